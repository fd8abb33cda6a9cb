"""Comparing an ONNX output with PyTorch: the error budget against float64 (`judge`), and fixed tolerances (`compare`).

The budget (what `verify parity` decides by): three tensors of the same model on the same inputs,

    got   - the graph on onnxruntime                 error = stat|got - truth|
    ref   - PyTorch in the graph's dtype             noise = stat|ref - truth|   (what rounding alone costs here)
    truth - PyTorch in float64

PASS when error <= multiple x noise + floor, the cosine to the truth is above a floor, no NaN/Inf, and no
decisive top-1 miss. `stat` is the RMS over the valid positions; the README's Tolerances section has the
measurements behind the statistic and the multiple. `compare`/`Tolerance` remain for graph-to-graph checks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from llama_tools.modeling import dtypes


@dataclass(frozen=True)
class Tolerance:
    """Pass when max|onnx - torch| <= atol + rtol * max|torch|, cosine >= min_cosine, no decisive top-1 miss."""

    atol: float
    rtol: float
    min_cosine: float

    def bound(self, ref_scale: float) -> float:
        return self.atol + self.rtol * ref_scale


# (graph dtype, provider) -> tolerance; fp32 on CPU is the 1e-4 on logits.
_F32, _F16, _BF16 = dtypes.FLOAT32.name, dtypes.FLOAT16.name, dtypes.BFLOAT16.name
TOLERANCES = {
    (_F32, "cpu"): Tolerance(1e-4, 0.0, 0.99999),
    (_F32, "cuda"): Tolerance(1e-3, 1e-4, 0.9999),
    (_F32, "cuda-tf32"): Tolerance(1e-2, 1e-3, 0.999),  # --tf32: MatMuls with 10-bit mantissas
    (_F16, "cpu"): Tolerance(0.0, 2e-2, 0.999),
    (_F16, "cuda"): Tolerance(0.0, 2e-2, 0.999),
    (_BF16, "cpu"): Tolerance(0.0, 6e-2, 0.995),
    (_BF16, "cuda"): Tolerance(0.0, 6e-2, 0.995),
}


@dataclass(frozen=True)
class TensorCheck:
    name: str  # "logits", "present.3.key", "decode logits"
    max_abs: float
    max_rel: float  # max abs error / max |reference|
    cosine: float
    top1: float | None  # fraction of positions whose argmax agrees (logits only)
    decisive_misses: int  # argmax differs where the reference's top-2 margin exceeds the tolerance
    nonfinite: int  # NaN or Inf in the ONNX output, anywhere (padding included)
    bound: float  # the max abs error allowed
    passed: bool

    @property
    def verdict(self) -> str:
        """'pass', or FAIL with the first reason."""
        if self.passed:
            return "pass"
        if self.nonfinite:
            return f"FAIL: {self.nonfinite} NaN/Inf"
        if not self.max_abs <= self.bound:
            return "FAIL: max abs > bound"
        if self.decisive_misses:
            return f"FAIL: {self.decisive_misses} decisive top-1 misses"
        return "FAIL: cosine too low"


@dataclass(frozen=True)
class DecodeCheck:
    steps: int
    agreed: int  # steps at which every row's ONNX argmax equals the reference's
    first_divergence: int | None  # step index, None when every step agrees
    divergence: str  # what happened there, in words
    reference_ids: list[list[int]]  # the greedy continuation per row (PyTorch)
    onnx_ids: list[list[int]]  # the ONNX argmax per row and step
    passed: bool


# --- Comparing two tensors ----------------------------------------------------------------------

def compare(name: str, got: np.ndarray, ref: np.ndarray, valid: np.ndarray, tol: Tolerance,
            logits: bool = False) -> TensorCheck:
    """got/ref: [batch, seq, ...] after moving the position axis to 1; valid: [batch, seq] bool."""
    assert got.shape == ref.shape, f"{name}: ONNX shape {got.shape} != PyTorch shape {ref.shape}"
    assert valid.shape == got.shape[:2], f"{name}: mask {valid.shape} does not match {got.shape[:2]}"
    nonfinite = int(np.size(got) - np.isfinite(got).sum())
    g, r = got[valid].astype(np.float64), ref[valid].astype(np.float64)  # [positions, ...]
    scale = float(np.abs(r).max()) if r.size else 0.0
    bound = tol.bound(scale)
    if nonfinite:
        max_abs = cos = float("nan")
    else:
        max_abs = float(np.abs(g - r).max()) if r.size else 0.0
        denom = np.linalg.norm(g) * np.linalg.norm(r)
        cos = float((g * r).sum() / denom) if denom else 1.0
    top1, misses = None, 0
    if logits:
        g2, r2 = g.reshape(-1, g.shape[-1]), r.reshape(-1, r.shape[-1])  # [positions, vocab]
        agree = g2.argmax(-1) == r2.argmax(-1)
        top1 = float(agree.mean()) if agree.size else 1.0
        misses = int(((~agree) & (margin(r2) > bound)).sum())
    passed = nonfinite == 0 and max_abs <= bound and cos >= tol.min_cosine and misses == 0
    return TensorCheck(name, max_abs, max_abs / scale if scale else 0.0, cos, top1, misses, nonfinite, bound, passed)


def margin(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row: how decisive the reference's choice is."""
    top2 = np.partition(logits, -2, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]




