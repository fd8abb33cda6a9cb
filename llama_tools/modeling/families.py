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
| granite |          | γ         | SiLU       | pre-norm, both x m  | x m                | alike; D x m, H / m|
| smollm3 |          | γ         | SiLU       | pre-norm            | / sqrt(n6)         | every 4th no RoPE |
| olmo2   | whole q/k| γ         | SiLU       | post-norm only      | / sqrt(n6)         | alike             |
| phi3    |          | γ         | SiLU       | pre-norm            | / sqrt(n6)         | alike; packed qkv |
| qwen3_moe | per head | γ       | SiLU       | pre-norm            | / sqrt(n6)         | alike; top-k experts|
| gpt_neox|          | LayerNorm γ, β | GELU, no gate | parallel (or sequential) | / sqrt(n6)  | alike; packed qkv, biases|
| falcon  |          | LayerNorm γ, β | GELU, no gate | parallel, 1 or 2 norms   | / sqrt(n6)  | alike; packed qkv, MQA/GQA|

Mixtures of experts (a router, top-k routed SwiGLU experts) are named in their files as `Family.moe` says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


@dataclass(frozen=True)
class MoeNames:
    """How a family's files name its mixture of experts: the config.json keys and the stored tensor names.

    The model's own module is always `block_sparse_moe` (router `gate`, `experts.e.{gate,up,down}_proj`);
    weights.py names each stored tensor from these, so a family's names live here and nowhere else.
    """

    experts_key: str  # config.json key of the routed expert count
    width_key: str | None  # config.json key of one expert's width; None: intermediate_size
    block: str  # the layer's sparse block in the file: "block_sparse_moe" (Mixtral), "mlp" (Qwen3-MoE)
    projections: tuple[str, str, str]  # an expert's gate, up and down projection names in the file


MIXTRAL_MOE = MoeNames("num_local_experts", None, "block_sparse_moe", ("w1", "w3", "w2"))
QWEN3_MOE = MoeNames("num_experts", "moe_intermediate_size", "mlp", ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class Family:
    """One family: its HF names, the config fields it sets beyond the LLaMA block, and the config keys it reads."""

    name: str
    hf_classes: tuple[str, ...]  # config.json `architectures` entries
    model_types: tuple[str, ...]  # config.json `model_type` values
    defaults: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family sets, unless the file says
    # The config.json keys that change the math and that this family's own code reads (beyond the sizes every
    # family requires), each with the value that code takes when the file leaves the key out. A key of
    # MATH_KEYS missing here is one the family's code ignores, and so does the reader.
    hf_keys: dict[str, Any] = field(default_factory=dict)
    genai_type: str = "llama"  # onnxruntime-genai's model.type
    moe: MoeNames = MIXTRAL_MOE  # the names of a mixture of experts (any family read with experts: Mixtral's)
    # transformers' module names: its decoder (model.<base>), the decoder's layer list and its final norm
    hf_modules: tuple[str, str, str] = ("model", "layers", "norm")

    @property
    def window_flag(self) -> bool:
        """The sliding window applies only with `use_sliding_window: true` (Qwen ships a window it does not use)."""
        return "use_sliding_window" in self.hf_keys


_GEMMA = dict(norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh")

# What each family's transformers config class takes when a key is absent (transformers 4.57 and 5.x agree on
# these; tests/test_config_keys.py reads them off the installed classes). RoPE's keys are read in both layouts:
# 4.x's top-level rope_theta / rope_scaling (/ rope_local_base_freq), 5.x's rope_parameters, flat or one entry
# per layer type; `rope_theta` here is the base when neither says.
_LLAMA_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
               "head_dim": None, "num_key_value_heads": None, "max_position_embeddings": 2048,
               "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
_MISTRAL_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                 "head_dim": None, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                 "tie_word_embeddings": False, "sliding_window": 4096}
_QWEN_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "head_dim": None, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "sliding_window": 4096, "use_sliding_window": False,
              "max_window_layers": 28, "layer_types": None}
_GEMMA_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
               "hidden_activation": None, "head_dim": 256, "num_key_value_heads": 16, "max_position_embeddings": 8192,
               "tie_word_embeddings": True, "attention_bias": False}
