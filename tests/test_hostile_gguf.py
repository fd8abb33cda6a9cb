"""Hostile GGUF files through the CLI: every number a header chooses, set to what no writer would write.

The base is the suite's tiny llama GGUF (test_gguf.write_gguf: the gguf library's own writer, as llama.cpp's converter
writes one). Where each count, length, type id, dimension and offset sits is taken from the library's own reader of
the intact file (and checked by reading each back), then one number is changed, or the file is cut at a structure's
start. Each case: `count-params` and `report shapes` exit 1 with exactly one stderr line naming the file (and what is
wrong), no traceback, in bounded time and memory (tracemalloc), nothing written and the input unchanged; `convert`
too for some, and the brief's original failures in a real process. The intact file, a valid alignment and a cut in
the data section (a partial download, which count-params counts) pass: the checks are not blanket refusals.
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

gguf = pytest.importorskip("gguf")

from helpers import add_llama_hparams, finish_gguf  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.modeling.weights import weight_specs  # noqa: E402
from test_gguf import tiny_cfg, write_gguf  # noqa: E402
from test_hostile import assert_one_line, tree  # noqa: E402
from test_hostile_inputs import digest, refused  # noqa: E402

ODD = [0, 2**64 - 1, 2**31, 2**62, 2**63]  # each count and length field is set to each of these
PEAK_BYTES = 4 << 20  # traced allocations of one refusal: ~0.1 MB measured; a hostile count must allocate nothing
SECONDS = 5.0


@dataclass(frozen=True)
class Field:
    """One number of a GGUF header: its byte offset and struct format."""

    offset: int
    fmt: str  # "<Q" (u64) or "<I" (u32)


def field_map(path: Path) -> dict[str, Field]:
    """Every count, length, type id, dimension and data offset of an intact GGUF, placed by the GGUF layout from the
    offsets and names the gguf library's own reader gives (header; per key/value: key length, value type, value;
    per tensor info: name length, n_dims, dims, type, data offset)."""
    r = gguf.GGUFReader(path)
    V = gguf.GGUFValueType
    out = {"tensor_count": Field(8, "<Q"), "kv_count": Field(16, "<Q")}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        out[f"key length {f.name}"] = Field(f.offset, "<Q")
        at = f.offset + 8 + len(f.name.encode())
        out[f"value type {f.name}"] = Field(at, "<I")
        if f.types[0] == V.STRING:
            out[f"string length {f.name}"] = Field(at + 4, "<Q")
        elif f.types[0] == V.ARRAY:
            out[f"item type {f.name}"] = Field(at + 4, "<I")
            out[f"array count {f.name}"] = Field(at + 8, "<Q")
            if f.types[-1] == V.STRING:
                out[f"first item length {f.name}"] = Field(at + 16, "<Q")
        elif f.types[0] == V.UINT32:
            out[f"value {f.name}"] = Field(at + 4, "<I")
    for t in r.tensors:
        out[f"name length {t.name}"] = Field(t.field.offset, "<Q")
        at = t.field.offset + 8 + len(t.name.encode())
        out[f"n_dims {t.name}"] = Field(at, "<I")
        for j in range(len(t.shape)):
            out[f"dim {j} {t.name}"] = Field(at + 4 + 8 * j, "<Q")
        at += 4 + 8 * len(t.shape)
        out[f"type {t.name}"] = Field(at, "<I")
        out[f"data offset {t.name}"] = Field(at + 4, "<Q")
    return out


def patched(blob: bytes, field: Field, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into(field.fmt, out, field.offset, value)
    return bytes(out)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[bytes, dict[str, Field]]:
    """The intact tiny GGUF's bytes and its field map, the map checked by reading every number back."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)
    r, blob, fields = gguf.GGUFReader(path), path.read_bytes(), field_map(path)

    def read(name: str) -> int:
        return struct.unpack_from(fields[name].fmt, blob, fields[name].offset)[0]

    assert (read("tensor_count"), read("kv_count")) == (len(r.tensors), len(r.fields) - 3)
    for t in r.tensors:
        assert [read(f"dim {j} {t.name}") for j in range(len(t.shape))] == t.shape.tolist()
        assert read(f"type {t.name}") == int(t.tensor_type) and read(f"n_dims {t.name}") == len(t.shape)
        assert read(f"data offset {t.name}") == t.data_offset - r.data_offset
        assert read(f"name length {t.name}") == len(t.name)
    assert read("array count tokenizer.ggml.tokens") == len(r.fields["tokenizer.ggml.tokens"].data)
    assert read("string length general.architecture") == len("llama")
    assert read("value llama.embedding_length") == 64
    return blob, fields


