"""Every element type we name, once: its names, bytes, and what torch, numpy, ONNX and checkpoints call it.

No torch or numpy import at module level: `count-params` reads bytes from here in a few microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    """One element type and all of its spellings."""

    name: str  # ours, as users type it and metadata stores it
    aliases: tuple[str, ...]
    bytes: float  # per element; int4 is half a byte (group scales not counted)
    torch: str | None  # attribute of the torch module
    numpy: str | None  # numpy dtype name to feed onnxruntime (bf16: its raw bits, as uint16)
    onnx: int | None  # onnx.TensorProto element type
    safetensors: str | None  # the header's dtype code
    torch_storage: str | None  # the storage class a torch zip's data.pkl names
    float: bool = False  # a floating type a model can run in


# onnx.TensorProto codes, typed here so that this module needs no onnx import.
DTYPES: dict[str, DType] = {d.name: d for d in [
    DType("float32", ("fp32", "float"), 4, "float32", "float32", 1, "F32", "FloatStorage", float=True),
    DType("float16", ("fp16", "half"), 2, "float16", "float16", 10, "F16", "HalfStorage", float=True),
    DType("bfloat16", ("bf16",), 2, "bfloat16", "uint16", 16, "BF16", "BFloat16Storage", float=True),
    DType("float64", ("fp64", "double"), 8, "float64", "float64", 11, "F64", "DoubleStorage"),
    DType("float8_e4m3fn", (), 1, "float8_e4m3fn", None, 17, "F8_E4M3", None),
    DType("float8_e5m2", (), 1, "float8_e5m2", None, 19, "F8_E5M2", None),
    DType("int64", (), 8, "int64", "int64", 7, "I64", "LongStorage"),
    DType("int32", (), 4, "int32", "int32", 6, "I32", "IntStorage"),
    DType("int16", (), 2, "int16", "int16", 5, "I16", "ShortStorage"),
    DType("int8", (), 1, "int8", "int8", 3, "I8", "CharStorage"),
    DType("uint8", (), 1, "uint8", "uint8", 2, "U8", "ByteStorage"),
    DType("bool", (), 1, "bool", "bool", 9, "BOOL", "BoolStorage"),
    DType("int4", (), 0.5, None, None, 22, None, None),
]}

FLOAT32, FLOAT16, BFLOAT16 = DTYPES["float32"], DTYPES["float16"], DTYPES["bfloat16"]
# What a model can be built, exported and reported in (the CLI's --dtype choices).
MODEL_DTYPES = tuple(d.name for d in DTYPES.values() if d.float)
# Weight memory rows of `count-params`.
MEMORY_DTYPES = (*MODEL_DTYPES, "int8", "int4")
_BY_ALIAS = {a: d for d in DTYPES.values() for a in (d.name, *d.aliases)}


def get(name: Any) -> DType:
    """A name or alias (or a torch.dtype) -> its DType; ValueError naming the choices."""
    if isinstance(name, DType):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _BY_ALIAS:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(MODEL_DTYPES)}")
    return _BY_ALIAS[key]


def model_dtype(name: Any) -> DType:
    """Like `get`, for the types a model runs in (float32, float16, bfloat16)."""
    d = get(name)
    if not d.float:
        raise ValueError(f"dtype {name!r} is not one a model runs in; choose one of {', '.join(MODEL_DTYPES)}")
    return d


def to_torch(name: Any) -> Any:
    """The torch.dtype of a name (imports torch)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    d = get(name)
    assert d.torch is not None, f"{d.name} has no torch dtype"
    return getattr(torch, d.torch)


def from_safetensors(code: str) -> DType | None:
    return next((d for d in DTYPES.values() if d.safetensors == code), None)


def from_torch_storage(cls: str) -> DType | None:
    return next((d for d in DTYPES.values() if d.torch_storage == cls), None)


def from_onnx(elem_type: int) -> DType:
    d = next((d for d in DTYPES.values() if d.onnx == elem_type), None)
    if d is None:
        raise ValueError(f"ONNX element type {elem_type} is not one llama-tools knows")
    return d


def from_onnx_type_string(type_str: str) -> DType:
    """onnxruntime's 'tensor(float16)' -> float16."""
    inner = type_str.removeprefix("tensor(").removesuffix(")")
    return get({"float": "float32", "double": "float64"}.get(inner, inner))
