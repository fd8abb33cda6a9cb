"""GPT-NeoX (Pythia) and Falcon against transformers' own GPTNeoXForCausalLM and FalconForCausalLM: what both
families share, run on every layout of each (tests/neox_block.py's LAYOUTS).

Each a 2-layer model (n2 64, 4 heads of 16) whose LayerNorm gains and biases and every Linear bias are off their
initial values, written by `save_pretrained`. Our fp32 logits equal transformers' eager fp32 logits, greedy tokens
equal, the streamed reference too, count-params equals its count, `convert --to hf` round-trips through transformers;
the plain export passes verify parity (whole graph, with the source check, --by-layer) and a planted fault fails it
(named at layer 1); onnxruntime-genai gives transformers' tokens; plain RTN int4 exports. Negative cases show the
comparison sees a sequential block read as parallel (and the reverse) and a LayerNorm without its β. What is one
family's own (its config keys, stored names, presets, refusals) is in tests/test_gpt_neox.py and tests/test_falcon.py;
GGUF in tests/test_gguf_neox_falcon_moe.py.
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
from llama_tools.checkpoints.config_files import load_config  # noqa: E402
from llama_tools.inference.reference import StreamedReference  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from helpers import genai_greedy  # noqa: E402
from neox_block import (IDS, LAYOUTS, assert_logits_equal, far, greedy_ids, hf_class, hf_greedy,  # noqa: E402
                        make_case, one_line_error, run)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "bench_faults.py")
bf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_faults", bf)
_spec.loader.exec_module(bf)


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
    """The plain export (asked for --optimize: the fused graph builds LLaMA's block, so the plain one, noted)."""
    name, d, _, _ = case
    path = tmp_path_factory.mktemp(f"{name}-onnx") / "model.onnx"
    r = run("export", "onnx", str(d), "-o", str(path), "--optimize")
    assert r.exit_code == 0, r.output[-1500:]
    family = LAYOUTS[name].family
    assert f"the fused graph does not support {family}'s block" in r.output and "wrote the plain graph" in r.output
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
    if LAYOUTS[name].parallel:
        text = one_line_error(run("export", "onnx", str(d), "-o", str(tmp_path / "t" / "model.onnx"), "-q",
                                  "--quantize", "int4"))
        assert "--max-kl" in text and "parallel block" in text and "--int4-algorithm rtn" in text
