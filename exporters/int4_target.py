"""Int4 that keeps the answer: the matrices whose int4 error moves the model most stay 8-bit until a KL target holds.

    calibration text ──streamed fp32 reference, one half-layer at a time──► s_m for every MatMul m:
        s_m = |Z(W_m int4) - Z|² / |Z|²   the residual stream right after m's half-layer, m alone in int4
        s_head = KL(p || p with W^8 int4)  the lm_head's own KL, on the final normed states
    rank by predicted KL (α s_m, α fitted to a measured all-int4 graph; s_head as is)
        ──keep the top ones 8-bit (MatMulNBits bits=8)──► quantize ──onnxruntime──► KL on calibration text
        └── above the target: refit α on that measurement, keep more (a few rounds; at worst every matrix 8-bit)
    the chosen graph ──► KL and top-1 on held-out text (QUALITY_TEXT): what the export reports

Why this shape: a 4-bit weight is off by up to half a step (~6% of a block's range), an 8-bit one by 1/16 of that,
so one matrix kept 8-bit removes nearly all of its error; which ones matter is a property of the trained weights
(SmolLM2-135M loses "Paris" at all-int4), found on real text, not guessed by name. The emulation of onnxruntime's
symmetric RTN (`fake_quant`) equals its MatMulNBits output to fp32 rounding (tests/test_int4_target.py), so the
ranking sees the error the graph will have; the loop then judges the real graph, never the emulation.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

HEAD = "/lm_head/MatMul"
# A MatMul of a decoder layer, plain or fused graph: /model/layers.{j}/{self_attn|mlp}/{proj}/MatMul
_LAYER_NODE = re.compile(r"^/model/layers\.(\d+)/(self_attn|mlp)/(\w+)/MatMul$")
# A fused graph packs projections along the output axis; int4 blocks run along the input axis, one set per output
# row, so quantizing the packed matrix is quantizing each part on its own.
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MAX_ROUNDS = 4  # graphs built and measured before every matrix is kept 8-bit


@dataclass(frozen=True)
class Matrix:
    """One quantizable MatMul of the graph, as the model knows it."""

    node: str
    layer: int | None  # None: the lm_head
    module: str  # "self_attn" | "mlp" | "lm_head"
    parts: tuple[str, ...]  # the nn.Linear names inside the module


def matrices(nodes: list[str]) -> list[Matrix]:
    """The graph's quantizable MatMul names -> what each is in the model; ValueError for one it cannot place."""
    out = []
    for node in nodes:
        if node == HEAD:
            out.append(Matrix(node, None, "lm_head", ("lm_head",)))
            continue
        m = _LAYER_NODE.match(node)
        if m is None or m.group(2) not in ("self_attn", "mlp"):
            raise ValueError(f"--max-kl: the graph's MatMul {node!r} is not a projection of a decoder layer or the "
                             f"lm_head (mixture-of-experts graphs are quantized without a target)")
        out.append(Matrix(node, int(m.group(1)), m.group(2), _PACKED.get(m.group(3), (m.group(3),))))
    return out


def fake_quant(w: Any, bits: int = 4, block: int = 32) -> Any:
    """W [out, in] as onnxruntime's symmetric RTN MatMulNBits holds it: per row, blocks of `block` along `in`,
    scale = (the block's value of largest magnitude) / -2^(bits-1), q = clamp(round(w / scale), -2^(b-1), 2^(b-1)-1)."""
    import torch

    rows, cols = w.shape
    pad = (-cols) % block
    x = torch.nn.functional.pad(w.double(), (0, pad)).reshape(rows, -1, block)  # [out, blocks, block]
    pick = x.abs().argmax(-1, keepdim=True)
    scale = (x.gather(-1, pick) / -(2 ** (bits - 1))).float().double()  # kept in fp32, as the graph stores it
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(x / safe), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (q * scale).reshape(rows, -1)[:, :cols].to(w.dtype)


TOP_K = 128  # next-token candidates per position the KL estimate sums over (a trained model's mass is there)


