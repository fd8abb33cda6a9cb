"""Falcon against transformers' own FalconForCausalLM: tiny seeded models saved by transformers, read by us.

Three layouts, each a 2-layer model (n2 64, 4 heads of 16) whose LayerNorm gains and biases and every Linear bias
are off their initial values (tests/neox_block.py), written by `save_pretrained`:
  - multi_query: one input_layernorm feeding attention and MLP in parallel, one KV head (Falcon-7B's layout), biases;
  - new_decoder_architecture: ln_attn and ln_mlp in parallel, 2 KV heads grouped with their query heads, no biases;
  - sequential: parallel_attn false, q/k/v one per head, input_layernorm then post_attention_layernorm, biases.
Our fp32 logits equal transformers' eager fp32 logits, greedy tokens equal, count-params equals its count, the
plain export passes verify parity (whole graph and --by-layer) and names a planted fault; negative cases show the
comparison sees a sequential block read as parallel and a LayerNorm without its β. ALiBi and layouts transformers
cannot run are refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf, load_config  # noqa: E402
from llama_tools.checkpoints.formats import checkpoint_tensors  # noqa: E402
from llama_tools.counting.accounting import count_params  # noqa: E402
from llama_tools.inference.reference import StreamedReference  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from llama_tools.modeling.presets import get_preset  # noqa: E402
from helpers import genai_greedy  # noqa: E402
from neox_block import (IDS, SIZES, assert_logits_equal, build, far, greedy_ids, hf_greedy, one_line_error,  # noqa: E402
                        run)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "bench_faults.py")
bf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_faults", bf)
_spec.loader.exec_module(bf)

CASES = {  # name: (FalconConfig keywords, our kv heads, parallel, one shared norm)
    "multi_query": (dict(multi_query=True, parallel_attn=True, bias=True), 1, True, True),
    "new_decoder": (dict(new_decoder_architecture=True, num_kv_heads=2, bias=False), 2, True, False),
    "sequential": (dict(multi_query=False, parallel_attn=False, bias=True), 4, False, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, directory, the transformers model, its logits on IDS)."""
    d = tmp_path_factory.mktemp(f"falcon-{request.param}")
    config = transformers.FalconConfig(**SIZES, **CASES[request.param][0])
    hf = build(transformers.FalconForCausalLM, config, d)
    with torch.no_grad():
        expected = hf(IDS).logits  # [1, 14, 256]
    return request.param, d, hf, expected


def test_the_config_is_read_as_falcon_lays_it_out(case):
    name, d, hf, _ = case
    cfg = load_config(d)
    _, kv, parallel, shared = CASES[name]
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


def test_logits_and_greedy_tokens_equal_transformers(case):
    _, d, hf, expected = case
    with torch.no_grad():
        got = load_model(d)(IDS).logits
    assert_logits_equal(got, expected)
    assert greedy_ids(d) == hf_greedy(hf)


def test_the_streamed_reference_equals_transformers(case):
    """verify parity's reference (half a layer at a time; the parallel FFN reads the layer's input) agrees too."""
    _, d, _, expected = case
    with torch.no_grad():
        got = StreamedReference(d)(IDS).logits
    assert_logits_equal(got, expected)


def test_negative_the_block_read_in_the_other_form_is_far_off(case):
    """The comparison can fail: the same weights run sequentially instead of in parallel (or the reverse) are far
    from transformers' logits; so are LayerNorms whose β is dropped."""
    name, d, _, expected = case
    ours = load_model(d)
    cfg, state = ours.cfg, dict(ours.state_dict())
    if cfg.parallel_residual:
        flipped = cfg.replace(parallel_residual=False, shared_norm=False)
        if cfg.shared_norm:  # the sequential form's second norm: the one norm's weights
            for j in range(cfg.num_hidden_layers):
                for p in ("weight", "bias"):
                    state[f"model.layers.{j}.post_attention_layernorm.{p}"] = state[f"model.layers.{j}.input_layernorm.{p}"]
    else:
        flipped = cfg.replace(parallel_residual=True)
    with torch.no_grad():
        assert far(model_from_state(flipped, state, torch.float32)(IDS).logits, expected) > 1e-2
        no_beta = {k: torch.zeros_like(v) if k.endswith("norm.bias") else v for k, v in ours.state_dict().items()}
        assert far(model_from_state(cfg, no_beta, torch.float32)(IDS).logits, expected) > 1e-2


def test_count_params_is_transformers_count(case):
    _, d, hf, _ = case
    r = run("count-params", str(d), "--format", "json")
    assert r.exit_code == 0, r.output[-800:]
    data = json.loads(r.output)[0]
    assert data["total"] == sum(p.numel() for p in hf.parameters())
    assert data["paper_formula"] + sum(i["params"] for i in data["left_out"]) == data["total"]


