"""Weight-only int4 of an exported graph with onnxruntime's own quantizer, and its parity measured honestly.

    MatMul(x, W^T) or MatMul(x, Transpose(W))  ──one weight at a time──►  MatMulNBits(x, W_Q4, scales[, zero points])
    W [in, out] (or [out, in]) in SOURCE.data      onnxruntime's node quantizer    (block 32 along `in`)

torch.onnx leaves every nn.Linear as Transpose(W) -> MatMul (and the fused graph's tied lm_head is
Transpose(E) -> MatMul); onnxruntime folds that at session start, but its quantizer only reads a MatMul whose
weight is an initializer, so such a weight is transposed as it is quantized. The attention's own MatMuls
(two activations) are left alone, as is the embedding Gather (a tied one is served by the lm_head's int4
blocks: `share_tied_embedding`).

int4 cannot meet fp32 tolerances (a 4-bit weight is off by up to half a step, ~3-6% of a block's range), so
its parity is measured, not passed against them: top-1 agreement over a greedy decode and the KL divergence
and perplexity change of the next-token distributions on a fixed token sequence, judged against the
thresholds of `QuantThresholds` (see there for why those numbers).

(Over 500 lines on purpose: the quantizer, run one weight at a time, and the measurement of what it made are
one promise about the int4 graph; the quality target that chooses 8-bit matrices lives in int4_target.py.)
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from llama_tools.outputs import files

from . import int4_blocks, int4_scales
from .graph_io import MS_DOMAIN
from .quant_options import (ACCURACY_LEVEL, BLOCK_SIZE, DEFAULT_ALGORITHM, EIGHT_BIT_BLOCK, FAITHFUL_KL, HEAD,
                            HEAD_PARTS, INT4_ALGORITHMS, PROMPT_IDS, SEARCHED, frequent_rows, head_8bit)

@dataclass(frozen=True)
class QuantizeResult:
    """What quantize_int4 wrote."""

    source: Path
    path: Path
    bytes_before: int  # on disk, .onnx + .onnx.data
    bytes_after: int
    quantized: int  # MatMul -> MatMulNBits
    left_fp: list[str]  # MatMuls with a constant weight that were not quantized (excluded)
    folded_transposes: int
    block_size: int
    symmetric: bool
    accuracy_level: int
    seconds: float
    algorithm: str = DEFAULT_ALGORITHM
    kept_8bit: list[str] = field(default_factory=list)  # MatMuls quantized to 8 bits, not 4 (a --max-kl target)
    scaled: int = 0  # MatMuls whose inputs were rescaled first ("awq")

    @property
    def ratio(self) -> float:
        return self.bytes_after / self.bytes_before


def _disk_bytes(path: Path) -> int:
    data = path.parent / (path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def share_tied_embedding(model: Any) -> bool:
    """A tied embedding stored once, in int4: the lm_head's MatMulNBits blocks also serve the Gather.

    The full-precision table goes; the embedding becomes com.microsoft.GatherBlockQuantized over the very
    initializers MatMulNBits reads (onnxruntime-genai's builder shares them the same way):

        B_Q4 [n1, n2/block, block/2] uint8 ──────────────────────────► MatMulNBits (lm_head) ──► logits
           └──► GatherBlockQuantized(ids) [b, s, n2/block, block] ──Reshape [b, s, n2]──► Z^0
        scales [n1, n2/block] ──Reshape [n1, n2/block, 1]──┘ (one scale per block along the last axis)
        zero points [n1, ceil(blocks/2)] (two per byte) ──unpacked once──► [n1, n2/block, 1] (asymmetric only)

    MatMulNBits packs two blocks' zero points per byte; GatherBlockQuantized reads one per (row, block) here,
    so an asymmetric lm_head gets its zero points unpacked into a table of their own (1/16 of the int4 data).
    Float zero points (HQQ's) are not readable by GatherBlockQuantized: such a head is not shared.
    Returns whether a tied embedding was found (a Gather on E, and a MatMulNBits on E's transpose).

    A head split by rows (HEAD_FREQUENT kept 8-bit apart from the rest: _split_head) serves the Gather from both
    tables, each id from the one that holds its row:

        ids ──Min(r-1)──────► GatherBlockQuantized(frequent) ──┐
            ──Sub(r), Max(0)─► GatherBlockQuantized(rest)    ──┴─ Where(ids < r) ──► Z^0
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    heads = {n.input[1]: n for n in graph.node if n.op_type == "MatMulNBits"}
    for gather in [n for n in graph.node if n.op_type == "Gather"]:
        table = gather.input[0]
        parts = [next(((heads[table + f"_t{part}_Q{b}"], b) for b in (4, 8) if table + f"_t{part}_Q{b}" in heads),
                      None) for part in ("", "_frequent", "_rest")]  # the quantizer's names for table + "_t"
        if table not in inits or not (parts[0] or (parts[1] and parts[2])):
            continue
        n1, n2 = inits[table].dims
        p = gather.name.rsplit("/", 1)[0]
        if any(not _gatherable(h, n2, inits) for h, _ in filter(None, parts)):
            return False
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, n2], np.int64), f"{p}/row_shape"))
        made: list[Any] = []
        if parts[0]:
            made += _gather_rows(graph, inits, p, "", *parts[0], gather.input[1], gather.output[0])
        else:
            r = next(a.i for a in parts[1][0].attribute if a.name == "N")
            const = lambda name, v: helper.make_node(  # noqa: E731
                "Constant", [], [f"{p}/{name}"], name=f"{p}/{name}", value=numpy_helper.from_array(np.array(v, np.int64)))
            ids = gather.input[1]
            made += [const("r", r), const("r_minus_1", r - 1), const("zero", 0), const("last_axis", [-1]),
                     helper.make_node("Less", [ids, f"{p}/r"], [f"{p}/is_frequent"], name=f"{p}/Less"),
                     helper.make_node("Min", [ids, f"{p}/r_minus_1"], [f"{p}/frequent_ids"], name=f"{p}/Min"),
                     helper.make_node("Sub", [ids, f"{p}/r"], [f"{p}/rest_ids_signed"], name=f"{p}/Sub"),
                     helper.make_node("Max", [f"{p}/rest_ids_signed", f"{p}/zero"], [f"{p}/rest_ids"], name=f"{p}/Max"),
                     helper.make_node("Unsqueeze", [f"{p}/is_frequent", f"{p}/last_axis"], [f"{p}/pick"],
                                      name=f"{p}/Unsqueeze")]  # [b, s] -> [b, s, 1]
            made += _gather_rows(graph, inits, p, "_frequent", *parts[1], f"{p}/frequent_ids", f"{p}/frequent_rows")
            made += _gather_rows(graph, inits, p, "_rest", *parts[2], f"{p}/rest_ids", f"{p}/rest_rows")
            made.append(helper.make_node("Where", [f"{p}/pick", f"{p}/frequent_rows", f"{p}/rest_rows"],
                                         [gather.output[0]], name=f"{p}/Where"))
        at = list(graph.node).index(gather)
        graph.node.remove(gather)
        for k, node in enumerate(made):
            graph.node.insert(at + k, node)
        if not any(table in n.input for n in graph.node):
            graph.initializer.remove(inits[table])
        return True
    return False


