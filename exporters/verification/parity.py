"""`verify parity`: an exported graph on onnxruntime against PyTorch, judged by an error budget against float64.

Three runs on the same ids (a left-padded batch, then greedy decode steps fed float64's tokens):

    the graph (onnxruntime)       --error-->  PyTorch float64 (the truth)  <--noise--  PyTorch in the graph's dtype

For the logits, every layer's present K and V and the decode logits, the graph passes when its RMS error to
float64 is within a multiple of the noise that PyTorch itself makes in the graph's dtype on these inputs
(compare.py BUDGET, measured in the README's Tolerances section), with a cosine floor, no NaN/Inf, and no
decisive top-1 miss (a differing argmax counts only where float64's own top-2 margin is larger than a
within-budget error could flip). The first layer whose K or V is out of budget is where to look.
Graphs other exporters wrote (onnxruntime-genai's builder, Optimum) are mapped by foreign.py and judged alike.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llama_tools.modeling import dtypes
from llama_tools.outputs import files
from llama_tools.outputs.progress import Progress, silent
from llama_tools.modeling.rope import context_length
from llama_tools.modeling.rope_layouts import HALF, INTERLEAVED
from llama_tools.checkpoints.source import ModelSource, resolve
from llama_tools.checkpoints.tokenizer import check_vocab

from .compare import BUDGET, DTYPE_LABEL, FP16_PER_FP32, BudgetCheck, Budget, DecodeCheck, judge, margin
from ..foreign import GraphIO, check_matches, describe_graph, foreign_lm
from ..graph_meta import has_our_metadata, is_int4  # noqa: F401  (verdict, by_layer, quantize import them from here)
from ..onnx_export import ExportMetadata, export_onnx, read_metadata
from ..prompts import default_prompts, left_pad, positions
from .. import rope_ops
from ..runtime import OnnxLM, create_session


@dataclass
class ParityReport:
    onnx_path: str
    source: str
    provider: str  # "cpu" | "cuda": what actually ran
    provider_note: str
    provider_options: dict[str, str]  # what onnxruntime reports it runs with (use_tf32 on CUDA)
    dtype: str  # the graph's
    graph: str  # who wrote it: "llama-tools plain", "onnxruntime-genai builder", "Optimum", ...
    reference: str  # "PyTorch float32 (noise), PyTorch float64 (truth)"
    prompt_lengths: list[int]
    budget: Budget
    checks: list[BudgetCheck]
    first_bad_layer: int | None
    decode: DecodeCheck
    seconds: float
    notes: list[str] = field(default_factory=list)
    export_seconds: float | None = None  # when the target was a model exported on the fly
    # Where the time went: session creation, reference load, each side's runs (prefill and decode), and for a
    # streamed reference the part spent reading weights from disk.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and self.decode.passed

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(budget=dataclasses.asdict(self.budget), checks=[c.to_dict() for c in self.checks],
                 decode=dataclasses.asdict(self.decode), passed=self.passed)
        return d


@dataclass(frozen=True)
class ParityTarget:
    """What `verify parity` runs, resolved once: the graph's metadata and the PyTorch source beside it."""

    onnx_path: Path | None  # None: export `source` on the fly first
    meta: ExportMetadata | None
    source: ModelSource
    seed: int
    foreign: GraphIO | None = None  # a graph another exporter wrote: its I/O as read from the graph


def resolve_target(target: str | None, source: str | None) -> ParityTarget:
    """TARGET (an .onnx, or a MODEL to export on the fly; default tiny) and --source -> one typed value."""
    target = target or "tiny"
    if not target.endswith(".onnx"):
        if source is not None:
            raise ValueError("--source is for an .onnx TARGET; a MODEL target is its own source")
        return ParityTarget(None, None, resolve(target, weights_required_in_dir=True, needs_data=True), 0)
    if Path(target).is_file() and not has_our_metadata(target):
        return _foreign_target(target, source)
    meta = read_metadata(target)
    if source is None:
        if not meta.source:
            raise ValueError(f"{target}: its metadata names no source; pass --source")
        if meta.seed is None and not Path(meta.source).is_dir():
            raise ValueError(f"{target} was exported from {meta.source}, which is not there any more and no seed "
                             f"reproduces its weights; pass --source with the checkpoint it came from")
        src = resolve(meta.source, needs_data=True)
        if meta.seed is None and src.weights is None:
            raise ValueError(f"{target} was exported from weights that no seed reproduces (source {meta.source!r}); "
                             f"pass --source with the checkpoint they came from")
    else:
        src = resolve(source, weights_required_in_dir=True, needs_data=True)
    _check_same_config(meta.config, src.cfg, target, src.spec)
    return ParityTarget(Path(target), meta, src, meta.seed or 0)


