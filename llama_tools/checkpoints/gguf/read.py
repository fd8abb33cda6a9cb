"""Opening a GGUF file through the `gguf` library (llama.cpp's own reader), every number its header chooses bounded.

The header and tensor infos are parsed once per file version (the file memory-mapped, arrays such as the vocabulary
sized but not sliced until read); counts and lengths are bounded against the bytes left, dimensions, types,
alignment and data offsets by llama.cpp's own rules: a hostile file is one HeaderError line naming it, never a
traceback. No torch; `gguf` (and numpy) are imported when a file is opened.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from ...modeling.config import INT64_MAX
from ..header_readers import FileExtent, HeaderError, PartialFile
from .architectures import MAGIC, SUFFIX

# Bounds on what a header may say, checked before the number is used. llama.cpp's reader (gguf.cpp) sets most:
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20  # general.alignment: a power of two (llama.cpp writes 32); pages are 64 KiB at most
MAX_ARRAY_DEPTH = 8  # arrays of arrays (the library nests them by recursion; llama.cpp reads none)
MAX_DATA_BYTES = 1 << 50  # 1 PiB of tensor data: no model is near it, so a header declaring more is hostile
_MIN_KV_BYTES = 13  # the smallest key/value: key length (8), empty key, value type (4), a 1-byte value
_MIN_TENSOR_INFO_BYTES = 24  # the smallest tensor info: name length (8), empty name, n_dims (4), type (4), offset (8)


class UnmodelledGguf(ValueError):
    """A readable GGUF whose architecture or features no family here models (count-params counts its header)."""


TEMPLATE_KEY = "tokenizer.chat_template"  # llama.cpp's key; named ones are tokenizer.chat_template.<name>


def is_template_key(key: str) -> bool:
    """Whether KEY holds a chat template (the default one, or a named one)."""
    return key == TEMPLATE_KEY or key.startswith(TEMPLATE_KEY + ".")


class NotUtf8(bytes):
    """A chat template's raw bytes that are not UTF-8, as its field's value: encoding text needs no template, so it
    is refused (`problem`) only where a template is used (a chat turn, a conversion)."""

    path: str
    key: str
    why: str

    @classmethod
    def of(cls, raw: bytes, path: Any, key: str, e: UnicodeDecodeError) -> "NotUtf8":
        out = cls(raw)
        out.path, out.key, out.why = str(path), key, f"{e.reason} at byte {e.start}"
        return out

    @property
    def problem(self) -> str:
        return f"{self.path}: GGUF metadata {self.key} is not UTF-8 text ({self.why})"


def _not_utf8(path: Any, key: str, e: UnicodeDecodeError, item: int | None = None) -> HeaderError:
    """The one line for a string of KEY (item ITEM of its array) that is not UTF-8."""
    which = f"{key} item {item:,}" if item is not None else key
    return HeaderError(f"{path}: GGUF metadata {which} is not UTF-8 text ({e.reason} at byte {e.start})")


def is_gguf(path: str | Path) -> bool:
    """A file named .gguf, or any file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == SUFFIX:
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def _dtype(dtype: Any, order: str) -> Any:
    import numpy as np

    return np.dtype(dtype).newbyteorder(order)


# The library's private helpers FastReader hooks; with one gone (another gguf version), the library's own reader.
_HOOKS = ("_get", "_get_str", "_get_field_parts", "_build_fields", "_build_tensor_info", "_build_tensors",
          "_push_field")


