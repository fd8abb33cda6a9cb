"""Read a weight file's header without its data: the tensors' names, shapes and dtypes, validated.

- torch .pth/.bin (a zip): torch_headers.py, by a restricted unpickler.
No torch import: counting a 70B checkpoint takes milliseconds.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..modeling import dtypes

# The safetensors library's own limit (MAX_HEADER_SIZE in its tensor.rs): 100,000,000 bytes, decimal.
MAX_HEADER_BYTES = 100_000_000
# serde_json's usize: shapes and offsets are unsigned 64-bit integers (20 decimal digits at most).
U64 = 2**64
# torch's and ONNX's sizes and strides are int64: one past it is no tensor torch could make (it raises TypeError).
I64 = 2**63
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class HeaderError(ValueError):
    """A weight file's header refused: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class FileExtent:
    """A weight file's bytes on disk against the bytes its header declares (header and data)."""

    file: str  # the file's name
    present: int
    declared: int

    @property
    def missing(self) -> int:
        """Bytes the header promises that the file does not hold (0: complete)."""
        return max(self.declared - self.present, 0)


class PartialFile(HeaderError):
    """A file whose data end before its header says (a download cut short): countable from its header, never loaded."""

    def __init__(self, path: Path, extent: FileExtent):
        super().__init__(f"{path}: truncated: holds {extent.present:,} of the {extent.declared:,} bytes its header "
                         f"declares ({extent.missing:,} missing), a partial download; fetch it again")
        self.path, self.extent = path, extent


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a file stores it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file: str  # file name inside the checkpoint directory (Meta shards merged: "consolidated.00-07.pth")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# --- Opening input files --------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _unreachable(path: Path, e: OSError) -> HeaderError:
    """Why an input cannot be reached, in one line: a symlink loop and a dangling link say so."""
    if e.errno == errno.ELOOP:
        return HeaderError(f"{path}: is a symbolic link loop (following it leads back to itself, or through more "
                           f"than 40 links); point it at the real file")
    if isinstance(e, FileNotFoundError):
        return HeaderError(f"{path}: " + ("a dangling symbolic link (its target does not exist)" if os.path.islink(path)
                                          else "no such file"))
    return HeaderError(f"{path}: cannot open ({e.strerror})")


def real_path(path: str | Path) -> Path:
    """An existing input with every symlink followed; one HeaderError line for a loop (Path.resolve raises
    RuntimeError on one in Python 3.11, and quietly returns a path in 3.13), a dangling link or no file."""
    path = Path(path)
    try:
        os.stat(path)
    except OSError as e:
        raise _unreachable(path, e) from None
    except ValueError:  # a NUL in the name
        raise HeaderError(f"{str(path)[:200]!r}: not a valid path (a NUL byte)") from None
    return Path(os.path.realpath(path))


def open_regular(path: str | Path) -> BinaryIO:
    """Open an input for reading only when it is a regular file: a FIFO, device or socket never blocks or streams.

    The check is made on the opened descriptor (O_NONBLOCK, so opening a FIFO cannot hang), not on a name that
    could be swapped between a stat and the open.
    """
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise HeaderError(f"{path}: is {_kind(st.st_mode)}, not a regular file; inputs must be regular files")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _unreachable(path, e) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise HeaderError(f"{path}: is {_kind(st.st_mode)}, not a regular file; inputs must be regular files")
    return os.fdopen(fd, "rb")


# --- safetensors headers --------------------------------------------------------------------------

def _bounded_int(text: str) -> int:
    # Python would parse a 10^4-digit integer (slowly, or refuse past 4300 digits with a message naming
    # nothing); no field of a header holds more than a u64, so anything longer is refused at once.
    if len(text.lstrip("-")) > 20:
        raise HeaderError(f"an integer of {len(text)} digits (a header holds unsigned 64-bit integers)")
    return int(text)


def _no_float(text: str) -> Any:
    raise HeaderError(f"the number {text[:30]!r}: every number in a header is an integer")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise HeaderError(f"key {dup[:80]!r} appears twice in one object")
    return d


def json_object(raw: bytes, path: Path | str, what: str = "", error: type[ValueError] = ValueError,
                **loads: Any) -> dict[str, Any]:
    """RAW (PATH's bytes) as a JSON object, or one `error` line naming PATH (and WHAT: "safetensors header: ")."""
    where = f"{path}: {what}"
    try:
        value = json.loads(raw.decode("utf-8"), **loads)
    except UnicodeDecodeError as e:
        raise error(f"{where}not UTF-8 text (byte {e.start})") from None
    except HeaderError as e:  # a hook of `loads` refused a value: a float, a duplicate key, an integer past its bound
        raise error(f"{where}holds {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}not valid JSON (line {e.lineno}: {e.msg})") from None
    except ValueError as e:  # Python's own bound: an integer of more than 4300 digits
        raise error(f"{where}{str(e).splitlines()[0]}") from None
    except RecursionError:
        raise error(f"{where}JSON nests too deeply (nested deeper than Python can parse)") from None
    if not isinstance(value, dict):
        raise error(f"{where}a JSON {type(value).__name__}, not an object")
    return value


