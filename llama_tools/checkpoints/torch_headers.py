"""A torch .pth/.bin (zip) checkpoint's header without its data, by a restricted unpickler.

`data.pkl` is read by an unpickler that only records what `torch._utils._rebuild_tensor_v2` would be called
with (storage dtype, shape, strides) and refuses every other global and every opcode torch.save does not
write: nothing in the file is executed, the storages (the data) are never opened, and no work grows faster
than the file (no dict key but a string, so nothing is hashed or printed whole: a tuple that holds itself
2^80 times over through the memo costs nothing). No torch import.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..modeling import dtypes

from .header_readers import I64, HeaderError, TensorInfo, open_regular

# A torch zip's data.pkl holds tensor metadata only, ~130 bytes a tensor: 70B's is a few hundred kB, DeepSeek-V3's
# 91k tensors in one file would be 12 MB. 32 MiB bounds the (pure-Python, op-checked) unpickling to seconds.
MAX_PICKLE_BYTES = 32 * 2**20
# Deflate can reach ~1000:1 on zeros (a zip bomb); weights barely compress, and torch.save stores every entry
# uncompressed. A compressed entry claiming more than this ratio is refused before anything is inflated.
MAX_COMPRESSION_RATIO = 32

# --- torch zip headers (restricted unpickler) -----------------------------------------------------

# What Python's pickler writes for torch.save's dicts, tuples, strings, ints and bools, protocols 0..5; anything
# else (floats, bytes, sets, DUP, NEWOBJ, INST, EXT...) is no part of tensor metadata and is refused by name.
_PICKLE_OPS = frozenset(
    "PROTO FRAME STOP MARK POP POP_MARK EMPTY_DICT DICT SETITEM SETITEMS EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 "
    "EMPTY_LIST LIST APPEND APPENDS BINUNICODE SHORT_BINUNICODE BINUNICODE8 UNICODE BININT BININT1 BININT2 LONG1 "
    "LONG4 INT LONG NONE NEWTRUE NEWFALSE GLOBAL STACK_GLOBAL REDUCE BUILD BINPERSID PERSID BINPUT LONG_BINPUT PUT "
    "MEMOIZE BINGET LONG_BINGET GET".split())


def _show(v: Any, budget: int = 60) -> str:
    """A value from a pickle as an error shows it, in at most ~budget characters and as much work.

    Never str() or repr() a pickled value: a tuple can hold itself twice at each of 80 levels (memo references),
    which str() would expand 2^80 times, and an int can have millions of digits.
    """
    if budget <= 0:
        return "..."
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v) if v.bit_length() <= 128 else f"<an integer of {v.bit_length()} bits>"
    if isinstance(v, str):
        return repr(v[:budget]) + ("..." if len(v) > budget else "")
    if isinstance(v, (tuple, list)):
        parts, left = [], budget - 2
        for item in v[:8]:
            if left <= 0:
                break
            parts.append(_show(item, left))
            left -= len(parts[-1]) + 2
        more = ", ..." if len(parts) < len(v) else ""
        return ("(%s%s)" if isinstance(v, tuple) else "[%s%s]") % (", ".join(parts), more)
    return f"<{type(v).__name__}>"


@dataclass(frozen=True)
class _Storage:
    dtype: str
    itemsize: int
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorStub:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> int:
        """Elements of its storage the tensor reaches, from element 0: torch.load refuses a view past the storage."""
        if 0 in self.shape:
            return 0
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1


def _int64s(v: Any) -> bool:
    return isinstance(v, tuple) and all(type(s) is int and 0 <= s < I64 for s in v)


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorStub:
    if not isinstance(storage, _Storage):
        raise HeaderError(f"a tensor whose storage is {_show(storage)}, not a storage reference")
    if not (type(storage_offset) is int and 0 <= storage_offset < I64 and _int64s(size)):
        raise HeaderError(f"a tensor with offset {_show(storage_offset, 30)} and shape {_show(size)}: "
                          f"not non-negative 64-bit integers")
    if not (_int64s(stride) and len(stride) == len(size)):
        raise HeaderError(f"a tensor of shape {_show(size)} with strides {_show(stride)}: not one non-negative "
                          f"64-bit integer per dimension")
    return _TensorStub(storage, storage_offset, size, stride)


def _rebuild_parameter(data: Any, *rest: Any) -> _TensorStub:
    if not isinstance(data, _TensorStub):
        raise HeaderError(f"a parameter of {_show(data)}, not of a tensor")
    return data


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    # torch.save writes OrderedDict() and fills it by SETITEMS (whose keys are checked); an iterable passed here
    # would hash keys we never saw.
    if args:
        raise HeaderError(f"OrderedDict called with {_show(args)}; torch.save writes OrderedDict()")
    return collections.OrderedDict()


class _StorageType:
    def __init__(self, dt: dtypes.DType):
        self.dtype, self.itemsize = dt.name, int(dt.bytes)


def _refuse_op(code: int) -> Any:
    op = pickletools.code2op.get(chr(code))
    raise HeaderError(f"opcode {op.name if op else hex(code)}, which torch.save does not write")


class _Dispatch(dict):
    def __missing__(self, code: int) -> Any:
        _refuse_op(code)


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Knows four globals and torch.save's opcodes; any other global (a class, os.system, ...) or opcode is refused
    before it can run.

    The pure-Python unpickler, so that each opcode it runs is one we allow: dict keys must be strings (hashing a
    shared tuple is exponential) and BUILD may only set a state dict's `_metadata`-style attributes.
    """

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return _ordered_dict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and (dt := dtypes.from_torch_storage(name)) is not None:
            return _StorageType(dt)
        raise HeaderError(f"{self.path}: refused: contains {module[:60]}.{name[:60]}, not only tensors "
                         f"(torch files are never unpickled beyond tensors)")

    def persistent_load(self, pid: Any) -> _Storage:
        # ('storage', storage_type, key, location, numel), as torch.save writes it.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise HeaderError(f"{self.path}: refused: unexpected persistent reference {_show(pid, 80)}")
        if not (isinstance(pid[2], str) and type(pid[4]) is int and 0 <= pid[4] < I64):
            raise HeaderError(f"{self.path}: refused: storage reference {_show(pid, 80)} is malformed")
        return _Storage(pid[1].dtype, pid[1].itemsize, pid[2], pid[4])

    def _set(self, items: list[Any]) -> None:
        """SETITEM(S): into a dict, string keys only (a key is hashed: a shared tuple would take 2^depth steps)."""
        target = self.stack[-1] if self.stack else None
        if not isinstance(target, dict):
            raise HeaderError(f"items set on {_show(target)}, not on a dict")
        for k, v in zip(items[0::2], items[1::2]):
            if type(k) is not str:
                raise HeaderError(f"a dict key {_show(k)}: torch.save's keys are strings")
            target[k] = v

    def _setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._set([key, value])

    def _setitems(self) -> None:
        self._set(self.pop_mark())

    def _dict(self) -> None:
        items = self.pop_mark()
        self.append({})
        self._set(items)

    def _build(self) -> None:
        # torch.save sets a state dict's `_metadata` (module versions), which counting never reads.
        state, inst = self.stack[-1], self.stack[-2] if len(self.stack) > 1 else None
        if not (isinstance(inst, collections.OrderedDict) and isinstance(state, dict) and set(state) <= {"_metadata"}):
            raise HeaderError(f"BUILD of {_show(inst)} from {_show(state)}: torch.save only sets a state dict's "
                              f"_metadata")
        self.stack.pop()

    dispatch = _Dispatch({code: fn for code, fn in pickle._Unpickler.dispatch.items()  # type: ignore[attr-defined]
                          if pickletools.code2op[chr(code)].name in _PICKLE_OPS})
    dispatch.update({pickle.SETITEM[0]: _setitem, pickle.SETITEMS[0]: _setitems, pickle.DICT[0]: _dict,
                     pickle.BUILD[0]: _build})


