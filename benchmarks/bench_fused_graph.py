"""Plain vs fused ONNX graph on onnxruntime's CPU: prefill and one decode step of the same seeded weights.

    python benchmarks/bench_fused_graph.py [--model 125m|tiny] [--threads 2] [--seq 128] [--rounds 5]

Variants, all exported into a temp dir from the same `load_model(cfg, seed=0)` weights, batch 1:
  - plain: export_onnx's graph (RoPE our op), fed numpy arrays (past grows by concatenation);
  - fused: export_fused's graph (GroupQueryAttention, packed MatMuls, Skip norms, our RoPE op), numpy feeds;
  - fused attention-rope: the same with GroupQueryAttention's own rotary (the fused default);
  - fused contrib-rope: the same with com.microsoft.RotaryEmbedding;
  - fused static: export_fused(static_kv=seq + 8) driven by fused.StaticKVSession (IOBinding, one buffer per
    layer bound as past and present: GQA writes the new slot in place).
Prefill: --seq tokens into an empty cache. Decode: one token over a cache of --seq (the same step repeated).
Blocks of calls per variant in turn over --rounds rounds; the median of each variant's calls, and its
ratio plain / variant (above 1: faster than plain). Each variant's logits are compared with plain's once.
`measure()` is the importable part: benchmarks/bench_fused.py can call it with its own config.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from llama_tools.exporters.fused import StaticKVSession, export_fused
from llama_tools.exporters.graph_io import io_names
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.presets import get_preset

MODELS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": lambda: get_preset("tiny"),
    # The issue's ~125M LLaMA: 768 wide, 12 layers, 12 query / 4 KV heads of 64, vocab 32000.
    "125m": lambda: get_preset("tiny").replace(
        name="llama-125m", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048),
}


@dataclass
class Timing:
    """One variant's medians (seconds) and its logits' max |difference| from the plain graph's."""

    variant: str
    prefill_s: float
    decode_s: float
    prefill_diff: float
    decode_diff: float
    export_s: float
    bytes: int


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _plain_runner(sess: ort.InferenceSession, cfg: ModelConfig, seq: int, past_slots: int | None):
    """(prefill(), decode()) closures over prepared numpy feeds; each returns the logits."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, size=(1, seq + 1)).astype(np.int64)  # the prompt, then one more token
    names_in, _ = io_names(cfg.num_hidden_layers)
    shape = (1, cfg.num_key_value_heads, past_slots or 0, cfg.head_dim)  # [batch, kv, 0 or buffer, hd]
    empty = {n: np.zeros(shape, np.float32) for n in names_in[3:]}
    prefill_feed = {"input_ids": ids[:, :seq], "attention_mask": np.ones((1, seq), np.int64),
                    "position_ids": np.arange(seq, dtype=np.int64)[None], **empty}
    out = sess.run(None, prefill_feed)
    decode_feed = {"input_ids": ids[:, seq:], "attention_mask": np.ones((1, seq + 1), np.int64),
                   "position_ids": np.array([[seq]], np.int64), **dict(zip(names_in[3:], out[1:]))}
    return (lambda: sess.run(["logits"], prefill_feed)[0]), (lambda: sess.run(["logits"], decode_feed)[0])


def _static_runner(sess: ort.InferenceSession, cfg: ModelConfig, seq: int, slots: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, size=(1, seq + 1)).astype(np.int64)
    run = StaticKVSession(sess, cfg, batch=1, max_length=slots)
    mask, pos = np.ones((1, seq), np.int64), np.arange(seq, dtype=np.int64)[None]
    run.step(ids[:, :seq], mask, pos)  # fills slots [0, seq); decode then rewrites slot seq each call
    dmask, dpos = np.ones((1, seq + 1), np.int64), np.array([[seq]], np.int64)
    return (lambda: run.step(ids[:, :seq], mask, pos)), (lambda: run.step(ids[:, seq:], dmask, dpos))


def measure(cfg: ModelConfig, *, threads: int = 2, seq: int = 128, rounds: int = 5, prefill_repeat: int = 2,
            decode_repeat: int = 10, seed: int = 0, workdir: Path | None = None,
            say: Callable[[str], None] = lambda m: None) -> list[Timing]:
    """Export the variants of `cfg`'s seeded weights and time them; the first row is the plain graph."""
    with tempfile.TemporaryDirectory(prefix="bench_fused_graph.") as d:
        tmp = Path(workdir or d)
        slots = seq + 8
        made = []
        t = time.perf_counter()
        plain = export_onnx(cfg, tmp / "plain.onnx", seed=seed)
        made.append(("plain", plain.path, plain.bytes, time.perf_counter() - t, None))
        for name, kw in (("fused", {"rope_op": "llama_tools"}), ("fused attention-rope", {"rope_op": "attention"}),
                         ("fused contrib-rope", {"rope_op": "contrib"}),
                         ("fused static (IOBinding)", {"static_kv": slots, "rope_op": "llama_tools"})):
            t = time.perf_counter()
            res = export_fused(cfg, tmp / f"{name.split()[0]}-{len(made)}.onnx", seed=seed, **kw)
            made.append((name, res.path, res.bytes, time.perf_counter() - t, kw.get("static_kv")))
        say(f"exported {len(made)} graphs")
        runners = []
        for name, path, size, secs, static in made:
            sess = _session(path, threads)
            fns = _static_runner(sess, cfg, seq, static) if static else _plain_runner(sess, cfg, seq, None)
            runners.append((name, fns, size, secs))
        ref_prefill, ref_decode = runners[0][1][0](), runners[0][1][1]()
        times = {name: ([], []) for name, *_ in runners}
        for _ in range(rounds):
            for name, (prefill, decode), *_ in runners:
                prefill()  # warm-up call, untimed
                for _ in range(prefill_repeat):
                    t = time.perf_counter()
                    prefill()
                    times[name][0].append(time.perf_counter() - t)
                decode()
                for _ in range(decode_repeat):
                    t = time.perf_counter()
                    decode()
                    times[name][1].append(time.perf_counter() - t)
        rows = []
        for name, (prefill, decode), size, secs in runners:
            rows.append(Timing(name, statistics.median(times[name][0]), statistics.median(times[name][1]),
                               float(np.abs(prefill()[:, -1] - ref_prefill[:, -1]).max()),
                               float(np.abs(decode() - ref_decode).max()), secs, size))
        return rows


