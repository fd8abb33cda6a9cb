"""bf16 graphs judged on the CPU: fp32 arithmetic rounded to bf16 after every op (exporters/emulation.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from llama_tools.cli import cli
from llama_tools.exporters.emulation import emulate_bf16, is_bf16_graph
from llama_tools.exporters.runtime import EMULATED_BF16, create_session


def _bf16(a: np.ndarray, name: str) -> TensorProto:
    bits = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy()
    t = helper.make_tensor(name, TensorProto.BFLOAT16, a.shape, bits.tobytes(), raw=True)
    return t


def test_each_op_is_rounded_as_torch_rounds_bf16():
    """y = relu(x W + b) in bf16: the emulated graph gives torch's bf16 result of each op, to 1 bf16 ulp (the
    matmul's accumulation order), and the unrounded fp32 graph does not (the rounding is really there)."""
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"), helper.make_node("Add", ["xw", "b"], ["s"],
             name="add"), helper.make_node("Relu", ["s"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [None, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [None, 32])],
                          initializer=[_bf16(w, "w"), _bf16(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    assert is_bf16_graph(m)
    em = emulate_bf16(m)
    assert not is_bf16_graph(em) and sum(n.op_type == "Cast" for n in em.graph.node) == 6  # 3 ops x 2 casts
    import onnxruntime as ort

    x = rng.standard_normal((8, 64)).astype(np.float32)
    xb = torch.from_numpy(x).bfloat16()
    want = torch.relu(xb @ torch.from_numpy(w).bfloat16() + torch.from_numpy(b).bfloat16()).float().numpy()
    got = ort.InferenceSession(em.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": xb.float().numpy()})[0]
    ulp = np.abs(want) * 2.0 ** -7 + 1e-30
    assert got.dtype == np.float32 and got.shape == (8, 32)
    assert np.all(np.abs(got - want) <= ulp), np.abs(got - want).max()
    assert np.array_equal(got, torch.from_numpy(got).bfloat16().float().numpy()), "outputs are bf16 values"
    exact = np.maximum(xb.float().numpy() @ torch.from_numpy(w).bfloat16().float().numpy()
                       + torch.from_numpy(b).bfloat16().float().numpy(), 0)
    assert not np.array_equal(got, exact), "without the rounding the fp32 result would differ"


@pytest.mark.parametrize("optimize", [False, True])
def test_a_bf16_export_is_judged_on_the_cpu_and_a_fault_fails(tmp_path, optimize):
    out = tmp_path / "model.onnx"
    args = ["export", "onnx", "tiny", "-o", str(out), "--dtype", "bfloat16", "-q", "--no-client-files"]
    assert CliRunner().invoke(cli, args + (["--optimize"] if optimize else [])).exit_code == 0
    assert create_session(out, "cpu").note.endswith(EMULATED_BF16)
    r = CliRunner().invoke(cli, ["verify", "parity", str(out), "--provider", "cpu", "--checks", "whole", "--format", "json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["passed"] and EMULATED_BF16 in rep["provider_note"], rep.get("provider_note")
    logits = next(c for c in rep["checks"] if c["name"] == "logits")
    assert 0.3 < logits["ratio"] < 3, logits  # as PyTorch's own bf16: the emulation is no better, no worse

    # Negative: layer 0's V projection x1.1 (the packed qkv in the fused graph) fails, at layer 0's V. bf16's
    # budget is 8x its own noise (2^-8 per op), so a fault must clear that: x1.05 on the last down_proj does not.
    m = onnx.load(str(out))
    t = next(t for t in m.graph.initializer if "layers.0.self_attn" in t.name and "v_proj" in t.name)
    bits = np.frombuffer(t.raw_data, np.int16).copy()
    scaled = (torch.from_numpy(bits).view(torch.bfloat16).float() * 1.1).bfloat16().view(torch.int16).numpy()
    t.raw_data = scaled.tobytes()
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    r = CliRunner().invoke(cli, ["verify", "parity", str(bad), "--provider", "cpu", "--source", "tiny",
                                 "--checks", "whole", "--format", "json"])
    assert r.exit_code == 1, r.output
    failed = [c["name"] for c in json.loads(r.stdout)["checks"] if not c["passed"]]
    assert "present.0.value" in failed, failed


def test_by_layer_runs_bf16_blocks_emulated_and_locates_a_fault(tmp_path):
    """--by-layer cuts bf16 blocks the CPU cannot run: each runs emulated, fed its input rounded to bf16."""
    out = tmp_path / "model.onnx"
    assert CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(out), "--dtype", "bfloat16", "-q",
                                    "--no-client-files"]).exit_code == 0
    r = CliRunner().invoke(cli, ["verify", "parity", str(out), "--by-layer", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert EMULATED_BF16 in json.loads(r.stdout)["notes"]
    m = onnx.load(str(out))
    t = next(t for t in m.graph.initializer if "layers.0.self_attn" in t.name and "v_proj" in t.name)
    bits = np.frombuffer(t.raw_data, np.int16).copy()
    t.raw_data = (torch.from_numpy(bits).view(torch.bfloat16).float() * 1.1).bfloat16().view(torch.int16).numpy().tobytes()
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    r = CliRunner().invoke(cli, ["verify", "parity", str(bad), "--by-layer", "--source", "tiny", "--format", "json"])
    assert r.exit_code == 1, r.output
    assert "layer 0" in r.output or '"layer": 0' in r.stdout or "present.0.value" in r.stdout, r.stdout[:500]