def write_plain(path: Path, alignment: tuple[str, int] | None, big_endian: bool = False,
                u64: dict[str, int] | None = None) -> Path:
    """A tiny llama GGUF of ones whose general.alignment is written as ("u32" | "u64" | "custom", value); u64:
    keys written as uint64 in place of what llama.cpp's converter writes."""
    cfg = tiny_cfg(tied=True)
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    add_llama_hparams(w, cfg)
    for key, value in (u64 or {}).items():
        w.add_uint64(key, value)  # the writer replaces the key's u32: a uint64 size is as valid a GGUF
    if alignment is not None:
        kind, value = alignment
        if kind == "custom":
            w.add_custom_alignment(value)  # the writer pads its data to it too: a valid file
        elif kind == "u32":
            w.add_uint32("general.alignment", value)
        else:
            w.add_uint64("general.alignment", value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for s in weight_specs(cfg):
        if s.name != "lm_head.weight":
            w.add_tensor(names.get_name(s.name, try_suffixes=(".weight",)), np.ones(s.shape, np.float32))
    finish_gguf(w)
    return path


# --- the cases: (how the file is made from the intact one, words its refusal names besides the file) -----------

def _set(name: str, value: int):
    return lambda blob, fields: patched(blob, fields[name], value)


def _cut(at: int):
    return lambda blob, fields: blob[:at]


CASES: dict[str, tuple] = {}
for _v in ODD:
    CASES[f"tensor_count={_v}"] = (_set("tensor_count", _v), () if _v == 0 else ("GGUF.tensor_count",))
    CASES[f"kv_count={_v}"] = (_set("kv_count", _v), () if _v == 0 else ("GGUF.kv_count",))
    for _f in ("string length general.architecture", "key length llama.block_count", "name length token_embd.weight"):
        CASES[f"{_f}={_v}"] = (_set(_f, _v), () if _v == 0 else ("string of",))
    CASES[f"first item length tokenizer.ggml.tokens={_v}"] = (
        _set("first item length tokenizer.ggml.tokens", _v), ("tokenizer.ggml.tokens", "runs past the end"))
    for _f in ("array count tokenizer.ggml.tokens", "array count tokenizer.ggml.token_type"):
        CASES[f"{_f}={_v}"] = (_set(_f, _v), () if _v == 0 else ("array of",))
for _v in (13, 99, 2**32 - 1):
    CASES[f"value type={_v}"] = (_set("value type llama.block_count", _v), ("llama.block_count", f"value type {_v}"))
    CASES[f"item type={_v}"] = (_set("item type tokenizer.ggml.tokens", _v), ("tokenizer.ggml.tokens", f"type {_v}"))
CASES["item type=array"] = (_set("item type tokenizer.ggml.tokens", 9), ("tokenizer.ggml.tokens", "array of"))
for _v in (4, 31, 99, 2**32 - 1):  # 4: Q4_2, removed from GGML; 31: never a type
    CASES[f"tensor type={_v}"] = (_set("type token_embd.weight", _v), ("token_embd.weight", f"GGML type {_v}"))
for _v in (0, 5, 2**31, 2**32 - 1):
    CASES[f"n_dims={_v}"] = (_set("n_dims token_embd.weight", _v),
                             ("token_embd.weight",) + (("dimensions",) if _v else ()))
CASES.update({
    "first tensor: a dimension of 0": (_set("dim 1 token_embd.weight", 0), ("'token_embd.weight'", "[64, 0]")),
    "first tensor: a dimension of 2^62": (_set("dim 1 token_embd.weight", 2**62), ("token_embd.weight", "elements")),
    "first tensor: a dimension of 2^31": (_set("dim 1 token_embd.weight", 2**31), ("token_embd.weight", "2147483648")),
    "dimensions whose product overflows 64 bits": (lambda b, f: patched(_set("dim 0 blk.0.attn_q.weight", 2**32)(b, f),
                                                   f["dim 1 blk.0.attn_q.weight"], 2**32),
                              ("blk.0.attn_q.weight", "64-bit")),
    "row not whole blocks": (_set("dim 0 token_embd.weight", 33), ("token_embd.weight", "Q8_0 blocks of 32")),
    "last tensor: a dimension of 2^62": (_set("dim 0 output_norm.weight", 2**62), ("output_norm.weight", "1 PiB")),
    "last tensor: a dimension of 0": (_set("dim 0 output_norm.weight", 0),
                                 ("llama.embedding_length", "output_norm.weight", "64", " 0 elements")),
    "last tensor: a dimension of 2^31": (_set("dim 0 output_norm.weight", 2**31),
                                    ("llama.embedding_length", "output_norm.weight", "2,147,483,648")),
    "misaligned offset": (_set("data offset token_embd.weight", 1), ("token_embd.weight", "alignment")),
    "misaligned second offset": (lambda b, f: patched(b, f["data offset blk.0.attn_norm.weight"], 4353),
                                 ("blk.0.attn_norm.weight", "4,353", "alignment")),
    "offset past the data before": (lambda b, f: patched(b, f["data offset blk.0.attn_norm.weight"], 4352 + 32),
                                    ("blk.0.attn_norm.weight", "4,384", "'token_embd.weight'", "4,352")),
    "offset 2^62": (_set("data offset token_embd.weight", 2**62), ("token_embd.weight", "4,611,686,018,427,387,904")),
    "offset 2^64-1": (_set("data offset token_embd.weight", 2**64 - 1), ("token_embd.weight", "alignment")),
    # metadata that disagrees with the tensors' shapes: the key, the tensor and both numbers
    "embedding_length": (_set("value llama.embedding_length", 32),
                         ("llama.embedding_length", "32", "token_embd.weight", "64")),
    "block_count": (_set("value llama.block_count", 3), ("llama.block_count", "3", "2", "blk.1.")),
    "block_count 2^31": (_set("value llama.block_count", 2**31), ("llama.block_count", "2,147,483,648", "blk.1.")),
    "head_count_kv": (_set("value llama.attention.head_count_kv", 4),
                      ("llama.attention.head_count_kv", "64", "blk.0.attn_k.weight", "32")),
    "head_count": (_set("value llama.attention.head_count", 8),
                   ("llama.embedding_length / llama.attention.head_count", "blk.0.attn_k.weight", "16", "32")),
    "head_count 0": (_set("value llama.attention.head_count", 0), ("llama.attention.head_count", "0")),
    "feed_forward_length": (_set("value llama.feed_forward_length", 100),
                            ("llama.feed_forward_length", "100", "blk.0.ffn_gate.weight", "96")),
    # numbers no tensor's shape checks: bounded as config.json's are (SIZE_LIMITS; the sizes: test_sizes_...)
    "eos id 2^32-1": (_set("value tokenizer.ggml.eos_token_id", 2**32 - 1),
                      ("tokenizer.ggml.eos_token_id", "4,294,967,295", "2,147,483,647")),
    "a size stored as a float": (_set("value type llama.embedding_length", 6), ("llama.embedding_length", "whole")),
    "architecture not UTF-8": (lambda b, f: b.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                      b"\x05\x00\x00\x00\x00\x00\x00\x00\xffllam", 1),
                               ("general.architecture", "UTF-8")),
    "duplicate key": (lambda b, f: b.replace(b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.bos_token_id"),
                      ("tokenizer.ggml.bos_token_id", "Duplicate")),
    "duplicate tensor": (lambda b, f: b.replace(b"blk.1.attn_q.weight", b"blk.0.attn_q.weight"),
                         ("blk.0.attn_q.weight", "duplicated")),
    "not a GGUF": (lambda b, f: b"GGML" + b[4:], ("magic",)),
    "version 7": (lambda b, f: b[:4] + struct.pack("<I", 7) + b[8:], ("version 7",)),
    "empty": (lambda b, f: b"", ()),
})
for _at in (3, 4, 8, 16, 23, 24):  # the header: magic, version, counts
    CASES[f"cut at byte {_at}"] = (_cut(_at), ("truncated",))


def boundaries(fields: dict[str, Field]) -> dict[str, int]:
    """Each key/value's and each tensor info's first byte, where its key or name length is (a cut there leaves
    the header incomplete), and a cut inside the last tensor info."""
    out = {f"cut at key {n.removeprefix('key length ')}": f.offset for n, f in fields.items()
           if n.startswith("key length ")}
    infos = {n.removeprefix("name length "): f.offset for n, f in fields.items() if n.startswith("name length ")}
    last = list(infos)[-1]
    return {**out, **{f"cut at tensor info {n}": at for n, at in infos.items()},
            f"cut inside tensor info {last}": infos[last] + 10}


def make(case: str, base, directory: Path) -> Path:
    blob, fields = base
    cuts = boundaries(fields)
    out = blob[:cuts[case]] if case in cuts else CASES[case][0](blob, fields)
    assert out != blob, "the case must change the file"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.gguf"
    path.write_bytes(out)
    return path


def invoke_bounded(argv: list[str]):
    """CliRunner's run of the command, with its wall time and the peak of traced allocations."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        r = CliRunner().invoke(cli, argv)
    finally:
        took = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return r, took, peak


def test_the_memory_bound_sees_numpys_allocations():
    """The negative case of the memory bound: an array the size of the bound is traced (numpy reports to
    tracemalloc), so a refusal that allocated one would fail."""
    tracemalloc.start()
    try:
        a = np.ones(PEAK_BYTES, np.uint8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak >= PEAK_BYTES and a.sum() == PEAK_BYTES


def assert_refused(argv: list[str], path: Path, names: tuple[str, ...] = ()) -> str:
    """One stderr line naming the file and `names`, exit 1, bounded time and memory, nothing written."""
    before_tree, before = tree(path.parent), digest(path.parent)
    r, took, peak = invoke_bounded(argv)
    line = assert_one_line(r, path.name, *names)
    assert took < SECONDS, f"{took:.1f} s: {line}"
    assert peak < PEAK_BYTES, f"{peak:,} bytes traced: {line}"
    assert tree(path.parent) == before_tree and digest(path.parent) == before, "a file was written or changed"
    return line


@pytest.fixture(scope="module", autouse=True)
def warm(base, tmp_path_factory):
    """One run of each command on the intact file first: imports are not the cases' memory or time."""
    d = tmp_path_factory.mktemp("warm")
    path = d / "tiny.gguf"
    path.write_bytes(base[0])
    for argv in (["count-params", str(path)], ["report", "shapes", str(path), "--format", "json"]):
        r = CliRunner().invoke(cli, argv)
        assert r.exit_code == 0, r.output


HEADER_CASES = list(CASES)
BOUNDARY_CASES = [*(f"cut at key {k}" for k in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens",
                                                "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id")),
                  "cut at tensor info token_embd.weight", "cut at tensor info blk.0.attn_q.weight",
                  "cut at tensor info output_norm.weight", "cut inside tensor info output_norm.weight"]


