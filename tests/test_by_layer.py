"""`verify parity --by-layer`: the graph cut into blocks by its node names, each block run on its own and judged.

The cut is checked against the whole graph on onnxruntime (the blocks chained on their own outputs give the
whole graph's logits and K/V); the check passes correct plain and fused exports with external weights, reads
the weights from the export's own file, fails a wrong layer and names it; --plot draws a PNG.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters import runtime
from llama_tools.exporters.verification.by_layer import EMBEDDING, HEAD, BlockRunner, GraphBlocks, verify_by_layer
from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.verification.parity import resolve_target
from llama_tools.exporters.prompts import left_pad, positions
from llama_tools.modeling.presets import get_preset
from helpers import sharp

CFG = get_preset("tiny").replace(num_hidden_layers=3)  # GQA 4/2 heads of 16
PROMPTS = [[1, 17, 300, 5, 99, 42, 7, 250, 3, 64], [1, 450, 29, 8, 77]]


def sharp_state(scale: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    s = {k: v.detach().clone() for k, v in sharp(CFG).state_dict().items()}
    for name, factor in (scale or {}).items():
        s[name] *= factor
    return s


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny3"
    save_checkpoint(CFG, sharp_state(), d, to="hf")
    return d


@pytest.fixture(scope="module", params=["plain", "fused"])
def exported(request, checkpoint, tmp_path_factory):
    """Weights in OUT.onnx.data (threshold 0), as a big model's are."""
    out = tmp_path_factory.mktemp(request.param) / "model.onnx"
    (export_onnx if request.param == "plain" else export_fused)(str(checkpoint), out, external_data_threshold_bytes=0)
    assert (out.parent / "model.onnx.data").is_file()
    return out


def test_blocks_chained_are_the_whole_graph(exported):
    """Each block fed the previous block's own output: the whole graph's logits and K/V, to rounding."""
    blocks = GraphBlocks(exported, CFG.num_hidden_layers)
    names = [b.name for b in blocks.blocks]
    assert names == [EMBEDDING, "layer 0", "layer 1", "layer 2", HEAD]
    # every node of a layer is in that layer's block; of other layers' nodes only weightless ones (the plain
    # graph computes the attention reshapes' shapes once, in layer 0)
    for b in blocks.blocks[1:-1]:
        assert {i for i, j in enumerate(blocks.layer_of) if j == b.layer} <= set(b.nodes)
        foreign = [blocks.nodes[i] for i in b.nodes if blocks.layer_of[i] not in (b.layer, None)]
        weights = {n for n, t in blocks.initializers.items() if len(t.dims) == 2}
        assert not [n.name for n in foreign if weights & set(n.input)]
    ids, mask = left_pad(PROMPTS)
    runner = BlockRunner(blocks, CFG.num_key_value_heads, CFG.head_dim)
    z, presents = None, []
    for b in blocks.blocks:
        out = runner.run(b, z, ids, mask)
        if b.presents:
            presents.append((out[b.presents[0]], out[b.presents[1]]))
        z = sum(out[x].astype(np.float64) for x in b.outputs).astype(np.float32)
    whole = runtime.OnnxLM(runtime.create_session(exported, "cpu"), CFG.num_hidden_layers, CFG.num_key_value_heads,
                           CFG.head_dim, io="numpy")
    ref = whole(ids, mask, positions(mask, ids.shape[1]), whole.empty_cache(len(PROMPTS)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(z[valid], ref.logits[valid], rtol=0, atol=1e-5)
    for (k, v), (rk, rv) in zip(presents, ref.presents):
        np.testing.assert_allclose(k, rk, rtol=0, atol=1e-5)
        np.testing.assert_allclose(v, rv, rtol=0, atol=1e-5)


def test_block_models_point_into_the_exports_data(exported):
    """No weight is copied: a block's initializers keep their external location (the export's .data file)."""
    blocks = GraphBlocks(exported, CFG.num_hidden_layers)
    model = blocks.block_model(blocks.blocks[2])
    big = [t for t in model.graph.initializer if len(t.dims) == 2]
    assert big and all(t.data_location == 1 and t.external_data[0].value == "model.onnx.data" for t in big)
    assert len(model.SerializeToString()) < 20_000
    mine = [t.name for t in big if t.name not in ("cos_cache", "sin_cache")]  # the RoPE tables are shared
    assert mine and all(".layers.1." in n for n in mine)  # only its own layer's matrices


def test_correct_export_passes_layer_by_layer(exported, checkpoint):
    rep = verify_by_layer(resolve_target(str(exported), str(checkpoint)), prompts=PROMPTS)
    assert rep.passed and rep.first_bad is None, [c.figures() for c in rep.checks if not c.passed]
    assert [b.name for b in rep.blocks][1:-1] == ["layer 0", "layer 1", "layer 2"]
    assert all(len(b.checks) == 3 for b in rep.blocks[1:-1])  # hidden state, K, V
    for c in rep.checks:
        assert c.ratio < 4, c.figures()  # near PyTorch's own rounding (well inside the 8x budget)
    s = rep.series()
    assert s["layers"] == [0, 1, 2] and len(s["key"]["error"]) == 3 and s["first_bad_layer"] is None


def test_a_wrong_layer_is_named(exported, checkpoint, tmp_path):
    """The export's layer 1 down_proj is 0.1% off the source: --by-layer names layer 1 (its own output)."""
    off = tmp_path / "off"
    save_checkpoint(CFG, sharp_state({"model.layers.1.mlp.down_proj.weight": 1 + 1e-3}), off, to="hf")
    rep = verify_by_layer(resolve_target(str(exported), str(off)), prompts=PROMPTS)
    assert not rep.passed and rep.first_bad == "layer 1" and rep.first_bad_layer == 1
    bad = rep.blocks[2]
    assert not bad.checks[0].passed and bad.checks[1].passed and bad.checks[2].passed  # Z^2 only: K/V come first
    assert all(b.passed for b in rep.blocks[:2]) and rep.blocks[3].passed  # layer 2 fed the truth's own input


def test_cli_by_layer_json_plot_and_exit_codes(exported, checkpoint, tmp_path):
    png = tmp_path / "layers.png"
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--source", str(checkpoint), "--by-layer",
                                 "--plot", str(png), "-q", "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["mode"] == "by-layer" and d["passed"] and len(d["blocks"]) == CFG.num_hidden_layers + 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    off = tmp_path / "off"
    save_checkpoint(CFG, sharp_state({"model.layers.2.self_attn.v_proj.weight": 1 + 1e-2}), off, to="hf")
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--source", str(off), "--by-layer", "-q"])
    assert r.exit_code == 1 and "FAIL; first out of budget: layer 2" in r.output, r.output


def test_whole_graph_plot(exported, checkpoint, tmp_path):
    png = tmp_path / "whole.png"
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--source", str(checkpoint), "--steps", "1",
                                 "--plot", str(png), "-q"])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, needle", [
    (["--plot", "x.svg"], "write a .png file"),
    (["--plot", "/proc/x.png"], "/proc/x.png"),
])
def test_plot_refused_before_any_work(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["verify", "parity", "tiny", "--by-layer", *args])
    assert r.exit_code == 1 and needle in r.output and "Traceback" not in r.output, r.output
    assert "Error:" in r.output and len(r.output.strip().splitlines()) == 1


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    r = CliRunner().invoke(cli, ["verify", "parity", "--by-layer", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 1 and "llama-tools[plot]" in r.output, r.output
    assert not (tmp_path / "p.png").exists()


def test_a_graph_without_layer_names_is_refused(tmp_path):
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, 1])
    y = helper.make_tensor_value_info("logits", onnx.TensorProto.INT64, [1, 1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x],
                                                [y]))
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="no node is named by its decoder layer"):
        GraphBlocks(tmp_path / "m.onnx", 2)