def print_table(rows: list[Timing], seq: int) -> None:
    plain = rows[0]
    print(f"\n| variant | prefill {seq} (ms) | x plain | decode step at {seq} (ms) | x plain | max |logits - plain| "
          f"(prefill last, decode) | export (s) | file (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.variant} | {r.prefill_s * 1e3:.1f} | {plain.prefill_s / r.prefill_s:.2f}x | "
              f"{r.decode_s * 1e3:.2f} | {plain.decode_s / r.decode_s:.2f}x | {r.prefill_diff:.1e}, "
              f"{r.decode_diff:.1e} | {r.export_s:.1f} | {r.bytes / 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125m", choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=2, help="ORT intra_op_num_threads")
    ap.add_argument("--seq", type=int, default=128, help="prefill length, and the decode step's cache length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-repeat", type=int, default=2)
    ap.add_argument("--decode-repeat", type=int, default=10)
    args = ap.parse_args()
    cfg = MODELS[args.model]()
    t0 = time.perf_counter()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; onnxruntime {ort.__version__} "
          f"CPUExecutionProvider, intra_op {args.threads} threads, sequential; python {sys.version.split()[0]}")
    print(f"{cfg.name}: {cfg.hidden_size} wide, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q / "
          f"{cfg.num_key_value_heads} kv heads of {cfg.head_dim}, vocab {cfg.vocab_size}, fp32, batch 1; medians of "
          f"{args.rounds} rounds x {args.prefill_repeat} prefills / {args.decode_repeat} decode steps")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = measure(cfg, threads=args.threads, seq=args.seq, rounds=args.rounds, prefill_repeat=args.prefill_repeat,
                   decode_repeat=args.decode_repeat, say=lambda m: print(m, file=sys.stderr))
    print_table(rows, args.seq)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