# --- The error budget against float64 ---------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """PASS when error <= multiple x noise + floor_ulps x eps(dtype) x rms|truth|, cosine >= min_cosine.

    Both figures are RMS over the valid positions. The floor is a rounding unit of the graph's dtype at the
    tensor's typical size: an output stored in that dtype cannot be nearer, and it keeps an exact tensor
    (noise 0, e.g. zero weights) from demanding an exact graph.
    """

    multiple: float
    floor_ulps: float
    min_cosine: float

    def floor(self, dtype: str, truth_rms: float) -> float:
        return self.floor_ulps * EPS[dtype] * truth_rms

    def bound(self, noise: float, floor: float) -> float:
        return self.multiple * noise + floor


# Machine epsilon (one unit in the last place at 1.0) of each graph dtype.
EPS = {_F32: float(np.finfo(np.float32).eps), _F16: float(np.finfo(np.float16).eps), _BF16: 2.0 ** -7}
# One multiple for every dtype and graph: see README "Tolerances" for the measured ratios it covers.
BUDGET = {_F32: Budget(8.0, 1.0, 0.99999), _F16: Budget(8.0, 1.0, 0.999), _BF16: Budget(8.0, 1.0, 0.995)}
DTYPE_LABEL = {_F32: "fp32", _F16: "fp16", _BF16: "bf16"}
DTYPE_MAX = {_F16: 65504.0}  # the largest finite value, where a model's numbers can pass it (fp32 and bf16: ~3.4e38)


@dataclass(frozen=True)
class BudgetCheck:
    """One tensor judged against float64; `passed` and `verdict` are read from the figures it shows."""

    name: str  # "logits", "present.3.key", "decode logits"
    dtype: str  # the graph's, and the reference's that gives the noise
    error: float  # RMS |graph - float64| over the valid positions
    noise: float  # RMS |PyTorch in dtype - float64|
    floor: float
    multiple: float
    max_error: float  # max |graph - float64| (shown, not judged: a max of a few noisy values is unstable)
    max_noise: float  # max |PyTorch in dtype - float64|
    scale: float  # RMS |float64|
    cosine: float  # graph against float64
    min_cosine: float
    top1: float | None  # fraction of positions whose argmax equals float64's (logits only)
    decisive_misses: int  # argmax differs where float64's top-2 margin exceeds `tie`
    tie: float  # the margin a within-budget error could flip: 2 x (multiple x max_noise + floor)
    nonfinite: int  # NaN or Inf in the graph's output, anywhere (padding included)
    # Each correct implementation's RMS error to float64 (PyTorch, then PyTorch with its sums reassociated);
    # `noise` is the largest: what any of them differs by.
    noises: tuple[float, ...] = ()
    # How `noise` was had: "" measured in the dtype; else the words of the estimate used instead (the fp16 fallback)
    estimate: str = ""
    peak: float = 0.0  # max |float64| over the valid positions: past the dtype's largest finite value, it cannot hold it

    @property
    def bound(self) -> float:
        return self.multiple * self.noise + self.floor

    @property
    def ratio(self) -> float:
        """error / noise: how many times the reference's own rounding the graph is off."""
        if self.noise > 0:
            return self.error / self.noise
        return 0.0 if self.error == 0 else math.inf

    @property
    def allowed_ratio(self) -> float:
        """The bound as a multiple of the noise (the multiple, plus the floor's share)."""
        return self.bound / self.noise if self.noise > 0 else math.inf

    @property
    def failures(self) -> list[str]:
        why = []
        if self.nonfinite:
            why.append(f"{self.nonfinite} NaN/Inf in the graph's output (it overflows)")
        largest = DTYPE_MAX.get(self.dtype, math.inf)
        if self.peak > largest:
            # The model's own value is out of the dtype's range: no graph in it can hold it (Gemma 3's residual
            # stream reaches 68,398 at layer 8 on the built-in text, past fp16's 65,504).
            label = DTYPE_LABEL.get(self.dtype, self.dtype)
            why.append(f"float64 reaches {self.peak:,.0f}, past {label}'s largest {largest:,.0f}: {label} cannot hold "
                       f"this model's numbers here; export it in fp32 (or bf16)")
        if not math.isfinite(self.noise) and math.isfinite(self.scale):
            # Every correct implementation in this dtype overflowed where float64 did not: the dtype cannot hold
            # this model's numbers (Gemma's residual stream passes fp16's 65504), so no noise can judge the graph.
            label = DTYPE_LABEL.get(self.dtype, self.dtype)
            why.append(f"PyTorch {label} overflows (NaN/Inf) where float64 is finite: {label} cannot hold this "
                       f"model's numbers; export it in fp32 (or bf16)")
        elif not self.error <= self.bound:
            why.append("error over budget")
        if not self.cosine >= self.min_cosine:
            why.append(f"cosine < {self.min_cosine}")
        if self.decisive_misses:
            why.append(f"{self.decisive_misses} decisive top-1 misses")
        return why

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL: " + "; ".join(self.failures)

    def figures(self, graph: str = "onnxruntime") -> str:
        """`onnxruntime 2.2e-4, PyTorch fp32 6.1e-5 (3.6x; bound 8x)`: both errors to float64, and their ratio."""
        allowed = self.allowed_ratio
        bound = f"bound {allowed:.3g}x" if math.isfinite(allowed) else f"bound {self.bound:.2g}"
        ref = f"PyTorch {DTYPE_LABEL.get(self.dtype, self.dtype)}" if not self.estimate else self.estimate
        return f"{graph} {self.error:.2g}, {ref} {self.noise:.2g} ({self.ratio:.2g}x; {bound})"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "bound": self.bound, "ratio": self.ratio,
                "allowed_ratio": self.allowed_ratio, "passed": self.passed, "verdict": self.verdict}


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


