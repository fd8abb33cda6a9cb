"""A fuzz run of the weight-file header readers (issue 18): mutated safetensors headers and torch zips.

Properties, on every generated file:
- our reader either returns tensors or raises HeaderError (a ValueError naming the file): no other exception;
- whatever it accepts, the safetensors library accepts too (safe_open reads every tensor with the same shape
  and dtype): the library is the independent truth, and we may only be stricter than it.
Bounded: a few hundred examples, each well under a second, so it runs in CI in seconds.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from llama_tools import dtypes
from llama_tools.checkpoints import torch_load
from llama_tools.header_readers import HeaderError, read_safetensors_header, read_torch_header

CODES = [d.safetensors for d in dtypes.DTYPES.values() if d.safetensors]
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

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
