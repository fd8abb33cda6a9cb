"""Llama 3's RoPE scaling and the rope_freqs.weight llama.cpp stores for it, both ways.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors) writes no rope_scaling keys for
HF's 'llama3' scaling: it stores one divisor per rotated pair (1 for fast pairs, `factor` for slow ones,
1 / ((1 - smooth) / factor + smooth) between), computed from float32 frequencies. Reading, the scaling is
recovered as the published parameter set whose divisors reproduce the tensor within float32 rounding; any other
tensor is refused, naming it. numpy only (count-params reads a config without torch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...modeling.config import RopeScaling
from .architectures import ROPE_FREQS
from .read import UnmodelledGguf

# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of every published 'llama3' scaling:
# Llama 3.1 and 3.3 (factor 8), Llama 3.2 (factor 32).
PUBLISHED = ((1.0, 4.0, 8192),)
FACTORS = (8.0, 32.0)
# llama.cpp computes the divisors in float32 (torch); the blend between the bands loses a few ulps to cancellation
# (2.7e-7 measured against exact arithmetic at n6 = 128): 16 ulps of slack still tells every parameter set apart.
RTOL = 2.0 ** -20


def llama3_divisors(theta: float, dims: int, s: RopeScaling) -> list[float]:
    """The rope_freqs.weight llama.cpp writes for 'llama3' scaling S: one divisor per rotated pair (exact
    arithmetic; llama.cpp's float32 differs within RTOL)."""
    low, high = s.original_max_position_embeddings / s.low_freq_factor, \
        s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for t in range(0, dims, 2):
        wavelen = 2 * math.pi * theta ** (t / dims)
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return out


def llama3_scaling(divisors: Any, theta: float, dims: int, path: Path) -> RopeScaling:
    """The 'llama3' RopeScaling whose divisors are DIVISORS (a float array of dims / 2); one line naming the tensor
    (UnmodelledGguf) when no published parameter set reproduces them."""
    import numpy as np

    got = np.asarray(divisors, dtype=np.float64)
    if got.shape != (dims // 2,) or not np.isfinite(got).all() or not (got > 0).all():
        raise UnmodelledGguf(f"{path}: tensor {ROPE_FREQS!r} must hold {dims // 2} positive divisors, one per rotated "
                         f"pair")
    top = float(np.float32(got.max()))
    for factor in dict.fromkeys((*FACTORS, top)):  # the published factors, then the tensor's own largest divisor
        for low, high, ctx in PUBLISHED:
            s = RopeScaling("llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                            original_max_position_embeddings=ctx)
            if np.allclose(got, llama3_divisors(theta, dims, s), rtol=RTOL, atol=0):
                return s
    raise UnmodelledGguf(f"{path}: tensor {ROPE_FREQS!r} (per-dimension RoPE divisors, from {got.min():g} to "
                     f"{got.max():g}) matches no 'llama3' scaling (factor {', '.join(f'{f:g}' for f in FACTORS)} or "
                     f"{top:g}, low/high frequency factors 1/4, 8192 original positions); llama-tools reads those")


def rope_freqs_tensor(reader: Any, path: Path) -> Any:
    """rope_freqs.weight as float numbers (F32, F16 or BF16 as llama.cpp may store it); None when absent."""
    import numpy as np
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        raise UnmodelledGguf(f"{path}: tensor {ROPE_FREQS!r} is stored as {t.tensor_type.name}; llama.cpp stores it as "
                         f"F32")
    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64).reshape(-1)
