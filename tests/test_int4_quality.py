"""export --quantize int4 ends with a quality line measured against the full-precision graph, and warns past it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from llama_tools.cli import cli
from llama_tools.exporters.quantize import QUALITY_WARN_KL, quick_quality
from llama_tools.modeling.presets import get_preset


def _export(tmp_path, name="int4"):
    out = tmp_path / name / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(out), "--quantize", "int4", "--format", "json",
                                 "--no-client-files"])
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout), r.stderr


def test_the_quality_line_is_kl_and_top1_against_the_full_graph(tmp_path):
    out, rep, err = _export(tmp_path)
    q = rep["int4_quality"]
    assert q["on"] == "a built-in English text" and q["tokens"] > 50  # tiny ships a tokenizer
    assert 0 < q["mean_kl"] < QUALITY_WARN_KL and 0.5 < q["top1"] <= 1  # a good int4 of tiny: no warning
    assert "warning" not in err


def _logits(path, ids):
    import onnxruntime as ort

    cfg = get_preset("tiny")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    arr = np.array([ids], np.int64)
    feeds = {i.name: (arr if i.name == "input_ids" else np.ones_like(arr) if i.name == "attention_mask"
                      else np.arange(len(ids))[None] if i.name == "position_ids"
                      else np.zeros([1, cfg.num_key_value_heads, 0, cfg.head_dim], np.float32))
             for i in sess.get_inputs()}
    return sess.run(["logits"], feeds)[0][0].astype(np.float64)  # [n, n1]


def test_quick_quality_by_hand_and_a_bad_graph_warns(tmp_path, monkeypatch):
    """KL and top-1 recomputed in numpy from the two graphs' logits; a graph with one weight scaled x3 warns."""
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.quantize import quantize_int4

    cfg = get_preset("tiny")
    full, int4 = tmp_path / "full.onnx", tmp_path / "int4.onnx"
    export_fused("tiny", full)
    quantize_int4(full, int4)
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, size=40).tolist()
    q = quick_quality(full, int4, cfg, ids, "ids")
    p, r = _logits(full, ids), _logits(int4, ids)
    lp = p - np.log(np.exp(p - p.max(-1, keepdims=True)).sum(-1, keepdims=True)) - p.max(-1, keepdims=True)
    lr = r - np.log(np.exp(r - r.max(-1, keepdims=True)).sum(-1, keepdims=True)) - r.max(-1, keepdims=True)
    kl = (np.exp(lp) * (lp - lr)).sum(-1).mean()
    # quick_quality runs the int4 graph a few positions at a time through its KV cache (here 40 at once, then 7):
    # the same numbers up to fp32's order of summation, far below any KL that matters.
    assert q.tokens == 40 and abs(q.mean_kl - kl) < 1e-6 and q.top1 == (p.argmax(-1) == r.argmax(-1)).mean()
    import llama_tools.exporters.quantize as quantize

    assert quantize.prefill_chunk(cfg.vocab_size) >= 40 and quantize.prefill_chunk(262144) == 8
    monkeypatch.setattr(quantize, "PREFILL_CHUNK", 7)
    q7 = quick_quality(full, int4, cfg, ids, "ids")
    assert abs(q7.mean_kl - kl) < 1e-6 and q7.top1 == q.top1
    assert q.warning is None
    # Negative: a graph whose lm_head is scaled x3 (sharper and shifted distributions) is far past the line.
    m = onnx.load(str(full))
    for t in m.graph.initializer:
        if t.name == "lm_head.MatMul.weight":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 30, t.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    worse = quick_quality(full, bad, cfg, ids, "ids")
    assert worse.mean_kl > QUALITY_WARN_KL and worse.warning and "mean KL" in worse.warning