def sensitivities(ref: Any, ids: list[int], mats: list[Matrix], block: int,
                  progress: Callable[[int, int, str], None] = lambda *a: None) -> dict[str, float]:
    """KL_m: the mean next-token KL (nats) with matrix m alone in int4, for every matrix, in one streamed pass.

    Each matrix's perturbed residual stream is spawned where the matrix acts and carried through every later
    half-layer beside the clean one (a batch that grows by one row per matrix; each half-layer's weights are read
    once). At the end, each stream's change of the final normed state δ is turned into KL by the Fisher form on
    the clean distribution's TOP_K candidates: KL ≈ ½ Var_p(δ · w_v) (second order, exact for small δ). The lm_head
    itself is measured exactly; a tied embedding read through the same int4 blocks adds its own stream.
    """
    import torch

    from llama_tools.model import layer_masks, layer_tables

    cfg = ref.cfg
    by_half: dict[tuple[int, str], list[Matrix]] = {}
    for m in mats:
        if m.layer is not None:
            by_half.setdefault((m.layer, m.module), []).append(m)
    head = any(m.layer is None for m in mats)
    with torch.no_grad():
        x = torch.tensor([ids])  # [1, n3]
        n3 = len(ids)
        z = ref._embed(x)  # Z^0: [1, n3, n2]
        names: list[str] = []
        streams = z[:0]  # [streams, n3, n2]: one perturbed copy of the residual stream per matrix so far
        if head and cfg.tie_word_embeddings:  # the Gather reads the lm_head's int4 blocks: D's rows in int4
            names.append(HEAD + " (embedding)")
            rows = ref.reader.rows("model.embed_tokens.weight", [(i, i + 1) for i in ids]).float()  # D[t]: [n3, n2]
            scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else 1.0  # Gemma's sqrt(n2)
            streams = (fake_quant(rows, 4, block) * torch.tensor(scale, dtype=z.dtype))[None]  # [1, n3, n2]
        masks = layer_masks(cfg, n3, 0, torch.ones_like(x), z.dtype, z.device)
        for j in range(cfg.num_hidden_layers):
            for attention, module in ((True, "self_attn"), (False, "mlp")):
                half = ref._half(j, attention)

                def run(zin: Any, h: Any = half, att: bool = attention) -> Any:
                    if att:
                        pos = torch.arange(n3).expand(zin.shape[0], n3)  # [b, n3]
                        return h.attend(zin, masks[h.sliding], pos, layer_tables(ref._tables, h.sliding), None)[0]
                    return h.feed_forward(zin)
                clean = run(z)
                moved = [run(streams)] if len(streams) else []
                owner = getattr(half, module)
                for m in by_half.get((j, module), []):
                    saved = {p: getattr(owner, p).weight.data for p in m.parts}
                    for p in m.parts:
                        getattr(owner, p).weight.data = fake_quant(saved[p], 4, block)
                    moved.append(run(z))
                    names.append(m.node)
                    for p in m.parts:
                        getattr(owner, p).weight.data = saved[p]
                streams = torch.cat(moved) if moved else streams
                z = clean
                del half
            progress(j + 1, cfg.num_hidden_layers, "int4 sensitivity (streamed)")
        out = dict(zip(names, _fisher_kl(ref, z, streams)))
        if head:
            out[HEAD] = _head_kl(ref, z, block) + out.pop(HEAD + " (embedding)", 0.0)
    return out


def _final(ref: Any) -> Any:
    """The final RMSNorm with its gain read (Gemma's 1 + γ included)."""
    from llama_tools.model import norm

    final = norm(ref.cfg)
    final.load_state_dict({"weight": ref.reader.read(["model.norm.weight"])["model.norm.weight"].float()})
    return final


