"""The shape report: every weight and every activation of one forward pass, in the paper's order.

Weights come from `llama_tools.modeling.weights.weight_specs` (the one name table); activations follow
sections 5-7 of the paper (Z^j, rnorm, Q/K/V and their per-head blocks, rope, scores, softmax,
U, R, Y, the SwiGLU intermediates, Z^{j+1}, the final rnorm and the logits H), with the batch
axis in front and the shapes of `llama_tools.modeling.model.Llama`'s tensors. A per-head row
(Q^{j,i}, scores, ...) has the shape of one block and `count` blocks; numel and bytes cover all of them.
No torch and no pandas here: `to_frame` imports pandas when asked.
The families' extra steps (families.py) get rows of their own, none of which a plain LLaMA has: Qwen3's and
Gemma 3's per-head q/k norms, Gemma's embedding scale and GELU-tanh gate, Gemma 2/3's norms after attention and
after the FFN, Gemma 2's soft caps of scores and logits; a sliding layer's scores read the window mask M^{sw}.
Every decoder has decoder 0's shapes (and row count: sliding and global layers differ in symbols and words only),
so `--layers first` costs the same for any depth; `--layers all` is refused past MAX_ROWS rows (counted from
decoder 0 before anything is built) instead of building GBs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_tools.modeling import dtypes
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.families import SLIDING
from llama_tools.modeling.weights import WeightSpec, weight_specs

if TYPE_CHECKING:
    from llama_tools.counting.transformers_count import ModuleTree

LAYER_CHOICES = ("all", "first")
ONLY_CHOICES = ("all", "weights", "activations")
MAX_DIMS = 4  # no tensor of the forward pass has more axes
# Rows of one report, at most. llama-3.1-405b (126 decoders) has ~4,300 and a 256-expert MoE of 61 decoders
# ~48,000; 50,000 rows take ~300 MB and seconds to render (benchmarks/bench_count_params.py measures it),
# while 10^5 decoders would take GBs. Deeper stacks: --layers first.
MAX_ROWS = 50_000


@dataclass(frozen=True)
class ShapeRow:
    """One weight or activation: where it lives, what the paper calls it, and its shape."""

    kind: str  # "weight" or "activation"
    section: str  # the paper's section ("6.2", "7", ...)
    layer: int | None  # decoder index j; None outside the stack
    symbol: str  # the paper's symbol (j substituted), or ours where the paper has none
    description: str
    module: str  # weights: parameter name (= HF name); activations: the HF module that produces or reads it
    port: str  # "param", "in" / "out" of `module`, "inside" (computed within its forward), or "after" (applied
    # to `module`'s output by its parent: Gemma 2's logit soft cap)
    shape: tuple[int, ...]  # of one block where count > 1
    count: int = 1  # number of blocks (heads, experts) of this shape
    meta_name: str | None = None  # Meta checkpoint name (weights only)
    dtype: str | None = None  # None: the report's dtype; token and position ids are int64

    @property
    def numel(self) -> int:
        """Elements of all `count` blocks."""
        return math.prod(self.shape) * self.count


@dataclass(frozen=True)
class ShapeReport:
    """The rows of one model at one sequence length, batch, past length and dtype."""

    model: str
    seq_len: int  # n3
    batch: int
    past: int  # cached positions before this step (0: a prompt pass)
    dtype: str
    layers: str  # "all" or "first"
    rows: tuple[ShapeRow, ...]
    notes: tuple[str, ...] = ()  # what the rows leave out or spread out (foreign activations, sliding layers)

    @property
    def dtype_bytes(self) -> int:
        return int(dtypes.get(self.dtype).bytes)

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (one dict per tensor, fixed columns) for CSV, Markdown and pandas."""
        out = []
        for order, r in enumerate(self.rows):
            dims = list(r.shape) + [None] * (MAX_DIMS - len(r.shape))
            rec: dict[str, Any] = {
                "order": order, "kind": r.kind, "section": r.section, "layer": r.layer, "symbol": r.symbol,
                "description": r.description, "module": r.module, "port": r.port, "meta_name": r.meta_name,
                "shape": "x".join(map(str, r.shape)), "rank": len(r.shape),
            }
            rec.update({f"d{i}": d for i, d in enumerate(dims)})
            dtype = r.dtype or self.dtype
            rec.update({"count": r.count, "numel": r.numel, "dtype": dtype, "bytes": r.numel * int(dtypes.get(dtype).bytes)})
            out.append(rec)
        return out

    def payload(self) -> dict[str, Any]:
        """The JSON form: the inputs of the report, its notes when it has any, and its rows."""
        return {"model": self.model, "seq_len": self.seq_len, "batch": self.batch, "past": self.past,
                "dtype": self.dtype, "layers": self.layers, **({"notes": list(self.notes)} if self.notes else {}),
                "rows": self.records()}