def _utf8(s: str) -> bool:
    """False for strings with lone surrogates (JSON escapes Python accepts and the library's serde does not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _u64(v: Any) -> bool:
    return type(v) is int and 0 <= v < U64


def _tensor_entry(path: Path, name: str, meta: Any) -> tuple[dtypes.DType, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each field typed as the library types it."""
    where = f"{path}: tensor {name[:200]!r}"
    if not _utf8(name):
        raise HeaderError(f"{where}: name is not valid UTF-8 (a lone surrogate escape)")
    if not isinstance(meta, dict):
        raise HeaderError(f"{where}: entry is a JSON {type(meta).__name__}, not an object "
                          f"{{dtype, shape, data_offsets}}")
    if set(meta) != _TENSOR_KEYS:
        odd = sorted(set(meta) ^ _TENSOR_KEYS)
        raise HeaderError(f"{where}: entry has keys {sorted(meta)[:5]}, needs exactly dtype, shape, data_offsets "
                          f"(differs in {odd[:3]})")
    code = meta["dtype"]
    dt = dtypes.from_safetensors(code) if isinstance(code, str) else None
    if dt is None:
        known = ", ".join(d.safetensors for d in dtypes.DTYPES.values() if d.safetensors)
        raise HeaderError(f"{where}: dtype {str(code)[:40]!r} is not one llama-tools reads ({known})")
    shape = meta["shape"]
    if not isinstance(shape, list) or not all(_u64(s) for s in shape):
        raise HeaderError(f"{where}: shape {str(shape)[:80]} must be a list of non-negative integers")
    if any(s >= I64 for s in shape):  # the library's usize takes it; torch's and ONNX's int64 sizes do not
        raise HeaderError(f"{where}: shape {str(shape)[:80]} has a dimension past 2^63 - 1 (sizes are int64)")
    offsets = meta["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_u64(o) for o in offsets)):
        raise HeaderError(f"{where}: data_offsets {str(offsets)[:80]} must be [begin, end], two non-negative "
                          f"integers")
    return dt, tuple(shape), offsets[0], offsets[1]


def read_safetensors_header(path: str | Path) -> list[TensorInfo]:
    """The tensors of one .safetensors file, validated by the rules of the safetensors library itself.

    A file whose data end before its header says is refused as PartialFile (read_safetensors_extent counts it).

    Those rules (its tensor.rs, `read_metadata` and `Metadata::validate`): the header length is at most
    100,000,000 and inside the file; the header is UTF-8 JSON, an object whose `__metadata__` (optional) maps
    strings to strings and whose every other entry is {dtype, shape, data_offsets} with unsigned integers;
    sorted by offsets, the tensors tile the data exactly (each begins where the last ended, the first at 0,
    begin <= end), each spans product(shape) * itemsize bytes (no product overflowing 64 bits on the way),
    and the data end where the file ends. Anything this accepts, the library accepts (tests check it on
    fuzzed headers); it is stricter on purpose in a few places: dtypes we do not model, duplicate keys,
    extra keys in an entry, a dimension past int64 (which the library's usize takes and torch cannot make).
    """
    path = Path(path)
    infos, extent = read_safetensors_extent(path)
    if extent.missing:
        raise PartialFile(path, extent)
    return infos


def read_safetensors_extent(path: str | Path) -> tuple[list[TensorInfo], FileExtent]:
    """read_safetensors_header's tensors and checks, except that data ending early is measured, not refused.

    What a partial download still tells: every tensor's name, shape and dtype, and how many bytes are missing.
    """
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: header length {n} is over the safetensors limit of {MAX_HEADER_BYTES} "
                              f"bytes: not a safetensors file")
        if n > size - 8:
            raise HeaderError(f"{path}: header length {n} is larger than the file ({size} bytes): truncated or "
                              f"not safetensors")
        raw = f.read(n)
    if len(raw) != n:
        raise HeaderError(f"{path}: file shrank while its header was read")
    header = json_object(raw, path, "safetensors header: ", HeaderError, parse_int=_bounded_int,
                         parse_float=_no_float, parse_constant=_no_float, object_pairs_hook=_unique_pairs)
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) and _utf8(k) and _utf8(v)
                                                                for k, v in meta.items())):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings, got {str(meta)[:80]}")
    entries = sorted(((_tensor_entry(path, name, m), name) for name, m in header.items() if name != "__metadata__"),
                     key=lambda e: (e[0][2], e[0][3]))
    out, start = [], 0
    for (dt, shape, begin, end), name in entries:
        where = f"{path}: tensor {name[:200]!r}"
        if begin != start or end < begin:
            what = ("overlaps the tensor before it" if begin < start else "leaves a gap after the tensor before it"
                    if begin > start else "ends before it begins")
            raise HeaderError(f"{where}: data_offsets [{begin}, {end}] {what} (data so far end at byte {start}); "
                              f"tensors must tile the data in order")
        start = end
        numel = 1
        for s in shape:  # the library's checked_mul: an intermediate product past 64 bits is refused
            numel *= s
            if numel >= U64:
                raise HeaderError(f"{where}: shape {list(shape)} overflows 64 bits")
        itemsize = int(dt.bytes)
        if numel * itemsize * 8 >= U64:
            raise HeaderError(f"{where}: shape {list(shape)} of {dt.name} overflows 64 bits of size")
        if end - begin != numel * itemsize:
            raise HeaderError(f"{where}: spans {end - begin} bytes but shape {list(shape)} of {dt.name} needs "
                              f"{numel * itemsize}")
        out.append(TensorInfo(name, shape, dt.name, numel * itemsize, path.name))
    if 8 + n + start < size:
        raise HeaderError(f"{path}: the tensors' data end at byte {8 + n + start} but the file has {size} bytes: "
                          f"bytes no tensor covers")
    # Callers see the header's own order (the order names were written), as before.
    order = {name: i for i, name in enumerate(header)}
    return sorted(out, key=lambda t: order[t.name]), FileExtent(path.name, size, 8 + n + start)
