"""A fuzz run of the weight-file header readers (issues 18, 21): mutated safetensors headers and torch zips.

Properties, on every generated file:
- our reader either returns tensors or raises HeaderError (a ValueError naming the file, one line): no other
  exception, within the deadline, and a bounded traced peak (tracemalloc) on the structured cases;
- whatever it accepts, the format's own library accepts too: safe_open reads every tensor with the same shape and
  dtype, torch.load every tensor with the same shape. The libraries are the independent truth; we may only be
  stricter than them.
Two kinds of generation: random damage (bytes, lengths, whole JSON values), and real files (written by
safetensors.torch.save_file and torch.save) mutated exhaustively: a cut at every structure boundary, every
length/count field at 0, -1, 2^31, 2^63, 2^64, every field of every wrong JSON (or pickled) type. A handful of
mutations also run through `count-params`: exit 0, or exit 1 with one stderr line naming the file; nothing written.
LLAMA_TOOLS_FUZZ_EXAMPLES sets the number of random examples (default 150; a benchmark runs more).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import struct
import tempfile
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from llama_tools.modeling import dtypes
from llama_tools.checkpoints.load import torch_load
from llama_tools.cli import cli
from llama_tools.checkpoints.header_readers import HeaderError, read_safetensors_header
from llama_tools.checkpoints.torch_headers import read_torch_header
from test_hostile import assert_one_line
from test_hostile_inputs import library_refuses

CODES = [d.safetensors for d in dtypes.DTYPES.values() if d.safetensors]
EXAMPLES = int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CLI_FUZZ = settings(FUZZ, max_examples=max(5, EXAMPLES // 15), deadline=10000)

# JSON values of every kind, including the ones a header must not hold (floats, bools, nesting, huge ints).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
odd_ints = st.sampled_from([-1, 0, 1, 2, 3, 7, 8, 2**32, 2**63, 2**64 - 1, 2**64, 10**30])


@st.composite
def valid_tensors(draw):
    """A valid header as {name: {dtype, shape, data_offsets}} plus the data length (tiny shapes)."""
    header, offset = {}, 0
    for i in range(draw(st.integers(0, 4))):
        code = draw(st.sampled_from(CODES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = int(dtypes.from_safetensors(code).bytes)
        for s in shape:
            n *= s
        header[f"t{i}"] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


def _mutate(draw, header: dict) -> dict:
    """One structural change: a field replaced by any JSON value or an odd integer, an entry dropped or doubled."""
    names = [k for k in header if k != "__metadata__"]
    kind = draw(st.sampled_from(["field_json", "field_int", "offsets", "shape_item", "entry", "metadata", "swap",
                                 "none"]))
    if not names or kind == "metadata":
        header["__metadata__"] = draw(json_values)
        return header
    name = draw(st.sampled_from(names))
    entry = header[name]
    if kind == "field_json":
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(json_values)
    elif kind == "field_int":
        entry["data_offsets"][draw(st.integers(0, 1))] = draw(odd_ints)
    elif kind == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = [b + draw(st.integers(-3, 3)), e + draw(st.integers(-3, 3))]
    elif kind == "shape_item":
        entry["shape"] = entry["shape"] + [draw(odd_ints | st.floats() | st.booleans())]
    elif kind == "entry":
        header[name] = draw(json_values)
    elif kind == "swap" and len(names) > 1:
        other = header[draw(st.sampled_from(names))]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    return header


@st.composite
def safetensors_files(draw) -> bytes:
    """The bytes of a safetensors file: valid, structurally mutated, or with raw bytes damaged."""
    header, data_len = draw(valid_tensors())
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    if draw(st.integers(0, 3)):
        header = _mutate(draw, header)
    raw = json.dumps(header, allow_nan=True).encode()
    raw += b" " * draw(st.integers(0, 8))
    n = len(raw)
    damage = draw(st.sampled_from(["none", "none", "length", "bytes", "truncate", "extend"]))
    if damage == "length":
        n = draw(odd_ints.filter(lambda v: 0 <= v < 2**64) | st.integers(0, len(raw) + 16))
    data = bytes(data_len)
    blob = struct.pack("<Q", n) + raw + data
    if damage == "bytes" and blob:
        at = draw(st.integers(0, len(blob) - 1))
        blob = blob[:at] + draw(st.binary(min_size=1, max_size=4)) + blob[at + 1:]
    elif damage == "truncate":
        blob = blob[:draw(st.integers(0, len(blob)))]
    elif damage == "extend":
        blob += draw(st.binary(min_size=1, max_size=8))
    return blob


def _library_reads(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the safetensors library itself reads: every tensor's shape and dtype, data touched."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return out


@FUZZ
@given(safetensors_files())
def test_fuzzed_safetensors_headers_are_refused_in_our_words_or_read_as_the_library_reads_them(blob):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        path.write_bytes(blob)
        try:
            infos = read_safetensors_header(path)
        except HeaderError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)
            return
        truth = _library_reads(path)  # raises if the library refuses what we accepted
        assert {t.name: (t.shape, t.dtype) for t in infos} == truth


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 200))
def test_random_bytes_are_refused_in_our_words(prefix, pad):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        path.write_bytes(prefix + bytes(pad))
        try:
            infos = read_safetensors_header(path)
        except HeaderError:
            return
        assert {t.name: (t.shape, t.dtype) for t in infos} == _library_reads(path)


def test_negative_the_library_is_a_real_check():
    """A header our checks would refuse (a gap in the data) is refused by the library too: the truth can fail."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gap.safetensors"
        raw = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
        with pytest.raises(HeaderError, match="gap"):
            read_safetensors_header(path)
        with pytest.raises(Exception, match="offset"):
            _library_reads(path)