def _foreign_target(target: str, source: str | None) -> ParityTarget:
    """Another exporter's graph: its I/O read from the graph, the config from --source (which is required)."""
    if is_int4(Path(target)):
        raise ValueError(f"{target}: weight-only int4 (MatMulNBits): an fp32 budget does not apply to it; measure "
                         f"it with `llama-tools verify int4` (top-1, KL, perplexity)")
    io = describe_graph(target)
    if source is None:
        raise ValueError(f"{target} was not written by llama-tools ({io.producer}); pass --source with the checkpoint "
                         f"it was exported from")
    src = resolve(source, weights_required_in_dir=True, needs_data=True)
    check_matches(io, src.cfg, src.spec)
    meta = ExportMetadata(config=src.cfg, rope_layout=io.rope_layout, rope_op="", dtype=io.dtype, version="",
                          source=src.spec, seed=None, graph=io.producer)
    return ParityTarget(Path(target), meta, src, 0, io)


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
    if longest + steps > context_length(cfg):  # dynamic NTK: max_position_embeddings x factor
        raise ValueError(f"prompt of {longest} tokens + --steps {steps} exceeds the model's context of "
                         f"{context_length(cfg)} positions; use fewer steps or a shorter prompt")
    static = target.meta.static_kv if target.meta is not None else None
    if static is not None and longest + steps > static:
        raise ValueError(f"prompt of {longest} tokens + --steps {steps} exceeds {target.onnx_path}'s static KV "
                         f"buffer of {static} positions; use fewer steps, or export with a larger --static-kv")


def verify_parity(target: ParityTarget, *, prompts: list[list[int]] | None = None, provider: str = "auto",
                  steps: int = 8, dtype: str = "float32", rope_op: str = "llama_tools", tf32: bool = False,
                  budget: Budget | None = None, progress: Progress = silent) -> ParityReport:
    """Export on the fly when the target is a MODEL, then compare; see the module docstring for the checks."""
    check_inputs(prompts or [], steps, target)
    if target.onnx_path is not None and is_int4(target.onnx_path):
        raise ValueError(f"{target.onnx_path}: weight-only int4 (MatMulNBits): fp32 tolerances do not apply to it; "
                         f"measure it with `llama-tools verify int4 {target.onnx_path}` (top-1, KL, perplexity)")
    if target.onnx_path is not None:
        return _verify(target.onnx_path, target, prompts, provider, steps, tf32, budget, progress)
    # A temp dir of ours (llama_tools.outputs.files): removed on SIGTERM too, and after a SIGKILL by the next run.
    with files.temp_dir("parity") as tmp:
        exported = export_onnx(target.source, Path(tmp) / "model.onnx", dtype=dtype, rope_op=rope_op,
                               seed=target.seed, progress=progress)
        meta = read_metadata(exported.path)
        rep = _verify(exported.path, dataclasses.replace(target, meta=meta), prompts, provider, steps, tf32,
                      budget, progress)
    rep.onnx_path, rep.export_seconds = f"{target.source.spec} (exported on the fly)", exported.seconds
    return rep


@dataclass
class Trace:
    """One side's run: prefill logits and K/V, then the decode steps' logits, and the tokens it was fed."""

    logits: np.ndarray  # [batch, seq, vocab]
    presents: list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V): [batch, kv_heads, seq, n6]
    decode: np.ndarray  # [batch, steps, vocab]: the logits after feeding tokens[:, s]
    tokens: np.ndarray  # [batch, steps]: fed at each decode step (float64's greedy choice)


# One forward step: (ids, mask, positions, past) -> (logits [batch, n, vocab], cache, presents on demand).
Step = Callable[[np.ndarray, np.ndarray, np.ndarray, Any], tuple[np.ndarray, Any, Callable[[], Any]]]


