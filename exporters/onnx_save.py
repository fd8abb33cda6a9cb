"""Save an exported onnx_ir model in bounded memory: weights streamed to the .data file one tensor at a time.

`ir.save` of a single file serializes every weight into one protobuf in memory, and `onnx.checker` on the
path loads them all again: 4.8x the weights at peak on a 150M model. Here

    initializer 0 --(fetch; cast, made contiguous 64 MiB of rows at a time)--> append to OUT.data
                  --> ExternalTensor(offset, length)
    initializer 1 --(...)--> append --> ...                  (one tensor in memory at a time)
    graph + ExternalTensor references --> OUT (a few MB) --> onnx.checker(full_check) on that proto alone

so the peak is the largest tensor as the source hands it (a memory-mapped file's pages), one slab of its
cast or transposed copy, and the graph; the check reads no weight. A `source` callable can
hand each weight over only when it is written (e.g. from the memory-mapped checkpoint), so the model
never has to be in memory whole. The caller owns the directory (temp dir, atomic rename).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnx_ir as ir
import torch

from llama_tools.modeling import dtypes

from .preflight import SINGLE_FILE_MAX_BYTES  # noqa: F401  (re-exported: the save's default)

INLINE_MAX_BYTES = 1024  # shape constants and other small initializers stay inside the proto
Source = Callable[[str], Any]  # initializer name -> torch tensor / numpy array / None (use its const_value)


@dataclass(frozen=True)
class SavedModel:
    """What save_model wrote."""

    path: Path
    external_data: Path | None  # NAME.data, or None for one self-contained file
    weight_bytes: int  # initializers, at their declared dtypes
    tensors: int  # initializers written to the .data file
    data_bytes: int  # the .data file's size (small initializers stay inline in the graph)
    seconds: float


def _nbytes(v: ir.Value) -> int:
    return int(math.prod(int(d) for d in v.shape) * v.dtype.itemsize)


def _as_torch(data: Any, v: ir.Value, materialize: bool = True) -> torch.Tensor:
    """A tensor-like (torch, numpy, ir tensor) -> a contiguous CPU torch tensor of v's declared dtype.

    materialize=False: the tensor as it came (a view, another dtype): `_write` casts it a slab at a time.
    """
    raw = getattr(data, "raw", data)  # onnx_ir's TorchTensor / Tensor wrap the real array in .raw
    if isinstance(raw, torch.Tensor):
        t = raw
    else:
        arr = np.asarray(raw if isinstance(raw, np.ndarray) else data.numpy())
        with warnings.catch_warnings():  # a read-only (memory-mapped) array: we only read it
            warnings.simplefilter("ignore", UserWarning)
            # numpy has no bf16: onnx_ir hands out ml_dtypes.bfloat16 arrays; torch takes their bits
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if arr.dtype.name == dtypes.BFLOAT16.name \
                else torch.from_numpy(arr)
    want = _TORCH_DTYPES.get(v.dtype)
    assert want is not None, f"{v.name}: no torch dtype for {v.dtype}"
    shape = tuple(int(d) for d in v.shape)
    assert tuple(t.shape) == shape, f"{v.name}: tensor {list(t.shape)} vs initializer {list(shape)}"
    if not materialize:
        return t.detach()
    return t.detach().to(device="cpu", dtype=want).contiguous()  # the per-tensor cast to the export dtype


_TORCH_DTYPES = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16,
                 ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.DOUBLE: torch.float64,
                 ir.DataType.INT64: torch.int64, ir.DataType.INT32: torch.int32, ir.DataType.INT8: torch.int8,
                 ir.DataType.UINT8: torch.uint8, ir.DataType.BOOL: torch.bool}


def _ir_tensor(t: torch.Tensor, v: ir.Value) -> ir.Tensor:
    """A torch tensor as an in-memory onnx_ir tensor (bf16 through ml_dtypes, which numpy lacks)."""
    import ml_dtypes

    arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    return ir.Tensor(arr, dtype=v.dtype, name=v.name)


SLAB_BYTES = 64 * 2**20  # a transposed or cast tensor is written this much at a time


@dataclass(frozen=True)
class Rows:
    """A 2-D weight a source hands out a row range at a time (`read(a, b)`: rows a..b as a tensor), so that
    writing it never holds it whole: Gemma 3's embedding is 0.67 GB in fp32.

    transposed: the tensor written [shape] is the transpose of what `read` hands out ([shape[1], shape[0]], read a
    slab of its rows at a time): an untied lm_head's W^T for a MatMul (Qwen2.5-0.5B's is 0.54 GB in fp32)."""

    shape: tuple[int, int]
    read: Callable[[int, int], torch.Tensor]
    transposed: bool = False

    def whole(self) -> torch.Tensor:
        """The tensor as written, in memory (a small graph's, serialized inside it)."""
        return self.read(0, self.shape[1]).T if self.transposed else self.read(0, self.shape[0])


def _write(f: Any, t: torch.Tensor | Rows, dtype: torch.dtype) -> int:
    """Append t's bytes in `dtype`, row-major and little-endian as ONNX stores them, a slab of rows at a time:
    a transposed view (W^T for a MatMul), a cast or a Rows source is never made whole, only SLAB_BYTES of it."""
    if isinstance(t, Rows) and t.transposed:
        return _write_transposed(f, t, dtype)
    if isinstance(t, Rows):
        count, per_row, rows_of = t.shape[0], t.shape[1] * dtype.itemsize, t.read
    else:
        if t.numel() == 0:
            return 0
        rows = t if t.dim() > 1 else t.reshape(1, -1)  # [rows, ...]
        count, per_row, rows_of = rows.shape[0], rows[0].numel() * dtype.itemsize, lambda a, b: rows[a:b]
    step = max(1, SLAB_BYTES // max(per_row, 1))
    n = 0
    for start in range(0, count, step):
        slab = rows_of(start, min(start + step, count)).to(device="cpu", dtype=dtype).contiguous()  # the only copy
        data = slab.reshape(-1).view(torch.uint8).numpy()
        f.write(memoryview(data))
        n += data.nbytes
    return n


def _write_transposed(f: Any, t: Rows, dtype: torch.dtype) -> int:
    """Append T = S^T [n, k] from S's row slabs [<= step, n]: each slab's transpose [n, step] written where T's rows
    hold those columns (positioned writes into the space reserved for T), so neither S nor T is ever whole."""
    n, k = t.shape  # T: [n, k]; S: [k, n]
    size, item = n * k * dtype.itemsize, dtype.itemsize
    f.flush()
    start, fd = f.tell(), f.fileno()
    f.truncate(start + size)
    step = max(1, SLAB_BYTES // max(n * item, 1))
    for a in range(0, k, step):
        b = min(a + step, k)
        slab = t.read(a, b)
        assert tuple(slab.shape) == (b - a, n), f"rows {a}..{b} of a [{k}, {n}] source came as {list(slab.shape)}"
        cols = torch.empty((n, b - a), dtype=dtype).copy_(slab.T)  # fresh strides even for one column
        cols = cols.view(torch.uint8).numpy()  # [n, (b - a) item]
        for i in range(n):  # T's row i, columns a..b
            view, done = memoryview(cols[i]), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], start + (i * k + a) * item + done)
    f.seek(start + size)
    return size


def _copy_external(f: Any, t: ir.ExternalTensor) -> int:
    """Append an external tensor's bytes read from its file SLAB_BYTES at a time: no memory map, so the pages
    read never count as ours (a mapped 500 MB embedding would, until unmapped)."""
    with open(t.path, "rb") as src:
        src.seek(t.offset or 0)
        left = t.length if t.length is not None else t.nbytes
        while left:
            chunk = src.read(min(SLAB_BYTES, left))
            if not chunk:
                raise ValueError(f"{t.path}: ends before tensor {t.name!r} does ({left:,} bytes missing)")
            f.write(chunk)
            left -= len(chunk)
    return t.length if t.length is not None else t.nbytes


def check_weightless(path: Path) -> None:
    """onnx.checker with full_check (strict shape inference) on the written proto.

    Given a path, the checker parses only the .onnx file: external tensors are checked to point at a
    regular file beside it, and never read, so this costs the graph's size, not the weights'.
    """
    onnx.checker.check_model(str(path), full_check=True)


def save_model(model: ir.Model, directory: str | Path, name: str = "model.onnx", *, source: Source | None = None,
               external: bool | None = None, single_file_max_bytes: int = SINGLE_FILE_MAX_BYTES, check: bool = True,
               callback: Callable[[int, int], None] | None = None) -> SavedModel:
    """Write `name` (and `name`.data) into `directory`; the model's initializers end up as external references.

    external None: external data when the weights exceed single_file_max_bytes. `source(name)` is asked for
    each initializer's data first (None: its const_value). `callback(done, total)` after each tensor.
    The model is consumed: its initializers point at the written file afterwards, their tensors are dropped.
    """
    t0 = time.perf_counter()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    inits = list(model.graph.initializers.values())
    weight_bytes = sum(_nbytes(v) for v in inits)
    external = weight_bytes > single_file_max_bytes if external is None else external
    path, data_name = directory / name, name + ".data"

    def fetch(v: ir.Value) -> Any:
        data = source(v.name) if source is not None else None
        if data is None:
            data = v.const_value
        if data is None:
            raise ValueError(f"initializer {v.name!r} has no data: neither the source nor the graph holds it")
        return data

    if not external:
        if source is not None:  # small: every weight in memory once, inside the proto
            for v in inits:
                data = fetch(v)
                data = data.whole() if isinstance(data, Rows) else data
                v.const_value = _ir_tensor(_as_torch(data, v), v)
        path.write_bytes(ir.serde.serialize_model(model).SerializeToString())  # small: weights inside are fine
        (directory / data_name).unlink(missing_ok=True)
        if check:
            check_weightless(path)
        return SavedModel(path, None, weight_bytes, 0, 0, time.perf_counter() - t0)

    written = offset = 0
    with open(directory / data_name, "wb") as f:
        for i, v in enumerate(inits):
            data = fetch(v)
            if isinstance(data, ir.ExternalTensor) and data.dtype == v.dtype and data.nbytes >= INLINE_MAX_BYTES:
                n = _copy_external(f, data)  # another file's tensor as it is (a graph rewritten, int4 around it)
                v.const_value = ir.ExternalTensor(data_name, offset, n, v.dtype, name=v.name, base_dir=directory,
                                                  shape=ir.Shape([int(d) for d in v.shape]))
                offset, written = offset + n, written + 1
                if callback is not None:
                    callback(i + 1, len(inits))
                continue
            t = data if isinstance(data, Rows) else _as_torch(data, v, materialize=False)
            dtype = _TORCH_DTYPES[v.dtype]
            if isinstance(t, Rows):
                assert tuple(t.shape) == tuple(int(d) for d in v.shape), f"{v.name}: rows {t.shape} vs {v.shape}"
                t = t if math.prod(t.shape) * dtype.itemsize >= INLINE_MAX_BYTES else t.whole()
            if not isinstance(t, Rows) and t.numel() * dtype.itemsize < INLINE_MAX_BYTES:
                v.const_value = _ir_tensor(_as_torch(t, v), v)  # shape constants, toy norms: inside the graph
            else:
                n = _write(f, t, dtype)
                v.const_value = ir.ExternalTensor(data_name, offset, n, v.dtype, name=v.name, base_dir=directory,
                                                  shape=ir.Shape([int(d) for d in v.shape]))
                offset += n
                written += 1
            del t, data  # the source's tensor (a view of its file): dropped before the next is fetched
            if callback is not None:
                callback(i + 1, len(inits))
    path.write_bytes(ir.serde.serialize_model(model).SerializeToString())  # references only: a few MB
    if check:
        check_weightless(path)
    return SavedModel(path, directory / data_name, weight_bytes, written, offset, time.perf_counter() - t0)
