"""The ModelConfig a GGUF's own metadata keys (<arch>.*) and tensor names describe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...modeling.config import INT64_MAX, SIZE_LIMITS, ModelConfig, RopeScaling
from ...modeling.families import FAMILIES, FULL, SLIDING
from ...modeling.rope import yarn_attention_factor
from .architectures import ALWAYS, ARCHITECTURES, GRANITE_KEYS, KEY, MOE_FAMILY, ROPE_FACTORS, ROPE_FREQS
from .read import UnmodelledGguf, field_value, meta_value
from .rope_freqs import llama3_scaling, longrope_scaling, longrope_tensors, rope_freqs_tensor


# <arch>.* keys -> the SIZE_LIMITS entry that bounds them (those the tensors' shapes do not: check_metadata).
LIMIT_OF = {"context_length": "max_position_embeddings", "rope.scaling.original_context_length":
            "original_max_position_embeddings", "attention.sliding_window": "sliding_window",
            "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
            "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
            "expert_feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
            "rope.dimension_count": "head_dim", "vocab_size": "vocab_size", "block_count": "num_hidden_layers"}


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's llama.* metadata and tensor names describe; one line for other architectures."""
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UnmodelledGguf(f"{path}: GGUF architecture {arch!r} is not LLaMA-family; llama-tools reads "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    names = {t.name for t in reader.tensors}

    def get(key: str, kind: type, default: Any = None, required: bool = True) -> Any:
        v = meta_value(reader, path, f"{arch}.{key}", kind, default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        limit = SIZE_LIMITS.get(LIMIT_OF.get(key, ""), INT64_MAX)
        if kind is int and v is not None and v > limit:  # as config.json's sizes are bounded (config_files)
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is {v:,}, over the {limit:,} llama-tools reads "
                             f"(far past any published model); is the file damaged?")
        return v

    a = ARCHITECTURES[arch]
    experts = get("expert_count", int, 0, required=False)  # bounded by check_metadata, with expert_used_count
    if experts and arch not in MOE_FAMILY and not a.moe:
        held = sorted([*MOE_FAMILY, *(name for name, x in ARCHITECTURES.items() if x.moe)])
        raise UnmodelledGguf(f"{path}: a mixture-of-experts {arch} GGUF ({arch}.expert_count); llama-tools reads "
                             f"experts of {', '.join(held)}")
    if a.moe and not experts:
        raise ValueError(f"{path}: GGUF metadata has no {arch}.expert_count; llama.cpp's {arch} routes every layer to "
                         f"experts")
    moe = dict(num_experts=experts, num_experts_per_tok=get("expert_used_count", int),
               moe_intermediate_size=get("expert_feed_forward_length", int, 0, required=False)) if experts else {}
    hidden, heads = get("embedding_length", int), get("attention.head_count", int)
    head_dim = get("attention.key_length", int, 0, required=False) or hidden // max(heads, 1)
    rotary = get("rope.dimension_count", int, head_dim, required=False)
    if rotary != head_dim and not a.partial_rotary:
        raise UnmodelledGguf(f"{path}: partial rotary ({arch}.rope.dimension_count {rotary} of head width "
                             f"{head_dim}) is not LLaMA's RoPE")
    if not 0 < rotary <= head_dim or rotary % 2:  # llama.cpp's phi3: the first n_rot channels, NEOX pairs in them
        raise ValueError(f"{path}: GGUF metadata {arch}.rope.dimension_count is {rotary}; it must be an even number "
                         f"in 2..{head_dim} (the head width)")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", int, None, required=False) or (int(emb.shape[-1]) if emb is not None else None) or (
        len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF holds neither {arch}.vocab_size, token_embd.weight nor a vocabulary")
    scaling = None
    kind = get("rope.scaling.type", str, None, required=False)
    divisors = rope_freqs_tensor(reader, path)
    factors = longrope_tensors(reader, path)
    context = get("context_length", int, 2048, required=False)
    if factors and not a.longrope:
        raise UnmodelledGguf(f"{path}: tensor {ROPE_FACTORS[next(iter(factors))]!r} (longrope's factors) in a {arch} "
                             f"GGUF; llama-tools reads them for "
                             f"{', '.join(n for n, x in ARCHITECTURES.items() if x.longrope)}")
    if factors or kind == "longrope":  # llama.cpp's converter writes no type key for it: the tensors say longrope
        if divisors is not None or kind not in (None, "none", "longrope"):
            raise UnmodelledGguf(f"{path}: longrope's factor tensors with {arch}.rope.scaling.type {kind!r} or "
                                 f"{ROPE_FREQS!r}; llama.cpp's converter writes the factors alone")
        if not factors:
            raise ValueError(f"{path}: GGUF metadata {arch}.rope.scaling.type is 'longrope' but the file holds "
                             f"neither {' nor '.join(map(repr, ROPE_FACTORS.values()))}")
        # llama.cpp's defaults: the original context is the trained one, the attention factor 1
        scaling = longrope_scaling(factors, rotary, context, get("rope.scaling.original_context_length", int, context,
                                                                 required=False),
                                   float(get("rope.scaling.attn_factor", float, 1.0, required=False)), path)
    elif divisors is not None:  # Llama 3's scaling, as llama.cpp stores it: no keys, the divisors themselves
        if kind not in (None, "none"):
            raise UnmodelledGguf(f"{path}: both {arch}.rope.scaling.type {kind!r} and tensor {ROPE_FREQS!r}; "
                                 f"llama.cpp writes one or the other")
        scaling = llama3_scaling(divisors, _f32(get("rope.freq_base", float, 10000.0, required=False)), rotary, path)
    elif kind == "yarn":  # ggml's rope_yarn: cos, sin x attn_factor x (1 + 0.1 ln factor); the ramp's ends rounded
        factor = float(get("rope.scaling.factor", float, 1.0, required=False))
        scaling = RopeScaling(
            type=kind, factor=factor, original_max_position_embeddings=get(
                "rope.scaling.original_context_length", int, 8192, required=False),
            attention_factor=float(get("rope.scaling.attn_factor", float, 1.0, required=False))
            * yarn_attention_factor(factor),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", float, 32.0, required=False)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", float, 1.0, required=False)))
    elif kind not in (None, "none"):
        scaling = RopeScaling(type=kind, factor=float(get("rope.scaling.factor", float, 1.0, required=False)),
                              original_max_position_embeddings=get("rope.scaling.original_context_length", int,
                                                                   8192, required=False))
    bos, eos, pad = (meta_value(reader, path, f"tokenizer.ggml.{k}_token_id", int) for k in ("bos", "eos", "padding"))
    for k, v in (("bos", bos), ("eos", eos), ("padding", pad)):
        if v is not None and v > SIZE_LIMITS["token_id"]:
            raise ValueError(f"{path}: GGUF metadata tokenizer.ggml.{k}_token_id is {v:,}, over the "
                             f"{SIZE_LIMITS['token_id']:,} an id may be; is the file damaged?")
    import numpy as np

    layers = get("block_count", int)  # check_metadata: as many as the file holds blk.N. tensors of
    family = FAMILIES[a.family].defaults
    # the biases are the file's tensors, not the family's defaults
    extra: dict[str, Any] = {k: v for k, v in family.items() if k not in ("qkv_bias", "o_bias", "mlp_bias")}
    layer_norm = extra.get("norm_kind") == "layer"  # LayerNorm's epsilon has a key of its own
    if a.parallel == KEY:  # llama.cpp requires it (gptneox)
        parallel = meta_value(reader, path, f"{arch}.use_parallel_residual", bool)
        if parallel is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.use_parallel_residual")
        extra["parallel_residual"] = parallel
    elif a.parallel == ALWAYS:  # one norm feeding both, unless attention has its own (attn_norm_2)
        extra.update(parallel_residual=True, shared_norm="blk.0.attn_norm_2.weight" not in names)
    window = get("attention.sliding_window", int, None, required=False)
    if window:
        pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")  # per layer: true = local
        if isinstance(pattern, list) and len(pattern) == layers:
            types = tuple(SLIDING if x else FULL for x in pattern)
        elif a.swa_pattern:
            types = tuple(SLIDING if (j + 1) % a.swa_pattern else FULL for j in range(layers))
        else:
            types = None
        extra.update(sliding_window=window, layer_types=types)
    if a.family in ("gemma2", "gemma3"):
        scale = get("attention.scale", float, None, required=False)  # a file's own query scale wins over llama.cpp's
        extra["query_pre_attn_scalar"] = (float(str(np.float32(1.0 / float(scale) ** 2))) if scale else
                                          float(hidden // heads if layers == a.big_layers else head_dim))
        for key, field in (("attn_logit_softcapping", "attn_logit_softcap"),
                           ("final_logit_softcapping", "final_logit_softcap")):
            v = get(key, float, None, required=False)
            extra[field] = _f32(v) if v else None
    if arch == "granite":  # absent: llama.cpp's 0, which for the attention scale is 1 / sqrt(n6), else no scaling
        for f, key in GRANITE_KEYS.items():
            v = get(key, float, None, required=False)
            if v is not None and v < 0:
                raise ValueError(f"{path}: GGUF metadata {arch}.{key} is {v!r}; it must be a number >= 0")
            if v:
                extra[f] = _f32(v)
    if a.no_rope_every:
        rotates = tuple((j + 1) % a.no_rope_every != 0 for j in range(layers))
        extra["rope_layers"] = None if all(rotates) else rotates
    base = get("rope.freq_base_swa", float, a.swa_base, required=False)
    if base is not None:
        extra["rope_local_theta"] = _f32(base)
    return ModelConfig(
        **{**extra, **moe}, pad_token_id=pad,
        name=path.stem, source=str(path), family=MOE_FAMILY.get(arch, a.family) if experts else a.family,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length", int),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", int, heads, required=False),
        head_dim=head_dim if head_dim != hidden // max(heads, 1) else 0, rotary_dim=rotary if rotary != head_dim else 0,
        rms_norm_eps=_f32(get("attention.layer_norm_epsilon" if layer_norm else "attention.layer_norm_rms_epsilon",
                              float, 1e-5, required=False)),
        rope_theta=_f32(get("rope.freq_base", float, 10000.0, required=False)), rope_scaling=scaling,
        rope_layout=a.rope_layout, max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in names,  # llama.cpp leaves the tied lm_head out
        qkv_bias=bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & names), o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=bos if bos is not None else 1, eos_token_id=eos if eos is not None else 2,
    )


def _f32(value: Any) -> float:
    """A float32 field as the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(value)))
