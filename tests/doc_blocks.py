"""The code blocks of README.md and docs/*.md, read and run as written (tests/test_readme.py, tests/test_docs.py).

A page's blocks run top to bottom in one empty directory, so a later block may use what an earlier one wrote:
- a shell block (``` or ```console/```sh/```shell/```bash) is a transcript: each `$ command` line runs in bash
  (stdout and stderr together, as a terminal shows them) and the lines after it, up to the next `$`, are what it
  prints;
- a ```python block runs as written; a ```text block right after it is what it prints (none: it prints nothing).
A block that cannot run here (a GPU, a download, minutes of benchmark) says why, either in its fence,
```sh {skip: needs a GPU}, or on the line before it, <!-- not run: needs a GPU -->; any other block is a mistake.
Shown output is compared after masking what timing, rounding and the machine change (MASKS, LINE_MASKS); a
command whose shown output has an `Error:` line, or ends in a FAIL verdict, must exit non-zero, any other zero.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHOWN_DIR = "/tmp/tour"  # what the pages show for the directory their blocks run in
FENCE = re.compile(r"^```(.*)$")
NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
SKIP_INFO = re.compile(r"\{\s*skip:(.*?)\}")
SHELL_LANGS = {"", "console", "sh", "shell", "bash"}
STEP_TIMEOUT_S = 600


def pages() -> list[Path]:
    """Every page whose blocks run: the README and each docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(page: Path) -> str:
    """PAGE as the messages name it: relative to the repository when it is in it."""
    try:
        return page.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return page.name


@dataclass
class Block:
    """One fenced block of a page."""

    page: str
    line: int  # 1-based line of its opening fence
    lang: str
    body: list[str]
    reason: str | None  # why it is not run (None: it runs)
    end: int  # 0-based line of its closing fence


@dataclass
class Step:
    """One thing a page runs: a shell command or a Python block, with what the page says it prints."""

    kind: str  # "sh" or "python"
    code: str
    expected: list[str]
    span: tuple[int, int]  # 0-based page lines [start, end) holding the expected output, for --update
    where: str  # page:line, for messages


@dataclass
class Page:
    """A page read: the steps it runs in order, the blocks it does not run, and blocks it cannot classify."""

    steps: list[Step]
    not_run: list[Block]
    problems: list[str]


def blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of TEXT, with the reason it is not run when the page gives one."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if close is None:
            raise ValueError(f"{page}:{i + 1}: a code block that never closes")
        info = m.group(1).strip()
        reason = None
        skip = SKIP_INFO.search(info)
        if skip:
            reason = skip.group(1).strip()
            info = SKIP_INFO.sub("", info).strip()
        prev = lines[i - 1].strip() if i else ""
        note = NOT_RUN.match(prev)
        if note:
            reason = note.group(1).strip()
        lang = info.split()[0] if info else ""
        out.append(Block(page, i + 1, lang, lines[i + 1:close], reason, close))
        i = close + 1
    return out


def read_page(text: str, page: str) -> Page:
    """The steps TEXT runs, in order, and its blocks that do not run."""
    found = blocks(text, page)
    steps: list[Step] = []
    not_run: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    consumed: set[int] = set()
    for n, b in enumerate(found):
        if n in consumed:
            continue
        where = f"{page}:{b.line}"
        if b.reason is not None:
            if len(b.reason) < 3:
                problems.append(f"{where}: a block marked not run must say why (<!-- not run: REASON -->)")
            not_run.append(b)
            if b.lang == "python" and n + 1 < len(found) and found[n + 1].lang == "text" \
                    and _adjacent(lines, b.end, found[n + 1].line - 1):
                consumed.add(n + 1)  # what the unrun block would print: shown, not compared
            continue
        if b.lang == "python":
            expected: list[str] = []
            span = (b.end + 1, b.end + 1)
            nxt = found[n + 1] if n + 1 < len(found) else None
            if nxt is not None and nxt.lang == "text" and nxt.reason is None and _adjacent(lines, b.end, nxt.line - 1):
                expected, span = nxt.body, (nxt.line, nxt.end)
                consumed.add(n + 1)
            steps.append(Step("python", "\n".join(b.body), expected, span, where))
        elif b.lang in SHELL_LANGS and b.body and b.body[0].startswith("$ "):
            at = [j for j, line in enumerate(b.body) if line.startswith("$ ")]
            for k, j in enumerate(at):
                stop = at[k + 1] if k + 1 < len(at) else len(b.body)
                steps.append(Step("sh", b.body[j][2:], b.body[j + 1:stop], (b.line + j + 1, b.line + stop),
                                  f"{page}:{b.line + j + 1}"))
        else:
            problems.append(f"{where}: a ```{b.lang} block that neither runs nor says why not: make it a transcript "
                            "(`$ command` lines, each followed by its output), a ```python block (then ```text), or "
                            "mark it <!-- not run: REASON -->")
    return Page(steps, not_run, problems)


