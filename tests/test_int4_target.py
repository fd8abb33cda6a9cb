"""Int4 to a KL target: the int4 emulation against onnxruntime's kernel, the graph's matrices placed in the model,
the selection loop on hand-made figures, and the whole path on a seeded model (kept matrices really 8-bit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from llama_tools.exporters.int4_target import HEAD, Matrix, choose, fake_quant, matrices, plan
from llama_tools.exporters.quant_options import HEAD_FREQUENT, HEAD_PARTS, HEAD_REST

logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)


def _bits(path):
    """A graph's MatMulNBits by name (less the quantizer's _Q4/_Q8) -> its bits."""
    import onnx

    return {n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits")
            for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits"}


def _as_planned(bits, b):
    """The plan's names of the matrices at B bits: a split head's MatMulNBits are its parts, a whole head both."""
    out = []
    for name, got in bits.items():
        if got == b:
            part = name.rsplit("_", 1)[-1] if name.startswith(HEAD + "_") else None
            out += [f"{HEAD}:{part}"] if part else list(HEAD_PARTS) if name == HEAD else [name]
    return out


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

    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import mean_kl, onnx_logits, quantize_to_target, reference_logits
    from llama_tools.inference.reference import reference_model
    from llama_tools.checkpoints.source import resolve

    src = resolve("tiny")
    full = tmp_path / "full" / "model.onnx"
    export_fused(src, full)
    ref = reference_model(src)
    everything = quantize_to_target(full, tmp_path / "all" / "model.onnx", ref, None, 1e3, {})[1]
    assert everything.met and everything.kept_8bit == [] and len(everything.rounds) == 1
    loose = everything.rounds[0].measured_kl
    q, r = quantize_to_target(full, tmp_path / "q" / "model.onnx", ref, None, loose / 4, {})
    bits = _bits(q.path)
    assert set(r.kept_8bit) and sorted(_as_planned(bits, 8)) == sorted(r.kept_8bit)
    assert set(bits.values()) <= {4, 8} and not set(_as_planned(bits, 4)) & set(r.kept_8bit)
    assert r.met and r.calibration_kl <= loose / 4
    ids = np.random.default_rng(1).integers(3, src.cfg.vocab_size, size=64).tolist()
    # The loop's reference logits come from the sensitivity pass's final states, a position chunk at a time.
    assert r.calibration_kl == pytest.approx(mean_kl(reference_logits(ref, ids), onnx_logits(q.path, src.cfg, ids)),
                                             rel=1e-4)
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


# --- The default target: 0.1 nats or 0.6x the all-int4 graph's KL, the lower, under 1.08x the int4 bytes -------

def test_parse_max_kl():
    from llama_tools.exporters.quant_options import DEFAULT_TARGET, Int4Target, int4_target, parse_max_kl

    assert parse_max_kl("auto") == DEFAULT_TARGET == Int4Target(max_kl=0.1, fraction=0.6, size_cap=1.08)
    assert DEFAULT_TARGET.describe().startswith("mean KL <= the lower of 0.1 nats and 0.6x the all-int4 graph's")
    assert parse_max_kl("none") is None and parse_max_kl(" None ") is None
    assert parse_max_kl("0.1") == Int4Target(max_kl=0.1) and parse_max_kl(0.25) == Int4Target(max_kl=0.25)
    assert parse_max_kl("0.4x") == Int4Target(fraction=0.4)
    for bad in ("0", "-1", "nan", "inf", "11", "1x", "0x", "abc", "x", ""):
        with pytest.raises(ValueError, match="--max-kl"):
            parse_max_kl(bad)
    assert int4_target({}) == DEFAULT_TARGET and int4_target({"algorithm": "rtn"}) == DEFAULT_TARGET
    assert int4_target({"algorithm": "hqq"}) is None  # HQQ's own scales: no default target
    assert int4_target({"algorithm": "rtn", "symmetric": False}) is None  # asymmetric RTN: not emulated
    assert int4_target({"symmetric": False}) == DEFAULT_TARGET  # imatrix (the default) is asymmetric anyway
    assert int4_target({"algorithm": "hqq", "max_kl": 0.2}) == Int4Target(max_kl=0.2)
    assert int4_target({"max_kl": "none"}) is None and int4_target({"max_kl": None}) is None


def test_plan_with_costs_takes_the_most_kl_per_byte():
    sens = {"big": 0.03, "a": 0.02, "b": 0.01, "c": 0.001}
    cost = {"big": 100, "a": 10, "b": 10, "c": 10}
    # per byte: a .002, b .001, big .0003, c .0001; alpha 1, 0.7 * 0.03 = .021: a (.041 left), b (.031), big (.001)
    assert plan(sens, 1.0, 0.03, cost=cost) == ["a", "b", "big"]
    assert plan(sens, 1.0, 0.03, cost=cost, budget=50) == ["a", "b", "c"]  # big does not fit: skipped, c does
    assert plan(sens, 1.0, 0.03) == ["big", "a"]  # no costs: the fewest matrices


def test_choose_relative_target_under_a_size_cap():
    """The target is a fraction of the first graph's measured KL; no graph may pass the cap; when none within it
    meets the target, the closest one built is the answer, said not met."""
    true = {"m0": 0.05, "m1": 0.02, "m2": 0.01, "m3": 0.001, HEAD: 0.04}
    cost = {"m0": 10, "m1": 10, "m2": 10, "m3": 10, HEAD: 200}
    base = 1000

    def build(kept):
        return sum(v for n, v in true.items() if n not in kept), base + sum(cost[n] for n in kept)
    r = choose(true, None, build, fraction=0.5, cost=cost, size_cap=1.3)
    assert r.max_kl == pytest.approx(0.5 * sum(true.values())) and r.rounds[0].kept == 0
    assert r.met and r.calibration_kl <= r.max_kl and HEAD not in r.kept_8bit  # m0, m1 suffice, 20 bytes not 200
    assert all(x.bytes <= 1.3 * base for x in r.rounds)
    tight = choose(true, None, build, fraction=0.1, cost=cost, size_cap=1.03)  # 30 bytes: m0, m1, m2 at most
    assert not tight.met and set(tight.kept_8bit) == {"m0", "m1", "m2"}
    assert all(x.bytes <= 1.03 * base for x in tight.rounds)
    assert tight.calibration_kl == min(x.measured_kl for x in tight.rounds) == pytest.approx(0.041)
    free = choose(true, None, build, fraction=0.1, cost=cost)  # no cap: the head is kept
    assert free.met and HEAD in free.kept_8bit
    # nats and a fraction: the lower binds, whichever it is
    for nats, want in ((0.02, 0.02), (0.1, 0.5 * sum(true.values()))):
        both = choose(true, nats, build, fraction=0.5, cost=cost)
        assert both.max_kl == pytest.approx(want) and both.nats == nats and both.met
        assert both.calibration_kl <= want


def test_extra_bytes_are_what_8bit_adds(tmp_path):
    """extra_bytes against the files: the graph with one matrix 8-bit weighs that much more than all-int4."""
    import onnx

    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import extra_bytes
    from llama_tools.exporters.quantize import _weights_of, quantize_int4

    full = tmp_path / "full.onnx"
    export_fused("tiny", full)
    model = onnx.load(str(full), load_external_data=False)
    nodes = list(_weights_of(model))
    for algorithm, zero_points in (("rtn", False), ("imatrix", True)):  # imatrix's int4 has zero points, 8-bit none
        cost = extra_bytes(model, nodes, 32, zero_points)
        base = quantize_int4(full, tmp_path / "all.onnx", algorithm=algorithm).bytes_after
        parts = extra_bytes(model, [n for n in nodes if n != HEAD] + list(HEAD_PARTS), 32, zero_points)
        assert parts[HEAD_FREQUENT] + parts[HEAD_REST] == cost[HEAD] and 0 < parts[HEAD_FREQUENT] < cost[HEAD] / 5
        for node, want in (("/model/layers.0/mlp/down_proj/MatMul", cost), (HEAD, cost), (HEAD_FREQUENT, parts),
                           (HEAD_REST, parts)):
            grown = quantize_int4(full, tmp_path / "one.onnx", algorithm=algorithm, keep_8bit=(node,)).bytes_after - base
            # within 1% and a few initializers' own records (name, dims, where its bytes are): zero points gone
            assert want[node] > 0 and abs(grown - want[node]) <= 3 * 192 + want[node] // 100, (node, grown, want[node])
        assert cost[HEAD] != cost["/model/layers.0/mlp/down_proj/MatMul"]
    assert extra_bytes(model, nodes, 32, True) != extra_bytes(model, nodes, 32, False)


def _default_export(src, out, int4=None):
    from llama_tools.exporters.pipeline import export

    return export(src, out, quantize="int4", int4=int4, client_files=False)


def test_the_default_on_a_seeded_model(tmp_path):
    """No --max-kl: 0.1 nats or 0.6x the all-int4 graph's KL, the lower, within 1.08x the int4 bytes; where the cap
    binds (tiny: its error is spread thin), the closest graph within it, said not met. With room (1.3x) the target
    is met on the calibration text and on the held-out quality text; `none` is every matrix int4 (imatrix), the
    very graph the default started from."""
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.quant_options import Int4Target

    src = resolve("tiny")
    rep = _default_export(src, tmp_path / "d" / "model.onnx")
    t = rep.target
    assert t is not None and t.fraction == 0.6 and t.size_cap == 1.08 and t.nats == 0.1
    assert t.max_kl == pytest.approx(min(0.1, 0.6 * t.all_int4_kl)) and t.rounds[0].kept == 0
    assert rep.bytes <= t.size_cap * t.rounds[0].bytes and t.kept_8bit == rep.quantized.kept_8bit
    assert t.calibration_kl == min(r.measured_kl for r in t.rounds) < t.all_int4_kl  # the closest, and better
    assert t.importance_tokens > t.calibration_tokens  # awq's inputs: the whole corpus
    assert set(t.stage_seconds) == {"importance", "scales", "sensitivity", "graphs"}  # where the time went
    assert all(v >= 0 for v in t.stage_seconds.values()) and sum(t.stage_seconds.values()) == pytest.approx(t.seconds)
    assert t.met == (t.calibration_kl <= t.max_kl)
    assert sorted(_as_planned(_bits(rep.path), 8)) == sorted(t.kept_8bit)
    # the report names the int4 graph's weights file, not the full-precision one removed (a small graph: none)
    assert rep.result.external_data is None and not (rep.path.parent / (rep.path.name + ".data")).exists()
    roomy = _default_export(src, tmp_path / "r" / "model.onnx",
                            {"max_kl": Int4Target(max_kl=0.1, fraction=0.5, size_cap=1.3)})
    r = roomy.target
    assert r.met and r.calibration_kl <= r.max_kl and roomy.bytes <= 1.3 * r.rounds[0].bytes
    assert roomy.bytes > rep.bytes  # the cap is what held the default back
    plain = _default_export(src, tmp_path / "p" / "model.onnx", {"max_kl": "none"})
    assert plain.target is None and plain.quantized.kept_8bit == [] and plain.bytes == t.rounds[0].bytes
    assert plain.quality.mean_kl > r.max_kl  # the check can fail: all int4 does not meet the target
    # held out (the quality line's text, in no calibration passage): what the target asked of the calibration text,
    # half the all-int4 graph's KL, holds there too within a margin (measured 0.50x)
    assert roomy.quality.mean_kl < 0.7 * plain.quality.mean_kl
    hqq = _default_export(src, tmp_path / "h" / "model.onnx", {"algorithm": "hqq"})
    assert hqq.target is None  # HQQ: every matrix int4 unless a target is asked for


def test_a_bad_target_is_refused_before_the_work(tmp_path):
    from llama_tools.exporters import pipeline
    from llama_tools.checkpoints.source import resolve

    calls = []
    real = pipeline.export_fused
    pipeline.export_fused = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for bad in ("0.5y", "0", "2x"):
            with pytest.raises(ValueError, match="--max-kl"):
                _default_export(resolve("tiny"), tmp_path / "b" / "model.onnx", {"max_kl": bad})
    finally:
        pipeline.export_fused = real
    assert not calls and not (tmp_path / "b").exists()


def test_the_default_written_through_a_device(tmp_path):
    """A graph written through (here /dev/null) cannot be read back: the candidates are built beside the full graph,
    the chosen one written last."""
    import json

    from click.testing import CliRunner

    from llama_tools.cli import cli

    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", "/dev/null", "--quantize", "int4", "-q",
                                 "--max-kl", "0.5x", "--format", "json"])  # no cap: met after a few graphs
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["int4_target"]
    assert t["fraction"] == 0.5 and t["met"] and len(t["rounds"]) >= 2
    assert t["importance_tokens"] > t["calibration_tokens"] > 0  # awq's inputs measured on the whole corpus
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", "/dev/null", "--quantize", "int4", "-q",
                                 "--max-kl", "0.5x"])
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if line.startswith("int4 target"))
    assert f"on {t['calibration_tokens']} calibration tokens (inputs measured on {t['importance_tokens']:,})" in row


@pytest.mark.slow
def test_the_default_on_smollm2(smollm2_hf, tmp_path):
    """SmolLM2-135M loses answers at all-int4 (held-out KL ~0.48): within 1.08x the int4 bytes (what bounds its
    decode time) the default keeps the most KL per byte 8-bit, though the harder calibration text (three languages
    and code) stays above 0.1 nats: said not met, the closest graph within the cap the answer."""
    from llama_tools.checkpoints.source import resolve

    rep = _default_export(resolve(str(smollm2_hf)), tmp_path / "d" / "model.onnx")
    t = rep.target
    # the all-int4 graph measured 0.204 on the calibration text: 0.6x of it is over 0.1, which binds
    assert t.max_kl == pytest.approx(min(0.1, 0.6 * t.all_int4_kl)) == pytest.approx(0.1)
    assert t.all_int4_kl < 0.3  # awq's scaled blocks alone come a good part of the way (uncalibrated: 0.54)
    chosen = t.rounds[t.chosen]
    # measured: 0.126 against all-int4 0.208 on the calibration text (inputs measured on 3,328 tokens of the corpus)
    assert t.importance_tokens > 8 * t.calibration_tokens
    assert t.met == (chosen.measured_kl <= t.max_kl) and chosen.measured_kl < 0.7 * t.all_int4_kl
    assert rep.bytes <= t.size_cap * t.rounds[0].bytes and 0 < len(t.kept_8bit) < len(t.sensitivity)
    # held out, English: below the calibration text's KL (measured 0.092 against 0.126; verify int4's FAITHFUL
    # on it is the benchmark's to judge, 0.1 being too near to assert here)
    assert rep.quality.mean_kl < 0.9 * t.calibration_kl, (rep.quality, t.calibration_kl)
    # the most KL per byte first: a few matrices carry a good part of the int4 error (measured: 17 of 122, 0.08x
    # the bytes, carry ~40% of it)
    share = sum(t.sensitivity[n] for n in t.kept_8bit) / sum(t.sensitivity.values())
    assert len(t.kept_8bit) < len(t.sensitivity) / 3 and share > len(t.kept_8bit) / len(t.sensitivity), share


def test_the_head_is_read_in_chunks_without_changing_a_figure(monkeypatch):
    """The lm_head's KL and the Fisher probes, W^8 read 7 rows at a time, equal the one-chunk figures; the head's KL
    equals the textbook formula on the whole matrix, and the probes' ½ E[(u · δh)²] the textbook Fisher form."""
    import llama_tools.exporters.int4_target as t
    from llama_tools.modeling.model import softcap
    from llama_tools.inference.reference import reference_model
    from llama_tools.checkpoints.source import resolve

    ref = reference_model(resolve("tiny"))
    cfg = ref.cfg
    z = torch.randn(1, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = t._head_rows(ref)
    assert whole[1] >= cfg.vocab_size  # tiny's head is one chunk by default
    r = 40  # the head's first 40 rows exact: the rest's KL, from the same pass
    one = (t._head_kl(ref, z, t.rtn_emulation(32), r), t._probes(ref, z, 3))
    monkeypatch.setattr(t, "_head_rows", lambda r: (whole[0], 7))
    many = (t._head_kl(ref, z, t.rtn_emulation(32), r), t._probes(ref, z, 3))
    assert one[1].shape == (3, 24, cfg.hidden_size) and one[1].dtype == torch.float32
    assert many[0] == pytest.approx(one[0], rel=1e-5)  # fp32 matmul shapes
    torch.testing.assert_close(many[1], one[1], rtol=1e-5, atol=1e-6)
    h = t._final(ref)(z)[0].detach()  # the final norm's gain is a parameter: no autograd in the textbook side
    w = ref.reader.rows(whole[0], [(0, cfg.vocab_size)]).float()
    lp = torch.log_softmax(softcap(h @ w.T, cfg.final_logit_softcap).double(), -1)
    lq = torch.log_softmax(softcap(h @ t.fake_quant(w, 4, 32).T, cfg.final_logit_softcap).double(), -1)
    wq = t.fake_quant(w, 4, 32)
    lr = torch.log_softmax(softcap(h @ torch.cat([w[:r], wq[r:]]).T, cfg.final_logit_softcap).double(), -1)
    textbook = [float((lp.exp() * (lp - lx)).sum(-1).mean()) for lx in (lq, lr)]
    assert one[0] == pytest.approx(textbook, rel=1e-9) and 0 < one[0][1] < one[0][0]
    assert one[0][1] != pytest.approx(textbook[0], rel=1e-3)  # the rest's figure is not the whole head's
    # the probes' second moment is the Fisher on the TOP_K candidates: ½ Σ p (s - s̄)², s = δh · w_v
    monkeypatch.setattr(t, "TOP_K", cfg.vocab_size)  # every token a candidate: the textbook's full sum
    delta = 0.01 * torch.randn(24, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    u = t._probes(ref, z, 4000)
    probe = 0.5 * ((u * delta).sum(-1) ** 2).mean(0)  # [24]
    sv = (delta @ w.T).double()  # δ logit of every token: [24, n1]
    textbook = 0.5 * (lp.exp() * (sv - (lp.exp() * sv).sum(-1, keepdim=True)) ** 2).sum(-1)
    # 4000 probes: each position's figure within ~2.2% (one sigma) of its expectation
    torch.testing.assert_close(probe.detach().double(), textbook, rtol=0.12, atol=0)
    flipped = 0.5 * ((u * delta.flip(0)).sum(-1) ** 2).mean(0)  # negative: each position's δ given another's
    assert not torch.allclose(flipped.detach().double(), textbook, rtol=0.12, atol=0)


def test_the_sensitivities_rank_matrices_as_running_each_alone_in_int4_does(tmp_path, monkeypatch):
    """Each matrix alone in int4 through the whole reference, its logits' KL from the clean ones (the truth, exactly,
    at any order): the sensitivities, a forward and a backward pass, rank the matrices alike and come within a
    factor of it; a shuffled assignment does not (the check can fail)."""
    import onnx

    import llama_tools.exporters.int4_target as t
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.quantize import _weights_of
    from llama_tools.inference.reference import reference_model
    from llama_tools.checkpoints.source import resolve
    from llama_tools.modeling.model import build_model

    src = resolve("tiny")
    export_fused(src, tmp_path / "m.onnx")
    nodes = [n for n in _weights_of(onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)) if n != HEAD]
    mats = matrices(nodes)
    ref = reference_model(src)
    ids = np.random.default_rng(3).integers(3, src.cfg.vocab_size, size=40).tolist()
    monkeypatch.setattr(t, "TOP_K", src.cfg.vocab_size)  # a random model's mass is spread: every token a candidate
    got = t.sensitivities(ref, ids, mats, 32, emulate=lambda w, node, rows=None: t.fake_quant(w, 2, 32))
    assert set(got) == {m.node for m in mats} and all(v > 0 for v in got.values())
    model = build_model(src.cfg, seed=0).eval()  # the weights the seeded reference reads
    x = torch.tensor([ids])
    with torch.no_grad():
        clean = torch.log_softmax(model(x).logits.double(), -1)
        truth = {}
        for m in mats:  # 2-bit: a move large enough to tell the matrices apart on random weights
            mod = getattr(model.model.layers[m.layer], m.module)
            saved = {p: getattr(mod, p).weight.data.clone() for p in m.parts}
            for p in m.parts:
                getattr(mod, p).weight.data = t.fake_quant(saved[p], 2, 32)
            lq = torch.log_softmax(model(x).logits.double(), -1)
            truth[m.node] = float((clean.exp() * (clean - lq)).sum(-1).mean())
            for p in m.parts:
                getattr(mod, p).weight.data = saved[p]
    keys = sorted(got)
    a, b = np.log([truth[k] for k in keys]), np.log([got[k] for k in keys])
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    assert np.corrcoef(rank(a), rank(b))[0, 1] >= 0.8, (truth, got)
    assert np.all(np.abs(b - a) <= np.log(3)), (truth, got)
    shuffled = np.random.default_rng(0).permutation(b)
    assert np.corrcoef(rank(a), rank(shuffled))[0, 1] < 0.8


def test_the_default_passes_over_a_graph_it_cannot_place(tmp_path):
    """Mixture-of-experts (the plain graph, expert MatMuls): the default target steps aside with a note, every
    matrix int4; an explicit --max-kl on it is refused in one line naming the option."""
    import json

    from llama_tools.checkpoints.config_files import config_to_hf
    from llama_tools.modeling.presets import get_preset
    from llama_tools.checkpoints.source import resolve

    cfg = get_preset("tiny").replace(family="mixtral", num_experts=4, num_experts_per_tok=2, intermediate_size=64)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    src = resolve(str(tmp_path / "config.json"))
    rep = _default_export(src, tmp_path / "d" / "model.onnx")
    assert rep.target is None and rep.quantized.kept_8bit == []
    assert any("without the default quality target" in n and "experts" in n for n in rep.notes), rep.notes
    with pytest.raises(ValueError, match="--max-kl.*experts"):
        _default_export(src, tmp_path / "e" / "model.onnx", {"max_kl": 0.1})
    assert not (tmp_path / "e").exists()


def test_fake_quant_a_few_rows_at_a_time(monkeypatch):
    """Rows are quantized on their own: three rows per step gives the whole matrix's figures bit for bit."""
    import llama_tools.exporters.int4_target as t

    w = torch.from_numpy(np.random.default_rng(5).standard_normal((50, 70)).astype(np.float32))  # 70: a padded block
    whole = t.fake_quant(w, 4, 32)
    monkeypatch.setattr(t, "FAKE_QUANT_ROWS_BYTES", 3 * 8 * 96)
    assert torch.equal(t.fake_quant(w, 4, 32), whole) and not torch.equal(whole, w)


# --- The lm_head's first rows, a matrix of their own -----------------------------------------------------------

def _tied_tiny(tmp_path):
    from llama_tools.checkpoints.convert import save_checkpoint
    from llama_tools.modeling.model import build_model
    from llama_tools.modeling.presets import get_preset

    cfg = get_preset("tiny").replace(tie_word_embeddings=True)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32)
    save_checkpoint(cfg, {k: v.detach() for k, v in model.state_dict().items()}, tmp_path / "ckpt", to="hf")
    return cfg, tmp_path / "ckpt"