# --- torch zips ----------------------------------------------------------------------------------

def _torch_zip() -> bytes:
    buf = io.BytesIO()
    torch.save({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.float16)}, buf)
    return buf.getvalue()


TORCH_ZIP = _torch_zip()


@FUZZ
@given(st.integers(0, len(TORCH_ZIP) - 1), st.binary(min_size=1, max_size=8), st.booleans())
def test_fuzzed_torch_zips_are_refused_in_our_words(at, junk, truncate):
    blob = TORCH_ZIP[:at] if truncate else TORCH_ZIP[:at] + junk + TORCH_ZIP[at + len(junk):]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "consolidated.00.pth"
        path.write_bytes(blob)
        try:
            infos = read_torch_header(path)
        except HeaderError as e:
            assert str(e).startswith(str(path)), str(e)
            return
        # The header reader never reads storages (headers only): damage there is torch.load's to find, and
        # the loader turns whatever torch raises into one line naming the file.
        try:
            loaded = torch_load(path)
        except ValueError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)
            return
        assert {t.name: t.shape for t in infos} == {k: tuple(v.shape) for k, v in loaded.items()}


@FUZZ
@given(st.binary(max_size=600))
def test_fuzzed_data_pkl_is_refused_in_our_words(pkl):
    """Any bytes as data.pkl: the restricted unpickler refuses them as one HeaderError, never another exception."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.pth"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", pkl)
        try:
            read_torch_header(path)
        except HeaderError:
            pass


# --- Real files, every structure boundary and every length field ------------------------------------------------
#
# The bases are written by the formats' own writers (safetensors.torch.save_file, torch.save); each mutation below
# is applied to them one at a time, exhaustively: a cut at every boundary of the file's structure, every length or
# count field set to each of ODD_FIELD (or to what its width holds), every field given each wrong JSON type.

ODD_FIELD = [0, -1, 2**31, 2**63, 2**64 - 1, 2**64]
WRONG_JSON = [None, True, 1.5, "x", [], {}, [[1]], {"a": 1}, [-1], [2**63], [1.5]]
MEMORY = 8 * 2**20  # a reader's peak (tracemalloc) on these few-kB files, far above what any of them needs


def bounded(read, path: Path):
    """read(path), with its peak traced allocation: (result or the HeaderError raised, peak bytes)."""
    tracemalloc.start()
    try:
        try:
            out = read(path)
        except HeaderError as e:
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _refused_in_our_words(e: HeaderError, path: Path) -> None:
    assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)


@pytest.fixture(scope="module")
def real_st(tmp_path_factory) -> bytes:
    """A safetensors file written by the library: three dtypes, a matrix, a scalar and an empty tensor."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "s": torch.tensor(7, dtype=torch.int64), "e": torch.zeros(0, 4)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _st_parts(blob: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


