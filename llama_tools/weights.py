"""Every weight of a config: its module (HF) name, Meta name, the paper's symbol, shape and component.

This table is the one source of truth for weight names and shapes. Counting sums it, the shape
report prints it, loaders map checkpoint names through it, and tests check that the PyTorch
module's `named_parameters()` is exactly this list. No torch import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig

# Components, in the order reports list them.
COMPONENTS = (
    "embedding", "attn.q", "attn.k", "attn.v", "attn.o", "attn.bias",
    "mlp.gate", "mlp.up", "mlp.down", "mlp.bias", "moe.router", "moe.experts", "moe.shared",
    "norm", "final_norm", "lm_head",
)


@dataclass(frozen=True)
class WeightSpec:
    name: str  # the module's parameter name, which is also the HF checkpoint name
    meta_name: str | None  # Meta consolidated.*.pth name (None: Meta has no such tensor)
    symbol: str  # the paper's symbol, or a name of ours for what the paper leaves out
    shape: tuple[int, ...]
    component: str
    layer: int | None  # decoder index j, None outside the decoder stack
    in_paper: bool  # counted by the paper's formula n8(4 n2^2 + 3 n2 n7) + n1 n2
    meta_shard_dim: int | None = None  # axis Meta's model-parallel shards split (None: replicated)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor as a checkpoint stores it; fused tensors (Baichuan W_pack) cover several specs."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]  # WeightSpec names, concatenated along axis 0 in this order


def _layer_specs(cfg: ModelConfig, j: int) -> list[WeightSpec]:
    n2, n7, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    hf, meta = f"model.layers.{j}.", f"layers.{j}."
    s = lambda *a, **k: WeightSpec(*a, layer=j, **k)  # noqa: E731
    out = [
        s(hf + "input_layernorm.weight", meta + "attention_norm.weight", f"γ^{{{j},1}}", (n2,), "norm",
          in_paper=False),
        # W^{j1}: n2 x n2 in the paper; with GQA, K and V shrink to kv_heads * n6 rows.
        s(hf + "self_attn.q_proj.weight", meta + "attention.wq.weight", f"W^{{{j}1}}", (q, n2), "attn.q",
          in_paper=True, meta_shard_dim=0),
        s(hf + "self_attn.k_proj.weight", meta + "attention.wk.weight", f"W^{{{j}2}}", (kv, n2), "attn.k",
          in_paper=True, meta_shard_dim=0),
        s(hf + "self_attn.v_proj.weight", meta + "attention.wv.weight", f"W^{{{j}3}}", (kv, n2), "attn.v",
          in_paper=True, meta_shard_dim=0),
    ]
    if cfg.qkv_bias:
        out += [s(hf + f"self_attn.{p}_proj.bias", None, f"b^{{{j}{i}}}", (size,), "attn.bias", in_paper=False)
                for p, i, size in (("q", 1, q), ("k", 2, kv), ("v", 3, kv))]
    out.append(s(hf + "self_attn.o_proj.weight", meta + "attention.wo.weight", f"W^{{{j}4}}", (n2, q), "attn.o",
                 in_paper=True, meta_shard_dim=1))
    if cfg.o_bias:
        out.append(s(hf + "self_attn.o_proj.bias", None, f"b^{{{j}4}}", (n2,), "attn.bias", in_paper=False))
    out.append(s(hf + "post_attention_layernorm.weight", meta + "ffn_norm.weight", f"γ^{{{j},2}}", (n2,), "norm",
                 in_paper=False))
    if not cfg.is_moe:
        # W^{j5} gate: n7 x n2, W^{j7} up: n7 x n2, W^{j6} down: n2 x n7 (HF order: gate, up, down).
        out += [
            s(hf + "mlp.gate_proj.weight", meta + "feed_forward.w1.weight", f"W^{{{j}5}}", (n7, n2), "mlp.gate",
              in_paper=True, meta_shard_dim=0),
            s(hf + "mlp.up_proj.weight", meta + "feed_forward.w3.weight", f"W^{{{j}7}}", (n7, n2), "mlp.up",
              in_paper=True, meta_shard_dim=0),
            s(hf + "mlp.down_proj.weight", meta + "feed_forward.w2.weight", f"W^{{{j}6}}", (n2, n7), "mlp.down",
              in_paper=True, meta_shard_dim=1),
        ]
        if cfg.mlp_bias:
            out += [s(hf + f"mlp.{p}_proj.bias", None, f"b^{{{j}{i}}}", (size,), "mlp.bias", in_paper=False)
                    for p, i, size in (("gate", 5, n7), ("up", 7, n7), ("down", 6, n2))]
        return out
    # Mixture of experts (Mixtral names): a router, then per expert w1 gate, w3 up, w2 down.
    e7 = cfg.moe_intermediate_size
    moe, mmoe = hf + "block_sparse_moe.", meta + "feed_forward."
    out.append(s(moe + "gate.weight", mmoe + "gate.weight", f"G^{{{j}}}", (cfg.num_experts, n2), "moe.router",
                 in_paper=False))
    groups = [("experts", "moe.experts", cfg.num_experts), ("shared_experts", "moe.shared", cfg.num_shared_experts)]
    for group, comp, count in groups:
        for e in range(count):
            p, mp = f"{moe}{group}.{e}.", f"{mmoe}{group}.{e}."
            out += [
                s(p + "w1.weight", mp + "w1.weight", f"W^{{{j}5}}_{{{e}}}", (e7, n2), comp, in_paper=False),
                s(p + "w3.weight", mp + "w3.weight", f"W^{{{j}7}}_{{{e}}}", (e7, n2), comp, in_paper=False),
                s(p + "w2.weight", mp + "w2.weight", f"W^{{{j}6}}_{{{e}}}", (n2, e7), comp, in_paper=False),
            ]
    return out


def weight_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """All parameters of the model, in the paper's order; a tied lm_head appears once, as the embedding."""
    n1, n2 = cfg.vocab_size, cfg.hidden_size
    specs = [WeightSpec("model.embed_tokens.weight", "tok_embeddings.weight", "D", (n1, n2), "embedding", None,
                        in_paper=not cfg.tie_word_embeddings, meta_shard_dim=1)]
    for j in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, j)
    specs.append(WeightSpec("model.norm.weight", "norm.weight", f"γ^{{{cfg.num_hidden_layers}}}", (n2,),
                            "final_norm", None, in_paper=False))
    if not cfg.tie_word_embeddings:
        # \bar{W}^8: n1 x n2, the paper's lm_head (it counts this one matrix of the two n1 x n2 ones).
        specs.append(WeightSpec("lm_head.weight", "output.weight", "W^8", (n1, n2), "lm_head", None,
                                in_paper=True, meta_shard_dim=0))
    return specs


