"""Checkpoint formats: how each names its tensors, orders RoPE rows, fuses q/k/v, and is recognized.

The one registry of these facts. Loading (checkpoints.py), header inspection (inspection.py),
conversion (convert.py) and the CLI's choices read them from here. No torch import.

| format    | names                          | q/k rows    | fused q/k/v                             |
|-----------|--------------------------------|-------------|-----------------------------------------|
| hf        | model.layers.j.self_attn.q_proj | half        | none                                    |
| meta      | layers.j.attention.wq           | interleaved | none; model-parallel shards to merge    |
| baichuan  | hf, q/k/v as self_attn.W_pack   | half        | rows cat(q, k, v)                       |
| phi3      | hf, qkv_proj and gate_up_proj   | half        | rows cat(q, k, v); gate, up cat(gate, up)|
| internlm2 | attention.wqkv, feed_forward.w1 | half        | per KV head: its n_rep q heads, k, v    |
| gpt_neox  | gpt_neox.layers.j.attention.*   | half        | per head: q, k, v (query_key_value)     |
| falcon    | transformer.h.j.self_attention.*| half        | per KV head: its n_rep q heads, k, v    |
| gguf      | blk.j.attn_q                    | interleaved | none; one .gguf file, mostly quantized  |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

from ..modeling.config import ModelConfig
from ..modeling.rope_layouts import HALF, INTERLEAVED, RopeLayout
from ..modeling.weights import WeightSpec, weight_specs

FusedQKV = Literal["concat", "grouped"]
_LAYER_PREFIX = re.compile(r"^.*?\.\d+\.")  # a stored name's layer part: "model.layers.3.", "blk.3."
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor as a checkpoint stores it; a fused tensor (W_pack, wqkv) covers several specs."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]  # WeightSpec (module) names it holds, along axis 0


@dataclass(frozen=True)
class CheckpointFormat:
    """One way checkpoints name and lay out the weights of a LLaMA-family model."""

    name: str
    description: str
    rope_layout: RopeLayout  # the q/k row order its files store
    fused_qkv: FusedQKV | None  # how q/k/v share one tensor, if they do
    fused_name: str | None  # that tensor's name within a layer
    renames: tuple[tuple[str, str], ...] = ()  # HF name fragment -> this format's
    marker: str | None = None  # a tensor name (suffix) that only this format has
    meta_names: bool = False  # names from WeightSpec.meta_name instead of HF's
    file_kind: str | None = None  # a WeightFiles.kind whose files are always in this format
    sandwich_renames: tuple[tuple[str, str], ...] = ()  # applied first for Gemma 2/3's four norms a layer
    stacked_experts: bool = False  # a layer's routed experts as one tensor a projection, named by expert 0's name
    # a layer's gate and up rows as one tensor, named by this rename of the gate's stored name (Phi-3's gate_up_proj,
    # llama.cpp's phi3 ffn_up)
    fused_gate_up: tuple[str, str] | None = None
    # applied first when attention and the FFN read their own norms in parallel (Falcon's ln_attn and ln_mlp)
    parallel_renames: tuple[tuple[str, str], ...] = ()

    def tensor_name(self, spec: WeightSpec, cfg: ModelConfig | None = None) -> str:
        """The stored name of an unfused weight (cfg: the model's, where its norms' names depend on it)."""
        if self.meta_names:
            if spec.meta_name is None:
                raise ValueError(f"Meta's layout has no name for {spec.name} (biases and the norms of other "
                                 f"families are not part of Meta checkpoints)")
            return spec.meta_name
        name = spec.hf_name
        after = cfg is not None and (cfg.sandwich_norms or cfg.post_norms)  # norms after attention and the FFN
        two = cfg is not None and cfg.parallel_residual and not cfg.shared_norm  # two norms reading Z^j
        for a, b in (self.sandwich_renames if after else ()) + (self.parallel_renames if two else ()) + self.renames:
            name = name.replace(a, b)
        return name


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in [
    CheckpointFormat("hf", "HF transformers: config.json + model*.safetensors or pytorch_model*.bin", HALF, None, None),
    CheckpointFormat("meta", "Meta: params.json + consolidated.NN.pth model-parallel shards", INTERLEAVED, None, None,
                     marker="tok_embeddings.weight", meta_names=True, file_kind="meta"),
    CheckpointFormat("baichuan", "Baichuan: HF names, q/k/v rows fused as W_pack", HALF, "concat",
                     "self_attn.W_pack.weight", marker="self_attn.W_pack.weight"),
    CheckpointFormat("phi3", "Phi-3: HF names, q/k/v rows fused as qkv_proj, gate/up as gate_up_proj", HALF, "concat",
                     "self_attn.qkv_proj.weight", marker="self_attn.qkv_proj.weight",
                     fused_gate_up=("mlp.gate_proj.", "mlp.gate_up_proj.")),
    CheckpointFormat("internlm2", "InternLM2: own names, q/k/v grouped per KV head as wqkv", HALF, "grouped",
                     "attention.wqkv.weight", marker="attention.wqkv.weight", renames=(
                         ("model.embed_tokens.", "model.tok_embeddings."), ("self_attn.o_proj.", "attention.wo."),
                         ("mlp.gate_proj.", "feed_forward.w1."), ("mlp.up_proj.", "feed_forward.w3."),
                         ("mlp.down_proj.", "feed_forward.w2."), ("input_layernorm.", "attention_norm."),
                         ("post_attention_layernorm.", "ffn_norm."), ("lm_head.", "output."))),
    # GPT-NeoX (Pythia): q/k/v rows per head [q_h, k_h, v_h] (its view(..., n5, 3 n6)), biases packed alike.
    CheckpointFormat("gpt_neox", "GPT-NeoX: gpt_neox.layers, q/k/v packed per head as query_key_value", HALF, "grouped",
                     "attention.query_key_value.weight", marker="attention.query_key_value.weight", renames=(
                         ("model.embed_tokens.", "gpt_neox.embed_in."), ("model.layers.", "gpt_neox.layers."),
                         ("self_attn.o_proj.", "attention.dense."), ("mlp.up_proj.", "mlp.dense_h_to_4h."),
                         ("mlp.down_proj.", "mlp.dense_4h_to_h."), ("model.norm.", "gpt_neox.final_layer_norm."),
                         ("lm_head.", "embed_out."))),
    # Falcon: per KV head its n_rep q heads, k, v (multi_query: one KV head, so q heads then k then v; no GQA: per
    # head q, k, v), as its _split_heads views the packed rows.
    CheckpointFormat("falcon", "Falcon: transformer.h, q/k/v packed per KV head as query_key_value", HALF, "grouped",
                     "self_attention.query_key_value.weight", marker="self_attention.query_key_value.weight", renames=(
                         ("model.embed_tokens.", "transformer.word_embeddings."), ("model.layers.", "transformer.h."),
                         ("self_attn.o_proj.", "self_attention.dense."), ("mlp.up_proj.", "mlp.dense_h_to_4h."),
                         ("mlp.down_proj.", "mlp.dense_4h_to_h."), ("model.norm.", "transformer.ln_f.")),
                     parallel_renames=(("input_layernorm.", "ln_attn."), ("post_attention_layernorm.", "ln_mlp."))),
    # llama.cpp's names (gguf.TensorNameMap, tested); its converter permutes HF's q/k rows to Meta's order.
    CheckpointFormat("gguf", "GGUF (llama.cpp): one .gguf file, config and vocabulary in its metadata", INTERLEAVED,
                     None, None, file_kind="gguf", renames=(
                         ("model.embed_tokens.", "token_embd."), ("model.layers.", "blk."),
                         ("self_attn.q_proj.", "attn_q."), ("self_attn.k_proj.", "attn_k."),
                         ("self_attn.v_proj.", "attn_v."), ("self_attn.o_proj.", "attn_output."),
                         ("self_attn.q_norm.", "attn_q_norm."), ("self_attn.k_norm.", "attn_k_norm."),
                         ("mlp.gate_proj.", "ffn_gate."), ("mlp.up_proj.", "ffn_up."), ("mlp.down_proj.", "ffn_down."),
                         ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
                         ("model.norm.", "output_norm."), ("lm_head.", "output."),
                         # Mixtral: the router, and each projection's experts stacked (expert 0's name renamed)
                         ("block_sparse_moe.gate.", "ffn_gate_inp."),
                         ("block_sparse_moe.experts.0.w1.", "ffn_gate_exps."),
                         ("block_sparse_moe.experts.0.w3.", "ffn_up_exps."),
                         ("block_sparse_moe.experts.0.w2.", "ffn_down_exps.")),
                     stacked_experts=True,
                     # Gemma 2/3: the norm after attention is post_attention_norm, 6.3's norm is ffn_norm
                     sandwich_renames=(("post_attention_layernorm.", "post_attention_norm."),
                                       ("pre_feedforward_layernorm.", "ffn_norm."),
                                       ("post_feedforward_layernorm.", "post_ffw_norm."))),
]}
HF, META = FORMATS["hf"], FORMATS["meta"]
# What `convert --to` writes: the family's own HF-style format, Meta's, or one GGUF file (gguf.write).
WRITABLE = ("hf", "meta", "gguf")
# Buffers some exporters store that no config explains and loaders skip.
# llama.cpp's RoPE tensors, the config's RoPE scaling held as tensors: Llama 3's per-dimension divisors, and Phi-3
# longrope's factor lists (the GGUF package reads them into the config, never as weights)
LLAMACPP_ROPE_TENSORS = {"freqs": "rope_freqs.weight", "long_factor": "rope_factors_long.weight",
                         "short_factor": "rope_factors_short.weight"}
BENIGN_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                   *LLAMACPP_ROPE_TENSORS.values())
# Family -> the format its published checkpoints use (default: hf).
_FAMILY_FORMAT = {"baichuan": "baichuan", "internlm2": "internlm2", "phi3": "phi3", "gpt_neox": "gpt_neox",
                  "falcon": "falcon"}


def get_format(name: str) -> CheckpointFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown checkpoint format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def family_format(cfg: ModelConfig) -> CheckpointFormat:
    """The format of the family's published checkpoints (what `convert --to hf` writes)."""
    return FORMATS[_FAMILY_FORMAT.get(cfg.family, "hf")]


