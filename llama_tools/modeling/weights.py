"""Every weight of a config: its module name, HF and Meta names, the paper's symbol, shape and component.

This table is the one source of truth for weight names and shapes. Counting sums it, the shape
report prints it, checkpoint formats (formats.py) name their tensors from it, and tests check that
the PyTorch module's `named_parameters()` is exactly this list. No torch import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .config import ModelConfig
from .families import FAMILIES, MIXTRAL_MOE

# Components, in the order reports list them.
COMPONENTS = (
    "embedding", "attn.q", "attn.k", "attn.v", "attn.o", "attn.bias", "attn.qk_norm",
    "mlp.gate", "mlp.up", "mlp.down", "mlp.bias", "moe.router", "moe.experts",
    "norm", "final_norm", "lm_head",
)


@dataclass(frozen=True)
class WeightSpec:
    name: str  # the module's parameter name (HF's, except a mixture of experts': see hf_name, families.MoeNames)
    meta_name: str | None  # Meta consolidated.*.pth name (None: Meta has no such tensor)
    symbol: str  # the paper's symbol, or a name of ours for what the paper leaves out
    shape: tuple[int, ...]
    component: str
    layer: int | None  # decoder index j, None outside the decoder stack
    in_paper: bool  # counted by the paper's formula n8(4 n2^2 + 3 n2 n7) + n1 n2
    meta_shard_dim: int | None = None  # axis Meta's model-parallel shards split (None: replicated)
    hf_name: str = ""  # the HF checkpoint's name when it differs from `name`

    def __post_init__(self) -> None:
        if not self.hf_name:
            object.__setattr__(self, "hf_name", self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _layer_specs(cfg: ModelConfig, j: int, experts: int | None = None) -> list[WeightSpec]:
    """Decoder j's weights; with `experts`, only the first that many routed experts (the rest have their shapes)."""
    n2, n7, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    hf, meta = f"model.layers.{j}.", f"layers.{j}."
    s = lambda *a, **k: WeightSpec(*a, layer=j, **k)  # noqa: E731

    def paper(hf_name: str, meta_name: str, i: int, shape: tuple[int, ...], component: str, shard: int) -> WeightSpec:
        """W^{ji}, one of the paper's matrices: its HF and Meta names and the dimension Meta's shards split."""
        return s(hf + hf_name, meta + meta_name, f"W^{{{j}{i}}}", shape, component, in_paper=True, meta_shard_dim=shard)
    out = [] if cfg.post_norms else [  # OLMo 2 has no norm before attention
        s(hf + "input_layernorm.weight", meta + "attention_norm.weight", f"γ^{{{j},1}}", (n2,), "norm",
          in_paper=False)]
    if cfg.norm_kind == "layer":  # GPT-NeoX, Falcon: LayerNorm's β beside each γ
        out.append(s(hf + "input_layernorm.bias", None, f"β^{{{j},1}}", (n2,), "norm", in_paper=False))
    # W^{j1}, W^{j2}, W^{j3}: n2 x n2 in the paper; with GQA, K and V shrink to kv_heads * n6 rows.
    out += [paper(f"self_attn.{p}_proj.weight", f"attention.w{p}.weight", i, rows, f"attn.{p}", 0)
            for p, i, rows in (("q", 1, (q, n2)), ("k", 2, (kv, n2)), ("v", 3, (kv, n2)))]
    if cfg.qkv_bias:
        out += [s(hf + f"self_attn.{p}_proj.bias", None, f"b^{{{j}{i}}}", (size,), "attn.bias", in_paper=False)
                for p, i, size in (("q", 1, q), ("k", 2, kv), ("v", 3, kv))]
    out.append(paper("self_attn.o_proj.weight", "attention.wo.weight", 4, (n2, q), "attn.o", 1))
    if cfg.o_bias:
        out.append(s(hf + "self_attn.o_proj.bias", None, f"b^{{{j}4}}", (n2,), "attn.bias", in_paper=False))
    if cfg.qk_norm:  # Qwen3, Gemma 3: one gain of n6 for all q heads, one for all k heads; OLMo 2: whole rows
        out += [s(hf + f"self_attn.{p}_norm.weight", None, f"γ^{{{j},{p}}}", (width if cfg.qk_norm_whole
                                                                               else cfg.head_dim,),
                  "attn.qk_norm", in_paper=False) for p, width in (("q", q), ("k", kv))]
    if cfg.sandwich_norms:  # Gemma 2/3: HF's post_attention_layernorm follows attention; 6.3's norm is pre_feedforward
        out += [s(hf + "post_attention_layernorm.weight", None, f"γ^{{{j},o}}", (n2,), "norm", in_paper=False),
                s(hf + "pre_feedforward_layernorm.weight", None, f"γ^{{{j},2}}", (n2,), "norm", in_paper=False),
                s(hf + "post_feedforward_layernorm.weight", None, f"γ^{{{j},f}}", (n2,), "norm", in_paper=False)]
    elif cfg.post_norms:  # OLMo 2: after attention and after the FFN only
        out += [s(hf + "post_attention_layernorm.weight", None, f"γ^{{{j},o}}", (n2,), "norm", in_paper=False),
                s(hf + "post_feedforward_layernorm.weight", None, f"γ^{{{j},f}}", (n2,), "norm", in_paper=False)]
    elif not cfg.shared_norm:  # (Falcon-7B's one norm feeds attention and the FFN alike)
        out.append(s(hf + "post_attention_layernorm.weight", meta + "ffn_norm.weight", f"γ^{{{j},2}}", (n2,), "norm",
                     in_paper=False))
        if cfg.norm_kind == "layer":
            out.append(s(hf + "post_attention_layernorm.bias", None, f"β^{{{j},2}}", (n2,), "norm", in_paper=False))
    if not cfg.is_moe:
        # W^{j5} gate: n7 x n2, W^{j7} up: n7 x n2, W^{j6} down: n2 x n7 (HF order: gate, up, down).
        # A plain (ungated) FFN has no W^{j5} (GPT-NeoX, Falcon).
        gate = (("gate", "w1", 5, (n7, n2), 0),) if cfg.gated_mlp else ()
        out += [paper(f"mlp.{p}_proj.weight", f"feed_forward.{w}.weight", i, shape, f"mlp.{p}", shard)
                for p, w, i, shape, shard in gate + (("up", "w3", 7, (n7, n2), 0), ("down", "w2", 6, (n2, n7), 1))]
        if cfg.mlp_bias:
            out += [s(hf + f"mlp.{p}_proj.bias", None, f"b^{{{j}{i}}}", (size,), "mlp.bias", in_paper=False)
                    for p, i, size in (("gate", 5, n7), ("up", 7, n7), ("down", 6, n2)) if p != "gate" or cfg.gated_mlp]
        return out
    # Mixture of experts: a router, then per expert the same SwiGLU as the dense FFN. The module is always
    # block_sparse_moe; the file's names are the family's (families.MoeNames: Mixtral's block_sparse_moe with
    # gate/up/down as w1/w3/w2, Qwen3-MoE's mlp with gate_proj/up_proj/down_proj). Meta's names are Mixtral's.
    e7 = cfg.moe_intermediate_size
    names = FAMILIES[cfg.family].moe
    moe, fmoe, mmoe = hf + "block_sparse_moe.", hf + names.block + ".", meta + "feed_forward."
    out.append(s(moe + "gate.weight", mmoe + "gate.weight", f"G^{{{j}}}", (cfg.num_experts, n2), "moe.router",
                 in_paper=False, hf_name=fmoe + "gate.weight"))
    for e in range(cfg.num_experts if experts is None else min(experts, cfg.num_experts)):
        p, fp, mp = f"{moe}experts.{e}.", f"{fmoe}experts.{e}.", f"{mmoe}experts.{e}."
        out += [s(p + f"{proj}.weight", mp + f"{w}.weight", f"W^{{{j}{i}}}_{{{e}}}", shape, "moe.experts",
                  in_paper=False, hf_name=fp + f"{stored}.weight")
                for proj, w, stored, i, shape in zip(
                    ("gate_proj", "up_proj", "down_proj"), MIXTRAL_MOE.projections, names.projections, (5, 7, 6),
                    ((e7, n2), (e7, n2), (n2, e7)))]
    return out


