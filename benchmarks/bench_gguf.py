"""GGUF speed and memory: counting from headers against the gguf library's own open, and export's peak RSS
from a GGUF against the same model's HF safetensors.

    python benchmarks/bench_gguf.py [--repeat 3] [--skip-export] [--verify]

The real files are the test suite's (tests/realmodels.py, cached in ~/.cache/llama-tools-tests):
SmolLM2-135M-Instruct.Q4_1.gguf and qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf, and their HF forms (fp32
safetensors, made by transformers' GGUF loader).

1. count-params from headers: `count_source(FILE)` in process, a fresh parse each time, against
   `gguf.GGUFReader(FILE)`, both best of --repeat; goal: ours <= 0.5x the library's open. Then the whole
   commands as fresh processes (median wall, peak RSS): `llama-tools count-params FILE` and
   `python -c "import gguf; gguf.GGUFReader(FILE)"`.
2. `llama-tools export onnx SRC -o OUT --no-client-files` as a fresh process from the GGUF and from its HF
   safetensors, peak RSS as the command reports it (the process's high-water mark, imports included);
   goal: from the GGUF, at most max(1 GB, 0.5x the fp32 weights), as bench_export_memory.py asks of the
   safetensors path, and near the safetensors path's own peak.
3. --verify: `verify parity OUT --source SRC --checks layers --steps 2` on that export, from the GGUF and from the
   HF checkpoint (peak RSS of the fresh process, RUSAGE_CHILDREN). Then the weight reads alone, in process, as
   verify parity makes them (each decoder layer's weights read three times in a row: in the graph's dtype,
   reassociated, in float64): CPU seconds from the HF safetensors, from the GGUF with GgufReader's layer cache
   (each tensor dequantized once) and without it (cache=False: dequantized at every read), best of --repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_headers import child_run  # noqa: E402

CLI = [sys.executable, "-m", "llama_tools.cli"]


def best(fn, repeat: int) -> float:
    """Best wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def count_rows(name: str, path: Path, repeat: int) -> float:
    """In-process and fresh-process counting against the library's open; returns the in-process ratio."""
    import gguf

    from llama_tools.checkpoints.gguf import read as gguf_read
    from llama_tools.counting.accounting import count_source

    def ours() -> None:
        gguf_read._open.cache_clear()  # a fresh parse, as a new process makes
        assert count_source(str(path)).checkpoint.ok

    t_ours, t_lib = best(ours, repeat), best(lambda: gguf.GGUFReader(path), repeat)
    procs = {}
    for label, cmd in (("count-params", CLI + ["count-params", str(path)]),
                       ("GGUFReader", [sys.executable, "-c", "import sys, gguf; gguf.GGUFReader(sys.argv[1])",
                                       str(path)])):
        runs = [child_run(cmd) for _ in range(repeat)]
        if any(r[2] for r in runs):
            raise SystemExit(f"{' '.join(cmd)} failed: {runs[0][3][-500:]}")
        procs[label] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
    (w_ours, m_ours), (w_lib, m_lib) = procs["count-params"], procs["GGUFReader"]
    print(f"| {name} | {path.stat().st_size / 1e6:,.0f} MB | {t_ours:.3f} s | {t_lib:.3f} s | {t_ours / t_lib:.3f}x "
          f"| {w_ours:.2f} s, {m_ours:.0f} MB | {w_lib:.2f} s, {m_lib:.0f} MB | {w_ours / w_lib:.2f}x |", flush=True)
    return t_ours / t_lib


def export(src: Path, out: Path) -> dict:
    """The real command in a fresh process; its JSON (peak_rss_bytes, wall_seconds, bytes)."""
    cmd = CLI + ["export", "onnx", str(src), "-o", str(out), "--format", "json", "-q", "--no-client-files"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout)


