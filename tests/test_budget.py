"""The error budget (compare.judge): figures by hand, the floor, the top-1 rule, and a verdict that matches its figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from llama_tools.exporters.verification.compare import BUDGET, EPS, FP16_PER_FP32, Budget, judge
from llama_tools.modeling.model import RMSNorm, wide

B = Budget(multiple=4.0, floor_ulps=1.0, min_cosine=0.9)


def three(err: float, noise: float, shape=(1, 4, 8)):
    """truth of all 1s; ref off by `noise` and got off by `err` everywhere (so RMS = max = the offset)."""
    t = np.ones(shape)
    return t + err, t + noise, t


def test_figures_by_hand():
    got, ref, t = three(3e-6, 1e-6)
    c = judge("x", got, ref, t, np.ones((1, 4), bool), "float32", B)
    floor = EPS["float32"] * 1.0  # 1 ulp at RMS |truth| = 1
    assert c.error == pytest.approx(3e-6) and c.noise == pytest.approx(1e-6)
    assert c.floor == pytest.approx(floor) and c.bound == pytest.approx(4e-6 + floor)
    assert c.ratio == pytest.approx(3.0) and c.allowed_ratio == pytest.approx(4 + floor / 1e-6)
    assert c.passed and c.verdict == "pass"
    assert c.figures() == "onnxruntime 3e-06, PyTorch fp32 1e-06 (3x; bound 4.12x)"
    d = c.to_dict()
    assert d["ratio"] == pytest.approx(3.0) and d["passed"] is True and json.dumps(d)


def test_over_budget_fails_and_says_why():
    got, ref, t = three(5e-6, 1e-6)
    c = judge("x", got, ref, t, np.ones((1, 4), bool), "float32", B)
    assert not c.passed and c.verdict == "FAIL: error over budget" and c.ratio == pytest.approx(5.0)


@pytest.mark.parametrize("err, noise", [(0.0, 0.0), (1e-9, 0.0), (1e-3, 0.0), (2e-6, 1e-6), (9e-6, 1e-6),
                                        (math.nan, 1e-6)])
def test_verdict_never_contradicts_its_figures(err, noise):
    got, ref, t = three(err, noise)
    c = judge("x", got, ref, t, np.ones((1, 4), bool), "float32", B)
    shown_ok = c.nonfinite == 0 and c.error <= c.bound and c.cosine >= c.min_cosine and c.decisive_misses == 0
    assert c.passed == shown_ok and (c.verdict == "pass") == c.passed


def test_a_reference_that_overflows_says_so():
    """fp16's own implementation at inf where float64 is finite (Gemma's residuals past 65504): the FAIL names the
    overflow, not an error budget it cannot have; a finite reference with the same graph error passes."""
    got, ref, t = three(1e-4, 1e-4)
    ref[0, 0, 0] = np.inf
    c = judge("x", got, ref, t, np.ones((1, 4), bool), "float16", B)
    assert not c.passed and "overflows" in c.verdict and "over budget" not in c.verdict, c.verdict
    assert judge("x", got, three(1e-4, 1e-4)[1], t, np.ones((1, 4), bool), "float16", B).passed


def test_fp16_overflow_falls_back_to_fp32_noise_scaled():
    """Where PyTorch fp16 overflows and float64 does not, the noise is PyTorch fp32's x FP16_PER_FP32 (asked for
    only then) and the figures say so; a graph within that budget passes, one past it fails, one whose own output
    overflows fails naming it, and fp32 overflowing too leaves the overflow's FAIL."""
    valid = np.ones((1, 4), bool)
    _, ref, t = three(0.0, 1e-4)
    ref[0, 0, 0] = np.inf  # PyTorch fp16 overflowed here
    wide32 = [t + 1e-7, t - 2e-7]  # PyTorch fp32, plain and reassociated: RMS noises 1e-7, 2e-7
    asked = []

    def fallback():
        asked.append(1)
        return wide32
    noise = FP16_PER_FP32 * 2e-7  # the larger fp32 noise, scaled
    c = judge("x", t + 0.5 * noise, ref, t, valid, "float16", B, fallback=fallback)
    assert asked and c.passed and c.noise == pytest.approx(noise) and c.ratio == pytest.approx(0.5)
    assert c.noises == pytest.approx((FP16_PER_FP32 * 1e-7, noise)) and c.estimate.startswith("PyTorch fp16 overflows")
    shown = f"onnxruntime {0.5 * noise:.2g}, PyTorch fp16 overflows: fp32 x {FP16_PER_FP32:g} {noise:.2g} (0.5x"
    assert c.figures().startswith(shown), c.figures()
    far = judge("x", t + 10 * noise, ref, t, valid, "float16", B, fallback=fallback)  # past 4x + the floor
    assert not far.passed and far.verdict == "FAIL: error over budget" and far.estimate
    inf = t + 0.5 * noise
    inf[0, 1, 2] = np.inf
    own = judge("x", inf, ref, t, valid, "float16", B, fallback=fallback)
    assert not own.passed and "1 NaN/Inf in the graph's output (it overflows)" in own.verdict
    both = judge("x", t, ref, t, valid, "float16", B, fallback=lambda: [ref])  # fp32 overflowing too
    assert not both.passed and "overflows (NaN/Inf) where float64 is finite" in both.verdict and not both.estimate
    asked.clear()  # a finite fp16 reference is measured, never estimated: the fallback is not even run
    c = judge("x", t, three(0.0, 1e-4)[1], t, valid, "float16", B, fallback=fallback)
    assert not asked and not c.estimate and c.noise == pytest.approx(1e-4)


