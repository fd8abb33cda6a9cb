"""The fused graph (`export onnx --optimize`) of GPT-NeoX (Pythia) and Falcon blocks: LayerNorm / SkipLayerNormalization
with β, GroupQueryAttention on the packed [all q | all k | all v] projection with its bias, a GELU MLP with biases
(onnxruntime's BiasGelu / Gelu, exact erf as transformers' "gelu"), attention and MLP in parallel or in sequence.
The packed QKV's rows are our reader's q, k, v (GPT-NeoX's per-head and Falcon's per-KV-head rows already
regrouped when the checkpoint is read, formats.py) stacked as [all q | all k | all v], GroupQueryAttention's order.

Every layout of tests/neox_block.py's LAYOUTS (2 layers, n2 64, 4 heads of 16, norms and biases off their initial
values): Pythia's partial rotary 0.25 and 0.5 (our RoPE node: GroupQueryAttention's rotary needs a width that is a
multiple of 16), Falcon-7B's multi-query with one norm, new_decoder_architecture's two norms and 2 KV heads, and
the sequential forms. One more NeoX model with heads of 64 at rotary_pct 0.25 (16 channels) puts the partial rotary in
GroupQueryAttention itself. Checked against transformers 4.57's own GPTNeoXForCausalLM / FalconForCausalLM: the
graph's logits, `verify parity` (with its source check; --by-layer) and a planted fault it names, onnxruntime-genai's
greedy tokens, and int4 RTN on the fused graph scoring no worse in `verify int4` than on the plain graph. Negative
cases: the tanh GELU in place of the erf one, and a fault planted in the final norm's gain.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from helpers import genai_greedy  # noqa: E402
from neox_block import (IDS, LAYOUTS, SIZES, build, hf_class, hf_greedy, make_case,  # noqa: E402
                        planted_verdict, run)


# The fused graph's fp32 logits against transformers' eager fp32, in units of the largest logit (max(1, |logit|)):
# measured 7e-7..1.7e-6 on every layout here (max |diff| 3.0e-6..6.9e-6 on logits up to 4.4; onnxruntime's fused
# kernels sum in another order than torch). 1e-5 leaves 6x room; tanh GELU for erf is past it (below).
LOGIT_RTOL = 1e-5
# Pythia-like heads of 64 with rotary_pct 0.25: 16 rotated channels, the partial rotary GroupQueryAttention rotates.
GQA_ROTARY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=128, use_parallel_residual=True, rotary_pct=0.25, intermediate_size=256)
CASES = [*LAYOUTS, "neox-gqa-rotary"]


def _case(name: str, tmp_path_factory):
    if name != "neox-gqa-rotary":
        return make_case(name, tmp_path_factory)
    d = tmp_path_factory.mktemp(name)
    hf = build(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**GQA_ROTARY), d)
    with torch.no_grad():
        expected = hf(IDS).logits
    return name, d, hf, expected


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    """(name, checkpoint directory, the transformers model, its logits on IDS)."""
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def fused(case, tmp_path_factory):
    """`export onnx --optimize`: the fused graph now, no note of a fallback."""
    name, d, _, _ = case
    path = tmp_path_factory.mktemp(f"{name}-fused") / "model.onnx"
    r = run("export", "onnx", str(d), "-o", str(path), "--optimize", "--format", "json")
    assert r.exit_code == 0, r.output[-1500:]
    rep = json.loads(r.output)
    assert rep["graph"] == "fused" and not any("plain graph" in n for n in rep["notes"]), rep["notes"]
    return path


def _logits(path: Path, kv_heads: int, head_dim: int) -> np.ndarray:
    """The graph's prefill logits on IDS, cache empty: [1, 14, 256]."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = IDS.numpy()
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    for i in sess.get_inputs()[3:]:
        feeds[i.name] = np.zeros((1, kv_heads, 0, head_dim), np.float32)  # [batch, kv_heads, past 0, n6]
    return sess.run(["logits"], feeds)[0]


def _json(output: str) -> dict:
    """The JSON report in a CLI's output, past any warning lines before it."""
    return json.loads(output[output.index("{"):])


def _geometry(name: str) -> tuple[int, int, int]:
    """(KV heads, head_dim, rotary width) of a case."""
    if name == "neox-gqa-rotary":
        return 2, 64, 16
    return LAYOUTS[name].kv, SIZES["hidden_size"] // SIZES["num_attention_heads"], LAYOUTS[name].rotary


def _ops(path: Path) -> dict[str, dict]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return {n.name: n for n in m.graph.node}


