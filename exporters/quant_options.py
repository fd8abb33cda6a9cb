"""What `export --quantize` offers, importable without numpy or onnxruntime: the CLI builds its choices here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

QUANTIZE = ("int4",)
# algorithm -> what it is (rtn and hqq are onnxruntime's matmul_nbits_quantizer, imatrix and awq ours), node by node.
INT4_ALGORITHMS = {
    "rtn": "round to nearest, one scale per block (onnxruntime's C++ kernel; symmetric unless --int4-asymmetric)",
    "hqq": "half-quadratic: scales and zero points fitted per block (onnxruntime's HQQ; always asymmetric)",
    "imatrix": "each block's scale and zero point searched to fit the weights its inputs use most on calibration "
               "text (ours; asymmetric, the fast kernel's format)",
    "awq": "imatrix after activation-aware input scales: each matrix's inputs rescaled by rms^alpha (alpha searched) "
           "and the inverse folded into the norm or up_proj before it (ours; fused graphs, exact in full precision)",
}
SEARCHED = ("imatrix", "awq")  # the algorithms that search int4_blocks on measured input importance
BLOCK_SIZE = 32
# A matrix kept 8-bit (--max-kl) takes blocks of 128: onnxruntime's 8-bit kernel runs them 5-20% faster than blocks
# of 32 at decode (one thread: 4864 x 896 56 vs 64 us, int4 47 us; benchmarks/bench_int4.py --kernels), at 8.25
# bits a weight instead of 9, and 8 bits over 128 weights still leave a tenth of int4's error over 32.
EIGHT_BIT_BLOCK = 128
# The lm_head's first rows, the tokenizer's earliest (most frequent) pieces, carry most of its int4 KL: with the first
# tenth exact, on the calibration text, SmolLM2-135M's head KL fell 0.041 -> 0.014 nats, Qwen2.5-0.5B's 0.015 -> 0.004,
# Gemma 3 270M's 0.027 -> 0.006. So the quality target may keep those rows 8-bit apart from the rest, for a tenth of
# the head's 8-bit bytes (each part then its own MatMulNBits, joined by a Concat).
HEAD = "/lm_head/MatMul"
HEAD_FREQUENT = HEAD + ":frequent"  # the head's first rows, to keep_8bit and the quality target
HEAD_REST = HEAD + ":rest"  # its other rows
HEAD_PARTS = {HEAD_FREQUENT: "first rows", HEAD_REST: "other rows"}
FREQUENT_PART = 10  # those rows: the first n1 // 10


def frequent_rows(n1: int) -> int:
    """How many of the lm_head's n1 rows HEAD_FREQUENT names."""
    return max(1, n1 // FREQUENT_PART)


def matrix_label(node: str) -> str:
    """A quantizable MatMul as a reader names it: "layers.3/mlp/down_proj", "lm_head (first rows)"."""
    base, _, part = node.partition(":")
    label = base.removesuffix("/MatMul").removeprefix("/model/").lstrip("/")
    return f"{label} ({HEAD_PARTS[node]})" if part else label


def matrix_labels(nodes: list[str]) -> list[str]:
    """matrix_label of each, a head whose two parts are both there named once, whole."""
    whole = all(part in nodes for part in HEAD_PARTS)
    out = [matrix_label(HEAD if whole and n in HEAD_PARTS else n) for n in nodes]
    return list(dict.fromkeys(out))


def head_8bit(keep_8bit: tuple[str, ...] | list[str]) -> tuple[bool, bool]:
    """(the head's first rows 8-bit, its other rows 8-bit) under keep_8bit: HEAD names both."""
    whole = HEAD in keep_8bit
    return whole or HEAD_FREQUENT in keep_8bit, whole or HEAD_REST in keep_8bit


# MLAS's int4 kernels on the CPU: accuracy level 4 quantizes the activations to int8 per block and runs
# an int8 dot product (the fast path); 0/1 dequantize to fp32 first.
ACCURACY_LEVEL = 4
# What runs without --int4-algorithm (quantize_int4's default; tests/test_cli_contract.py holds the two equal).
DEFAULT_ALGORITHM = "awq"
# `verify int4` without --prompt/--ids starts its greedy decode from this many seeded ids.
PROMPT_IDS = 8


# --- What int4 aims at (--max-kl) ------------------------------------------------------------------------------
# Measured (benchmarks/bench_int4.py, held-out text): every matrix int4 by round to nearest is the builder's int4 to
# within noise (SmolLM2-135M KL 0.371 vs 0.372 nats; it loses " Paris"). The default aims at the lower of FAITHFUL_KL
# and DEFAULT_FRACTION of the all-int4 graph's KL on the calibration text (awq's scaled blocks, every matrix int4: the
# first graph built): they come most of the way at int4's own size and speed, and the matrices with the most KL per
# extra byte are kept 8-bit until it holds, within the cap.
# 0.6: Qwen2.5-Coder-0.5B's all-int4 graph measured 0.071 nats, its target 0.043 (held-out KL 0.032, 0.31x the
# builder's); the earlier yardstick, half of int4 without calibration (0.086 there, one more graph built, 13 s), set
# the same 0.043. SmolLM2-135M's all-int4 0.204 leaves 0.1 binding either way.
DEFAULT_FRACTION = 0.6  # of the all-int4 graph's KL on the calibration text (int4_target.choose)
# What `verify int4` calls faithful (QuantThresholds.max_mean_kl), the export's quality line warns past, and the
# default target never exceeds.
FAITHFUL_KL = 0.1
# A decode step reads every weight once, and its time follows those bytes: profiled on SmolLM2-135M (one thread), a
# 576 x 3072 matrix 8-bit took 92 us a step against 55 us int4 (1.61x the bytes, 1.67x the time; cached, as a lone
# kernel is timed, 1.05x). Under a cap of 1.3 the default kept 45 of 122 8-bit there: 1.24x the builder's bytes,
# 1.18-1.22x its decode time (KL 0.070). Under 1.1: 22 of 122, 97.9 MB (1.13x), 1.12x, held-out KL 0.086,
# FAITHFUL on both texts; the calibration text's 0.1 is then not met (0.126: the closest graph within the cap is
# the answer). On Qwen2.5-Coder-0.5B and Gemma 3 270M the target is met inside 1.1x (1.03x, 1.08x the builder's).
# With the importance measured on the whole calibration corpus (int4_target.calibration_windows), SmolLM2's
# default-text KL at 1.1 fell 0.096 -> 0.087; 1.08 keeps 0.092 with 17 of 122 8-bit, 96.2 MB (1.11x the builder's
# file), decode 1.06x (1.05: 0.101, not faithful): the cap that leaves decode inside 1.1x with the answer kept.
DEFAULT_SIZE_CAP = 1.08  # 8-bit may add at most 0.08x the int4 matrices' own bytes (what a decode step reads)
MAX_NATS = 10.0  # an absolute target above this is no target (uniform over 22,000 tokens is 10 nats)
NO_TARGET = "none"  # every matrix int4: the plain quantizer
AUTO = "auto"  # the default below


@dataclass(frozen=True)
class Int4Target:
    """What int4 aims at: a mean KL in nats, a fraction of the all-int4 graph's KL, or the lower of the two, under a
    size cap."""

    max_kl: float | None = None  # nats, absolute
    # of the all-int4 graph's KL (the algorithm's own blocks, every matrix int4), on the calibration text
    fraction: float | None = None
    size_cap: float | None = None  # the quantized matrices at most this times their all-int4 bytes (None: no cap)

    def describe(self) -> str:
        """One line: what the target is."""
        said = ([f"{self.max_kl:g} nats"] if self.max_kl is not None else []) + \
            ([f"{self.fraction:g}x the all-int4 graph's"] if self.fraction is not None else [])
        what = "mean KL <= " + (f"the lower of {said[0]} and {said[1]}" if len(said) == 2 else said[0])
        return what + (f", its matrices at most {self.size_cap:g}x their int4 bytes" if self.size_cap else "")


DEFAULT_TARGET = Int4Target(max_kl=FAITHFUL_KL, fraction=DEFAULT_FRACTION, size_cap=DEFAULT_SIZE_CAP)


def parse_max_kl(value: Any) -> Int4Target | None:
    """--max-kl's value -> the target: "auto" the default, "none" every matrix int4 (None), NATS an absolute KL,
    "Fx" (0 < F < 1) F times the all-int4 graph's KL; ValueError naming the option otherwise."""
    if value is None or isinstance(value, Int4Target):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return DEFAULT_TARGET
    if text in (NO_TARGET, "off"):
        return None
    relative = text.endswith("x")
    try:
        number = float(text[:-1] if relative else text)
    except ValueError:
        number = math.nan
    if relative:
        if not 0 < number < 1:
            raise ValueError(f"--max-kl {value!r}: a relative target is F x the all-int4 graph's KL with 0 < F < 1, "
                             f"e.g. 0.5x")
        return Int4Target(fraction=number)
    if not 0 < number <= MAX_NATS:  # NaN fails too
        raise ValueError(f"--max-kl {value!r}: give nats in (0, {MAX_NATS:g}], a fraction such as 0.5x, "
                         f"{AUTO!r} (the default: {DEFAULT_TARGET.describe()}) or {NO_TARGET!r} (every matrix int4)")
    return Int4Target(max_kl=number)


def int4_target(options: dict[str, Any]) -> Int4Target | None:
    """The target an int4 export runs to, from quantize_int4's options plus "max_kl" (absent: the default).

    The default applies to what the sensitivity pass emulates exactly: symmetric RTN and imatrix. HQQ's fitted
    scales and RTN's asymmetric zero points are not emulated, so those without --max-kl are every matrix int4.
    """
    if "max_kl" not in options:
        algorithm = options.get("algorithm", DEFAULT_ALGORITHM)
        emulated = algorithm in SEARCHED or (algorithm == "rtn" and options.get("symmetric", True))
        return DEFAULT_TARGET if emulated else None
    return parse_max_kl(options["max_kl"])