def test_values_past_fp16s_range_fail_naming_it():
    """float64 itself past 65504 (Gemma 3's residual stream at layer 8): no fp16 graph can hold it, the FAIL says so
    and no fallback estimate is made; 60000 fits and is judged as usual."""
    valid = np.ones((1, 4), bool)
    t = np.full((1, 4, 8), 60000.0)
    assert judge("x", t, t, t, valid, "float16", B).passed
    t[0, 1, 3] = 68398.0
    got, ref = t.copy(), t.copy()
    ref[0, 1, 3] = got[0, 1, 3] = np.inf
    c = judge("x", got, ref, t, valid, "float16", B, fallback=lambda: [t])
    assert not c.passed and not c.estimate and "float64 reaches 68,398, past fp16's largest 65,504" in c.verdict
    assert judge("x", t, t, t, valid, "float32", B).passed  # fp32 holds it


def test_floor_for_exact_tensors():
    # PyTorch exact (noise 0): an error below one fp32 ulp at the tensor's size passes, a larger one fails.
    got, ref, t = three(0.5 * EPS["float32"], 0.0)
    assert judge("x", got, ref, t, np.ones((1, 4), bool), "float32", B).passed
    got, ref, t = three(3 * EPS["float32"], 0.0)
    c = judge("x", got, ref, t, np.ones((1, 4), bool), "float32", B)
    assert not c.passed and c.ratio == math.inf
    zeros = np.zeros((1, 4, 8))
    assert judge("x", zeros, zeros, zeros, np.ones((1, 4), bool), "float16", B).passed  # all exact: 0 <= 0


def test_masked_positions_are_not_judged_but_nan_anywhere_fails():
    got, ref, t = three(1e-6, 1e-6)
    got[0, 0] = 99.0
    valid = np.array([[False, True, True, True]])
    assert judge("x", got, ref, t, valid, "float32", B).passed
    got[0, 0] = np.nan
    c = judge("x", got, ref, t, valid, "float32", B)
    assert c.nonfinite == 8 and not c.passed and "NaN" in c.verdict