@pytest.mark.slow
def test_a_trained_models_int4_warns(smollm2_hf, tmp_path):
    """SmolLM2-135M's round-to-nearest int4 loses answers (" Paris." becomes " capital of France."): the export
    says so."""
    out = tmp_path / "int4" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(smollm2_hf), "-o", str(out), "--quantize", "int4",
                                 "--int4-algorithm", "rtn", "--max-kl", "none", "--format", "json",
                                 "--no-client-files"])
    assert r.exit_code == 0, r.output
    q = json.loads(r.stdout)["int4_quality"]
    assert q["mean_kl"] > QUALITY_WARN_KL and "warning: int4 moves this model's answers" in r.stderr


def test_quantizer_options_reach_the_graph(tmp_path):
    out = tmp_path / "v" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(out), "--quantize", "int4", "--int4-block-size",
                                 "64", "--int4-asymmetric", "--int4-keep", "/lm_head/MatMul", "--no-client-files",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    q = json.loads(r.stdout)["quantized"]
    assert (q["block_size"], q["symmetric"], q["left_fp"]) == (64, False, ["/lm_head/MatMul"])
    nodes = onnx.load(str(out)).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert nbits and all(a["block_size"] == 64 for a in attrs)
    four = [n for n, a in zip(nbits, attrs) if a["bits"] == 4]  # the target may keep some 8-bit (symmetric)
    assert four and all(len(n.input) == 4 for n in four)  # zero points
    assert [n.name for n in nodes if n.op_type == "MatMul" and n.name == "/lm_head/MatMul"] == ["/lm_head/MatMul"]


@pytest.mark.parametrize("argv, says", [
    (["--int4-block-size", "64"], "go with --quantize int4"),
    (["--quantize", "int4", "--int4-block-size", "48"], "not a power of two"),
    (["--quantize", "int4", "--int4-accuracy-level", "5"], "--int4-accuracy-level"),
    (["--quantize", "int4", "--int4-keep", "/nope"], "--int4-keep '/nope' is not a MatMul"),
])
def test_bad_quantizer_options_are_one_line(argv, says, tmp_path):
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "m.onnx"), *argv])
    assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output, r.output
    assert not list(tmp_path.iterdir())  # nothing of ours left


def test_the_perplexity_changes_standard_error_by_hand():
    """ppl_change_se is the delta method's: exp(mean d) * sd(d) / sqrt(n) of the per-token NLL changes d."""
    from llama_tools.exporters.quantize import kl_and_nll, kl_and_ppl, ppl_change_se

    ref = np.zeros(3)
    # d = [0, 0.2]: mean 0.1, sd (n - 1) 0.2 / sqrt(2), so SE = exp(0.1) * 0.1
    assert ppl_change_se(ref[:2], np.array([0.0, 0.2])) == pytest.approx(np.exp(0.1) * 0.1, rel=1e-12)
    assert ppl_change_se(ref[:2], np.array([0.3, 0.3])) == 0  # one shift on every token: no spread
    # Four times the tokens with the same spread: half the error.
    d = np.array([0.0, 0.2, 0.1, -0.1])
    one, four = ppl_change_se(np.zeros(4), d), ppl_change_se(np.zeros(16), np.tile(d, 4))
    assert four == pytest.approx(one / 2 * np.sqrt(3 / 15 * 4), rel=1e-12)  # sd(ddof=1) of 4 vs 16 copies
    # kl_and_nll's NLLs are the ones kl_and_ppl's perplexities average.
    rng = np.random.default_rng(0)
    a, b, ids = rng.normal(size=(6, 11)), rng.normal(size=(6, 11)), rng.integers(0, 11, 6)
    kl, nll_a, nll_b = kl_and_nll(a, b, ids)
    assert kl.shape == nll_a.shape == (5,)
    kl2, ppl_a, ppl_b = kl_and_ppl(a, b, ids)
    assert np.array_equal(kl, kl2) and ppl_a == pytest.approx(np.exp(nll_a.mean()))
    p = np.exp(a[2] - a[2].max()) / np.exp(a[2] - a[2].max()).sum()
    assert nll_a[2] == pytest.approx(-np.log(p[ids[3]]))  # position 2 predicts ids[3]