def _outside_specs(cfg: ModelConfig) -> tuple[list[WeightSpec], list[WeightSpec]]:
    """The weights before the decoder stack (D) and after it (the final norm, an untied lm_head)."""
    n1, n2 = cfg.vocab_size, cfg.hidden_size
    before = [WeightSpec("model.embed_tokens.weight", "tok_embeddings.weight", "D", (n1, n2), "embedding", None,
                         in_paper=not cfg.tie_word_embeddings, meta_shard_dim=1)]
    after = [WeightSpec("model.norm.weight", "norm.weight", f"γ^{{{cfg.num_hidden_layers}}}", (n2,),
                        "final_norm", None, in_paper=False)]
    if cfg.norm_kind == "layer":
        after.append(WeightSpec("model.norm.bias", None, f"β^{{{cfg.num_hidden_layers}}}", (n2,), "final_norm", None,
                                in_paper=False))
    if not cfg.tie_word_embeddings:
        # \bar{W}^8: n1 x n2, the paper's lm_head (it counts this one matrix of the two n1 x n2 ones).
        after.append(WeightSpec("lm_head.weight", "output.weight", "W^8", (n1, n2), "lm_head", None,
                                in_paper=True, meta_shard_dim=0))
    return before, after


def weight_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """All parameters of the model, in the paper's order; a tied lm_head appears once, as the embedding."""
    before, after = _outside_specs(cfg)
    specs = list(before)
    for j in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, j)
    return specs + after


