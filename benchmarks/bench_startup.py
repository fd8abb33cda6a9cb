"""CPU time of refusals that need no weights, against a bare `python -c "import click"`, each in a fresh process.

    python benchmarks/bench_startup.py [--repeat 5]

Goal: a refusal costs at most ~4x `import click` (the package's own imports, which resolving MODEL needs). The
least of --repeat runs is the figure, so that a machine busy elsewhere does not decide it.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys

REFUSALS = [
    ["presets", "--bogus-option"],
    ["count-params", "tinny"],
    ["report", "shapes", "tiny", "--seq-len", "300"],
    ["generate", "tiny", "--ids", "1 999"],
    ["export", "onnx", "tiny", "-o", "x.onnx", "--static-kv", "0"],
    ["verify", "parity", "tiny", "--steps", "300"],
]


def cpu_seconds(cmd: list[str]) -> float:
    """User + system CPU seconds of one fresh process running `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"least of {args.repeat} runs")
    click_s = min(cpu_seconds([sys.executable, "-c", "import click"]) for _ in range(args.repeat))
    cli = [sys.executable, "-m", "llama_tools.cli"]
    print(f"{'command':<52} {'CPU ms':>8} {'x click':>8}")
    yardstick = 'python -c "import click"'
    print(f"{yardstick:<52} {click_s * 1000:>8.0f} {1.0:>8.2f}")
    for argv in REFUSALS:
        s = min(cpu_seconds(cli + argv) for _ in range(args.repeat))
        print(f"{' '.join(argv):<52} {s * 1000:>8.0f} {s / click_s:>8.2f}")


if __name__ == "__main__":
    main()