def _adjacent(lines: list[str], end: int, start: int) -> bool:
    """Only blank lines between a block closing at END and one opening at START."""
    return all(not line.strip() for line in lines[end + 1:start])


def env() -> dict[str, str]:
    """llama-tools from this interpreter's environment, whatever PATH says; the terminal's width not inherited."""
    e = dict(os.environ)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.pop("COLUMNS", None)
    return e


def run(step: Step, cwd: Path) -> tuple[int, list[str]]:
    """Run one step in CWD: its exit status and what it printed (CWD shown as SHOWN_DIR)."""
    if step.kind == "sh":
        cmd = ["bash", "-o", "pipefail", "-c", step.code]
    else:
        cmd = [sys.executable, "-c", step.code]
    r = subprocess.run(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=STEP_TIMEOUT_S)
    text = r.stdout.replace(str(cwd.resolve()), SHOWN_DIR).replace(str(cwd), SHOWN_DIR)
    return r.returncode, [line.rstrip() for line in text.rstrip("\n").splitlines()]


def _steps_count(m: re.Match[str]) -> str:
    # "8/8 steps agree" is a verdict; "4/32" is how many argmax near-ties one machine's rounding broke
    return m.group(0) if m.group(1) == m.group(2) else f"<k>/{m.group(2)} steps"


MASKS = [
    (re.compile(r"\btransformers \d+\.\d+\.\d+\b"), "transformers <version>"),  # the installed one's
    (re.compile(r"\b\d[\d,]*(\.\d+)? ?(s|ms|MB|GB|MiB|GiB|tokens/s)\b"), "<measure>"),  # timings, sizes, speeds, RSS
    (re.compile(r"/tmp/\S+|/work/\S+"), "<path>"),
    (re.compile(r"\b\d+(\.\d+)?e[-+]\d+\b"), "<err>"),  # parity errors: depend on the machine's kernels
    (re.compile(r"\b\d+(\.\d+)?x\b"), "<ratio>"),  # error ratios and bounds: machine-dependent too
    (re.compile(r"(?<![\d.])(?!100\.0%)\d+\.\d+%"), "<pct>"),  # agreement rates: all (100.0%) is kept
    (re.compile(r"\b(\d+)/(\d+) steps\b"), _steps_count),
    (re.compile(r"\b(\d+\.\d{2})\d+\b"), r"\1"),  # long floats to 2 decimals (cosines, KL, perplexity)
    (re.compile(r"^\s*-{3,}(\s+-{3,})*\s*$"), "<rule>"),  # a table's rule: its widths follow the values
    (re.compile(r"[ \t]+"), " "),  # column widths follow the values
]
# int4 on tiny's random weights: every figure hangs on the CPU's int8 kernels (accuracy level 4), so on these lines
# only the words, the thresholds and the verdict are compared.
LINE_MASKS = [
    (re.compile(r"^\s*(int4 quality|top-1 agreement|own greedy|mean KL|max KL|perplexity fp32|max \|logit error\|)"),
     re.compile(r"[-+]?\d+\.\d+"), "<n>"),
]


def masked(lines: list[str]) -> list[str]:
    """LINES with what timing, rounding and the machine change replaced by placeholders; blank lines dropped."""
    out = []
    for line in lines:
        for select, number, repl in LINE_MASKS:
            if select.match(line):
                head, _, tail = line.partition("  ")  # the label keeps its own digits (top-1, int4, fp32)
                line = head + "  " + number.sub(repl, tail)
        for pattern, sub in MASKS:
            line = pattern.sub(sub, line)
        out.append(line.strip())
    return [line for line in out if line]


def should_fail(expected: list[str]) -> bool:
    """Whether the shown output is a refusal or a failed verdict (then the command must exit non-zero)."""
    shown = [line for line in expected if line.strip()]
    return any(line.startswith("Error:") for line in shown) or bool(shown and shown[-1].startswith("FAIL"))


