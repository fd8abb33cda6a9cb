"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM: a tiny seeded model saved by transformers, read by us.

Each case is a 2-layer model (n2 64, 8 experts of width 32, top 2) built from a seed by transformers, its router,
expert, attention and norm weights moved off their initial values, and written by `save_pretrained` (HF's writer,
HF's config.json and tensor names: mlp.gate, mlp.experts.e.gate_proj). Our fp32 logits must equal transformers'
eager fp32 logits, with norm_topk_prob both true and false; the negative case shows the comparison sees a flipped
norm_topk_prob. Configs with dense layers among the sparse ones (decoder_sparse_step, mlp_only_layers) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3MoeForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3MoeForCausalLM", allow_module_level=True)

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf, load_config  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from llama_tools.modeling.weights import weight_specs  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])  # [1, 14]


def perturb(model) -> None:
    """Every weight off its initial value: norms around 1 with spread, matrices at unit gain (q/k at 3x), the router
    at 4x so that routing is decisive and differs between tokens."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        else:
            gain = 3.0 if any(k in name for k in ("q_proj", "k_proj")) else 4.0 if name.endswith("mlp.gate.weight") \
                else 1.0
            p.normal_(0.0, gain / p.shape[1] ** 0.5)


def hf_qwen3_moe(directory: Path, norm_topk_prob: bool):
    """The transformers model, seeded and perturbed, saved to DIRECTORY by transformers itself."""
    config = transformers.Qwen3MoeConfig(**SIZES, norm_topk_prob=norm_topk_prob, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        perturb(model)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk_prob", "no_norm_topk_prob"])
def case(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"qwen3moe-{request.param}")
    hf = hf_qwen3_moe(d, request.param)
    with torch.no_grad():
        expected = hf(IDS).logits  # [1, 14, 256]
    return request.param, d, hf, expected


def test_the_checkpoint_holds_qwen3_moe_names(case):
    """transformers' own file names the router and experts as Qwen3-MoE does, and every name is one we expect."""
    _, d, hf, _ = case
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "model.layers.1.mlp.gate.weight" in stored
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored
    cfg = load_config(d)
    assert {s.hf_name for s in weight_specs(cfg)} == stored


def test_logits_equal_transformers(case):
    norm_topk_prob, d, hf, expected = case
    ours = load_model(d)
    assert ours.cfg.family == "qwen3_moe" and ours.cfg.norm_topk_prob is norm_topk_prob
    assert ours.cfg.num_experts == 8 and ours.cfg.moe_intermediate_size == 32 and ours.cfg.qk_norm
    with torch.no_grad():
        got = ours(IDS).logits
    assert got.shape == expected.shape == (1, IDS.shape[1], SIZES["vocab_size"])
    assert got.dtype == expected.dtype == torch.float32
    assert expected.std() > 0.1
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_routing_is_not_degenerate(case):
    """The tokens go to different experts (else a misrouted expert could hide): at least 4 of 8 are chosen."""
    _, _, hf, _ = case
    with torch.no_grad():
        out = hf(IDS, output_router_logits=True)
    chosen = torch.topk(out.router_logits[0], SIZES["num_experts_per_tok"], dim=-1).indices  # [14, 2]
    assert len(set(chosen.flatten().tolist())) >= 4


def test_negative_flipped_norm_topk_prob_changes_the_logits(case):
    """The comparison can fail: the same weights with norm_topk_prob flipped are far from transformers' logits."""
    norm_topk_prob, d, _, expected = case
    ours = load_model(d)
    flipped = model_from_state(ours.cfg.replace(norm_topk_prob=not norm_topk_prob), ours.state_dict(), torch.float32)
    with torch.no_grad():
        got = flipped(IDS).logits
    assert (got - expected).abs().max().item() > 1e-2


def test_count_params_is_transformers_count(case):
    _, d, hf, _ = case
    r = CliRunner().invoke(cli, ["count-params", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)[0]["total"] == sum(p.numel() for p in hf.parameters())


def test_the_config_round_trips_and_transformers_reads_ours(case, tmp_path):
    """config_to_hf writes what transformers builds the same model from, and what we read back unchanged."""
    _, d, hf, _ = case
    cfg = load_config(d)
    data = config_to_hf(cfg)
    back = config_from_hf(data)
    assert back.replace(name=cfg.name, source=cfg.source) == cfg
    theirs = transformers.AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items()
                                                                        if k not in ("model_type", "architectures")})
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim"):
        assert getattr(theirs, key) == getattr(hf.config, key), key


def _config(tmp_path: Path, **changes) -> Path:
    data = {**config_to_hf(load_config("qwen3-30b-a3b")), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("changes, key", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0, 5]}, "mlp_only_layers"),
])
def test_dense_layers_among_the_sparse_are_refused(tmp_path, changes, key):
    path = _config(tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        load_config(path)
    message = str(e.value)
    assert "\n" not in message and f"field {key!r}" in message and "every layer" in message
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    assert r.exit_code != 0 and key in r.output


def test_every_layer_sparse_is_read(tmp_path):
    """The published form (step 1, no dense layers, said explicitly) reads as the preset."""
    cfg = load_config(_config(tmp_path, decoder_sparse_step=1, mlp_only_layers=[]))
    assert cfg.replace(name="", source="") == load_config("qwen3-30b-a3b").replace(name="", source="")


def test_export_and_verify_parity_against_transformers(case, tmp_path):
    """`export onnx --optimize` writes the plain graph (the fused one has no experts), said in a note; `verify parity`
    reads the checkpoint as transformers does (its source check) and the graph as PyTorch computes it: PASS."""
    _, d, _, _ = case
    out = tmp_path / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(d), "-o", str(out), "--optimize", "--format", "json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["graph"] == "plain" and any("mixture of experts" in n for n in rep["notes"])
    r = CliRunner().invoke(cli, ["verify", "parity", str(out), "--source", str(d)])
    assert r.exit_code == 0, r.output
    source = next(line for line in r.output.splitlines() if line.startswith("source check:"))
    assert "transformers" in source and "agrees in all" in source
    assert r.output.strip().splitlines()[-1].startswith("PASS")


def test_generate_and_onnxruntime_genai_give_transformers_greedy_tokens(case, tmp_path):
    """`generate` on the checkpoint, and onnxruntime-genai on its export (the plain graph and the client files
    `export onnx` writes beside it), decode transformers' own greedy tokens."""
    _, d, hf, _ = case
    want = hf.generate(IDS, max_new_tokens=6, do_sample=False,
                       attention_mask=torch.ones_like(IDS))[0, IDS.shape[1]:].tolist()
    assert len(want) == 6
    r = CliRunner().invoke(cli, ["generate", str(d), "--ids", " ".join(map(str, IDS[0].tolist())),
                                 "--max-new-tokens", "6", "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)["new_ids"] == want
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    from helpers import genai_greedy

    out = tmp_path / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(d), "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output[-800:]
    assert genai_greedy(tmp_path, IDS[0].tolist(), 6) == want
