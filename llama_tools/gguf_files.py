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
No torch at import; `gguf` (and numpy) are imported when a file is read.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelConfig, RopeScaling
from .families import FAMILIES, FULL, SLIDING
from .rope_layouts import HALF
from .formats import FORMATS, checkpoint_tensors
from .header_readers import FileExtent, PartialFile, TensorInfo
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


def _reader_class() -> type:
    import struct
    import sys

    import gguf
    import numpy as np

    ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    KNOWN = {int(t) for t in gguf.GGUFValueType}

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
        """gguf.GGUFReader with its per-field slicing done on a plain ndarray view of the same memory map, and
        each array sliced only when read.

        The library slices its np.memmap once per array item (~250k slices for a 49k vocabulary), and memmap's
        Python-level __array_finalize__/__getitem__ make that 3.8 s; the same slices of a plain view of the map
        take a fifth of it. Counting, config and tensor reads need none of those slices (one or two numpy views
        per item: 130 MB and 1 s for Qwen2's 152k tokens, their types and 151k merges), so an array is only
        sized (strings walked by their lengths) until its contents are asked for. Parsing stays the library's;
        tensor data stays mapped, never copied.
        """

        _eager = False

        @property
        def data(self) -> Any:
            return self._mapped

        @data.setter
        def data(self, value: Any) -> None:
            self._mapped = value.view(np.ndarray)  # the same pages; the memmap stays alive as its base

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            order = self.byte_order if override_order is None else override_order
            dt = _dtype(dtype, order)
            if getattr(self, "_tensor_data", False) and int(offset) + dt.itemsize * int(count) > self._mapped.size:
                # A partial file (a download cut short): the header is whole but this tensor's data are not all
                # there. A zero-stride placeholder of its shape lets the header parse, reading and allocating
                # nothing; open_gguf then refuses the file to every reader of data (gguf_extent says what is short).
                return np.lib.stride_tricks.as_strided(np.zeros(1, dt), shape=(int(count),), strides=(0,),
                                                       writeable=False)
            return np.frombuffer(self._mapped, dtype=dt, count=int(count), offset=int(offset))

        def _build_tensors(self, start_offs: int, fields: Any) -> None:
            self._tensor_data = True  # these reads are tensor data, which a partial file may lack; no others
            try:
                super()._build_tensors(start_offs, fields)
            finally:
                self._tensor_data = False

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if self._eager or raw_type != ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            types = [ARRAY] + ([gguf.GGUFValueType(item)] if count and item in KNOWN else [])  # as the library's
            scalar = self.gguf_scalar_to_np.get(item)  # type: ignore[call-overload]
            end, offs = len(self._mapped), orig_offs + 12
            if scalar is not None:
                offs += count * np.dtype(scalar).itemsize
            elif item == STRING:
                length = struct.Struct("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q")
                for _ in range(count):  # each string: a u64 length, then its bytes
                    if offs + 8 > end:
                        raise ValueError(f"an array at offset {orig_offs} runs past the end of the file")
                    offs += 8 + length.unpack_from(self._mapped, offs)[0]
            else:  # arrays of arrays: the library's own parse, all of it
                return self._parts(orig_offs, raw_type)
            if offs > end:
                raise ValueError(f"an array at offset {orig_offs} runs past the end of the file")
            return offs - orig_offs, [Unsliced(orig_offs)], [], types

        def _build_fields(self, offs: int, count: int) -> int:
            end = super()._build_fields(offs, count)
            for name, f in list(self.fields.items()):
                if len(f.parts) == 4 and isinstance(f.parts[3], Unsliced):
                    at = f.parts[3].offset
                    self.fields[name] = ArrayField(f, functools.partial(self._array, f, at),
                                                   functools.partial(self._values, at))
            return end

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
    """The gguf library's reader over `path` (memory-mapped); one ValueError line for what is not a GGUF.

    One parse per file version: resolving MODEL, counting and reading weights share it. A file whose tensor data
    end before its header says is refused (PartialFile) unless partial_ok (counting its header only).
    """
    p = Path(path).resolve()
    st = p.stat()
    reader = _open(p, st.st_ino, st.st_mtime_ns, st.st_size)
    if not partial_ok:
        extent = gguf_extent(reader, Path(path))
        if extent.missing:
            raise PartialFile(Path(path), extent)
    return reader


def gguf_extent(reader: Any, path: Path) -> FileExtent:
    """The file's bytes against the end of the last tensor's data, as the header places it."""
    declared = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    return FileExtent(path.name, int(reader.data.size), declared)