def _head_rows(ref: Any) -> tuple[str, int]:
    cfg = ref.cfg
    return ("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"), \
        max(1, (16 * 2**20) // (4 * cfg.hidden_size))


def _head_logits(ref: Any, h: Any, quantized_block: int | None = None) -> Any:
    """H = h W^{8T} (W^8 int4-emulated when quantized_block), W^8 read a row chunk at a time: [n3, n2] -> [n3, n1]."""
    import torch

    name, step = _head_rows(ref)
    cfg = ref.cfg
    out = []
    for a in range(0, cfg.vocab_size, step):
        w = ref.reader.rows(name, [(a, min(a + step, cfg.vocab_size))]).float()  # [rows, n2]
        if cfg.norm_head:
            w = torch.nn.functional.normalize(w, dim=-1)
        out.append(h @ (fake_quant(w, 4, quantized_block) if quantized_block else w).T)
    return torch.cat(out, -1)


def _fisher_kl(ref: Any, z: Any, streams: Any) -> list[float]:
    """Per stream [s, n3, n2] vs the clean final state z [1, n3, n2]: mean KL ≈ ½ Var_p(δh · w_v) over TOP_K."""
    import torch

    from llama_tools.model import softcap

    if not len(streams):
        return []
    cfg = ref.cfg
    final = _final(ref)
    h = final(z)[0]  # Zbar: [n3, n2]
    raw = _head_logits(ref, h)  # [n3, n1]
    logits = softcap(raw, cfg.final_logit_softcap)
    p = torch.softmax(logits.double(), -1)
    top_p, top = p.topk(min(TOP_K, cfg.vocab_size), -1)  # [n3, K]
    name, _ = _head_rows(ref)
    w = torch.stack([ref.reader.rows(name, [(int(v), int(v) + 1) for v in t]).float() for t in top])  # [n3, K, n2]
    if cfg.norm_head:
        w = torch.nn.functional.normalize(w, dim=-1)
    cap = cfg.final_logit_softcap
    slope = (1 - torch.tanh(raw.gather(-1, top) / cap) ** 2).double() if cap else 1.0  # d softcap / d logit
    out = []
    for zs in streams:
        d = (final(zs[None])[0] - h).double()  # δh: [n3, n2]
        s = torch.einsum("tkd,td->tk", w.double(), d) * slope  # δ logit of each candidate: [n3, K]
        mean = (top_p * s).sum(-1, keepdim=True)
        out.append(float((0.5 * (top_p * (s - mean) ** 2).sum(-1)).mean()))
    return out


def _head_kl(ref: Any, z: Any, block: int) -> float:
    """KL(p || p') of the lm_head alone in int4, exactly, on the final states z [1, n3, n2]."""
    import torch

    from llama_tools.model import softcap

    cap = ref.cfg.final_logit_softcap
    h = _final(ref)(z)[0]  # Zbar: [n3, n2]
    p = torch.log_softmax(softcap(_head_logits(ref, h), cap).double(), -1)  # [n3, n1]
    q = torch.log_softmax(softcap(_head_logits(ref, h, block), cap).double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@dataclass
class Round:
    """One graph built and measured."""

    kept: int  # matrices kept 8-bit
    predicted_kl: float
    measured_kl: float  # on the calibration text
    bytes: int


@dataclass
class TargetResult:
    """What the target chose and what it measured."""

    max_kl: float
    kept_8bit: list[str]
    sensitivity: dict[str, float]  # KL_m: nats with that matrix alone in int4
    alpha: float  # measured KL / the sum of the int4 matrices' KL_m, fitted to the graphs that missed
    rounds: list[Round] = field(default_factory=list)
    calibration_tokens: int = 0
    seconds: float = 0.0
    met: bool = False

    @property
    def calibration_kl(self) -> float:
        return self.rounds[-1].measured_kl


def plan(sens: dict[str, float], alpha: float, max_kl: float, margin: float = 0.7) -> list[str]:
    """The fewest matrices to keep 8-bit so that the predicted KL of the rest, alpha * sum KL_m, is at most
    margin * max_kl (8-bit leaves 1/256 of a matrix's int4 KL: neglected)."""
    order = sorted(sens, key=sens.get, reverse=True)
    rest = alpha * sum(sens.values())
    kept: list[str] = []
    for n in order:
        if rest <= margin * max_kl:
            break
        kept.append(n)
        rest -= alpha * sens[n]
    return kept


def choose(sens: dict[str, float], max_kl: float, build: Callable[[list[str]], tuple[float, int]]) -> TargetResult:
    """The loop of the module docstring. build(kept) quantizes with `kept` 8-bit -> (KL on calibration, bytes).

    alpha: measured KL / the sum of the int4 matrices' own KL_m, at least 1 (errors compound, and onnxruntime's
    int8 activations add their own), refitted on each graph that misses the target.
    """
    result = TargetResult(max_kl=max_kl, kept_8bit=[], sensitivity=sens, alpha=1.0)
    kept: list[str] = []
    for _ in range(MAX_ROUNDS):
        kl, size = build(kept)
        rest = sum(v for n, v in sens.items() if n not in kept)
        result.rounds.append(Round(len(kept), result.alpha * rest, kl, size))
        if kl <= max_kl:
            result.kept_8bit, result.met = kept, True
            return result
        result.alpha = max(result.alpha, kl / max(rest, 1e-30))
        more = plan(sens, result.alpha, max_kl)
        if set(more) <= set(kept):  # predicted to meet it, measured not to: keep the next quarter anyway
            order = sorted((n for n in sens if n not in kept), key=sens.get, reverse=True)
            more = kept + order[: max(1, len(order) // 4)]
        kept = sorted(set(kept) | set(more), key=list(sens).index)
    everything = list(sens)  # the last resort: every matrix 8-bit
    kl, size = build(everything)
    result.rounds.append(Round(len(everything), 0.0, kl, size))
    result.kept_8bit, result.met = everything, kl <= max_kl
    return result


def calibration_ids(tokenizer: Any, vocab_size: int, limit: int = 192) -> tuple[list[int], str]:
    """The built-in passages (prose in three languages, code) through the tokenizer, else seeded ids."""
    from .prompts import PASSAGES

    if tokenizer is None:
        return np.random.default_rng(1).integers(3, vocab_size, size=64).tolist(), "64 seeded ids (no tokenizer)"
    ids = tokenizer.encode("\n\n".join(text for _, text in PASSAGES))[:limit]
    return ids, f"{len(ids)} tokens of built-in prose (English, French, German) and Python code"


def onnx_logits(path: str | Path, cfg: Any, ids: list[int]) -> np.ndarray:
    """One prefill of ids through the graph on the CPU: logits [n, n1] in fp32."""
    from .prompts import positions
    from .runtime import OnnxLM, create_session

    arr = np.array([ids], np.int64)  # [1, n]
    mask = np.ones_like(arr)
    lm = OnnxLM(create_session(Path(path), "cpu"), cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    out = np.asarray(lm(arr, mask, positions(mask, arr.shape[1]), lm.empty_cache(1)).logits, np.float32)[0]
    del lm
    return out


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(p || q) in nats, float64 a row at a time."""
    from .quantize import _kl_row

    return float(np.mean([_kl_row(p, q) for p, q in zip(p_logits, q_logits)]))


def reference_logits(ref: Any, ids: list[int]) -> np.ndarray:
    """The streamed fp32 reference's logits on ids: [n, n1]."""
    import torch

    x = torch.tensor([ids])
    return ref(x, torch.ones_like(x)).logits[0].float().numpy()


def quantize_to_target(full: Path, target: Path, ref: Any, tokenizer: Any, max_kl: float,
                       int4: dict[str, Any], say: Callable[[str], None] = lambda m: None,
                       progress: Callable[[int, int, str], None] = lambda *a: None) -> tuple[Any, TargetResult]:
    """FULL (the fp32 graph) -> TARGET in int4 with the fewest matrices 8-bit that meet `max_kl` on calibration text.

    Returns (the last quantize_int4 result, what the target chose). Every graph but the last is overwritten.
    """
    import onnx

    from .quantize import _weights_of, quantize_int4

    if not (math.isfinite(max_kl) and max_kl > 0):
        raise ValueError(f"--max-kl must be a positive number of nats, got {max_kl}")
    t0 = time.perf_counter()
    cfg = ref.cfg
    exclude = tuple(int4.get("exclude") or ())
    nodes = [n for n in _weights_of(onnx.load(str(full), load_external_data=False)) if n not in exclude]
    mats = matrices(nodes)
    ids, _ = calibration_ids(tokenizer, cfg.vocab_size)
    say(f"measuring each of {len(mats)} matrices' int4 error on {len(ids)} calibration tokens")
    sens = sensitivities(ref, ids, mats, int4.get("block_size", 32), progress)
    p = reference_logits(ref, ids)
    last: list[Any] = [None]

    def build(kept: list[str]) -> tuple[float, int]:
        say(f"int4 with {len(kept)} of {len(mats)} matrices 8-bit")
        last[0] = quantize_int4(full, target, **{**int4, "keep_8bit": tuple(kept)})
        return mean_kl(p, onnx_logits(target, cfg, ids)), last[0].bytes_after
    result = choose(sens, max_kl, build)
    result.calibration_tokens, result.seconds = len(ids), time.perf_counter() - t0
    return last[0], result
