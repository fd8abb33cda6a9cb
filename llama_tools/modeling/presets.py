"""Published configurations as small overrides of a default (gpt-fast style), their aliases, the paper's four."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from . import dtypes
from .config import ModelConfig, RopeScaling

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


def _preset(name: str, *bases: dict[str, Any], **kw: Any) -> ModelConfig:
    """LLaMA-2's defaults (eps 1e-5, 4096 positions, fp16), then `bases`, then `kw`."""
    fields: dict[str, Any] = dict(rms_norm_eps=1e-5, max_position_embeddings=4096, torch_dtype=FP16)
    for base in bases:
        fields.update(base)
    return ModelConfig(name=name, source=name, **{**fields, **kw})


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
    _preset("llama-3.1-405b", _LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
            num_attention_heads=128, num_key_value_heads=8, rope_scaling=_LLAMA3_SCALING,
            max_position_embeddings=131072),
    _preset("mistral-7b", _7B, family="mistral", intermediate_size=14336, num_key_value_heads=8,
            max_position_embeddings=32768, sliding_window=4096, torch_dtype=BF16),
    _preset("mixtral-8x7b", _7B, family="mixtral", intermediate_size=14336, num_key_value_heads=8, rope_theta=1e6,
            max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2, torch_dtype=BF16),
    _preset("qwen2-7b", family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=131072, qkv_bias=True, bos_token_id=151643, eos_token_id=151643,
            torch_dtype=BF16),
    _preset("yi-34b", vocab_size=64000, hidden_size=7168, intermediate_size=20480, num_hidden_layers=60,
            num_attention_heads=56, num_key_value_heads=8, rope_theta=5e6, torch_dtype=BF16),
    _preset("deepseek-67b", _70B, vocab_size=102400, intermediate_size=22016, num_hidden_layers=95,
            rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001, torch_dtype=BF16),
    _preset("internlm2-20b", family="internlm2", vocab_size=92544, hidden_size=6144, intermediate_size=16384,
            num_hidden_layers=48, num_attention_heads=48, num_key_value_heads=8, rope_theta=1e6,
            max_position_embeddings=32768, torch_dtype=BF16),
    _preset("baichuan2-7b", _7B, family="baichuan", vocab_size=125696, rms_norm_eps=1e-6, norm_head=True,
            torch_dtype=BF16),
    _preset("baichuan2-13b", _13B, family="baichuan", vocab_size=125696, intermediate_size=13696, rms_norm_eps=1e-6,
            position_encoding="alibi", norm_head=True, torch_dtype=BF16),
    # Small enough to build in a test: GQA (4 query heads over 2 KV heads), two layers.
    _preset("tiny", vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, torch_dtype=FP32),
]}

ALIASES = {
    "llama-2-7b-hf": "llama-2-7b", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b",
    "llama2-70b": "llama-2-70b", "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b", "mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
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
