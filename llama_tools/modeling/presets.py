"""Published configurations as small overrides of a default (gpt-fast style), their aliases, the paper's four."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from . import dtypes
from .config import ModelConfig, RopeScaling
from .families import FAMILIES, FULL, SLIDING
from .rope import longrope_attention_factor

FP16, BF16, FP32 = dtypes.FLOAT16.name, dtypes.BFLOAT16.name, dtypes.FLOAT32.name
_LLAMA3_SCALING = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

# Sizes every preset overrides in part; each one below states only how it differs (its HF config.json).
_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)
_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40)
_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8)
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
               eos_token_id=128001, torch_dtype=BF16)
# Llama 3.1 and 3.2: 128K positions through the llama3 scaling of RoPE (factor 8; 3.2's small ones 32).
_LLAMA31 = dict(_LLAMA3, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072)
_LLAMA32 = dict(_LLAMA31, rope_scaling=RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=8192), tie_word_embeddings=True)


def _sizes(n2: int, n7: int, n8: int, n5: int, kv: int | None = None) -> dict[str, int]:
    """The sizes a row gives, in the paper's order: width n2, FFN width n7, layers n8, heads n5 (and KV heads)."""
    out = dict(hidden_size=n2, intermediate_size=n7, num_hidden_layers=n8, num_attention_heads=n5)
    return out if kv is None else {**out, "num_key_value_heads": kv}


def _family(name: str, **kw: Any) -> dict[str, Any]:
    """A family's name and the fields it sets beyond the LLaMA block (families.py), as its config reader sets them."""
    return dict(family=name, **FAMILIES[name].defaults, **kw)


def _pattern(layers: int, every: int) -> tuple[str, ...]:
    """Gemma 2/3's layer types: every `every`-th layer full attention, the rest sliding (HF's own rule)."""
    return tuple(SLIDING if (j + 1) % every else FULL for j in range(layers))


# Qwen3 (dense): q/k norm per head, n6 = 128 whatever the width, 40,960 positions; the three small ones tie.
_QWEN3 = dict(**_family("qwen3"), vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
              rope_theta=1e6, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
              torch_dtype=BF16)
# Qwen3-MoE: Qwen3's attention (4 KV heads) with 128 routed experts of width 768 in every layer, 8 a token, their
# weights renormalized; n7 (6,144) is the width a dense layer would have, and no layer is dense.
_QWEN3_MOE = dict(_QWEN3, **_family("qwen3_moe"), num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, norm_topk_prob=True)
# Gemma 1-3: tied embeddings, eps 1e-6, ids bos 2 / eos 1 / pad 0, n6 = 256 unless stated.
_GEMMA_IDS = dict(head_dim=256, tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
                  pad_token_id=0)
_GEMMA = dict(**_family("gemma"), **_GEMMA_IDS, vocab_size=256000, max_position_embeddings=8192, torch_dtype=BF16)
_GEMMA2 = dict(**_family("gemma2"), **_GEMMA_IDS, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
               query_pre_attn_scalar=256, attn_logit_softcap=50.0, final_logit_softcap=30.0, torch_dtype=FP32,
               full_every=2)
_GEMMA3 = dict(**_family("gemma3"), **_GEMMA_IDS, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
               query_pre_attn_scalar=256, rope_theta=1e6, rope_local_theta=10000.0, torch_dtype=BF16,
               full_every=6)
# Gemma 3 4B, 12B, 27B: the text model of the multimodal checkpoint (its text_config): 262,208 rows (the image
# tokens' too), a window of 1,024, 128K positions by linear scaling of the global layers' RoPE.
_GEMMA3_MM = dict(_GEMMA3, vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                  rope_scaling=RopeScaling("linear", factor=8.0))
# SmolLM2: LLaMA blocks, tied, 49,152 tokens, 8K positions.
_SMOLLM2 = dict(vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
                bos_token_id=0, eos_token_id=0, torch_dtype=BF16)

# Granite 3.1: Llama blocks with four multipliers, tied, 49,155 tokens, 128K positions at base 10^7.
_GRANITE = dict(**_family("granite"), vocab_size=49155, num_hidden_layers=40, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True, rope_theta=1e7, max_position_embeddings=131072,
                embedding_multiplier=12.0, residual_multiplier=0.22, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                torch_dtype=BF16)