def export_rows(name: str, gguf_path: Path, hf: Path, tmp: Path, verify: bool) -> tuple[float, float, float]:
    """Peak RSS of export (and verify) from the GGUF and from the HF safetensors; (gguf peak, hf peak, weights)."""
    weights = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    goal = max(1e9, 0.5 * weights)
    peaks = {}
    for label, src in (("GGUF", gguf_path), ("HF safetensors", hf)):
        r = export(src, tmp / name / label.split()[0] / "model.onnx")
        peaks[label] = r["peak_rss_bytes"]
        print(f"| {name} | export onnx | {label} | {weights / 1e9:.2f} GB | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{r['peak_rss_bytes'] / weights:.2f}x | {r['wall_seconds']:.1f} s |", flush=True)
    g, h = peaks["GGUF"], peaks["HF safetensors"]
    print(f"| {name} | export onnx | GGUF / HF | | {g / h:.2f}x | | | goal <= {goal / 1e9:.2f} GB: "
          f"{'OK' if g <= goal else 'MISSED'} |", flush=True)
    if verify:
        graph = tmp / name / "HF" / "model.onnx"
        for label, src in (("GGUF", gguf_path), ("HF safetensors", hf)):
            cmd = CLI + ["verify", "parity", str(graph), "--source", str(src), "--checks", "layers", "--steps", "2",
                         "--provider", "cpu"]
            wall, rss_mib, rc, _ = child_run(cmd)
            rss = rss_mib * 2**20
            print(f"| {name} | verify parity | {label} | {weights / 1e9:.2f} GB | {rss / 1e9:.2f} GB | "
                  f"{rss / weights:.2f}x | {wall:.1f} s, exit {rc} |", flush=True)
    return g, h, weights


def verify_reads(name: str, gguf_path: Path, hf: Path, repeat: int) -> None:
    """CPU seconds of verify parity's weight reads (every layer three times in a row) per source."""
    from llama_tools.checkpoints.gguf.tensors import GgufReader
    from llama_tools.inference.reference import CheckpointReader

    def reads(reader) -> float:
        layers = {}
        for n in reader.where:
            if n.startswith("model.layers."):
                layers.setdefault(int(n.split(".")[2]), []).append(n)
        t = time.process_time()
        for names in layers.values():
            for _ in range(3):
                reader.read(names)
        return time.process_time() - t

    got = {label: min(reads(make()) for _ in range(repeat)) for label, make in (
        ("HF safetensors", lambda: CheckpointReader(hf)), ("GGUF, dequantized at every read",
                                                            lambda: GgufReader(gguf_path, cache=False)),
        ("GGUF, layer cache", lambda: GgufReader(gguf_path)))}
    h = got["HF safetensors"]
    print(f"| {name} | " + " | ".join(f"{v:.2f} s ({v / h:.1f}x)" for v in got.values()) + " |",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-export", action="store_true")
    ap.add_argument("--verify", action="store_true", help="also verify parity's peak RSS from each source")
    args = ap.parse_args()
    from importlib.metadata import version

    sys.path.insert(0, str(ROOT / "tests"))
    from realmodels import qwen2_gguf, qwen2_hf, smollm2_gguf, smollm2_hf

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} CPUs, "
          f"{mem:.0f} GiB, {platform.platform()}, Python {platform.python_version()}, gguf {version('gguf')}")
    models = [("SmolLM2-135M Q4_1", smollm2_gguf(), smollm2_hf), ("Qwen2.5-Coder-0.5B Q4_K_M", qwen2_gguf(), qwen2_hf)]
    print(f"\ncount-params from headers vs gguf.GGUFReader's open (in process: best of {args.repeat}; "
          f"fresh processes: median wall, peak RSS)")
    print("| file | size | count_source | GGUFReader() | ratio | count-params process | GGUFReader process "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = [count_rows(name, path, args.repeat) for name, path, _ in models]
    print(f"goal: counting <= 0.5x the library's open; worst {max(ratios):.3f}x -> "
          f"{'OK' if max(ratios) <= 0.5 else 'MISSED'}")
    if args.skip_export:
        return
    print("\npeak RSS (fresh process, imports included) of the same command from the GGUF and from its HF "
          "safetensors (fp32)")
    print("| model | command | source | fp32 weights | peak RSS | / weights | wall |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as t:
        for name, path, hf in models:
            export_rows(name, path, hf(), Path(t), args.verify)
    if args.verify:
        print("\nverify parity's weight reads (each layer's weights three times in a row), CPU seconds, best of "
              f"{args.repeat}")
        print("| model | HF safetensors | GGUF, dequantized at every read | GGUF, layer cache |")
        print("|---|---|---|---|")
        for name, path, hf in models:
            verify_reads(name, path, hf(), args.repeat)


if __name__ == "__main__":
    main()