def test_top1_flip_counts_only_beyond_what_a_within_budget_error_could_flip():
    t = np.array([[[1.0, 0.999999, 0.0], [3.0, 0.0, 0.0]]])  # position 0: a 1e-6 near-tie
    ref = t + np.array([[[1e-6, -1e-6, 0.0], [1e-6, 0.0, 0.0]]])
    got = np.array([[[0.9999995, 0.9999995 + 1e-7, 0.0], [3.0, 0.0, 0.0]]])  # flips the near-tie
    c = judge("logits", got, ref, t, np.ones((1, 2), bool), "float32", B, logits=True)
    assert c.top1 == 0.5 and c.decisive_misses == 0
    assert c.tie == pytest.approx(2 * (4 * 1e-6 + c.floor))
    got[0, 1] = [0.0, 3.1, 0.0]  # position 1 flips against a margin of 3
    c = judge("logits", got, ref, t, np.ones((1, 2), bool), "float32", Budget(1e9, 1.0, 0.0), logits=True)
    assert c.error <= c.bound and c.decisive_misses == 0  # a budget that wide would excuse it: margin 3 < tie
    c = judge("logits", got, ref, t, np.ones((1, 2), bool), "float32", Budget(1e5, 1.0, 0.0), logits=True)
    assert c.decisive_misses == 1 and not c.passed and "decisive top-1" in c.verdict


def test_every_graph_dtype_has_a_budget():
    assert set(BUDGET) == {"float32", "float16", "bfloat16"}
    assert EPS["bfloat16"] == 2.0 ** -7 and EPS["float16"] == 2.0 ** -10


def test_float64_stays_wide_in_norms():
    # The float64 truth is only a truth if the norm does not round through fp32 (wide() keeps float64).
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 7
    norm = RMSNorm(64, 1e-5).double()
    want = x.numpy() / np.sqrt((x.numpy() ** 2).mean(-1, keepdims=True) + 1e-5)
    got = norm(x).detach().numpy()
    assert got.dtype == np.float64 and np.abs(got - want).max() < 1e-14
    assert wide(torch.ones(2, dtype=torch.float16)).dtype == torch.float32


def test_a_second_implementation_sums_in_another_order():
    """reassociated_matmul is the same product (float64: equal to 1e-12) summed in another order (fp32: not
    bitwise equal, within fp32 rounding of the sums), so its error to float64 is a second, independent sample."""
    import torch

    from llama_tools.inference.reference import REASSOCIATE_CHUNK, reassociate, reassociated_matmul

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 4 * REASSOCIATE_CHUNK + 5, generator=g), torch.randn(50, 4 * REASSOCIATE_CHUNK + 5,
                                                                                  generator=g)
    exact = x.double() @ w.double().T
    assert torch.allclose(reassociated_matmul(x.double(), w.double()), exact, rtol=0, atol=1e-12)
    a, b = reassociated_matmul(x, w), x @ w.T
    assert not torch.equal(a, b)
    for y in (a, b):
        assert float((y.double() - exact).abs().max()) < 1e-4 * float(exact.abs().max())
    lin = torch.nn.Linear(w.shape[1], 50)
    with torch.no_grad():
        want = lin(x)
    reassociate(lin)
    with torch.no_grad():
        assert torch.allclose(lin(x), want, atol=1e-5) and not torch.equal(lin(x), want)


def test_the_noise_is_the_larger_of_the_implementations():
    """Two references: the noise is the larger RMS error; a graph 5x the smaller but 1x the larger passes, and a
    graph far off fails whichever reference is taken (the check can still fail)."""
    rng = np.random.default_rng(0)
    truth = rng.standard_normal((2, 8, 32))
    valid = np.ones((2, 8), bool)
    quiet = truth + 1e-7 * rng.standard_normal(truth.shape)
    loud = truth + 5e-7 * rng.standard_normal(truth.shape)
    got = truth + 5e-7 * rng.standard_normal(truth.shape)
    alone = judge("one", got, quiet, truth, valid, "float32")
    both = judge("two", got, (quiet, loud), truth, valid, "float32")
    assert both.noise == pytest.approx(max(both.noises)) and both.noises[0] < both.noises[1]
    assert alone.noise == pytest.approx(both.noises[0]) and both.passed and both.ratio < 2 < alone.ratio
    far = truth * (1 + 1e-3)
    assert not judge("far", far, (quiet, loud), truth, valid, "float32").passed