_GEMMA2_KEYS = {**_GEMMA_KEYS, "hidden_activation": "gelu_pytorch_tanh", "num_key_value_heads": 4,
                "sliding_window": 4096, "layer_types": None, "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA3_KEYS = {**_GEMMA2_KEYS, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "max_position_embeddings": 131072, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                "sliding_window_pattern": 6}
# Granite: Llama with four multipliers (transformers' defaults: 1 each, so attention_multiplier 1 is no 1/sqrt(n6)).
_GRANITE_KEYS = {**_LLAMA_KEYS, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                 "attention_multiplier": 1.0, "logits_scaling": 1.0}
# SmolLM3: Llama whose layers listed 0 in no_rope_layers (default: every no_rope_layer_interval-th) have no RoPE.
_SMOLLM3_KEYS = {**_LLAMA_KEYS, "rope_theta": 2000000.0, "max_position_embeddings": 32768,
                 "num_key_value_heads": 4, "tie_word_embeddings": True, "use_sliding_window": False,
                 "sliding_window": None, "layer_types": None, "no_rope_layers": None, "no_rope_layer_interval": 4}
# OLMo 2: Llama's sizes with norms after attention and the FFN only, q/k normalized over the whole projection.
_OLMO2_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu",
               "head_dim": None, "num_key_value_heads": None, "max_position_embeddings": 2048,
               "tie_word_embeddings": False, "attention_bias": False}
# Phi-3 (and 3.5): Llama's block stored packed (qkv_proj, gate_up_proj: formats.py), a window where the config says,
# longrope's short and long factors past original_max_position_embeddings, partial rotary (Phi-4-mini: RoPE on the
# first int(n6 x partial_rotary_factor) channels of each head, rope.py).
_PHI3_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "head_dim": None, "num_key_value_heads": None, "max_position_embeddings": 4096,
              "original_max_position_embeddings": 4096, "tie_word_embeddings": False, "sliding_window": None,
              "partial_rotary_factor": 1.0}
# Qwen3-MoE: Qwen3's attention (q/k norm per head; n6 = n2 / n5 unless head_dim is given: its config class has no
# head_dim of its own) with routed experts in every layer, softmax then top-k, renormalized when norm_topk_prob.
# decoder_sparse_step and mlp_only_layers (dense layers among the sparse ones) are read and refused unless every
# layer is sparse (config_files.py).
_QWEN3_MOE_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                   "head_dim": None, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                   "tie_word_embeddings": False, "sliding_window": 4096, "use_sliding_window": False,
                   "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                   "mlp_only_layers": None}
# GPT-NeoX (Pythia): LayerNorms with biases, q/k/v packed per head (query_key_value), biases on every Linear (qkv and
# dense: attention_bias), a plain GELU MLP, attention and MLP in parallel unless use_parallel_residual is false, RoPE on
# the first rotary_pct of each head (the base is rotary_emb_base: the config class overwrites rope_theta with it).
_GPT_NEOX_KEYS = {"rotary_pct": 0.25, "partial_rotary_factor": 0.25, "rotary_emb_base": 10000, "rope_scaling": None,
                  "layer_norm_eps": 1e-5, "hidden_act": "gelu", "max_position_embeddings": 2048,
                  "tie_word_embeddings": False, "use_parallel_residual": True, "attention_bias": True,
                  "bos_token_id": 0, "eos_token_id": 2}
# Falcon: LayerNorms with biases, query_key_value packed (multi_query: n5 q heads, one k, one v; otherwise grouped per
# KV head), `bias` on every Linear, a plain GELU MLP of ffn_hidden_size (4 n2 unless said); attention and MLP in
# parallel from one input_layernorm (7B/40B's old layout) or from ln_attn and ln_mlp (new_decoder_architecture), or
# in sequence when parallel_attn is false. alibi is not read, so alibi: true is refused (UNMODELLED_KEYS).
# tie_word_embeddings: PretrainedConfig's default, true.
_FALCON_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "layer_norm_epsilon": 1e-5, "activation": "gelu",
                "max_position_embeddings": 2048, "tie_word_embeddings": True, "num_kv_heads": None,
                "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": False,
                "num_ln_in_parallel_attn": None, "ffn_hidden_size": None, "bos_token_id": 11,
                "eos_token_id": 11}
_NEOX_BLOCK = dict(norm_kind="layer", gated_mlp=False, hidden_act="gelu")  # what both set beyond the LLaMA block

# Baichuan and InternLM2 ship their own modeling code beside the weights (trust_remote_code).
_BAICHUAN_KEYS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
                  "position_embedding": None, "norm_head": None}
