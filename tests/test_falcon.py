"""Falcon: what is its own against transformers' FalconConfig and FalconForCausalLM.

Its layouts (tests/neox_block.py's LAYOUTS: Falcon-7B's multi_query with one shared norm, new_decoder_architecture's
ln_attn and ln_mlp with 2 KV heads, a sequential one) are read as transformers lays them out, their stored names are
the ones we predict, ALiBi and layouts transformers cannot run are refused in one line, and the falcon-7b preset
counts as transformers does. What Falcon shares with GPT-NeoX (logits, greedy tokens, the streamed reference, count,
round trip, export, verify parity, onnxruntime-genai, int4, negative cases) is in tests/test_neox_falcon.py; GGUF
(llama.cpp's falcon) in tests/test_gguf_neox_falcon_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf, load_config  # noqa: E402
from llama_tools.checkpoints.formats import checkpoint_tensors  # noqa: E402
from llama_tools.counting.accounting import count_params  # noqa: E402
from llama_tools.modeling.presets import get_preset  # noqa: E402
from neox_block import SIZES, LAYOUTS, family_layouts, make_case, one_line_error, run  # noqa: E402


@pytest.fixture(scope="module", params=family_layouts("falcon"))
def case(request, tmp_path_factory):
    """(layout name, directory, the transformers model, its logits on IDS)."""
    return make_case(request.param, tmp_path_factory)


def test_the_config_is_read_as_falcon_lays_it_out(case):
    name, d, hf, _ = case
    cfg = load_config(d)
    layout = LAYOUTS[name]
    kv, parallel, shared = layout.kv, layout.parallel, layout.shared
    assert cfg.family == "falcon" and cfg.norm_kind == "layer" and not cfg.gated_mlp and cfg.hidden_act == "gelu"
    assert (cfg.num_key_value_heads, cfg.parallel_residual, cfg.shared_norm) == (kv, parallel, shared)
    assert cfg.intermediate_size == 4 * SIZES["hidden_size"] and cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias == hf.config.bias


def test_the_checkpoint_holds_falcon_names(case):
    """transformers' own file: every stored name is one we predict, shapes included (q/k/v packed, biases too)."""
    _, d, _, _ = case
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    predicted = {t.name: t.shape for t in checkpoint_tensors(load_config(d))}
    assert predicted == stored
    assert "transformer.h.1.self_attention.query_key_value.weight" in stored


# --- Refusals and the preset -----------------------------------------------------------------------------------

def _config(tmp_path: Path, **changes) -> Path:
    data = {**config_to_hf(get_preset("falcon-7b")), **changes}
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path / "config.json"


@pytest.mark.parametrize("changes, named", [
    ({"alibi": True}, "'alibi'"),
    ({"new_decoder_architecture": True, "parallel_attn": False}, "'parallel_attn' false"),
    ({"multi_query": False, "num_kv_heads": 8}, "'num_kv_heads'"),
    ({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 3}, "'num_ln_in_parallel_attn'"),
])
def test_what_falcon_does_not_compute_is_refused_in_one_line(tmp_path, changes, named):
    path = _config(tmp_path, **changes)
    text = one_line_error(run("count-params", str(path)))
    assert str(path) in text and named in text


def test_the_falcon_7b_preset_counts_as_transformers_does():
    """The preset against transformers' own count of tiiuae/falcon-7b's published config on the meta device."""
    published = dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                     multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False,
                     bos_token_id=11, eos_token_id=11, layer_norm_epsilon=1e-5)
    with torch.device("meta"):
        hf = transformers.FalconForCausalLM(transformers.FalconConfig(**published))
    truth = sum(p.numel() for p in hf.parameters())
    assert truth == 6_921_720_704  # the model card's 7B
    assert count_params(get_preset("falcon-7b")).total == truth
    assert config_from_hf({**published, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}).replace(
        name="falcon-7b", source="falcon-7b", torch_dtype=get_preset("falcon-7b").torch_dtype) == get_preset("falcon-7b")
