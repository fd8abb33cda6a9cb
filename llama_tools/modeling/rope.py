"""RoPE's facts that need no torch: the paper's angles θ̄_t and which scalings the model computes.

The two q/k row layouts live in rope_layouts.py (config needs them too, below this module).
"""

from __future__ import annotations

import math

from .config import ModelConfig

SUPPORTED_SCALING = ("linear", "llama3")


def check_scaling_supported(cfg: ModelConfig) -> None:
    """ValueError when the model cannot compute cfg's rope_scaling (counting still works)."""
    if cfg.rope_scaling and cfg.rope_scaling.type not in SUPPORTED_SCALING:
        raise ValueError(f"config {cfg.source or cfg.name!r}: rope_scaling type {cfg.rope_scaling.type!r} is "
                         f"not supported by the model (supported: {', '.join(SUPPORTED_SCALING)}); counting still works")


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """θ̄_t = base^(-t/n6) for t = 0, 2, ..., n6-2 (the paper's bar-theta), after rope_scaling."""
    check_scaling_supported(cfg)
    d = cfg.head_dim
    inv = [cfg.rope_theta ** (-t / d) for t in range(0, d, 2)]
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.type == "linear":
        return [f / s.factor for f in inv]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out
