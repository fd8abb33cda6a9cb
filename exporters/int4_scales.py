"""Activation-aware input scales ("awq"): each matrix's inputs rescaled, exactly, before its int4 blocks are searched.

A MatMul x W^T computes the same with x / s and W diag(s) for any positive s over the inputs. When x is the output of
an RMSNorm, x / s is that norm with its gain divided by s; when x is act(gate) * up, it is up's rows divided by s.
So the fp graph is unchanged (to fp rounding), but int4 now rounds W diag(s): an input that is large on real text
(a_k = E[x_k^2] high) gets its column scaled up, and its weights a finer share of each block's 16 levels. With
s = rms^alpha (rms_k = sqrt(a_k)), alpha is searched per matrix group over ALPHAS on the importance-weighted error

    sum_k  a_k  sum_n  (W[n, k] - Q(W diag(s))[n, k] / s_k)^2

(alpha = 0 is s = 1: plain imatrix, so on the rows it measures the search is never worse; tests/test_int4_scales.py).
Measured on SmolLM2-135M (PyTorch emulation, 192 calibration tokens, lm_head 8-bit): mean KL on the export's check
text 0.232 -> 0.148 nats, on held-out text 0.142 -> 0.092 (AWQ, Lin et al. 2023, searches the same alpha on the
layer's output error; the diagonal measure here came within 0.016 nats of it).

    fused layer j:  input_layernorm (γ / s_qkv) ──► qkv_proj  W diag(s_qkv)
                    post_attention (or pre_feedforward) norm (γ / s_gu) ──► gate_up_proj  W diag(s_gu), up rows / s_d
                    act(gate) * (up / s_d) ──► down_proj  W diag(s_d)
    o_proj (its input is attention's output: folding into v splits across the heads that share it) and the lm_head
    (tied to the embedding) keep s = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import int4_blocks

ALGORITHM = "awq"
ALPHAS = tuple(a / 10 for a in range(9))  # searched exponents; measured best on SmolLM2-135M: 0.0-0.7
SEARCH_ROWS = 512  # output rows of W the alpha search measures on (evenly spread): the error is a sum over rows
FINALISTS = 3  # alphas (besides 0) the block search judges: round to nearest's best and the two below it
# The finalists are judged by int4_blocks.LIGHT, a lighter block search than the graph's: on 16 of SmolLM2-135M's
# matrices it chose the alpha the full search chose on all 16. The chosen alpha's blocks are then searched in full,
# once, for the graph.
_NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # op -> its gain's input index


@dataclass
class Scales:
    """Per MatMul node: its inputs' scale s [k] (W^T's rows times s) and, for a matrix whose outputs feed a scaled
    input, its outputs' divisor [n] (W^T's columns over it); per norm-gain initializer: the gain's divisor."""

    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    gains: dict[str, np.ndarray] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)

    def columns(self, node: str, cols: Callable[[int, int], np.ndarray]) -> Callable[[int, int], np.ndarray]:
        """cols(a, b) -> W^T[:, a:b] as the scaled graph holds it (node's inputs times s, outputs over theirs)."""
        s, d = self.inputs.get(node), self.outputs.get(node)
        if s is None and d is None:
            return cols

        def scaled(a: int, b: int) -> np.ndarray:
            w = cols(a, b).astype(np.float32)  # a copy of its own, scaled in place
            if s is not None:
                np.multiply(w, s[:, None], out=w)
            if d is not None:
                np.divide(w, d[None, a:b], out=w)
            return w
        return scaled

    def importance(self, node: str, a: Any) -> Any:
        """The node's input importance after scaling: E[(x_k / s_k)^2] = a_k / s_k^2."""
        s = self.inputs.get(node)
        return a if s is None or a is None else np.asarray(a, np.float32) / s**2

    def emulate(self, w: Any, node: str, rows: slice | None, quant: Callable[[Any, Any], Any], a: Any) -> Any:
        """W [n, k] of the reference (torch; `rows`: its rows inside the node's packed matrix) -> what the scaled
        int4 graph computes with: Q(W diag(s) / d) diag(1/s) * d, with quant(W', importance) the int4 emulation."""
        import torch

        s, d = self.inputs.get(node), self.outputs.get(node)
        if s is None and d is None:
            return quant(w, a)
        st = torch.ones(w.shape[1], dtype=w.dtype) if s is None else torch.as_tensor(s, dtype=w.dtype)
        dt = torch.ones(w.shape[0], dtype=w.dtype) if d is None else torch.as_tensor(d[rows], dtype=w.dtype)
        return quant(w * st[None, :] / dt[:, None], self.importance(node, a)) / st[None, :] * dt[:, None]