def _said(e: BaseException) -> str:
    """An exception's first line (a KeyError's without its quotes), else its type's name."""
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _reader_class() -> type:
    import struct
    import sys

    import gguf
    import numpy as np

    if not all(callable(getattr(gguf.GGUFReader, h, None)) for h in _HOOKS):
        return gguf.GGUFReader  # slower, fewer bounds; _open still turns its exceptions into one line
    ARRAY, STRING, UINT32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
    KNOWN = {int(t) for t in gguf.GGUFValueType}
    # GGML type id -> (type, weights per block, bytes per block): the types the library sizes; no others are read
    SIZES = {int(t): (t, int(w), int(b)) for t, (w, b) in gguf.GGML_QUANT_SIZES.items()}
    ERRORS = (ValueError, KeyError, IndexError, OverflowError, TypeError, struct.error)  # the library's, on bad bytes

    class Unsliced:
        """Where the library's parts of an array would go: the value's offset, until first read."""

        def __init__(self, offset: int):
            self.offset = offset

    class ArrayField(gguf.ReaderField):
        """An array field (a vocabulary, its token types, its merges) whose per-item slices are made when first read.

        `parts` and `data` are the library's own, built by its parser on first access; name, offset and types are
        known without them, and `contents()` decodes the values straight from the map, slicing nothing.
        """

        def __new__(cls, field: Any, build: Any, values: Any) -> "ArrayField":
            self = super().__new__(cls, *field)
            self._build, self._values = build, values
            return self

        @functools.cached_property
        def _full(self) -> Any:
            return self._build()

        parts = property(lambda self: self._full.parts)  # type: ignore[assignment]
        data = property(lambda self: self._full.data)  # type: ignore[assignment]

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            """The library's contents(): the items as Python values (str, int, float, bool), an index or a slice."""
            return self._values()[index_or_slice]

    class TextField(gguf.ReaderField):
        """A string field decoded when read, as the library's, but bytes that are not UTF-8 named by file and key (a
        chat template's come back as NotUtf8, refused only where it is used)."""

        def __new__(cls, field: Any, path: Path) -> "TextField":
            self = super().__new__(cls, *field)
            self._path = path
            return self

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            raw = self.parts[-1].tobytes()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if is_template_key(self.name):
                    return NotUtf8.of(raw, self._path, self.name, e)
                raise _not_utf8(self._path, self.name, e) from None

    class FastReader(gguf.GGUFReader):
        """gguf.GGUFReader with its per-field slicing done on a plain ndarray view of the same memory map, each array
        sliced only when read, and every number the file chooses bounded before the library uses it.

        The library slices its np.memmap once per array item (~250k slices for a 49k vocabulary), and memmap's
        Python-level __array_finalize__/__getitem__ make that 3.8 s; the same slices of a plain view of the map
        take a fifth of it. Counting, config and tensor reads need none of those slices (one or two numpy views
        per item: 130 MB and 1 s for Qwen2's 152k tokens, their types and 151k merges), so an array is only
        sized (strings walked by their lengths) until its contents are asked for. Parsing stays the library's;
        tensor data stays mapped, never copied. Its hooks refuse, as one HeaderError naming the file and the field,
        what would make the library loop, allocate or overflow: counts and lengths past the bytes left, unknown
        value and tensor types, more than 4 dimensions, element counts past 64 bits, misplaced data offsets, an
        alignment that is no power of two; whatever else the library raises on bad bytes is named the same way.
        """

        _eager = False
        _tensor_data = False
        _depth = 0  # arrays being parsed, one inside another
        _at = "header"  # what is being parsed, for a refusal's words

        def __init__(self, path: Any):
            self._path = Path(path)
            try:
                super().__init__(path)
            except HeaderError:
                raise
            except UnicodeDecodeError as e:  # the library decodes keys and tensor names as it parses them
                raise HeaderError(f"{self._path}: GGUF {self._at}: its name is not UTF-8 text ({e.reason} at byte "
                                  f"{e.start} of it)") from None
            except ERRORS as e:
                raise HeaderError(f"{self._path}: GGUF {self._at}: {_said(e)}") from None

        @property
        def data(self) -> Any:
            return self._mapped

        @data.setter
        def data(self, value: Any) -> None:
            self._mapped = value.view(np.ndarray)  # the same pages; the memmap stays alive as its base

        def _refuse(self, why: str) -> HeaderError:
            return HeaderError(f"{self._path}: GGUF {self._at}: {why}")

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            order = self.byte_order if override_order is None else override_order
            dt = _dtype(dtype, order)
            offset, count = int(offset), int(count)
            end = offset + dt.itemsize * count
            if count < 0 or end > self._mapped.size:
                if self._tensor_data and count >= 0:
                    # A partial file (a download cut short): the header is whole but this tensor's data are not all
                    # there. A zero-stride placeholder of its shape (bounded by _build_tensors) lets the header
                    # parse, reading and allocating nothing; open_gguf then refuses the file to every reader of
                    # data (gguf_extent says what is short).
                    return np.lib.stride_tricks.as_strided(np.zeros(1, dt), shape=(count,), strides=(0,),
                                                           writeable=False)
                raise self._refuse(f"needs bytes {offset:,} to {end:,}, the file ends at byte {self._mapped.size:,} "
                                   f"(truncated)")
            return np.frombuffer(self._mapped, dtype=dt, count=count, offset=offset)

        def _get_str(self, offset: int) -> Any:
            length = self._get(offset, np.uint64)
            n, left = int(length[0]), self._mapped.size - offset - 8
            if n > left:
                raise self._refuse(f"a string of {n:,} bytes at byte {offset:,} runs past the end of the file "
                                   f"({left:,} bytes left): a wrong length, or a truncated file")
            return length, self._get(offset + 8, np.uint8, n)

        def _build_fields(self, offs: int, count: int) -> int:
            kvs, tensors = int(count), int(self.fields["GGUF.tensor_count"].parts[0][0])
            left = self._mapped.size - offs
            for n, key, least in ((kvs, "GGUF.kv_count", _MIN_KV_BYTES),
                                  (tensors, "GGUF.tensor_count", _MIN_TENSOR_INFO_BYTES)):
                if n * least > left:  # before any loop: 2^62 entries would run for ever, or overflow C sizes
                    raise self._refuse(f"{key} is {n:,}, more than the {left:,} bytes after the header can hold "
                                       f"({least} bytes each at least): a wrong count, or a truncated file")
            if kvs * _MIN_KV_BYTES + tensors * _MIN_TENSOR_INFO_BYTES > left:
                raise self._refuse(f"{kvs:,} key/value pairs and {tensors:,} tensor infos need more than the {left:,} "
                                   f"bytes after the header: wrong counts, or a truncated file")
            for i in range(kvs):
                self._at = f"key/value {i + 1} of {kvs} ({self._peek_key(offs)}at byte {offs:,})"
                offs = super()._build_fields(offs, 1)
            self._at = "header"
            for name, f in list(self.fields.items()):
                if len(f.parts) == 4 and isinstance(f.parts[3], Unsliced):
                    at = f.parts[3].offset
                    self.fields[name] = ArrayField(f, functools.partial(self._array, f, at),
                                                   functools.partial(self._values, at, name))
                elif list(f.types) == [STRING]:
                    self.fields[name] = TextField(f, self._path)
            return offs

        def _peek_key(self, offs: int) -> str:
            """The key at `offs` quoted, then ', ' (for a refusal's words) when short, whole and UTF-8; else ''."""
            raw = self._mapped[offs:offs + 8].tobytes()
            if len(raw) < 8:
                return ""
            n = struct.unpack("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q", raw)[0]
            if n > 200 or offs + 8 + n > self._mapped.size:
                return ""
            try:
                return f"{self._mapped[offs + 8:offs + 8 + n].tobytes().decode('utf-8')!r}, "
            except UnicodeDecodeError:
                return ""

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            kind = int(raw_type)
            if kind not in KNOWN:
                raise self._refuse(f"value type {kind} is not a GGUF value type (0 to {max(KNOWN)})")
            if kind != ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            if item not in KNOWN:
                raise self._refuse(f"an array of value type {item}, not a GGUF value type (0 to {max(KNOWN)})")
            scalar = self.gguf_scalar_to_np.get(item)  # type: ignore[call-overload]
            least = np.dtype(scalar).itemsize if scalar is not None else 8 if item == STRING else 12  # per item
            left = self._mapped.size - orig_offs - 12
            if count * least > left:  # before the library loops over the items
                raise self._refuse(f"an array of {count:,} {gguf.GGUFValueType(item).name} items needs "
                                   f"{count * least:,} bytes at least, {left:,} are left in the file: a wrong count, "
                                   f"or a truncated file")
            if self._depth >= MAX_ARRAY_DEPTH:  # the library recurses once per level
                raise self._refuse(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            self._depth += 1
            try:
                if self._eager:
                    return super()._get_field_parts(orig_offs, raw_type)
                if item == ARRAY:  # arrays of arrays: the library's own parse, all of it
                    return self._parts(orig_offs, raw_type)
                return self._sized(orig_offs, item, count, scalar)
            finally:
                self._depth -= 1

        def _sized(self, orig_offs: int, item: int, count: int, scalar: Any) -> Any:
            """An array of scalars or strings walked by its lengths, nothing sliced: (size, parts, idxs, types)."""
            types = [ARRAY] + ([gguf.GGUFValueType(item)] if count else [])  # as the library's
            end, offs = len(self._mapped), orig_offs + 12
            if scalar is not None:
                offs += count * np.dtype(scalar).itemsize
            else:  # strings: each a u64 length, then its bytes
                length = struct.Struct("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q")
                with memoryview(self._mapped) as buf:  # unpack_from reads a memoryview faster than an ndarray
                    for _ in range(count):  # bounded: count * 8 bytes are there
                        if offs + 8 > end:
                            offs = end + 1
                            break
                        offs += 8 + length.unpack_from(buf, offs)[0]
            if offs > end:
                raise self._refuse(f"an array at byte {orig_offs:,} runs past the end of the file ({end:,} bytes): "
                                   f"a wrong string length or count, or a truncated file")
            return offs - orig_offs, [Unsliced(orig_offs)], [], types

        def _build_tensor_info(self, offs: int, count: int) -> Any:
            n, fields = int(count), []  # bounded by _build_fields
            for i in range(n):
                self._at = f"tensor info {i + 1} of {n} (at byte {offs:,})"
                length, name = self._get_str(offs)
                shown = name.tobytes()[:80].decode("utf-8", "replace")
                self._at = f"tensor info {i + 1} of {n} ({shown!r}, at byte {offs:,})"
                n_dims = int(self._get(offs + 8 + int(length[0]), np.uint32)[0])
                if n_dims > MAX_DIMS:  # before the library reads that many dimensions
                    raise self._refuse(f"{n_dims:,} dimensions, more than GGML's {MAX_DIMS}")
                offs, got = super()._build_tensor_info(offs, 1)
                self._check_tensor_info(got[0])
                fields += got
            self._at = "header"
            self._check_alignment()
            return offs, fields

        def _check_tensor_info(self, field: Any) -> None:
            """Dimensions, type and size of one tensor info, by llama.cpp's rules, before the library uses them."""
            dims, raw_type = [int(d) for d in field.parts[3].tolist()], field.parts[4]
            kind = SIZES.get(int(raw_type[0]))
            if kind is None:
                raise self._refuse(f"GGML type {int(raw_type[0])} is not a tensor type the gguf library knows")
            numel = math.prod(dims)
            if numel > INT64_MAX:
                raise self._refuse(f"dimensions {dims} hold {numel:,} elements, more than a 64-bit count")
            qtype, block, block_bytes = kind
            if (dims[0] if dims else 1) % block:
                raise self._refuse(f"rows of {dims[0] if dims else 1:,} weights are not whole {qtype.name} blocks of "
                                   f"{block}")
            if numel * block_bytes // block > MAX_DATA_BYTES:
                raise self._refuse(f"dimensions {dims} of {qtype.name} are {numel * block_bytes // block:,} bytes, "
                                   f"more than {MAX_DATA_BYTES:,} (1 PiB)")

        def _check_alignment(self) -> None:
            f = self.fields.get("general.alignment")
            if f is None:
                return
            if list(f.types) != [UINT32]:
                raise self._refuse(f"general.alignment is stored as {'/'.join(t.name for t in f.types)}; GGUF "
                                   f"stores it as UINT32")
            a = int(f.parts[-1][0])
            if not 0 < a <= MAX_ALIGNMENT or a & (a - 1):
                raise self._refuse(f"general.alignment is {a:,}, not a power of two up to {MAX_ALIGNMENT:,}")

        def _build_tensors(self, start_offs: int, fields: Any) -> None:
            align, end = int(self.alignment), 0  # end: where the next tensor's data start, in the data section
            before = "the data section starts"
            for f in fields:  # llama.cpp's layout: each tensor's data where the previous one's end, padded
                self._at = f"tensor {f.name!r}"
                offset, kind = int(f.parts[5][0]), SIZES[int(f.parts[4][0])]
                dims = [int(d) for d in f.parts[3].tolist()]
                if offset % align:
                    raise self._refuse(f"its data offset {offset:,} is not a multiple of the alignment ({align})")
                if offset != end:
                    raise self._refuse(f"its data offset is {offset:,}, not {end:,} where {before}; llama.cpp "
                                       f"refuses such a file too")
                nbytes = math.prod(dims) * kind[2] // kind[1]
                end += -(-nbytes // align) * align
                before = f"{f.name!r} ends (dimensions {dims}, {kind[0].name}: {nbytes:,} bytes, padded to {align})"
                if start_offs + end > MAX_DATA_BYTES:
                    raise self._refuse(f"the tensor data would end at byte {start_offs + end:,}, past "
                                       f"{MAX_DATA_BYTES:,} (1 PiB)")
            self._at = "tensor data"
            self._tensor_data = True  # these reads are tensor data, which a partial file may lack; no others
            try:
                super()._build_tensors(start_offs, fields)
            finally:
                self._tensor_data = False
            self._at = "header"

        def _parts(self, offs: int, raw_type: int) -> Any:
            """The library's own parse of one value, every item sliced."""
            self._eager = True
            try:
                return super()._get_field_parts(offs, raw_type)
            finally:
                self._eager = False

        def _values(self, value_offs: int, key: str) -> list[Any]:
            """An array's items as Python values, read from the map (not kept: a vocabulary is ~10 MB of str)."""
            item, count = int(self._get(value_offs, np.uint32)[0]), int(self._get(value_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item)  # type: ignore[call-overload]
            if scalar is not None:
                return self._get(value_offs + 12, scalar, count).tolist()
            length = struct.Struct("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q")
            out, offs, buf = [], value_offs + 12, self._mapped
            for i in range(count):  # sized when the header was parsed, so every string is inside the file
                n = length.unpack_from(buf, offs)[0]
                try:
                    out.append(str(buf[offs + 8:offs + 8 + n].tobytes(), encoding="utf-8"))  # strict, as the library
                except UnicodeDecodeError as e:
                    raise _not_utf8(self._path, key, e, i) from None
                offs += 8 + n
            return out

        def _array(self, field: Any, value_offs: int) -> Any:
            """The library's own field for an array (what its parser would have made up front)."""
            _, parts, idxs, types = self._parts(value_offs, ARRAY)
            head = list(field.parts[:3])  # key length, key, value type
            return gguf.ReaderField(field.offset, field.name, head + parts, [i + len(head) for i in idxs], types)

    return FastReader


def open_gguf(path: str | Path, partial_ok: bool = False) -> Any:
    """The gguf library's reader over `path` (memory-mapped); one HeaderError line for what is not a readable GGUF.

    One parse per file version: resolving MODEL, counting and reading weights share it. A file whose tensor data
    end before its header says is refused (PartialFile) unless partial_ok (counting its header only).
    """
    p = Path(path).resolve()
    st = p.stat()
    reader = _open(p, st.st_ino, st.st_mtime_ns, st.st_size)
    if not partial_ok:
        refuse_partial(reader, Path(path))
    return reader


def refuse_partial(reader: Any, path: Path) -> None:
    """PartialFile when the file's tensor data end before its header says (a download cut short)."""
    extent = gguf_extent(reader, path)
    if extent.missing:
        raise PartialFile(path, extent)


def gguf_extent(reader: Any, path: Path) -> FileExtent:
    """The file's bytes against the end of the last tensor's data, as the header places it."""
    declared = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    return FileExtent(path.name, int(reader.data.size), declared)


@functools.lru_cache(maxsize=2)
def _open(p: Path, inode: int, mtime_ns: int, size: int) -> Any:
    import struct

    try:
        reader = _reader_class()(p)
    except HeaderError:
        raise
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, struct.error, OSError) as e:
        raise HeaderError(f"{p}: not a readable GGUF file ({_said(e)})") from None
    reader._path = p  # field_value's refusals name the file
    return reader


def field_value(reader: Any, key: str, default: Any = None, *, lazy: bool = False) -> Any:
    """A metadata field's Python value (str, int, float, bool or list), `default` when absent; a string that is not
    UTF-8 is one line naming the file and key, but with `lazy` a chat template's comes back as NotUtf8."""
    f = reader.fields.get(key)
    if f is None:
        return default
    path = getattr(reader, "_path", "a GGUF file")
    try:
        value = f.contents()
    except UnicodeDecodeError as e:  # the library's own reader: strings are decoded when read
        if not (lazy and is_template_key(key) and len(f.types) == 1):
            raise _not_utf8(path, key, e) from None
        value = NotUtf8.of(bytes(f.parts[-1]), path, key, e)
    if isinstance(value, NotUtf8) and not lazy:
        raise HeaderError(value.problem)
    return value


def template_problem(path: str | Path) -> str | None:
    """Why a GGUF's chat template cannot be used (its bytes are not UTF-8), naming the file and key; else None."""
    value = field_value(open_gguf(path), TEMPLATE_KEY, lazy=True)
    return value.problem if isinstance(value, NotUtf8) else None


_KINDS = {int: f"a whole number from 0 to {INT64_MAX}", float: "a finite number", str: "a string",
          bool: "true or false"}


def meta_value(reader: Any, path: Path, key: str, kind: type, default: Any = None) -> Any:
    """A metadata field's value, refused in one line unless of `kind` (int, float, str or bool); `default` when
    absent."""
    v = field_value(reader, key)
    if v is None:
        return default
    ok = (kind is bool and isinstance(v, bool)) or not isinstance(v, bool) and (
        (kind is int and isinstance(v, int) and 0 <= v <= INT64_MAX)
        or (kind is float and isinstance(v, (int, float)) and math.isfinite(v))
        or (kind is str and isinstance(v, str)))
    if not ok:
        shown = f"an array of {len(v)} items" if isinstance(v, list) else repr(v[:40] if isinstance(v, str) else v)
        raise HeaderError(f"{path}: GGUF metadata {key} is {shown}, not {_KINDS[kind]}")
    return v
