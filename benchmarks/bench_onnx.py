"""PyTorch eager vs onnxruntime (CPU) on export_onnx's graph: prefill and decode latency, and what ORT fuses.

    python benchmarks/bench_onnx.py [--models tiny,150m] [--dtype float32|float16] [--threads N]
        [--rounds 3] [--repeat 3] [--decode-repeat 10] [--seq 128] [--optimizer-type qwen3|none]

In one process and one dtype, for each model (the `tiny` preset and a 134M-parameter LLaMA):
prefill of --seq tokens (batch 1) and one decode step over a KV cache of --seq, each variant timed
in blocks taken in turn over several rounds (median, and min), for
  - eager PyTorch under torch.no_grad() and under torch.inference_mode();
  - onnxruntime CPU sessions (own SessionOptions, same thread count as torch) on graphs exported by
    export_onnx into a temp dir: RoPE as our llama_tools op (an ONNX function ORT inlines) or as
    com.microsoft.RotaryEmbedding (`--rope-op contrib`), at ORT_ENABLE_ALL (what exporters.runtime
    gets: its SessionOptions keep the default level, checked and printed) and at ORT_ENABLE_BASIC;
  - the same graphs first rewritten by onnxruntime.transformers.optimizer.optimize_model.
Ratios are eager (no_grad) / variant: above 1 means the variant is faster. Each variant's logits
(prefill and decode) are compared once with eager's: max |difference|. Then the op types of every
ORT variant's optimized graph (sess_options.optimized_model_filepath) are counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch

from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.runtime import create_session
from llama_tools.counting.accounting import count_params
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.presets import get_preset
from llama_tools.modeling.model import Llama, build_model

MODELS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": lambda: get_preset("tiny"),
    # head_dim explicitly: replace() keeps tiny's derived head_dim (64 / 4 = 16), not 768 / 12.
    "150m": lambda: get_preset("tiny").replace(
        name="llama-150m", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, head_dim=64, max_position_embeddings=2048),
}
# Ops that stand for a fusion (ORT contrib or fused standard ops): listed first, and as "absent" when missing.
FUSED = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding",
         "MultiHeadAttention", "GroupQueryAttention", "Attention", "FusedMatMul", "QuickGelu", "FastGelu",
         "BiasGelu", "Gelu", "MatMulNBits")
LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}


@dataclass
class Row:
    model: str
    variant: str
    prefill_s: float | None = None  # median
    decode_s: float | None = None
    prefill_min: float | None = None  # the fastest run: what a background load did not slow
    decode_min: float | None = None
    diff_prefill: float | None = None  # max |logits - eager logits|
    diff_decode: float | None = None
    note: str = ""


@dataclass
class Graph:
    """One ORT variant's optimized graph: op type counts, and what the transformers optimizer reported."""

    model: str
    variant: str
    ops: collections.Counter = field(default_factory=collections.Counter)
    optimizer_stats: dict[str, int] | None = None  # None: no transformers optimizer on this one


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


# --- Inputs -------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """Prefill (seq tokens, batch 1) and one decode token after it, as numpy int64."""

    ids: np.ndarray  # [1, seq]
    mask: np.ndarray  # [1, seq]
    pos: np.ndarray  # [1, seq]
    next_id: np.ndarray  # [1, 1]
    next_mask: np.ndarray  # [1, seq + 1]
    next_pos: np.ndarray  # [1, 1]


def make_inputs(cfg: ModelConfig, seq: int) -> Inputs:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, size=(1, seq + 1), dtype=np.int64)
    return Inputs(ids[:, :seq], np.ones((1, seq), np.int64), np.arange(seq, dtype=np.int64)[None],
                  ids[:, seq:], np.ones((1, seq + 1), np.int64), np.array([[seq]], np.int64))


# --- The variants: a prefill and a decode step each, timed in interleaved rounds -------------------------

@dataclass
class Variant:
    name: str
    prefill: Callable[[], Any]
    decode: Callable[[], Any]  # one token over the KV cache of the variant's own prefill
    logits: tuple[np.ndarray, np.ndarray]  # (prefill, decode), fp32, for the numerics check
    times: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))