def _gatherable(head: Any, n2: int, inits: dict[str, Any]) -> bool:
    """GatherBlockQuantized can read this MatMulNBits' blocks as whole rows of n2: uint8 zero points or none (not
    HQQ's floats), and blocks that tile n2 (a padded last block would make the row longer)."""
    import onnx

    zp = inits.get(head.input[3]) if len(head.input) > 3 and head.input[3] else None
    block_size = next(a.i for a in head.attribute if a.name == "block_size")  # an 8-bit head's may differ
    return n2 % block_size == 0 and (zp is None or zp.data_type == onnx.TensorProto.UINT8)


def _gather_rows(graph: Any, inits: dict[str, Any], p: str, part: str, head: Any, bits: int, ids: str,
                 out: str) -> list[Any]:
    """GatherBlockQuantized of `ids` over HEAD's blocks -> OUT [b, s, n2] (its initializers added to GRAPH)."""
    from onnx import helper, numpy_helper

    n1 = next(a.i for a in head.attribute if a.name == "N")
    block_size = next(a.i for a in head.attribute if a.name == "block_size")
    blocks = next(a.i for a in head.attribute if a.name == "K") // block_size
    graph.initializer.append(numpy_helper.from_array(np.array([n1, blocks, 1], np.int64), f"{p}/scales_shape{part}"))
    nodes = [helper.make_node("Reshape", [head.input[2], f"{p}/scales_shape{part}"], [f"{p}/scales_3d{part}"],
                              name=f"{p}/Reshape_scales{part}")]  # [n1, n2/block] -> [n1, n2/block, 1]
    gathered = [head.input[1], ids, f"{p}/scales_3d{part}"]
    zp = inits.get(head.input[3]) if len(head.input) > 3 and head.input[3] else None
    if zp is not None:  # [n1, ceil(blocks/2)], block b in nibble b % 2 of byte b // 2 -> [n1, blocks, 1]
        assert bits == 4, "an 8-bit head is symmetric: it has no zero points"
        packed = numpy_helper.to_array(zp).reshape(n1, -1)
        unpacked = np.stack([(packed[:, b // 2] >> (4 * (b % 2))) & 0xF for b in range(blocks)], 1)
        graph.initializer.append(numpy_helper.from_array(unpacked.astype(np.uint8)[:, :, None],
                                                         f"{p}/zero_points_3d{part}"))
        gathered.append(f"{p}/zero_points_3d{part}")
    nodes.append(helper.make_node("GatherBlockQuantized", gathered, [f"{p}/blocks{part}"],
                                  name=f"{p}/GatherBlockQuantized{part}", domain=MS_DOMAIN, gather_axis=0,
                                  quantize_axis=2, block_size=block_size, bits=bits))  # [b, s, n2/block, block]
    nodes.append(helper.make_node("Reshape", [f"{p}/blocks{part}", f"{p}/row_shape"], [out],
                                  name=f"{p}/Reshape_rows{part}"))  # [b, s, n2/block, block] -> [b, s, n2]
    return nodes


def eight_bit_block(k: int, tied: bool, block_size: int) -> int:
    """The blocks of a matrix kept 8-bit: the largest power of two up to EIGHT_BIT_BLOCK that tiles K exactly (no
    padded bytes), else EIGHT_BIT_BLOCK, or block_size for a tied head (the embedding's Gather reads whole rows)."""
    fits = [b for b in (EIGHT_BIT_BLOCK >> i for i in range(4)) if b >= 16 and k % b == 0]
    return fits[0] if fits else block_size if tied else EIGHT_BIT_BLOCK


def _weights_of(model: Any) -> dict[str, tuple[str, bool]]:
    """MatMul node name -> (its 2-D constant weight, whether through a Transpose): what will be quantized.

    torch.onnx leaves nn.Linear as MatMul(x, Transpose(W)) and the fused graph's tied lm_head is
    MatMul(x, Transpose(E)); the quantizer only reads a MatMul whose weight is an initializer, so those
    weights are transposed as they are quantized (W^T [in, out], named W + "_t").
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    transposed = {}
    for n in graph.node:
        perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
        if (n.op_type == "Transpose" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2
                and perm in (None, [1, 0])):
            transposed[n.output[0]] = n.input[0]
    out = {}
    for n in graph.node:
        if n.op_type != "MatMul":
            continue
        if n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            out[n.name] = (n.input[1], False)
        elif n.input[1] in transposed:
            out[n.name] = (transposed[n.input[1]], True)
    return out


# RTN quantizes each output column's blocks on their own, so a big matrix goes through the quantizer this many
# bytes of columns at a time (a 32000 x 4096 lm_head would otherwise be held three times over in fp32).
CHUNK_BYTES = 32 * 2**20


def _columns(tensor: Any, base: Path, transposed: bool) -> tuple[int, int, Callable[[int, int], np.ndarray]]:
    """(in, out, cols(a, b)) of a MatMul weight: cols gives W^T[:, a:b], an [in, b - a] array, read from the
    external data file with positioned reads of just those bytes (a memory map would fault in the whole matrix
    around a column slice, all counted as ours). W stored [out, in] gives the transposed view of its rows a..b,
    not a copy: the block search wants those rows, and takes them back as they were read."""
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    dims = [int(d) for d in tensor.dims]
    k, n = (dims[1], dims[0]) if transposed else (dims[0], dims[1])  # stored [out, in] behind a Transpose
    if not uses_external_data(tensor):
        inside = numpy_helper.to_array(tensor)  # inside the proto: small
        return k, n, lambda a, b: np.ascontiguousarray(inside[a:b].T if transposed else inside[:, a:b])
    info = {e.key: e.value for e in tensor.external_data}
    location, start = info["location"], int(info.get("offset", 0))
    if Path(location).name != location:  # a name beside the graph, never a path that leaves its directory
        raise ValueError(f"{base}: tensor {tensor.name!r} points at {location!r}, not a file beside the graph")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    row = dims[1] * dtype.itemsize  # bytes of one stored row

    def cols(a: int, b: int) -> np.ndarray:
        fd = os.open(base / location, os.O_RDONLY)
        try:
            if transposed:  # W [out, in]: rows a..b are one contiguous run
                w = np.empty((b - a, dims[1]), dtype)
                _pread_into(fd, w, start + a * row)
                return w.T  # [in, b - a], a view
            out = np.empty((k, b - a), dtype)  # W^T [in, out]: (b - a) values from each of the k rows
            width = (b - a) * dtype.itemsize
            for r in range(k):
                out[r] = np.frombuffer(_pread(fd, width, start + r * row + a * dtype.itemsize), dtype)
            return out
        finally:
            os.close(fd)
    return k, n, cols


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """OUT's bytes read from fd at offset, straight into it (no bytes object in between)."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"external data ends before a tensor does ({len(view) - done:,} bytes missing)")
        done += got


def _pread(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"external data ends before a tensor does ({size - len(data):,} bytes missing)")
    return data


class _Spill:
    """The int4 graph's large tensors (codes, scales) appended to a scratch file as each matrix is made, the graph
    holding references to it: the quantized weights are never all in memory, nor one matrix's joined twice
    (Gemma 3's 8-bit head alone is 168 MB). Pieces joined along axis 0 are written one after another: the bytes
    np.concatenate would make."""

    NAME = "int4-weights.data"
    MIN_BYTES = 1 << 20  # smaller ones (a toy model's) and zero points (1/64 byte a weight) stay inside the graph

    def __init__(self, directory: Path):
        self.path = directory / self.NAME
        self.file = open(self.path, "wb")
        self.offset = 0

    def tensor(self, name: str, pieces: list[np.ndarray]) -> Any:
        """A TensorProto of the pieces joined along axis 0: inside when small, else written here and referenced."""
        import onnx
        from onnx import helper, numpy_helper

        dims = [sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]]
        nbytes = sum(p.nbytes for p in pieces)
        if nbytes < self.MIN_BYTES or name.endswith("_zero_points"):  # share_tied_embedding unpacks zero points
            return numpy_helper.from_array(pieces[0] if len(pieces) == 1 else np.concatenate(pieces), name)
        start = self.offset
        for p in pieces:
            assert p.shape[1:] == pieces[0].shape[1:] and p.dtype == pieces[0].dtype, f"{name}: pieces differ"
            data = np.ascontiguousarray(p, dtype=p.dtype.newbyteorder("<"))  # ONNX stores little-endian
            self.file.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        t = onnx.TensorProto(name=name, dims=dims, data_type=helper.np_dtype_to_tensor_dtype(pieces[0].dtype))
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.NAME), ("offset", str(start)), ("length", str(nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def close(self) -> None:
        self.file.close()


def _quantize_matmul(quantizer: Any, node: Any, name: str, k: int, n: int,
                     cols: Callable[[int, int], np.ndarray], chunked: bool,
                     spill: _Spill | None = None) -> tuple[list[Any], list[Any]]:
    """onnxruntime's node quantizer on MatMul(x, W^T) -> (its nodes, its initializers), W^T [k, n] handed over
    CHUNK_BYTES of columns at a time when `chunked` and the pieces joined along the output axis: Q4 [n, blocks,
    blob], scales [n, blocks] and zero points [n, ...] are per column, so the join is what one call would give."""
    from onnx import helper, numpy_helper

    step = max(1, CHUNK_BYTES // (4 * k)) if chunked else n
    pieces: list[dict[str, np.ndarray]] = []
    for a in range(0, n, step):
        one = helper.make_graph([], "one MatMul", [], [], initializer=[numpy_helper.from_array(cols(a, min(a + step, n)),
                                                                                               name)])
        matmul = helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name)
        with warnings.catch_warnings():  # HQQ's torch.from_numpy of a read-only array: its own affair
            warnings.simplefilter("ignore", UserWarning)
            nodes = quantizer.quantize(matmul, [one])
        made = [t for t in one.initializer if t.name != name]
        if step == n and spill is None:
            return nodes, made
        pieces.append({t.name: numpy_helper.to_array(t) for t in made})
        del one, made
    for q in (q for q in nodes if q.op_type == "MatMulNBits"):
        for attr in q.attribute:
            if attr.name == "N":
                attr.i = n  # the last piece's width -> the whole matrix's
    if spill is not None:
        return nodes, [spill.tensor(key, [p[key] for p in pieces]) for key in pieces[0]]
    joined = [numpy_helper.from_array(np.concatenate([p[key] for p in pieces], axis=0), key) for key in pieces[0]]
    return nodes, joined


def _node_quantizer(algorithm: str, block_size: int, symmetric: bool, accuracy_level: int, bits: int = 4) -> Any:
    """onnxruntime's per-MatMul quantizer (what its MatMulNBitsQuantizer runs on each node)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    if algorithm == "hqq":  # its zero points are floats: no symmetric form
        return mnq.HQQWeightOnlyQuantizer(mnq.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits))
    return mnq.DefaultWeightOnlyQuantizer(mnq.DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits))


def quantize_int4(source: str | Path, output: str | Path, *, block_size: int = BLOCK_SIZE,
                  symmetric: bool = True, accuracy_level: int = ACCURACY_LEVEL,
                  exclude: tuple[str, ...] = (), algorithm: str = DEFAULT_ALGORITHM,
                  keep_8bit: tuple[str, ...] = (), importance: dict[str, Any] | None = None,
                  scales: Any = None, store: Any = None) -> QuantizeResult:
    """SOURCE .onnx (plain or fused) -> OUTPUT with every constant-weight MatMul as int4 MatMulNBits, atomically.

    symmetric (rtn only; default True): int4 in [-8, 7] times one scale per block of 32 weights, no zero point.
    For round to nearest a zero point buys little on LLaMA's centred weights (measured: see
    benchmarks/bench_fused.py); imatrix's searched zero points do (docs/export.md), at 1/64 byte per weight and no
    measurable kernel time.
    exclude: node names to keep in full precision (e.g. "/lm_head/MatMul"). algorithm: "rtn", "hqq" (always with
    zero points) or "imatrix" (int4_blocks: ours, always with zero points; importance: node name -> the mean square of
    its input per column on calibration text, uniform where absent). keep_8bit: node names quantized to 8 bits
    (symmetric RTN in blocks of EIGHT_BIT_BLOCK, eight_bit_block) instead; HEAD_FREQUENT or HEAD_REST alone keeps
    only the lm_head's first frequent_rows(n1) rows or its others 8-bit (the head split in two, _split_head). "awq": imatrix on inputs rescaled by
    int4_scales (`scales`, an int4_scales.Scales; planned here from `importance` when None), the norms' gains and
    up_proj's rows divided to match. store: an int4_blocks.BlockStore holding (or to hold) the searched int4 blocks
    of this very source, importance and scales, so that the next graph built from them searches none again.

    In bounded memory: the graph is read without its weights; each MatMul's weight is read from SOURCE's
    .data file, quantized by onnxruntime's own node quantizer on a one-node graph and dropped, so one
    full-precision matrix and the int4 ones are held at a time; what stays in full precision streams from
    SOURCE's file to OUTPUT's as it is written (onnx_save).

        MatMul(x, W) or MatMul(x, Transpose(W)):  W ──read──► W^T [in, out] ──node quantizer──►
                                                  MatMulNBits(x, W_Q4, W_scales[, W_zero_points])
    """
    import onnx
    from onnx import helper

    t0 = time.perf_counter()
    source, output = Path(source), Path(output)
    if not source.is_file():
        raise ValueError(f"{source}: no such ONNX file; export it first (llama-tools export onnx)")
    if output.resolve() == source.resolve():
        raise ValueError(f"{output}: is the source graph; write the int4 graph to another file")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (MatMulNBits), got {block_size}")
    if algorithm not in INT4_ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r}: choose one of {', '.join(INT4_ALGORITHMS)}")
    symmetric = symmetric and algorithm == "rtn"
    try:
        model = onnx.load(str(source), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends  # noqa: BLE001
        raise ValueError(f"{source}: not an ONNX model ({type(e).__name__})") from None
    graph, base = model.graph, source.parent
    weights = _weights_of(model)
    candidates = list(weights)
    unknown = [n for n in exclude if n not in candidates]
    if unknown:
        raise ValueError(f"--int4-keep {unknown[0]!r} is not a MatMul with a constant weight in the graph; "
                         f"choose among {', '.join(candidates[:4])}, ..., {candidates[-1]}")
    parts = candidates + (list(HEAD_PARTS) if HEAD in candidates else [])  # the head's rows in two parts
    unknown = [n for n in keep_8bit if n not in parts or n.split(":")[0] in exclude]
    if unknown:
        raise ValueError(f"8-bit {unknown[0]!r} is not a MatMul with a constant weight that is quantized")
    if not [n for n in candidates if n not in exclude]:
        raise ValueError(f"{source}: no MatMul with a constant 2-D weight to quantize to int4 "
                         f"(already quantized, or every one excluded)")
    searched = algorithm in SEARCHED
    quantizer = None if searched else _node_quantizer(algorithm, block_size, symmetric, accuracy_level)
    if algorithm == int4_scales.ALGORITHM and scales is None and importance:
        scales = plan_scales(model, importance, block_size, exclude, base=source.parent)
    scales = scales if algorithm == int4_scales.ALGORITHM else None
    # A tied lm_head (MatMul on the Gather's table, transposed) serves the embedding too (share_tied_embedding),
    # which GatherBlockQuantized can only read without a zero point: with HQQ it is quantized symmetric RTN.
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    tied_rtn = _node_quantizer("rtn", block_size, True, accuracy_level) if algorithm == "hqq" else None
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    inits = {t.name: t for t in graph.initializer}
    with files.scratch_dir(source) as scratch:  # the int4 tensors as they are made (_Spill), gone at the end
        spill = _Spill(scratch)
        try:
            folded = _quantize_nodes(graph, base, weights, inits, exclude, keep_8bit, gathered, quantizer, tied_rtn,
                                     importance, block_size, accuracy_level, algorithm, spill, scales, store)
        finally:
            spill.close()
        quantized = sum(n.op_type == "MatMulNBits" for n in graph.node)
        split = HEAD in candidates and HEAD not in exclude and len(set(head_8bit(keep_8bit))) == 2
        assert quantized == len(candidates) - len(exclude) + split, (
            f"{quantized} MatMulNBits for {len(candidates) - len(exclude)} quantizable MatMuls")
        if scales is not None:
            int4_scales.apply_gains(graph, base, scales)
        share_tied_embedding(model)  # a tied lm_head with no zero point or uint8 ones (not HQQ's floats)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        _save_streamed(model, {"": base, _Spill.NAME: scratch}, output)
    return QuantizeResult(source=source, path=output, bytes_before=_disk_bytes(source), bytes_after=_disk_bytes(output),
                          quantized=quantized, left_fp=list(exclude), folded_transposes=folded,
                          block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level,
                          seconds=time.perf_counter() - t0, algorithm=algorithm, kept_8bit=list(keep_8bit),
                          scaled=len(scales.inputs) if scales is not None else 0)


def plan_scales(model: Any, importance: dict[str, Any], block_size: int = BLOCK_SIZE, exclude: tuple[str, ...] = (),
                progress: Any = None, base: Path | None = None) -> Any:
    """int4_scales.plan on MODEL: the path of an .onnx, or its ModelProto read without its weights (in BASE)."""
    import onnx

    if not hasattr(model, "graph"):
        base, model = Path(model).parent, onnx.load(str(model), load_external_data=False)
    assert base is not None, "a ModelProto's weights need their directory"
    weights = _weights_of(model)
    inits = {t.name: t for t in model.graph.initializer}

    def read(node: str) -> tuple[int, int, Any]:
        return _columns(inits[weights[node][0]], base, weights[node][1])
    return int4_scales.plan(model.graph, weights, read, importance, block_size, exclude,
                            **({"progress": progress} if progress else {}))


def _quantize_nodes(graph: Any, base: Path, weights: dict[str, Any], inits: dict[str, Any], exclude: tuple[str, ...],
                    keep_8bit: tuple[str, ...], gathered: set[str], quantizer: Any, tied_rtn: Any,
                    importance: dict[str, Any] | None, block_size: int, accuracy_level: int, algorithm: str,
                    spill: _Spill, scales: Any = None, store: Any = None) -> int:
    """Each quantized MatMul replaced in GRAPH by its MatMulNBits (tensors through SPILL); the Transposes folded."""
    nodes, folded = [], 0
    for node in graph.node:
        if node.name not in weights or node.name in exclude:
            nodes.append(node)
            continue
        name, through_transpose = weights[node.name]
        k, n, cols = _columns(inits[name], base, through_transpose)
        a = (importance or {}).get(node.name)
        if scales is not None:  # the graph's W^T rows times s (its inputs over s), outputs over theirs
            cols, a = scales.columns(node.name, cols), scales.importance(node.name, a)
        if through_transpose:
            name, folded = name + "_t", folded + 1  # the quantizer names its tensors after this: W_t_Q4, ...
        tied = through_transpose and weights[node.name][0] in gathered

        stored = None if store is None or quantizer is not None else \
            stored_rows(store, node.name, k, n, cols, a, block_size)

        def one(part: Any, tensor: str, n: int, cols: Callable[[int, int], np.ndarray], eight: bool,
                offset: int = 0) -> tuple:
            if eight:
                eight_q = _node_quantizer("rtn", eight_bit_block(k, tied, block_size), True, accuracy_level, bits=8)
                return _quantize_matmul(eight_q, part, tensor, k, n, cols, chunked=True, spill=spill)
            if tied_rtn is not None and tied:
                return _quantize_matmul(tied_rtn, part, tensor, k, n, cols, chunked=True, spill=spill)
            if quantizer is None:
                packed = None if stored is None else (lambda i, j: stored(offset + i, offset + j))
                return int4_blocks.matmul_nbits(part, tensor, k, n, cols, a, block=block_size, bits=4,
                                                accuracy_level=accuracy_level, chunk_bytes=CHUNK_BYTES, spill=spill,
                                                packed_rows=packed)
            return _quantize_matmul(quantizer, part, tensor, k, n, cols, chunked=algorithm == "rtn", spill=spill)
        frequent_8bit, rest_8bit = head_8bit(keep_8bit)
        if node.name == HEAD and frequent_8bit != rest_8bit:
            made_nodes, made = _split_head(node, name, n, cols, one, frequent_8bit, rest_8bit)
        else:
            made_nodes, made = one(node, name, n, cols, node.name in keep_8bit or
                                   (node.name == HEAD and frequent_8bit and rest_8bit))
        nodes += made_nodes
        graph.initializer.extend(made)
    graph.ClearField("node")
    graph.node.extend(nodes)
    _drop_unused(graph)  # the weights now quantized, and the Transposes that fed them
    return folded


def stored_rows(store: Any, node: str, k: int, n: int, cols: Callable[[int, int], np.ndarray], importance: Any,
                block: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    """rows(a, b) -> the packed int4 blocks of rows a..b-1 of NODE's W [n, k] (cols: W^T's columns, as the graph
    holds them), from STORE, searched there a chunk at a time on a miss."""
    step = max(1, CHUNK_BYTES // (4 * k))

    def search_chunk(a: int, b: int) -> dict[str, np.ndarray]:
        w = cols(a, min(b, n))  # [k, rows]
        return int4_blocks.pack(int4_blocks.search(np.ascontiguousarray(w.T, dtype=np.float32), importance, bits=4,
                                                   block=block))
    return lambda a, b: store.rows(node, a, b, step, search_chunk)


def _split_head(node: Any, name: str, n: int, cols: Callable[[int, int], np.ndarray], one: Callable[..., tuple],
                frequent_8bit: bool, rest_8bit: bool) -> tuple[list[Any], list[Any]]:
    """The lm_head as two MatMulNBits, its first frequent_rows(n1) vocabulary rows and the rest, each 8-bit or int4:

        x ──► MatMulNBits (rows 0..r-1,  W_t_frequent_Q{8|4}) ──► logits[..., :r] ──┐
          └─► MatMulNBits (rows r..n1-1, W_t_rest_Q{8|4})     ──► logits[..., r:] ──┴─ Concat(-1) ──► logits
    """
    from onnx import helper

    r = frequent_rows(n)
    made_nodes, made = [], []
    for part, a, b, eight in (("frequent", 0, r, frequent_8bit), ("rest", r, n, rest_8bit)):
        half = helper.make_node("MatMul", list(node.input), [f"{node.output[0]}_{part}"], name=f"{node.name}_{part}")
        ns, ts = one(half, f"{name}_{part}", b - a, lambda i, j, a=a: cols(a + i, a + j), eight, a)
        made_nodes += ns
        made += ts
    made_nodes.append(helper.make_node("Concat", [f"{node.output[0]}_frequent", f"{node.output[0]}_rest"],
                                       list(node.output), name=node.name.rsplit("/", 1)[0] + "/Concat", axis=-1))
    return made_nodes, made


def _drop_unused(graph: Any) -> None:
    """Nodes whose outputs nothing reads (a Transpose whose MatMul was quantized), then unread initializers."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input} | outputs
    for t in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(t)  # in place: extending a cleared field would copy every int4 tensor once more


def _save_streamed(model: Any, bases: dict[str, Path], output: Path) -> None:
    """OUTPUT atomically: one self-contained file up to onnx_save's single-file size, else OUTPUT + OUTPUT.data
    with the weights copied a tensor at a time from the files the graph refers to (SOURCE's, in full precision, and
    the spilled int4 ones). bases: a referenced file's name -> its directory ("": any other, SOURCE's)."""
    import onnx_ir as ir
    from onnx.external_data_helper import uses_external_data

    from llama_tools.outputs.progress import silent

    from .onnx_export import save_model
    from .onnx_save import SINGLE_FILE_MAX_BYTES

    def nbytes(t: Any) -> int:
        info = {e.key: e.value for e in t.external_data}
        return int(info.get("length", 0)) if uses_external_data(t) else len(t.raw_data) or t.ByteSize()
    if sum(nbytes(t) for t in model.graph.initializer) > SINGLE_FILE_MAX_BYTES:
        ir_model = ir.serde.deserialize_model(model)
        for v in ir_model.graph.initializers.values():  # each file's tensors copied from it as they are written
            t = v.const_value
            if isinstance(t, ir.ExternalTensor):
                t.base_dir = bases.get(t.location, bases[""])
        save_model(ir_model, output, SINGLE_FILE_MAX_BYTES, False, silent)
        return
    for i, t in enumerate(model.graph.initializer):  # small: what is left in the files comes inside
        if uses_external_data(t):
            where = bases.get({e.key: e.value for e in t.external_data}["location"], bases[""])
            inside = ir.Tensor(ir.serde.deserialize_tensor(t, where).numpy(), name=t.name)  # bf16 too (ml_dtypes)
            model.graph.initializer[i].CopyFrom(ir.serde.serialize_tensor(inside))
    with files.atomic_files([output.parent / (output.name + ".data"), output]) as tmp:
        (tmp / output.name).write_bytes(model.SerializeToString())  # one copy of the bytes (onnx.save makes more)
    (output.parent / (output.name + ".data")).unlink(missing_ok=True)  # a previous run's weights, now stale


# --- Parity, measured --------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantThresholds:
    """What int4 must reach to be called faithful to fp32; not fp32 tolerances.

    Measured (symmetric int4, block 32, tiny seeded LLaMA with its final norm scaled 1x..20x so that the
    fp32 perplexity of its own greedy text spans 343..13; tests/test_genai.py keeps the 10x case):
      good int4:                 top-1 75-83%, mean KL 0.0001-0.048 nats, perplexity change -0.9%..+5.0%
      one layer's down_proj rows shuffled, then int4:  top-1 52-65%, and at perplexity <= 29 also
                                 mean KL >= 0.068 and perplexity change >= +18%
    Random weights give near-uniform choices (many top-1 near-ties), hence a top-1 floor of 70% and not
    the 90%+ a trained model shows; KL and perplexity catch a broken graph once the model is decisive.
    A seeded 125M LLaMA (benchmarks/bench_fused.py) fails them: top-1 34%, KL 0.018 nats, and 1.2 nats once
    its logits are made decisive. onnxruntime-genai's builder int4 of the same weights does exactly as badly
    (KL against its own fp32 graph 0.0207 vs ours 0.0208): random 768-wide weights, not this quantizer.
    """

    min_top1: float = 0.70  # teacher-forced greedy decode: steps whose argmax equals fp32's
    max_mean_kl: float = FAITHFUL_KL  # nats per token on the fixed sequence
    max_ppl_change: float = 0.10  # |ppl_int4 / ppl_fp32 - 1| on the fixed sequence


@dataclass(frozen=True)
class QuantParity:
    """int4 graph vs the fp32 PyTorch model; `faithful` is the verdict against `thresholds`, nothing more."""

    onnx_path: str
    steps: int
    top1_agreement: float  # teacher-forced: both fed fp32's greedy tokens, argmax compared at each step
    free_run_same: int  # the int4 graph's own greedy tokens equal fp32's for this many steps
    reference_ids: list[int]
    int4_ids: list[int]
    sequence_length: int  # of the fixed token sequence
    mean_kl: float  # KL(p_fp32 || p_int4) in nats, mean over positions
    max_kl: float
    ppl_reference: float
    ppl_int4: float
    ppl_change_se: float  # the standard error of ppl_change from its tokens' spread: what the text's length buys
    max_abs_logit_error: float  # for scale only: no fp32 bound applies
    thresholds: QuantThresholds
    failures: list[str] = field(default_factory=list)
    on: str = ""  # what the fixed sequence is: a text's name, or the prompt and fp32's continuation
    provider: str = "cpu"  # what ran the int4 graph: "cpu" or "cuda"
    provider_note: str = ""  # one line: which provider ran and why

    @property
    def ppl_change(self) -> float:
        return self.ppl_int4 / self.ppl_reference - 1.0

    @property
    def faithful(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_change": self.ppl_change, "faithful": self.faithful}


def _kl_row(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) in nats of one position's logits [n1], in float64."""
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_and_ppl(ref_logits: np.ndarray, got_logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Per-position KL(ref || got) [seq - 1], and each side's perplexity of ids[1:] given ids[:-1].

    ref_logits, got_logits: [seq, vocab]; ids: [seq]. Position t predicts ids[t + 1].
    """
    kl, nll_r, nll_g = kl_and_nll(ref_logits, got_logits, ids)
    return kl, float(np.exp(nll_r.mean())), float(np.exp(nll_g.mean()))


def kl_and_nll(ref_logits: np.ndarray, got_logits: np.ndarray, ids: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position KL(ref || got), and each side's negative log-likelihood of ids[t + 1], all [seq - 1]."""
    lr, lg = _log_softmax(ref_logits[:-1]), _log_softmax(got_logits[:-1])  # [seq - 1, vocab]
    kl = (np.exp(lr) * (lr - lg)).sum(-1)
    nxt = ids[1:]
    return kl, -lr[np.arange(len(nxt)), nxt], -lg[np.arange(len(nxt)), nxt]


def ppl_change_se(nll_ref: np.ndarray, nll_got: np.ndarray) -> float:
    """The standard error of ppl_got / ppl_ref - 1 from the per-token log-likelihood changes (delta method)."""
    d = nll_got - nll_ref  # [n]: the change's log is their mean
    if len(d) < 2:
        return float("nan")
    return float(np.exp(d.mean()) * d.std(ddof=1) / math.sqrt(len(d)))


def measure_quant_parity(onnx_path: str | Path, reference: Any = None, *, prompt: list[int] | None = None,
                         sequence: list[int] | None = None, steps: int = 32,
                         thresholds: QuantThresholds = QuantThresholds(), on: str | None = None,
                         provider: str = "cpu") -> QuantParity:
    """The int4 graph against the fp32 PyTorch model (the graph's source, or `reference`, a Llama).

    prompt: where the greedy decode starts (default: 8 seeded ids). sequence: the fixed token sequence for KL
    and perplexity (default: the prompt followed by fp32's own greedy continuation of `steps` tokens, i.e. a
    text the reference model finds likely, so perplexity means something even for random weights).
    provider: where onnxruntime runs the int4 graph (runtime.create_session's "auto", "cpu" or "cuda").
    """
    import torch

    from llama_tools.checkpoints.loading import load_model
    from llama_tools.modeling.model import Llama

    from .graph_meta import read_metadata
    from .prompts import positions
    from .runtime import OnnxLM, create_session

    from .foreign import check_matches, describe_graph, foreign_lm
    from .verification.parity import has_our_metadata

    onnx_path = Path(onnx_path)
    io = None
    if not has_our_metadata(onnx_path):  # another exporter's graph (the builder's int4): its I/O read from it
        io = describe_graph(onnx_path)
        if reference is None:
            raise ValueError(f"{onnx_path} was not written by llama-tools ({io.producer}); pass --source with the "
                             f"checkpoint it was exported from")
        if not isinstance(reference, Llama):
            reference = load_model(reference, dtype="float32")
        check_matches(io, reference.cfg, str(getattr(reference.cfg, "name", "--source")))
        meta = None
        cfg = reference.cfg
    else:
        meta = read_metadata(onnx_path)
        cfg = meta.config
    rng = np.random.default_rng(0)
    prompt = list(prompt) if prompt else rng.integers(3, cfg.vocab_size, size=PROMPT_IDS).tolist()
    longest = max(len(prompt) + steps, len(sequence) if sequence else 0)
    if meta is not None and meta.static_kv is not None and longest > meta.static_kv:
        raise ValueError(f"{onnx_path}: its static KV buffer holds {meta.static_kv} positions, but the prompt and "
                         f"{steps} steps need {longest}; use fewer steps, or export with a larger --static-kv")
    if reference is None:
        assert meta is not None, "a foreign graph's reference is given (checked above)"
        if meta.seed is None and not Path(meta.source).is_dir():
            raise ValueError(f"{onnx_path}: exported from weights no seed reproduces; pass the fp32 model as reference")
        reference = load_model(meta.source, dtype="float32", seed=meta.seed or 0)
    if not isinstance(reference, Llama):
        reference = load_model(reference, dtype="float32", seed=meta.seed if meta is not None and meta.seed else 0)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    session = create_session(onnx_path, provider)
    lm = (foreign_lm(session, io, cfg) if io is not None
          else OnnxLM(session, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim))
    reference = reference.float().eval()

    def onnx_step(ids: list[int], past: Any, total: int) -> Any:
        arr = np.array([ids], np.int64)  # [1, n]
        mask = np.ones((1, total), np.int64)  # [1, past + n]
        return lm(arr, mask, positions(mask, len(ids)), past)

    # Greedy decode, teacher-forced: both fed fp32's tokens; and the int4 graph's own free-running greedy.
    with torch.no_grad():
        out = reference(torch.tensor([prompt]))
        ref_ids, past = [], out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            ref_ids.append(nxt)
            out = reference(torch.tensor([[nxt]]), past_key_values=past)
            past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    got = onnx_step(prompt, lm.empty_cache(1), len(prompt))
    agree, total = 0, len(prompt)
    for tok in ref_ids:
        agree += int(got.logits[0, -1].argmax() == tok)
        total += 1
        got = onnx_step([tok], got.cache, total)
    own = onnx_step(prompt, lm.empty_cache(1), len(prompt))
    int4_ids, total = [], len(prompt)
    for _ in range(steps):
        int4_ids.append(int(own.logits[0, -1].argmax()))
        total += 1
        own = onnx_step([int4_ids[-1]], own.cache, total)
    same = next((i for i, (a, b) in enumerate(zip(ref_ids, int4_ids)) if a != b), steps)

    # The fixed sequence in one prefill: KL per position and perplexity.
    seq = list(sequence) if sequence else prompt + ref_ids
    if len(seq) < 2 or any(not 0 <= t < cfg.vocab_size for t in seq):
        raise ValueError(f"sequence needs >= 2 ids in 0..{cfg.vocab_size - 1}")
    g = onnx_step(seq, lm.empty_cache(1), len(seq)).logits[0]  # [seq, vocab]
    with torch.no_grad():
        r = reference(torch.tensor([seq])).logits[0].numpy()
    kl, nll_r, nll_g = kl_and_nll(r, g, np.array(seq))
    ppl_r, ppl_g, se = float(np.exp(nll_r.mean())), float(np.exp(nll_g.mean())), ppl_change_se(nll_r, nll_g)

    top1 = agree / steps
    failures = []
    if top1 < thresholds.min_top1:
        failures.append(f"top-1 agreement {top1:.1%} < {thresholds.min_top1:.0%}")
    if float(kl.mean()) > thresholds.max_mean_kl:
        failures.append(f"mean KL {kl.mean():.4f} nats > {thresholds.max_mean_kl}")
    if abs(ppl_g / ppl_r - 1) > thresholds.max_ppl_change:
        failures.append(f"perplexity change {ppl_g / ppl_r - 1:+.1%} beyond ±{thresholds.max_ppl_change:.0%} "
                        f"(standard error {se:.1%} on {len(seq) - 1} predicted tokens)")
    if not np.isfinite(g).all():
        failures.append("NaN or Inf in the int4 logits")
    return QuantParity(
        onnx_path=str(onnx_path), steps=steps, top1_agreement=top1, free_run_same=same, reference_ids=ref_ids,
        int4_ids=int4_ids, sequence_length=len(seq), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        ppl_reference=ppl_r, ppl_int4=ppl_g, ppl_change_se=se, max_abs_logit_error=float(np.abs(g - r).max()),
        thresholds=thresholds, failures=failures,
        on=on or ("the given sequence" if sequence else "the prompt and fp32's greedy continuation"),
        provider=session.provider, provider_note=session.note)


# The warning is on KL alone: top-1 flips on near-ties (the seeded tiny model: KL 0.0002 nats yet top-1 87%), while a
# trained model that loses answers shows in KL (SmolLM2-135M int4: 0.47 nats on the built-in text, "Paris" lost).
QUALITY_WARN_KL = FAITHFUL_KL


@dataclass
class QuickQuality:
    """int4 graph vs the full-precision graph it came from, teacher-forced on one text: the export's quality line."""

    tokens: int
    on: str  # "built-in text" | "seeded ids (no tokenizer)" | a file name
    mean_kl: float  # KL(full || int4) in nats, mean over positions
    top1: float  # argmax agreement over positions

    @property
    def warning(self) -> str | None:
        if self.mean_kl <= QUALITY_WARN_KL:
            return None
        return f"mean KL {self.mean_kl:.3f} nats > {QUALITY_WARN_KL}, top-1 {self.top1:.1%}"


# Positions per onnxruntime call: the logits held are [c, n1] fp32 within PREFILL_BYTES (Gemma 3's 262,144 tokens:
# 8 positions), not [n, n1]; at most PREFILL_CHUNK, where a longer call gains little (SmolLM2-135M's int4 graph,
# 192 positions: 64 at a time took 0.8x the time of 16 at a time, 192 at once 0.72x). 8 MB rather than 16: Gemma 3
# 270M's int4 session peaked 35 MB lower over 192 positions (each logits copy inside the graph is smaller), 0.1 s
# slower.
PREFILL_BYTES = 8 * 2**20
PREFILL_CHUNK = 64


def prefill_chunk(vocab_size: int) -> int:
    """Positions per call for a vocabulary of vocab_size: within PREFILL_BYTES of fp32 logits, 1..PREFILL_CHUNK."""
    return max(1, min(PREFILL_CHUNK, PREFILL_BYTES // (4 * vocab_size)))


def onnx_chunks(path: str | Path, cfg: Any, ids: list[int]) -> Any:
    """The graph's logits on ids, prefill_chunk positions at a time through its own KV cache: [<= chunk, n1] fp32."""
    from .prompts import positions
    from .runtime import OnnxLM, create_session

    lm = OnnxLM(create_session(Path(path), "cpu"), cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cache = lm.empty_cache(1)
    step = prefill_chunk(cfg.vocab_size)
    for a in range(0, len(ids), step):
        part = np.array([ids[a:a + step]], np.int64)  # [1, c]
        mask = np.ones((1, a + part.shape[1]), np.int64)  # [1, past + c]
        out = lm(part, mask, positions(mask, part.shape[1]), cache)
        cache = out.cache
        yield np.asarray(out.logits, np.float32)[0]
    del lm


def spilled_rows(slabs: Iterable[Any], n: int, n1: int, where: str | Path) -> Callable[[int, int], np.ndarray]:
    """Logits [n, n1] given as column slabs [n, c] in vocabulary order (a head pass, one row chunk of W^8 per slab),
    written now into an unlinked scratch file in WHERE -> (a, b) -> the rows of positions a..b [b - a, n1] fp32.

    Logits too big to hold (Gemma's 262,144 tokens: 1 MB a position) are made before any onnxruntime session opens,
    one pass over W^8 holding one slab: a head pass beside an open session was seen to leave 0.4-0.9 GB of freed
    blocks resident in the heap. The file has no name (nothing is left behind after a kill) and lives in the page
    cache, not in the process's memory."""
    import tempfile

    f = tempfile.TemporaryFile(dir=where)
    fd, col = f.fileno(), 0
    for slab in slabs:
        x = np.ascontiguousarray(np.asarray(slab, np.float32))  # [n, c]
        assert x.shape[0] == n and col + x.shape[1] <= n1, f"a slab of {x.shape} at column {col} of [{n}, {n1}]"
        for t in range(n):  # position t's columns col..col + c
            _pwrite_all(fd, memoryview(x[t]).cast("B"), (t * n1 + col) * 4)
        col += x.shape[1]
    assert col == n1, f"the slabs hold {col} of {n1} columns"

    def read(a: int, b: int) -> np.ndarray:
        out = np.empty((b - a, n1), np.float32)
        _pread_into(fd, out, a * n1 * 4)
        return out
    read.file = f  # type: ignore[attr-defined]  # open (and on disk) as long as READ lives
    return read


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


QUALITY_TOKENS = 256  # the most positions quick_quality scores


def quick_quality(full: Any, int4: str | Path, cfg: Any, ids: list[int], on: str, zbar: Any = None) -> QuickQuality:
    """One prefill of `ids` through the full-precision side and the int4 graph on the CPU: mean KL and top-1.

    full: the full-precision graph's path, or the model itself (a `Llama`, or the streamed reference, which
    holds one decoder layer at a time: the export's own check needs no session over the whole fp32 graph).
    The full side runs first; the int4 graph then runs prefill_chunk positions at a time, each chunk scored as
    it comes. From the streamed reference only its final hidden state is kept, its logits spilled: for Gemma's
    262,144 tokens, 256 positions' logits would be 0.27 GB per side.
    zbar: the streamed reference's final hidden state on these ids, made before (its pass then runs before any
    of the export's int4 work). Its logits are made before the session opens, in one pass over W^8, into an
    unlinked scratch file beside the int4 graph (`spilled_rows`): a head pass beside the open session was seen to
    raise the export's peak by 0.45 GB, and Qwen2.5's 238 positions' logits held beside it (145 MB) by as much.
    """
    from .graph_meta import read_metadata
    from .prompts import positions

    static = read_metadata(int4).static_kv  # a static_kv graph holds that many positions
    ids = ids[: min(len(ids), QUALITY_TOKENS, static or QUALITY_TOKENS)]
    arr = np.array([ids], np.int64)  # [1, n]
    mask = np.ones_like(arr)
    pos = positions(mask, arr.shape[1])
    if isinstance(full, (str, Path)):
        p_logits = onnx_chunks(full, cfg, ids)
        whole = np.concatenate(list(p_logits))  # [n, n1]
        p_rows = lambda a, b: whole[a:b]  # noqa: E731
    else:  # a torch model: the same prefill
        import torch

        with torch.no_grad():
            if hasattr(full, "head"):  # the streamed reference: Zbar [n, n2] now, H a chunk at a time
                if zbar is None:
                    zbar = full(torch.from_numpy(arr), torch.from_numpy(mask), torch.from_numpy(pos),
                                hidden=True).logits[0]
                slabs = (x.float().numpy() for x in full.head_slabs(zbar))  # [n, rows] each
                p_rows = spilled_rows(slabs, zbar.shape[0], cfg.vocab_size, Path(int4).parent)
            else:
                whole = full(torch.from_numpy(arr), torch.from_numpy(mask),
                             torch.from_numpy(pos)).logits.float().numpy()[0]  # [n, n1]
                p_rows = lambda a, b: whole[a:b]  # noqa: E731
    from llama_tools.outputs.progress import release_freed_memory

    release_freed_memory()  # the streamed layers' pages are not the session's floor
    kl, agree, a = [], 0, 0
    for q in onnx_chunks(int4, cfg, ids):  # [c, n1]
        p = np.asarray(p_rows(a, a + len(q)), np.float32)
        kl += [_kl_row(x, y) for x, y in zip(p, q)]  # float64 one row at a time
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        a += len(q)
    return QuickQuality(tokens=arr.shape[1], on=on, mean_kl=float(np.mean(kl)), top1=agree / len(kl))
