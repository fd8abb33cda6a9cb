"""Logits judged a chunk at a time: the same figures as the whole tensor, lm_head and the logits never whole.

compare.JudgeSums is fed [positions, vocabulary columns] chunks (by_layer.head_check makes the logits a slab of
vocabulary rows at a time, on both sides); its figures are checked against a whole-tensor computation written out
here, the head check's against the whole logits of the same tiny model, and a corrupted logit in the last chunk
is caught.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.verification import by_layer
from llama_tools.exporters.verification.compare import BUDGET, JudgeSums, judge, margin
from llama_tools.exporters.verification.parity import resolve_target
from llama_tools.inference.reference import CheckpointReader
from llama_tools.modeling.presets import get_preset
from helpers import sharp

CFG = get_preset("tiny").replace(num_hidden_layers=2)  # vocab 512, n2 64
PROMPTS = [[1, 17, 300, 5, 99, 42, 7, 250, 3, 64], [1, 450, 29, 8, 77]]


def whole_figures(got: np.ndarray, refs: list[np.ndarray], truth: np.ndarray, valid: np.ndarray) -> dict:
    """judge's figures computed on whole float64 tensors, as written in its docstrings."""
    g, t = got[valid].astype(np.float64), truth[valid].astype(np.float64)  # [positions, vocab]
    noise = [r[valid].astype(np.float64) - t for r in refs]
    tie = 2 * (BUDGET["float32"].multiple * max(np.abs(d).max() for d in noise)
               + BUDGET["float32"].floor("float32", math.sqrt(np.mean(t ** 2))))
    agree = g.argmax(-1) == t.argmax(-1)
    return {"error": math.sqrt(np.mean((g - t) ** 2)), "noises": tuple(math.sqrt(np.mean(d ** 2)) for d in noise),
            "max_error": np.abs(g - t).max(), "max_noise": max(np.abs(d).max() for d in noise),
            "scale": math.sqrt(np.mean(t ** 2)), "cosine": (g * t).sum() / np.linalg.norm(g) / np.linalg.norm(t),
            "top1": agree.mean(), "decisive_misses": int((~agree & (margin(t) > tie)).sum())}


def assert_same(check, want: dict) -> None:
    for k, v in want.items():
        assert getattr(check, k) == pytest.approx(v, rel=1e-9, abs=1e-300), f"{k}: {getattr(check, k)} != {v}"


def seeded_logits(seed: int = 0) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = rng.normal(size=(3, 7, 1000)) * 4  # [batch, seq, vocab]
    refs = [(truth + rng.normal(size=truth.shape) * 1e-6).astype(np.float32) for _ in range(2)]
    got = (truth + rng.normal(size=truth.shape) * 2e-6).astype(np.float32)
    got[0, 3] = truth[0, 3] + 0.0  # one exact row
    got[1, 2, truth[1, 2].argmax()] -= 20.0  # a decisive top-1 miss
    valid = np.ones((3, 7), bool)
    valid[1, :2] = valid[2, :4] = False  # left padding
    return got, refs, truth, valid


@pytest.mark.parametrize("rows, cols", [(1, 1000), (2, 7), (5, 333), (11, 1), (100, 64)])
def test_chunked_sums_are_the_whole_tensors_figures(rows, cols):
    got, refs, truth, valid = seeded_logits()
    want = whole_figures(got, refs, truth, valid)
    g, t, rs = got[valid], truth[valid], [r[valid] for r in refs]  # [positions, vocab]
    sums = JudgeSums(len(t), len(rs), logits=True)
    for c in range(0, t.shape[1], cols)[::-1]:  # the columns in any order: a slab's place is its offset
        for p in range(0, len(t), rows):
            cut = (slice(p, p + rows), slice(c, c + cols))
            sums.add(p, c, g[cut], [r[cut] for r in rs], t[cut])
    check = sums.check("logits", "float32", None, 0)
    assert_same(check, want)
    assert check.decisive_misses == 1 and not check.passed
    assert_same(judge("logits", got, refs, truth, valid, "float32", logits=True), want)  # the whole-tensor entry


def test_argmax_ties_keep_the_first_index_across_chunks():
    t = np.zeros((1, 1, 6))
    t[0, 0, [1, 4]] = 2.0  # a tie split across two chunks: argmax says 1
    sums = JudgeSums(1, 1, logits=True)
    for c in (3, 0):
        sums.add(0, c, t[0][:, c:c + 3], [t[0][:, c:c + 3]], t[0][:, c:c + 3])
    assert sums.t_arg.tolist() == [1] and sums.g_arg.tolist() == [1] and sums.t_best[0] - sums.t_second[0] == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny2"
    save_checkpoint(CFG, {k: v.detach().clone() for k, v in sharp(CFG).state_dict().items()}, d, to="hf")
    out = tmp_path_factory.mktemp("fused") / "model.onnx"
    export_fused(str(d), out, external_data_threshold_bytes=0)
    return d, out