def eager_variant(name: str, model: Llama, x: Inputs, ctx: Callable[[], Any]) -> Variant:
    t = {k: torch.from_numpy(v) for k, v in vars(x).items()}

    def prefill() -> Any:
        with ctx():
            return model(t["ids"], t["mask"], t["pos"])

    out = prefill()
    past = out.past_key_values  # KV cache of seq positions, reused by every timed decode step

    def decode() -> Any:
        with ctx():
            return model(t["next_id"], t["next_mask"], t["next_pos"], past)

    return Variant(name, prefill, decode, (out.logits.float().numpy(), decode().logits.float().numpy()))


def ort_session(path: Path, level: str, threads: int, optimized: Path) -> ort.InferenceSession:
    """A CPU session with our thread count; its optimized graph goes to `optimized` (+ .data, weights)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # the NchwcTransformer warning on saving an ORT_ENABLE_ALL graph
    so.optimized_model_filepath = str(optimized)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", optimized.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_variant(name: str, sess: ort.InferenceSession, cfg: ModelConfig, x: Inputs) -> Variant:
    """Feeds built once; sess.run on numpy inputs, all outputs fetched (the presents are the step's result)."""
    types = {i.name: i.type for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    kv_dtype = np.float16 if types["past_key_values.0.key"] == "tensor(float16)" else np.float32
    empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), kv_dtype)
    past_names = [n for n in types if n.startswith("past_key_values.")]
    feed = {"input_ids": x.ids, "attention_mask": x.mask, "position_ids": x.pos, **{n: empty for n in past_names}}
    out = sess.run(None, feed)
    presents = dict(zip(outs, out))
    step = {"input_ids": x.next_id, "attention_mask": x.next_mask, "position_ids": x.next_pos,
            **{n: presents[n.replace("past_key_values.", "present.")] for n in past_names}}
    logits_decode = sess.run(["logits"], step)[0]
    return Variant(name, lambda: sess.run(None, feed), lambda: sess.run(None, step),
                   (out[0].astype(np.float32), logits_decode.astype(np.float32)))


def time_in_rounds(variants: list[Variant], rounds: int, warmup: int, repeat: int, decode_repeat: int,
                   settle_s: float) -> None:
    """Blocks of one variant's calls, the variants in turn, `rounds` times over; times go to v.times.

    Rounds spread a background load over all variants. Between blocks a pause lets the previous
    variant's threads stop spinning (ORT's pool and torch's OpenMP threads busy-wait after work, and
    on 2 cores a spinning thread can stall a millisecond step by a scheduler time slice); the warm-up
    calls absorb what is left.
    """
    for which, n in ((0, repeat), (1, decode_repeat)):
        for _ in range(rounds):
            for v in variants:
                fn = (v.prefill, v.decode)[which]
                time.sleep(settle_s)
                for _ in range(warmup):
                    fn()
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    v.times[which].append(time.perf_counter() - t0)


def op_counts(path: Path) -> collections.Counter:
    """Node count per op type; ops outside the default domain are named domain.op (com.microsoft.FusedMatMul)."""
    m = onnx.load(str(path), load_external_data=False)
    return collections.Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
                               for n in m.graph.node)


def is_fused(op: str) -> bool:
    return op.rsplit(".", 1)[-1] in FUSED and not op.startswith("llama_tools.")  # ours is no fusion