def _st_blob(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def st_cuts(blob: bytes) -> list[int]:
    """Every boundary of the file's structure: in and after the length, each JSON token, each tensor's data."""
    n, header = _st_parts(blob)
    cuts = set(range(9)) | {8 + n - 1, 8 + n}
    cuts |= {8 + i + d for i, c in enumerate(blob[8:8 + n]) if c in b'{}[],:"' for d in (0, 1)}
    cuts |= {8 + n + o for k, v in header.items() if k != "__metadata__" for o in v["data_offsets"] if type(o) is int}
    return sorted(c for c in cuts if c < len(blob))


def st_field_mutations(blob: bytes) -> list[tuple[str, bytes]]:
    """(what, file) for every length/count field set to each ODD_FIELD, and every field of each wrong JSON type."""
    n, header = _st_parts(blob)
    data = blob[8 + n:]
    out = [(f"length prefix {v}", struct.pack("<Q", v % 2**64) + blob[8:]) for v in ODD_FIELD]
    names = [k for k in header if k != "__metadata__"]
    for name in names:
        for field in ("shape", "data_offsets"):
            for i in range(len(header[name][field])):
                for v in ODD_FIELD:
                    h = json.loads(json.dumps(header))
                    h[name][field][i] = v
                    out.append((f"{name}.{field}[{i}] = {v}", _st_blob(h, data)))
        for field in ("dtype", "shape", "data_offsets", None):
            for v in WRONG_JSON:
                h = json.loads(json.dumps(header))
                if field is None:
                    h[name] = v
                else:
                    h[name][field] = v
                out.append((f"{name}.{field} = {v!r}", _st_blob(h, data)))
    for v in WRONG_JSON:
        out.append((f"__metadata__ = {v!r}", _st_blob({**header, "__metadata__": v}, data)))
    return out


def test_a_safetensors_file_cut_at_any_boundary_is_refused_by_us_and_the_library(real_st, tmp_path):
    path = tmp_path / "model.safetensors"
    cuts = st_cuts(real_st)
    assert len(cuts) > 60  # the structure really was walked
    for cut in cuts:
        path.write_bytes(real_st[:cut])
        out, peak = bounded(read_safetensors_header, path)
        assert isinstance(out, HeaderError), f"a cut at byte {cut} was read: {out}"
        _refused_in_our_words(out, path)
        assert peak < MEMORY, f"cut at {cut}: {peak:,} bytes"
        assert library_refuses(path), f"the library reads the file cut at {cut}: not a truncation"


def test_every_length_field_and_json_type_of_a_real_header_is_refused_or_read_as_the_library_reads_it(real_st, tmp_path):
    path = tmp_path / "model.safetensors"
    refused = 0
    for what, blob in st_field_mutations(real_st):
        path.write_bytes(blob)
        out, peak = bounded(read_safetensors_header, path)
        assert peak < MEMORY, f"{what}: {peak:,} bytes"
        if isinstance(out, HeaderError):
            _refused_in_our_words(out, path)
            refused += 1
            continue
        assert {t.name: (t.shape, t.dtype) for t in out} == _library_reads(path), what
    assert refused > 100


def test_negative_the_intact_real_file_is_read_as_the_library_reads_it(real_st, tmp_path):
    """The mutations above are what is refused: the untouched file reads, and agrees with the library."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(real_st)
    infos = read_safetensors_header(path)
    assert {t.name: (t.shape, t.dtype) for t in infos} == _library_reads(path) == {
        "w": ((2, 3), "float32"), "b": ((3,), "bfloat16"), "s": ((), "int64"), "e": ((0, 4), "float32")}


@FUZZ
@given(st.data())
def test_several_mutations_of_a_real_header_at_once(real_st, data):
    """Up to three field mutations and a cut together: still refused in our words or read as the library reads it."""
    blob = real_st
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        muts = st_field_mutations(blob) if len(blob) >= 8 and _parses(blob) else []
        kind = data.draw(st.sampled_from(["field", "field", "cut"] if muts else ["cut"]), label="kind")
        if kind == "field":
            blob = data.draw(st.sampled_from(muts), label="mutation")[1]
        else:
            cuts = st_cuts(blob) if _parses(blob) else list(range(len(blob)))
            blob = blob[:data.draw(st.sampled_from(cuts or [0]), label="cut")]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        path.write_bytes(blob)
        out, peak = bounded(read_safetensors_header, path)
        assert peak < MEMORY
        if isinstance(out, HeaderError):
            _refused_in_our_words(out, path)
        else:
            assert {t.name: (t.shape, t.dtype) for t in out} == _library_reads(path)


def _parses(blob: bytes) -> bool:
    try:
        n, header = _st_parts(blob)
    except (ValueError, struct.error):
        return False
    lists = lambda v: isinstance(v, list) and all(type(x) is int for x in v)  # noqa: E731
    return isinstance(header, dict) and all(isinstance(v, dict) and lists(v.get("shape")) and lists(v.get("data_offsets"))
                                            for k, v in header.items() if k != "__metadata__")


# --- Real torch zips: every integer of data.pkl, every opcode boundary, every zip field -----------------------

@pytest.fixture(scope="module")
def real_pth() -> bytes:
    """torch.save of a module's state dict (BUILD of its _metadata) and of views: transposed, expanded (stride 0),
    offset into a shared storage, a parameter, bf16 and int64."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    sd = m.state_dict()
    base = torch.arange(12, dtype=torch.float32)
    sd.update({"t": base.reshape(3, 4).t(), "x": torch.ones(1).expand(5), "o": base[4:10].reshape(2, 3),
               "p": torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), "i": torch.tensor([1, 2], dtype=torch.int64)})
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _pkl_name(blob: bytes) -> str:
    return next(n for n in zipfile.ZipFile(io.BytesIO(blob)).namelist() if n.endswith("data.pkl"))