# SmolLM3: Llama blocks, every 4th layer without RoPE (no_rope_every), tied, Llama 3's vocabulary.
_SMOLLM3 = dict(**_family("smollm3"), vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-6,
                rope_theta=5e6, max_position_embeddings=65536, bos_token_id=128000, eos_token_id=128012,
                pad_token_id=128004, torch_dtype=BF16, no_rope_every=4)

# OLMo 2 (November 2024): norms after attention and the FFN, 100,352 rows, untied, 4K positions at base 500,000.
_OLMO2 = dict(**_family("olmo2"), vocab_size=100352, rms_norm_eps=1e-6, rope_theta=500000.0,
              max_position_embeddings=4096, bos_token_id=100257, eos_token_id=100257, pad_token_id=100277,
              torch_dtype=FP32)

# Phi-3 (4K context): Llama blocks stored packed, 32,064 rows, untied, a window of 2,047.
_PHI3 = dict(**_family("phi3"), vocab_size=32064, max_position_embeddings=4096, sliding_window=2047,
             bos_token_id=1, eos_token_id=32000, pad_token_id=32000, torch_dtype=BF16)

# Phi-4-mini: Phi-3's block (packed, SwiGLU) with 200,064 tied rows, GQA (24 query heads over 8), RoPE on the first
# 96 of each head's 128 channels (partial_rotary_factor 0.75), longrope from 4,096 to 131,072 positions (48 short and
# 48 long factors, one per rotated pair), and a window (262,144) past the context, so it never masks a key.
_PHI4_MINI_LONG = (1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                   2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                   5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                   11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                   25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                   32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)
_PHI4_MINI = dict(**_family("phi3"), vocab_size=200064, num_key_value_heads=8, rotary_dim=96,
                  max_position_embeddings=131072, sliding_window=262144, tie_word_embeddings=True,
                  rope_scaling=RopeScaling("longrope", factor=32.0, original_max_position_embeddings=4096,
                                           attention_factor=longrope_attention_factor(32.0, 4096),
                                           short_factor=(1.0,) * 48, long_factor=tuple(map(float, _PHI4_MINI_LONG))),
                  bos_token_id=199999, eos_token_id=200020, pad_token_id=199999, torch_dtype=BF16)


def _preset(name: str, *bases: dict[str, Any], **kw: Any) -> ModelConfig:
    """LLaMA-2's defaults (eps 1e-5, 4096 positions, fp16), then `bases`, then `kw`; `full_every` (Gemma 2/3) makes
    the layer types from the layer count (_pattern), `no_rope_every` (SmolLM3) the layers with RoPE."""
    fields: dict[str, Any] = dict(rms_norm_eps=1e-5, max_position_embeddings=4096, torch_dtype=FP16)
    for base in bases:
        fields.update(base)
    fields.update(kw)
    every = fields.pop("full_every", None)
    if every:
        fields["layer_types"] = _pattern(fields["num_hidden_layers"], every)
    every = fields.pop("no_rope_every", None)
    if every:
        fields["rope_layers"] = tuple((j + 1) % every != 0 for j in range(fields["num_hidden_layers"]))
    return ModelConfig(name=name, source=name, **fields)

# Pythia (GPT-NeoX): LayerNorms with biases, packed q/k/v with biases, a GELU MLP of 4 n2, attention and MLP in
# parallel, RoPE on the first quarter of each head (rotary_pct 0.25), untied embed_out, 50,304 rows, bos = eos = 0.
_PYTHIA = dict(**_family("gpt_neox"), vocab_size=50304, qkv_bias=True, o_bias=True, rms_norm_eps=1e-5,
               parallel_residual=True, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0, torch_dtype=FP16)