def plan(graph: Any, weights: dict[str, tuple[str, bool]], read: Callable[[str], tuple[int, int, Any]],
         importance: dict[str, Any], block: int, skip: tuple[str, ...] = (),
         progress: Callable[[int, int, str], None] = lambda *a: None) -> Scales:
    """The scales for every fused decoder layer whose structure allows them (the table above), alpha searched.

    weights: quantize._weights_of; read(node) -> (k, n, cols) of its weight; importance: node -> a [k]; skip: nodes
    kept in full precision (not rescaled). A layer in another shape (the plain graph, biases on the MLP) keeps s = 1.
    """
    made = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    inits = {t.name for t in graph.initializer}
    layers = sorted({int(name.split("/")[2].split(".")[1]) for name in weights
                     if name.startswith("/model/layers.") and name.endswith("/mlp/down_proj/MatMul")})
    out = Scales()
    for j in layers:
        qkv, gu, down = (f"/model/layers.{j}/self_attn/qkv_proj/MatMul", f"/model/layers.{j}/mlp/gate_up_proj/MatMul",
                         f"/model/layers.{j}/mlp/down_proj/MatMul")
        nodes = {n.name: n for n in graph.node if n.name in (qkv, gu, down)}
        if down in nodes and gu in nodes and down not in skip and gu not in skip and \
                _feeds_up(nodes[down], nodes[gu], made, readers) and down in importance:
            k, n, cols = read(down)
            s, alpha = _search(cols, k, n, importance[down], block, None)
            out.alphas[down] = alpha
            if alpha > 0:  # alpha 0 is s = 1: nothing to fold
                out.inputs[down] = s
                n_gu = read(gu)[1]
                out.outputs[gu] = np.concatenate([np.ones(n_gu - k, np.float32), s])  # [gate | up]: up's rows / s_d
        for node in (qkv, gu):
            if node not in nodes or node in skip or node not in importance:
                continue
            gain = _norm_gain(nodes[node], made, readers, inits)
            if gain is None:
                continue
            k, n, cols = read(node)
            s, alpha = _search(cols, k, n, importance[node], block, out.outputs.get(node))
            out.alphas[node] = alpha
            if alpha > 0:
                out.inputs[node] = out.gains[gain] = s
        progress(j + 1, len(layers), "int4 input scales")
    return out