@pytest.mark.parametrize("case", HEADER_CASES + BOUNDARY_CASES)
def test_count_params_and_report_shapes_refuse_in_one_line(case, base, tmp_path):
    path = make(case, base, tmp_path)
    names = CASES[case][1] if case in CASES else ("truncated",)
    assert_refused(["count-params", str(path)], path, names)
    assert_refused(["report", "shapes", str(path)], path, names)


def test_every_structure_boundary_of_the_header_is_a_refusal(base, tmp_path):
    """A cut at every key/value's and every tensor info's first byte: one line naming the file, nothing counted."""
    cuts = boundaries(base[1])
    assert len(cuts) == 17 + 20 + 1  # the tiny file's key/values and tensor infos, as the library lists them
    for at in cuts.values():
        d = tmp_path / str(at)
        d.mkdir()
        path = d / "model.gguf"
        path.write_bytes(base[0][:at])
        assert_refused(["count-params", str(path)], path, ("GGUF",))


@pytest.mark.parametrize("case", ["tensor_count=4611686018427387904", "last tensor: a dimension of 2^31",
                                  "misaligned offset", "embedding_length"])
def test_convert_refuses_before_writing(case, base, tmp_path):
    path = make(case, base, tmp_path / "in")
    out = tmp_path / "out"
    assert_refused(["convert", str(path), str(out), "--to", "hf"], path, CASES[case][1])
    assert not out.exists()