# --- weights --------------------------------------------------------------------------------------

def _weight_section(spec: WeightSpec, sandwich: bool = False) -> str:
    """Where the paper introduces the weight: D in 4, attention in 6.2, FFN in 6.4, W^8 in 7.

    sandwich: Gemma 2/3, whose post_attention_layernorm normalizes R^j before 6.3's residual.
    """
    if spec.component == "embedding":
        return "4"
    if spec.component == "lm_head":
        return "7"
    if spec.component == "final_norm":
        return "6.6"
    if spec.component == "norm":
        if "input_layernorm" in spec.name:
            return "6.1"
        return "6.3" if sandwich and "post_attention_layernorm" in spec.name else "6.4"
    return "6.2" if spec.component.startswith("attn") else "6.4"


def _first_decoder_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """weight_specs(cfg) without decoders 1..n8-1, built from a one-decoder copy (constant time in n8)."""
    n8 = cfg.num_hidden_layers
    specs = weight_specs(cfg.replace(num_hidden_layers=1))
    # The symbols outside the stack that name n8: the final norm's gain γ^{n8} (and a LayerNorm's bias β^{n8}).
    named = {"γ^{1}": f"γ^{{{n8}}}", "β^{1}": f"β^{{{n8}}}"}
    return [dataclasses.replace(s, symbol=named[s.symbol]) if s.component == "final_norm" and s.symbol in named
            else s for s in specs]


def weight_rows(cfg: ModelConfig, layers: str = "all") -> list[ShapeRow]:
    """One row per parameter, straight from weight_specs (a tied lm_head appears once, as D)."""
    specs = weight_specs(cfg) if layers == "all" else _first_decoder_specs(cfg)
    after = cfg.sandwich_norms or cfg.post_norms  # a norm after attention (Gemma 2/3, OLMo 2)
    return [ShapeRow("weight", _weight_section(s, after), s.layer, s.symbol, f"weight ({s.component})",
                     s.name, "param", s.shape, meta_name=s.meta_name) for s in specs]


# --- activations ----------------------------------------------------------------------------------

def _gain(cfg: ModelConfig) -> str:
    """What a norm row adds to "rnorm(X)": Gemma's gain is 1 + γ; GPT-NeoX's and Falcon's norm is a LayerNorm."""
    if cfg.norm_kind == "layer":
        return ", as LayerNorm: (X - mean) / sigma γ + β"
    return ", gain 1 + γ" if cfg.norm_plus_one else ""


def _layer_kinds(cfg: ModelConfig) -> list[bool]:
    """The kinds of layer the model has, global (False) before sliding (True); bounded by layer_types' own length."""
    if cfg.sliding_window is None:
        return [False]
    if cfg.layer_types is None:
        return [True]
    return sorted({t == SLIDING for t in cfg.layer_types})


def _mask_symbol(sliding: bool) -> str:
    """M: the causal mask of a global layer; M^{sw}: a sliding layer's, which also hides keys past the window."""
    return "M^{sw}" if sliding else "M"


def _custom_scale(cfg: ModelConfig) -> bool:
    """Whether the scores are divided by sqrt(s) of Gemma's query_pre_attn_scalar rather than sqrt(n6)."""
    return cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim


def _rope_base(cfg: ModelConfig, sliding: bool) -> str:
    """The RoPE base a layer rotates with, when the layers differ in it (Gemma 3's local layers); else ""."""
    if cfg.rope_local_theta is None:
        return ""
    if sliding:
        return f", local base {cfg.rope_local_theta:g}"
    sc = cfg.rope_scaling
    return f", base {cfg.rope_theta:g}" + (f" ({sc.type} scaling x{sc.factor:g})" if sc else "")


def _rotary_width(cfg: ModelConfig) -> str:
    """The channels RoPE turns, when fewer than a head's (partial rotary); else ""."""
    if not cfg.partial_rotary:
        return ""
    return (f", rotating channels 0..{cfg.rotary_dim - 1} of n6 = {cfg.head_dim} (partial rotary; the other "
            f"{cfg.head_dim - cfg.rotary_dim} pass through)")