# Falcon-7B: one input_layernorm feeding attention and MLP in parallel, multi-query (one KV head), no biases, a GELU
# MLP of 4 n2, tied, 65,024 rows, bos = eos = 11.
_FALCON_7B = dict(**_family("falcon"), vocab_size=65024, num_key_value_heads=1, rms_norm_eps=1e-5,
                  parallel_residual=True, shared_norm=True, tie_word_embeddings=True, max_position_embeddings=2048,
                  bos_token_id=11, eos_token_id=11, torch_dtype=BF16)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    # The paper's four.
    _preset("llama-7b", _7B, rms_norm_eps=1e-6, max_position_embeddings=2048),
    _preset("llama-13b", _13B, rms_norm_eps=1e-6, max_position_embeddings=2048),
    _preset("baichuan-7b", _7B, family="baichuan", vocab_size=64000, rms_norm_eps=1e-6, torch_dtype=FP32),
    _preset("baichuan-13b", _13B, family="baichuan", vocab_size=64000, intermediate_size=13696, rms_norm_eps=1e-6,
            position_encoding="alibi", torch_dtype=BF16),
    # The rest of the family (seed 004's table).
    _preset("llama-2-7b", _7B),
    _preset("llama-2-13b", _13B),
    _preset("llama-2-70b", _70B, vocab_size=32000),
    _preset("llama-3-8b", _7B, _LLAMA3, intermediate_size=14336, num_key_value_heads=8),
    _preset("llama-3-70b", _70B, _LLAMA3),
    _preset("llama-3.1-405b", _LLAMA3, _sizes(16384, 53248, 126, 128, 8), rope_scaling=_LLAMA3_SCALING,
            max_position_embeddings=131072),
    _preset("mistral-7b", _7B, family="mistral", intermediate_size=14336, num_key_value_heads=8,
            max_position_embeddings=32768, sliding_window=4096, torch_dtype=BF16),
    _preset("mixtral-8x7b", _7B, family="mixtral", intermediate_size=14336, num_key_value_heads=8, rope_theta=1e6,
            max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2, torch_dtype=BF16),
    _preset("qwen2-7b", _sizes(3584, 18944, 28, 28, 4), family="qwen2", vocab_size=152064, rms_norm_eps=1e-6,
            rope_theta=1e6, max_position_embeddings=131072, qkv_bias=True, bos_token_id=151643, eos_token_id=151643,
            torch_dtype=BF16),
    _preset("yi-34b", _sizes(7168, 20480, 60, 56, 8), vocab_size=64000, rope_theta=5e6, torch_dtype=BF16),
    _preset("deepseek-67b", _70B, vocab_size=102400, intermediate_size=22016, num_hidden_layers=95,
            rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001, torch_dtype=BF16),
    _preset("internlm2-20b", _sizes(6144, 16384, 48, 48, 8), family="internlm2", vocab_size=92544, rope_theta=1e6,
            max_position_embeddings=32768, torch_dtype=BF16),
    _preset("baichuan2-7b", _7B, family="baichuan", vocab_size=125696, rms_norm_eps=1e-6, norm_head=True,
            torch_dtype=BF16),
    _preset("baichuan2-13b", _13B, family="baichuan", vocab_size=125696, intermediate_size=13696, rms_norm_eps=1e-6,
            position_encoding="alibi", norm_head=True, torch_dtype=BF16),
    # This year's small and mid-size models (tests/test_presets_2025.py: each equals transformers' own count).
    _preset("llama-3.1-8b", _7B, _LLAMA31, intermediate_size=14336, num_key_value_heads=8),
    _preset("llama-3.1-70b", _70B, _LLAMA31),
    _preset("llama-3.2-1b", _LLAMA32, _sizes(2048, 8192, 16, 32, 8)),
    _preset("llama-3.2-3b", _LLAMA32, _sizes(3072, 8192, 28, 24, 8)),
    _preset("qwen3-0.6b", _QWEN3, _sizes(1024, 3072, 28, 16), tie_word_embeddings=True),
    _preset("qwen3-1.7b", _QWEN3, _sizes(2048, 6144, 28, 16), tie_word_embeddings=True),
    _preset("qwen3-4b", _QWEN3, _sizes(2560, 9728, 36, 32), tie_word_embeddings=True),
    _preset("qwen3-8b", _QWEN3, _sizes(4096, 12288, 36, 32)),
    _preset("qwen3-14b", _QWEN3, _sizes(5120, 17408, 40, 40)),
    _preset("qwen3-32b", _QWEN3, _sizes(5120, 25600, 64, 64)),
    _preset("qwen3-30b-a3b", _QWEN3_MOE, _sizes(2048, 6144, 48, 32)),
    _preset("gemma-2b", _GEMMA, _sizes(2048, 16384, 18, 8, 1)),
    _preset("gemma-7b", _GEMMA, _sizes(3072, 24576, 28, 16, 16)),
    _preset("gemma-2-2b", _GEMMA2, _sizes(2304, 9216, 26, 8, 4)),
    _preset("gemma-2-9b", _GEMMA2, _sizes(3584, 14336, 42, 16, 8)),
    _preset("gemma-2-27b", _GEMMA2, _sizes(4608, 36864, 46, 32, 16), head_dim=128, query_pre_attn_scalar=144),
    _preset("gemma-3-270m", _GEMMA3, _sizes(640, 2048, 18, 4, 1)),
    _preset("gemma-3-1b", _GEMMA3, _sizes(1152, 6912, 26, 4, 1)),
    _preset("gemma-3-4b", _GEMMA3_MM, _sizes(2560, 10240, 34, 8, 4)),
    _preset("gemma-3-12b", _GEMMA3_MM, _sizes(3840, 15360, 48, 16, 8)),
    _preset("gemma-3-27b", _GEMMA3_MM, _sizes(5376, 21504, 62, 32, 16), head_dim=128, query_pre_attn_scalar=168),
    _preset("smollm2-135m", _SMOLLM2, _sizes(576, 1536, 30, 9, 3)),
    _preset("smollm2-360m", _SMOLLM2, _sizes(960, 2560, 32, 15, 5)),
    _preset("smollm2-1.7b", _SMOLLM2, _sizes(2048, 8192, 24, 32, 32), rope_theta=130000.0),
    _preset("granite-3.1-2b", _GRANITE, hidden_size=2048, intermediate_size=8192, attention_multiplier=0.015625,
            logits_scaling=8.0),
    _preset("granite-3.1-8b", _GRANITE, hidden_size=4096, intermediate_size=12800, attention_multiplier=0.0078125,
            logits_scaling=16.0),
    _preset("olmo-2-7b", _OLMO2, _sizes(4096, 11008, 32, 32)),
    _preset("olmo-2-13b", _OLMO2, _sizes(5120, 13824, 40, 40)),
    _preset("phi-3-mini-4k", _PHI3, _sizes(3072, 8192, 32, 32)),
    _preset("phi-3-medium-4k", _PHI3, _sizes(5120, 17920, 40, 40, 10)),
    _preset("phi-4-mini", _PHI4_MINI, _sizes(3072, 8192, 32, 24)),
    _preset("smollm3-3b", _SMOLLM3, _sizes(2048, 11008, 36, 16, 4)),
    _preset("pythia-160m", _PYTHIA, _sizes(768, 3072, 12, 12), rotary_dim=16),  # n6 64, a quarter rotates
    _preset("pythia-1b", _PYTHIA, _sizes(2048, 8192, 16, 8), rotary_dim=64),  # n6 256
    _preset("falcon-7b", _FALCON_7B, _sizes(4544, 18176, 32, 71)),
    # Small enough to build in a test: GQA (4 query heads over 2 KV heads), two layers.
    _preset("tiny", _sizes(64, 176, 2, 4, 2), vocab_size=512, max_position_embeddings=256, torch_dtype=FP32),
]}