def with_pkl(blob: bytes, pkl: bytes) -> bytes:
    """The zip with data.pkl replaced, every other record as it was (stored, as torch.save writes them)."""
    zin, out = zipfile.ZipFile(io.BytesIO(blob)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, pkl if info.filename.endswith("data.pkl") else zin.read(info))
    return out.getvalue()


def _enc_int(v: int) -> bytes:
    if -2**31 <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = pickle.encode_long(v)
    return b"\x8a" + bytes([len(raw)]) + raw


# Opcodes a wrong type is written with: None, True, a string, (), {}, a float (not an opcode torch.save writes).
WRONG_PICKLED = [b"N", b"\x88", b"X\x01\x00\x00\x00x", b")", b"}", b"G" + struct.pack(">d", 1.5)]


def pkl_mutations(pkl: bytes) -> list[tuple[str, bytes]]:
    """(what, data.pkl) for every integer set to each ODD_FIELD or a wrong type, and a cut at every opcode."""
    ops = list(pickletools.genops(pkl))
    ends = [pos for _, _, pos in ops[1:]] + [len(pkl)]
    out = [(f"cut at op {i}", pkl[:pos]) for i, (_, _, pos) in enumerate(ops)]
    for (op, arg, pos), end in zip(ops, ends):
        if op.name in ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"):
            out += [(f"int {arg} at {pos} = {v}", pkl[:pos] + _enc_int(v) + pkl[end:]) for v in ODD_FIELD]
            out += [(f"int {arg} at {pos} = {w!r}", pkl[:pos] + w + pkl[end:]) for w in WRONG_PICKLED]
    return out


def check_torch_file(path: Path) -> str:
    """read_torch_header's answer is a HeaderError in our words, or shapes that torch.load itself reads."""
    out, peak = bounded(read_torch_header, path)
    assert peak < MEMORY, f"{peak:,} bytes"
    if isinstance(out, HeaderError):
        _refused_in_our_words(out, path)
        return "refused"
    try:
        loaded = torch_load(path)
    except ValueError as e:  # storage bytes damaged: torch.load's to find, one line naming the file
        assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)
        return "data"
    assert {t.name: t.shape for t in out} == {k: tuple(v.shape) for k, v in loaded.items()}
    return "read"


def test_every_integer_and_opcode_boundary_of_a_real_data_pkl(real_pth, tmp_path):
    """Shapes, strides, offsets and storage sizes at 0, -1, 2^31, 2^63, 2^64 or of a wrong type, data.pkl cut at
    every opcode: refused in our words, or read exactly as torch.load reads it (never accepted and then refused)."""
    path = tmp_path / "consolidated.00.pth"
    pkl = zipfile.ZipFile(io.BytesIO(real_pth)).read(_pkl_name(real_pth))
    seen: dict[str, int] = {}
    for what, mutated in pkl_mutations(pkl):
        path.write_bytes(with_pkl(real_pth, mutated))
        result = check_torch_file(path)
        assert result != "data", f"{what}: accepted from its header, refused by torch.load"
        seen[result] = seen.get(result, 0) + 1
    assert seen["refused"] > 300 and seen.get("read", 0) > 10, seen  # both answers really happen


