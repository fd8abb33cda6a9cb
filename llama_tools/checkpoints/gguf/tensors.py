"""A GGUF's tensors: infos from the header (what count-params shows), and module-named fp32 weights dequantized
one tensor at a time by the gguf library (GgufReader, reference.CheckpointReader's interface)."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...modeling.config import ModelConfig
from ..formats import CheckpointFormat, checkpoint_tensors
from ..header_readers import FileExtent, TensorInfo
from ..weight_files import CheckpointHeaders, WeightFiles
from ...modeling.weights import stack_specs, weight_specs
from .architectures import ARCHITECTURES, KIND, MAX_PER_EXPERT, ROPE_TENSORS, gguf_format, per_expert_format
from .check import check_metadata
from .config import gguf_config
from .read import UnmodelledGguf, field_value, gguf_extent, open_gguf, refuse_partial


def tensor_infos(reader: Any, path: Path) -> list[TensorInfo]:
    """Every tensor's name, shape (rows first, as torch has it), GGML type and stored bytes."""
    return [TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name,
                       int(t.n_bytes), path.name) for t in reader.tensors]


def block_sizes(reader: Any) -> dict[str, tuple[int, int]]:
    """GGML type name -> (weights per block, bytes per block), as llama.cpp defines them."""
    from gguf import GGML_QUANT_SIZES

    return {t.tensor_type.name: tuple(int(x) for x in GGML_QUANT_SIZES[t.tensor_type]) for t in reader.tensors}


@dataclass(frozen=True)
class GgufTensors:
    """A GGUF's tensors as its header describes them, whatever its architecture, and whether the data are all there."""

    architecture: str | None  # general.architecture
    tensors: list[TensorInfo]
    blocks: dict[str, tuple[int, int]]  # GGML type -> (weights, bytes) per block
    extent: FileExtent


def read_gguf_tensors(path: str | Path) -> GgufTensors:
    """Header and tensor infos of any GGUF, a partial one included; no config built, no tensor data read."""
    p = Path(path)
    reader = open_gguf(p, partial_ok=True)
    check_metadata(reader, p)  # a hostile shape makes a file look partial: said as what it is
    arch = field_value(reader, "general.architecture")
    return GgufTensors(str(arch) if arch is not None else None, tensor_infos(reader, p), block_sizes(reader),
                       gguf_extent(reader, p))


def read_gguf_headers(path: str | Path) -> CheckpointHeaders:
    """A GGUF file as far as its header goes: config from the metadata, tensor infos; no tensor data read."""

    p = Path(path)
    reader = open_gguf(p, partial_ok=True)
    check_metadata(reader, p)  # before the partial check: a hostile shape makes a file look partial
    refuse_partial(reader, p)
    cfg = gguf_config(reader, p)
    infos = tensor_infos(reader, p)
    # The file itself stands where a directory would: inspection reports it as the checkpoint's path.
    return CheckpointHeaders(p, WeightFiles(KIND, (p,)), [infos], cfg, infos, file_format(reader, cfg, p),
                             blocks=block_sizes(reader))


def file_format(reader: Any, cfg: ModelConfig, path: Path) -> CheckpointFormat:
    """GGUF's format, or its per-expert form for a mixture of experts written before llama.cpp stacked them."""
    if not cfg.is_moe or not any(t.name == "blk.0.ffn_gate.0.weight" for t in reader.tensors):
        return gguf_format(field_value(reader, "general.architecture"))
    if cfg.num_experts > MAX_PER_EXPERT:
        raise UnmodelledGguf(f"{path}: {cfg.num_experts:,} experts stored one tensor each (blk.0.ffn_gate.0.weight); "
                             f"llama-tools reads up to {MAX_PER_EXPERT} so, and any number stacked (ffn_gate_exps)")
    return per_expert_format(cfg.num_experts)


# --- Reading tensors, dequantized -------------------------------------------------------------------------

# Quantized bytes are read with positioned reads this many fp32 bytes of rows at a time, not through the memory
# map: every page of a map that was touched counts in RSS until it is unmapped, which would add the whole file
# to an export's peak; a chunk also bounds the library's per-call temporaries (it builds its output twice).
CHUNK_BYTES = 16 << 20
# verify parity runs each decoder layer three times (in the graph's dtype, reassociated, in float64), each run reading
# the layer's weights: the last layer's dequantized tensors are kept, up to this many bytes (a layer of an 8B model
# in fp32 fits), so each tensor is dequantized once, not three times; a larger layer is not kept at all.
CACHE_BYTES = 1 << 30