def _layer_activations(cfg: ModelConfig, j: int, b: int, n3: int, past: int) -> list[ShapeRow]:
    """Decoder j, 6.1 to 6.4: Z^j -> Z^{j+1}, with the family's extra steps."""
    n2, n5, kv, n6 = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    total = past + n3  # key positions each query sees: cached ones plus this step's
    p = f"model.layers.{j}."
    a = lambda sec, sym, desc, mod, port, shape, count=1: ShapeRow(  # noqa: E731
        "activation", sec, j, sym, desc, mod, port, tuple(shape), count)
    rope, gain, sliding = cfg.rotates(j), _gain(cfg), cfg.slides(j)
    qs, ks = (f"Qbar^{{{j},i}}", f"Kbar^{{{j},i}}") if rope else (f"Q^{{{j},i}}", f"K^{{{j},i}}")
    m = cfg.residual_multiplier
    times = f"{m:g} " if m != 1.0 else ""  # Granite: what attention and the FFN add is scaled first
    raw = f"{qs}{ks}T x {cfg.attention_multiplier:g}" if cfg.attention_multiplier is not None else \
        f"{qs}{ks}T/sqrt({'s' if _custom_scale(cfg) else 'n6'})"
    cap = cfg.attn_logit_softcap
    score = f"{f'softcap({raw})' if cap is not None else raw}+{_mask_symbol(sliding)}"
    x = "Z^j" if cfg.post_norms else "Zbar^j"  # OLMo 2: attention reads the residual stream itself
    rows = [a("6.1", f"Z^{{{j}}}", f"decoder {j} input", p.rstrip("."), "in", (b, n3, n2))]
    if not cfg.post_norms:
        rows.append(a("6.1", f"Zbar^{{{j}}}", f"rnorm(Z^j){gain}", p + "input_layernorm", "out", (b, n3, n2)))
    rows += [
        a("6.2", f"Q^{{{j}}}", f"queries {x} W^{{j1T}}", p + "self_attn.q_proj", "out", (b, n3, cfg.q_size)),
        a("6.2", f"K^{{{j}}}", f"keys {x} W^{{j2T}}", p + "self_attn.k_proj", "out", (b, n3, cfg.kv_size)),
        a("6.2", f"V^{{{j}}}", f"values {x} W^{{j3T}}", p + "self_attn.v_proj", "out", (b, n3, cfg.kv_size)),
        a("6.2", f"Q^{{{j},i}}", "query block of one head (column split of Q^j)", p + "self_attn", "inside",
          (b, n3, n6), n5),
        a("6.2", f"K^{{{j},i}}", "key block of one KV head", p + "self_attn", "inside", (b, n3, n6), kv),
        a("6.2", f"V^{{{j},i}}", "value block of one KV head", p + "self_attn", "inside", (b, n3, n6), kv),
    ]
    if cfg.qk_norm and cfg.qk_norm_whole:
        # OLMo 2: each row of Q^j and K^j normalized over the whole projection, before the heads are split.
        rows += [
            a("6.2", f"rnorm(Q^{{{j}}})", f"q norm: each query row RMS-normalized over n5 n6{gain}",
              p + "self_attn.q_norm", "out", (b, n3, cfg.q_size)),
            a("6.2", f"rnorm(K^{{{j}}})", f"k norm: each key row RMS-normalized over kv n6{gain}",
              p + "self_attn.k_norm", "out", (b, n3, cfg.kv_size)),
        ]
    elif cfg.qk_norm:
        # Qwen3, Gemma 3: each head's row normalized over its n6 channels by one shared gain, before RoPE.
        rows += [
            a("6.2", f"rnorm(Q^{{{j},i}})", f"q norm: each query head RMS-normalized over n6{gain}",
              p + "self_attn.q_norm", "out", (b, n3, n6), n5),
            a("6.2", f"rnorm(K^{{{j},i}})", f"k norm: each key head RMS-normalized over n6{gain}",
              p + "self_attn.k_norm", "out", (b, n3, n6), kv),
        ]
    if rope:
        q_in, k_in = ("rnorm(Q^{j,i})", "rnorm(K^{j,i})") if cfg.qk_norm else ("Q^{j,i}", "K^{j,i}")
        base = _rope_base(cfg, sliding) + _rotary_width(cfg)
        rows += [
            a("6.2", f"Qbar^{{{j},i}}", f"rope({q_in}){base}", p + "self_attn.rope", "out", (b, n3, n6), n5),
            a("6.2", f"Kbar^{{{j},i}}", f"rope({k_in}){base}", p + "self_attn.rope", "out", (b, n3, n6), kv),
        ]
    if past:
        rows += [
            a("6.2", f"Kpast^{{{j}}}", "cached keys read (past_key_values)", p + "self_attn", "in", (b, kv, past, n6)),
            a("6.2", f"Vpast^{{{j}}}", "cached values read (past_key_values)", p + "self_attn", "in",
              (b, kv, past, n6)),
        ]
    rows += [
        a("6.2", f"Kcache^{{{j}}}", "present keys (cache after this step)", p + "self_attn", "out",
          (b, kv, total, n6)),
        a("6.2", f"Vcache^{{{j}}}", "present values (cache after this step)", p + "self_attn", "out",
          (b, kv, total, n6)),
    ]
    if cfg.n_rep > 1:
        # Grouped-query attention: each K/V head is repeated for the n_rep query heads that share it.
        rows += [
            a("6.2", f"repeat({ks})", f"keys repeated {cfg.n_rep}x to n5 heads (GQA)", p + "self_attn", "inside",
              (b, total, n6), n5),
            a("6.2", f"repeat(V^{{{j},i}})", f"values repeated {cfg.n_rep}x to n5 heads (GQA)", p + "self_attn",
              "inside", (b, total, n6), n5),
        ]
    scale = f", s = query_pre_attn_scalar = {cfg.query_pre_attn_scalar:g}" if _custom_scale(cfg) else ""
    if cap is not None:
        # Gemma 2 caps the scaled scores before the mask is added.
        rows += [
            a("6.2", raw, f"scaled scores before the soft cap{scale}", p + "self_attn", "inside", (b, n3, total), n5),
            a("6.2", f"softcap({raw})", f"scores soft-capped: {cap:g} tanh(x / {cap:g}) (attn_logit_softcapping)",
              p + "self_attn", "inside", (b, n3, total), n5),
        ]
        scale = ""
    if sliding:
        window = f", sliding window of {cfg.sliding_window} keys"
    else:
        window = ", global layer: full causal mask" if len(_layer_kinds(cfg)) > 1 else ""
    if cfg.attention_multiplier is not None:
        scale = " (attention_multiplier, not 1 / sqrt(n6))"
    if cfg.rope_layers is not None and not rope:
        window += ", no RoPE in this layer"
    rows += [
        a("6.2", score, ("attention scores (+ALiBi in M)" if cfg.position_encoding != "rope" else "attention scores")
          + scale + window,
          p + "self_attn", "inside", (b, n3, total), n5),
        a("6.2", f"smax({score})", "attention probabilities", p + "self_attn", "inside", (b, n3, total), n5),
        a("6.2", f"U^{{{j},i}}", "smax(...) V^{j,i}: one head's output", p + "self_attn", "inside", (b, n3, n6), n5),
        a("6.2", f"U^{{{j}}}", "[U^{j,0}, ..., U^{j,n5-1}]", p + "self_attn.o_proj", "in", (b, n3, cfg.q_size)),
        a("6.2", f"R^{{{j}}}", "U^j W^{j4T}", p + "self_attn.o_proj", "out", (b, n3, n2)),
    ]
    if cfg.post_norms:
        # OLMo 2: R^j normalized before the residual; the FFN reads Y^j itself.
        rows += [
            a("6.3", f"rnorm(R^{{{j}}})", f"post-attention norm: R^j normalized before the residual{gain}",
              p + "post_attention_layernorm", "out", (b, n3, n2)),
            a("6.3", f"Y^{{{j}}}", "Z^j + rnorm(R^j): the FFN's input, no norm before it", p + "mlp", "in",
              (b, n3, n2)),
        ]
    elif cfg.sandwich_norms:
        # Gemma 2/3: HF's post_attention_layernorm normalizes R^j; 6.3's norm is pre_feedforward_layernorm.
        rows += [
            a("6.3", f"rnorm(R^{{{j}}})", f"post-attention norm: R^j normalized before the residual{gain}",
              p + "post_attention_layernorm", "out", (b, n3, n2)),
            a("6.3", f"Y^{{{j}}}", "Z^j + rnorm(R^j)", p + "pre_feedforward_layernorm", "in", (b, n3, n2)),
            a("6.4", f"Ybar^{{{j}}}", f"rnorm(Y^j){gain}", p + "pre_feedforward_layernorm", "out", (b, n3, n2)),
        ]
    elif cfg.parallel_residual:
        # GPT-NeoX, Falcon: the FFN reads Z^j too (its own norm, or Falcon-7B's one input_layernorm).
        ln = p + ("input_layernorm" if cfg.shared_norm else "post_attention_layernorm")
        rows.append(a("6.4", f"Ybar^{{{j}}}", f"rnorm(Z^j){gain}: the FFN reads the layer's input, in parallel "
                                               f"with attention", ln, "out", (b, n3, n2)))
    else:
        rows += [
            a("6.3", f"Y^{{{j}}}", f"Z^j + {times}R^j", p + "post_attention_layernorm", "in", (b, n3, n2)),
            a("6.4", f"Ybar^{{{j}}}", f"rnorm(Y^j){gain}", p + "post_attention_layernorm", "out", (b, n3, n2)),
        ]
    rows += _moe_activations(cfg, j, b, n3) if cfg.is_moe else _ffn_activations(cfg, j, b, n3)
    if cfg.sandwich_norms or cfg.post_norms:
        rows += [
            a("6.4", f"rnorm(Yhat^{{{j}}})", f"post-FFN norm: Yhat^j normalized before the residual{gain}",
              p + "post_feedforward_layernorm", "out", (b, n3, n2)),
            a("6.4", f"Z^{{{j + 1}}}", "Y^j + rnorm(Yhat^j): decoder output", p.rstrip("."), "out", (b, n3, n2)),
        ]
    else:
        out = "Z^j + (R^j + Yhat^j)" if cfg.parallel_residual else f"Y^j + {times}Yhat^j"
        rows.append(a("6.4", f"Z^{{{j + 1}}}", f"{out}: decoder output", p.rstrip("."), "out", (b, n3, n2)))
    return rows


