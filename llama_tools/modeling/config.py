"""The model configuration: one typed dataclass, every size the model, accounting, reports and export use.

The paper's constants keep their symbols: n1 vocab, n2 hidden width, n5 heads, n6 head width,
n7 FFN width, n8 decoder layers (n3, the sequence length, is an input, not a config value).
Presets live in presets.py, the HF/Meta file readers in config_files.py. No torch, no pandas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from . import dtypes
from .families import FAMILY_NAMES, FULL, SLIDING
from .rope_layouts import HALF, ROPE_LAYOUTS, RopeLayout

PositionEncoding = Literal["rope", "alibi"]

# Every size is an int64 for torch and ONNX shapes; one past it is refused when the config is read.
INT64_MAX = 2**63 - 1

# The most a config file may say, by HF key (config_files maps Meta's keys onto these). Each is far past every
# published model (the largest in the comment) and small enough that what is built per unit of it (a per-layer
# list, per-expert tensor names, a RoPE table before the memory check) cannot run away. Counting is analytic in all
# of them: a 405B or DeepSeek-V3 config counts in milliseconds, and a 10^8-decoder one is refused by the memory
# check (with its figure) rather than here.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 2**24,  # Gemma 3: 262,144
    "hidden_size": 2**20,  # Llama 3.1 405B: 16,384
    "intermediate_size": 2**22,  # 405B: 53,248
    "head_dim": 2**16,  # Gemma: 256
    "num_attention_heads": 2**16,  # 405B: 128
    "num_key_value_heads": 2**16,
    "num_hidden_layers": 2**30,  # 405B: 126 (decoders are counted, never listed: see LAYER_LIST_LIMIT)
    "num_local_experts": 2**16,  # Qwen3-Next: 512 (Qwen3-MoE's num_experts is bounded by this too)
    "num_experts_per_tok": 2**16,  # Qwen3-Next: 10
    "max_position_embeddings": 2**40,  # Llama 4 Scout: 10,485,760
    "original_max_position_embeddings": 2**40,
    "sliding_window": 2**40,  # Qwen2: 131,072
    "sliding_window_pattern": 2**30,  # Gemma 3: 6
    "multiple_of": 2**22,  # Llama 3: 4,096
    "token_id": 2**31 - 1,  # bos/eos/pad: an id of a vocabulary of at most vocab_size
}
# A config whose layers alternate (Gemma 2/3's sliding pattern) lists each layer's attention: at most this many.
LAYER_LIST_LIMIT = 2**20
# rope_scaling's factor, low_freq_factor and high_freq_factor (DeepSeek-V3's yarn: 40, Llama 3.1: 8).
ROPE_FACTOR_LIMIT = 2.0**16

# The families (families.py); `family` picks the tensor names and what `convert` writes.
FAMILIES = FAMILY_NAMES
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")  # the FFN's: SwiGLU's SiLU, GeGLU's tanh-approximated GELU, exact GELU
NORM_KINDS = ("rms", "layer")  # RMSNorm with a gain; LayerNorm with a gain and a bias (GPT-NeoX, Falcon)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF writes it in `rope_scaling`."""

    type: str  # "linear", "llama3", "dynamic", "yarn", ...
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn and longrope: cos and sin are multiplied by this (transformers' attention_factor, yarn's mscale ratio);
    # None: 1. The reader resolves transformers' defaults into it (config_files._rope_scaling).
    attention_factor: float | None = None
    beta_fast: float = 32.0  # yarn: the ramp's ends, in rotations over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors, n6/2 each
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for f in ("short_factor", "long_factor"):  # lists from JSON or asdict: tuples, so the config hashes
            if isinstance(getattr(self, f), list):
                object.__setattr__(self, f, tuple(getattr(self, f)))

    def validate(self, where: str) -> None:
        """Raise ValueError naming the first field out of range (a type a string, factors > 0, ...)."""
        if not isinstance(self.type, str):
            raise ValueError(f"{where}: field rope_scaling.type must be a string, got {self.type!r}")
        for f in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{where}: field rope_scaling.{f} must be a finite number > 0, got {v!r}")
        n = self.original_max_position_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{where}: field rope_scaling.original_max_position_embeddings must be an integer "
                             f">= 1, got {n!r}")
        for f in ("attention_factor", "beta_fast", "beta_slow"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or (f == "attention_factor" and v <= 0)):
                raise ValueError(f"{where}: field rope_scaling.{f} must be a finite number"
                                 f"{' > 0' if f == 'attention_factor' else ''}, got {v!r}")
        for f in ("short_factor", "long_factor"):
            v = getattr(self, f)
            if v is not None and not all(not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
                                         and x > 0 for x in v):
                raise ValueError(f"{where}: field rope_scaling.{f} must be a list of finite numbers > 0")
        if self.type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError(f"{where}: longrope scaling needs rope_scaling.short_factor and long_factor")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"{where}: field rope_scaling.high_freq_factor must be greater than low_freq_factor "
                             f"for llama3 scaling, got {self.high_freq_factor} <= {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-family decoder: every size the model, the accounting, the reports and the export use."""

    name: str
    vocab_size: int  # n1
    hidden_size: int  # n2
    intermediate_size: int  # n7
    num_hidden_layers: int  # n8
    num_attention_heads: int  # n5
    num_key_value_heads: int = 0  # 0 means n5 (plain multi-head attention)
    head_dim: int = 0  # n6; 0 means n2 / n5
    family: str = "llama"
    rms_norm_eps: float = 1e-6
    position_encoding: PositionEncoding = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_layout: RopeLayout = HALF  # the q/k row order of the weights (rope.py)
    # Partial rotary (Phi-4-mini, GPT-NeoX): RoPE turns the first rotary_dim channels of each q/k head, the rest pass
    # through; 0 means n6 (every channel). transformers: int(n6 * partial_rotary_factor) (rope.rotary_dim_of).
    rotary_dim: int = 0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry biases
    o_bias: bool = False  # HF `attention_bias=True` puts a bias on o_proj too
    mlp_bias: bool = False
    norm_head: bool = False  # Baichuan2: lm_head rows are L2-normalized at inference
    sliding_window: int | None = None  # Mistral v0.1, Gemma 2/3; applied by the model's mask
    layer_types: tuple[str, ...] | None = None  # per layer SLIDING or FULL attention; None: the window, if any, on all
    # Family overrides of the LLaMA block (families.py); all off for LLaMA itself.
    qk_norm: bool = False  # Qwen3, Gemma 3: each q and k head RMS-normalized (a gain of n6) before RoPE
    norm_plus_one: bool = False  # Gemma: every norm scales by (1 + γ), so a stored γ of 0 is the identity
    embed_scale: bool = False  # Gemma: Z^0 = rows of D times sqrt(n2)
    hidden_act: str = "silu"  # the FFN gate's activation (ACTIVATIONS)
    norm_kind: str = "rms"  # NORM_KINDS; "layer": (X - mean) / sigma times γ plus β, eps rms_norm_eps
    gated_mlp: bool = True  # False: Yhat = act(Ybar W^{j7 T} + b) W^{j6 T} + b, no gate (GPT-NeoX, Falcon)
    parallel_residual: bool = False  # Z^{j+1} = Z^j + (R^j + Yhat^j), attention and FFN both reading Z^j
    shared_norm: bool = False  # the parallel form with one norm feeding both (Falcon-7B's input_layernorm)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the FFN too, before each residual
    post_norms: bool = False  # OLMo 2: norms after attention and after the FFN only (none before them)
    qk_norm_whole: bool = False  # OLMo 2: the q/k norm over the whole projection (n5 n6, kv n6), not per head
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: scores divided by sqrt(this) instead of sqrt(n6)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap tanh(scores / cap), before the mask
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap tanh(logits / cap)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: rope_theta
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: whether layer j rotates q and k; None: every layer
    # Granite's four multipliers: Z^0 times the first, R and Yhat times the second before each residual, scores
    # Qbar Kbar^T times the third instead of / sqrt(n6), H divided by the fourth.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts means a dense SwiGLU FFN.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # width of one routed expert; 0 means n7
    norm_topk_prob: bool = True  # the k chosen softmax weights renormalized to sum 1 (Mixtral always; Qwen3-MoE's flag)
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int | None = None  # as the source says; None when it names none
    torch_dtype: str = dtypes.FLOAT32.name  # the dtype the published weights are stored in
    source: str = ""  # where the config came from: a preset name or a file path

    def __post_init__(self) -> None:
        for name, value in self._derivations().items():
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        self.validate()

    def _derivations(self) -> dict[str, int]:
        """Sizes a config may leave at 0, and what they are then: kv heads = n5, n6 = n2 / n5, expert width = n7,
        the rotary width n6 (whole heads rotate)."""
        head_dim = self.head_dim or self.hidden_size // max(self.num_attention_heads, 1)
        return {"num_key_value_heads": self.num_attention_heads,
                "head_dim": self.hidden_size // max(self.num_attention_heads, 1),
                "moe_intermediate_size": self.intermediate_size if self.num_experts else 0,
                "rotary_dim": head_dim if isinstance(head_dim, int) else 0}

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense."""
        where = f"config {self.source or self.name!r}"
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= INT64_MAX:
                raise ValueError(f"{where}: field {f} must be a positive integer of at most 64 bits, got {v!r}")
        if self.hidden_size % self.num_attention_heads and self.head_dim == self.hidden_size // self.num_attention_heads:
            raise ValueError(f"{where}: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}; set head_dim explicitly or fix the sizes")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{where}: num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.torch_dtype not in dtypes.DTYPES:
            raise ValueError(f"{where}: torch_dtype {self.torch_dtype!r} is not one of {', '.join(dtypes.DTYPES)}")
        if self.position_encoding not in ("rope", "alibi"):
            raise ValueError(f"{where}: position_encoding must be 'rope' or 'alibi', got {self.position_encoding!r}")
        if self.position_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"{where}: head_dim {self.head_dim} must be even for RoPE")
        r = self.rotary_dim
        if not isinstance(r, int) or isinstance(r, bool) or not 0 < r <= self.head_dim or (
                r % 2 and self.position_encoding == "rope"):
            raise ValueError(f"{where}: field rotary_dim (partial_rotary_factor x head_dim) must be an even integer "
                             f"in 2..head_dim ({self.head_dim}), got {r!r}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"{where}: rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"{where}: family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{where}: field {f} must be a finite number > 0, got {v!r}")
        for f in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "norm_head", "norm_topk_prob"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{where}: field {f} must be true or false, got {getattr(self, f)!r}")
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}: field {f} must be an integer >= 0, got {v!r}")
        pad = self.pad_token_id
        if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 0):
            raise ValueError(f"{where}: field pad_token_id must be an integer >= 0 or null, got {pad!r}")
        sw = self.sliding_window
        if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or sw < 1):
            raise ValueError(f"{where}: field sliding_window must be an integer >= 1 or null, got {sw!r}")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(where)
            for f in ("short_factor", "long_factor"):
                v = getattr(self.rope_scaling, f)
                if v is not None and len(v) != self.rotary_dim // 2:
                    raise ValueError(f"{where}: field rope_scaling.{f} must hold rotary_dim / 2 = "
                                     f"{self.rotary_dim // 2} numbers (one per rotated channel pair), got {len(v)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act must be one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"{where}: norm_kind must be one of {', '.join(NORM_KINDS)}, got {self.norm_kind!r}")
        if self.shared_norm and not self.parallel_residual:
            raise ValueError(f"{where}: shared_norm needs parallel_residual (one norm feeding attention and FFN)")
        for f in ("qk_norm", "norm_plus_one", "embed_scale", "sandwich_norms", "post_norms", "qk_norm_whole",
                  "gated_mlp", "parallel_residual", "shared_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{where}: field {f} must be true or false, got {getattr(self, f)!r}")
        for f in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta",
                  "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not (math.isfinite(v) and v > 0)):
                raise ValueError(f"{where}: field {f} must be a finite number > 0 or null, got {v!r}")
        lt = self.layer_types
        if lt is not None and (not isinstance(lt, tuple) or len(lt) != self.num_hidden_layers
                               or any(t not in (SLIDING, FULL) for t in lt)):
            raise ValueError(f"{where}: field layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                             f"{self.num_hidden_layers} layers, got {lt!r}")
        rl = self.rope_layers
        if rl is not None and (not isinstance(rl, tuple) or len(rl) != self.num_hidden_layers
                               or any(not isinstance(r, bool) for r in rl)):
            raise ValueError(f"{where}: field rope_layers must say true or false for each of the "
                             f"{self.num_hidden_layers} layers, got {rl!r}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"{where}: num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")

    # Derived sizes: the one place they are computed.
    @property
    def n_rep(self) -> int:
        """Query heads that share one K/V head (1 for MHA, n5 for MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def partial_rotary(self) -> bool:
        """Whether RoPE turns only the first rotary_dim channels of each q/k head (the rest pass through)."""
        return self.rotary_dim < self.head_dim

    def slides(self, j: int) -> bool:
        """Whether layer j attends through the sliding window (every layer when layer_types is None)."""
        return self.sliding_window is not None and (self.layer_types is None or self.layer_types[j] == SLIDING)

    def rotates(self, j: int) -> bool:
        """Whether layer j rotates q and k by RoPE (SmolLM3 leaves some layers without; ALiBi none)."""
        return self.position_encoding == "rope" and (self.rope_layers is None or self.rope_layers[j])

    @property
    def uniform_layers(self) -> bool:
        """Whether every decoder layer computes the same function of its own weights (no local/global mix)."""
        # Without layer_types every layer slides alike: no loop over n8, which may be any number.
        if self.rope_layers is not None and len(set(self.rope_layers)) > 1:
            return False
        return self.sliding_window is None or self.layer_types is None or len(set(self.layer_types)) <= 1

    @property
    def attention_scale(self) -> float:
        """What scores are divided by the square root of: n6, or Gemma's query_pre_attn_scalar."""
        return self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim

    @property
    def score_scale(self) -> float:
        """What Qbar Kbar^T is multiplied by: Granite's attention_multiplier, else 1 / sqrt(n6 or Gemma's s)."""
        return self.attention_multiplier if self.attention_multiplier is not None \
            else 1.0 / math.sqrt(self.attention_scale)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes`; a size equal to its derivation (n6 = n2 / n5, ...) is derived anew.

        A function of the field values alone: equal configs give equal copies.
        """
        rederive = {name: 0 for name, value in self._derivations().items()
                    if getattr(self, name) == value and name not in changes}
        n = changes.get("num_hidden_layers")
        for f in ("layer_types", "rope_layers"):
            listed = getattr(self, f)
            if n is not None and listed is not None and f not in changes:
                # fewer layers keep the first n entries; more repeat the pattern
                rederive[f] = tuple(listed[j % len(listed)] for j in range(n))
        return dataclasses.replace(self, **{**rederive, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for f in ("layer_types", "rope_layers"):
            if d.get(f) is not None:
                d[f] = tuple(d[f])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


