"""How fast `llama-tools count-params` answers from a preset and from a config.json.

    python benchmarks/bench_count_params.py [--repeat 15]

Each run is a fresh process, as a user's shell would start it. Prints the median wall time of
`llama-tools count-params llama-2-7b` and of the same with a config.json, against the floor
`python -c "import click"`, as ratios (goal: at most 4x, which means neither torch nor pandas
loads on that path), and each one's peak RSS.

Then the bounded-work table (issue 11): `count_params` in-process at 10^2..10^6 decoders (goal: 10^6
under 1 s, and flat in n8), and fresh processes of `count-params` on a 10^6-decoder config.json and
`report shapes` on 10^5 decoders (refused in one line), with --layers first, and at reports.shapes.MAX_ROWS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_tools.counting.accounting import count_params
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.modeling.presets import get_preset
from llama_tools.reports.shapes import MAX_ROWS, row_count

sys.path.insert(0, str(Path(__file__).parent))
from bench_headers import child_run  # noqa: E402


def median_run(cmd: list[str], repeat: int) -> tuple[float, float]:
    """Median wall seconds and max peak RSS (MB) of `repeat` fresh processes, after one warm-up."""
    child_run(cmd)
    runs = [child_run(cmd) for _ in range(repeat)]
    bad = [r for r in runs if r[2] != 0]
    if bad:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {bad[0][2]}): {bad[0][3].strip()[-300:]}")
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    exe = shutil.which("llama-tools")
    cli = [exe] if exe else [sys.executable, "-m", "llama_tools.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(config_to_hf(get_preset("llama-2-7b"))))
        cases = [
            ('python -c "import click"', [sys.executable, "-c", "import click"]),
            ("count-params llama-2-7b", cli + ["count-params", "llama-2-7b"]),
            ("count-params config.json", cli + ["count-params", str(cfg_path)]),
            ("count-params (paper's four, json)", cli + ["count-params", "--format", "json"]),
        ]
        results = [(name, *median_run(cmd, args.repeat)) for name, cmd in cases]
    floor = results[0][1]
    print(f"{'command':<38} {'median s':>9} {'x floor':>8} {'peak MB':>8}")
    for name, wall, rss in results:
        print(f"{name:<38} {wall:>9.3f} {wall / floor:>8.2f} {rss:>8.1f}")
    worst = max(wall for _, wall, _ in results[1:]) / floor
    print(f"goal: at most 4x the floor; worst {worst:.2f}x -> {'OK' if worst <= 4 else 'MISSED'}")
    bounded(cli, max(3, args.repeat // 3))


def bounded(cli: list[str], repeat: int) -> None:
    """Time and memory against the layer count: in-process counting, then whole commands."""
    print(f"\nbounded work on {platform.node()} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()})")
    base = get_preset("llama-2-70b")
    print(f"{'count_params(llama-2-70b), n8':<44} {'median s':>9} {'x n8=100':>9}")
    first = None
    for n8 in (10**2, 10**4, 10**6):
        cfg = base.replace(num_hidden_layers=n8)
        runs = []
        for _ in range(repeat):
            t = time.perf_counter()
            count_params(cfg)
            runs.append(time.perf_counter() - t)
        med = statistics.median(runs)
        first = first or med
        print(f"{n8:<44,} {med:>9.4f} {med / first:>9.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        def config(n8: int, name: str) -> str:
            path = Path(tmp) / name
            path.write_text(json.dumps(config_to_hf(get_preset("llama-7b").replace(num_hidden_layers=n8))))
            return str(path)

        at_limit = (MAX_ROWS - 10) // 34  # llama-7b: 34 rows per decoder, 10 outside the stack
        assert row_count(get_preset("llama-7b").replace(num_hidden_layers=at_limit), 128) <= MAX_ROWS
        cases = [
            ("count-params 10^6 decoders --per-layer", cli + ["count-params", config(10**6, "m.json"),
                                                             "--per-layer"], 0),
            ("count-params 10^6 decoders --format json", cli + ["count-params", config(10**6, "m.json"), "--format",
                                                              "json"], 0),
            ("report shapes 10^5 decoders (refused)", cli + ["report", "shapes", config(10**5, "k.json")], 1),
            ("report shapes 10^5 decoders --layers first", cli + ["report", "shapes", config(10**5, "k.json"),
                                                                  "--layers", "first"], 0),
            (f"report shapes {at_limit:,} decoders (csv)", cli + ["report", "shapes", config(at_limit, "l.json")], 0),
            (f"report shapes {at_limit:,} decoders (json)", cli + ["report", "shapes", config(at_limit, "l.json"),
                                                                   "--format", "json"], 0),
        ]
        print(f"{'command':<44} {'median s':>9} {'peak MB':>9} {'exit':>5}")
        for name, cmd, want in cases:
            runs = [child_run(cmd) for _ in range(max(1, repeat // 2))]
            if any(r[2] != want for r in runs):
                raise SystemExit(f"{name}: exit {runs[0][2]}, expected {want}: {runs[0][3].strip()[-300:]}")
            print(f"{name:<44} {statistics.median(r[0] for r in runs):>9.3f} {max(r[1] for r in runs):>9.1f} "
                  f"{want:>5}")
    t = time.perf_counter()
    count_params(base.replace(num_hidden_layers=10**6))
    took = time.perf_counter() - t
    print(f"goal: 10^6 decoders counted in under 1 s: {took:.4f} s -> {'OK' if took < 1 else 'MISSED'}")


if __name__ == "__main__":
    main()
