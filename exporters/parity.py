"""`verify parity`: an exported graph on onnxruntime against the PyTorch model, check by check.

1. Prefill a left-padded batch (batch > 1, rows of different lengths) in both; compare the logits
   and every present K/V at the real (unpadded) positions: max abs and rel error, cosine, top-1.
2. Walk the layers in order: the first whose K or V is out of tolerance is where to look.
3. Greedy decode N steps through each side's own KV cache, fed the reference's tokens, and compare
   the choice at every step; report the first divergence.
The reference is always fp32 PyTorch: an fp16 graph is judged against what the weights mean, not
against another rounding of them. NaN or Inf anywhere fails. A differing top-1 counts only where the
reference's own top-2 margin is larger than the tolerance (a near-tie is reported, not failed).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llama_tools import dtypes, files
from llama_tools.config import ModelConfig
from llama_tools.progress import Progress, silent
from llama_tools.rope import HALF, INTERLEAVED
from llama_tools.source import ModelSource, resolve
from llama_tools.tokenizer import check_vocab

from .compare import TOLERANCES, DecodeCheck, TensorCheck, Tolerance, compare, margin
from .onnx_export import ExportMetadata, export_onnx, read_metadata
from .prompts import default_prompts, left_pad, positions
from .runtime import OnnxLM, create_session


@dataclass
class ParityReport:
    onnx_path: str
    source: str
    provider: str  # "cpu" | "cuda": what actually ran
    provider_note: str
    provider_options: dict[str, str]  # what onnxruntime reports it runs with (use_tf32 on CUDA)
    dtype: str  # the graph's
    reference: str  # "PyTorch float32"
    prompt_lengths: list[int]
    tolerance: Tolerance
    checks: list[TensorCheck]
    first_bad_layer: int | None
    decode: DecodeCheck
    seconds: float
    notes: list[str] = field(default_factory=list)
    export_seconds: float | None = None  # when the target was a model exported on the fly
    # Where the time went: session creation, reference load, onnxruntime and reference forward passes
    # (prefill and decode), and for a streamed reference the part spent reading weights from disk.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and self.decode.passed

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


@dataclass(frozen=True)
class ParityTarget:
    """What `verify parity` runs, resolved once: the graph's metadata and the PyTorch source beside it."""

    onnx_path: Path | None  # None: export `source` on the fly first
    meta: ExportMetadata | None
    source: ModelSource
    seed: int


def resolve_target(target: str | None, source: str | None) -> ParityTarget:
    """TARGET (an .onnx, or a MODEL to export on the fly; default tiny) and --source -> one typed value."""
    target = target or "tiny"
    if not target.endswith(".onnx"):
        if source is not None:
            raise ValueError("--source is for an .onnx TARGET; a MODEL target is its own source")
        return ParityTarget(None, None, resolve(target, weights_required_in_dir=True), 0)
    meta = read_metadata(target)
    if source is None:
        if not meta.source:
            raise ValueError(f"{target}: its metadata names no source; pass --source")
        if meta.seed is None and not Path(meta.source).is_dir():
            raise ValueError(f"{target} was exported from {meta.source}, which is not there any more and no seed "
                             f"reproduces its weights; pass --source with the checkpoint it came from")
        src = resolve(meta.source)
        if meta.seed is None and src.weights is None:
            raise ValueError(f"{target} was exported from weights that no seed reproduces (source {meta.source!r}); "
                             f"pass --source with the checkpoint they came from")
    else:
        src = resolve(source, weights_required_in_dir=True)
    _check_same_config(meta.config, src.cfg, target, src.spec)
    return ParityTarget(Path(target), meta, src, meta.seed or 0)


def is_int4(onnx_path: Path) -> bool:
    """Whether a graph holds onnxruntime's weight-only int4 MatMulNBits (read without its weights)."""
    import onnx

    return any(n.op_type == "MatMulNBits" for n in onnx.load(str(onnx_path), load_external_data=False).graph.node)


