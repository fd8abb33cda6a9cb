"""Planted faults are caught and located (issue 16 item 5): benchmarks/bench_faults.py's planter on tiny models.

Each fault goes into a copy of a correct export (beside it, sharing its .data); `verify parity --by-layer`
must FAIL and name the layer it is in (layer 0 for the RoPE base, which every layer uses; "logits only" for
the final norm), the whole-graph check must FAIL too. A scale error far below fp32 rounding must PASS (the check
is not trigger-happy). The builder graph and the real model are the slow cases.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.modeling.presets import get_preset
from helpers import sharp

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "bench_faults.py")
bf = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = bf  # its dataclasses look their module up
_spec.loader.exec_module(bf)

CFG = get_preset("tiny").replace(num_hidden_layers=4)  # GQA 4/2 heads: two KV heads to swap
LAYER = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny4"
    save_checkpoint(CFG, {k: v.detach().clone() for k, v in sharp(CFG).state_dict().items()}, d, to="hf")
    return d


@pytest.fixture(scope="module", params=["plain", "fused"])
def graph(request, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model.onnx"
    (export_onnx if request.param == "plain" else export_fused)(str(checkpoint), out, external_data_threshold_bytes=0)
    return out


@pytest.mark.parametrize("fault", bf.FAULTS)
def test_fault_fails_by_layer_and_is_located(graph, checkpoint, fault):
    faulted = bf.plant(graph, fault, CFG, LAYER)
    assert faulted.parent == graph.parent and not (faulted.parent / (faulted.name + ".data")).exists()
    v = bf.check(faulted, "by-layer", str(checkpoint))
    assert not v.passed and v.located == bf.expected(fault, "by-layer", LAYER, CFG.num_hidden_layers), v


@pytest.mark.parametrize("fault", ["scale", "final-norm"])
def test_fault_fails_the_whole_graph_check(graph, checkpoint, fault):
    """The whole graph sees layer j's down_proj first in layer j+1's K/V; the final norm in the logits only."""
    v = bf.check(bf.plant(graph, fault, CFG, LAYER), "whole", str(checkpoint), steps=1)
    assert not v.passed and v.located == bf.expected(fault, "whole", LAYER, CFG.num_hidden_layers), v


def test_the_planter_changes_only_what_it_says(graph):
    """Scale: one matrix, by exactly (1 + eps) after fp32 rounding; KV swap: two heads' columns exchanged."""
    import numpy as np

    before = bf.Planter(graph)
    after = bf.Planter(bf.plant(graph, "scale", CFG, LAYER, 1e-3))
    changed = [n for n in before.inits if not np.array_equal(before.array(n), after.array(n))]
    assert len(changed) == 1 and f"layers.{LAYER}." in changed[0] and "down_proj" in changed[0]
    np.testing.assert_allclose(after.array(changed[0]), before.array(changed[0]) * (1 + 1e-3), rtol=1e-6)
    swapped = bf.Planter(bf.plant(graph, "kv-swap", CFG, LAYER))
    changed = [n for n in before.inits if not np.array_equal(before.array(n), swapped.array(n))]
    assert changed and all(f"layers.{LAYER}." in n for n in changed)
    d = CFG.head_dim
    for n in changed:
        a, b = before.array(n), swapped.array(n)
        cols = np.nonzero((a != b).any(0))[0]
        assert len(cols) in (4 * d, 2 * d)  # K and V heads 0 and 1 (packed qkv), or one of them per matrix
        np.testing.assert_array_equal(np.sort(a[:, cols], axis=1), np.sort(b[:, cols], axis=1))


def test_a_fault_below_rounding_passes(graph, checkpoint):
    """Negative control: a scale of 1e-9 (below fp32's 6e-8 rounding step) changes nothing and passes."""
    v = bf.check(bf.plant(graph, "scale", CFG, LAYER, 1e-9), "by-layer", str(checkpoint))
    assert v.passed and v.located == "-", v


@pytest.mark.slow
def test_builder_graph_faults_are_located(checkpoint, tmp_path):
    """onnxruntime-genai's builder graph of the same checkpoint: every fault caught by --by-layer, at its layer."""
    pytest.importorskip("onnxruntime_genai")
    from llama_tools.modeling import presets

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in checkpoint.iterdir():
        (hf / f.name).symlink_to(f)
    tok = Path(presets.__file__).parent.parent / "data"  # llama_tools/data
    for f in tok.glob("*/tokenizer*"):  # tiny's tokenizer.model: the builder writes the client files from it
        (hf / f.name).symlink_to(f)
    bf.builder(hf, tmp_path / "builder", tmp_path / "work")
    path = tmp_path / "builder" / "model.onnx"
    assert bf.check(path, "by-layer", str(checkpoint)).passed
    for fault in bf.FAULTS:
        v = bf.check(bf.plant(path, fault, CFG, LAYER), "by-layer", str(checkpoint))
        assert not v.passed and v.located == bf.expected(fault, "by-layer", LAYER, CFG.num_hidden_layers), (fault, v)


@pytest.fixture(scope="module")
def smollm2_plain(smollm2_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model.onnx"
    export_onnx(str(smollm2_hf), out)
    return out


@pytest.mark.slow
def test_real_model_by_layer_passes_and_locates_a_fault(smollm2_plain, smollm2_hf):
    """SmolLM2 (30 layers): the correct export passes layer by layer; down_proj of layer 15 x (1 + 1e-3) is named."""
    cfg = json.loads((Path(smollm2_hf) / "config.json").read_text())
    from llama_tools.checkpoints.source import resolve

    c = resolve(str(smollm2_hf)).cfg
    assert c.num_hidden_layers == cfg["num_hidden_layers"]
    ok = bf.check(smollm2_plain, "by-layer")
    assert ok.passed, ok
    v = bf.check(bf.plant(smollm2_plain, "scale", c, 15), "by-layer")
    assert not v.passed and v.located == "layer 15", v
