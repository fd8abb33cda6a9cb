"""llama.cpp's logits of a GGUF, computed in a child process: a crash there is a line of the verdict, not its end.

llama.cpp is native code built for the machine it was compiled on: a build that uses an instruction this CPU does
not run dies with SIGILL in llama_decode (seen where a VM lists AVX-512 and AMX it does not execute), and one that
reads a hostile file out of bounds dies with SIGSEGV. In the verifier's own process either would end the run with
no verdict; here the parent reads the exit status and says "not checked" and why.

    parent: rows.json ──► python -m ...llamacpp_child GGUF DIR THREADS ──► DIR/row-N.npy (fp32 [n3, n1]) ──► parent
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

CACHE_TYPE = 0  # the KV cache's type: GGML_TYPE_F32 (llama_cpp.GGML_TYPE_F32)
# The child's bound in time: llama.cpp's CPU prefill of the verifier's rows takes seconds; a hang is not a verdict.
CHILD_SECONDS = 1800


def llamacpp_logits(path: Path, rows: list[list[int]], threads: int, scratch: Path) -> list[Path] | str:
    """llama.cpp's fp32 logits of each row (row-N.npy under scratch), or why there are none, in words."""
    (scratch / "rows.json").write_text(json.dumps(rows))
    try:
        done = subprocess.run([sys.executable, "-m", __spec__.name if __spec__ else "llamacpp_child", str(path),
                               str(scratch), str(threads)], capture_output=True, text=True, timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        return f"llama.cpp ran past {CHILD_SECONDS} s on {path}"
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        why = {"SIGILL": " (an instruction this CPU does not run: rebuild llama-cpp-python with "
                         "CMAKE_ARGS=-DGGML_NATIVE=OFF)"}.get(name, "")
        return f"llama.cpp died with {name} running {path}{why}"
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        return lines[-1][:300] if lines else f"llama.cpp exited with status {done.returncode} on {path}"
    return [scratch / f"row-{i}.npy" for i in range(len(rows))]


def main(argv: list[str]) -> int:
    """The child: load the GGUF, run each row whole, save its logits; a refusal is one line on stderr, status 2."""
    path, scratch, threads = Path(argv[0]), Path(argv[1]), int(argv[2])
    rows = json.loads((scratch / "rows.json").read_text())
    import llama_cpp

    try:
        # K and V cached in F32, no flash attention (on CPU it rounds the scores through F16): the check measures
        # the file's reading, not llama.cpp's default F16 cache (Qwen3-MoE tiny: 9.2e-4 relative RMS with it,
        # 6e-7 without)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(len(r) for r in rows) + 1, logits_all=True,
                              verbose=False, n_threads=threads, type_k=CACHE_TYPE, type_v=CACHE_TYPE,
                              flash_attn=False)
    except (ValueError, RuntimeError) as e:  # llama.cpp refusing the file: said, not judged (no vocabulary, ...)
        print(f"llama.cpp cannot load {path}: {(str(e).splitlines() or [''])[0][:200]}", file=sys.stderr)
        return 2
    for i, row in enumerate(rows):
        llm.reset()
        llm.eval(row)
        np.save(scratch / f"row-{i}.npy", np.asarray(llm.scores[:len(row)], dtype=np.float32))  # [n3, n1]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
