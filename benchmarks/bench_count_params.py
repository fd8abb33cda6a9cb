"""How fast `llama-tools count-params` answers from a preset and from a config.json.

    python benchmarks/bench_count_params.py [--repeat 15]

Each run is a fresh process, as a user's shell would start it. Prints the median wall time of
`llama-tools count-params llama-2-7b` and of the same with a config.json, against the floor
`python -c "import click"`, as ratios (goal: at most 4x, which means neither torch nor pandas
loads on that path), and each one's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_tools.config_files import config_to_hf
from llama_tools.presets import get_preset

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


if __name__ == "__main__":
    main()