_INTERNLM2_KEYS = {"rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                   "num_key_value_heads": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                   "bias": True}

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", ("LlamaForCausalLM",), ("llama",), hf_keys=_LLAMA_KEYS),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), hf_keys=_MISTRAL_KEYS, genai_type="mistral"),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",),
           hf_keys={**_MISTRAL_KEYS, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "sliding_window": None,
                    "num_local_experts": 8, "num_experts_per_tok": 2}),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), {"qkv_bias": True}, hf_keys=_QWEN_KEYS, genai_type="qwen2"),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), {"qk_norm": True},
           hf_keys={**_QWEN_KEYS, "head_dim": 128, "attention_bias": False}, genai_type="qwen3"),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), {"qk_norm": True}, hf_keys=_QWEN3_MOE_KEYS,
           moe=QWEN3_MOE),
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), _GEMMA, hf_keys=_GEMMA_KEYS, genai_type="gemma"),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), {**_GEMMA, "sandwich_norms": True}, hf_keys=_GEMMA2_KEYS,
           genai_type="gemma2"),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), {**_GEMMA, "sandwich_norms": True, "qk_norm": True},
           hf_keys=_GEMMA3_KEYS, genai_type="gemma3_text"),
    Family("granite", ("GraniteForCausalLM",), ("granite",), hf_keys=_GRANITE_KEYS, genai_type="granite"),
    Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), hf_keys=_SMOLLM3_KEYS, genai_type="smollm3"),
    Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), {"qk_norm": True, "qk_norm_whole": True, "post_norms": True},
           hf_keys=_OLMO2_KEYS, genai_type="olmo"),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), hf_keys=_PHI3_KEYS, genai_type="phi3"),
    Family("gpt_neox", ("GPTNeoXForCausalLM",), ("gpt_neox",), {**_NEOX_BLOCK, "mlp_bias": True},
           hf_keys=_GPT_NEOX_KEYS, hf_modules=("gpt_neox", "layers", "final_layer_norm")),
    Family("falcon", ("FalconForCausalLM",), ("falcon",), _NEOX_BLOCK, hf_keys=_FALCON_KEYS,
           hf_modules=("transformer", "h", "ln_f")),
    Family("baichuan", ("BaichuanForCausalLM", "BaiChuanForCausalLM"), ("baichuan",), hf_keys=_BAICHUAN_KEYS),
    Family("internlm2", ("InternLM2ForCausalLM",), ("internlm2",), hf_keys=_INTERNLM2_KEYS),
]}
# Every optional key some family reads: a family that leaves one out of its hf_keys ignores it, as its code does.
MATH_KEYS = frozenset(k for f in FAMILIES.values() for k in f.hf_keys)


def _neutral(*values: Any) -> Any:
    return lambda v: v in values


# Keys that change the math in the transformers (or remote) code of models no family here computes: refused in one
# line naming the key unless they hold the value that changes nothing, or unless the config's family reads the key
# (Granite's multipliers, SmolLM3's layers without RoPE). Elsewhere a config that carries one is a variant
# (partial rotary, bidirectional attention, ...).
UNMODELLED_KEYS: dict[str, Any] = {
    "use_bidirectional_attention": _neutral(None, False),
    "partial_rotary_factor": _neutral(None, 1, 1.0),
    "rotary_pct": _neutral(None, 1, 1.0),
    "attention_chunk_size": _neutral(None),
    "no_rope_layers": lambda v: v is None or (isinstance(v, list) and all(x == 1 for x in v)),
    "no_rope_layer_interval": _neutral(None, 0),
    "embedding_multiplier": _neutral(None, 1, 1.0),
    "residual_multiplier": _neutral(None, 1, 1.0),
    "attention_multiplier": _neutral(None),
    "logits_scaling": _neutral(None, 1, 1.0),
    "clip_qkv": _neutral(None),
    "use_qk_norm": _neutral(None, False),
    "qk_layernorm": _neutral(None, False),
    "rope_interleave": _neutral(None, False),
    "q_lora_rank": _neutral(None),
    "kv_lora_rank": _neutral(None),
    "shared_expert_intermediate_size": _neutral(None, 0),
    "n_shared_experts": _neutral(None, 0),
    "num_experts": _neutral(None, 0),
    "n_routed_experts": _neutral(None, 0),
    "moe_intermediate_size": _neutral(None, 0),
    "parallel_attn": _neutral(None, False),
    "use_parallel_residual": _neutral(None, False),
    "alibi": _neutral(None, False),
}
# Inside RoPE's parameters (4.x rope_scaling, 5.x rope_parameters): the keys the model reads; any other key that
# is not null (yarn's attention_factor and betas, longrope's factor lists, ...) is refused, naming it.
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"})
# Read besides those by one scaling type only (transformers 4.57's modeling_rope_utils; DeepSeek's mscale pair).
ROPE_TYPE_KEYS = {
    "yarn": frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"attention_factor", "short_factor", "long_factor"}),
}
FAMILY_NAMES = tuple(FAMILIES)
# config.json `architectures` entries and `model_type` values -> family name.
HF_NAMES = {name: f.name for f in FAMILIES.values() for name in (*f.hf_classes, *f.model_types)}