def test_a_head_split_by_rows_computes_each_part_in_its_own_precision(tmp_path):
    """HEAD_FREQUENT kept 8-bit and the rest int4 (or the other way): two MatMulNBits joined by a Concat, the tied
    embedding served from both tables. Independent truth: on ids all in one part, the logits of that part's rows
    equal those of the graph with the whole head in that part's precision (same embedding rows, same layers)."""
    import onnx

    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import onnx_logits
    from llama_tools.exporters.quant_options import frequent_rows
    from llama_tools.exporters.quantize import quantize_int4

    cfg, ckpt = _tied_tiny(tmp_path)
    full = export_fused(resolve(str(ckpt)), tmp_path / "full.onnx").path
    r = frequent_rows(cfg.vocab_size)
    graphs = {}
    for tag, keep in (("int4", ()), ("8bit", (HEAD,)), ("frequent", (HEAD_FREQUENT,)), ("rest", (HEAD_REST,))):
        q = quantize_int4(full, tmp_path / f"{tag}.onnx", algorithm="imatrix", keep_8bit=keep)
        nodes = onnx.load(str(q.path), load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        split = tag in ("frequent", "rest")
        assert q.quantized == 9 + split and ops.count("GatherBlockQuantized") == 1 + split, (tag, q.quantized)
        assert any(n.name == "/lm_head/Concat" for n in nodes) == split
        assert "model.embed_tokens.weight" not in {t.name for t in onnx.load(str(q.path)).graph.initializer}
        graphs[tag] = q.path
    rng = np.random.default_rng(0)
    low, high = rng.integers(0, r, 12).tolist(), rng.integers(r, cfg.vocab_size, 12).tolist()
    logits = {(tag, which): onnx_logits(p, cfg, ids) for tag, p in graphs.items()
              for which, ids in (("low", low), ("high", high))}
    assert logits[("frequent", "low")].shape == (12, cfg.vocab_size)
    part = {"low": np.s_[:, :r], "high": np.s_[:, r:]}
    for split, which, same in (("frequent", "low", "8bit"), ("frequent", "high", "int4"),
                               ("rest", "high", "8bit"), ("rest", "low", "int4")):
        got, want = logits[(split, which)][part[which]], logits[(same, which)][part[which]]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{split} on {which} ids")
    # the other part's rows are in the other precision: they differ (the check can fail)
    assert np.abs(logits[("frequent", "low")][:, r:] - logits[("8bit", "low")][:, r:]).max() > 1e-3


def test_the_head_parts_sensitivities_add_up_to_the_whole_head(tmp_path):
    """With the head in two parts, its KL is split: the other rows' own (first rows exact), and the first rows'
    the difference; together the whole head's (embedding stream included), as the plan adds them."""
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.int4_target import matrices, sensitivities
    from llama_tools.inference.reference import reference_model

    cfg, ckpt = _tied_tiny(tmp_path)
    ref = reference_model(resolve(str(ckpt)))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 48).tolist()
    whole = sensitivities(ref, ids, matrices([HEAD]), 32)
    split = sensitivities(ref, ids, matrices(list(HEAD_PARTS)), 32)
    assert set(whole) == {HEAD} and set(split) == set(HEAD_PARTS)
    assert split[HEAD_REST] > 0 and split[HEAD_FREQUENT] > 0
    assert split[HEAD_REST] + split[HEAD_FREQUENT] == pytest.approx(whole[HEAD], rel=1e-6)


