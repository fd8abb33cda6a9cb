"""int4 variants of a real trained model: size, quality on real text, and whether it still says "Paris".

Each variant is `llama-tools export onnx HF_DIR --quantize int4 [options]` (the fused graph, then onnxruntime's
MatMulNBits quantizer), scored by the export's own quality line (KL and top-1 against the full-precision model on
its built-in text) and by `verify int4 --text` on a second, held-out paragraph (perplexity vs PyTorch fp32).

    python benchmarks/bench_int4.py [HF_DIR] [--builder]   # default: the tests' SmolLM2-135M-Instruct
                                                            # (tests/realmodels.py); --builder adds its int4 row,
                                                            # --builder-only runs that row alone
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


def builder_row(hf: Path, tmp: Path, cfg, text: str) -> str:
    """onnxruntime-genai's builder, `-p int4 -e cpu` (its defaults), scored as the rows above: against the same
    streamed PyTorch fp32 model, read through the builder's own input and output names (exporters/foreign.py)."""
    import importlib.util

    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from llama_tools.exporters.foreign import describe_graph, foreign_lm
    from llama_tools.exporters.prompts import positions
    from llama_tools.exporters.quantize import QUALITY_TEXT, _kl_row, kl_and_ppl
    from llama_tools.exporters.runtime import create_session
    from llama_tools.reference import reference_model
    from llama_tools.source import resolve

    spec = importlib.util.spec_from_file_location("bench_faults", Path(__file__).with_name("bench_faults.py"))
    bf = importlib.util.module_from_spec(spec)
    sys.modules["bench_faults"] = bf
    spec.loader.exec_module(bf)
    out = tmp / "builder-int4"
    bf.builder(hf, out, tmp / "builder-in", precision="int4")
    path = out / "model.onnx"
    size = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("model.onnx"))
    lm = foreign_lm(create_session(path, "cpu"), describe_graph(path), cfg)
    ref = reference_model(resolve(str(hf)))
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))

    def both(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        arr = np.array([ids], np.int64)
        mask = np.ones_like(arr)
        got = np.asarray(lm(arr, mask, positions(mask, arr.shape[1]), lm.empty_cache(1)).logits, np.float64)[0]
        with torch.no_grad():
            want = ref(torch.from_numpy(arr)).logits.double().numpy()[0]
        return want, got

    want, got = both(tok.encode(QUALITY_TEXT).ids)
    kl_builtin = float(np.mean([_kl_row(p, q) for p, q in zip(want, got)]))
    top1 = float((want.argmax(-1) == got.argmax(-1)).mean())
    ids = tok.encode(text).ids
    want, got = both(ids)
    kl, ppl_ref, ppl_got = kl_and_ppl(want, got, np.array(ids))
    prompt = tok.encode("The capital of France is").ids
    same, a, b = 0, list(prompt), list(prompt)
    for _ in range(3):  # greedy, both sides re-run on their own text
        wa, _ = both(a)
        _, gb = both(b)
        a.append(int(wa[-1].argmax()))
        b.append(int(gb[-1].argmax()))
        same += a == b
    cache = lm(np.arange(100, 164)[None], np.ones((1, 64), np.int64), np.arange(64)[None], lm.empty_cache(1)).cache
    import time

    times = []
    for s in range(64, 96):
        t = time.perf_counter()
        cache = lm(np.array([[5]]), np.ones((1, s + 1), np.int64), np.array([[s]]), cache).cache
        times.append(time.perf_counter() - t)
    return (f"| onnxruntime-genai builder int4 (its defaults) | {size / 1e6:.1f} | {kl_builtin:.3f} | {top1:.1%} "
            f"| {float(kl.mean()):.3f} | {ppl_ref:.2f} -> {ppl_got:.2f} | {same}/3 | {float(np.median(times)) * 1000:.1f} |")


def main() -> None:
    with_builder = "--builder" in sys.argv[1:] or "--builder-only" in sys.argv[1:]
    only_builder = "--builder-only" in sys.argv[1:]
    argv = [a for a in sys.argv[1:] if not a.startswith("--builder")]
    if argv:
        hf = Path(argv[0])
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
        if not only_builder:
            run("export", "onnx", str(hf), "-o", str(fp32), "--optimize", "--no-client-files")
            print(f"| fused fp32 (no int4) | {run_size(fp32) / 1e6:.1f} | | | | | | {decode_ms(fp32, cfg):.1f} |",
                  flush=True)
        text.write_text(TEXT, encoding="utf-8")
        if with_builder:
            print(builder_row(hf, Path(tmp), cfg, TEXT), flush=True)
        for name, opts in ({} if only_builder else VARIANTS).items():
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