ALIASES = {
    "llama-2-7b-hf": "llama-2-7b", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b",
    "llama2-70b": "llama-2-70b", "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b", "mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "llama3.1-8b": "llama-3.1-8b", "llama3.1-70b": "llama-3.1-70b", "llama3.1-405b": "llama-3.1-405b",
    "meta-llama-3.1-8b": "llama-3.1-8b", "meta-llama-3.1-70b": "llama-3.1-70b",
    "meta-llama-3.1-405b": "llama-3.1-405b", "llama3.2-1b": "llama-3.2-1b", "llama3.2-3b": "llama-3.2-3b",
    "gemma2-2b": "gemma-2-2b", "gemma2-9b": "gemma-2-9b", "gemma2-27b": "gemma-2-27b",
    "gemma3-270m": "gemma-3-270m", "gemma3-1b": "gemma-3-1b", "gemma3-4b": "gemma-3-4b",
    "gemma3-12b": "gemma-3-12b", "gemma3-27b": "gemma-3-27b", "gemma-3-1b-pt": "gemma-3-1b",
    "gemma-3-4b-pt": "gemma-3-4b", "gemma-3-12b-pt": "gemma-3-12b", "gemma-3-27b-pt": "gemma-3-27b",
    "granite-3.1-2b-instruct": "granite-3.1-2b", "granite-3.1-8b-instruct": "granite-3.1-8b",
    "granite3.1-2b": "granite-3.1-2b", "granite3.1-8b": "granite-3.1-8b", "smollm3": "smollm3-3b",
    "smollm3-3b-base": "smollm3-3b", "olmo-2-1124-7b": "olmo-2-7b", "olmo-2-1124-13b": "olmo-2-13b",
    "olmo2-7b": "olmo-2-7b", "olmo2-13b": "olmo-2-13b", "phi-3-mini-4k-instruct": "phi-3-mini-4k",
    "phi3-mini": "phi-3-mini-4k", "phi-3-mini": "phi-3-mini-4k", "phi-3-medium-4k-instruct": "phi-3-medium-4k",
    "phi3-medium": "phi-3-medium-4k", "phi-4-mini-instruct": "phi-4-mini", "phi4-mini": "phi-4-mini",
    "phi-4-mini-3.8b": "phi-4-mini",
}

