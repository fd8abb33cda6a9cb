"""The default row past a sliding window runs as a batch of its own, and it is what catches a graph without the window.

A model whose window is longer than every default row gets one more row, past the window, so that the window
masks keys. Padded with the short rows, every row would cost its length in every layer (Gemma 3 270M: 1.5x its
weights); run apart, each layer-local and source check judges both batches' valid positions at once. Here a tiny
seeded Mistral with a window of 24 is exported fused, and a copy of the graph has its attention's window taken
out (GroupQueryAttention's local_window_size -1): the default inputs FAIL it at layer 0, the same rows without the
one past the window PASS it, and the correct graph passes every check, transformers' source check included.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters import prompts
from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.prompts import WINDOW_EXTRA, Inputs, default_inputs
from llama_tools.exporters.verification import compare
from llama_tools.exporters.verification.parity import resolve_target
from llama_tools.exporters.verification.verdict import parity_inputs, verify
from llama_tools.modeling.presets import get_preset
from helpers import sharp

WINDOW = 24
CFG = get_preset("tiny").replace(num_hidden_layers=2, family="mistral", sliding_window=WINDOW)


def test_the_row_past_the_window_is_a_batch_of_its_own():
    """Shapes first: the row's length, its group, and what the whole-graph check runs of it."""
    src = SimpleNamespace(cfg=SimpleNamespace(sliding_window=40), path=None, tokenizer=None)
    small = default_inputs(src, 256, 128, random_ids=2)
    assert [len(r) for r in small.rows] == [11, 6, 40 + WINDOW_EXTRA] and small.groups == ((0, 1), (2,))
    assert [[len(r) for r in b] for b in small.batches()] == [[11, 6], [40 + WINDOW_EXTRA]]
    assert small.whole_graph(256) == (small.rows, None)  # 3 x 48 x 256 float64 logits: one padded batch
    src = SimpleNamespace(cfg=SimpleNamespace(sliding_window=512), path=None, tokenizer=None)
    big = default_inputs(src, 262144, 1024, random_ids=2)  # Gemma 3's window and vocabulary
    assert [len(r) for r in big.rows] == [11, 6, 520] and big.groups == ((0, 1), (2,))
    rows, why = big.whole_graph(262144)  # 3 x 520 x 262,144 x 8 bytes = 3.0 GiB padded together
    assert [len(r) for r in rows] == [11, 6] and "3.0 GiB" in why and "left out of the whole-graph check" in why
    given = Inputs([[5, 6, 7], [8]], "2 row(s) given")  # rows a user gives: one batch, as given
    assert given.batches() == [[[5, 6, 7], [8]]] and given.whole_graph(10**6) == (given.rows, None)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(checkpoint, its fused graph, the same graph without the window)."""
    d = tmp_path_factory.mktemp("ckpt") / "mistral-window"
    save_checkpoint(CFG, {k: v.detach().clone() for k, v in sharp(CFG).state_dict().items()}, d, to="hf")
    out = tmp_path_factory.mktemp("fused") / "model.onnx"
    export_fused(str(d), out, external_data_threshold_bytes=0)
    model = onnx.load(str(out), load_external_data=False)  # the weights stay in the export's own .data file
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == CFG.num_hidden_layers
    for n in gqa:
        (w,) = [a for a in n.attribute if a.name == "local_window_size"]
        assert w.i == WINDOW - 1 or w.i == WINDOW, w.i  # the window as the graph holds it
        w.i = -1
    unwindowed = out.parent / "no-window.onnx"
    onnx.save(model, str(unwindowed))
    return d, out, unwindowed


def test_a_graph_without_the_window_fails_only_on_the_row_past_it(windowed):
    d, _, unwindowed = windowed
    target = resolve_target(str(unwindowed), str(d))
    inputs = parity_inputs(target, None, 2)
    assert [len(r) for r in inputs.rows] == [11, 6, WINDOW + WINDOW_EXTRA] and inputs.groups == ((0, 1), (2,))
    v = verify(target, inputs, mode="layers", provider="cpu", steps=2)
    assert not v.passed and v.first_bad == "layer 0", v.first_bad
    assert v.source_check.passed  # the checkpoint is read right: the graph is what is wrong
    within = verify(target, Inputs(inputs.rows[:2], inputs.what), mode="layers", provider="cpu", steps=2)
    assert within.passed, within.first_bad  # the window masks nothing in rows shorter than it


def test_the_correct_graph_passes_with_the_row_apart(windowed, monkeypatch):
    d, graph, _ = windowed
    target = resolve_target(str(graph), str(d))
    inputs = parity_inputs(target, None, 2)
    v = verify(target, inputs, mode="both", provider="cpu", steps=2)
    assert v.passed and v.source_check.checked and v.source_check.passed, v.first_bad
    assert v.prompt_lengths == [11, 6, WINDOW + WINDOW_EXTRA] and "a batch of its own" in v.inputs
    assert v.whole.prompt_lengths == [11, 6, WINDOW + WINDOW_EXTRA]  # its logits fit: the whole graph runs it too
    monkeypatch.setattr(prompts, "WINDOW_ROW_BYTES", 1024)  # as if the padded logits were too big to hold whole
    v = verify(target, inputs, mode="both", provider="cpu", steps=2, source_check=False)
    assert v.passed and v.whole.prompt_lengths == [11, 6], v.whole.prompt_lengths
    assert any("left out of the whole-graph check" in n for n in v.notes), v.notes


def test_judge_sums_added_a_few_positions_at_a_time_are_the_same(monkeypatch):
    """JudgeSums widens at most ADD_ELEMENTS at once: the figures do not depend on it."""
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(37, 300)) * 3
    refs = [(truth + rng.normal(size=truth.shape) * 1e-6).astype(np.float32) for _ in range(2)]
    got = (truth + rng.normal(size=truth.shape) * 3e-6).astype(np.float32)
    figures = []
    for elements in (1 << 18, 1, 301, 900):
        monkeypatch.setattr(compare, "ADD_ELEMENTS", elements)
        sums = compare.JudgeSums(37, 2, logits=True)
        sums.add(0, 0, got, refs, truth)
        c = sums.check("logits", "float32", compare.BUDGET["float32"], 0)
        figures.append((c.error, c.noise, c.max_error, c.max_noise, c.scale, c.cosine, c.top1, c.tie))
    for f in figures[1:]:
        assert f == pytest.approx(figures[0], rel=1e-12)