def run_page(page: Path, update: bool = False) -> list[str]:
    """Run PAGE's steps in a fresh empty directory; the differences (or, with update, rewrite the page's outputs)."""
    name = rel(page)
    text = page.read_text(encoding="utf-8")
    read = read_page(text, name)
    problems = list(read.problems)
    got_all: list[list[str] | None] = []  # None: not to be written
    with tempfile.TemporaryDirectory(prefix="doc-") as tmp:
        cwd = Path(tmp)
        for step in read.steps:
            code, got = run(step, cwd)
            bad_exit = (code != 0) != should_fail(got if update else step.expected) or \
                (update and bool(step.expected) and should_fail(step.expected) != should_fail(got))
            if bad_exit:
                problems.append(f"{step.where}: {step.code!r}: exit {code}\n" + "\n".join(got[-15:]))
            if update:  # a crash, or a refusal where the page shows none (or the reverse), is not written
                got_all.append(None if bad_exit else got)
            elif masked(got) != masked(step.expected):
                problems.append(f"{step.where}: {step.code!r} prints, masked:\n  " + "\n  ".join(masked(got)) +
                                f"\n{name} shows, masked:\n  " + "\n  ".join(masked(step.expected)))
    if update:  # re-read: the page may have been edited while it ran; only output spans change
        now = read_page(page.read_text(encoding="utf-8"), name)
        if [s.code for s in now.steps] != [s.code for s in read.steps]:
            return problems + [f"{name} changed while it ran; run --update again"]
        new_lines = page.read_text(encoding="utf-8").splitlines()
        for step, got in sorted(zip(now.steps, got_all), key=lambda r: r[0].span, reverse=True):
            if got is None:
                continue
            a, b = step.span
            if a == b and step.kind == "python":  # a python block with no ```text block yet: add one when it prints
                if got:
                    new_lines[a:a] = ["", "```text", *got, "```"]
            else:
                new_lines[a:b] = got
        page.write_text("\n".join(new_lines) + "\n", encoding="utf-8")
    return problems


# What a block that is not run still proves: the scripts, commands, options and extras it names exist.

def _commands(b: Block) -> list[list[str]]:
    """The command lines of a block, as argv lists (a transcript's `$` lines; else every line)."""
    lines = [line[2:] for line in b.body if line.startswith("$ ")] or b.body
    out = []
    for line in lines:
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                argv = shlex.split(part, comments=True)
            except ValueError:
                continue
            if argv:
                out.append(argv)
    return out


@functools.lru_cache(maxsize=None)
def script_help(script: str) -> tuple[bool, str]:
    """Whether `python SCRIPT --help` answers (else whether SCRIPT imports), and the help text."""
    r = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 0 and "usage:" in r.stdout:
        return True, r.stdout
    probe = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('m', sys.argv[1]); "
             "s.loader.exec_module(importlib.util.module_from_spec(s))")
    r2 = subprocess.run([sys.executable, "-c", probe, str(ROOT / script)], cwd=ROOT, env=env(), capture_output=True,
                        text=True, timeout=120)
    return r2.returncode == 0, ""


def _options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def scripts_named(b: Block) -> list[tuple[str, list[str]]]:
    """(benchmark script, the options given to it) for each benchmark command line of B."""
    out = []
    for argv in _commands(b):
        for k, a in enumerate(argv):
            if re.fullmatch(r"benchmarks/\w+\.py", a):
                out.append((a, _options(argv[k + 1:])))
    return out


def check_script(script: str, options: list[str]) -> list[str]:
    """The script exists, answers --help (or imports), and knows every option the page gives it."""
    if not (ROOT / script).is_file():
        return [f"{script}: no such script"]
    ok, help_text = script_help(script)
    if not ok:
        return [f"{script}: neither `--help` nor an import works"]
    missing = [o for o in options if o != "--help" and not re.search(rf"{re.escape(o)}\b", help_text)]
    return [f"{script}: no option {o} in its --help" for o in missing]


def check_llama_tools(argv: list[str]) -> list[str]:
    """A llama-tools command line names a real command, and every option it gives is one of that command's."""
    import click

    from llama_tools.cli import cli

    cmd: click.Command = cli
    words = argv[1:]
    while isinstance(cmd, click.Group) and words and not words[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), words[0])
        if sub is None:
            return [f"{' '.join(argv)}: no command {words[0]!r}"]
        cmd, words = sub, words[1:]
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    return [f"{' '.join(argv[:3])}: no option {o}" for o in _options(words) if o not in known]


@functools.lru_cache(maxsize=1)
def extras() -> frozenset[str]:
    """The extras pyproject.toml declares (read by hand: tomllib is Python 3.11's, the project runs on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return frozenset(re.findall(r"^([\w-]+) = \[", section, flags=re.M))


EXTRA = re.compile(r"""(?:pip install[^`\n]*?)(?:-e )?["']?\.\[([\w,-]+)\]""")


def check_extras(text: str, where: str) -> list[str]:
    """Every `pip install ".[a,b]"` in TEXT names extras pyproject.toml declares."""
    out = []
    for m in EXTRA.finditer(text):
        out += [f"{where}: no extra [{e}] in pyproject.toml" for e in m.group(1).split(",") if e not in extras()]
    return out


if __name__ == "__main__":
    print(__doc__)