def _search(cols: Callable[[int, int], np.ndarray], k: int, n: int, a: Any, block: int,
            divisor: np.ndarray | None) -> tuple[np.ndarray, float]:
    """(s [k], alpha): the ALPHAS entry whose s = rms^alpha gives the least importance-weighted error of W's int4
    blocks, measured on SEARCH_ROWS rows of W spread over n."""
    a = np.maximum(np.asarray(a, np.float64).reshape(-1), 0.0)
    assert a.size == k, f"importance has {a.size} values for {k} inputs"
    picks = np.unique(np.linspace(0, n - 1, min(n, SEARCH_ROWS)).round().astype(int))
    w = cols(0, n).T[picks].astype(np.float32)  # W rows [m, k]: one matrix read, as quantized (fp32, as searched)
    if divisor is not None:
        w = w / divisor[picks, None].astype(np.float32)
    rms = np.sqrt(np.maximum(a, a[a > 0].min() if (a > 0).any() else 1.0))  # unseen: as the least seen

    def scale(alpha: float) -> np.ndarray:
        s = rms**alpha
        return s / np.sqrt(s.max() * s.min())  # centred on 1: the gain and W stay in range

    # Round to nearest ranks every alpha (one rounding each, not the search's 18); the searched blocks then judge
    # its best, the FINALISTS - 1 alphas below it (round to nearest favours a larger alpha than the search) and alpha
    # 0, so the answer is never worse than s = 1 on these rows. Measured on SmolLM2-135M's 90 scaled matrices: the
    # alpha of a search over all nine on 86, a weighted error 0.05% over it on average (5.9% at worst), in 0.67x
    # the time.
    r = ALPHAS.index(min(ALPHAS[1:], key=lambda alpha: _error(w, a, scale(alpha), block, int4_blocks.RTN)))
    best: tuple[float, np.ndarray, float] | None = None
    for alpha in sorted({0.0, *ALPHAS[max(1, r - FINALISTS + 1):r + 1]}):
        s = scale(alpha)
        err = _error(w, a, s, block, int4_blocks.LIGHT)
        if best is None or err < best[0]:
            best = (err, s.astype(np.float32), alpha)
    assert best is not None
    return best[1], best[2]


def _error(w: np.ndarray, a: np.ndarray, s: np.ndarray, block: int, options: dict[str, Any]) -> float:
    """sum_k a_k sum_n (W - Q(W diag(s)) / s)^2 = sum_k (a_k / s_k^2) sum_n (W' - Q(W'))^2 with W' = W diag(s): the
    weighted error int4_blocks' search (with `options`) measures on W' with importance a / s^2, block by block."""
    blocks = int4_blocks.search(w * s.astype(np.float32), (a / s**2).astype(np.float32), block=block, **options)
    assert blocks.errors is not None
    return float(blocks.errors.sum(dtype=np.float64))


def _norm_gain(node: Any, made: dict[str, Any], readers: dict[str, list[Any]], inits: set[str]) -> str | None:
    """The gain initializer of the RMSNorm whose output only this MatMul reads, or None (s stays 1)."""
    norm = made.get(node.input[0])
    if norm is None or norm.op_type not in _NORMS or norm.domain not in ("", "ai.onnx", "com.microsoft") or \
            norm.output[0] != node.input[0] or [r.name for r in readers.get(node.input[0], [])] != [node.name]:
        return None
    gain = norm.input[_NORMS[norm.op_type]]
    return gain if gain in inits and len(readers.get(gain, [])) == 1 else None


def _feeds_up(down: Any, gu: Any, made: dict[str, Any], readers: dict[str, list[Any]]) -> bool:
    """down's input is act(gate) * up with up the second half of gate_up's own output (no bias between)."""
    mul = made.get(down.input[0])
    if mul is None or mul.op_type != "Mul" or [r.name for r in readers.get(down.input[0], [])] != [down.name]:
        return False
    split = made.get(mul.input[1])
    return (split is not None and split.op_type == "Split" and split.output[1] == mul.input[1]
            and split.input[0] == gu.output[0] and len(readers.get(mul.input[1], [])) == 1)


def apply_gains(graph: Any, base: Path, scales: Scales) -> None:
    """Each scaled norm's gain divided by its s, the tensor then held inside the graph (n2 values)."""
    from onnx import numpy_helper

    for i, t in enumerate(graph.initializer):
        s = scales.gains.get(t.name)
        if s is None:
            continue
        g = numpy_helper.to_array(t, base_dir=str(base))
        assert g.shape == s.shape, f"{t.name}: gain {g.shape} for scales {s.shape}"
        graph.initializer[i].CopyFrom(numpy_helper.from_array((g.astype(np.float32) / s).astype(g.dtype), t.name))
