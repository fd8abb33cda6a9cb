"""The families: each a small, named override of the LLaMA block, and the names its files give it.

One registry. The config reader (config_files.py) takes a family's HF class and model_type from here and its
defaults for keys a config.json may leave out; the model (model.py) reads the overrides from the config's
fields; `convert` and the export name the family from here. No torch.

| family  | q/k norm | norm gain | FFN gate   | around attn and FFN | scores             | layers            |
|---------|----------|-----------|------------|---------------------|--------------------|-------------------|
| llama   |          | γ         | SiLU       | pre-norm            | / sqrt(n6)         | alike             |
| qwen2   |          | γ         | SiLU       | pre-norm            | / sqrt(n6)         | alike; q/k/v bias |
| qwen3   | per head | γ         | SiLU       | pre-norm            | / sqrt(n6)         | alike             |
| gemma   |          | 1 + γ     | GELU-tanh  | pre-norm            | / sqrt(n6)         | alike; D x sqrt(n2)|
| gemma2  |          | 1 + γ     | GELU-tanh  | pre- and post-norm  | / sqrt(s), capped  | local / global    |
| gemma3  | per head | 1 + γ     | GELU-tanh  | pre- and post-norm  | / sqrt(s)          | 5 local : 1 global|
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


@dataclass(frozen=True)
class Family:
    """One family: its HF names and the config fields it sets beyond the LLaMA block."""

    name: str
    hf_classes: tuple[str, ...]  # config.json `architectures` entries
    model_types: tuple[str, ...]  # config.json `model_type` values
    defaults: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family sets, unless the file says
    window_flag: bool = False  # the sliding window applies only with `use_sliding_window: true` (Qwen)
    tied_by_default: bool = False  # HF's config class defaults tie_word_embeddings to true
    genai_type: str = "llama"  # onnxruntime-genai's model.type


_GEMMA = dict(norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh")

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), genai_type="mistral"),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",)),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), {"qkv_bias": True}, window_flag=True, genai_type="qwen2"),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), {"qk_norm": True}, window_flag=True, genai_type="qwen3"),
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), _GEMMA, tied_by_default=True, genai_type="gemma"),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), {**_GEMMA, "sandwich_norms": True},
           tied_by_default=True, genai_type="gemma2"),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), {**_GEMMA, "sandwich_norms": True, "qk_norm": True},
           tied_by_default=True, genai_type="gemma3_text"),
    Family("baichuan", ("BaichuanForCausalLM", "BaiChuanForCausalLM"), ("baichuan",)),
    Family("internlm2", ("InternLM2ForCausalLM",), ("internlm2",)),
]}
FAMILY_NAMES = tuple(FAMILIES)
# config.json `architectures` entries and `model_type` values -> family name.
HF_NAMES = {name: f.name for f in FAMILIES.values() for name in (*f.hf_classes, *f.model_types)}