def test_the_fused_graph_holds_the_layernorm_gelu_block(case, fused):
    """LayerNorm with β, GroupQueryAttention on one packed QKV, the GELU MLP with its bias in the GELU node; the parallel
    block's MLP reads the layer's input normed; RoPE in GQA where the rotary width allows."""
    name, d, _, _ = case
    nodes = _ops(fused)
    kinds = {n.op_type for n in nodes.values()}
    assert {"GroupQueryAttention", "SkipLayerNormalization", "LayerNormalization"} <= kinds
    assert not kinds & {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Sigmoid", "Split"}
    parallel = name == "neox-gqa-rotary" or LAYOUTS[name].parallel
    shared = name != "neox-gqa-rotary" and LAYOUTS[name].shared
    # parallel: Y^j = Z^j + R^j a plain Add, the MLP reading norm(Z^j) (Falcon-7B: the attention's own normed input)
    assert ("/model/layers.0/residual_add/Add" in nodes) == parallel
    assert ("/model/layers.0/post_attention_layernorm/LayerNormalization" in nodes) == (parallel and not shared)
    assert ("/model/layers.0/post_attention_layernorm/SkipLayerNormalization" in nodes) == (not parallel)
    bias = name.startswith("neox") or LAYOUTS[name].config.get("bias", False)
    assert nodes["/model/layers.0/mlp/act_fn/" + ("BiasGelu" if bias else "Gelu")].domain == "com.microsoft"
    gqa = nodes["/model/layers.0/self_attn/GroupQueryAttention"]
    attrs = {a.name: a.i for a in gqa.attribute}
    kv, hd, rotary = _geometry(name)
    assert attrs["kv_num_heads"] == kv
    assert attrs["do_rotary"] == int(rotary % 16 == 0)  # else our RoPE node rotates the packed q and k heads
    assert ("/model/layers.0/self_attn/rope_qk" in nodes) == (rotary % 16 != 0)


def test_the_fused_logits_equal_transformers(case, fused):
    name, _, _, expected = case
    kv, hd, _ = _geometry(name)
    got = _logits(fused, kv, hd)
    scale = max(1.0, expected.abs().max().item())
    assert np.abs(got - expected.numpy()).max() <= LOGIT_RTOL * scale


@pytest.mark.parametrize("by_layer", [False, True], ids=["default", "by_layer"])
def test_verify_parity_passes_with_the_source_check_and_names_a_planted_fault(case, fused, by_layer):
    _, d, _, _ = case
    r = run("verify", "parity", str(fused), "--source", str(d), "-q", "--format", "json",
            *(["--by-layer"] if by_layer else []))
    assert r.exit_code == 0, r.output[-2500:]
    data = json.loads(r.output)
    assert data["passed"] and data["source_check"]["checked"]
    # layer 1's down_proj x (1 + 1e-3): named at layer 1 by either mode (the whole check: by the logits after it)
    v = planted_verdict(fused, d, "layers" if by_layer else "auto")
    assert not v.passed and v.first_bad == "layer 1", v.first_bad


def test_negative_the_final_layernorm_gain_off_fails_verify(case, fused):
    """bench_faults' final-norm fault on a LayerNorm (γ and β both [n2]): its γ x (1 + 1e-3) fails the whole check."""
    _, d, _, _ = case
    assert not planted_verdict(fused, d, "whole", "final-norm").passed


def test_negative_the_tanh_gelu_in_place_of_erf_is_far(case, fused, tmp_path):
    """The comparison sees which GELU runs: FastGelu (tanh) where the model's GELU is exact erf moves the logits past
    the bound (measured 7.6e-5 of the largest logit at the least, falcon-sequential: tanh and erf GELU differ by
    at most ~2e-4 per unit)."""
    import onnx

    name, _, _, expected = case
    m = onnx.load(str(fused))
    for n in m.graph.node:
        if n.op_type in ("Gelu", "BiasGelu"):
            n.op_type = "FastGelu"  # FastGelu(x, bias) = tanh-GELU(x + bias): the same inputs as BiasGelu
    onnx.save(m, str(tmp_path / "tanh.onnx"))
    kv, hd, _ = _geometry(name)
    got = _logits(tmp_path / "tanh.onnx", kv, hd)
    off = np.abs(got - expected.numpy()).max() / max(1.0, expected.abs().max().item())
    print(name, off)
    assert off > LOGIT_RTOL, off


def test_onnxruntime_genai_runs_the_fused_graph_with_transformers_tokens(case, fused):
    pytest.importorskip("onnxruntime_genai")
    _, _, hf, _ = case
    assert genai_greedy(fused.parent, IDS[0].tolist(), 6) == hf_greedy(hf, 6)


@pytest.mark.parametrize("name", ["neox-parallel", "falcon-multi_query", "falcon-sequential"])
def test_int4_rtn_on_the_fused_graph_runs_and_is_no_worse_than_on_the_plain_graph(name, tmp_path_factory):
    """The same matrices rounded the same way (blocks run along each output column's inputs, which packing q, k, v
    side by side does not change): `verify int4`'s KL on the fused graph within a hair of the plain graph's, top-1 as
    good."""
    from llama_tools.exporters.quantize import quantize_int4

    _, d, _, _ = _case(name, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"{name}-int4")
    r = run("export", "onnx", str(d), "-o", str(out / "fused" / "model.onnx"), "-q", "--quantize", "int4",
            "--max-kl", "none", "--int4-algorithm", "rtn", "--format", "json")
    assert r.exit_code == 0, r.output[-1500:]
    assert _json(r.output)["graph"] == "fused"  # after its quality warning line, if any
    r = run("export", "onnx", str(d), "-o", str(out / "plain-fp32" / "model.onnx"), "-q", "--no-client-files")
    assert r.exit_code == 0, r.output[-1500:]
    (out / "plain").mkdir()
    quantize_int4(out / "plain-fp32" / "model.onnx", out / "plain" / "model.onnx", algorithm="rtn")
    kl = {}
    for graph in ("fused", "plain"):
        r = run("verify", "int4", str(out / graph / "model.onnx"), "--source", str(d), "--steps", "8",
                "--provider", "cpu", "--format", "json")
        assert r.exit_code in (0, 1), r.output[-1500:]
        kl[graph] = _json(r.output)
    print({g: {k: v for k, v in rep.items() if not isinstance(v, (list, dict))} for g, rep in kl.items()})
    # neox-parallel measured mean KL 0.0868419273 (fused) against 0.0868419206 (plain), top-1 50% both: the same
    # int4 weights, summed in another order. 0.1% of room is noise's; a matrix rounded otherwise moves KL by far more.
    f, p = (kl[g]["mean_kl"] for g in ("fused", "plain"))
    assert f <= p * 1.001 + 1e-6, (f, p)
    assert kl["fused"]["top1_agreement"] >= kl["plain"]["top1_agreement"]
