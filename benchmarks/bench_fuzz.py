"""The format fuzzers, run long: every mutated file read or refused in one line, examples per second per format.

templates: generated chat templates and tokenizer.json regexes, each rendered/encoded or refused within its bounds.

    python benchmarks/bench_fuzz.py [--examples 3000] [--only gguf,headers,configs,tokenizers,templates]

Each format's fuzz file (tests/test_fuzz_*.py: its hypothesis properties and exhaustive mutations) runs in a fresh pytest process with LLAMA_TOOLS_FUZZ_EXAMPLES
set (the suite runs them with a small default); the table shows the tests, the examples each drew at most, the
wall time, the peak memory of the process (VmHWM, /usr/bin/time), and whether every property held.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZERS = {"gguf": "tests/test_fuzz_gguf.py", "headers": "tests/test_fuzz_headers.py",
           "configs": "tests/test_fuzz_configs.py", "tokenizers": "tests/test_fuzz_tokenizers.py",
           "templates": "tests/test_fuzz_templates.py"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=3000, help="hypothesis examples per property")
    ap.add_argument("--only", default=",".join(FUZZERS))
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}; "
          f"{args.examples} examples per property")
    print(f"{'format':<11} {'tests':>6} {'result':<28} {'wall s':>8} {'peak MB':>8}")
    env = {**os.environ, "LLAMA_TOOLS_FUZZ_EXAMPLES": str(args.examples)}
    failed = False
    for name in args.only.split(","):
        cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "pytest", FUZZERS[name], "-q", "-p", "no:cacheprovider"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        peak = int(r.stderr.strip().splitlines()[-1]) / 1024
        summary = next((ln for ln in reversed(r.stdout.splitlines()) if " passed" in ln or " failed" in ln), "?")
        tests = sum(int(w) for w, k in zip(summary.split(), summary.split()[1:]) if w.isdigit() and
                    k.rstrip(",") in ("passed", "failed"))
        ok = r.returncode == 0
        failed |= not ok
        print(f"{name:<11} {tests:>6} {'every property held' if ok else 'FAILED: ' + summary[:20]:<28} {wall:>8.1f} "
              f"{peak:>8.0f}", flush=True)
        if not ok:
            print(r.stdout[-3000:])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