def test_kept_matrices_are_labelled_as_a_reader_names_them():
    """The export's kept line: module paths without the graph's prefixes; a head kept in one part says which rows,
    both parts say the head once."""
    from llama_tools.exporters.quant_options import matrix_labels

    down = "/model/layers.3/mlp/down_proj/MatMul"
    assert matrix_labels([down, HEAD_FREQUENT]) == ["layers.3/mlp/down_proj", "lm_head (first rows)"]
    assert matrix_labels([HEAD_REST]) == ["lm_head (other rows)"]
    assert matrix_labels([HEAD_REST, down, HEAD_FREQUENT]) == ["lm_head", "layers.3/mlp/down_proj"]
    assert matrix_labels([HEAD]) == ["lm_head"]


def test_the_target_row_tells_a_miss_from_its_bound():
    """The export's int4 target row: a KL that misses its bound never prints equal to it (tiny's are ~1e-4)."""
    from llama_tools.cli.export_cmd import distinct

    assert distinct(0.1, 0.1258) == ("0.1000", "0.1258")  # the usual four decimals
    assert distinct(7.3178e-05, 1.21e-04) == ("7.32e-05", "0.000121")  # were 0.0001 and 0.0001
    for bound, got in ((0.1, 0.10004), (7.3178e-05, 7.3179e-05), (0.5, 0.5 + 1e-12)):
        x, y = distinct(bound, got)
        assert x != y and float(x) <= bound < got and float(y) > bound, (x, y)
    assert distinct(0.1, 0.1) == ("0.1000", "0.1000")