# Elements of a tensor judged at once (float64 copies of this many: 16 MiB each), so a [batch, seq, 152k] logits
# tensor never has a whole float64 twin.
CHUNK_ELEMENTS = 1 << 21


# PyTorch fp16's noise over PyTorch fp32's, both RMS to float64 on the same inputs: where PyTorch fp16 overflows
# but float64's values fit fp16 (Qwen2.5's whole graph from layer 6 on the built-in text; onnxruntime's fp16
# kernels accumulate in fp32 and stay finite), the fp16 noise is estimated as fp32's x this. Measured per layer
# and tensor where PyTorch fp16 is finite (benchmarks/bench_budget.py --fp16-ratio, built-in text): SmolLM2 by
# layer 1984-3414, whole graph 2591-4000; Qwen2.5-0.5B by layer 2705-4670, whole graph 2418-3284 (layers 0-5).
# The unit roundoffs' ratio 2^-11 / 2^-24 = 8192 overstates it (fp32's noise is mostly its sums' order, fp16's
# its roundings of inputs and outputs). The power of two under the smallest ratio measured is taken: the
# estimate is 0.2-0.5x the real fp16 noise, a tighter budget, never a looser one.
FP16_PER_FP32 = 1024.0


def judge(name: str, got: np.ndarray, ref: np.ndarray | Sequence[np.ndarray], truth: np.ndarray, valid: np.ndarray,
          dtype: str, budget: Budget | None = None, logits: bool = False,
          fallback: Callable[[], Sequence[np.ndarray]] | None = None, peak: float | None = None) -> BudgetCheck:
    """got/ref/truth: [batch, seq, ...] (positions on axis 1); valid: [batch, seq] bool; dtype: the graph's.

    ref: one correct implementation in the graph's dtype, or several (the noise is the largest of their errors).
    fallback (fp16 only): the same implementations in fp32, asked for only where a ref is not finite at a real
    position while float64 is; the noise is then theirs x FP16_PER_FP32, and `estimate` says so.
    peak: max |float64| in the tensor's own units, where `truth` was rescaled (by_layer.per_channel); else read here.
    """
    refs = [ref] if isinstance(ref, np.ndarray) else list(ref)
    assert refs and all(got.shape == r.shape == truth.shape for r in refs), \
        f"{name}: shapes {got.shape}, {[r.shape for r in refs]}, {truth.shape} differ"
    assert valid.shape == got.shape[:2], f"{name}: mask {valid.shape} does not match {got.shape[:2]}"
    where = np.nonzero(valid)  # the real positions, visited CHUNK_ELEMENTS at a time: float64 copies of a chunk only
    width = max(1, math.prod(got.shape[2:]))
    step = max(1, CHUNK_ELEMENTS // width)
    n = len(where[0])
    sums = JudgeSums(n, len(refs), logits)
    for a in range(0, n, step):
        idx = (where[0][a:a + step], where[1][a:a + step])
        sums.add(a, 0, got[idx], [r[idx] for r in refs], truth[idx])
    wide_sums = None
    if fallback is not None:
        def wide_sums() -> tuple[list[float], float]:
            wide = [np.asarray(r) for r in fallback()]
            assert all(r.shape == truth.shape for r in wide), f"{name}: fallback shapes differ from {truth.shape}"
            return _noise_sums(wide, truth, where, step)
    return sums.check(name, dtype, budget, int(np.size(got) - np.isfinite(got).sum()), wide_sums, peak)


ADD_ELEMENTS = 1 << 18  # elements JudgeSums widens to float64 at once


class JudgeSums:
    """What `judge` reads from a tensor, summed a chunk at a time: chunks of positions, and of the last axis too.

    A logits tensor of a 262,144-piece vocabulary is 1 MB a position in fp32: a caller that makes it a slab of
    vocabulary columns at a time (by_layer's head) adds each [positions, columns] chunk as it is made, and never
    holds it whole. Sums, maxima, argmaxes and top-2 margins are the whole tensor's (the sums' order aside).
    """

    def __init__(self, positions: int, refs: int, logits: bool = False):
        self.sq_t = self.sq_e = self.dot = self.sq_g = 0.0
        self.sq_r = [0.0] * refs
        self.max_error = self.max_noise = self.top = 0.0
        self.count = 0  # elements added
        self.positions, self.logits = positions, logits
        if logits:  # per position: the graph's best logit and its index, float64's best two and the best's index
            self.g_best, self.t_best, self.t_second = (np.full(positions, -np.inf) for _ in range(3))
            self.g_arg, self.t_arg = np.zeros(positions, np.int64), np.zeros(positions, np.int64)

    def add(self, first: int, column: int, got: np.ndarray, refs: Sequence[np.ndarray], truth: np.ndarray) -> None:
        """A chunk [p, ...] of positions first..first+p-1 (of the valid ones, in order); logits: [p, columns] from
        vocabulary column `column` on."""
        # A few positions at a time: each widened copy and difference below is one more float64 copy of the rows
        # (a 654 x 3206 logits chunk: 17 MB each, 0.1 GB of them at once).
        step = max(1, ADD_ELEMENTS // max(1, truth[:1].size))
        for p in range(0, truth.shape[0], step):
            self._add(first + p, column, got[p:p + step], [r[p:p + step] for r in refs], truth[p:p + step])

    def _add(self, first: int, column: int, got: np.ndarray, refs: Sequence[np.ndarray], truth: np.ndarray) -> None:
        g, t = got.astype(np.float64), truth.astype(np.float64)  # [chunk, ...]
        self.count += t.size
        self.sq_t += float(np.square(t).sum())
        self.top = max(self.top, float(np.abs(t).max()) if t.size else 0.0)
        for i, r in enumerate(refs):
            d = np.abs(r.astype(np.float64) - t)
            self.sq_r[i] += float(np.square(d).sum())
            self.max_noise = max(self.max_noise, float(d.max()) if d.size else 0.0)
        d = np.abs(g - t)  # NaN/Inf in the graph: these sums are not read (check() says why)
        self.sq_e += float(np.square(d).sum())
        self.max_error = max(self.max_error, float(d.max()) if d.size else 0.0)
        self.dot += float((g * t).sum())
        self.sq_g += float(np.square(g).sum())
        if self.logits and t.size:
            rows = slice(first, first + t.shape[0])
            g2, t2 = g.reshape(t.shape[0], -1), t.reshape(t.shape[0], -1)  # [chunk, columns]
            _better(self.g_best, self.g_arg, rows, g2, column)
            c1 = t2.max(-1)
            c2 = np.partition(t2, -2, axis=-1)[:, -2] if t2.shape[1] > 1 else np.full(len(c1), -np.inf)
            m1, m2 = self.t_best[rows].copy(), self.t_second[rows]
            self.t_second[rows] = np.maximum(np.minimum(m1, c1), np.maximum(m2, c2))  # second of {m1, m2, c1, c2}
            _better(self.t_best, self.t_arg, rows, t2, column)

    def check(self, name: str, dtype: str, budget: Budget | None, nonfinite: int,
              wide_sums: Callable[[], tuple[list[float], float]] | None = None,
              peak: float | None = None) -> BudgetCheck:
        """The BudgetCheck of everything added; nonfinite: NaN/Inf in the graph's tensor, padding included.

        wide_sums (fp16 only): the fp32 implementations' squared-error sums and max error, asked for only where
        the fp16 noise is not finite (judge's fallback)."""
        assert dtype in EPS, f"{name}: no rounding unit for dtype {dtype!r}"
        budget = budget or BUDGET[dtype]
        count = self.count
        scale = math.sqrt(self.sq_t / count) if count else 0.0
        floor = budget.floor(dtype, scale)
        noises = [math.sqrt(x / count) if count else 0.0 for x in self.sq_r]
        max_noise = self.max_noise
        peak = self.top if peak is None else peak
        estimate = ""
        if (wide_sums is not None and dtype == _F16 and not math.isfinite(max(noises)) and math.isfinite(self.sq_t)
                and peak <= DTYPE_MAX[_F16]):  # the values fit fp16: only PyTorch's arithmetic overflowed
            sq_w, max_w = wide_sums()
            if all(math.isfinite(x) for x in sq_w):  # fp32 overflowing too: nothing to estimate from, say so below
                noises = [FP16_PER_FP32 * (math.sqrt(x / count) if count else 0.0) for x in sq_w]
                max_noise = FP16_PER_FP32 * max_w
                estimate = f"PyTorch fp16 overflows: fp32 x {FP16_PER_FP32:g}"
        noise = max(noises)
        if nonfinite:
            error = max_error = cos = math.nan
        else:
            error, max_error = (math.sqrt(self.sq_e / count) if count else 0.0), self.max_error
            denom = math.sqrt(self.sq_g) * math.sqrt(self.sq_t)
            cos = self.dot / denom if denom else 1.0
        tie = 2 * (budget.multiple * max_noise + floor)
        top1, misses = None, 0
        if self.logits:
            agree = self.g_arg == self.t_arg
            top1 = float(agree.mean()) if agree.size else 1.0
            misses = int(((~agree) & (self.t_best - self.t_second > tie)).sum())
        return BudgetCheck(name, dtype, error, noise, floor, budget.multiple, max_error, max_noise, scale, cos,
                           budget.min_cosine, top1, misses, tie, nonfinite, tuple(noises), estimate, peak)


def _better(best: np.ndarray, arg: np.ndarray, rows: slice, chunk: np.ndarray, column: int) -> None:
    """Fold a chunk's row maxima into the running (best, arg) of its rows: the lowest index wins a tie, as argmax
    (whatever order the chunks come in)."""
    i = chunk.argmax(-1)  # [chunk]
    v = chunk[np.arange(len(i)), i]
    take = (v > best[rows]) | ((v == best[rows]) & (i + column < arg[rows]))
    best[rows] = np.where(take, v, best[rows])
    arg[rows] = np.where(take, i + column, arg[rows])


def _noise_sums(refs: Sequence[np.ndarray], truth: np.ndarray, where: tuple[np.ndarray, ...],
                step: int) -> tuple[list[float], float]:
    """Each ref's sum of squared errors to `truth` over the positions `where` (chunked as judge is), and the max."""
    sq = [0.0] * len(refs)
    top = 0.0
    for a in range(0, len(where[0]), step):
        idx = (where[0][a:a + step], where[1][a:a + step])
        t = truth[idx].astype(np.float64)
        for i, r in enumerate(refs):
            d = np.abs(r[idx].astype(np.float64) - t)
            sq[i] += float(np.square(d).sum())
            top = max(top, float(d.max()) if d.size else 0.0)
    return sq, top