@contextlib.contextmanager
def quiet_optimizer():
    """The transformers optimizer logs every fusion at INFO and prints symbolic-shape warnings."""
    loggers = [logging.getLogger(n) for n in ("onnxruntime.transformers", "fusion_base", "onnx_model", "")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def transformers_optimize(src: Path, dst: Path, cfg: ModelConfig, model_type: str) -> dict[str, int]:
    """onnxruntime.transformers.optimizer on our graph (python fusions only: opt_level 0); the fusions it reports."""
    from onnxruntime.transformers.optimizer import optimize_model

    with quiet_optimizer():
        opt = optimize_model(str(src), model_type=model_type, num_heads=cfg.num_attention_heads,
                             hidden_size=cfg.hidden_size, opt_level=0)
        opt.save_model_to_file(str(dst), use_external_data_format=False)
    # Its own get_fused_operator_statistics() counts op types in any domain (our RotaryEmbedding too): diff instead.
    added = op_counts(dst) - op_counts(src)
    return {op: n for op, n in added.items() if is_fused(op)}


# --- One model --------------------------------------------------------------------------------------------

def bench_model(key: str, args: argparse.Namespace, tmp: Path) -> tuple[list[Row], list[Graph]]:
    cfg = MODELS[key]()
    dtype = {"float32": torch.float32, "float16": torch.float16}[args.dtype]
    params = count_params(cfg).total
    print(f"\n== {cfg.name}: {params:,} parameters ({params / 1e6:.1f}M), {cfg.num_hidden_layers} layers, "
          f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, "
          f"vocab {cfg.vocab_size}, {args.dtype}", flush=True)
    model = build_model(cfg, dtype=dtype, seed=0)
    x = make_inputs(cfg, args.seq)
    rows: list[Row] = []
    graphs: list[Graph] = []

    runs = [eager_variant("eager torch.no_grad()", model, x, torch.no_grad),
            eager_variant("eager torch.inference_mode()", model, x, torch.inference_mode)]
    ref_p, ref_d = runs[0].logits
    print(f"   max |logits| of eager: prefill {np.abs(ref_p).max():.3g}, decode {np.abs(ref_d).max():.3g}",
          flush=True)

    exported: dict[str, Path] = {}
    for rope_op in ("llama_tools", "contrib"):
        path = tmp / f"{key}_{rope_op}.onnx"
        t0 = time.perf_counter()
        res = export_onnx(model, path, dtype=args.dtype, rope_op=rope_op, check=False)
        exported[rope_op] = path
        print(f"   exported rope_op={rope_op}: {res.num_nodes} nodes, {res.bytes / 2**20:.0f} MiB, "
              f"{time.perf_counter() - t0:.1f}s", flush=True)

    variants: list[tuple[str, Path, str, dict[str, int] | None]] = [  # name, graph, level, optimizer stats
        ("ORT all, rope llama_tools", exported["llama_tools"], "all", None),
        ("ORT basic, rope llama_tools", exported["llama_tools"], "basic", None),
        ("ORT all, rope contrib", exported["contrib"], "all", None),
    ]
    if args.optimizer_type != "none":
        for rope_op in ("llama_tools", "contrib"):
            dst = tmp / f"{key}_{rope_op}_{args.optimizer_type}.onnx"
            t0 = time.perf_counter()
            try:
                stats = transformers_optimize(exported[rope_op], dst, cfg, args.optimizer_type)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"   transformers optimizer ({args.optimizer_type}) failed on rope {rope_op}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
                continue
            print(f"   transformers optimizer ({args.optimizer_type}) on rope {rope_op}: "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
            variants.append((f"ORT all + optimizer({args.optimizer_type}), rope {rope_op}", dst, "all", stats))

    failed: list[Row] = []
    for name, path, level, stats in variants:
        optimized = tmp / f"{path.stem}.{level}.opt.onnx"
        try:
            runs.append(ort_variant(name, ort_session(path, level, args.threads, optimized), cfg, x))
        except Exception as e:  # noqa: BLE001 - a variant that does not run is a result too
            failed.append(Row(key, name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"))
            continue
        graphs.append(Graph(key, name, op_counts(optimized), stats))

    t0 = time.perf_counter()
    time_in_rounds(runs, args.rounds, args.warmup, args.repeat, args.decode_repeat, args.settle)
    print(f"   timed {len(runs)} variants in {time.perf_counter() - t0:.0f}s", flush=True)
    for v in runs:
        rows.append(Row(key, v.name, statistics.median(v.times[0]), statistics.median(v.times[1]),
                        min(v.times[0]), min(v.times[1]), max_diff(v.logits[0], ref_p), max_diff(v.logits[1], ref_d)))
    return rows + failed, graphs


# --- Output -----------------------------------------------------------------------------------------------

def ms(median: float | None, best: float | None) -> str:
    return "" if median is None or best is None else f"{median * 1e3:.2f} ({best * 1e3:.2f})"


def ratio(ref: float | None, s: float | None) -> str:
    return "" if ref is None or s is None else f"{ref / s:.2f}x"


def sci(v: float | None) -> str:
    return "" if v is None else f"{v:.1e}"


def print_table(rows: list[Row], seq: int) -> None:
    head = ["model", "variant", f"prefill {seq}: ms (min)", "decode: ms (min)", "eager/this pre", "eager/this dec",
            "max|dlogits| pre", "max|dlogits| dec"]
    body = []
    for row in rows:
        ref = next(r for r in rows if r.model == row.model and r.variant.startswith("eager torch.no_grad"))
        if row.note:
            body.append([row.model, row.variant, row.note, "", "", "", "", ""])
            continue
        body.append([row.model, row.variant, ms(row.prefill_s, row.prefill_min), ms(row.decode_s, row.decode_min),
                     ratio(ref.prefill_s, row.prefill_s), ratio(ref.decode_s, row.decode_s),
                     "(reference)" if row is ref else sci(row.diff_prefill),
                     "(reference)" if row is ref else sci(row.diff_decode)])
    widths = [max(len(str(c[i])) for c in [head, *body]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print("\n" + fmt(head))
    print("  ".join("-" * w for w in widths))
    for cells in body:
        print(fmt(cells))


def print_graphs(graphs: list[Graph]) -> None:
    print("\nOp types in each session's optimized graph (optimized_model_filepath):")
    for g in graphs:
        fused = [f"{op} {n}" for op, n in g.ops.most_common() if is_fused(op)]
        present = {op.rsplit(".", 1)[-1] for op in g.ops if is_fused(op)}
        absent = [op for op in FUSED if op not in present]
        rest = [f"{op} {n}" for op, n in g.ops.most_common() if not is_fused(op)]
        print(f"  {g.model} | {g.variant}: {sum(g.ops.values())} nodes")
        print(f"      fused:  {', '.join(fused) or '-'}")
        print(f"      others: {', '.join(rest)}")
        print(f"      absent: {', '.join(absent)}")
        if g.optimizer_stats is not None:
            print(f"      added by the transformers optimizer: "
                  f"{', '.join(f'{k} {v}' for k, v in g.optimizer_stats.items()) or 'nothing'}")


def runtime_level(tmp: Path) -> str:
    """The graph optimization level exporters.runtime.create_session's session really has."""
    path = tmp / "probe.onnx"
    export_onnx(get_preset("tiny"), path, check=False)
    so = create_session(path, "cpu").session.get_session_options()
    return f"{so.graph_optimization_level.name}, intra_op_num_threads={so.intra_op_num_threads} (0: ORT's default)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,150m", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--seq", type=int, default=128, help="prefill length, and the decode step's KV cache length")
    ap.add_argument("--rounds", type=int, default=3, help="passes over all variants (a block of calls each)")
    ap.add_argument("--repeat", type=int, default=3, help="timed prefill runs per variant and round")
    ap.add_argument("--decode-repeat", type=int, default=10, help="timed decode steps per variant and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before each block")
    ap.add_argument("--settle", type=float, default=0.2, help="seconds of pause before each block")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch.set_num_threads and ORT intra_op_num_threads")
    ap.add_argument("--optimizer-type", default="qwen3",
                    help="onnxruntime.transformers.optimizer model_type, or 'none' to skip it")
    args = ap.parse_args()
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    bad = [k for k in keys if k not in MODELS]
    if bad:
        ap.error(f"unknown model {bad[0]!r}; choose from {', '.join(MODELS)}")
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    if args.optimizer_type not in (*MODEL_TYPES, "none"):
        ap.error(f"--optimizer-type {args.optimizer_type!r}: onnxruntime {ort.__version__} has {', '.join(MODEL_TYPES)}")

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__} (CPUExecutionProvider), python "
          f"{sys.version.split()[0]}; threads: torch {torch.get_num_threads()}, ORT intra_op {args.threads} "
          f"(inter_op 1, sequential)")
    print(f"prefill: batch 1 x {args.seq} tokens; decode: one token over a KV cache of {args.seq}. Medians of "
          f"{args.rounds} rounds x {args.repeat} prefills / {args.decode_repeat} decode steps per variant, "
          f"{args.warmup} warm-up and {args.settle}s pause before each block")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"transformers optimizer model types in {ort.__version__}: {', '.join(MODEL_TYPES)} (no llama; qwen3 is "
          f"the decoder-only RoPE/RMSNorm/GQA one); using {args.optimizer_type!r}")
    rows: list[Row] = []
    graphs: list[Graph] = []
    with tempfile.TemporaryDirectory(prefix="bench_onnx.") as d:
        tmp = Path(d)
        print(f"exporters.runtime.create_session's level: {runtime_level(tmp)}")
        for key in keys:
            r, g = bench_model(key, args, tmp)
            rows += r
            graphs += g
    print_table(rows, args.seq)
    print_graphs(graphs)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min); total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
