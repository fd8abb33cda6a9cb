"""GPT-NeoX (Pythia) and Falcon against transformers' own GPTNeoXForCausalLM and FalconForCausalLM: what both
families share, run on every layout of each (tests/neox_block.py's LAYOUTS).

Each a 2-layer model (n2 64, 4 heads of 16) whose LayerNorm gains and biases and every Linear bias are off their
initial values, written by `save_pretrained`. Our fp32 logits equal transformers' eager fp32 logits, greedy tokens
equal, the streamed reference too, count-params equals its count, `convert --to hf` round-trips through transformers;
the plain export passes verify parity (whole graph, with the source check, --by-layer) and a planted fault fails it
(named at layer 1); onnxruntime-genai gives transformers' tokens; RTN and the default int4 export, whose
sensitivities rank the matrices as transformers with each alone in int4 does. Negative cases show the
comparison sees a sequential block read as parallel (and the reverse) and a LayerNorm without its β. What is one
family's own (its config keys, stored names, presets, refusals) is in tests/test_gpt_neox.py and tests/test_falcon.py;
GGUF in tests/test_gguf_neox_falcon_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import load_config  # noqa: E402
from llama_tools.inference.reference import StreamedReference  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from helpers import genai_greedy  # noqa: E402
from neox_block import (IDS, LAYOUTS, assert_logits_equal, far, greedy_ids, hf_class, hf_greedy,  # noqa: E402
                        make_case, one_line_error, planted_verdict, run)



@pytest.fixture(scope="module", params=list(LAYOUTS))
def case(request, tmp_path_factory):
    """(layout name, directory, the transformers model, its logits on IDS)."""
    return make_case(request.param, tmp_path_factory)


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
    _, d, _, expected = case
    ours = load_model(d)
    cfg, state = ours.cfg, dict(ours.state_dict())
    if cfg.parallel_residual:
        flipped = cfg.replace(parallel_residual=False, shared_norm=False)
        if cfg.shared_norm:  # the sequential form's second norm: Falcon-7B's one norm's weights
            for j in range(cfg.num_hidden_layers):
                layer = f"model.layers.{j}."
                for p in ("weight", "bias"):
                    state[f"{layer}post_attention_layernorm.{p}"] = state[f"{layer}input_layernorm.{p}"]
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
    name, d, hf, expected = case
    r = run("convert", str(d), str(tmp_path / "out"), "--to", "hf")
    assert r.exit_code == 0, r.output[-800:]
    again = hf_class(LAYOUTS[name].family).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, expected)
    back = load_config(tmp_path / "out")
    assert back.replace(name="x", source="") == load_config(d).replace(name="x", source="")


@pytest.fixture(scope="module")
def graph(case, tmp_path_factory):
    """The plain export (the fused one, --optimize, is tests/test_fused_neox_falcon.py's)."""
    name, d, _, _ = case
    path = tmp_path_factory.mktemp(f"{name}-onnx") / "model.onnx"
    r = run("export", "onnx", str(d), "-o", str(path))
    assert r.exit_code == 0, r.output[-1500:]
    return path


def test_the_export_passes_verify_parity_whole_and_a_fault_fails_it(case, graph):
    _, d, _, _ = case
    r = run("verify", "parity", str(graph), "--source", str(d), "-q", "--no-source-check", "--checks", "whole",
            "--format", "json")
    assert r.exit_code == 0, r.output[-2500:]
    assert json.loads(r.output)["passed"]
    assert not planted_verdict(graph, d, "whole").passed


@pytest.mark.parametrize("by_layer", [False, True], ids=["default", "by_layer"])
def test_the_export_passes_verify_parity_with_the_source_check_and_a_fault_is_named(case, graph, by_layer):
    _, d, _, _ = case
    r = run("verify", "parity", str(graph), "--source", str(d), "-q", "--format", "json",
            *(["--by-layer"] if by_layer else []))
    assert r.exit_code == 0, r.output[-2500:]
    data = json.loads(r.output)
    assert data["passed"] and data["source_check"]["checked"]
    v = planted_verdict(graph, d, "layers" if by_layer else "auto")
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


def test_int4_round_to_nearest_and_the_default_target_export(case, tmp_path):
    """Plain RTN int4, and the default (awq blocks, the KL target): its passes run a parallel block as one unit, so
    every matrix gets a sensitivity and the graph built is the one it chose."""
    name, d, _, _ = case
    r = run("export", "onnx", str(d), "-o", str(tmp_path / "rtn" / "model.onnx"), "-q", "--quantize", "int4",
            "--max-kl", "none", "--int4-algorithm", "rtn")
    assert r.exit_code == 0, r.output[-1500:]
    r = run("export", "onnx", str(d), "-o", str(tmp_path / "t" / "model.onnx"), "-q", "--quantize", "int4",
            "--format", "json")
    assert r.exit_code == 0, r.output[-1500:]
    target = json.loads(r.stdout)["int4_target"]  # stderr may hold the quality warning of a random model
    assert target["rounds"] and len(target["sensitivity"]) >= 4 * 2 and all(v > 0 for v in target["sensitivity"].values())


def test_the_sensitivities_rank_matrices_as_transformers_with_each_alone_in_int4(case):
    """The target's forward and backward passes (one unit per parallel block) against transformers' own model with
    each matrix alone fake-quantized to 2 bits, its logits' KL from the clean ones (the truth at any order; a row's
    blocks are its own, so quantizing transformers' packed query_key_value is quantizing our q, k, v): ranked alike
    and within a factor; a shuffled assignment is not (the check can fail)."""
    import numpy as np

    import llama_tools.exporters.int4_target as t

    name, d, hf, _ = case
    hf_names = {"qkv_proj": "query_key_value", "o_proj": "dense", "up_proj": "dense_h_to_4h",
                "down_proj": "dense_4h_to_h"}
    nodes = [f"/model/layers.{j}/{mod}/{proj}/MatMul" for j in range(2)
             for mod, proj in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "up_proj"),
                               ("mlp", "down_proj"))]
    mats = t.matrices(nodes)
    ref = StreamedReference(d)
    ids = IDS[0].tolist() * 3  # [42]
    quant = lambda w: t.fake_quant(w, 2, 16)  # noqa: E731  (2-bit: moves large enough to tell them apart)
    old = t.TOP_K
    t.TOP_K = ref.cfg.vocab_size  # a random model's mass is spread: every token a candidate
    try:
        got = t.sensitivities(ref, ids, mats, 16, emulate=lambda w, node, rows=None: quant(w))
    finally:
        t.TOP_K = old
    assert set(got) == set(nodes) and all(v > 0 for v in got.values())
    layers = hf.gpt_neox.layers if LAYOUTS[name].family == "gpt_neox" else hf.transformer.h
    x = torch.tensor([ids])
    truth = {}
    with torch.no_grad():
        clean = torch.log_softmax(hf(x).logits.double(), -1)
        for m in mats:
            block = layers[m.layer]
            owner = getattr(block, "attention", None) or getattr(block, "self_attention", None) \
                if m.module == "self_attn" else block.mlp
            lin = getattr(owner, hf_names[m.node.split("/")[4]])
            saved = lin.weight.data.clone()
            lin.weight.data = quant(saved)
            lq = torch.log_softmax(hf(x).logits.double(), -1)
            truth[m.node] = float((clean.exp() * (clean - lq)).sum(-1).mean())
            lin.weight.data = saved
    keys = sorted(got)
    a, b = np.log([truth[k] for k in keys]), np.log([got[k] for k in keys])
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    assert np.corrcoef(rank(a), rank(b))[0, 1] >= 0.7, (truth, got)
    assert np.all(np.abs(b - a) <= np.log(4)), (truth, got)
    shuffled = b[[5, 3, 7, 0, 6, 1, 4, 2]]
    assert np.corrcoef(rank(a), rank(shuffled))[0, 1] < 0.7
