"""Int4 to a KL target: the int4 emulation against onnxruntime's kernel, the graph's matrices placed in the model,
the selection loop on hand-made figures, and the whole path on a seeded model (kept matrices really 8-bit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from llama_tools.exporters.int4_target import HEAD, Matrix, choose, fake_quant, matrices, plan

logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32])
def test_fake_quant_is_onnxruntime_matmulnbits(bits, block):
    """The emulation equals the weight onnxruntime's MatMulNBits multiplies by (read back through an identity)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    k, n = 96, 40
    w = np.random.default_rng(bits + block).standard_normal((k, n)).astype(np.float32)  # MatMul's [in, out]
    w[:block, 0] = 0.0  # an all-zero block: scale 0
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
                              initializer=[numpy_helper.from_array(w, "W")])
    q = mnq.MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                 block_size=block, is_symmetric=True, bits=bits, accuracy_level=0)
    q.process()
    session = ort.InferenceSession(q.model.model.SerializeToString(), providers=["CPUExecutionProvider"])
    held = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]  # [in, out]: the dequantized weight
    ours = fake_quant(torch.from_numpy(w.T.copy()), bits, block).numpy().T  # nn.Linear's [out, in] in, [in, out] back
    assert ours.shape == held.shape and ours.dtype == held.dtype
    np.testing.assert_allclose(ours, held, rtol=0, atol=1e-6)
    assert np.abs(held - w).max() > (1e-3 if bits == 8 else 1e-2)  # it is quantized: the check can fail
    assert not np.allclose(fake_quant(torch.from_numpy(w.T.copy()), 12 - bits, block).numpy().T, held, atol=1e-6)


def test_matrices_place_every_projection():
    nodes = ["/model/layers.0/self_attn/qkv_proj/MatMul", "/model/layers.0/mlp/gate_up_proj/MatMul",
             "/model/layers.3/self_attn/o_proj/MatMul", "/model/layers.12/mlp/down_proj/MatMul", HEAD,
             "/model/layers.1/self_attn/k_proj/MatMul"]
    got = matrices(nodes)
    assert got[0] == Matrix(nodes[0], 0, "self_attn", ("q_proj", "k_proj", "v_proj"))
    assert got[1] == Matrix(nodes[1], 0, "mlp", ("gate_proj", "up_proj"))
    assert got[2].parts == ("o_proj",) and got[3].layer == 12 and got[4].layer is None and got[5].parts == ("k_proj",)
    with pytest.raises(ValueError, match="experts"):
        matrices(["/model/layers.0/block_sparse_moe/experts.0/w1/MatMul"])


def test_plan_keeps_the_largest_predicted_until_the_rest_fits():
    sens = {"a": 0.001, "b": 0.004, HEAD: 0.003, "c": 0.0005}
    # alpha 10: predicted a .01, b .04, head .03, c .005 -> total .085; 0.7 * 0.05 = .035: keep b (.045 left), then
    # head (.015 left) and stop.
    assert plan(sens, 10.0, 0.05) == ["b", HEAD]
    assert plan(sens, 10.0, 1.0) == []
    assert set(plan(sens, 10.0, 1e-9)) == set(sens)


def test_choose_measures_until_the_target_holds():
    """A made-up graph whose KL is the sum of its int4 matrices' true costs, three times what s_m predicts."""
    true = {"m0": 0.05, "m1": 0.02, "m2": 0.01, "m3": 0.001, HEAD: 0.04}
    sens = {n: v / 3 for n, v in true.items()}  # each matrix's KL alone, a third of what it costs in company
    built = []

    def build(kept):
        built.append(list(kept))
        return sum(v for n, v in true.items() if n not in kept), 100 + 10 * len(kept)
    r = choose(sens, 0.015, build)
    assert r.met and r.rounds[-1].measured_kl <= 0.015 and built[0] == []
    assert set(r.kept_8bit) >= {"m0", HEAD, "m1"} and "m3" not in r.kept_8bit, r.kept_8bit
    assert [x.measured_kl for x in r.rounds] == [sum(v for n, v in true.items() if n not in k) for k in built]
    # An unreachable target: every matrix 8-bit at last, and said not met.
    never = choose(sens, 1e-6, lambda kept: (0.001, 1))
    assert not never.met and set(never.kept_8bit) == set(sens)


def test_target_on_a_seeded_model(tmp_path):
    """The whole path: the kept matrices are 8-bit MatMulNBits in the graph, and the measured KL meets the target."""
    import onnx

    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import mean_kl, onnx_logits, quantize_to_target, reference_logits
    from llama_tools.reference import reference_model
    from llama_tools.source import resolve

    src = resolve("tiny")
    full = tmp_path / "full" / "model.onnx"
    export_fused(src, full)
    ref = reference_model(src)
    everything = quantize_to_target(full, tmp_path / "all" / "model.onnx", ref, None, 1e3, {})[1]
    assert everything.met and everything.kept_8bit == [] and len(everything.rounds) == 1
    loose = everything.rounds[0].measured_kl
    q, r = quantize_to_target(full, tmp_path / "q" / "model.onnx", ref, None, loose / 4, {})
    graph = onnx.load(str(q.path), load_external_data=False).graph
    bits = {n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits")  # the quantizer's name: +_Q4
            for n in graph.node if n.op_type == "MatMulNBits"}
    assert set(r.kept_8bit) and all(bits[n] == 8 for n in r.kept_8bit)
    assert all(b == 4 for n, b in bits.items() if n not in r.kept_8bit)
    assert r.met and r.calibration_kl <= loose / 4
    ids = np.random.default_rng(1).integers(3, src.cfg.vocab_size, size=64).tolist()
    assert r.calibration_kl == pytest.approx(mean_kl(reference_logits(ref, ids), onnx_logits(q.path, src.cfg, ids)),
                                             rel=1e-6)
    assert q.bytes_after > everything.rounds[0].bytes  # 8-bit costs bytes
    with pytest.raises(ValueError, match="--max-kl"):
        quantize_to_target(full, tmp_path / "bad" / "model.onnx", ref, None, float("nan"), {})


def test_cli_max_kl(tmp_path):
    """`export onnx --quantize int4 --max-kl`: the target's rows and JSON; refused without --quantize and at 0."""
    import json

    from click.testing import CliRunner

    from llama_tools.cli import cli

    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "q" / "model.onnx"), "--quantize",
                                 "int4", "--max-kl", "0.0001", "-q", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    t = out["int4_target"]
    assert t["max_kl"] == 0.0001 and len(t["rounds"]) >= 2 and t["rounds"][0]["kept"] == 0
    assert t["met"] == (t["rounds"][-1]["measured_kl"] <= 0.0001) and t["kept_8bit"]
    assert out["quantized"]["kept_8bit"] == t["kept_8bit"]
    for bad, why in ((["--max-kl", "0.1"], "--quantize int4"), (["--quantize", "int4", "--max-kl", "0"], "--max-kl")):
        r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "b" / "model.onnx"), *bad])
        assert r.exit_code != 0 and why in r.output, r.output
        assert not (tmp_path / "b").exists()