# Where each preset's numbers come from (its published config.json; the paper for its four).
PRESET_SOURCES = {
    "llama-7b": "the paper (huggyllama/llama-7b)", "llama-13b": "the paper (huggyllama/llama-13b)",
    "baichuan-7b": "the paper (baichuan-inc/Baichuan-7B)", "baichuan-13b": "the paper (baichuan-inc/Baichuan-13B-Base)",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf", "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B", "llama-3.1-405b": "meta-llama/Llama-3.1-405B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1", "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2-7b": "Qwen/Qwen2-7B", "yi-34b": "01-ai/Yi-34B", "deepseek-67b": "deepseek-ai/deepseek-llm-67b-base",
    "internlm2-20b": "internlm/internlm2-20b", "baichuan2-7b": "baichuan-inc/Baichuan2-7B-Base",
    "baichuan2-13b": "baichuan-inc/Baichuan2-13B-Base",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B", "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    **{f"qwen3-{s}": f"Qwen/Qwen3-{s.upper()}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b", "30b-a3b")},
    "gemma-2b": "google/gemma-2b", "gemma-7b": "google/gemma-7b", "gemma-2-2b": "google/gemma-2-2b",
    "gemma-2-9b": "google/gemma-2-9b", "gemma-2-27b": "google/gemma-2-27b", "gemma-3-270m": "google/gemma-3-270m",
    "gemma-3-1b": "google/gemma-3-1b-pt", "gemma-3-4b": "google/gemma-3-4b-pt (text_config)",
    "gemma-3-12b": "google/gemma-3-12b-pt (text_config)", "gemma-3-27b": "google/gemma-3-27b-pt (text_config)",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M", "smollm2-360m": "HuggingFaceTB/SmolLM2-360M",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B", "granite-3.1-2b": "ibm-granite/granite-3.1-2b-instruct",
    "granite-3.1-8b": "ibm-granite/granite-3.1-8b-instruct", "smollm3-3b": "HuggingFaceTB/SmolLM3-3B",
    "olmo-2-7b": "allenai/OLMo-2-1124-7B", "olmo-2-13b": "allenai/OLMo-2-1124-13B",
    "phi-3-mini-4k": "microsoft/Phi-3-mini-4k-instruct", "phi-3-medium-4k": "microsoft/Phi-3-medium-4k-instruct",
    "phi-4-mini": "microsoft/Phi-4-mini-instruct",
    "pythia-160m": "EleutherAI/pythia-160m", "pythia-1b": "EleutherAI/pythia-1b", "falcon-7b": "tiiuae/falcon-7b",
    "tiny": "built in: seeded weights and a tokenizer, for tests and the README",
}

# Presets that ship a tokenizer as package data, so --prompt, tokenize and the export's clients work on them.
# tiny's: 512 BPE pieces with byte fallback, trained once by scripts/train_tiny_tokenizer.py on the paper's text.
PRESET_TOKENIZERS = {"tiny": "data/tiny/tokenizer.model"}

# The four models the paper counts (section 10).
PAPER_MODELS = ("llama-7b", "llama-13b", "baichuan-7b", "baichuan-13b")


def preset_names() -> list[str]:
    return list(PRESETS)


def aliases_of(name: str) -> list[str]:
    """The other names that select preset NAME (what `presets` lists beside it)."""
    return [a for a, target in ALIASES.items() if target == name]


def preset_tokenizer(name: str) -> Path | None:
    """The packaged tokenizer.model of preset NAME, or None when it has none."""
    rel = PRESET_TOKENIZERS.get(ALIASES.get(name.lower(), name.lower()))
    return Path(__file__).resolve().parent.parent / rel if rel else None  # llama_tools/data/


def closest_preset(name: str) -> str | None:
    """The preset or alias NAME most likely misspells (difflib's ratio >= 0.6), or None."""
    close = difflib.get_close_matches(name.lower(), [*PRESETS, *ALIASES], n=1)
    return close[0] if close else None


def get_preset(name: str) -> ModelConfig:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        close = closest_preset(name)
        hint = f" (did you mean {close}?)" if close else ""
        raise ValueError(f"unknown model {name!r}: not a preset, config.json or checkpoint directory{hint}. "
                         f"Known presets: {', '.join(PRESETS)}")
    return PRESETS[key]
