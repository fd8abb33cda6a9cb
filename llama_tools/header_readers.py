"""Read a weight file's header without its data: the tensors' names, shapes and dtypes, validated.

- safetensors: 8-byte little-endian header length, then a JSON header {name: {dtype, shape, data_offsets}}.
- torch .pth/.bin (a zip): `data.pkl` is read by a restricted unpickler that only records what
  `torch._utils._rebuild_tensor_v2` would be called with (storage dtype, shape) and refuses every
  other global: nothing in the file is executed, and the storages (the data) are never opened.
No torch import: counting a 70B checkpoint takes milliseconds.
"""

from __future__ import annotations

import collections
import json
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import dtypes

# A header larger than this is not a LLaMA checkpoint header (70B's largest shard header is ~100 kB).
MAX_HEADER_BYTES = 100 * 2**20


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


# --- safetensors headers --------------------------------------------------------------------------

def read_safetensors_header(path: str | Path) -> list[TensorInfo]:
    """The tensors of one .safetensors file, validated against the file size (truncation, bad offsets)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} is larger than the file ({size} bytes): truncated or not safetensors")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is implausibly large (> {MAX_HEADER_BYTES}): not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = dtypes.from_safetensors(meta["dtype"])
            assert dt is not None, f"unknown safetensors dtype {meta['dtype']!r}"
            dtype, itemsize = dt.name, int(dt.bytes)
            shape = tuple(int(s) for s in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError, AssertionError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes but shape {list(shape)} of {dtype} "
                             f"needs {nbytes}")
        if end > data_bytes:
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file holds "
                             f"{data_bytes} data bytes")
        out.append(TensorInfo(name, shape, dtype, nbytes, path.name))
    return out


# --- torch zip headers (restricted unpickler) -----------------------------------------------------

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


def _rebuild_tensor_v2(storage: _Storage, storage_offset: int, size: tuple, stride: tuple, *rest: Any) -> _TensorStub:
    return _TensorStub(storage, int(storage_offset), tuple(int(s) for s in size))


def _rebuild_parameter(data: _TensorStub, *rest: Any) -> _TensorStub:
    return data


class _StorageType:
    def __init__(self, dt: dtypes.DType):
        self.dtype, self.itemsize = dt.name, int(dt.bytes)


class _MetadataUnpickler(pickle.Unpickler):
    """Knows four globals; any other one (a class, os.system, ...) is refused before it can run."""

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and (dt := dtypes.from_torch_storage(name)) is not None:
            return _StorageType(dt)
        raise ValueError(f"{self.path}: refused: contains {module}.{name}, not only tensors "
                         f"(torch files are never unpickled beyond tensors)")

    def persistent_load(self, pid: Any) -> _Storage:
        # ('storage', storage_type, key, location, numel), as torch.save writes it.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise ValueError(f"{self.path}: refused: unexpected persistent reference {pid!r}")
        return _Storage(pid[1].dtype, pid[1].itemsize, str(pid[2]), int(pid[4]))


def read_torch_header(path: str | Path) -> list[TensorInfo]:
    """The tensors of a torch zip file (.pth/.bin) from `data.pkl` alone, checking each storage is there."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path}: not a readable torch zip file ({e}): truncated, or the legacy non-zip "
                         f"format (re-save it with torch.save)") from None
    with zf:
        names = zf.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError(f"{path}: zip file without data.pkl: not a torch checkpoint")
        prefix = pkl[: -len("data.pkl")]
        sizes = {i.filename: i.file_size for i in zf.infolist()}
        try:
            with zf.open(pkl) as f:
                obj = _MetadataUnpickler(f, path).load()
        except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError) as e:
            raise ValueError(f"{path}: cannot read tensor metadata from data.pkl ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: refused: holds a {type(obj).__name__}, not a dict of tensors")
    out = []
    for name, t in obj.items():
        if not isinstance(t, _TensorStub):
            raise ValueError(f"{path}: refused: entry {name!r} is a {type(t).__name__}, not a tensor")
        st = t.storage
        stored = sizes.get(f"{prefix}data/{st.key}")
        need = (t.offset + math.prod(t.shape)) * st.itemsize
        if stored is None or stored < need:
            raise ValueError(f"{path}: truncated: storage of tensor {name!r} holds {stored or 0} bytes, needs {need}")
        out.append(TensorInfo(str(name), t.shape, st.dtype, math.prod(t.shape) * st.itemsize, path.name))
    return out