# The FFN gate's activation (config.ACTIVATIONS): the row's op name and its words.
_ACT_WORDS = {"silu": "silu", "gelu_tanh": "GELU (tanh approximation)", "gelu": "GELU (exact, erf)"}


def _ffn_activations(cfg: ModelConfig, j: int, b: int, n3: int) -> list[ShapeRow]:
    """SwiGLU: Yhat^j = (silu(Ybar W^{j5T}) ⊗ (Ybar W^{j7T})) W^{j6T}; Gemma's GeGLU puts gelu_tanh for silu."""
    n2, n7, p = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{j}.mlp"
    y = "Y" if cfg.post_norms else "Ybar"  # OLMo 2's FFN reads Y^j itself
    gate, up = f"{y}^{{{j}}}W^{{{j}5T}}", f"{y}^{{{j}}}W^{{{j}7T}}"
    act = cfg.hidden_act
    a = lambda sym, desc, mod, port, shape: ShapeRow("activation", "6.4", j, sym, desc, mod, port, shape)  # noqa: E731
    if not cfg.gated_mlp:  # GPT-NeoX, Falcon: no gate; up (dense_h_to_4h), GELU, down (dense_4h_to_h), with biases
        bias = " + b^{j7}" if cfg.mlp_bias else ""
        return [
            a(up, f"up projection{bias}", p + ".up_proj", "out", (b, n3, n7)),
            a(f"{act}({up})", f"after {_ACT_WORDS[act]}", p + ".down_proj", "in", (b, n3, n7)),
            a(f"Yhat^{{{j}}}", f"(...) W^{{j6T}}{' + b^{j6}' if cfg.mlp_bias else ''}: FFN output", p + ".down_proj",
              "out", (b, n3, n2)),
        ]
    return [
        a(gate, "gate projection", p + ".gate_proj", "out", (b, n3, n7)),
        a(f"{act}({gate})", f"gate after {_ACT_WORDS[act]}", p, "inside", (b, n3, n7)),
        a(up, "up projection", p + ".up_proj", "out", (b, n3, n7)),
        a(f"{act}({gate})⊗{up}", "gated product", p + ".down_proj", "in", (b, n3, n7)),
        a(f"Yhat^{{{j}}}", "(...) W^{j6T}: FFN output", p + ".down_proj", "out", (b, n3, n2)),
    ]


