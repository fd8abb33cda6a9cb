"""Activation-aware input scales ("awq"): the search is never worse than none on its own measure, the rescaled graph
computes what the full-precision one does, and the sensitivity pass emulates exactly the blocks the graph holds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from llama_tools.exporters import int4_blocks as ib
from llama_tools.exporters import int4_scales


def _weighted_error(w: np.ndarray, q: np.ndarray, a: np.ndarray) -> float:
    return float((a * (w.astype(np.float64) - q) ** 2).sum())


def test_the_search_is_never_worse_than_no_scale_and_favours_a_busy_input():
    rng = np.random.default_rng(0)
    n, k = 64, 128
    w = rng.normal(0, 0.02, (n, k)).astype(np.float32)
    a = rng.uniform(0.5, 1.5, k)
    a[[3, 40, 77]] = 400.0  # three inputs far larger on text than the rest (as real activations have)
    s, alpha = int4_scales._search(lambda i, j: np.ascontiguousarray(w.T[:, i:j]), k, n, a, 32, None)
    assert s.shape == (k,) and s.dtype == np.float32 and alpha in int4_scales.ALPHAS
    plain = _weighted_error(w, ib.search(w, a.astype(np.float32)).dequantize(), a)  # alpha 0: imatrix itself
    scaled = _weighted_error(w, ib.search(w * s, (a / s**2).astype(np.float32)).dequantize() / s, a)
    assert alpha > 0 and s[3] > s[0] and scaled < plain
    # uniform importance: every alpha gives s = 1, the search keeps imatrix
    s1, _ = int4_scales._search(lambda i, j: np.ascontiguousarray(w.T[:, i:j]), k, n, np.ones(k), 32, None)
    np.testing.assert_array_equal(s1, np.ones(k, np.float32))


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import importance, quantize_nodes
    from llama_tools.exporters.quantize import plan_scales
    from llama_tools.inference.reference import reference_model

    tmp = tmp_path_factory.mktemp("awq")
    src = resolve("tiny")
    full = tmp / "full.onnx"
    export_fused("tiny", full)
    nodes = quantize_nodes(full, {})
    got = importance(reference_model(src), list(range(5, 69)), nodes)
    return src, full, nodes, got, plan_scales(full, got)


def test_the_rescaled_graph_computes_what_the_full_precision_one_does(tiny_awq, tmp_path, monkeypatch):
    """With every matrix 8-bit (near exact) and scales far from 1 (0.5x..2x), the awq graph's logits are as close
    to the fp32 graph's as imatrix's; with the norms' gains put back as they were, they are not (the fold is what
    keeps the function)."""
    from llama_tools.exporters.int4_target import onnx_logits
    from llama_tools.exporters.quantize import plan_scales, quantize_int4

    src, full, nodes, got, searched = tiny_awq
    layers = src.cfg.num_hidden_layers
    assert len(searched.alphas) == 3 * layers  # qkv, gate_up and down of every layer searched
    chosen = [node for node, a in searched.alphas.items() if a > 0]  # alpha 0 is s = 1: nothing folded
    assert sorted(searched.inputs) == sorted(chosen) and len(searched.gains) == len(
        [n for n in chosen if "down_proj" not in n])
    rng = np.random.default_rng(1)
    monkeypatch.setattr(int4_scales, "_search", lambda cols, k, *a: (
        np.exp(rng.uniform(np.log(0.5), np.log(2), k)).astype(np.float32), 1.0))
    scales = plan_scales(full, got)
    assert len(scales.inputs) == 3 * layers and len(scales.gains) == 2 * layers and len(scales.outputs) == layers
    ids = list(range(7, 39))
    want = onnx_logits(full, src.cfg, ids)
    errors = {}
    for algorithm in ("imatrix", "awq"):
        out = quantize_int4(full, tmp_path / f"{algorithm}.onnx", algorithm=algorithm, importance=got,
                            keep_8bit=tuple(nodes), scales=scales)
        assert out.scaled == (3 * layers if algorithm == "awq" else 0)
        errors[algorithm] = np.abs(onnx_logits(out.path, src.cfg, ids) - want).max()
    assert errors["awq"] <= 2 * errors["imatrix"] + 1e-4, errors
    # negative: the awq graph with the fp32 graph's gains computes another function
    m = onnx.load(str(tmp_path / "awq.onnx"))
    fp = {t.name: t for t in onnx.load(str(full)).graph.initializer}
    for i, t in enumerate(m.graph.initializer):
        if t.name in scales.gains:
            m.graph.initializer[i].CopyFrom(fp[t.name])
    onnx.save(m, str(tmp_path / "unfolded.onnx"))
    assert np.abs(onnx_logits(tmp_path / "unfolded.onnx", src.cfg, ids) - want).max() > 10 * errors["awq"]


def test_the_emulation_is_what_the_graph_holds(tiny_awq, tmp_path):
    """Scales.emulate maps the reference's W (a part of a packed matrix, its rows given) to exactly the int4 blocks
    the awq graph holds, mapped back: for gate_up's up rows that includes dividing by down_proj's scale."""
    from llama_tools.exporters.int4_target import imatrix_emulation
    from llama_tools.exporters.quantize import _weights_of, quantize_int4

    src, full, nodes, got, scales = tiny_awq
    out = quantize_int4(full, tmp_path / "awq.onnx", algorithm="awq", importance=got, scales=scales)
    m = onnx.load(str(out.path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    fp = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(full)).graph.initializer}
    weights = _weights_of(onnx.load(str(full)))
    emulate = imatrix_emulation(got, 32, scales)
    n7 = src.cfg.intermediate_size
    for node, rows in (("/model/layers.0/mlp/down_proj/MatMul", None),
                       ("/model/layers.1/mlp/gate_up_proj/MatMul", slice(n7, 2 * n7))):
        name, transposed = weights[node]
        w = fp[name] if transposed else fp[name].T  # [out, in] of the packed matrix
        part = w[rows] if rows is not None else w
        nb = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.startswith(node))
        held = ib.unpack(inits[nb.input[1]], inits[nb.input[2]], inits[nb.input[3]], bits=4, k=w.shape[1])
        held = held[rows] if rows is not None else held
        d = scales.outputs[node][rows][:, None] if node in scales.outputs else 1.0
        mapped = held / scales.inputs[node][None, :] * d  # the graph's blocks in the reference's terms
        np.testing.assert_allclose(emulate(torch.from_numpy(part.copy()), node, rows).numpy(), mapped,
                                   rtol=1e-6, atol=1e-7)
        # negative: without the scales the emulation is plain imatrix, another set of blocks
        assert not np.allclose(imatrix_emulation(got, 32)(torch.from_numpy(part.copy()), node).numpy(), mapped,
                               rtol=1e-6, atol=1e-7)


def test_the_block_store_gives_the_graph_and_the_emulation_the_same_blocks_searched_once(tiny_awq, tmp_path):
    """A BlockStore shared by the sensitivity emulation and the candidate graphs: each graph built through it holds
    exactly the blocks a graph built without it holds, its emulation equals imatrix_emulation's, and a matrix is
    searched once (a second graph with other matrices 8-bit, the head split in two, searches nothing)."""
    from llama_tools.exporters.int4_blocks import BlockStore
    from llama_tools.exporters.int4_target import imatrix_emulation, stored_emulation
    from llama_tools.exporters.quant_options import HEAD, HEAD_FREQUENT
    from llama_tools.exporters.quantize import _weights_of, quantize_int4

    src, full, nodes, got, scales = tiny_awq
    store = BlockStore(tmp_path / "blocks")
    emulate, plain = stored_emulation(store, full, got, 32, scales), imatrix_emulation(got, 32, scales)
    fp = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(full)).graph.initializer}
    weights = _weights_of(onnx.load(str(full)))
    n7 = src.cfg.intermediate_size
    for node, rows in (("/model/layers.0/mlp/down_proj/MatMul", None), ("/model/layers.1/mlp/gate_up_proj/MatMul",
                                                                        slice(n7, 2 * n7)), (HEAD, slice(100, 300))):
        name, transposed = weights[node]
        w = torch.from_numpy((fp[name] if transposed else fp[name].T).copy())  # [out, in] of the packed matrix
        rows = rows or slice(0, w.shape[0])
        np.testing.assert_allclose(emulate(w[rows], node, rows).numpy(), plain(w[rows], node, rows).numpy(),
                                   rtol=1e-6, atol=1e-7)
    searched = store.searched
    assert searched == 3  # one chunk each: tiny's matrices are small
    blocks = lambda path: {t.name: numpy_helper.to_array(t).tobytes() for t in onnx.load(str(path)).graph.initializer}
    for keep in ((), ("/model/layers.0/mlp/down_proj/MatMul", HEAD_FREQUENT)):
        alone = quantize_int4(full, tmp_path / "alone.onnx", algorithm="awq", importance=got, scales=scales,
                              keep_8bit=keep)
        shared = quantize_int4(full, tmp_path / "shared.onnx", algorithm="awq", importance=got, scales=scales,
                               keep_8bit=keep, store=store)
        assert blocks(alone.path) == blocks(shared.path), keep
        if not keep:  # the first graph searched what the emulation had not
            searched = store.searched
            assert searched == len(nodes) > 3
    assert store.searched == searched  # the second graph, head split and one matrix 8-bit, searched nothing
    # negative: a store filled under other importances is not what this graph needs
    wrong = BlockStore(tmp_path / "wrong")
    other = quantize_int4(full, tmp_path / "other.onnx", algorithm="imatrix", importance=got, store=wrong)
    assert blocks(other.path) != blocks(alone.path)
