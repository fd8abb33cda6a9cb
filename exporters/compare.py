"""Comparing an ONNX output with the PyTorch reference: tolerances per (dtype, provider), and one check's figures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llama_tools import dtypes


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