def run_trace(step: Step, ids: np.ndarray, mask: np.ndarray, steps: int, empty: Any,
              tokens: np.ndarray | None = None, progress: Progress = silent, what: str = "") -> Trace:
    """Prefill then `steps` greedy steps through the side's own cache, fed `tokens` (or its own argmax)."""
    logits, cache, presents = step(ids, mask, positions(mask, ids.shape[1]), empty)
    nxt, fed, dec = logits[:, -1], [], []
    for s in range(steps):
        tok = tokens[:, s] if tokens is not None else nxt.argmax(-1)  # [batch]
        fed.append(tok)
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], axis=1)  # [batch, past + 1]
        out, cache, _ = step(tok[:, None].astype(np.int64), mask, positions(mask, 1), cache)
        nxt = out[:, -1]
        dec.append(out)
        progress(s + 1, steps, f"greedy decode step ({what})")
    batch, vocab = logits.shape[0], logits.shape[-1]
    return Trace(logits, presents(), np.concatenate(dec, axis=1) if dec else np.zeros((batch, 0, vocab)),
                 np.stack(fed, 1) if fed else np.zeros((batch, 0), np.int64))


def torch_step(model: Any) -> Step:
    """A PyTorch reference as a Step; its outputs widened to float64 numpy (exact for every float dtype)."""
    import torch

    def step(ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: Any) -> tuple[np.ndarray, Any, Any]:
        with torch.no_grad():
            out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(pos), past_key_values=past)
        f64 = lambda t: t.to(torch.float64).numpy()  # noqa: E731
        return f64(out.logits), out.past_key_values, lambda: [(f64(k), f64(v)) for k, v in out.past_key_values]
    return step


def onnx_step(lm: Any) -> Step:
    """An OnnxLM (or foreign.RowByRow) as a Step: the cache stays where the session keeps it."""
    def step(ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: Any) -> tuple[np.ndarray, Any, Any]:
        try:
            out = lm(ids, mask, pos, past)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  onnxruntime's own exception types: one line, not a traceback
            when = "the prefill" if past is None or ids.shape[1] > 1 else "a decode step (try --steps 0)"
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise ValueError(f"onnxruntime failed in {when}: {first[:300]}") from None
        return out.logits, out.cache, lambda: out.presents
    return step


def budget_for(dtype: str, provider: str, options: dict[str, str]) -> tuple[Budget, str | None]:
    """The dtype's budget; CUDA with TF32 allowed rounds fp32 MatMul inputs to 10 mantissa bits: 2^13 x wider."""
    b = BUDGET[dtype]
    if provider == "cuda" and options.get("use_tf32") == "1" and dtype == dtypes.FLOAT32.name:
        return (dataclasses.replace(b, multiple=b.multiple * 2 ** 13, min_cosine=0.999),
                "TF32 MatMuls: the fp32 budget's multiple widened by 2^13 (TF32 keeps 10 of fp32's 23 mantissa bits)")
    return b, None


