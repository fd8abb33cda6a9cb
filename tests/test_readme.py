"""The README's tour runs top to bottom in an empty directory and prints what the README shows (issue 19 item 1).

Steps, in README order, from the Tour section on: each `$ llama-tools ...` line of a plain ``` block (run by bash,
stdout and stderr together, as a terminal shows them; the lines after it up to the next `$` are what it prints),
and each ```python block (run as written; a ```text block right after it is what it prints). Compared: numbers,
token text and verdicts; masked: timings, sizes in MB, paths, float digits that differ between machines.

Refresh the README's outputs from a real run (after a change to what a command prints):

    python tests/test_readme.py --update
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SHOWN_DIR = "/tmp/tour"  # what the README shows for the directory the tour runs in
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Step:
    kind: str  # "sh" or "python"
    code: str
    expected: list[str]
    span: tuple[int, int]  # README lines [start, end) holding the expected output, for --update


def steps(text: str) -> list[Step]:
    """The tour's commands and snippets with what the README says they print."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Tour"))
    end = next((i for i, line in enumerate(lines) if i > start and line.startswith("## ") and
                not line.startswith("## Tour")), len(lines))
    out: list[Step] = []
    i = start
    while i < end:
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
        body = lines[i + 1:close]
        if m.group(1) == "python":
            expected, span = [], (close + 1, close + 1)
            k = close + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k < len(lines) and lines[k] == "```text":
                k_end = next(j for j in range(k + 1, len(lines)) if FENCE.match(lines[j]))
                expected, span = lines[k + 1:k_end], (k + 1, k_end)
                close = k_end
            out.append(Step("python", "\n".join(body), expected, span))
        elif m.group(1) == "" and body and body[0].startswith("$ "):
            cmd_at = [j for j, line in enumerate(body) if line.startswith("$ ")]
            for n, j in enumerate(cmd_at):
                stop = cmd_at[n + 1] if n + 1 < len(cmd_at) else len(body)
                out.append(Step("sh", body[j][2:], body[j + 1:stop], (i + 2 + j, i + 1 + stop)))
        i = close + 1
    return out


def env() -> dict[str, str]:
    """llama-tools from this interpreter's environment, whatever PATH says."""
    e = dict(os.environ)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.pop("COLUMNS", None)
    return e


def run(step: Step, cwd: Path) -> tuple[int, list[str]]:
    if step.kind == "sh":
        cmd = ["bash", "-o", "pipefail", "-c", step.code]
    else:
        cmd = [sys.executable, "-c", step.code]
    r = subprocess.run(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    text = r.stdout.replace(str(cwd.resolve()), SHOWN_DIR).replace(str(cwd), SHOWN_DIR)
    return r.returncode, [line.rstrip() for line in text.rstrip("\n").splitlines()]


MASKS = [
    (re.compile(r"\b\d[\d,]*(\.\d+)? ?(s|ms|MB|GB|tokens/s)\b"), "<measure>"),  # timings, sizes, speeds, RSS
    (re.compile(r"/tmp/\S+|/work/\S+"), "<path>"),
    (re.compile(r"\b\d+(\.\d+)?e[-+]\d+\b"), "<err>"),  # parity errors: depend on the machine's kernels
    (re.compile(r"\b\d+(\.\d+)?x\b"), "<ratio>"),  # error ratios and bounds: machine-dependent too
    (re.compile(r"\b(\d+\.\d{2})\d+\b"), r"\1"),  # long floats to 2 decimals (cosines, KL, perplexity)
    (re.compile(r"[ \t]+"), " "),  # column widths follow the values
]


def masked(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, repl in MASKS:
            line = pattern.sub(repl, line)
        out.append(line.strip())
    return [line for line in out if line]


def run_tour(update: bool = False) -> list[str]:
    """Run every step in a fresh empty directory; the differences (or, with update, rewrite the README)."""
    text = README.read_text(encoding="utf-8")
    found = steps(text)
    problems: list[str] = []
    new_lines = text.splitlines()
    replacements: list[tuple[tuple[int, int], list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="tour-") as tmp:
        cwd = Path(tmp)
        for step in found:
            code, got = run(step, cwd)
            refused = any(line.startswith("Error:") for line in step.expected)
            if (code != 0) != refused:
                problems.append(f"{step.code!r}: exit {code}\n" + "\n".join(got[-15:]))
            if update:
                replacements.append((step.span, step.kind, got))
            elif masked(got) != masked(step.expected):
                problems.append(f"{step.code!r} prints, masked:\n  " + "\n  ".join(masked(got)) +
                                "\nREADME shows, masked:\n  " + "\n  ".join(masked(step.expected)))
    if update:  # re-read: others may have edited the README while the tour ran; only output spans change
        text = README.read_text(encoding="utf-8")
        now = steps(text)
        if [s.code for s in now] != [s.code for s in found]:
            return ["the README's tour changed while it ran; run --update again"]
        new_lines = text.splitlines()
        replacements = [(s.span, s.kind, got) for s, (_, _, got) in zip(now, replacements)]
        for (a, b), kind, got in sorted(replacements, key=lambda r: r[0], reverse=True):
            if a == b and kind == "python":  # a python block with no ```text block yet: add one when it prints
                if got:
                    new_lines[a:a] = ["", "```text", *got, "```"]
            else:
                new_lines[a:b] = got
        README.write_text("\n".join(new_lines) + "\n", encoding="utf-8")
    return problems


def test_steps_are_found():
    """The extraction sees the tour's commands, the output under each, and the client snippets."""
    found = steps(README.read_text(encoding="utf-8"))
    cmds = [s.code for s in found if s.kind == "sh"]
    assert any(c.startswith("llama-tools convert tiny") for c in cmds)
    assert any(c.startswith("llama-tools verify int4") for c in cmds)
    assert any("onnxruntime_genai" in s.code for s in found if s.kind == "python")
    assert all(s.expected for s in found if s.kind == "sh"), "every command shows what it prints"


def test_masks_keep_numbers_and_verdicts():
    """Timings and paths are masked; a changed count or verdict is still a difference (the negative case)."""
    a = masked(["tiny-hf  hf  4  21  158,016  632,064", "PASS: checks ran in 0.5 s", "time  13.1 s: graph 12.0 s"])
    assert a == masked(["tiny-hf hf 4 21 158,016 632,064", "PASS: checks ran in 3.2 s", "time 9.9 s: graph 9.0 s"])
    assert a != masked(["tiny-hf hf 4 21 158,017 632,064", "PASS: checks ran in 0.5 s", "time 13.1 s: graph 12.0 s"])
    assert a != masked(["tiny-hf hf 4 21 158,016 632,064", "FAIL: checks ran in 0.5 s", "time 13.1 s: graph 12.0 s"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="the tour's commands are bash lines")
def test_tour_runs_as_written():
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("optimum.onnxruntime")
    problems = run_tour()
    assert not problems, "\n\n".join(problems) + "\n\n(refresh the README with: python tests/test_readme.py --update)"


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        left = run_tour(update=True)
        print(f"rewrote the tour's outputs in {README}" + ("; exit codes that disagree:\n" + "\n".join(left)
                                                           if left else ""))
        sys.exit(1 if left else 0)
    print(__doc__)
    sys.exit(2)
