"""The default int4 export's time against onnxruntime-genai's builder int4, paired, and how it grows with depth.

    python benchmarks/bench_int4_time.py [--depths 8,16] [--no-real] [--rounds 3]

Rows: SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct (real models, tests' cache) and seeded checkpoints of
SmolLM2's width (576, 9 heads, vocabulary 49,152, its tokenizer) at two depths. Each export is a fresh process, one right after the other:
`llama-tools export onnx DIR -o OUT --quantize int4` (the default: awq blocks, KL target) and the builder's
`-p int4 -e cpu`. The table gives wall seconds, the int4 step and its stages (importance, awq's scales, the
sensitivity pass, the candidate graphs built and measured), the ratio to the builder (goal 3x), both processes' CPU
seconds, our export's peak RSS, and from the two depths
the cost of one more decoder layer in the passes over the layers; the projection to LLaMA-2-7B and 70B scales that
per-layer cost by the layers' weights (the work is linear in the weights at a fixed calibration length).
--rounds N runs each pair N times, one after the other, and gives the round with the median ratio (both processes'
times move with the machine's load; a ratio within a round is paired), with the rounds' range of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_faults import builder  # noqa: E402  (the builder run as the tests run it)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def real_model(name: str) -> Path:
    """A real model in HF form, by its tests/realmodels.py function (converted once from the registry's GGUF)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import realmodels

    return getattr(realmodels, name)()


REAL = (("SmolLM2-135M-Instruct", "smollm2_hf"), ("Qwen2.5-Coder-0.5B-Instruct", "qwen2_hf"))


def seeded(real: Path, layers: int, out: Path) -> Path:
    """A seeded checkpoint of the real model's config at `layers` decoder layers, with the real tokenizer."""
    import torch

    from llama_tools.checkpoints.config_files import load_config
    from llama_tools.checkpoints.convert import save_checkpoint
    from llama_tools.modeling.model import build_model

    cfg = load_config(real / "config.json").replace(num_hidden_layers=layers, name=f"seeded-{layers}")
    model = build_model(cfg, seed=0)
    save_checkpoint(cfg, {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}, out, to="hf")
    for name in TOKENIZER_FILES:
        if (real / name).exists():
            shutil.copy(real / name, out / name)
    return out


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ours(ckpt: Path, out: Path) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds) of the default int4 export as a fresh process, and its JSON report."""
    t, c = time.perf_counter(), children_cpu()
    r = subprocess.run([sys.executable, "-m", "llama_tools.cli", "export", "onnx", str(ckpt), "-o", str(out),
                        "--quantize", "int4", "--format", "json"], capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, children_cpu() - c
    if r.returncode != 0:
        raise SystemExit(f"export of {ckpt} failed: {r.stderr.strip().splitlines()[-1:]}")
    return wall, cpu, json.loads(r.stdout)


def theirs(ckpt: Path, work: Path) -> tuple[float, float]:
    t, c = time.perf_counter(), children_cpu()
    builder(ckpt, work / "out", work / "in", precision="int4")
    return time.perf_counter() - t, children_cpu() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="8,16", help="two decoder-layer counts for the seeded checkpoints")
    ap.add_argument("--no-real", action="store_true", help="leave out the real models' rows")
    ap.add_argument("--rounds", type=int, default=1, help="pairs per checkpoint; the median round is shown [1]")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    depths = [int(d) for d in args.depths.split(",")]
    if len(depths) != 2 or not 0 < depths[0] < depths[1]:
        raise SystemExit("--depths: two layer counts, the smaller first, e.g. 8,16")
    real = real_model("smollm2_hf")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; Python "
          f"{platform.python_version()}; each export a fresh process, ours then the builder's")
    print("| checkpoint | layers | ours s | int4 step s | importance | scales | sensitivity | graphs (built) | "
          "builder s | x builder (rounds' range) | CPU s ours / builder (x) | mean KL held-out | our peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    tmp = Path(tempfile.mkdtemp(prefix="bench_int4_time_"))
    rows = {}
    try:
        cases = [] if args.no_real else [(name, real_model(fn)) for name, fn in REAL]
        cases += [("seeded, SmolLM2 width", seeded(real, d, tmp / f"seeded-{d}")) for d in depths]
        for i, (name, ckpt) in enumerate(cases):
            runs = []
            for _ in range(args.rounds):
                wall, cpu, rep = ours(ckpt, tmp / f"ours-{i}" / "model.onnx")
                b, b_cpu = theirs(ckpt, tmp / f"builder-{i}")
                runs.append((wall / b, wall, cpu, rep, b, b_cpu))
                shutil.rmtree(tmp / f"ours-{i}", ignore_errors=True)
                shutil.rmtree(tmp / f"builder-{i}", ignore_errors=True)
            ratios = sorted(r[0] for r in runs)
            _, wall, cpu, rep, b, b_cpu = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]  # the median round
            spread = f" ({ratios[0]:.1f}-{ratios[-1]:.1f}x)" if len(runs) > 1 else ""
            layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
            st, built = rep["int4_target"]["stage_seconds"], len(rep["int4_target"]["rounds"])
            rows[(name, layers)] = (wall, st)
            print(f"| {name} | {layers} | {wall:.1f} | {rep['phases']['int4']:.1f} | {st.get('importance', 0):.1f} | "
                  f"{st.get('scales', 0):.1f} | {st['sensitivity']:.1f} | {st['graphs']:.1f} ({built}) | {b:.1f} | "
                  f"{wall / b:.1f}x{spread} | {cpu:.1f} / {b_cpu:.1f} ({cpu / b_cpu:.1f}x) | "
                  f"{rep['int4_quality']['mean_kl']:.3f} | {rep['peak_rss_bytes'] / 1e9:.2f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (_, st1), (_, st2) = (rows[("seeded, SmolLM2 width", d)] for d in depths)
    # the passes over the layers (importance, scales, sensitivity); the graphs' count depends on the target's rounds
    s1, s2 = (sum(v for k, v in st.items() if k != "graphs") for st in (st1, st2))
    per_layer = (s2 - s1) / (depths[1] - depths[0])
    fixed = s1 - per_layer * depths[0]
    print(f"\npasses over the layers (importance, scales, sensitivity): {per_layer:.2f} s a decoder layer of SmolLM2's "
          f"width (3.5M weights), {fixed:.1f} s besides (head, embedding); {s2 / s1:.2f}x the time for "
          f"{depths[1] / depths[0]:.0f}x the layers; sensitivity alone {st2['sensitivity'] / st1['sensitivity']:.2f}x")
    from llama_tools.modeling.presets import get_preset
    from llama_tools.counting.accounting import count_params

    width = 3 * 576 * 1536 + 576 * (576 + 2 * 192 + 576)  # one SmolLM2 decoder layer's matrices
    for preset in ("llama-2-7b", "llama-2-70b"):
        cfg = get_preset(preset)
        c = count_params(cfg)
        layer_weights = (c.total - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)) \
            / cfg.num_hidden_layers
        t = fixed + per_layer * cfg.num_hidden_layers * layer_weights / width
        print(f"projected passes over the layers, {preset}: {t / 3600:.1f} h ({cfg.num_hidden_layers} layers of "
              f"{layer_weights / 1e6:.0f}M weights, linear in them; each graph built adds a pass over the weights)")


if __name__ == "__main__":
    main()
