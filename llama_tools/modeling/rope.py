"""RoPE's facts that need no torch: the paper's angles θ̄_t and which scalings the model computes.

Every scaling transformers implements (modeling_rope_utils.py, 4.57) is computed here to its arithmetic:
linear, llama3 and yarn give one table for every pass; dynamic (NTK) and longrope pick theirs from the length of
the pass (`seq_len` = the largest position in it + 1), as transformers' RotaryEmbedding does at each forward call.
With a KV cache that means: a pass's new queries and keys are rotated with the tables of that pass's length, and
the keys already cached keep the rotation they were stored with (transformers' decode, step by step). An ONNX graph
computes them from the pass's length (exporters/rope_tables.py); a GGUF's fixed keys cannot hold them.

Partial rotary (Phi-4-mini's partial_rotary_factor 0.75, GPT-NeoX's rotary_pct): the angles are those of a head of
width rotary_dim = int(n6 x factor), base^(-t/rotary_dim), and only the first rotary_dim channels of each q/k head
turn (in the row layout's pairs within them); the others pass through. transformers 4.57 computes every scaling's
frequencies over that width (modeling_rope_utils: dim = int(head_dim * partial_rotary_factor)).

The two q/k row layouts live in rope_layouts.py (config needs them too, below this module).
"""

from __future__ import annotations

import math

from .config import ModelConfig

SUPPORTED_SCALING = ("linear", "llama3", "yarn", "dynamic", "longrope")
PER_PASS_SCALING = ("dynamic", "longrope")  # tables that depend on the pass's length


# The config.json keys that say the rotary width, in the families whose transformers code reads them; a family that
# reads both takes the first (transformers 4.57's GPTNeoXConfig sets partial_rotary_factor from rotary_pct).
PARTIAL_ROTARY_KEYS = ("rotary_pct", "partial_rotary_factor")


def rotary_dim_of(factor: float, head_dim: int) -> int:
    """transformers' rotary width: int(head_dim * partial_rotary_factor), truncated as its rope init does."""
    return int(head_dim * factor)


def partial_rotary_factor(cfg: ModelConfig) -> float:
    """The partial_rotary_factor a config.json says for cfg's rotary width: rotary_dim / n6, nudged up by an ulp
    where the quotient times n6 rounds below rotary_dim (transformers truncates: 30 / 44 * 44 is 29.999...)."""
    factor = cfg.rotary_dim / cfg.head_dim
    while rotary_dim_of(factor, cfg.head_dim) < cfg.rotary_dim:
        factor = math.nextafter(factor, 2.0)
    return factor


def check_partial_rotary(factor: object, head_dim: int, where: str, key: str = "partial_rotary_factor") -> int:
    """The rotary width a partial_rotary_factor gives for heads of head_dim; a one-line ValueError naming KEY when
    the factor is not a number in (0, 1] or the width is not even and > 0."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor)
                                                                               and 0 < factor <= 1):
        raise ValueError(f"{where}: field {key!r} must be a number in (0, 1], got {factor!r}")
    dim = rotary_dim_of(float(factor), head_dim)
    if dim <= 0 or dim % 2:
        raise ValueError(f"{where}: field {key!r} is {factor!r}: it rotates int({head_dim} x {factor!r}) = {dim} "
                         f"channels of each head, and RoPE needs an even number > 0")
    return dim


def check_scaling_supported(cfg: ModelConfig) -> None:
    """ValueError when the model cannot compute cfg's rope_scaling (counting still works)."""
    if cfg.rope_scaling and cfg.rope_scaling.type not in SUPPORTED_SCALING:
        raise ValueError(f"config {cfg.source or cfg.name!r}: rope_scaling type {cfg.rope_scaling.type!r} is "
                         f"not supported by the model (supported: {', '.join(SUPPORTED_SCALING)}); counting still works")


def per_pass(cfg: ModelConfig) -> bool:
    """True when RoPE's tables depend on the pass's length (dynamic, longrope)."""
    return cfg.rope_scaling is not None and cfg.rope_scaling.type in PER_PASS_SCALING


def pass_key(cfg: ModelConfig, seq_len: int) -> tuple[str, int]:
    """What a pass's tables depend on: longrope's short or long factors, dynamic's length clamped below by the
    context (within it the base is unchanged). Equal keys, equal tables."""
    s = cfg.rope_scaling
    if s is not None and s.type == "longrope":
        return ("long" if seq_len > s.original_max_position_embeddings else "short"), 0
    if s is not None and s.type == "dynamic":
        return "dynamic", max(seq_len, cfg.max_position_embeddings)
    return "fixed", 0


def context_length(cfg: ModelConfig) -> int:
    """The positions a run may reach: max_position_embeddings, or for dynamic NTK that times its factor (the length
    its grown base is scaled for: positions past max_position_embeddings are what dynamic is for)."""
    s = cfg.rope_scaling
    if s is not None and s.type == "dynamic":
        return int(cfg.max_position_embeddings * max(float(s.factor), 1.0))
    return cfg.max_position_embeddings


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (yarn's and longrope's attention factor; 1 otherwise)."""
    s = cfg.rope_scaling
    if s is None or s.type not in ("yarn", "longrope") or s.attention_factor is None:
        return 1.0
    return float(s.attention_factor)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """transformers' default for yarn: 0.1 m ln(factor) + 1, as a ratio of two such when DeepSeek's mscale and
    mscale_all_dim are both given (and non-zero)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def longrope_attention_factor(factor: float, original: int) -> float:
    """transformers' default for longrope: sqrt(1 + ln(factor) / ln(original context)), 1 when factor <= 1."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn(inv: list[float], d: int, base: float, s) -> list[float]:  # noqa: ANN001
    """yarn: frequencies that turn fewer than beta_slow times over the original context interpolated (/ factor),
    more than beta_fast times kept, a linear ramp over the dimensions between."""
    def correction_dim(rotations: float) -> float:
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep (extrapolate), 1: interpolate
        extrapolation = 1 - ramp
        out.append(f / s.factor * (1 - extrapolation) + f * extrapolation)
    return out


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> list[float]:
    """θ̄_t = base^(-t/n6) for t = 0, 2, ..., n6-2 (the paper's bar-theta), after rope_scaling; with partial rotary
    n6 is the rotary width (rotary_dim), as transformers computes them.

    seq_len: the pass's length (largest position + 1), which dynamic and longrope read; None: a pass within
    the original context (dynamic's unchanged base, longrope's short factors)."""
    check_scaling_supported(cfg)
    d = cfg.rotary_dim
    base = cfg.rope_theta
    s = cfg.rope_scaling
    if s is not None and s.type == "dynamic" and seq_len is not None:
        # transformers: the base grows with the pass past config.max_position_embeddings, seq_len clamped below by it
        m = cfg.max_position_embeddings
        length = max(seq_len, m)
        base = base * ((s.factor * length / m) - (s.factor - 1)) ** (d / (d - 2))
    inv = [base ** (-t / d) for t in range(0, d, 2)]
    if s is None or s.type == "dynamic":
        return inv
    if s.type == "linear":
        return [f / s.factor for f in inv]
    if s.type == "yarn":
        return _yarn(inv, d, base, s)
    if s.type == "longrope":
        long = seq_len is not None and seq_len > s.original_max_position_embeddings
        factors = s.long_factor if long else s.short_factor
        return [f / e for f, e in zip(inv, factors)]  # type: ignore[arg-type]
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