def check_inputs(prompts: list[list[int]], steps: int, target: ParityTarget) -> None:
    """Cheap checks before any export or session: ids in the vocabulary, prompt + steps within the context.

    A static-KV graph's buffer is its context: the prompt and the decode must fit in it.
    """
    cfg = target.meta.config if target.meta is not None else target.source.cfg
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    for p in prompts:
        check_vocab(p, cfg.vocab_size, "prompt")
    longest = max((len(p) for p in prompts), default=len(max(default_prompts(cfg.vocab_size, 0), key=len)))
    if longest + steps > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {longest} tokens + --steps {steps} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} positions; use fewer steps or a shorter prompt")
    static = target.meta.static_kv if target.meta is not None else None
    if static is not None and longest + steps > static:
        raise ValueError(f"prompt of {longest} tokens + --steps {steps} exceeds {target.onnx_path}'s static KV "
                         f"buffer of {static} positions; use fewer steps, or export with a larger --static-kv")


def verify_parity(target: ParityTarget, *, prompts: list[list[int]] | None = None, provider: str = "auto",
                  steps: int = 8, dtype: str = "float32", rope_op: str = "llama_tools", tf32: bool = False,
                  tolerance: Tolerance | None = None, progress: Progress = silent) -> ParityReport:
    """Export on the fly when the target is a MODEL, then compare; see the module docstring for the checks."""
    check_inputs(prompts or [], steps, target)
    if target.onnx_path is not None and is_int4(target.onnx_path):
        raise ValueError(f"{target.onnx_path}: weight-only int4 (MatMulNBits): fp32 tolerances do not apply to it; "
                         f"measure it with `llama-tools verify int4 {target.onnx_path}` (top-1, KL, perplexity)")
    if target.onnx_path is not None:
        return _verify(target.onnx_path, target, prompts, provider, steps, tf32, tolerance, progress)
    # A temp dir of ours (llama_tools.files): removed on SIGTERM too, and after a SIGKILL by the next run.
    with files.temp_dir("parity") as tmp:
        exported = export_onnx(target.source, Path(tmp) / "model.onnx", dtype=dtype, rope_op=rope_op,
                               seed=target.seed, progress=progress)
        meta = read_metadata(exported.path)
        rep = _verify(exported.path, dataclasses.replace(target, meta=meta), prompts, provider, steps, tf32,
                      tolerance, progress)
    rep.onnx_path, rep.export_seconds = f"{target.source.spec} (exported on the fly)", exported.seconds
    return rep