def test_vjp_is_each_probes_jacobian_transpose_product():
    """_vjp runs f once and sends each probe back: J_f(z)ᵀ g for every probe's rows, as the explicit Jacobian gives;
    a probe's cotangent sent with another probe's rows would differ."""
    from llama_tools.exporters.int4_target import _vjp

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    f = lambda z: torch.tanh(z @ w) * z.sum(1, keepdim=True)  # noqa: E731  (mixes positions: not elementwise)
    z = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)  # [b, n3, n2]
    g = torch.randn(3 * 2, 3, 6, generator=gen, dtype=torch.float64)  # three probes, probe-major
    got = _vjp(f, z, g)
    assert got.shape == g.shape and got.dtype == torch.float64
    jac = torch.autograd.functional.jacobian(f, z)  # [b, n3, n2, b, n3, n2]
    want = torch.cat([torch.einsum("abcxyz,abc->xyz", jac, g[i * 2:(i + 1) * 2]) for i in range(3)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(_vjp(f, z, g.flip(0)), want)


def test_the_head_passes_record_no_autograd_graph():
    """The final norm is read without gradients for its weights, so the head's chunked products keep nothing for a
    backward pass (recorded, they held 3.1 GB on Qwen2.5-Coder-0.5B's head); its output still carries a gradient
    to its input, which the probes' pass needs."""
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.int4_target import _final, _head_chunks
    from llama_tools.inference.reference import reference_model

    ref = reference_model(resolve("tiny"))
    final = _final(ref)
    assert not any(p.requires_grad for p in final.parameters())
    z = torch.randn(1, 5, ref.cfg.hidden_size)
    x, _ = next(_head_chunks(ref, final(z)[0]))
    assert x.grad_fn is None and not x.requires_grad
    zin = z.clone().requires_grad_(True)
    assert final(zin).requires_grad  # the negative: a gradient to the input is still there


def test_the_reference_logits_spilled_to_a_nameless_file_read_back_as_made(tmp_path, monkeypatch):
    """states_logits with a scratch directory: every position's logits written there before any session, a column
    slab of W^8 at a time (7 rows here) or from the clean logits, and read back row for row as the in-memory path
    makes them; the file has no name in the directory; a slab of the wrong shape is refused."""
    import llama_tools.exporters.int4_target as t
    from llama_tools.exporters.quantize import spilled_rows
    from llama_tools.inference.reference import reference_model
    from llama_tools.checkpoints.source import resolve

    ref = reference_model(resolve("tiny"))
    cfg = ref.cfg
    z = torch.randn(1, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    held = t.states_logits(ref, z)  # [24, n1] in memory (tiny's fit in LOGITS_CACHE_BYTES)
    clean = t._clean_logits(ref, t._final(ref)(z)[0])
    from_clean = t.states_logits(ref, z, clean, scratch=tmp_path)
    whole = t._head_rows(ref)
    monkeypatch.setattr(t, "_head_rows", lambda r: (whole[0], 7))  # W^8 in slabs of 7 rows: many columns slabs
    spilled = t.states_logits(ref, z, scratch=tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked: nothing to leave behind after a kill
    for a, b in ((0, 24), (0, 8), (8, 16), (23, 24), (5, 19)):
        want = held(a, b)
        assert want.shape == (b - a, cfg.vocab_size) and want.dtype == np.float32
        for got in (spilled(a, b), from_clean(a, b)):
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(spilled(0, 8), held(8, 16), atol=1e-3)  # negative: another window's rows differ
    with pytest.raises(AssertionError, match="hold 5 of 9 columns"):
        spilled_rows([np.zeros((3, 5), np.float32)], 3, 9, tmp_path)
    with pytest.raises(AssertionError, match="a slab of"):
        spilled_rows([np.zeros((2, 5), np.float32)], 3, 9, tmp_path)
