"""Llama 3's RoPE scaling and the rope_freqs.weight llama.cpp stores for it, both ways; longrope's factor tensors.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors) writes no rope_scaling keys for
HF's 'llama3' scaling: it stores one divisor per rotated pair (1 for fast pairs, `factor` for slow ones,
1 / ((1 - smooth) / factor + smooth) between), computed from float32 frequencies. Reading, the scaling is
recovered as the published parameter set whose divisors reproduce the tensor within float32 rounding; any other
tensor is refused, naming it.

longrope (Phi-3-mini-128K, Phi-4-mini): the converter (Phi3MiniModel) stores the long and short factors as
rope_factors_long.weight / rope_factors_short.weight (F32, one per rotated pair), the original context as
{arch}.rope.scaling.original_context_length and sqrt(1 + ln(context / original) / ln(original)) as
{arch}.rope.scaling.attn_factor, which llama.cpp multiplies cos and sin by; no scaling type key. llama.cpp takes the
long factors when its context per sequence is over the original (llama_model::get_rope_factors), transformers when
the pass is. numpy only (count-params reads a config without torch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...modeling.config import RopeScaling
from ...modeling.rope import longrope_attention_factor
from .architectures import ROPE_FACTORS, ROPE_FREQS
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


def rope_freqs_tensor(reader: Any, path: Path, name: str = ROPE_FREQS) -> Any:
    """rope_freqs.weight (or NAME) as float numbers (F32, F16 or BF16 as llama.cpp may store it); None when absent."""
    import numpy as np
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        raise UnmodelledGguf(f"{path}: tensor {name!r} is stored as {t.tensor_type.name}; llama.cpp stores it as "
                             f"F32")
    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64).reshape(-1)


def longrope_tensors(reader: Any, path: Path) -> dict[str, Any]:
    """longrope's factor tensors the file holds: RopeScaling field (long_factor, short_factor) -> float numbers."""
    found = {field: rope_freqs_tensor(reader, path, name) for field, name in ROPE_FACTORS.items()}
    return {field: v for field, v in found.items() if v is not None}


def longrope_scaling(factors: dict[str, Any], dims: int, context: int, original: int, attn_factor: float,
                     path: Path) -> RopeScaling:
    """The 'longrope' RopeScaling of a file's factor tensors (both, dims / 2 positive numbers each), its context, its
    original context and its stored attention factor; ValueError naming the tensor or key otherwise."""
    import numpy as np

    lists = {}
    for field, name in ROPE_FACTORS.items():
        got = factors.get(field)
        if got is None:
            raise ValueError(f"{path}: GGUF holds {ROPE_FACTORS[next(iter(factors))]!r} but not {name!r}; longrope "
                             f"needs both factor tensors")
        if got.shape != (dims // 2,) or not np.isfinite(got).all() or not (got > 0).all():
            raise ValueError(f"{path}: tensor {name!r} must hold {dims // 2} finite factors > 0, one per rotated pair "
                             f"(rope.dimension_count {dims}); it holds {got.size}")
        lists[field] = tuple(_f32(x) for x in got)  # stored as float32: read as the shortest decimal of each
    if not 0 < original <= context:
        raise ValueError(f"{path}: GGUF metadata rope.scaling.original_context_length is {original:,}; longrope needs "
                         f"1..context_length ({context:,})")
    if not (math.isfinite(attn_factor) and attn_factor > 0):
        raise ValueError(f"{path}: GGUF metadata rope.scaling.attn_factor is {attn_factor!r}; it must be a finite "
                         f"number > 0")
    factor = context / original  # transformers' factor whenever the original context is given (Phi-3's layout)
    default = longrope_attention_factor(factor, original)
    # the key is float32: transformers' own default when it is that rounded, so the config reads back exactly
    attention = default if _f32(default) == _f32(attn_factor) else _f32(attn_factor)
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       attention_factor=attention, **lists)


def _f32(value: float) -> float:
    """A float32 value as the shortest decimal that is the same float32."""
    import numpy as np

    return float(str(np.float32(value)))