def _check_zip_sizes(zf: zipfile.ZipFile, path: Path, size: int) -> None:
    """Declared sizes bounded before anything is inflated: no zip bomb, no entries overlapping to multiply bytes."""
    infos = zf.infolist()
    stored = 0
    for i in infos:
        if i.header_offset + i.compress_size > size:
            raise HeaderError(f"{path}: zip entry {i.filename[:80]!r} runs past the end of the file: truncated")
        if i.compress_type != zipfile.ZIP_STORED and i.file_size > MAX_COMPRESSION_RATIO * max(i.compress_size, 1):
            raise HeaderError(f"{path}: zip entry {i.filename[:80]!r} declares {i.file_size} bytes from "
                              f"{i.compress_size} compressed (over {MAX_COMPRESSION_RATIO}:1): refused as a zip "
                              f"bomb (torch.save stores entries uncompressed)")
        stored += i.compress_size
    if stored > size:
        raise HeaderError(f"{path}: zip entries hold {stored} bytes in a {size}-byte file: entries overlap")


def _check_small_records(zf: zipfile.ZipFile, path: Path, prefix: str) -> None:
    """The records torch.load reads beside data.pkl (byteorder, version) say what torch.save writes there."""
    rules = {"byteorder": (b"little", b"big"), "version": None, ".data/version": None}
    for name, allowed in rules.items():
        try:
            info = zf.getinfo(prefix + name)
        except KeyError:
            continue
        if info.file_size > 64:
            raise HeaderError(f"{path}: zip record {name!r} declares {info.file_size} bytes, not a torch record")
        try:
            value = zf.read(info).strip()
        except Exception as e:  # noqa: BLE001  (a damaged entry: bad CRC, bad deflate stream, ...)
            raise HeaderError(f"{path}: zip record {name!r} is damaged ({type(e).__name__}: {str(e)[:80]})") from None
        ok = value in allowed if allowed else value.isdigit()
        if not ok:
            raise HeaderError(f"{path}: zip record {name!r} holds {value[:20]!r}, not what torch.save writes")