def _numel(s: WeightSpec) -> int:
    return s.numel


def _any(s: WeightSpec) -> bool:
    return True


@dataclass(frozen=True)
class StackSpecs:
    """The whole weight table in constant time whatever n8 and the expert count are.

    Every decoder has decoder 0's shapes and every routed expert expert 0's (both are built from the same
    fields), so the table is `outside` + n8 copies of (`decoder` + `experts` copies of `expert`), up to names.
    """

    outside: list[WeightSpec]  # D, the final norm, lm_head
    decoder: list[WeightSpec]  # decoder 0 without its routed experts
    expert: list[WeightSpec]  # decoder 0's expert 0 (empty for a dense FFN)
    layers: int  # n8
    experts: int  # routed experts per decoder

    def per_decoder(self, key: Callable[[WeightSpec], int] = _numel, pred: Callable[[WeightSpec], bool] = _any) -> int:
        """sum(key(s)) over one decoder's weights that satisfy pred, its experts included."""
        return (sum(key(s) for s in self.decoder if pred(s))
                + self.experts * sum(key(s) for s in self.expert if pred(s)))

    def total(self, key: Callable[[WeightSpec], int] = _numel, pred: Callable[[WeightSpec], bool] = _any) -> int:
        """sum(key(s)) over the whole table's weights that satisfy pred."""
        return sum(key(s) for s in self.outside if pred(s)) + self.layers * self.per_decoder(key, pred)


def stack_specs(cfg: ModelConfig) -> StackSpecs:
    """weight_specs(cfg) folded: outside the stack, decoder 0 and its expert 0, with the counts that repeat them."""
    before, after = _outside_specs(cfg)
    first = _layer_specs(cfg, 0, experts=1)
    return StackSpecs(before + after, [s for s in first if s.component != "moe.experts"],
                      [s for s in first if s.component == "moe.experts"], cfg.num_hidden_layers, cfg.num_experts)
