"""This year's presets (Llama 3.1/3.2, Qwen3, Gemma 1-3, SmolLM2) against their published config.json files.

Each preset is written twice: in presets.py as our fields, and here as the HF config.json keys its model card's
repository publishes (the 4B+ Gemma 3: the `text_config` of the multimodal checkpoint, with Gemma3TextConfig's
defaults for what it leaves out). Three checks per preset, none needing weights:

- our reader of the published file gives the preset, field for field (only the name and source differ);
- our count equals transformers' own: the published config built by transformers on the meta device,
  `model.num_parameters()`, to the unit;
- the preset round-trips through config_to_hf -> config_from_hf unchanged.

The totals are also pinned to the figures the model cards publish (rounded there), so a wrong width in both
places at once still shows.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf
from llama_tools.counting.accounting import count_params
from llama_tools.modeling.presets import ALIASES, PRESET_SOURCES, PRESETS, get_preset

_LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
               hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
_LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
              num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
              max_position_embeddings=40960, attention_bias=False, use_sliding_window=False, sliding_window=None,
              hidden_act="silu", bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
# Qwen/Qwen3-30B-A3B's config.json (its MoE keys; max_window_layers, router_aux_loss_coef and the like change nothing)
_QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, head_dim=128,
                  num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                  max_position_embeddings=40960, attention_bias=False, use_sliding_window=False, sliding_window=None,
                  max_window_layers=48, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
                  tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                  router_aux_loss_coef=0.001, torch_dtype="bfloat16")
_GEMMA = dict(model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=256000, head_dim=256,
              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192, hidden_act="gelu",
              bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16")
_GEMMA2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=256000, head_dim=256,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
               hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
               sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
               bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="float32")
_GEMMA3 = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144, head_dim=256,
               rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
               max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
               sliding_window=512, sliding_window_pattern=6, attn_logit_softcapping=None,
               final_logit_softcapping=None, bos_token_id=2, eos_token_id=1, pad_token_id=0,
               torch_dtype="bfloat16")
# The 4B+ text_config: only what differs from Gemma3TextConfig's defaults is written there.
_GEMMA3_MM = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=1024,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, torch_dtype="bfloat16")
_SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
                tie_word_embeddings=True, hidden_act="silu", bos_token_id=0, eos_token_id=0,
                torch_dtype="bfloat16")

_GRANITE = dict(model_type="granite", architectures=["GraniteForCausalLM"], vocab_size=49155, num_hidden_layers=40,
                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000000.0,
                rope_scaling=None, max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
                mlp_bias=False, hidden_act="silu", embedding_multiplier=12.0, residual_multiplier=0.22,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="bfloat16")
_SMOLLM3 = dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], vocab_size=128256, rms_norm_eps=1e-6,
                rope_theta=5000000.0, rope_scaling=None, max_position_embeddings=65536, tie_word_embeddings=True,
                attention_bias=False, mlp_bias=False, hidden_act="silu", use_sliding_window=False,
                sliding_window=None, no_rope_layer_interval=4,
                no_rope_layers=[int((j + 1) % 4 != 0) for j in range(36)],
                bos_token_id=128000, eos_token_id=128012, pad_token_id=128004, torch_dtype="bfloat16")

_OLMO2 = dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], vocab_size=100352, rms_norm_eps=1e-6,
              rope_theta=500000.0, rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
              attention_bias=False, hidden_act="silu", bos_token_id=100257, eos_token_id=100257,
              pad_token_id=100277, torch_dtype="float32")

_PHI3 = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=32064, rms_norm_eps=1e-5,
             rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
             original_max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False,
             hidden_act="silu", bos_token_id=1, eos_token_id=32000, pad_token_id=32000, torch_dtype="bfloat16")
# microsoft/Phi-4-mini-instruct's config.json (its longrope lists: 48 factors each, one per rotated channel pair of
# the 96 that partial_rotary_factor 0.75 turns of each 128-wide head; lm_head_bias, interpolate_factor and
# full_attn_mod are keys its modeling code reads none of)
_PHI4_MINI_LONG = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                   2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                   5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                   11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                   25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                   32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
_PHI4_MINI = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072,
                  intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                  attention_bias=False, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                  partial_rotary_factor=0.75, max_position_embeddings=131072, original_max_position_embeddings=4096,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": _PHI4_MINI_LONG},
                  sliding_window=262144, tie_word_embeddings=True, bos_token_id=199999, eos_token_id=200020,
                  pad_token_id=199999, torch_dtype="bfloat16")


def _sizes(hidden: int, ffn: int, layers: int, heads: int, kv: int, **kw) -> dict:
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, **kw)


# preset -> (its published config.json, the total its model card publishes, that figure's rounding)
PUBLISHED: dict[str, tuple[dict, float, float]] = {
    "llama-3.1-8b": ({**_LLAMA3, **_sizes(4096, 14336, 32, 32, 8), "rope_scaling": _LLAMA31_SCALING}, 8.03e9, 5e6),
    "llama-3.1-70b": ({**_LLAMA3, **_sizes(8192, 28672, 80, 64, 8), "rope_scaling": _LLAMA31_SCALING}, 70.6e9, 5e7),
    "llama-3.1-405b": ({**_LLAMA3, **_sizes(16384, 53248, 126, 128, 8), "rope_scaling": _LLAMA31_SCALING},
                       405.9e9, 5e7),
    "llama-3.2-1b": ({**_LLAMA3, **_sizes(2048, 8192, 16, 32, 8, head_dim=64), "tie_word_embeddings": True,
                      "rope_scaling": {**_LLAMA31_SCALING, "factor": 32.0}}, 1.24e9, 5e6),
    "llama-3.2-3b": ({**_LLAMA3, **_sizes(3072, 8192, 28, 24, 8, head_dim=128), "tie_word_embeddings": True,
                      "rope_scaling": {**_LLAMA31_SCALING, "factor": 32.0}}, 3.21e9, 5e6),
    # Qwen3's cards: 0.6B (0.44B non-embedding), 1.7B (1.4B), 4.0B (3.6B), 8.2B (6.95B), 14.8B (13.2B), 32.8B (31.2B)
    "qwen3-0.6b": ({**_QWEN3, **_sizes(1024, 3072, 28, 16, 8), "tie_word_embeddings": True}, 0.6e9, 5e7),
    "qwen3-1.7b": ({**_QWEN3, **_sizes(2048, 6144, 28, 16, 8), "tie_word_embeddings": True}, 1.7e9, 5e7),
    "qwen3-4b": ({**_QWEN3, **_sizes(2560, 9728, 36, 32, 8), "tie_word_embeddings": True}, 4.0e9, 5e7),
    "qwen3-8b": ({**_QWEN3, **_sizes(4096, 12288, 36, 32, 8), "tie_word_embeddings": False}, 8.2e9, 5e7),
    "qwen3-14b": ({**_QWEN3, **_sizes(5120, 17408, 40, 40, 8), "tie_word_embeddings": False}, 14.8e9, 5e7),
    "qwen3-32b": ({**_QWEN3, **_sizes(5120, 25600, 64, 64, 8), "tie_word_embeddings": False}, 32.8e9, 5e7),
    # Qwen3-30B-A3B's card: 30.5B in all, 3.3B activated
    "qwen3-30b-a3b": ({**_QWEN3_MOE, **_sizes(2048, 6144, 48, 32, 4)}, 30.5e9, 5e7),
    "gemma-2b": ({**_GEMMA, **_sizes(2048, 16384, 18, 8, 1)}, 2.51e9, 5e6),
    "gemma-7b": ({**_GEMMA, **_sizes(3072, 24576, 28, 16, 16)}, 8.54e9, 5e6),
    "gemma-2-2b": ({**_GEMMA2, **_sizes(2304, 9216, 26, 8, 4)}, 2.61e9, 5e6),
    "gemma-2-9b": ({**_GEMMA2, **_sizes(3584, 14336, 42, 16, 8)}, 9.24e9, 5e6),
    "gemma-2-27b": ({**_GEMMA2, **_sizes(4608, 36864, 46, 32, 16, head_dim=128, query_pre_attn_scalar=144)},
                    27.2e9, 5e7),
    "gemma-3-270m": ({**_GEMMA3, **_sizes(640, 2048, 18, 4, 1)}, 268e6, 5e5),
    "gemma-3-1b": ({**_GEMMA3, **_sizes(1152, 6912, 26, 4, 1)}, 1.0e9, 5e7),
    # The multimodal cards count the 0.4B vision tower too (4.3B, 12.2B, 27.4B); the text model alone:
    "gemma-3-4b": ({**_GEMMA3_MM, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
                   3.88e9, 5e6),
    "gemma-3-12b": ({**_GEMMA3_MM, **_sizes(3840, 15360, 48, 16, 8)}, 11.77e9, 5e6),
    "gemma-3-27b": ({**_GEMMA3_MM, **_sizes(5376, 21504, 62, 32, 16, head_dim=128, query_pre_attn_scalar=168)},
                    27.01e9, 5e6),
    "smollm2-135m": ({**_SMOLLM2, **_sizes(576, 1536, 30, 9, 3)}, 134.5e6, 5e4),
    "smollm2-360m": ({**_SMOLLM2, **_sizes(960, 2560, 32, 15, 5)}, 362e6, 5e5),
    "smollm2-1.7b": ({**_SMOLLM2, **_sizes(2048, 8192, 24, 32, 32), "rope_theta": 130000.0}, 1.71e9, 5e6),
    # Granite 3.1's cards: 2.5B and 8.1B (8,170,848,256)
    "granite-3.1-2b": ({**_GRANITE, "hidden_size": 2048, "intermediate_size": 8192, "attention_multiplier": 0.015625,
                        "logits_scaling": 8.0}, 2.53e9, 5e6),
    "granite-3.1-8b": ({**_GRANITE, "hidden_size": 4096, "intermediate_size": 12800,
                        "attention_multiplier": 0.0078125, "logits_scaling": 16.0}, 8.17e9, 5e6),
    "smollm3-3b": ({**_SMOLLM3, **_sizes(2048, 11008, 36, 16, 4)}, 3.08e9, 5e6),
    # Phi-3's cards: mini 3.8B, medium 14B
    "phi-3-mini-4k": ({**_PHI3, **_sizes(3072, 8192, 32, 32, 32)}, 3.8e9, 5e7),
    "phi-3-medium-4k": ({**_PHI3, **_sizes(5120, 17920, 40, 40, 10)}, 14.0e9, 5e7),
    # Phi-4-mini's card: 3.8B (3,836,021,760: the figure commonly quoted, and transformers' own count below)
    "phi-4-mini": (_PHI4_MINI, 3836021760, 0),
    # OLMo 2's cards: 7B (7.30B) and 13B (13.7B)
    "olmo-2-7b": ({**_OLMO2, **_sizes(4096, 11008, 32, 32, 32)}, 7.3e9, 5e7),
    "olmo-2-13b": ({**_OLMO2, **_sizes(5120, 13824, 40, 40, 40)}, 13.7e9, 5e7),
}


def _hf_published(name: str) -> dict:
    """The published config.json; the 4B+ Gemma 3 completed with Gemma3TextConfig's defaults (as it loads)."""
    data = dict(PUBLISHED[name][0])
    if name in ("gemma-3-4b", "gemma-3-12b", "gemma-3-27b"):
        transformers = pytest.importorskip("transformers")
        cls = transformers.Gemma3TextConfig
        full = cls(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")}).to_dict()
        data = {**{k: full[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "max_position_embeddings", "query_pre_attn_scalar", "rope_theta",
                                        "rope_local_base_freq", "rms_norm_eps", "bos_token_id", "eos_token_id",
                                        "pad_token_id", "attn_logit_softcapping", "final_logit_softcapping",
                                        "hidden_activation", "tie_word_embeddings")}, **data}
    return data


def _same(a, b) -> None:
    strip = lambda c: dataclasses.replace(c, name="", source="")  # noqa: E731
    assert strip(a) == strip(b)


def test_every_new_preset_has_its_published_config():
    new = set(PUBLISHED)
    assert new <= set(PRESETS) and all(PRESET_SOURCES.get(n) for n in new)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_config_reads_as_the_preset(name):
    _same(config_from_hf(_hf_published(name)), PRESETS[name])


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_preset_round_trips_through_its_config_json(name):
    cfg = PRESETS[name]
    _same(config_from_hf(config_to_hf(cfg)), cfg)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_total_is_near_the_model_cards_figure(name):
    _, figure, rounding = PUBLISHED[name]
    assert abs(count_params(PRESETS[name]).total - figure) <= rounding


def _transformers_count(data: dict) -> int:
    """transformers' own num_parameters() of the config, its model built on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = {k: v for k, v in data.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg = transformers.AutoConfig.for_model(data["model_type"], **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == data["architectures"][0]
    return model.num_parameters()


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_count_equals_transformers_num_parameters(name):
    start = time.perf_counter()
    assert count_params(PRESETS[name]).total == _transformers_count(_hf_published(name))
    assert time.perf_counter() - start < 60  # the meta device: even the 405B builds in seconds


def test_negative_a_one_unit_change_is_seen():
    """The comparison can fail: one FFN row more in transformers' config is 3 x n2 x n8 parameters apart."""
    data = {**_hf_published("smollm2-135m"), "intermediate_size": 1537}
    assert _transformers_count(data) - count_params(PRESETS["smollm2-135m"]).total == 3 * 576 * 30


def test_aliases_people_type():
    for alias, target in {"llama3.1-8b": "llama-3.1-8b", "Llama-3.2-1B": "llama-3.2-1b", "Qwen3-0.6B": "qwen3-0.6b",
                          "gemma-3-1b-pt": "gemma-3-1b", "gemma2-9b": "gemma-2-9b",
                          "SmolLM2-135M": "smollm2-135m", "granite-3.1-8b-instruct": "granite-3.1-8b",
                          "SmolLM3-3B": "smollm3-3b", "qwen3-30b-a3b": "qwen3-30b-a3b",
                          "Qwen3-30B-A3B": "qwen3-30b-a3b", "Phi-4-mini-instruct": "phi-4-mini",
                          "phi4-mini": "phi-4-mini"}.items():
        assert get_preset(alias) is PRESETS[target]
    assert all(a == a.lower() and "/" not in a for a in ALIASES)  # a "/" reads as a path (looks_like_path)
    assert PRESET_SOURCES["qwen3-30b-a3b"] == "Qwen/Qwen3-30B-A3B"  # the HF id, where the other Qwen3 ids are


def test_phi4_mini_rotates_96_of_128_channels_with_48_factors():
    """Partial rotary: int(128 x 0.75) = 96 channels turn, so longrope's lists hold 48 factors; the parameters are
    those of whole heads (RoPE has none), 3,836,021,760 in all, the embedding counted once (tied)."""
    cfg = PRESETS["phi-4-mini"]
    assert (cfg.head_dim, cfg.rotary_dim, cfg.partial_rotary) == (128, 96, True)
    assert len(cfg.rope_scaling.short_factor) == len(cfg.rope_scaling.long_factor) == 48
    assert config_to_hf(cfg)["partial_rotary_factor"] == 0.75
    assert count_params(cfg).total == 3836021760 == count_params(cfg.replace(rotary_dim=0, rope_scaling=None)).total


def test_qwen3_moe_active_parameters_are_the_cards():
    """Qwen3-30B-A3B's card: 3.3B activated (8 of 128 experts a token); ours, embedding and lm_head included,
    3.353B, so the card's figure is held to 0.1B (one expert more a token is 0.23B more)."""
    assert abs(count_params(PRESETS["qwen3-30b-a3b"]).active_per_token - 3.3e9) <= 1e8