def test_convert_to_hf_round_trips_through_transformers(case, tmp_path):
    """`convert --to hf` writes a checkpoint transformers reads back into the same model (the same logits)."""
    _, d, hf, expected = case
    r = run("convert", str(d), str(tmp_path / "out"), "--to", "hf")
    assert r.exit_code == 0, r.output[-800:]
    again = transformers.FalconForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, expected)
    back = load_config(tmp_path / "out")
    assert back.replace(name="x", source="") == load_config(d).replace(name="x", source="")


@pytest.fixture(scope="module")
def graph(case, tmp_path_factory):
    """The plain export (asked for --optimize: the fused graph builds LLaMA's block, so the plain one, noted)."""
    name, d, _, _ = case
    path = tmp_path_factory.mktemp(f"falcon-{name}-onnx") / "model.onnx"
    r = run("export", "onnx", str(d), "-o", str(path), "--optimize")
    assert r.exit_code == 0, r.output[-1500:]
    assert "the fused graph does not support falcon's block" in r.output and "wrote the plain graph" in r.output
    return path


def _planted(graph: Path, d: Path, mode: str):
    """verify's verdict on the export with layer 1's down_proj scaled by 1 + 1e-3 (bench_faults' "scale")."""
    from llama_tools.exporters.verification.parity import resolve_target
    from llama_tools.exporters.verification.verdict import parity_inputs, verify

    faulted = bf.plant(graph, "scale", resolve_target(str(graph), str(d)).source.cfg, 1)
    try:
        ft = resolve_target(str(faulted), str(d))
        return verify(ft, parity_inputs(ft, None, 2, None, 0), mode=mode, provider="cpu", steps=2, source_check=False)
    finally:
        faulted.unlink()


def test_the_export_passes_verify_parity_whole_and_a_fault_fails_it(case, graph):
    _, d, _, _ = case
    r = run("verify", "parity", str(graph), "--source", str(d), "-q", "--no-source-check", "--checks", "whole",
            "--format", "json")
    assert r.exit_code == 0, r.output[-2500:]
    assert json.loads(r.output)["passed"]
    assert not _planted(graph, d, "whole").passed


@pytest.mark.parametrize("by_layer", [False, True], ids=["default", "by_layer"])
def test_the_export_passes_verify_parity_with_the_source_check_and_a_fault_is_named(case, graph, by_layer):
    _, d, _, _ = case
    r = run("verify", "parity", str(graph), "--source", str(d), "-q", "--format", "json",
            *(["--by-layer"] if by_layer else []))
    assert r.exit_code == 0, r.output[-2500:]
    data = json.loads(r.output)
    assert data["passed"] and data["source_check"]["checked"]
    v = _planted(graph, d, "layers" if by_layer else "auto")
    assert not v.passed and v.first_bad == "layer 1", v.first_bad


def test_verify_source_agrees_with_transformers(case):
    _, d, _, _ = case
    r = run("verify", "source", str(d), "--random-ids", "2", "--format", "json")
    assert r.exit_code == 0, r.output[-2000:]
    assert json.loads(r.output)["checked"]


def test_onnxruntime_genai_runs_the_graph_with_transformers_tokens(case, graph):
    pytest.importorskip("onnxruntime_genai")
    _, _, hf, _ = case
    assert genai_greedy(graph.parent, IDS[0].tolist(), 6) == hf_greedy(hf, 6)


def test_int4_round_to_nearest_works_and_the_measured_passes_are_refused(case, tmp_path):
    """Plain RTN int4 needs no measurement; --max-kl's target and the searched algorithms measure attention and the
    FFN apart, which a parallel block does not allow: refused in one line naming the options."""
    name, d, _, _ = case
    r = run("export", "onnx", str(d), "-o", str(tmp_path / "rtn" / "model.onnx"), "-q", "--quantize", "int4",
            "--max-kl", "none", "--int4-algorithm", "rtn")
    assert r.exit_code == 0, r.output[-1500:]
    if CASES[name][2]:
        text = one_line_error(run("export", "onnx", str(d), "-o", str(tmp_path / "t" / "model.onnx"), "-q",
                                  "--quantize", "int4"))
        assert "--max-kl" in text and "parallel block" in text and "--int4-algorithm rtn" in text


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


def test_gguf_is_refused_naming_the_family(case, tmp_path):
    _, d, _, _ = case
    text = one_line_error(run("convert", str(d), str(tmp_path / "x.gguf"), "--to", "gguf"))
    assert "'falcon'" in text and "no GGUF architecture" in text


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