def read_torch_header(path: str | Path) -> list[TensorInfo]:
    """The tensors of a torch zip file (.pth/.bin) from `data.pkl` alone, checking each storage is there.

    Every declared size is checked against the file first (no entry inflated past 32:1, none overlapping,
    data.pkl at most 32 MiB), so that neither this reader nor torch.load can be made to allocate more than
    the file justifies.
    """
    path = Path(path)
    with open_regular(path) as raw:
        size = os.fstat(raw.fileno()).st_size
        try:
            zf = zipfile.ZipFile(raw)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            raise HeaderError(f"{path}: not a readable torch zip file ({str(e)[:80]}): truncated, or the legacy "
                              f"non-zip format (re-save it with torch.save)") from None
        with zf:
            _check_zip_sizes(zf, path, size)
            names = zf.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise HeaderError(f"{path}: zip file without data.pkl: not a torch checkpoint")
            if zf.getinfo(pkl).file_size > MAX_PICKLE_BYTES:
                raise HeaderError(f"{path}: data.pkl declares {zf.getinfo(pkl).file_size} bytes, over the "
                                  f"{MAX_PICKLE_BYTES} that tensor metadata may take")
            prefix = pkl[: -len("data.pkl")]
            _check_small_records(zf, path, prefix)
            sizes = {i.filename: i.file_size for i in zf.infolist()}
            try:
                with zf.open(pkl) as f:
                    obj = _MetadataUnpickler(f, path).load()
            except HeaderError as e:
                if str(e).startswith(str(path)):
                    raise
                raise HeaderError(f"{path}: refused: data.pkl holds {e}") from None
            # A crafted pickle can raise nearly anything (it is only data to us, never run): every failure
            # to read it is the same refusal, its message shown only when it is text (never a pickled value).
            except Exception as e:  # noqa: BLE001
                said = str(e) if all(isinstance(a, str) for a in e.args) else _show(e.args, 100)
                raise HeaderError(f"{path}: cannot read tensor metadata from data.pkl ({type(e).__name__}: "
                                  f"{said.splitlines()[0][:100] if said.strip() else ''})") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"{path}: refused: holds {_show(obj)}, not a dict of tensors")
    out = []
    for name, t in dict.items(obj):
        if not (isinstance(name, str) and isinstance(t, _TensorStub)):
            raise HeaderError(f"{path}: refused: entry {_show(name, 80)} is {_show(t)}, not a tensor under a name")
        st = t.storage
        stored = sizes.get(f"{prefix}data/{st.key}")
        need = st.numel * st.itemsize  # torch.save writes each storage whole
        if stored is None or stored < need:
            raise HeaderError(f"{path}: truncated: storage of tensor {name[:80]!r} holds {stored or 0} bytes, "
                              f"needs {need}")
        if t.span > st.numel:
            raise HeaderError(f"{path}: tensor {name[:80]!r} (offset {t.offset}, shape {_show(t.shape)}, strides "
                              f"{_show(t.stride)}) reaches element {t.span:,} of a storage of {st.numel:,}")
        out.append(TensorInfo(name, t.shape, st.dtype, math.prod(t.shape) * st.itemsize, path.name))
    return out