def test_the_float64_layer_widened_on_use_is_the_float64_layer(checkpoint):
    """The truth keeps matrices in fp32 and widens each as it runs: bit for bit a layer built in float64."""
    from llama_tools.exporters.verification.by_layer import LayerReference
    from llama_tools.modeling.model import DecoderLayer
    from llama_tools.inference.reference import CheckpointReader

    reader = CheckpointReader(checkpoint)
    _, mask = left_pad(PROMPTS)
    z = torch.randn(2, mask.shape[1], CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got, k, v = LayerReference(reader, torch.float64).layer(1, z, mask)
    ref = LayerReference(reader, torch.float64)
    layer = DecoderLayer(CFG).to(torch.float64)
    names = [n for n in reader.where if n.startswith("model.layers.1.")]
    layer.load_state_dict({n.removeprefix("model.layers.1."): t.double() for n, t in reader.read(names).items()})
    from llama_tools.modeling.model import attention_bias

    bias = attention_bias(CFG, mask.shape[1], 0, torch.from_numpy(mask), torch.float32, z.device).double()
    with torch.no_grad():
        want, (wk, wv) = layer.eval()(z, bias, torch.from_numpy(positions(mask, mask.shape[1])),
                                      ref.tables(mask.shape[1]), None)
    assert torch.equal(got, want) and torch.equal(k, wk) and torch.equal(v, wv)


def test_per_channel_units_keep_a_massive_channel_from_hiding_an_error():
    """Hand-built hidden states: channel 0 is 1000x the others and carries its own rounding; channel 1 is 1e-4 off.

    Judged as one tensor the massive channel's rounding sets the noise and the error hides; in channel units
    it fails. Without the error both pass.
    """
    from llama_tools.exporters.verification.by_layer import per_channel
    from llama_tools.exporters.verification.compare import judge

    rng = np.random.default_rng(0)
    truth = rng.standard_normal((2, 8, 16))  # [batch, seq, n2]
    truth[..., 0] *= 1000.0
    valid = np.ones((2, 8), bool)
    noise = lambda: truth * (1 + 6e-8 * rng.standard_normal(truth.shape))  # noqa: E731  fp32-sized rounding
    ref, got = noise(), noise()
    got[..., 1] = truth[..., 1] * (1 + 1e-4)
    assert judge("whole", got, ref, truth, valid, "float32").passed  # hidden under channel 0's rounding
    scaled = judge("scaled", *per_channel(got, truth, valid, ref), valid, "float32")
    assert not scaled.passed and scaled.ratio > 50
    assert judge("ok", *per_channel(noise(), truth, valid, ref), valid, "float32").passed
    s = per_channel(got, truth, valid, ref)[2]
    np.testing.assert_allclose(np.sqrt((s ** 2).mean((0, 1))), 1.0)  # every channel in units of its RMS