def zip_fields(blob: bytes) -> list[tuple[str, int, str]]:
    """(name, offset, struct format) of every length, count and offset field of the zip's records."""
    zf = zipfile.ZipFile(io.BytesIO(blob))
    fields = []
    for info in zf.infolist():
        at = info.header_offset
        fields += [(f"{info.filename} local {n}", at + o, f) for n, o, f in
                   (("compressed size", 18, "<I"), ("size", 22, "<I"), ("name length", 26, "<H"),
                    ("extra length", 28, "<H"))]
    cd = zf.start_dir
    while blob[cd:cd + 4] == b"PK\x01\x02":
        fields += [(f"central@{cd} {n}", cd + o, f) for n, o, f in
                   (("compressed size", 20, "<I"), ("size", 24, "<I"), ("name length", 28, "<H"),
                    ("extra length", 30, "<H"), ("comment length", 32, "<H"), ("offset", 42, "<I"))]
        cd += 46 + sum(struct.unpack_from("<HHH", blob, cd + 28))
    end = blob.rfind(b"PK\x05\x06")
    fields += [(f"end {n}", end + o, f) for n, o, f in (("disk entries", 8, "<H"), ("entries", 10, "<H"),
                                                         ("directory size", 12, "<I"),
                                                         ("directory offset", 16, "<I"))]
    return fields


def zip_cuts(blob: bytes) -> list[int]:
    """Every record boundary of the zip: each local header, its data's start and end, each directory record."""
    zf = zipfile.ZipFile(io.BytesIO(blob))
    cuts = {zf.start_dir, blob.rfind(b"PK\x05\x06")}
    for info in zf.infolist():
        start = info.header_offset + 30 + sum(struct.unpack_from("<HH", blob, info.header_offset + 26))
        cuts |= {info.header_offset, info.header_offset + 30, start, start + info.compress_size}
    cuts |= {i for i in range(zf.start_dir, len(blob)) if blob[i:i + 4] in (b"PK\x01\x02", b"PK\x06\x06",
                                                                         b"PK\x06\x07")}
    return sorted(c for c in cuts if 0 <= c < len(blob))


def test_every_zip_field_and_record_boundary_of_a_real_pth(real_pth, tmp_path):
    """Sizes, name lengths, offsets and counts of the zip's records at 0, 2^31 and all ones, the file cut at every
    record: refused in our words, or read as torch.load reads it (or its data found damaged, in one line)."""
    path = tmp_path / "consolidated.00.pth"
    fields = zip_fields(real_pth)
    assert len(fields) > 60
    seen: dict[str, int] = {}
    for name, at, fmt in fields:
        for v in (0, 2**31, 2**(8 * struct.calcsize(fmt)) - 1):
            if fmt == "<H" and v == 2**31:
                continue
            blob = bytearray(real_pth)
            struct.pack_into(fmt, blob, at, v)
            path.write_bytes(bytes(blob))
            r = check_torch_file(path)
            seen[r] = seen.get(r, 0) + 1
    for cut in zip_cuts(real_pth):
        path.write_bytes(real_pth[:cut])
        assert check_torch_file(path) == "refused", f"cut at {cut}"
    assert seen.get("refused", 0) > 50, seen


def test_negative_the_real_pth_with_its_views_is_read_as_torch_reads_it(real_pth, tmp_path):
    """The untouched file (a transposed view, a stride-0 expansion, an offset into a shared storage) is accepted
    with torch's own shapes: the span checks above refuse damage, not real layouts."""
    path = tmp_path / "consolidated.00.pth"
    path.write_bytes(real_pth)
    assert check_torch_file(path) == "read"
    shapes = {t.name: t.shape for t in read_torch_header(path)}
    assert shapes["t"] == (4, 3) and shapes["x"] == (5,) and shapes["o"] == (2, 3)


# --- The CLI on a few of them: one line, exit 1, nothing written --------------------------------------------------

@CLI_FUZZ
@given(st.data())
def test_count_params_on_mutated_weight_files_is_a_count_or_one_line(real_st, real_pth, data):
    kind = data.draw(st.sampled_from(["safetensors", "pth"]), label="kind")
    if kind == "safetensors":
        name, blob = "model.safetensors", data.draw(st.sampled_from(st_field_mutations(real_st)), label="mutation")[1]
    else:
        pkl = zipfile.ZipFile(io.BytesIO(real_pth)).read(_pkl_name(real_pth))
        name = "consolidated.00.pth"
        blob = with_pkl(real_pth, data.draw(st.sampled_from(pkl_mutations(pkl)), label="mutation")[1])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(blob)
        before = sorted(p.name for p in Path(d).iterdir())
        r = CliRunner().invoke(cli, ["count-params", str(path)])
        if r.exit_code != 0:
            assert_one_line(r, name)
        assert sorted(p.name for p in Path(d).iterdir()) == before  # nothing written beside the input
        assert Path(path).read_bytes() == blob
