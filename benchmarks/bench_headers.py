"""Count LLaMA-2-70B from its headers: a sharded safetensors checkpoint with real headers and data holes.

    python benchmarks/bench_headers.py [--shards 15] [--repeat 20]

Writes 15 sparse files (~138 GB apparent, a few hundred kB on disk) in a temp dir, times
`inspect_checkpoint` in process (goal < 0.5 s) and `llama-tools count-params DIR` as a fresh process
(wall time and peak RSS, goal < 100 MB), then deletes everything.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.inspection import inspect_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import write_sparse_safetensors  # noqa: E402  (a test fixture, shared with the tests)


def child_run(cmd: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS in MB and exit code of a fresh process (RUSAGE_CHILDREN of a lone child)."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "w = time.perf_counter() - t; "
             "print(w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, r.returncode); "
             "sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])")
    p = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    wall, rss, rc = p.stdout.split()
    return float(wall), float(rss), int(rc), p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    cfg = get_preset("llama-2-70b")
    tmp = Path(tempfile.mkdtemp(prefix="bench_headers_"))
    try:
        start = time.perf_counter()
        files = write_sparse_safetensors(cfg, tmp, shards=args.shards)
        build_s = time.perf_counter() - start
        apparent = sum(f.stat().st_size for f in files)
        on_disk = sum(f.stat().st_blocks * 512 for f in tmp.iterdir())
        print(f"checkpoint: {cfg.name}, {len(files)} shards, apparent {apparent / 1e9:.1f} GB, "
              f"on disk {on_disk / 1e6:.2f} MB, built in {build_s:.3f} s")

        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            insp = inspect_checkpoint(tmp)
            times.append(time.perf_counter() - t)
        tracemalloc.start()  # a separate run: tracing slows Python down several times
        inspect_checkpoint(tmp)
        _, py_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"inspect_checkpoint: {insp.total_params:,} params in {len(insp.tensors)} tensors, ok={insp.ok}; "
              f"median {statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms "
              f"over {args.repeat} runs; Python allocations peak {py_peak / 1e6:.1f} MB")
        assert insp.total_params == 68_976_648_192, insp.total_params

        exe = shutil.which("llama-tools") or str(Path(sys.executable).parent / "llama-tools")
        wall, rss, rc, tail = child_run([exe, "count-params", str(tmp), "--format", "json"])
        what = "`llama-tools count-params DIR`"
        if rc != 0:
            print(f"{what} failed (rc {rc}): {tail.strip().splitlines()[-1:]}; timing inspect_checkpoint instead")
            what = "`python -c inspect_checkpoint(DIR)`"
            wall, rss, rc, tail = child_run([sys.executable, "-c", "import sys; from llama_tools.checkpoints.inspection import "
                                             "inspect_checkpoint; inspect_checkpoint(sys.argv[1])", str(tmp)])
        print(f"{what} (fresh process, imports included): wall {wall:.3f} s, peak RSS {rss:.1f} MB, rc {rc}")
        wall_py, rss_py, _, _ = child_run([sys.executable, "-c", "pass"])
        print(f"bare `python -c pass` for scale: wall {wall_py:.3f} s, peak RSS {rss_py:.1f} MB")
        print(f"goals: in-process < 0.5 s: {'met' if statistics.median(times) < 0.5 else 'MISSED'} "
              f"({0.5 / statistics.median(times):.0f}x margin); peak < 100 MB: {'met' if rss < 100 else 'MISSED'}")
    finally:
        shutil.rmtree(tmp)
        print(f"cleaned up {tmp}: {'gone' if not tmp.exists() else 'STILL THERE'}")


if __name__ == "__main__":
    main()
