"""Configs of every modelled family and RoPE variant, as transformers' own config classes take them.

One table, two layouts: `v5_kwargs` (transformers >= 5: `rope_parameters`, flat or one entry per layer type) and
`v4_kwargs` (4.x: top-level rope_theta, rope_scaling, rope_local_base_freq). scripts/write_config_fixtures.py
writes each case's config.json with transformers 5 into tests/data/transformers5/; tests/test_config_layouts.py
reads both against the installed transformers. Norms, biases and caps are off their initial values where the
family has them; windows are short and the rows long (SEQ), so every window and original context is passed.
"""

from __future__ import annotations

from typing import Any

SEQ = 320  # positions each case runs: past every sliding window (16) and llama3's original context (64)
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
_SLIDING, _FULL = "sliding_attention", "full_attention"
_GEMMA3_LAYERS = [_SLIDING, _SLIDING, _FULL, _SLIDING]


def _default(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


# case -> (config class, model class, family keys, RoPE parameters in transformers 5's form)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True), _default(500000.0)),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {}, {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 10000.0}),
    "llama-llama3": ("LlamaConfig", "LlamaForCausalLM", {},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16), _default(1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=None), _default(1000000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                                                     max_window_layers=2, tie_word_embeddings=True),
              _default(1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True),
              {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), _default(10000.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                                                        attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
               _default(10000.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=24, layer_types=_GEMMA3_LAYERS),
               {_FULL: _default(1000000.0), _SLIDING: _default(10000.0)}),
    "gemma3-linear": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                      dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=24, layer_types=_GEMMA3_LAYERS),
                      {_FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                       _SLIDING: _default(10000.0)}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=3.0, residual_multiplier=0.4,
                                                           attention_multiplier=0.09, logits_scaling=0.5),
                _default(10000.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(attention_bias=True), _default(500000.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=16), _default(10000.0)),
    # Phi-3's own longrope (short and long factors, n6 / 2 = 8 each) past its original context of 64
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=64),
                      {"rope_type": "longrope", "rope_theta": 10000.0,
                       "short_factor": [1.0, 1.1, 1.3, 1.5, 2.0, 2.5, 3.0, 3.5],
                       "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}),
    # every 2nd layer without RoPE, those layers sliding (transformers' rule for SmolLM3's layer_types)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, use_sliding_window=True,
                                                           sliding_window=16), _default(2000000.0)),
}


def v5_kwargs(case: str) -> dict[str, Any]:
    """The config class's keyword arguments as transformers 5 takes them."""
    _, _, keys, rope = CASES[case]
    return {**SIZES, **keys, "rope_parameters": rope}


def v4_kwargs(case: str) -> dict[str, Any]:
    """The same config as transformers 4.x takes it: RoPE's base and scaling as top-level keys."""
    _, _, keys, rope = CASES[case]
    out: dict[str, Any] = {**SIZES, **keys}
    full = rope.get(_FULL, rope)
    if _SLIDING in rope:
        out["rope_local_base_freq"] = rope[_SLIDING]["rope_theta"]
    out["rope_theta"] = full["rope_theta"]
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if CASES[case][0] == "Phi3Config" and scaling["rope_type"] != "default":  # 4.x's Phi3Config: `type` and the
        scaling = {"type": scaling.pop("rope_type"), **scaling}  # two lists only (its _rope_scaling_validation)
    out["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
    return out


def off_initial_values(model: Any) -> Any:
    """A transformers model's numbers moved off their initial values, in place (seed the RNG first): norms, q/k norms
    and biases far from 0 or 1, so a misread one shows; every matrix at unit gain, q and k at 3x, so that the
    attention scores are O(1) and RoPE's angles, windows and masks decide the output."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                gain = 3.0 if any(k in name for k in ("q_proj", "k_proj")) else 1.0
                p.normal_(0.0, gain / p.shape[1] ** 0.5)
    return model


def saved_model(model_cls: Any, config: Any, directory: Any, perturb: Any = off_initial_values) -> Any:
    """A transformers model of `config` built from seed 0 in eval mode, perturb(model) applied in place, saved to
    DIRECTORY by transformers itself; the model."""
    import torch

    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        perturb(model)
    model.save_pretrained(directory)
    return model
