"""GGUF block types: every common one is dequantized by the gguf library and equals an independent decode.

Truth is a decoder written here in plain numpy, in float64, from llama.cpp's published block layouts
(ggml-common.h's block_* structs, ggml-quants.c's dequantize_row_*), sharing no code with the `gguf` library
our reader calls. Each block type gets a tiny LLaMA (width 256, so K-quants' 256-weight super-blocks fit a
row) written with gguf.GGUFWriter: the types the library quantizes from seeded weights, the K-quants as random
block bytes with their f16 scale fields set to finite values. A deliberately wrong decode must disagree, so the
comparison can fail. The two real GGUFs (SmolLM2 Q4_1, Qwen2.5-Coder Q4_K_M) are checked type by type (slow).
The header parse, which leaves arrays (the vocabulary) unsliced until read, must give the library's own fields.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

gguf = pytest.importorskip("gguf")

from llama_tools.checkpoints.gguf import read as gguf_read, tensors as gguf_tensors  # noqa: E402
from llama_tools.counting.accounting import count_source  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.modeling.config import ModelConfig  # noqa: E402
from llama_tools.checkpoints.gguf.tensors import GgufReader  # noqa: E402
from llama_tools.modeling.weights import weight_specs  # noqa: E402
from helpers import add_llama_hparams, finish_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
EPS32 = 2.0 ** -23  # float32's unit roundoff x 2
BLOCK_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
QUANTIZED_BY_LIBRARY = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}  # gguf.quants.quantize does these
# (weights per block, bytes per block) from ggml-common.h's structs, written out here rather than taken from the library
LAYOUT = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
          "Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
          "Q5_K": (256, 176), "Q6_K": (256, 210)}
# byte offsets of the f16 fields of each K-quant block: d (and dmin), set to finite values in random blocks
K_HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


# --- the independent decode: float64 values and the magnitude of the terms each is summed from ---------------

def _f16(blk: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte `at` of each block, as float64 [n, 1]."""
    return np.ascontiguousarray(blk[:, at:at + 2]).view("<f2").astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes of 4-bit quants -> 32 values: low nibbles are weights 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int64)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's qh (a little-endian u32): bit j is weight j's fifth bit, for j in 0..31."""
    bits = np.ascontiguousarray(qh).view("<u4").astype(np.int64)  # [n, 1]
    return (bits >> np.arange(32)) & 1  # [n, 32]


def _scale_min_k4(s12: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit scale and min of sub-block j, packed in 12 bytes (llama.cpp's get_scale_min_k4)."""
    s = s12.astype(np.int64)
    if j < 4:
        return s[:, j:j + 1] & 63, s[:, j + 4:j + 5] & 63
    sc = (s[:, j + 4:j + 5] & 0x0F) | ((s[:, j - 4:j - 3] >> 6) << 4)
    mn = (s[:, j + 4:j + 5] >> 4) | ((s[:, j:j + 1] >> 6) << 4)
    return sc, mn


