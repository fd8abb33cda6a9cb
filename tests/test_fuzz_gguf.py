"""A fuzz run of the GGUF reader: valid tiny GGUFs written by the gguf library, then mutated.

Mutations: any count, length, type id, dimension or data offset (placed by the library's own reader of the intact
file, test_hostile_gguf.field_map) set to an odd value, bytes flipped in the header region, the file cut anywhere
(at structure boundaries more often), or several of these. Bases: the suite's tiny llama GGUF with its vocabulary
(little-endian), and a big-endian one. Properties, on every generated file:
- read_gguf_tensors (any GGUF, a partial one included) either returns or raises HeaderError; read_gguf_headers
  (the config) and GgufReader either return or raise ValueError; every refusal is one line naming the file; no other
  exception, and each example within the deadline;
- whatever is accepted whole, the gguf library itself reads the same way (tensor names, GGML types, shapes, data
  offsets and byte sizes, field names): the library is the independent truth, and we may only be stricter than it.
A CLI property on a handful of examples: `count-params` exits 0, or 1 with one stderr line naming the file (or, for
a file read whole whose tensors differ from its own metadata's config, its report and a line per difference).
LLAMA_TOOLS_FUZZ_EXAMPLES sets the number of examples (default 150; a benchmark runs more).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from llama_tools.checkpoints.gguf import read as gguf_read  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.checkpoints.gguf.tensors import GgufReader, read_gguf_headers, read_gguf_tensors  # noqa: E402
from llama_tools.checkpoints.header_readers import HeaderError  # noqa: E402
from test_gguf import write_gguf  # noqa: E402
from test_hostile import assert_one_line  # noqa: E402
from test_hostile_gguf import field_map, patched, write_plain  # noqa: E402

EXAMPLES = int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CLI_FUZZ = settings(FUZZ, max_examples=max(5, EXAMPLES // 15))
ODD = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 63, 64, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
ODD_U64 = ODD + [2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[bytes, dict, int]]:
    """name -> (the intact file's bytes, its field map, where its data section starts)."""
    d = tmp_path_factory.mktemp("bases")
    write_gguf(d / "le.gguf")
    write_plain(d / "be.gguf", None, big_endian=True)
    paths = {n: d / f"{n}.gguf" for n in ("le", "be")}
    return {n: (p.read_bytes(), field_map(p), gguf.GGUFReader(p).data_offset) for n, p in paths.items()}


def mutate(data: st.DataObject, blob: bytes, fields: dict, header_end: int) -> bytes:
    """One to three mutations of `blob`: a field set to an odd value, bytes flipped, or a cut."""
    for _ in range(data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="mutations")):
        kind = data.draw(st.sampled_from(["field", "field", "field", "flip", "cut", "boundary cut"]), label="kind")
        if kind == "field":
            name = data.draw(st.sampled_from(sorted(fields)), label="field")
            f = fields[name]
            if f.offset + struct.calcsize(f.fmt) > len(blob):
                continue  # cut away by an earlier mutation
            own = struct.unpack_from(f.fmt, blob, f.offset)[0]
            top = 2**64 - 1 if f.fmt == "<Q" else 2**32 - 1
            value = data.draw(st.sampled_from(ODD_U64 if f.fmt == "<Q" else ODD)
                              | st.integers(max(0, own - 3), min(top, own + 3)), label="value")
            blob = patched(blob, f, value)
        elif kind == "flip" and blob:
            at = data.draw(st.integers(0, min(len(blob), header_end + 64) - 1), label="at")
            mask = data.draw(st.binary(min_size=1, max_size=4).map(lambda b: bytes(x or 1 for x in b)), label="mask")
            span = blob[at:at + len(mask)]
            blob = blob[:at] + bytes(a ^ b for a, b in zip(span, mask)) + blob[at + len(span):]
        elif kind == "cut":
            blob = blob[:data.draw(st.integers(0, len(blob)), label="cut")]
        elif kind == "boundary cut":
            f = fields[data.draw(st.sampled_from(sorted(fields)), label="at field")]
            blob = blob[:max(0, f.offset + data.draw(st.integers(-2, 9), label="delta"))]
    return blob