def _moe_activations(cfg: ModelConfig, j: int, b: int, n3: int) -> list[ShapeRow]:
    """Mixtral's sparse FFN as the model runs it: every expert on every token, weighted by the router."""
    n2, e7, ne, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    p, t = f"model.layers.{j}.block_sparse_moe", b * n3  # tokens are flattened: [b n3, n2]
    a = lambda sym, desc, mod, port, shape, count=1: ShapeRow(  # noqa: E731
        "activation", "6.4", j, sym, desc, mod, port, shape, count)
    gate, up = f"Ybar^{{{j}}}W^{{{j}5T}}_{{e}}", f"Ybar^{{{j}}}W^{{{j}7T}}_{{e}}"
    rows = [
        a(f"Ybar^{{{j}}}G^{{{j}T}}", "router logits", p + ".gate", "out", (t, ne)),
        a(f"topk(smax(Ybar^{{{j}}}G^{{{j}T}}))", f"routing weights of the top {k} experts", p, "inside", (t, k)),
    ]
    what, m = "routed expert (run densely here; a sparse kernel sees ~k/E of the rows)", f"{p}.experts.*"
    rows += [
        a(gate, f"{what}: gate projection", m + ".gate_proj", "out", (t, e7), ne),
        a(up, f"{what}: up projection", m + ".up_proj", "out", (t, e7), ne),
        a(f"silu({gate})⊗{up}", f"{what}: gated product", m + ".down_proj", "in", (t, e7), ne),
        a(f"Yhat^{{{j}}}_{{e}}", f"{what}: output", m, "out", (t, n2), ne),
    ]
    rows.append(a(f"Yhat^{{{j}}}", "weighted sum of the expert outputs", p, "out", (b, n3, n2)))
    return rows