@functools.lru_cache(maxsize=None)
def dequantizable(qtype: Any) -> bool:
    """Whether the installed gguf library dequantizes this GGML type to floats (one zero block tried)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        out = dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return np.asarray(out).dtype.kind == "f"


class GgufReader:
    """Module-named fp32 tensors of a GGUF file, dequantized on demand; `reference.CheckpointReader`'s interface.

    Names and shapes are checked against the metadata's config up front; no tensor is read until asked. A stacked
    experts tensor (ffn_gate_exps) is read an expert at a time. With `cache`, the last decoder layer's dequantized
    tensors are kept (CACHE_BYTES at most) for the next read of the same layer.
    """

    def __init__(self, path: str | Path, cache: bool = True):
        p = Path(path)
        self.path, self.directory = p, p.parent
        self._gguf = open_gguf(p, partial_ok=True)
        check_metadata(self._gguf, p)
        refuse_partial(self._gguf, p)
        cfg = gguf_config(self._gguf, p)
        infos = tensor_infos(self._gguf, p)
        fmt = file_format(self._gguf, cfg, p)
        self.files, self.format, self.cfg = WeightFiles(KIND, (p,)), fmt, cfg  # q/k rows as stored
        self.gains_plus_one = ARCHITECTURES[field_value(self._gguf, "general.architecture")].gains_plus_one
        self.info: dict[str, TensorInfo] = {t.name: t for t in infos}
        self._tensors = {t.name: t for t in self._gguf.tensors}
        self.where: dict[str, str] = {}  # module name -> stored name
        self.expert: dict[str, int] = {}  # module name -> its index in a stacked experts tensor (ffn_gate_exps)
        self.part: dict[str, tuple[int, int]] = {}  # module name -> its rows [start, stop) in a fused tensor (Phi-3)
        rows_of = {s.name: s.shape[0] for s in weight_specs(cfg)}
        # experts bounded by check_metadata (the stacked tensors' axis), or by file_format (per-expert tensors)
        for ct in checkpoint_tensors(cfg, fmt):
            t = self.info.get(ct.name)
            if t is None:
                raise ValueError(f"{p}: tensor {ct.name!r} that its metadata predicts is not in the file")
            if t.shape != ct.shape:
                raise ValueError(f"{p}: tensor {ct.name!r} has shape {list(t.shape)}, its metadata predicts "
                                 f"{list(ct.shape)}")
            for i, part in enumerate(ct.parts):
                self.where[part] = ct.name
                if len(ct.shape) == 3:  # a stacked experts tensor, even of one expert
                    self.expert[part] = i
                elif len(ct.parts) > 1:  # rows of a fused tensor, the parts one after another
                    start = sum(rows_of[q] for q in ct.parts[:i])
                    self.part[part] = (start, start + rows_of[part])
        # rope_freqs.weight and longrope's factors are read into the config (its RoPE scaling), not as weights
        extra = sorted(set(self.info) - set(self.where.values()) - set(ROPE_TENSORS))
        if extra:
            raise ValueError(f"{p}: tensor {extra[0]!r} is not a weight of the {cfg.family} model its metadata "
                             f"describes")
        if self._gguf.byte_order != "I":  # the library's dequantizers read the host's byte order only
            raise ValueError(f"{p}: a GGUF of the other byte order (big-endian); llama-tools reads little-endian ones")
        for name in set(self.where.values()):  # refused before any export or conversion starts writing
            t = self._tensors[name]
            if not dequantizable(t.tensor_type):
                raise ValueError(f"{p}: tensor {name!r} is stored as {t.tensor_type.name}, a type the gguf library "
                                 f"cannot dequantize")
        self.weight_bytes = sum(t.nbytes for t in infos)
        layer = 4 * stack_specs(cfg).per_decoder()  # one decoder's weights in fp32, its experts included
        self._cache: OrderedDict[tuple[str, int | None], Any] = OrderedDict()  # (stored, expert) -> fp32 array
        self._cache_limit = layer if cache and layer <= CACHE_BYTES else 0
        self._cached = 0  # bytes held

    def _dequantized(self, stored: str, ranges: list[tuple[int, int]] | None = None) -> Any:
        """float32 numpy rows of one stored tensor (all, or the row ranges [start, stop) joined), dequantized by
        the gguf library a chunk of rows at a time into one array.

        Rows are of the last axis: a stacked experts tensor [experts, rows, n2] has experts x rows of them, expert
        e's being e x rows to (e + 1) x rows. Quantized blocks never span rows, so row ranges are exact; only the
        bytes of the rows asked for are read.
        """
        import math
        import os

        import numpy as np
        from gguf.quants import dequantize

        t = self._tensors[stored]
        shape = self.info[stored].shape
        width = shape[-1] if shape else 1  # weights per row
        n_rows = math.prod(shape) // width
        row_bytes = int(t.n_bytes) // n_rows
        spans = [slice(a, b).indices(n_rows)[:2] for a, b in (ranges if ranges is not None else [(0, n_rows)])]
        out = np.empty((sum(max(b - a, 0) for a, b in spans), width), np.float32)  # [rows, n2]
        step = max(1, CHUNK_BYTES // (4 * width))
        at = 0
        with open(self.path, "rb", buffering=0) as f:
            for start, stop in spans:
                for a in range(start, stop, step):
                    b = min(stop, a + step)
                    raw = os.pread(f.fileno(), (b - a) * row_bytes, int(t.data_offset) + a * row_bytes)
                    if len(raw) != (b - a) * row_bytes:
                        raise ValueError(f"{self.path}: tensor {stored!r} is cut short (the file was truncated)")
                    block = np.frombuffer(raw, np.uint8).reshape(b - a, row_bytes)
                    out[at:at + b - a] = dequantize(block, t.tensor_type).reshape(b - a, width)
                    at += b - a
        return out.reshape(shape) if ranges is None else out  # [rows, n2] for ranges

    def read(self, names: list[str], device: Any = "cpu", dtype: Any = None) -> dict[str, Any]:
        """Module-named weights, dequantized, as tensors that own their memory (fp32 unless `dtype`)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        out = {}
        for n in names:  # one dequantized tensor (or expert) in flight at a time
            a = self._weight(n)  # a fresh array
            if self.gains_plus_one and n.endswith("norm.weight"):
                a -= 1.0  # llama.cpp stored Gemma's 1 + γ
            out[n] = torch.from_numpy(a).to(device=device, dtype=dtype)
        return out

    def _weight(self, name: str) -> Any:
        """A module-named weight's fp32 array, a fresh one: from the cache (copied), else dequantized (and kept
        while the cache's bytes allow, the least recently read dropped first)."""
        stored, e = self.where[name], self.expert.get(name)
        key = (name, None) if name in self.part else (stored, e)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit.copy()
        if name in self.part and len(self.info[stored].shape) == 1:  # its elements of a fused bias (attn_qkv.bias)
            a = self._dequantized(stored)[slice(*self.part[name])].copy()
        elif name in self.part:  # its rows of a fused tensor (quantized blocks never span rows)
            a = self._dequantized(stored, [self.part[name]])
        elif e is None:
            a = self._dequantized(stored)
        else:  # one expert's rows of the stacked tensor
            rows = self.info[stored].shape[1]
            a = self._dequantized(stored, [(e * rows, (e + 1) * rows)])
        if a.nbytes > self._cache_limit:
            return a
        self._cache[key], self._cached = a, self._cached + a.nbytes
        while self._cached > self._cache_limit:
            self._cached -= self._cache.popitem(last=False)[1].nbytes
        return a.copy()

    def rows(self, name: str, ranges: list[tuple[int, int]], device: Any = "cpu") -> Any:
        """Row ranges [start, stop) of a module-named 2-D weight (embedding, lm_head), dequantized, fp32."""
        import torch

        return torch.from_numpy(self._dequantized(self.where[name], ranges)).to(device)  # [sum of rows, n2]

    def tokenizer_fields(self) -> dict[str, Any]:
        """The tokenizer.* metadata as Python values (a string that is not UTF-8: one line naming the file, key; a
        chat template's is read.NotUtf8, since the weights and the vocabulary need no template)."""
        return {k: field_value(self._gguf, k, lazy=True) for k in self._gguf.fields if k.startswith("tokenizer.")}