@pytest.mark.parametrize("kind, value, words", [("u32", 0, "is 0"), ("u32", 3, "is 3"), ("u32", 2**31, "2,147,483,648"),
                                               ("u64", 2**40, "UINT64")])
def test_alignment_that_is_no_bounded_power_of_two_is_refused(kind, value, words, tmp_path):
    path = write_plain(tmp_path / "aligned.gguf", (kind, value))
    line = assert_refused(["count-params", str(path)], path, ("general.alignment", words))
    assert "not a power of two" in line or "UINT32" in line
    assert_refused(["report", "shapes", str(path)], path, ("general.alignment",))


def test_a_valid_alignment_and_the_intact_file_are_read(base, tmp_path):
    """The negative cases: what the checks must let through is read, and as the library reads it."""
    path = write_plain(tmp_path / "aligned.gguf", ("custom", 64))
    assert gguf.GGUFReader(path).alignment == 64
    for p in (path, make_intact(base, tmp_path)):
        r = CliRunner().invoke(cli, ["count-params", str(p), "--format", "json"])
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)[0]["checkpoint"]
        want = sum(int(t.n_elements) for t in gguf.GGUFReader(p).tensors)
        assert got["total_params"] == got["expected_params"] == want and not got["mismatched"] and not got["missing"]
        r = CliRunner().invoke(cli, ["report", "shapes", str(p), "--format", "json"])
        assert r.exit_code == 0, r.output