def _mask_rows(cfg: ModelConfig, b: int, n3: int, past: int) -> list[ShapeRow]:
    """M of each kind of layer the model has (built once per pass, broadcast over the batch)."""
    total, mixed = past + n3, len(_layer_kinds(cfg)) > 1
    # ALiBi adds a per-head slope, hence n5 planes.
    m_heads = cfg.num_attention_heads if cfg.position_encoding == "alibi" else 1
    rows = []
    for sliding in _layer_kinds(cfg):
        desc = "mask (+ALiBi)" if m_heads > 1 else "causal mask"
        if sliding:
            desc = f"sliding-window {desc}: each query sees its last {cfg.sliding_window} positions"
        desc += (" (sliding layers)" if sliding else " (global layers)") if mixed else ""
        rows.append(ShapeRow("activation", "5", None, _mask_symbol(sliding), desc, "model", "inside",
                             (1, m_heads, n3, total)))
    return rows


def activation_rows(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0,
                    layers: str = "all") -> list[ShapeRow]:
    """Every tensor of one forward pass over `seq_len` new tokens after `past` cached ones."""
    b, n3, n8, n2 = batch, seq_len, cfg.num_hidden_layers, cfg.hidden_size
    a = lambda sec, sym, desc, mod, port, shape, dtype=None: ShapeRow(  # noqa: E731
        "activation", sec, None, sym, desc, mod, port, shape, dtype=dtype)
    rows = [
        a("4", "t^", "token ids", "model", "in", (b, n3), "int64"),
        a("4", "t", "position ids", "model", "inside", (b, n3), "int64"),
        *_mask_rows(cfg, b, n3, past),
    ]
    if cfg.embed_scale:
        rows += [
            a("6", "D[t^]", "token embeddings: rows of D", "model.embed_tokens", "out", (b, n3, n2)),
            a("6", "Z^{0}", f"D[t^] x sqrt(n2) = {math.sqrt(n2):g} (Gemma's embedding scale, in the weights' dtype)",
              "model", "inside", (b, n3, n2)),
        ]
    elif cfg.embedding_multiplier != 1.0:
        rows += [
            a("6", "D[t^]", "token embeddings: rows of D", "model.embed_tokens", "out", (b, n3, n2)),
            a("6", "Z^{0}", f"D[t^] x {cfg.embedding_multiplier:g} (embedding_multiplier)", "model", "inside",
              (b, n3, n2)),
        ]
    else:
        rows.append(a("6", "Z^{0}", "token embeddings: rows of D", "model.embed_tokens", "out", (b, n3, n2)))
    for j in range(n8 if layers == "all" else 1):
        rows += _layer_activations(cfg, j, b, n3, past)
    rows += [
        a("6.5", f"Z^{{{n8}}}", "output of the decoder stack", "model.norm", "in", (b, n3, n2)),
        a("6.6", f"Zbar^{{{n8}}}", f"rnorm(Z^n8): the model's output{_gain(cfg)}", "model.norm", "out", (b, n3, n2)),
    ]
    cap = cfg.final_logit_softcap
    if cfg.logits_scaling != 1.0:
        rows += [
            a("7", f"Zbar^{{{n8}}}W^{{8T}}", "logits before their scaling", "lm_head", "out", (b, n3, cfg.vocab_size)),
            a("7", "H", f"Zbar^n8 W^{{8T}} / {cfg.logits_scaling:g} (logits_scaling)", "lm_head", "after",
              (b, n3, cfg.vocab_size)),
        ]
    elif cap is None:
        rows.append(a("7", "H", "logits Zbar^n8 W^{8T}", "lm_head", "out", (b, n3, cfg.vocab_size)))
    else:
        rows += [
            a("7", f"Zbar^{{{n8}}}W^{{8T}}", "logits before the soft cap", "lm_head", "out", (b, n3, cfg.vocab_size)),
            a("7", "H", f"logits soft-capped: {cap:g} tanh(Zbar^n8 W^{{8T}} / {cap:g}) (final_logit_softcapping)",
              "lm_head", "after", (b, n3, cfg.vocab_size)),
        ]
    return rows


