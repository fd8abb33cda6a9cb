"""int4 variants of a real trained model: size, quality on real text, and whether it still says "Paris".

Each variant is `llama-tools export onnx HF_DIR --quantize int4 [options]` (the fused graph, then onnxruntime's
MatMulNBits quantizer), scored by the export's own quality line (KL and top-1 against the full-precision model on
its built-in text) and by `verify int4 --text` on a second, held-out paragraph (perplexity vs PyTorch fp32).

    python benchmarks/bench_int4.py [HF_DIR]      # default: the tests' SmolLM2-135M-Instruct (tests/realmodels.py)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = ("Paris is the capital and largest city of France. With an estimated population of over two million "
        "residents, it is the centre of the Paris Region. The city is a major railway, highway, and air-transport "
        "hub served by two international airports. The Louvre is the most-visited art museum in the world.")
VARIANTS = {
    "symmetric, block 32 (default)": [],
    "asymmetric, block 32": ["--int4-asymmetric"],
    "symmetric, block 16": ["--int4-block-size", "16"],
    "symmetric, block 64": ["--int4-block-size", "64"],
    "symmetric, block 32, lm_head kept fp32": ["--int4-keep", "/lm_head/MatMul"],
    "HQQ, block 32": ["--int4-algorithm", "hqq"],
    "HQQ, block 64": ["--int4-algorithm", "hqq", "--int4-block-size", "64"],
}


def run_size(path: Path) -> int:
    data = path.parent / (path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def run(*argv: str) -> dict:
    done = subprocess.run(["llama-tools", *argv, "--format", "json"], capture_output=True, text=True)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        sys.exit(f"{' '.join(argv)}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def decode_ms(path: Path, cfg) -> float:
    """Median ms of one decode step at 64..96 tokens of context (onnxruntime CPU, batch 1)."""
    import time

    import numpy as np

    from llama_tools.exporters.runtime import OnnxLM, create_session

    lm = OnnxLM(create_session(path, "cpu"), cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    ids = np.arange(100, 164)[None]
    cache = lm(ids, np.ones_like(ids), np.arange(64)[None], lm.empty_cache(1)).cache
    times = []
    for s in range(64, 96):
        t = time.perf_counter()
        cache = lm(np.array([[5]]), np.ones((1, s + 1), np.int64), np.array([[s]]), cache).cache
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1000


def main() -> None:
    if len(sys.argv) > 1:
        hf = Path(sys.argv[1])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import realmodels

        hf = realmodels.smollm2_hf()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {hf}")
    print("| variant | MB | KL vs fp32 (built-in text) | top-1 | KL on held-out text | perplexity fp32 -> int4 "
          "| first 3 greedy tokens equal fp32's | decode ms |")
    print("|---|---|---|---|---|---|---|---|")
    from llama_tools.source import resolve

    cfg = resolve(str(hf)).cfg
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        fp32 = Path(tmp) / "fp32" / "model.onnx"
        run("export", "onnx", str(hf), "-o", str(fp32), "--optimize", "--no-client-files")
        print(f"| fused fp32 (no int4) | {run_size(fp32) / 1e6:.1f} | | | | | | {decode_ms(fp32, cfg):.1f} |", flush=True)
        text.write_text(TEXT, encoding="utf-8")
        for name, opts in VARIANTS.items():
            out = Path(tmp) / name.replace(" ", "_").replace(",", "") / "model.onnx"
            exp = run("export", "onnx", str(hf), "-o", str(out), "--quantize", "int4", "--no-client-files", *opts)
            q = exp["int4_quality"]
            ver = run("verify", "int4", str(out), "--source", str(hf), "--text", str(text),
                      "--prompt", "The capital of France is", "--steps", "3")
            print(f"| {name} | {exp['bytes'] / 1e6:.1f} | {q['mean_kl']:.3f} | {q['top1']:.1%} | {ver['mean_kl']:.3f} "
                  f"| {ver['ppl_reference']:.2f} -> {ver['ppl_int4']:.2f} | {ver['free_run_same']}/3 "
                  f"| {decode_ms(out, cfg):.1f} |", flush=True)


if __name__ == "__main__":
    main()