def _verify(onnx_path: Path, target: ParityTarget, prompts: list[list[int]] | None, provider: str, steps: int,
            tf32: bool, budget: Budget | None, progress: Progress) -> ParityReport:
    """Run the graph, PyTorch in its dtype and PyTorch in float64 on the same ids; judge each tensor."""
    import torch

    from llama_tools.inference.reference import reference_model

    start = time.perf_counter()
    meta = target.meta
    assert meta is not None, "the graph's metadata is read before it is run"
    cfg = meta.config
    prompts = prompts or default_prompts(cfg.vocab_size, meta.seed)
    clock = _Clock()
    run = create_session(onnx_path, provider, tf32=tf32)
    clock.lap("session")
    if target.foreign is not None:
        lm = foreign_lm(run, target.foreign, cfg)
    else:
        lm = OnnxLM(run, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    session_bytes = _weight_bytes(onnx_path) if run.provider == "cpu" else 0  # the session's copy is in host RAM
    # Streams one layer at a time (cast to the pass's dtype); refused up front when even that will not fit.
    ref_model = reference_model(target.source, seed=target.seed, progress=progress, batch=len(prompts),
                                seq=max(map(len, prompts)), steps=steps, extra_bytes=session_bytes,
                                dtype=getattr(torch, dtypes.get(meta.dtype).torch), float64_pass=True)
    truth_model = ref_model.with_dtype(torch.float64)
    clock.lap("reference load")
    chosen, tf32_note = budget_for(meta.dtype, run.provider, run.options)
    budget = budget or chosen
    # The K cache holds q/k rows in the weights' RoPE layout: compare the graph's in the reference's order.
    k_order = _channel_order(meta.rope_layout, ref_model.cfg.rope_layout, cfg.head_dim)
    by_position = keys_by_position(meta, left_pad(prompts)[1])  # keys rotated by slot turned back by their padding

    ids, mask = left_pad(prompts)
    valid = mask.astype(bool)  # [batch, seq]
    truth = run_trace(torch_step(truth_model), ids, mask, steps, None, None, progress, "PyTorch float64")
    clock.lap("PyTorch float64")
    ref = run_trace(torch_step(ref_model), ids, mask, steps, None, truth.tokens, progress, f"PyTorch {meta.dtype}")
    clock.lap(f"PyTorch {meta.dtype}")
    alt_model = ref_model.with_dtype(ref_model.dtype, reassociated=True)  # a second correct implementation
    alt = run_trace(torch_step(alt_model), ids, mask, steps, None, truth.tokens, progress,
                    f"PyTorch {meta.dtype} reassociated")
    clock.lap(f"PyTorch {meta.dtype} reassociated")
    got = run_trace(onnx_step(lm), ids, mask, steps, lm.empty_cache(len(prompts)), truth.tokens, progress,
                    "onnxruntime")
    clock.lap("onnxruntime")

    wide: list[Trace] = []  # fp16 only: PyTorch fp32, run where PyTorch fp16 overflows (compare.judge's fallback)

    def widened() -> list[Trace]:
        if not wide:
            t0 = time.perf_counter()
            for again in (False, True):
                wide.append(run_trace(torch_step(ref_model.with_dtype(torch.float32, reassociated=again)), ids, mask,
                                      steps, None, truth.tokens, progress, "PyTorch float32 (where fp16 overflows)"))
            clock.laps["PyTorch float32 (where fp16 overflows)"] = time.perf_counter() - t0
            clock.last = time.perf_counter()
        return wide

    def fallback(pick: Callable[[Trace], np.ndarray]) -> Callable[[], list[np.ndarray]] | None:
        return (lambda: [pick(w) for w in widened()]) if meta.dtype == dtypes.FLOAT16.name else None

    checks = [judge("logits", got.logits, (ref.logits, alt.logits), truth.logits, valid, meta.dtype, budget,
                    logits=True, fallback=fallback(lambda w: w.logits))]
    first_bad_layer = None
    kv = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731  [batch, kv_heads, seq, n6] -> [batch, seq, kv_heads, n6]
    for i, ((gk, gv), (rk, rv), (ak, av), (tk, tv)) in enumerate(zip(got.presents, ref.presents, alt.presents,
                                                                     truth.presents)):
        gk = by_position(i, gk)[..., k_order]
        for w, (what, g, r, a, t) in enumerate((("key", gk, rk, ak, tk), ("value", gv, rv, av, tv))):
            c = judge(f"present.{i}.{what}", kv(g), (kv(r), kv(a)), kv(t), valid, meta.dtype, budget,
                      fallback=fallback(lambda tr, i=i, w=w: kv(tr.presents[i][w])))
            checks.append(c)
            if not c.passed and first_bad_layer is None:
                first_bad_layer = i
    if steps:
        checks.append(judge("decode logits", got.decode, (ref.decode, alt.decode), truth.decode,
                            np.ones(got.decode.shape[:2], bool), meta.dtype, budget, logits=True,
                            fallback=fallback(lambda tr: tr.decode)))
    decode = _greedy(got, truth, checks[0].tie, checks[-1].tie)
    clock.lap("compare")
    label = DTYPE_LABEL.get(meta.dtype, meta.dtype)
    notes = [f"error = RMS |onnxruntime - PyTorch float64|, noise = the larger RMS |PyTorch {label} - PyTorch "
             f"float64| of two correct implementations (PyTorch's, and PyTorch's with every matrix product summed "
             f"in another order) over the real positions; pass when error <= {budget.multiple:g} x noise + {budget.floor_ulps:g} ulp of "
             f"{meta.dtype} at the tensor's RMS, cosine >= {budget.min_cosine}"]
    if tf32_note:
        notes.append(tf32_note)
    estimated = [c.name for c in checks if c.estimate]
    if estimated:
        notes.append(f"PyTorch fp16 overflows (NaN/Inf where float64 is finite) in {len(estimated)} check(s) from "
                     f"{estimated[0]} on: their noise is PyTorch fp32's x {FP16_PER_FP32:g} (the smallest fp16/fp32 "
                     f"noise ratio measured where fp16 is finite)")
    if target.foreign is not None:
        io = target.foreign
        notes.append(f"a {io.producer} graph: inputs and outputs read from it (cache {io.past} -> {io.present}"
                     + (", position_ids" if io.position_ids else ", no position_ids")
                     + ("; run one row at a time: its attention takes no left padding" if io.row_by_row else "") + ")")
    if meta.rope_layout != ref_model.cfg.rope_layout:
        notes.append(f"the graph's K rows are {meta.rope_layout}, the reference's {ref_model.cfg.rope_layout}: "
                     f"K compared after reordering its channels")
    graph = target.foreign.producer if target.foreign is not None else f"llama-tools {meta.graph}"
    return ParityReport(
        onnx_path=str(onnx_path), source=target.source.label, provider=run.provider, provider_note=run.note,
        provider_options=dict(run.options), dtype=meta.dtype, graph=graph,
        reference=f"PyTorch {meta.dtype} (noise), PyTorch float64 (truth)", prompt_lengths=[len(p) for p in prompts],
        budget=budget, checks=checks, first_bad_layer=first_bad_layer, decode=decode,
        seconds=time.perf_counter() - start, notes=notes, timings=clock.laps | _read_seconds(ref_model),
    )


def _greedy(got: Trace, truth: Trace, prefill_tie: float, decode_tie: float) -> DecodeCheck:
    """The graph's argmax at every step against float64's token; a flip on a near-tie is reported, not failed.

    A near-tie: float64's top-2 margin there is within what a within-budget error could flip (the `tie` of
    the prefill logits check for step 0, of the decode logits check after).
    """
    steps = truth.tokens.shape[1]
    if steps == 0:
        return DecodeCheck(0, 0, None, "no decode steps asked for", [], [], True)
    # The logits each step's token was chosen from: the prefill's last row, then each decode step's but the last.
    g = np.concatenate([got.logits[:, -1:], got.decode[:, :-1]], axis=1).astype(np.float64)  # [batch, steps, vocab]
    t = np.concatenate([truth.logits[:, -1:], truth.decode[:, :-1]], axis=1)
    g_tok = g.argmax(-1)  # [batch, steps]
    differ = g_tok != truth.tokens
    agreed = int((~differ).all(0).sum())
    first, what, passed = None, "every step agrees", True
    if differ.any():
        step = int(np.nonzero(differ.any(0))[0][0])
        row = int(np.nonzero(differ[:, step])[0][0])
        m = float(margin(t[row, step]))
        first, passed = step, m <= (prefill_tie if step == 0 else decode_tie)
        what = (f"step {step}, row {row}: float64 {int(truth.tokens[row, step])}, ONNX {int(g_tok[row, step])} "
                f"(float64 top-2 margin {m:.3g}" + (", a near-tie: not counted as a failure)" if passed else ")"))
    return DecodeCheck(steps, agreed, first, what, truth.tokens.tolist(), g_tok.tolist(), passed)


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


def _weight_bytes(onnx_path: Path) -> int:
    """Bytes of the graph's weights on disk (the file and its external data)."""
    data = onnx_path.parent / (onnx_path.name + ".data")
    return onnx_path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def keys_by_position(meta: ExportMetadata, mask: np.ndarray) -> Callable[[int, np.ndarray], np.ndarray]:
    """(layer, present K [b, kv_heads, slots, n6]) -> the keys rotated by position, as the reference holds them.

    A graph whose attention rotates (rope_op IN_ATTENTION) turns each key by its cache slot: a left-padded row's
    by its padding more than its position. The scores are unchanged (they see only distances); the cache is
    turned back here, row by row, before it is compared. Any other graph's keys are returned as they are.
    """
    if meta.rope_op != rope_ops.IN_ATTENTION.name:
        return lambda layer, keys: keys
    from llama_tools.modeling.model import layer_tables, rope_tables_of

    cfg = meta.config
    pads = (np.cumsum(mask, axis=1) == 0).sum(axis=1)  # [b]: the zeros before a row's first token
    tables = rope_tables_of(cfg, length=int(pads.max()) + 1, rotation_only=True)  # a turn: no attention factor
    assert tables is not None, "a graph whose attention rotates has RoPE tables"

    def turned_back(layer: int, keys: np.ndarray) -> np.ndarray:
        if not cfg.rotates(layer):  # SmolLM3's layers without RoPE: GQA left their keys as they are
            return keys
        cos, sin = layer_tables(tables, cfg.slides(layer))
        return rope_ops.unrotate_slots(keys, pads, cos.numpy(), sin.numpy(), meta.rope_layout == INTERLEAVED)
    return turned_back


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