_LISTED = 16  # layer numbers a note names of each kind before it says how many more


def layer_note(cfg: ModelConfig, layers: str = "all") -> str | None:
    """Which layers slide and which attend globally, when the model has both kinds (Gemma 2/3); else None."""
    if len(_layer_kinds(cfg)) < 2:
        return None
    lt = cfg.layer_types or ()  # two kinds need layer_types (_layer_kinds)
    n_sliding = lt.count(SLIDING)

    def kind(name: str, sliding: bool, n: int, what: str) -> str:
        # The first _LISTED numbers only: a deep stack's note stays one short line.
        idx = list(itertools.islice((j for j, t in enumerate(lt) if (t == SLIDING) == sliding), _LISTED))
        more = f", ... ({n - _LISTED:,} more)" if n > _LISTED else ""
        return f"{n:,} {name} ({what}): layer{'s' if n > 1 else ''} {', '.join(map(str, idx))}{more}"
    note = ("layers differ in attention: "
            + kind("sliding", True, n_sliding, f"mask M^{{sw}}, window {cfg.sliding_window}" + _rope_base(cfg, True))
            + "; " + kind("global", False, len(lt) - n_sliding, "mask M, full causal" + _rope_base(cfg, False)))
    if layers == "first":
        note += f"; --layers first shows decoder 0 only, a {'sliding' if cfg.slides(0) else 'global'} layer"
    return note


def shape_report(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0, dtype: str | None = None,
                 layers: str = "all", only: str = "all") -> ShapeReport:
    """Weights then activations of `cfg` for a batch of `batch` sequences of `seq_len` new tokens."""
    dtype = dtypes.model_dtype(dtype).name if dtype else (
        cfg.torch_dtype if dtypes.get(cfg.torch_dtype).float else dtypes.FLOAT32.name)
    for name, v, low in (("seq_len", seq_len, 1), ("batch", batch, 1), ("past", past, 0)):
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if layers not in LAYER_CHOICES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)}, got {layers!r}")
    if only not in ONLY_CHOICES:
        raise ValueError(f"only must be one of {', '.join(ONLY_CHOICES)}, got {only!r}")
    if cfg.position_encoding == "rope" and past + seq_len > cfg.max_position_embeddings:
        # The rope tables stop there; ALiBi has no table to run out of.
        raise ValueError(f"past + seq_len = {past + seq_len} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings} of {cfg.name!r}; use a shorter --seq-len or --past")
    n = row_count(cfg, seq_len, batch, past, layers, only)
    if n > MAX_ROWS:
        raise ValueError(f"{cfg.name}: --layers all gives {n:,} rows for {cfg.num_hidden_layers:,} decoders, over the "
                         f"limit of {MAX_ROWS:,}; pass --layers first (every decoder has decoder 0's shapes)")
    weights = weight_rows(cfg, layers)
    rows = ([] if only == "activations" else weights) + (
        [] if only == "weights" else activation_rows(cfg, seq_len, batch, past, layers))
    note = layer_note(cfg, layers)
    return ShapeReport(cfg.name, seq_len, batch, past, dtype, layers, tuple(rows), (note,) if note else ())