def default_layout(cfg: ModelConfig) -> str:
    """Tensor naming of the family's published checkpoints."""
    return {"baichuan": "baichuan", "internlm2": "internlm2"}.get(cfg.family, "hf")


def checkpoint_tensors(cfg: ModelConfig, layout: str | None = None) -> list[CheckpointTensor]:
    """The tensors a checkpoint of `cfg` holds in `layout` ("hf", "meta", "baichuan", "internlm2")."""
    layout = layout or default_layout(cfg)
    specs = weight_specs(cfg)
    if layout == "hf":
        return [CheckpointTensor(s.name, s.shape, (s.name,)) for s in specs]
    if layout == "meta":
        missing = [s.name for s in specs if s.meta_name is None]
        if missing:
            raise ValueError(f"config {cfg.name!r}: Meta's layout has no name for {missing[0]} "
                             f"(biases are not part of Meta checkpoints)")
        return [CheckpointTensor(s.meta_name, s.shape, (s.name,)) for s in specs]  # type: ignore[arg-type]
    if layout not in ("baichuan", "internlm2"):
        raise ValueError(f"unknown checkpoint layout {layout!r}; choose hf, meta, baichuan or internlm2")
    out: list[CheckpointTensor] = []
    by_name = {s.name: s for s in specs}
    for s in specs:
        if s.component in ("attn.k", "attn.v"):
            continue  # folded into the fused q/k/v tensor emitted with attn.q
        if s.component == "attn.q":
            prefix = s.name.rsplit("q_proj", 1)[0]
            parts = tuple(prefix + f"{p}_proj.weight" for p in "qkv")
            rows = sum(by_name[p].shape[0] for p in parts)
            fused = prefix + ("W_pack.weight" if layout == "baichuan" else "wqkv.weight")
            if layout == "internlm2":
                fused = fused.replace("self_attn.", "attention.")
            out.append(CheckpointTensor(fused, (rows, cfg.hidden_size), parts))
            continue
        name = s.name
        if layout == "internlm2":
            name = _internlm2_name(name)
        out.append(CheckpointTensor(name, s.shape, (s.name,)))
    return out


_INTERNLM2 = {
    "model.embed_tokens.": "model.tok_embeddings.", "self_attn.o_proj.": "attention.wo.",
    "mlp.gate_proj.": "feed_forward.w1.", "mlp.up_proj.": "feed_forward.w3.", "mlp.down_proj.": "feed_forward.w2.",
    "input_layernorm.": "attention_norm.", "post_attention_layernorm.": "ffn_norm.", "lm_head.": "output.",
}


def _internlm2_name(name: str) -> str:
    for a, b in _INTERNLM2.items():
        name = name.replace(a, b)
    return name