@functools.lru_cache(maxsize=2)
def _open(p: Path, inode: int, mtime_ns: int, size: int) -> Any:
    import gguf

    try:
        try:
            return _reader_class()(p)
        except (AttributeError, TypeError):  # the library's private helpers changed: its own reader, slower
            return gguf.GGUFReader(p)
    except (ValueError, KeyError, IndexError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{p}: not a readable GGUF file ({first})") from None


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata field's Python value (str, int, float, bool or list), `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's llama.* metadata and tensor names describe; one line for other architectures."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnmodelledGguf(f"{path}: GGUF architecture {arch!r} is not LLaMA-family; llama-tools reads "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    names = {t.name for t in reader.tensors}

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        v = field_value(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return v

    if get("expert_count", 0, required=False):
        raise UnmodelledGguf(f"{path}: a mixture-of-experts GGUF ({arch}.expert_count); llama-tools reads dense ones")
    if "rope_freqs.weight" in names:
        raise UnmodelledGguf(f"{path}: per-dimension RoPE factors (rope_freqs.weight, Llama 3.1's scaling) are not "
                             f"read from GGUF yet")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", 0, required=False) or hidden // max(heads, 1))
    rotary = get("rope.dimension_count", head_dim, required=False)
    if int(rotary) != head_dim:
        raise UnmodelledGguf(f"{path}: partial rotary ({arch}.rope.dimension_count {rotary} of head width "
                             f"{head_dim}) is not LLaMA's RoPE")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", None, required=False) or (int(emb.shape[-1]) if emb is not None else None) or (
        len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF holds neither {arch}.vocab_size, token_embd.weight nor a vocabulary")
    scaling = None
    kind = get("rope.scaling.type", None, required=False)
    if kind not in (None, "none"):
        scaling = RopeScaling(type=str(kind), factor=float(get("rope.scaling.factor", 1.0, required=False)),
                              original_max_position_embeddings=int(get("rope.scaling.original_context_length",
                                                                       8192, required=False)))
    bos, eos = field_value(reader, "tokenizer.ggml.bos_token_id"), field_value(reader, "tokenizer.ggml.eos_token_id")
    import numpy as np

    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    a = ARCHITECTURES[arch]
    layers = int(get("block_count"))
    family = FAMILIES[a.family].defaults
    extra: dict[str, Any] = {k: v for k, v in family.items() if k != "qkv_bias"}
    window = get("attention.sliding_window", None, required=False)
    if window:
        pattern = get("attention.sliding_window_pattern", None, required=False)  # per layer: true = local
        if isinstance(pattern, list) and len(pattern) == layers:
            types = tuple(SLIDING if x else FULL for x in pattern)
        elif a.swa_pattern:
            types = tuple(SLIDING if (j + 1) % a.swa_pattern else FULL for j in range(layers))
        else:
            types = None
        extra.update(sliding_window=int(window), layer_types=types)
    if a.family in ("gemma2", "gemma3"):
        scale = get("attention.scale", None, required=False)  # a file's own query scale wins over llama.cpp's rule
        extra["query_pre_attn_scalar"] = (float(str(np.float32(1.0 / float(scale) ** 2))) if scale else
                                          float(hidden // heads if layers == a.big_layers else head_dim))
        for key, field in (("attn_logit_softcapping", "attn_logit_softcap"),
                           ("final_logit_softcapping", "final_logit_softcap")):
            v = get(key, None, required=False)
            extra[field] = _f32(v) if v else None
    base = get("rope.freq_base_swa", a.swa_base, required=False)
    if base is not None:
        extra["rope_local_theta"] = _f32(base)
    return ModelConfig(
        **extra, pad_token_id=int(pad) if pad is not None else None,
        name=path.stem, source=str(path), family=a.family,
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads, required=False)),
        head_dim=head_dim if head_dim != hidden // max(heads, 1) else 0,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        rope_theta=_f32(get("rope.freq_base", 10000.0, required=False)), rope_scaling=scaling,
        rope_layout=a.rope_layout, max_position_embeddings=int(get("context_length", 2048, required=False)),
        tie_word_embeddings="output.weight" not in names,  # llama.cpp leaves the tied lm_head out
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=int(bos) if bos is not None else 1, eos_token_id=int(eos) if eos is not None else 2,
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


def _check_layers(path: Path, cfg: ModelConfig, infos: list[TensorInfo]) -> None:
    found = {int(m.group(1)) for t in infos if (m := _LAYER.match(t.name))}
    held = max(found) + 1 if found else 0
    if held != cfg.num_hidden_layers:
        raise ValueError(f"{path}: its metadata says {cfg.num_hidden_layers} decoder layers (block_count), the "
                         f"file holds tensors of {held}")


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
    arch = field_value(reader, "general.architecture")
    return GgufTensors(str(arch) if arch is not None else None, tensor_infos(reader, p), block_sizes(reader),
                       gguf_extent(reader, p))


def read_gguf_headers(path: str | Path) -> CheckpointHeaders:
    """A GGUF file as far as its header goes: config from the metadata, tensor infos; no tensor data read."""

    p = Path(path)
    reader = open_gguf(p)
    cfg = gguf_config(reader, p)
    infos = tensor_infos(reader, p)
    _check_layers(p, cfg, infos)
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
        self._gguf = open_gguf(p)
        cfg = gguf_config(self._gguf, p)
        infos = tensor_infos(self._gguf, p)
        _check_layers(p, cfg, infos)
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
        """The tokenizer.* metadata as Python values."""
        return {k: f.contents() for k, f in self._gguf.fields.items() if k.startswith("tokenizer.")}


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
    state = {}
    for n in names:
        state.update(reader.read([n], dtype=dtype))
    return GgufCheckpoint(reader.cfg, state, reader.tokenizer_fields(), time.perf_counter() - start)


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