def module_tree_report(tree: ModuleTree, seq_len: int, batch: int = 1, past: int = 0, dtype: str | None = None,
                       layers: str = "all", only: str = "all") -> ShapeReport:
    """A foreign architecture's weights from transformers' module tree (transformers_count); no activation rows.

    Each parameter once (a tied lm_head is the embedding's row), with its shape, elements and bytes; the paper's
    symbols and sections do not apply, and its activations are not modelled here: the report's note says so.
    """
    dtype = dtypes.model_dtype(dtype).name if dtype else tree.torch_dtype
    for name, v, low in (("seq_len", seq_len, 1), ("batch", batch, 1), ("past", past, 0)):
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if layers not in LAYER_CHOICES or only not in ONLY_CHOICES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)} and only one of {', '.join(ONLY_CHOICES)}")
    rows = () if only == "activations" else tuple(
        ShapeRow("weight", "", w.layer, "", f"weight ({w.component})", w.name, "param", w.shape)
        for w in tree.weights if layers == "all" or w.layer is None or w.layer == 0)
    if len(rows) > MAX_ROWS:
        raise ValueError(f"{tree.model}: --layers all gives {len(rows):,} rows, over the limit of {MAX_ROWS:,}; pass "
                         f"--layers first")
    notes = [f"{tree.class_name} (model_type {tree.model_type}) is no family llama-tools models: its weights come "
             f"from transformers {tree.transformers_version}'s module tree (no paper symbols); its activations are "
             f"left out"]
    if tree.tied:
        notes.append("lm_head is tied to the embedding: one row, counted once")
    return ShapeReport(tree.model, seq_len, batch, past, dtype, layers, rows, tuple(notes))


def row_count(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0, layers: str = "all",
              only: str = "all") -> int:
    """len(shape_report(...).rows), from decoder 0 alone: constant time and memory in n8."""
    one = cfg.replace(num_hidden_layers=1)
    rows = ([] if only == "activations" else weight_rows(one, "first")) + (
        [] if only == "weights" else activation_rows(one, seq_len, batch, past, "first"))
    per_decoder = sum(r.layer == 0 for r in rows)
    # The copy keeps decoder 0's kind of layer only; the whole model builds one mask per kind.
    masks = 0 if only == "weights" else len(_layer_kinds(cfg)) - len(_layer_kinds(one))
    n = cfg.num_hidden_layers if layers == "all" else 1
    # SmolLM3: a layer without RoPE has no Qbar, Kbar rows (rope_layers is listed, so bounded)
    unrotated = 0 if only == "weights" or cfg.rope_layers is None else (
        2 * sum(cfg.rotates(0) and not cfg.rotates(j) for j in range(n)))
    return len(rows) + masks + per_decoder * (n - 1) - unrotated


def to_frame(report: ShapeReport) -> Any:
    """The report as a pandas DataFrame, integer columns kept integer where some rows are empty."""
    import pandas as pd

    df = pd.DataFrame(report.records())
    for col in ["layer"] + [f"d{i}" for i in range(MAX_DIMS)]:
        df[col] = df[col].astype("Int64")
    return df


FORMATS = ("csv", "json", "markdown", "table")
_SUFFIX_FORMATS = {".csv": "csv", ".json": "json", ".md": "markdown", ".markdown": "markdown"}


def infer_format(path: str | None, fmt: str | None) -> str:
    """An explicit --format wins; else the file's suffix decides; else CSV."""
    if fmt:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    if path is None:
        return "csv"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ValueError(f"{path}: cannot tell the format from suffix {suffix!r}; pass --format csv|json|markdown")
    return _SUFFIX_FORMATS[suffix]


def render_report(report: ShapeReport, fmt: str) -> str:
    """The report as text; CSV through pandas, the rest through llama_tools.outputs.tables.render."""
    if fmt == "csv":
        return to_frame(report).to_csv(index=False, lineterminator="\n")
    from llama_tools.outputs.tables import render

    return render(report.records(), fmt, json_payload=report.payload()) + "\n"


def write_report(report: ShapeReport, path: str | Path, fmt: str) -> None:
    """Write atomically (a reader never sees half a report); a device or FIFO is written through."""
    from llama_tools.outputs.files import write_chunks
    from llama_tools.outputs.paths import check_output_path

    check_output_path(path)  # a directory or /proc path is refused before rendering
    write_chunks(path, [render_report(report, fmt)])