def _verify(onnx_path: Path, target: ParityTarget, prompts: list[list[int]] | None, provider: str, steps: int,
            tf32: bool, tolerance: Tolerance | None, progress: Progress) -> ParityReport:
    """Run the graph and the PyTorch model on the same ids."""
    import torch

    from llama_tools.reference import reference_model

    start = time.perf_counter()
    meta = target.meta
    assert meta is not None, "the graph's metadata is read before it is run"
    cfg = meta.config
    prompts = prompts or default_prompts(cfg.vocab_size, meta.seed)
    clock = _Clock()
    run = create_session(onnx_path, provider, tf32=tf32)
    clock.lap("session")
    onnx_lm = OnnxLM(run, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    session_bytes = _weight_bytes(onnx_path) if run.provider == "cpu" else 0  # the session's copy is in host RAM
    # A checkpoint's reference streams one fp32 layer at a time; refused up front when even that will not fit.
    ref_model = reference_model(target.source, seed=target.seed, progress=progress, batch=len(prompts),
                                seq=max(map(len, prompts)), steps=steps, extra_bytes=session_bytes)
    clock.lap("reference load")
    tol = tolerance or TOLERANCES[(meta.dtype, _tolerance_key(meta.dtype, run.provider, run.options))]
    # The K cache holds q/k rows in the weights' RoPE layout: compare the graph's in the reference's order.
    k_order = _channel_order(meta.rope_layout, ref_model.cfg.rope_layout, cfg.head_dim)

    ids, mask = left_pad(prompts)
    pos = positions(mask, ids.shape[1])
    valid = mask.astype(bool)  # [batch, seq]
    got = onnx_lm(ids, mask, pos, onnx_lm.empty_cache(len(prompts)))
    clock.lap("onnxruntime prefill")
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(pos))
    clock.lap("reference prefill")
    checks = [compare("logits", got.logits, ref.logits.numpy(), valid, tol, logits=True)]
    first_bad_layer = None
    for i, ((gk, gv), (rk, rv)) in enumerate(zip(got.presents, ref.past_key_values)):
        for what, g, r in (("key", gk[..., k_order], rk), ("value", gv, rv)):
            # [batch, kv_heads, seq, n6] -> [batch, seq, kv_heads, n6]: positions on axis 1 for the mask
            c = compare(f"present.{i}.{what}", g.transpose(0, 2, 1, 3), r.numpy().transpose(0, 2, 1, 3), valid, tol)
            checks.append(c)
            if not c.passed and first_bad_layer is None:
                first_bad_layer = i

    clock.lap("compare prefill")
    decode, decode_check = _decode(onnx_lm, ref_model, got, ref, mask, steps, tol, progress, clock)
    if decode_check is not None:
        checks.append(decode_check)
    notes = [f"max relative error = max abs error / max |reference|; tolerance {tol}"]
    if meta.dtype != "float32":
        notes.append(f"{meta.dtype} graph judged against the float32 PyTorch model")
    if meta.rope_layout != ref_model.cfg.rope_layout:
        notes.append(f"the graph's K rows are {meta.rope_layout}, the reference's {ref_model.cfg.rope_layout}: "
                     f"K compared after reordering its channels")
    return ParityReport(
        onnx_path=str(onnx_path), source=target.source.label, provider=run.provider, provider_note=run.note,
        provider_options=dict(run.options),
        dtype=meta.dtype, reference="PyTorch float32", prompt_lengths=[len(p) for p in prompts], tolerance=tol,
        checks=checks, first_bad_layer=first_bad_layer, decode=decode, seconds=time.perf_counter() - start,
        notes=notes, timings=clock.laps | _read_seconds(ref_model),
    )


class _Clock:
    """Seconds per named phase, summed over repeats."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


def _read_seconds(ref_model: Any) -> dict[str, float]:
    """A streamed reference's seconds spent reading weights (part of its load and forward times)."""
    times = getattr(ref_model, "times", None)
    return {"of which reading weights": times.read} if times is not None else {}


def _tolerance_key(dtype: str, provider: str, options: dict[str, str]) -> str:
    """'cuda-tf32' when CUDA runs an fp32 graph's MatMuls in TF32 (its own, wider tolerance), else the provider."""
    tf32 = provider == "cuda" and options.get("use_tf32") == "1" and dtype == dtypes.FLOAT32.name
    return "cuda-tf32" if tf32 else provider


def _weight_bytes(onnx_path: Path) -> int:
    """Bytes of the graph's weights on disk (the file and its external data)."""
    data = onnx_path.parent / (onnx_path.name + ".data")
    return onnx_path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _channel_order(graph_layout: str, ref_layout: str, head_dim: int) -> np.ndarray:
    """Indices that put a graph K head's channels in the reference's RoPE layout (identity when they agree)."""
    order = np.arange(head_dim)
    if graph_layout == ref_layout:
        return order
    assert {graph_layout, ref_layout} == {HALF, INTERLEAVED}, f"RoPE layouts {graph_layout!r}, {ref_layout!r}"
    to_half = np.concatenate([order[0::2], order[1::2]])  # interleaved channel pairs (2t, 2t+1) -> (t, t + n6/2)
    # Reference half-split, graph interleaved: reference channel c sits at graph channel to_half[c]; and back.
    return to_half if ref_layout == HALF else np.argsort(to_half)