def make_intact(base, directory: Path) -> Path:
    path = directory / "intact.gguf"
    path.write_bytes(base[0])
    return path


@pytest.mark.parametrize("cut", ["header end", "data start", "mid data", "last byte"])
def test_a_cut_in_the_data_is_a_partial_download(cut, base, tmp_path):
    """Header whole, data short: count-params counts it and says PARTIAL; what needs a config or the data refuses."""
    blob, _ = base
    r = gguf.GGUFReader(make_intact(base, tmp_path))
    header_end = r.tensors[-1].field.offset + sum(int(p.nbytes) for p in r.tensors[-1].field.parts)
    at = {"header end": header_end, "data start": r.data_offset, "mid data": (r.data_offset + len(blob)) // 2,
          "last byte": len(blob) - 1}[cut]
    d = tmp_path / "cut"
    d.mkdir()
    path = d / "model.gguf"
    path.write_bytes(blob[:at])
    res, took, peak = invoke_bounded(["count-params", str(path)])
    assert res.exit_code == 0 and "PARTIAL" in res.stdout and took < SECONDS and peak < PEAK_BYTES, res.output
    assert_refused(["report", "shapes", str(path)], path, ("partial",))
    out = tmp_path / "out"
    assert_refused(["convert", str(path), str(out), "--to", "hf"], path, ("missing",))
    assert not out.exists()


@pytest.mark.parametrize("case", ["tensor_count=4611686018427387904", "kv_count=4611686018427387904",
                                  "string length general.architecture=9223372036854775808"])
def test_the_original_failures_in_a_real_process(case, base, tmp_path):
    """The brief's tracebacks (OverflowError in the library's _get) as the installed entry point runs them."""
    path = make(case, base, tmp_path)
    for argv in (["count-params", str(path)], ["report", "shapes", str(path)]):
        refused(argv, tmp_path, path.name, seconds=15)


def test_without_its_hooks_the_librarys_own_reader_is_caught_at_our_boundary(base, tmp_path, monkeypatch):
    """Another gguf version without the private helpers FastReader hooks: the library's own reader parses, and
    whatever it raises on a hostile file is still one line naming the file."""
    from llama_tools.checkpoints.gguf import read as gguf_read

    monkeypatch.setattr(gguf_read, "_HOOKS", ("_a_helper_no_version_has",))
    gguf_read._open.cache_clear()
    try:
        intact = make_intact(base, tmp_path)
        assert type(gguf_read.open_gguf(intact)) is gguf.GGUFReader
        assert CliRunner().invoke(cli, ["count-params", str(intact)]).exit_code == 0
        for i, case in enumerate(("tensor_count=4611686018427387904", "kv_count=4611686018427387904",
                                  "string length general.architecture=9223372036854775808",
                                  "last tensor: a dimension of 2^62", "tensor type=99", "cut at byte 16")):
            path = make(case, base, tmp_path / f"case{i}")
            assert_refused(["count-params", str(path)], path, ("not a readable GGUF file",))
    finally:
        gguf_read._open.cache_clear()



@pytest.mark.parametrize("key, value, bound", [("llama.context_length", 2**62, "max_position_embeddings"),
                                               ("llama.attention.sliding_window", 2**41, "sliding_window")])
def test_sizes_no_tensor_checks_are_bounded_as_a_configs(key, value, bound, tmp_path):
    """A uint64 size over SIZE_LIMITS (the bound config.json's get) is refused in one line naming the key, the value
    and the bound; the same file with the size in bounds is counted (the check can pass)."""
    from llama_tools.modeling.config import SIZE_LIMITS

    for d in ("big", "ok"):
        (tmp_path / d).mkdir()
    path = write_plain(tmp_path / "big" / "model.gguf", None, u64={key: value})
    assert_refused(["count-params", str(path)], path, (key, f"{value:,}", f"{SIZE_LIMITS[bound]:,}"))
    r = CliRunner().invoke(cli, ["count-params", str(write_plain(tmp_path / "ok" / "model.gguf", None,
                                                                 u64={key: 4096}))])
    assert r.exit_code == 0, r.output
