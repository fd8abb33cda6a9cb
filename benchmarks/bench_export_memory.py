"""Peak memory of `export onnx` from a checkpoint: plain, fused (--optimize) and int4 (--quantize int4).

    python benchmarks/bench_export_memory.py [--layers 2] [--skip-7b] [--skip-smollm2]

Each export is the real command (`llama-tools export onnx CKPT -o OUT ... --format json`) in a fresh process;
its peak RSS is the process's high-water mark over the whole run (tracing or graph building, writing, int4
quantization and the int4 quality check), as the command's own `peak RSS` row reports it. Models:

- SmolLM2-135M-Instruct (the test suite's real model, converted and cached as tests/realmodels.py does),
  fp32 weights 538 MB. Goal (issue 17): fused and int4 at most the plain export's peak.
- LLaMA-7B width (n2 4096, n7 11008, 32 heads, vocab 32000, untied) with --layers decoders, seeded, written
  as HF safetensors to a temp dir. Goal: fused and int4 peak <= max(1 GB, 0.5x the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
MODES = {"plain": [], "fused": ["--optimize"], "int4": ["--quantize", "int4"]}


def export(ckpt: Path, out: Path, mode: str) -> dict:
    cmd = [sys.executable, "-m", "llama_tools.cli", "export", "onnx", str(ckpt), "-o", str(out), *MODES[mode],
           "--format", "json", "-q", "--no-client-files"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    return json.loads(run.stdout)


def weights_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def bench(name: str, ckpt: Path, goal: str, tmp: Path) -> list[str]:
    w = weights_bytes(ckpt)
    rows, plain_peak = [], None
    for mode in MODES:
        r = export(ckpt, tmp / name / mode / "model.onnx", mode)
        peak = r["peak_rss_bytes"]
        plain_peak = plain_peak or peak
        rows.append(f"| {name} | {w / 1e9:.2f} GB | {mode} | {peak / 1e9:.2f} GB | {peak / w:.2f}x | "
                    f"{peak / plain_peak:.2f}x | {r['wall_seconds']:.1f} s | {r['bytes'] / 1e6:,.0f} MB |")
        print(rows[-1], flush=True)
    print(f"goal for {name}: {goal}")
    return rows


def write_7b_width(layers: int, directory: Path) -> None:
    import torch

    from llama_tools.checkpoints.convert import save_checkpoint
    from llama_tools.modeling.model import build_model
    from llama_tools.modeling.presets import get_preset

    cfg = get_preset("llama-7b").replace(num_hidden_layers=layers, torch_dtype="float32")
    with torch.no_grad():
        model = build_model(cfg, dtype=torch.float32)
    save_checkpoint(cfg, {k: v.detach() for k, v in model.state_dict().items()}, directory, to="hf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="decoders of the 7B-width checkpoint [2]")
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}")
    print("| model | fp32 weights | export | peak RSS | / weights | / plain's | wall | file |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-export-memory-") as t:
        tmp = Path(t)
        if not args.skip_smollm2:
            from tests.realmodels import Unavailable, smollm2_hf

            try:  # converted once and cached, as the test suite does
                bench("SmolLM2-135M", smollm2_hf(), "fused, int4 <= plain's peak", tmp)
            except Unavailable as e:
                print(f"SmolLM2: {e}")
        if not args.skip_7b:
            ckpt = tmp / "llama-7b-width"
            write_7b_width(args.layers, ckpt)
            bench(f"7B width, {args.layers} layers", ckpt, "fused, int4 <= max(1 GB, 0.5x the weights)", tmp)


if __name__ == "__main__":
    main()
