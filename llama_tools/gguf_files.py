"""GGUF files (llama.cpp's single-file checkpoints) through the `gguf` library, llama.cpp's own reader.

A .gguf holds the config (llama.* metadata), the vocabulary (tokenizer.ggml.*) and the tensors, most of them
quantized in blocks (Q4_1: 32 weights in 20 bytes). Read here:
- `read_gguf_headers`: header and tensor infos only (the file is memory-mapped, no tensor data is touched,
  arrays such as the vocabulary are sized but not sliced until read), the config they describe, checked
  against the tensors' names and shapes; what `count-params` shows.
- `GgufReader`: module-named fp32 tensors dequantized one at a time by `gguf.quants.dequantize` (every block
  type the library reads; any other is refused up front, naming the tensor), their rows read in chunks with
  positioned reads; the same interface as `reference.CheckpointReader`, so the streamed reference and the
  ONNX export read a GGUF as they read a checkpoint directory.
- `read_gguf_checkpoint`: every weight dequantized to one dtype, tensor by tensor (for `convert`).
llama.cpp's converter permutes HF's q/k rows into Meta's interleaved order, so a GGUF's q/k rows are
interleaved (formats.FORMATS["gguf"].rope_layout) and `convert --to hf` permutes them back.
Every number a file chooses is bounded before it is used (counts and lengths against the bytes left, dimensions,
types, alignment and data offsets by llama.cpp's own rules), and a modelled architecture's sizes are checked against
its tensors' shapes before any config is built: a hostile file is one HeaderError line naming it, never a traceback.
No torch at import; `gguf` (and numpy) are imported when a file is read.
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import INT64_MAX, ModelConfig, RopeScaling
from .families import FAMILIES, FULL, SLIDING
from .rope_layouts import HALF
from .formats import FORMATS, checkpoint_tensors
from .header_readers import FileExtent, HeaderError, PartialFile, TensorInfo
from .weight_files import CheckpointHeaders, WeightFiles
from .weights import weight_specs


SUFFIX = ".gguf"
MAGIC = b"GGUF"
KIND = "gguf"  # WeightFiles.kind of a GGUF source
GGUF = FORMATS[KIND]


@dataclass(frozen=True)
class GgufArchitecture:
    """A general.architecture we read: the family it is, and how llama.cpp's converter stores it."""

    family: str
    rope_layout: str  # the q/k row order of its files
    gains_plus_one: bool = False  # norm gains stored as 1 + γ (Gemma's): γ is the stored value minus 1
    swa_pattern: int = 0  # llama.cpp's sliding-window pattern when the file names none: n - 1 local, 1 global
    swa_base: float | None = None  # the local layers' RoPE base when the file names none (llama.cpp's default)
    big_layers: int = 0  # the block count of the size that scales queries by n2 / n5, not n6 (Gemma 2/3 27B)


# llama.cpp writes Mistral as "llama" and permutes its q/k rows to Meta's interleaved order (its rope type NORM);
# the others keep HF's rows (rope type NEOX: the two halves); biases and q/k norms are found by tensor names.
# Gemma's converter adds 1 to every norm gain, and llama.cpp fixes what the files leave out (the window pattern,
# the local base, the query scale) by architecture and size: so do we.
ARCHITECTURES = {"llama": GgufArchitecture("llama", GGUF.rope_layout),
                 "qwen2": GgufArchitecture("qwen2", HALF),
                 "qwen3": GgufArchitecture("qwen3", HALF),
                 "gemma": GgufArchitecture("gemma", HALF, gains_plus_one=True),
                 "gemma2": GgufArchitecture("gemma2", HALF, gains_plus_one=True, swa_pattern=2, big_layers=46),
                 "gemma3": GgufArchitecture("gemma3", HALF, gains_plus_one=True, swa_pattern=6, swa_base=10000.0,
                                            big_layers=62)}
_LAYER = re.compile(r"^blk\.(\d+)\.")