def _q3k_scales(s12: np.ndarray) -> np.ndarray:
    """Q3_K's 16 signed 6-bit scales: low 4 bits in bytes 0-7 (low nibbles, then high), high 2 bits in bytes 8-11."""
    s = s12.astype(np.int64)
    k = np.arange(16)
    low = np.where(k < 8, s[:, k % 8] & 0x0F, s[:, k % 8] >> 4)
    high = (s[:, 8 + k % 4] >> (2 * (k // 4))) & 3
    return (low | (high << 4)) - 32  # [n, 16]


def decode(blk: np.ndarray, kind: str, wrong: str = "") -> tuple[np.ndarray, np.ndarray]:
    """[n blocks, bytes] -> (float64 weights [n, weights per block], |terms| they are summed from).

    `wrong` plants one mistake in the decode (the negative cases)."""
    n = blk.shape[0]
    if kind == "F32":
        v = np.ascontiguousarray(blk).view("<f4").astype(np.float64)
        return v, np.abs(v)
    if kind == "F16":
        v = np.ascontiguousarray(blk).view("<f2").astype(np.float64)
        return v, np.abs(v)
    if kind == "BF16":  # the upper half of a float32
        v = (np.ascontiguousarray(blk).view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return v, np.abs(v)
    if kind == "Q8_0":  # f16 d, 32 int8
        d = _f16(blk, 0)
        v = d * np.ascontiguousarray(blk[:, 2:34]).view(np.int8)
        return v, np.abs(v)
    if kind == "Q4_0":  # f16 d, 16 bytes of nibbles; d * (q - 8)
        v = _f16(blk, 0) * (_nibbles(blk[:, 2:18]) - (7 if wrong == "q-7" else 8))
        return v, np.abs(v)
    if kind == "Q4_1":  # f16 d, f16 m, 16 bytes of nibbles; d * q + m
        dq, m = _f16(blk, 0) * _nibbles(blk[:, 4:20]), _f16(blk, 2)
        return dq + m, np.abs(dq) + np.abs(m)
    if kind == "Q5_0":  # f16 d, u32 qh, 16 bytes of nibbles; d * ((q | h << 4) - 16)
        high = 0 if wrong == "no-high-bit" else _q5_high(blk[:, 2:6]) << 4
        v = _f16(blk, 0) * ((_nibbles(blk[:, 6:22]) | high) - 16)
        return v, np.abs(v)
    if kind == "Q5_1":  # f16 d, f16 m, u32 qh, 16 bytes of nibbles; d * (q | h << 4) + m
        dq, m = _f16(blk, 0) * (_nibbles(blk[:, 8:24]) | (_q5_high(blk[:, 4:8]) << 4)), _f16(blk, 2)
        return dq + m, np.abs(dq) + np.abs(m)
    out, mag = np.empty((n, 256)), np.empty((n, 256))
    if kind == "Q2_K":  # scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), f16 d, f16 dmin
        sc, qs, d, dmin = blk[:, 0:16].astype(np.int64), blk[:, 16:80].astype(np.int64), _f16(blk, 80), _f16(blk, 82)
        for half in range(2):
            for j in range(4):  # shift 2j
                for h in range(2):
                    e, k = half * 128 + j * 32 + h * 16, half * 8 + j * 2 + h
                    q = (qs[:, half * 32 + h * 16:half * 32 + h * 16 + 16] >> (2 * j)) & 3
                    dq, m = d * (sc[:, k:k + 1] & 0x0F) * q, dmin * (sc[:, k:k + 1] >> 4)
                    out[:, e:e + 16] = dq + m if wrong == "min-added" else dq - m
                    mag[:, e:e + 16] = np.abs(dq) + np.abs(m)
        return out, mag
    if kind == "Q3_K":  # hmask[32], qs[64] (2 bits), scales[12] (6-bit signed), f16 d; d * s * (q - (hbit ? 0 : 4))
        hm, qs = blk[:, 0:32].astype(np.int64), blk[:, 32:96].astype(np.int64)
        sc, d = _q3k_scales(blk[:, 96:108]), _f16(blk, 108)
        for half in range(2):
            for j in range(4):
                for h in range(2):
                    e, k = half * 128 + j * 32 + h * 16, half * 8 + j * 2 + h
                    q = (qs[:, half * 32 + h * 16:half * 32 + h * 16 + 16] >> (2 * j)) & 3
                    hbit = (hm[:, h * 16:h * 16 + 16] >> (half * 4 + j)) & 1
                    hbit = 1 - hbit if wrong == "hbit-inverted" else hbit
                    out[:, e:e + 16] = d * sc[:, k:k + 1] * (q - 4 * (1 - hbit))
        return out, np.abs(out)
    if kind in ("Q4_K", "Q5_K"):  # f16 d, f16 dmin, scales[12] (6-bit scale, min pairs), [qh[32]], qs[128]
        d, dmin, s12 = _f16(blk, 0), _f16(blk, 2), blk[:, 4:16]
        qh = blk[:, 16:48].astype(np.int64) if kind == "Q5_K" else None
        qs = blk[:, 48:176].astype(np.int64) if kind == "Q5_K" else blk[:, 16:144].astype(np.int64)
        for g in range(4):  # 64 weights: 32 low nibbles (sub-block 2g), 32 high nibbles (2g + 1)
            for h in range(2):
                sc, mn = _scale_min_k4(s12, 2 * g + h)
                if wrong == "scale-min-swapped":
                    sc, mn = mn, sc
                q = (qs[:, 32 * g:32 * g + 32] >> (4 * h)) & 0x0F
                if qh is not None:
                    q = q + 16 * ((qh >> (2 * g + h)) & 1)
                dq, m = d * sc * q, dmin * mn
                e = 64 * g + 32 * h
                out[:, e:e + 32], mag[:, e:e + 32] = dq - m, np.abs(dq) + np.abs(m)
        return out, mag
    if kind == "Q6_K":  # ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d; d * s * (q - 32)
        ql, qh, d = blk[:, 0:128].astype(np.int64), blk[:, 128:192].astype(np.int64), _f16(blk, 208)
        sc = np.ascontiguousarray(blk[:, 192:208]).view(np.int8).astype(np.int64)
        offset = 31 if wrong == "q-31" else 32
        for half in range(2):
            lo, hi, s = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32], sc[:, 8 * half:8 * half + 8]
            for part in range(4):  # weights l + 32 part: nibble (part // 2) of ql[l + 32 (part % 2)], qh bits 2 part
                q = (((lo[:, 32 * (part % 2):32 * (part % 2) + 32] >> (4 * (part // 2))) & 0x0F)
                     | (((hi >> (2 * part)) & 3) << 4)) - offset
                scale = np.repeat(s[:, 2 * part:2 * part + 2], 16, axis=1)  # l // 16 picks the first or second
                out[:, 128 * half + 32 * part:128 * half + 32 * part + 32] = d * scale * q
        return out, np.abs(out)
    raise AssertionError(f"no independent decode for {kind}")


def decode_tensor(raw: np.ndarray, kind: str, shape: tuple[int, ...], wrong: str = "") -> tuple[np.ndarray, np.ndarray]:
    """A tensor's stored bytes [rows, row bytes] -> (float64 weights, term magnitudes), both of `shape`."""
    weights, nbytes = LAYOUT[kind]
    v, mag = decode(np.ascontiguousarray(raw, np.uint8).reshape(-1, nbytes), kind, wrong)
    assert v.shape[1] == weights
    return v.reshape(shape), mag.reshape(shape)


def assert_decodes_to(got: torch.Tensor | np.ndarray, want: np.ndarray, mag: np.ndarray, what: str = "") -> None:
    """`got` (float32) equals the float64 decode to float32 rounding: each value within 2 roundings (2^-23) of
    the magnitude of the terms it was computed from (a product's rounding, a sum's)."""
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, decode {want.shape}"
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= EPS32 * mag)  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} weights differ from the independent decode, "
                           f"worst {float(np.nanmax(err)):.3g}")


# --- tiny files of one block type -------------------------------------------------------------------------------

CFG = ModelConfig(name="blocks", vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=64, tie_word_embeddings=False)


def stored_bytes(kind: str, a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Weights [rows, n] as stored blocks [rows, row bytes]: quantized by the library, or random K-quant blocks."""
    weights, nbytes = LAYOUT[kind]
    rows, n = a.shape
    if kind in QUANTIZED_BY_LIBRARY:
        q = gguf.quants.quantize(a, T[kind])
        return np.ascontiguousarray(q).view(np.uint8).reshape(rows, n // weights * nbytes)
    blocks = rng.integers(0, 256, (rows * n // weights, nbytes), dtype=np.uint8)
    for at in K_HALF_FIELDS[kind]:  # d, dmin: finite, both signs, a range of exponents
        half = (rng.uniform(0.5, 1.0, len(blocks)) * 2.0 ** rng.integers(-10, -3, len(blocks))
                * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, at:at + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, n // weights * nbytes)


def write_blocks_gguf(path: Path, kind: str, seed: int = 0,
                     odd: tuple[str, str] | None = None) -> dict[str, tuple[str, np.ndarray, tuple[int, ...]]]:
    """A tiny LLaMA whose matrices are all `kind` blocks (norms F32); module name -> (stored name, bytes, shape).

    odd (module name, type): that matrix stored as zero blocks of another type instead."""
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CFG.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, CFG)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(CFG.vocab_size)])
    stored = {}
    for s in weight_specs(CFG):
        name = names.get_name(s.name, try_suffixes=(".weight", ".bias"))
        a = rng.standard_normal(s.shape).astype(np.float32) * 0.05
        if len(s.shape) == 1:
            raw, t = a.view(np.uint8).reshape(1, -1), T.F32  # norms stay F32, as llama.cpp stores them
            w.add_tensor(name, a)
        elif odd is not None and odd[0] == s.name:
            weights, nbytes = gguf.GGML_QUANT_SIZES[T[odd[1]]]
            raw, t = np.zeros((s.shape[0], s.shape[1] // weights * nbytes), np.uint8), T[odd[1]]
            w.add_tensor(name, raw, raw_dtype=t)
        else:
            raw, t = stored_bytes(kind, a, rng), T[kind]
            w.add_tensor(name, raw, raw_dtype=t)
        stored[s.name] = (name, raw, tuple(s.shape))
    finish_gguf(w)
    return stored


@pytest.fixture(scope="module")
def block_files(tmp_path_factory):
    """Block type -> (its tiny GGUF, module name -> (stored name, stored bytes, shape))."""
    d = tmp_path_factory.mktemp("blocks")
    return {kind: (d / f"{kind}.gguf", write_blocks_gguf(d / f"{kind}.gguf", kind)) for kind in BLOCK_TYPES}


def test_layouts_agree_with_the_library():
    """Our written-out block sizes are llama.cpp's (the library's table), so the files hold what we think."""
    for kind, size in LAYOUT.items():
        assert tuple(gguf.GGML_QUANT_SIZES[T[kind]]) == size, kind


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_reader_equals_independent_decode(block_files, kind, monkeypatch):
    """Every matrix, read whole and by row ranges, equals the numpy decode; the library's dequantize did it."""
    path, stored = block_files[kind]
    calls: list[str] = []
    library = gguf.quants.dequantize

    def counted(data, qtype):
        calls.append(qtype.name)
        return library(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    monkeypatch.setattr(gguf_tensors, "CHUNK_BYTES", 3 * 4 * CFG.hidden_size)  # chunks of 3 rows (1 for n7-wide ones)
    on_disk = {t.name: t for t in gguf.GGUFReader(path).tensors}
    reader = GgufReader(path)
    for module, (name, raw, shape) in stored.items():
        assert on_disk[name].tensor_type.name == (kind if len(shape) == 2 else "F32"), name
        got = reader.read([module])[module]
        assert got.dtype == torch.float32 and tuple(got.shape) == shape, (module, got.dtype, got.shape)
        want, mag = decode_tensor(raw, kind if len(shape) == 2 else "F32", shape)
        assert_decodes_to(got, want, mag, f"{kind} {module}")
        if len(shape) == 2:  # ranges across chunk edges, out of order, one row
            ranges = [(1, 5), (0, 1), (shape[0] - 2, shape[0])]
            rows = reader.rows(module, ranges)
            assert rows.dtype == torch.float32 and tuple(rows.shape) == (7, shape[1])
            pick = np.concatenate([np.arange(a, b) for a, b in ranges])
            assert_decodes_to(rows, want[pick], mag[pick], f"{kind} {module} rows")
    assert kind in calls and set(calls) <= {kind, "F32"}, calls


@pytest.mark.parametrize("kind, wrong", [("Q4_0", "q-7"), ("Q5_0", "no-high-bit"), ("Q2_K", "min-added"),
                                         ("Q3_K", "hbit-inverted"), ("Q4_K", "scale-min-swapped"),
                                         ("Q5_K", "scale-min-swapped"), ("Q6_K", "q-31")])
def test_a_wrong_decode_disagrees(block_files, kind, wrong):
    """Negative case: the comparison fails for a decode with one planted mistake, so it can catch one."""
    path, stored = block_files[kind]
    name, raw, shape = stored["model.layers.0.mlp.up_proj.weight"]
    got = GgufReader(path).read(["model.layers.0.mlp.up_proj.weight"])["model.layers.0.mlp.up_proj.weight"]
    want, mag = decode_tensor(raw, kind, shape)
    assert_decodes_to(got, want, mag)
    bad, bad_mag = decode_tensor(raw, kind, shape, wrong=wrong)
    with pytest.raises(AssertionError, match="differ from the independent decode"):
        assert_decodes_to(got, bad, bad_mag)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_count_params_from_headers(block_files, kind, monkeypatch):
    """count-params: parameters the product of dims whatever the type, bytes the block arithmetic; none decoded."""
    path, stored = block_files[kind]

    def refuse(*args, **kwargs):
        raise AssertionError("count-params dequantized a block")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(GgufReader, "_dequantized", refuse)
    gguf_read._open.cache_clear()  # a parse of its own, under the patches
    count = count_source(str(path))
    insp = count.checkpoint
    assert insp is not None and insp.ok and insp.layout == "gguf"
    want_params = sum(math.prod(shape) for _, _, shape in stored.values())
    assert count.total == insp.total_params == want_params
    weights, nbytes = LAYOUT[kind]
    matrices = [shape for _, _, shape in stored.values() if len(shape) == 2]
    norms = [shape for _, _, shape in stored.values() if len(shape) == 1]
    want_bytes = {kind: sum(math.prod(s) for s in matrices) // weights * nbytes}
    want_bytes["F32"] = want_bytes.get("F32", 0) + 4 * sum(math.prod(s) for s in norms)
    got = {d.dtype: d for d in insp.by_dtype}
    assert {k: d.bytes for k, d in got.items()} == want_bytes
    assert (got[kind].block_weights, got[kind].block_bytes) == (weights, nbytes)
    assert insp.total_bytes == sum(raw.nbytes for _, raw, _ in stored.values())
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    assert r.exit_code == 0 and kind in r.output, r.output


@pytest.mark.parametrize("kind", ["Q8_1", "Q8_K"])
def test_unsupported_type_is_one_line(block_files, kind, tmp_path):
    """A type the gguf library cannot dequantize: refused up front, one line naming the tensor and the type."""
    path = tmp_path / f"{kind}.gguf"
    write_blocks_gguf(path, "Q8_0", odd=("model.layers.0.mlp.up_proj.weight", kind))
    with pytest.raises(ValueError, match=rf"tensor 'blk\.0\.ffn_up\.weight' is stored as {kind}, a type the gguf "
                                         rf"library cannot dequantize"):
        GgufReader(path)
    r = CliRunner().invoke(cli, ["convert", str(path), str(tmp_path / "hf"), "--to", "hf"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "blk.0.ffn_up.weight" in lines[0] and kind in lines[0], r.output
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    r = CliRunner().invoke(cli, ["count-params", str(path)])  # counting needs no dequantizer
    assert r.exit_code == 0 and kind in r.output, r.output


def test_big_endian_file_is_one_line(tmp_path):
    """A big-endian GGUF: the library's dequantizers would read its floats byte-swapped; refused in one line."""
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    add_llama_hparams(w, CFG)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CFG.num_hidden_layers)
    for s in weight_specs(CFG):
        w.add_tensor(names.get_name(s.name, try_suffixes=(".weight",)), np.ones(s.shape, np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match="big-endian"):
        GgufReader(path)


# --- the header parse: arrays left unsliced until read, the same fields as the library's -------------------------

def assert_fields_equal_library(path: Path, parts: bool = True) -> None:
    """Our reader's fields and tensor infos equal gguf.GGUFReader's: names, order, types, data, contents (and
    every part, the library's raw slices, where `parts`)."""
    gguf_read._open.cache_clear()
    ours, theirs = gguf_read.open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.name, g.offset, g.types) == (f.name, f.offset, f.types), name
        assert g.contents() == f.contents(), name
        assert list(g.data) == list(f.data) and len(g.parts) == len(f.parts), name
        assert not parts or all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
    assert ([(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in ours.tensors]
            == [(t.name, t.tensor_type, t.data_offset, t.n_bytes, t.shape.tolist()) for t in theirs.tensors])


def test_header_parse_equals_library(tmp_path):
    """Arrays of strings, numbers and arrays, empty strings: every field as the library parses it."""
    path = tmp_path / "fields.gguf"
    write_blocks_gguf(path, "Q8_0")
    src = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "more.gguf"), "llama")
    for f in src.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [1.5, 2.5])
    w.add_array("test.strings", ["x", "", "yz", "\u00e9\u6f22"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.nested_strings", [["a", "bc"], ["d"]])
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    finish_gguf(w)
    for p in (path, tmp_path / "more.gguf"):
        assert_fields_equal_library(p)
    assert type(gguf_read.open_gguf(tmp_path / "more.gguf").fields["tokenizer.ggml.tokens"]).__name__ == "ArrayField"


def test_vocabulary_cut_short_is_one_line(tmp_path):
    """A file that ends inside its vocabulary: sizing the array of strings finds it, one line, no traceback."""
    path = tmp_path / "whole.gguf"
    write_blocks_gguf(path, "Q8_0")
    tokens = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:int(tokens.offset) + 200])  # a few strings into the array
    r = CliRunner().invoke(cli, ["count-params", str(cut)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output


# --- the real files -------------------------------------------------------------------------------------------

def _real_types_equal_decode(path: Path, expected: set[str]) -> None:
    """The file's block types are `expected`; for each, its smallest tensor, and rows of its largest, equal the
    independent decode of the bytes at the tensor's offset."""
    on_disk = gguf.GGUFReader(path).tensors
    kinds = {t.tensor_type.name for t in on_disk}
    assert kinds == expected
    reader = GgufReader(path)
    module = {stored: m for m, stored in reader.where.items()}
    raw_file = np.memmap(path, np.uint8, mode="r")
    for kind in sorted(kinds):
        of_kind = sorted((t for t in on_disk if t.tensor_type.name == kind), key=lambda t: t.n_elements)
        small, large = of_kind[0], of_kind[-1]
        shape = reader.info[small.name].shape
        raw = raw_file[small.data_offset:small.data_offset + small.n_bytes]
        got = reader.read([module[small.name]])[module[small.name]]
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        want, mag = decode_tensor(raw, kind, shape)
        assert_decodes_to(got, want, mag, f"{path.name} {small.name} ({kind})")
        shape = reader.info[large.name].shape
        if len(shape) == 2:  # rows at the start, across the reader's first chunk edge, at the end
            rows, row_bytes = shape[0], large.n_bytes // shape[0]
            edge = max(1, gguf_tensors.CHUNK_BYTES // (4 * shape[1]))
            ranges = [(0, 2), (min(edge - 1, rows - 2), min(edge + 1, rows)), (rows - 2, rows)]
            got = reader.rows(module[large.name], ranges)
            pick = np.concatenate([np.arange(a, b) for a, b in ranges])
            raw = np.asarray(raw_file[large.data_offset:large.data_offset + large.n_bytes]).reshape(rows, row_bytes)
            want, mag = decode_tensor(raw[pick], kind, (len(pick), shape[1]))
            assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
            assert_decodes_to(got, want, mag, f"{path.name} {large.name} rows ({kind})")


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "qwen2_gguf"])
def test_real_header_parse_equals_library(fixture, request):
    """The real vocabularies (49k and 152k tokens, their merges), left unsliced until read, read as the library's."""
    assert_fields_equal_library(request.getfixturevalue(fixture), parts=False)  # 300k slices: tiny files check them


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "qwen2_gguf"])
def test_real_count_params_beats_library_open(fixture, request):
    """count-params from headers (best of 3) takes at most half the time gguf.GGUFReader takes to open the file."""
    import time

    path = request.getfixturevalue(fixture)

    def best(fn, runs: int) -> float:
        times = []
        for _ in range(runs):
            gguf_read._open.cache_clear()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    ours = best(lambda: count_source(str(path)), 3)
    library = best(lambda: gguf.GGUFReader(path), 1)  # seconds; ours is ~1% of it
    assert ours <= 0.5 * library, (ours, library)


@pytest.mark.slow
def test_real_smollm2_blocks(smollm2_gguf):
    """SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1 matrices, a Q8_0 embedding, F32 norms, each as the decode says."""
    _real_types_equal_decode(smollm2_gguf, {"F32", "Q4_1", "Q8_0"})


@pytest.mark.slow
def test_real_qwen2_blocks(qwen2_gguf):
    """Qwen2.5-Coder-0.5B Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K matrices, F32 norms and biases, each as the decode says."""
    _real_types_equal_decode(qwen2_gguf, {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"})