def detect_format(file_kind: str, names: list[str] | set[str]) -> CheckpointFormat:
    """Which format a set of stored tensor names is in (Meta's .pth shards and GGUF files are so by their file kind)."""
    by_kind = next((f for f in FORMATS.values() if f.file_kind == file_kind), None)
    if by_kind is not None:
        return by_kind
    # Fused formats first: InternLM2's model.tok_embeddings also ends like Meta's tok_embeddings.
    for fmt in sorted(FORMATS.values(), key=lambda f: f.fused_qkv is None):
        if fmt.marker and any(n == fmt.marker or n.endswith("." + fmt.marker) for n in names):
            return fmt
    return HF


def checkpoint_tensors(cfg: ModelConfig, fmt: CheckpointFormat | None = None) -> list[CheckpointTensor]:
    """The tensors a checkpoint of `cfg` holds in format `fmt` (default: the family's own)."""
    fmt = fmt or family_format(cfg)
    specs = weight_specs(cfg)
    if fmt.fused_qkv is None and fmt.fused_gate_up is None:
        try:
            if fmt.stacked_experts and cfg.is_moe:
                return _stacked(cfg, fmt, specs)
            return [CheckpointTensor(fmt.tensor_name(s, cfg), s.shape, (s.name,)) for s in specs]
        except ValueError as e:
            raise ValueError(f"config {cfg.name!r}: {e}") from None
    by_name = {s.name: s for s in specs}
    out: list[CheckpointTensor] = []
    for s in specs:
        qkv_bias = s.component == "attn.bias" and ".self_attn.o_proj." not in s.name
        if (fmt.fused_qkv and (s.component in ("attn.k", "attn.v") or (qkv_bias and ".q_proj." not in s.name))) \
                or (fmt.fused_gate_up and s.component == "mlp.up"):
            continue  # inside the fused tensor emitted with attn.q (its bias with q's bias; mlp.gate)
        if fmt.fused_qkv and qkv_bias:  # q/k/v biases packed as their rows are (GPT-NeoX, Falcon)
            prefix = s.name.rsplit("self_attn.q_proj", 1)[0]
            parts = tuple(prefix + f"self_attn.{p}_proj.bias" for p in "qkv")
            stored = _LAYER_PREFIX.match(fmt.tensor_name(s, cfg))
            assert stored is not None and fmt.fused_name is not None, f"{fmt.name}: {s.name} has no fused name"
            out.append(CheckpointTensor(stored.group(0) + fmt.fused_name.removesuffix(".weight") + ".bias",
                                        (sum(by_name[p].shape[0] for p in parts),), parts))
        elif fmt.fused_qkv and s.component == "attn.q":
            prefix = s.name.rsplit("self_attn.q_proj", 1)[0]  # "model.layers.j."
            parts = tuple(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")
            rows = sum(by_name[p].shape[0] for p in parts)
            stored = _LAYER_PREFIX.match(fmt.tensor_name(s, cfg))  # "model.layers.j." or GGUF's "blk.j."
            assert stored is not None, f"{fmt.name}: {s.name} is stored under no layer prefix"
            out.append(CheckpointTensor(stored.group(0) + fmt.fused_name, (rows, cfg.hidden_size), parts))
        elif fmt.fused_gate_up and s.component == "mlp.gate":
            parts = (s.name, s.name.replace("mlp.gate_proj.", "mlp.up_proj."))
            name = fmt.tensor_name(s, cfg).replace(*fmt.fused_gate_up)
            out.append(CheckpointTensor(name, (2 * s.shape[0], s.shape[1]), parts))
        else:
            out.append(CheckpointTensor(fmt.tensor_name(s, cfg), s.shape, (s.name,)))
    return out


def _stacked(cfg: ModelConfig, fmt: CheckpointFormat, specs: list[WeightSpec]) -> list[CheckpointTensor]:
    """Unfused tensors, each layer's routed experts stacked on a new first axis: one tensor a projection, its parts
    the experts in order (GGUF's ffn_gate_exps: [experts, rows, columns])."""
    out = []
    for s in specs:
        if s.component != "moe.experts":
            out.append(CheckpointTensor(fmt.tensor_name(s, cfg), s.shape, (s.name,)))
        elif ".experts.0." in s.name:  # the others are parts of expert 0's tensor
            parts = tuple(s.name.replace(".experts.0.", f".experts.{e}.") for e in range(cfg.num_experts))
            out.append(CheckpointTensor(fmt.tensor_name(s, cfg), (cfg.num_experts, *s.shape), parts))
    return out


def merge_meta_shards(cfg: ModelConfig, shards: list[dict[str, T]], join: Callable[[str, list[T], int], T],
                      label: Callable[[int], str]) -> dict[str, T]:
    """Meta's model-parallel shards -> whole entries, joined along each weight's meta_shard_dim.

    Works for tensors and for header records alike: `join(name, parts, axis)` does the joining,
    `label(k)` names shard k in errors. Replicated weights (norms) are taken from shard 0.
    """
    if len(shards) == 1:
        return shards[0]
    axis = {s.meta_name: s.meta_shard_dim for s in weight_specs(cfg)}
    first = shards[0]
    for k, shard in enumerate(shards[1:], start=1):
        if list(shard) != list(first):
            odd = sorted(set(shard) ^ set(first))[0]
            raise ValueError(f"{label(k)}: shard holds different tensors than {label(0)} (e.g. {odd!r})")
    merged = {}
    for name, entry in first.items():
        dim = axis.get(name)
        merged[name] = entry if dim is None else join(name, [shard[name] for shard in shards], dim)
    return merged