# Bounds on what a header may say, checked before the number is used. llama.cpp's reader (gguf.cpp) sets most:
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20  # general.alignment: a power of two (llama.cpp writes 32); pages are 64 KiB at most
MAX_ARRAY_DEPTH = 8  # arrays of arrays (the library nests them by recursion; llama.cpp reads none)
MAX_DATA_BYTES = 1 << 50  # 1 PiB of tensor data: no model is near it, so a header declaring more is hostile
_MIN_KV_BYTES = 13  # the smallest key/value: key length (8), empty key, value type (4), a 1-byte value
_MIN_TENSOR_INFO_BYTES = 24  # the smallest tensor info: name length (8), empty name, n_dims (4), type (4), offset (8)


class UnmodelledGguf(ValueError):
    """A readable GGUF whose architecture or features no family here models (count-params counts its header)."""


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
                                                   functools.partial(self._values, at))
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

        def _values(self, value_offs: int) -> list[Any]:
            """An array's items as Python values, read from the map (not kept: a vocabulary is ~10 MB of str)."""
            item, count = int(self._get(value_offs, np.uint32)[0]), int(self._get(value_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item)  # type: ignore[call-overload]
            if scalar is not None:
                return self._get(value_offs + 12, scalar, count).tolist()
            length = struct.Struct("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q")
            out, offs, buf = [], value_offs + 12, self._mapped
            for _ in range(count):  # sized when the header was parsed, so every string is inside the file
                n = length.unpack_from(buf, offs)[0]
                out.append(str(buf[offs + 8:offs + 8 + n].tobytes(), encoding="utf-8"))  # strict, as the library
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


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata field's Python value (str, int, float, bool or list), `default` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError as e:  # strings are decoded when read, not when the header is parsed
        raise HeaderError(f"{getattr(reader, '_path', 'a GGUF file')}: GGUF metadata {key} is not UTF-8 text "
                          f"({e.reason} at byte {e.start})") from None


_KINDS = {int: f"a whole number from 0 to {INT64_MAX}", float: "a finite number", str: "a string"}


def meta_value(reader: Any, path: Path, key: str, kind: type, default: Any = None) -> Any:
    """A metadata field's value, refused in one line unless of `kind` (int, float or str); `default` when absent."""
    v = field_value(reader, key)
    if v is None:
        return default
    ok = not isinstance(v, bool) and (
        (kind is int and isinstance(v, int) and 0 <= v <= INT64_MAX)
        or (kind is float and isinstance(v, (int, float)) and math.isfinite(v))
        or (kind is str and isinstance(v, str)))
    if not ok:
        shown = f"an array of {len(v)} items" if isinstance(v, list) else repr(v[:40] if isinstance(v, str) else v)
        raise HeaderError(f"{path}: GGUF metadata {key} is {shown}, not {_KINDS[kind]}")
    return v


# What a modelled architecture's sizes say of its tensors' shapes, in GGML order (ne[0]: a row's width, torch's last
# axis): tensor name (blk.N. taken off) -> the size key of each axis.
_SHAPES = {"token_embd.weight": ("hidden", "vocab"), "output.weight": ("hidden", "vocab"),
           "output_norm.weight": ("hidden",), "attn_norm.weight": ("hidden",), "ffn_norm.weight": ("hidden",),
           "attn_q.weight": ("hidden", "q"), "attn_k.weight": ("hidden", "kv"), "attn_v.weight": ("hidden", "kv"),
           "attn_output.weight": ("q", "hidden"), "ffn_gate.weight": ("hidden", "ffn"),
           "ffn_up.weight": ("hidden", "ffn"), "ffn_down.weight": ("ffn", "hidden")}


def check_metadata(reader: Any, path: Path) -> None:
    """A modelled architecture's sizes against its tensors' shapes, before any config is built from them: one line
    naming the key, the tensor and both numbers. Other architectures are counted from their headers, unchecked."""
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        return
    shapes = {t.name: [int(d) for d in t.shape.tolist()] for t in reader.tensors}

    def size(key: str, default: Any = None) -> Any:
        return meta_value(reader, path, f"{arch}.{key}", int, default)

    layers = size("block_count")
    blocks = {name: int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    held = max(blocks.values()) + 1 if blocks else 0
    if layers is not None and held != layers:
        last = f" ({max(blocks, key=blocks.__getitem__)} the last)" if blocks else ""
        raise HeaderError(f"{path}: its metadata says {layers:,} decoder layers ({arch}.block_count), the file holds "
                          f"tensors of {held:,}{last}")
    hidden, heads, ffn, vocab = size("embedding_length"), size("attention.head_count"), size("feed_forward_length"), \
        size("vocab_size")
    kv = size("attention.head_count_kv", heads)
    for key, v in (("attention.head_count", heads), ("attention.head_count_kv", kv), ("embedding_length", hidden)):
        if v == 0:
            raise HeaderError(f"{path}: GGUF metadata {arch}.{key} is 0; a model has at least one")
    width = size("attention.key_length", 0)
    width_said = f"{arch}.attention.key_length"
    if not width and hidden and heads and not hidden % heads:  # else ModelConfig says what is wrong
        width, width_said = hidden // heads, f"{arch}.embedding_length / {arch}.attention.head_count"
    said = {"hidden": (f"{arch}.embedding_length", hidden), "vocab": (f"{arch}.vocab_size", vocab),
            "ffn": (f"{arch}.feed_forward_length", ffn),
            "q": (f"{arch}.attention.head_count ({heads}) x head width ({width}, {width_said})",
                  heads * width if heads and width else None),
            "kv": (f"{arch}.attention.head_count_kv ({kv}) x head width ({width}, {width_said})",
                   kv * width if kv and width else None)}
    for name, ne in shapes.items():
        axes = _SHAPES.get(name.split(".", 2)[2] if name in blocks else name)
        if axes is None:
            continue  # biases, q/k norms, what no rule here covers: GgufReader checks every shape it reads
        shape = list(reversed(ne))  # as torch has it
        if len(ne) != len(axes):
            raise HeaderError(f"{path}: tensor {name!r} has shape {shape}; {arch} stores it with {len(axes)} "
                              f"dimension{'s' if len(axes) > 1 else ''}")
        for axis, (got, what) in enumerate(zip(ne, axes)):
            key, want = said[what]
            if want is not None and got != want:
                where = "elements" if len(ne) == 1 else ("columns" if axis == 0 else "rows")
                raise HeaderError(f"{path}: metadata {key} says {want:,}, tensor {name!r} has {got:,} {where} "
                                  f"(shape {shape})")


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's llama.* metadata and tensor names describe; one line for other architectures."""
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UnmodelledGguf(f"{path}: GGUF architecture {arch!r} is not LLaMA-family; llama-tools reads "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    names = {t.name for t in reader.tensors}

    def get(key: str, kind: type, default: Any = None, required: bool = True) -> Any:
        v = meta_value(reader, path, f"{arch}.{key}", kind, default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return v

    if get("expert_count", int, 0, required=False):
        raise UnmodelledGguf(f"{path}: a mixture-of-experts GGUF ({arch}.expert_count); llama-tools reads dense ones")
    if "rope_freqs.weight" in names:
        raise UnmodelledGguf(f"{path}: per-dimension RoPE factors (rope_freqs.weight, Llama 3.1's scaling) are not "
                             f"read from GGUF yet")
    hidden, heads = get("embedding_length", int), get("attention.head_count", int)
    head_dim = get("attention.key_length", int, 0, required=False) or hidden // max(heads, 1)
    rotary = get("rope.dimension_count", int, head_dim, required=False)
    if rotary != head_dim:
        raise UnmodelledGguf(f"{path}: partial rotary ({arch}.rope.dimension_count {rotary} of head width "
                             f"{head_dim}) is not LLaMA's RoPE")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", int, None, required=False) or (int(emb.shape[-1]) if emb is not None else None) or (
        len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF holds neither {arch}.vocab_size, token_embd.weight nor a vocabulary")
    scaling = None
    kind = get("rope.scaling.type", str, None, required=False)
    if kind not in (None, "none"):
        scaling = RopeScaling(type=kind, factor=float(get("rope.scaling.factor", float, 1.0, required=False)),
                              original_max_position_embeddings=get("rope.scaling.original_context_length", int,
                                                                   8192, required=False))
    bos, eos, pad = (meta_value(reader, path, f"tokenizer.ggml.{k}_token_id", int) for k in ("bos", "eos", "padding"))
    import numpy as np

    a = ARCHITECTURES[arch]
    layers = get("block_count", int)  # check_metadata: as many as the file holds blk.N. tensors of
    family = FAMILIES[a.family].defaults
    extra: dict[str, Any] = {k: v for k, v in family.items() if k != "qkv_bias"}
    window = get("attention.sliding_window", int, None, required=False)
    if window:
        pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")  # per layer: true = local
        if isinstance(pattern, list) and len(pattern) == layers:
            types = tuple(SLIDING if x else FULL for x in pattern)
        elif a.swa_pattern:
            types = tuple(SLIDING if (j + 1) % a.swa_pattern else FULL for j in range(layers))
        else:
            types = None
        extra.update(sliding_window=window, layer_types=types)
    if a.family in ("gemma2", "gemma3"):
        scale = get("attention.scale", float, None, required=False)  # a file's own query scale wins over llama.cpp's
        extra["query_pre_attn_scalar"] = (float(str(np.float32(1.0 / float(scale) ** 2))) if scale else
                                          float(hidden // heads if layers == a.big_layers else head_dim))
        for key, field in (("attn_logit_softcapping", "attn_logit_softcap"),
                           ("final_logit_softcapping", "final_logit_softcap")):
            v = get(key, float, None, required=False)
            extra[field] = _f32(v) if v else None
    base = get("rope.freq_base_swa", float, a.swa_base, required=False)
    if base is not None:
        extra["rope_local_theta"] = _f32(base)
    return ModelConfig(
        **extra, pad_token_id=pad,
        name=path.stem, source=str(path), family=a.family,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length", int),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", int, heads, required=False),
        head_dim=head_dim if head_dim != hidden // max(heads, 1) else 0,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", float, 1e-5, required=False)),
        rope_theta=_f32(get("rope.freq_base", float, 10000.0, required=False)), rope_scaling=scaling,
        rope_layout=a.rope_layout, max_position_embeddings=get("context_length", int, 2048, required=False),
        tie_word_embeddings="output.weight" not in names,  # llama.cpp leaves the tied lm_head out
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=bos if bos is not None else 1, eos_token_id=eos if eos is not None else 2,
    )


def _f32(value: Any) -> float:
    """A float32 field as the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


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
    return CheckpointHeaders(p, WeightFiles(KIND, (p,)), [infos], cfg, infos, GGUF, blocks=block_sizes(reader))


# --- Reading tensors, dequantized -------------------------------------------------------------------------

# Quantized bytes are read with positioned reads this many fp32 bytes of rows at a time, not through the memory
# map: every page of a map that was touched counts in RSS until it is unmapped, which would add the whole file
# to an export's peak; a chunk also bounds the library's per-call temporaries (it builds its output twice).
CHUNK_BYTES = 16 << 20


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

    Names and shapes are checked against the metadata's config up front; no tensor is read until asked.
    """

    def __init__(self, path: str | Path):
        p = Path(path)
        self.path, self.directory = p, p.parent
        self._gguf = open_gguf(p, partial_ok=True)
        check_metadata(self._gguf, p)
        refuse_partial(self._gguf, p)
        cfg = gguf_config(self._gguf, p)
        infos = tensor_infos(self._gguf, p)
        self.files, self.format, self.cfg = WeightFiles(KIND, (p,)), GGUF, cfg  # q/k rows as stored: interleaved
        self.gains_plus_one = ARCHITECTURES[field_value(self._gguf, "general.architecture")].gains_plus_one
        self.info: dict[str, TensorInfo] = {t.name: t for t in infos}
        self._tensors = {t.name: t for t in self._gguf.tensors}
        self.where: dict[str, str] = {}  # module name -> stored name
        for ct in checkpoint_tensors(cfg, GGUF):
            t = self.info.get(ct.name)
            if t is None:
                raise ValueError(f"{p}: tensor {ct.name!r} that its metadata predicts is not in the file")
            if t.shape != ct.shape:
                raise ValueError(f"{p}: tensor {ct.name!r} has shape {list(t.shape)}, its metadata predicts "
                                 f"{list(ct.shape)}")
            self.where[ct.parts[0]] = ct.name
        extra = sorted(set(self.info) - set(self.where.values()))
        if extra:
            raise ValueError(f"{p}: tensor {extra[0]!r} is not a weight of the {cfg.family} model its metadata "
                             f"describes")
        if self._gguf.byte_order != "I":  # the library's dequantizers read the host's byte order only
            raise ValueError(f"{p}: a GGUF of the other byte order (big-endian); llama-tools reads little-endian ones")
        for name in self.where.values():  # refused before any export or conversion starts writing
            t = self._tensors[name]
            if not dequantizable(t.tensor_type):
                raise ValueError(f"{p}: tensor {name!r} is stored as {t.tensor_type.name}, a type the gguf library "
                                 f"cannot dequantize")
        self.weight_bytes = sum(t.nbytes for t in infos)

    def _dequantized(self, stored: str, ranges: list[tuple[int, int]] | None = None) -> Any:
        """float32 numpy rows of one stored tensor (all, or the row ranges [start, stop) joined), dequantized by
        the gguf library a chunk of rows at a time into one array.

        Quantized blocks never span rows, so row ranges are exact; only the bytes of the rows asked for are read.
        """
        import math
        import os

        import numpy as np
        from gguf.quants import dequantize

        t = self._tensors[stored]
        shape = self.info[stored].shape
        n_rows = shape[0] if len(shape) > 1 else 1
        width = math.prod(shape) // n_rows  # weights per row
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
        return out.reshape(-1, *shape[1:]) if len(shape) > 1 else out.reshape(shape)  # [rows, n2...]

    def read(self, names: list[str], device: Any = "cpu", dtype: Any = None) -> dict[str, Any]:
        """Module-named weights, dequantized, as tensors that own their memory (fp32 unless `dtype`)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        out = {}
        for n in names:  # one dequantized tensor in flight at a time
            a = self._dequantized(self.where[n])  # a fresh array
            if self.gains_plus_one and n.endswith("norm.weight"):
                a -= 1.0  # llama.cpp stored Gemma's 1 + γ
            out[n] = torch.from_numpy(a).to(device=device, dtype=dtype)
        return out

    def rows(self, name: str, ranges: list[tuple[int, int]], device: Any = "cpu") -> Any:
        """Row ranges [start, stop) of a module-named 2-D weight (embedding, lm_head), dequantized, fp32."""
        import torch

        return torch.from_numpy(self._dequantized(self.where[name], ranges)).to(device)  # [sum of rows, n2]

    def tokenizer_fields(self) -> dict[str, Any]:
        """The tokenizer.* metadata as Python values (a string that is not UTF-8: one line naming the file, key)."""
        return {k: field_value(self._gguf, k) for k in self._gguf.fields if k.startswith("tokenizer.")}


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
    reader = GgufReader(path)
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

    from .model import model_from_state
    from .layouts import permute_rope_rows

    dtype = torch.float32 if dtype is None else dtype
    ck = read_gguf_checkpoint(path, dtype)
    cfg, state = ck.cfg, ck.state
    if rope_layout is not None and rope_layout != cfg.rope_layout:
        state = permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout,
                                  rope_layout)
        cfg = cfg.replace(rope_layout=rope_layout)
    return model_from_state(cfg, state, dtype, device, consume=True)