def _check_same_config(exported: Any, reference: Any, onnx_path: Any, source: Any) -> None:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "position_encoding")
    diff = [k for k in keys if getattr(exported, k) != getattr(reference, k)]
    if diff:
        k = diff[0]
        raise ValueError(f"{onnx_path} was exported with {k}={getattr(exported, k)} but {source} has "
                         f"{k}={getattr(reference, k)}; pass the model it was exported from")


def _decode(onnx_lm: OnnxLM, ref_model: Any, got: Any, ref: Any, mask: np.ndarray, steps: int, tol: Tolerance,
            progress: Progress, clock: "_Clock") -> tuple[DecodeCheck, TensorCheck | None]:
    """Greedy decode through both caches, both fed the reference's choice; compare every step's argmax."""
    import torch

    batch = mask.shape[0]
    past_onnx, past_ref = got.cache, ref.past_key_values
    ref_next = ref.logits[:, -1].numpy()  # [batch, vocab]
    onnx_next = got.logits[:, -1]
    ref_ids: list[list[int]] = [[] for _ in range(batch)]
    onnx_ids: list[list[int]] = [[] for _ in range(batch)]
    first, first_margin, what, agreed = None, 0.0, "", 0
    errors: list[tuple[np.ndarray, np.ndarray]] = []
    for step in range(steps):
        r_tok, o_tok = ref_next.argmax(-1), onnx_next.argmax(-1)  # [batch]
        for row in range(batch):
            ref_ids[row].append(int(r_tok[row]))
            onnx_ids[row].append(int(o_tok[row]))
        differ = np.nonzero(r_tok != o_tok)[0]
        if differ.size == 0:
            agreed += 1
        elif first is None:
            row = int(differ[0])
            first, first_margin = step, float(margin(ref_next[row]))
            what = (f"step {step}, row {row}: PyTorch {int(r_tok[row])}, ONNX {int(o_tok[row])} "
                    f"(reference top-2 margin {first_margin:.3g})")
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)  # [batch, past + 1]
        ids = r_tok[:, None].astype(np.int64)  # [batch, 1]: the reference's token, fed to both
        pos = positions(mask, 1)
        clock.lap("decode bookkeeping")
        out = onnx_lm(ids, mask, pos, past_onnx)
        clock.lap("onnxruntime decode")
        with torch.no_grad():
            r = ref_model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                          position_ids=torch.from_numpy(pos), past_key_values=past_ref)
        clock.lap("reference decode")
        past_onnx, past_ref = out.cache, r.past_key_values  # the graph's cache stays on its device
        onnx_next, ref_next = out.logits[:, -1], r.logits[:, -1].numpy()
        errors.append((out.logits, r.logits.numpy()))
        progress(step + 1, steps, "greedy decode step")
    if not errors:
        return DecodeCheck(0, 0, None, "no decode steps asked for", ref_ids, onnx_ids, True), None
    g = np.concatenate([e[0] for e in errors], axis=1)  # [batch, steps, vocab]
    r = np.concatenate([e[1] for e in errors], axis=1)
    logits_check = compare("decode logits", g, r, np.ones(g.shape[:2], bool), tol, logits=True)
    near_tie = first is not None and first_margin <= logits_check.bound
    passed = logits_check.passed and (first is None or near_tie)
    # The verdict's words say why it is what it is; a failing row never reads as agreement alone.
    if first is None:
        what = "every step agrees"
    elif near_tie:
        what += ": a near-tie in the reference, not counted as a failure"
    if not logits_check.passed:
        what += (f"; but the decode logits are out of tolerance (max abs {logits_check.max_abs:.3g} > "
                 f"{logits_check.bound:.3g})" if logits_check.nonfinite == 0 else "; but the decode logits hold NaN/Inf")
    return DecodeCheck(steps, agreed, first, what, ref_ids, onnx_ids, passed), logits_check