def run_head(exported, monkeypatch, elements: int, corrupt: bool = False):
    """verify parity --by-layer's head check, the head made HEAD_CHUNK_ELEMENTS at a time; the rows read recorded."""
    from llama_tools.exporters.verification.by_layer import _by_layer

    d, out = exported
    monkeypatch.setattr(by_layer, "HEAD_CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(by_layer, "HEAD_MIN_COLUMNS", 1)
    read, cut = [], []
    rows = CheckpointReader.rows
    monkeypatch.setattr(CheckpointReader, "rows", lambda self, name, ranges, device="cpu": read.append(
        (name, sum(b - a for a, b in ranges))) or rows(self, name, ranges, device))
    vocab_rows = by_layer.GraphBlocks.vocab_rows

    def cut_rows(self, t, vocab, start, stop):
        s = vocab_rows(self, t, vocab, start, stop)
        cut.append((t.name, list(s.dims)))
        return s
    monkeypatch.setattr(by_layer.GraphBlocks, "vocab_rows", cut_rows)
    calls = []
    run = by_layer.BlockRunner._run

    def spoiled(self, sess, b, z, ids, mask):
        o = run(self, sess, b, z, ids, mask)
        if b.name == by_layer.HEAD:
            calls.append(o["logits"].shape)
            if corrupt and len(calls) == expected_calls:  # the last slab's last chunk of positions
                o["logits"][0, -1, -1] += 50.0
        return o
    monkeypatch.setattr(by_layer.BlockRunner, "_run", spoiled)
    positions = sum(map(len, PROMPTS))
    cols = min(CFG.vocab_size, max(1, elements // positions))
    expected_calls = -(-CFG.vocab_size // cols) * -(-positions // max(1, elements // cols))
    rep = _by_layer(out, resolve_target(str(out), str(d)), PROMPTS, "cpu", False, None, lambda *a: None)
    assert len(calls) == expected_calls
    return rep, read, cut, cols


def test_head_in_slabs_gives_the_whole_heads_figures(exported, monkeypatch):
    whole, _, cut, _ = run_head(exported, monkeypatch, 1 << 21)
    assert cut == []  # one slab: the whole vocabulary, the head block as the graph has it
    rep, read, cut, cols = run_head(exported, monkeypatch, 100)  # 15 positions x 6 columns a chunk
    assert cols == 6
    a, b = whole.blocks[-1].checks[0], rep.blocks[-1].checks[0]
    for k in ("scale", "top1", "decisive_misses", "cosine"):  # float64's own figures, and the argmaxes
        assert getattr(b, k) == pytest.approx(getattr(a, k), rel=1e-9), k
    # fp32 products of another shape ([6 columns] against [512]) are another blocking of the same sums: their
    # rounding, and so the error and noise, move by a fraction of themselves (measured: 1e-3), not more
    for k in ("error", "noise", "max_error", "max_noise"):
        assert getattr(b, k) == pytest.approx(getattr(a, k), rel=0.05), k
    assert rep.passed
    # Never the whole embedding/lm_head: the reference reads a slab of rows (or the ids' rows), the graph's head
    # block holds a slab of its table.
    head = [k for n, k in read if n == "lm_head.weight"]  # untied: the embedding is read for Z^0 alone
    assert head and max(head) <= cols and sum(head) == CFG.vocab_size  # each row read once, for all three sides
    embed = [k for n, k in read if n == "model.embed_tokens.weight"]
    assert embed and max(embed) <= len({0, *(i for p in PROMPTS for i in p)})  # the ids' rows (padding's 0), no more
    assert cut and all(math.prod(dims) <= cols * CFG.hidden_size for _, dims in cut)  # [64, 6]: lm_head.MatMul


@pytest.mark.parametrize("elements", [100, 1 << 21])  # many chunks (the last of both axes), and one
def test_a_corrupted_logit_in_the_last_chunk_fails(exported, monkeypatch, elements):
    rep, *_ = run_head(exported, monkeypatch, elements, corrupt=True)
    head = rep.blocks[-1]
    assert not head.passed and rep.first_bad == "logits only"
    assert "error over budget" in head.checks[0].verdict
    assert head.checks[0].max_error == pytest.approx(50.0, rel=1e-3)