@dataclass
class GgufCheckpoint:
    """A GGUF's config (q/k rows interleaved, as stored), its weights in one dtype, and its vocabulary fields."""

    cfg: ModelConfig
    state: dict[str, Any]
    tokenizer_fields: dict[str, Any]
    seconds: float


def read_gguf_checkpoint(path: str | Path, dtype: Any = None) -> GgufCheckpoint:
    """Every weight dequantized and cast to `dtype` (default float32) one tensor at a time."""
    start = time.perf_counter()
    reader = GgufReader(path, cache=False)  # every tensor read once
    names = [s.name for s in weight_specs(reader.cfg) if s.name in reader.where]  # a tied lm_head is not stored
    vocabulary = reader.tokenizer_fields()  # decoded before the weights: its refusal comes first
    state = {}
    for n in names:
        state.update(reader.read([n], dtype=dtype))
    return GgufCheckpoint(reader.cfg, state, vocabulary, time.perf_counter() - start)


def load_gguf_model(path: str | Path, dtype: Any = None, device: Any = "cpu", rope_layout: str | None = None) -> Any:
    """A GGUF file -> an eval-mode Llama (what `checkpoints.load_checkpoint` gives for a directory).

    rope_layout None keeps the file's interleaved q/k rows (the model applies RoPE in either order).
    """
    import torch

    from ..layouts import permute_rope_rows
    from ...modeling.model import model_from_state

    dtype = torch.float32 if dtype is None else dtype
    ck = read_gguf_checkpoint(path, dtype)
    cfg, state = ck.cfg, ck.state
    if rope_layout is not None and rope_layout != cfg.rope_layout:
        state = permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout,
                                  rope_layout)
        cfg = cfg.replace(rope_layout=rope_layout)
    return model_from_state(cfg, state, dtype, device, consume=True)