def assert_named(e: BaseException, path: Path) -> None:
    text = str(e)
    assert path.name in text and "\n" not in text, text


def library_view(path: Path):
    """What the gguf library reads: fields, and per tensor (name, type, shape rows first, data offset, bytes)."""
    r = gguf.GGUFReader(path)
    return (list(r.fields)[3:], [(t.name, t.tensor_type.name, tuple(reversed(t.shape.tolist())), int(t.data_offset),
                                  int(t.n_bytes)) for t in r.tensors])


def check(path: Path) -> str:
    """The properties of one file (see the module's docstring); what became of it."""
    gguf_read._open.cache_clear()  # a fresh parse: a flipped byte keeps the size, and maybe the mtime
    try:
        got = read_gguf_tensors(path)
    except HeaderError as e:
        assert_named(e, path)
        return "refused by the header reader"
    outcome = "read whole, compared with the library"
    for read in (read_gguf_headers, GgufReader):
        try:
            read(path)
        except ValueError as e:
            assert_named(e, path)
            outcome = f"header read, refused by {read.__name__}; compared with the library"
            break
    if got.extent.missing:
        return "partial: counted from the header"  # the library cannot slice its data (we count its header)
    reader = gguf_read.open_gguf(path)
    fields, tensors = library_view(path)  # raises if the library refuses what we accepted
    assert list(reader.fields)[3:] == fields
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in got.tensors] == [(n, d, s, b) for n, d, s, _, b in tensors]
    assert [int(t.data_offset) for t in reader.tensors] == [o for *_, o, _ in tensors]
    assert got.extent.declared <= got.extent.present
    return outcome


@FUZZ
@given(data=st.data())
def test_mutated_ggufs_are_read_as_the_library_reads_them_or_refused_in_one_line(bases, data, tmp_path_factory):
    name = data.draw(st.sampled_from(sorted(bases)), label="base")
    blob, fields, header_end = bases[name]
    path = tmp_path_factory.mktemp("fuzz") / "model.gguf"
    path.write_bytes(mutate(data, blob, fields, header_end))
    event(check(path))


@CLI_FUZZ
@given(data=st.data())
def test_count_params_on_mutated_ggufs_exits_0_or_says_one_line(bases, data, tmp_path_factory):
    blob, fields, header_end = bases["le"]
    path = tmp_path_factory.mktemp("cli") / "model.gguf"
    path.write_bytes(mutate(data, blob, fields, header_end))
    gguf_read._open.cache_clear()
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    if r.exit_code and r.stdout:  # read, but differing from its own config (a name changed): the report, a line
        assert isinstance(r.exception, SystemExit) and r.exit_code == 1 and "Traceback" not in r.output  # per problem
        assert r.stderr and all(path.name in line for line in r.stderr.splitlines()), r.stderr
        event("counted, differing from its config")
    elif r.exit_code:
        assert_one_line(r, path.name)
        event("refused in one line")
    else:
        event("counted")


def test_the_intact_bases_are_read_and_a_refusal_is_checked(bases, tmp_path):
    """The negative cases: the unmutated files pass `check` whole; a cut header is refused, in one line."""
    for name, (blob, _, header_end) in bases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(blob)
        assert check(path) == ("read whole, compared with the library" if name == "le" else
                               "header read, refused by GgufReader; compared with the library")  # big-endian
        assert not read_gguf_tensors(path).extent.missing
        cut = tmp_path / f"{name}-cut.gguf"
        cut.write_bytes(blob[:header_end // 2])
        gguf_read._open.cache_clear()
        with pytest.raises(HeaderError, match="truncated") as e:
            read_gguf_tensors(cut)
        assert_named(e.value, cut)
