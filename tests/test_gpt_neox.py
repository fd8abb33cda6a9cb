"""GPT-NeoX (Pythia): what is its own against transformers' GPTNeoXConfig and GPTNeoXForCausalLM.

Its layouts (tests/neox_block.py's LAYOUTS: Pythia's parallel block at rotary_pct 0.25, a sequential one at 0.5
without attention biases) are read as transformers lays them out, their stored names are the ones we predict, and the
Pythia presets count as transformers does. What GPT-NeoX shares with Falcon (logits, greedy tokens, the streamed
reference, count, round trip, export, verify parity, onnxruntime-genai, int4, negative cases) is in
tests/test_neox_falcon.py; GGUF (llama.cpp's gptneox) in tests/test_gguf_neox_falcon_moe.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llama_tools.checkpoints.config_files import config_from_hf, load_config  # noqa: E402
from llama_tools.checkpoints.formats import checkpoint_tensors  # noqa: E402
from llama_tools.counting.accounting import count_params  # noqa: E402
from llama_tools.modeling.presets import get_preset  # noqa: E402
from neox_block import LAYOUTS, family_layouts, make_case  # noqa: E402


@pytest.fixture(scope="module", params=family_layouts("gpt_neox"))
def case(request, tmp_path_factory):
    """(layout name, directory, the transformers model, its logits on IDS)."""
    return make_case(request.param, tmp_path_factory)


def test_the_config_is_read_as_gpt_neox_lays_it_out(case):
    name, d, hf, _ = case
    cfg = load_config(d)
    rotary, parallel = LAYOUTS[name].rotary, LAYOUTS[name].parallel
    assert cfg.family == "gpt_neox" and cfg.norm_kind == "layer" and not cfg.gated_mlp and cfg.hidden_act == "gelu"
    assert (cfg.rotary_dim, cfg.parallel_residual, cfg.shared_norm) == (rotary, parallel, False)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and not cfg.tie_word_embeddings
    assert cfg.qkv_bias == cfg.o_bias == hf.config.attention_bias and cfg.mlp_bias


def test_the_checkpoint_holds_gpt_neox_names(case):
    """transformers' own file: every stored name is one we predict, shapes included (q/k/v packed, biases too)."""
    _, d, _, _ = case
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    predicted = {t.name: t.shape for t in checkpoint_tensors(load_config(d))}
    assert predicted == stored
    assert "gpt_neox.layers.1.attention.query_key_value.weight" in stored and "embed_out.weight" in stored


# --- The presets -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset, sizes, truth", [
    ("pythia-160m", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
     162_322_944),
    ("pythia-1b", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8),
     1_011_781_632),
])
def test_the_pythia_presets_count_as_transformers_does(preset, sizes, truth):
    """Each preset against transformers' own count of EleutherAI's published config on the meta device."""
    published = dict(vocab_size=50304, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                     layer_norm_eps=1e-5, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=False, **sizes)
    with torch.device("meta"):
        hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**published))
    assert sum(p.numel() for p in hf.parameters()) == truth  # the model card's figure
    assert count_params(get_preset(preset)).total == truth
    read = config_from_hf({**published, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                           "torch_dtype": "float16"})
    assert read.replace(name=preset, source=preset) == get_preset(preset)
