"""Our model against an independent implementation: HF transformers on the same weights.

Each case builds a small random HF model, saves it with `save_pretrained` (HF's own writer, HF's own
config.json), loads it with `load_model(DIR)` and compares fp32 logits (max abs difference < 1e-5) and
greedy generations token by token. q/k/v/o weights are scaled up so that attention scores are O(1):
with a default init, attention barely moves the output and a wrong RoPE could still pass (the last
test proves that this one cannot).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.load import read_checkpoint  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from llama_tools.inference.generation import generate  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def rope_kwargs(params: dict) -> dict:
    """transformers 5 nests rope_theta and the scaling under rope_parameters; 4.x takes rope_theta, rope_scaling."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": params}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": None if scaling["rope_type"] == "default" else scaling}


CASES = {
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                                                          attention_bias=True)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                          **rope_kwargs(LLAMA3_ROPE))),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                                   sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      tie_word_embeddings=True,
                                                      **rope_kwargs({"rope_type": "default", "rope_theta": 1e6}))),
}
IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])


def hf_model(case: str, directory):
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**SIZES, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj")):
                p.mul_(10.0)  # attention scores O(1): RoPE and masking decide the output
            elif any(k in name for k in ("v_proj", "o_proj")):
                p.mul_(5.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)  # HF inits biases to 0: make them count
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_generation_match_transformers(tmp_path, case):
    hf = hf_model(case, tmp_path)
    ours = load_model(tmp_path)
    theta = (getattr(hf.config, "rope_parameters", None) or {}).get("rope_theta") or hf.config.rope_theta
    assert ours.cfg.rope_theta == theta
    assert (ours.cfg.rope_scaling is not None) == (case == "llama-gqa")
    with torch.no_grad():
        expected = hf(IDS).logits
        got = ours(IDS).logits
    assert got.shape == expected.shape == (1, IDS.shape[1], SIZES["vocab_size"])
    assert got.dtype == expected.dtype == torch.float32
    assert expected.std() > 0.05  # the logits are not all near zero: the comparison means something
    assert (got - expected).abs().max().item() < 1e-5

    prompt = IDS[0, :6].tolist()
    with torch.no_grad():
        hf_ids = hf.generate(IDS[:, :6], max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 6:].tolist()
    out = generate(ours, prompt, max_new_tokens=12)
    assert len(hf_ids) == 12 and out.new_ids == hf_ids


def test_the_comparison_catches_a_wrong_rope_and_a_missing_window(tmp_path):
    """Negative cases: the same weights with the other RoPE layout, or without the sliding window, differ."""
    hf = hf_model("mistral-window", tmp_path)
    with torch.no_grad():
        expected = hf(IDS).logits
    ck = read_checkpoint(tmp_path)
    for cfg in (ck.cfg.replace(rope_layout="interleaved"), ck.cfg.replace(sliding_window=None)):
        wrong = model_from_state(cfg, ck.state, torch.float32)
        with torch.no_grad():
            assert (wrong(IDS).logits - expected).abs().max().item() > 1e-3


def test_sharded_bf16_save_pretrained(tmp_path):
    """HF's own sharded writer (index + 0000x-of-0000y files) with bf16 weights, loaded with --dtype casting."""
    hf = hf_model("llama-gqa", tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="100KB")
    assert len(list((tmp_path / "bf16").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path / "bf16")  # float32 by default: bf16 values upcast exactly
    assert ours.cfg.torch_dtype == "bfloat16" and ours.lm_head.weight.dtype == torch.float32
    # HF's own reader, in fp32 (hf.float() would keep a bf16-rounded rotary inv_freq buffer).
    reloaded = type(hf).from_pretrained(tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reloaded(IDS).logits  # the same bf16-rounded weights, in fp32
        assert (ours(IDS).logits - expected).abs().max().item() < 1e-5
    assert load_model(tmp_path / "bf16", dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16
