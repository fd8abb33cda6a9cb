"""Every docs/*.md page runs as written, as the README does (tests/doc_blocks.py), and what no page runs is checked.

A block a page does not run still has to be true where it can be checked cheaply: it says why it is not run, the
benchmark scripts it names exist and answer `--help` (or import) with the options shown, its `llama-tools` lines
name real commands and options, and the extras it installs are pyproject.toml's. Links between pages resolve, and
the pages speak of the product (no development-log words).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from doc_blocks import (DOCS, README, Block, check_extras, check_llama_tools, check_script, pages, read_page,
                        rel, run_page, scripts_named, _commands)

DOC_PAGES = sorted(DOCS.glob("*.md"))
PENDING: set[str] = set()  # pages linked from the README but written separately


def _not_run() -> list[Block]:
    out: list[Block] = []
    for page in pages():
        out += read_page(page.read_text(encoding="utf-8"), rel(page)).not_run
    return out


def _script_options() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for b in _not_run():
        for script, options in scripts_named(b):
            found.setdefault(script, []).extend(options)
    return found


SCRIPTS = _script_options()


def test_the_docs_pages_exist():
    names = {p.name for p in DOC_PAGES}
    assert {"commands.md", "verification.md", "checkpoints.md", "export.md", "benchmarks.md",
            "python-api.md"} <= names, names


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_every_block_runs_or_says_why(page: Path):
    """Each block is a transcript, a Python block, or marked not run with a reason; nothing else."""
    read = read_page(page.read_text(encoding="utf-8"), rel(page))
    assert not read.problems, "\n".join(read.problems)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="the pages' commands are bash lines")
@pytest.mark.parametrize("page", [p for p in DOC_PAGES if read_page(p.read_text(encoding="utf-8"), rel(p)).steps],
                         ids=rel)
def test_page_runs_as_written(page: Path):
    if "onnxruntime_genai" in page.read_text(encoding="utf-8"):
        pytest.importorskip("onnxruntime_genai")
        pytest.importorskip("optimum.onnxruntime")
    problems = run_page(page)
    assert not problems, "\n\n".join(problems) + "\n\n(refresh the outputs with: python tests/test_readme.py " \
                                                 f"--update {rel(page)})"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_blocks_name_working_scripts(script: str):
    """Each benchmark a page names exists, answers --help (or imports), and knows the options the page gives it."""
    assert not check_script(script, SCRIPTS[script])


def test_not_run_commands_are_real():
    """The llama-tools lines of blocks not run name real commands and options; their extras exist."""
    problems = []
    for b in _not_run():
        for argv in _commands(b):
            if argv[0] == "llama-tools":
                problems += [f"{b.page}:{b.line}: {p}" for p in check_llama_tools(argv)]
    for page in pages():
        problems += check_extras(page.read_text(encoding="utf-8"), rel(page))
    assert not problems, "\n".join(problems)


def test_the_checks_of_blocks_not_run_can_fail():
    """The negative cases: a missing script, an option a script or command lacks, an extra pyproject lacks."""
    assert check_script("benchmarks/no_such_bench.py", []) == ["benchmarks/no_such_bench.py: no such script"]
    assert check_script("benchmarks/bench_faults.py", ["--no-such-option"])
    assert check_llama_tools(["llama-tools", "verify", "parity", "--no-such-option"])
    assert check_llama_tools(["llama-tools", "verify", "nothing"])
    assert not check_llama_tools(["llama-tools", "verify", "parity", "x.onnx", "--by-layer", "--plot", "p.png"])
    assert check_extras('pip install ".[gpu,nope]"', "x") == ["x: no extra [nope] in pyproject.toml"]
    assert not check_extras('pip install -e ".[genai,test]"', "x")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> list[str]:
    """TEXT's lines outside code blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return out


def _anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#").replace("`", "")) for line in _prose(page.read_text(encoding="utf-8"))
            if line.startswith("#")}


def test_links_resolve():
    """Every relative link of every page names a file that exists, and a heading there when it names one."""
    problems = []
    for page in pages():
        for line in _prose(page.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if rel(dest) in PENDING:
                    continue
                if not dest.exists():
                    problems.append(f"{rel(page)}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{rel(page)}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_the_readme_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    assert all(f"(docs/{p.name})" in text for p in DOC_PAGES), [p.name for p in DOC_PAGES
                                                               if f"(docs/{p.name})" not in text]


# Words of a development log, not of the product ("session" alone is one; onnxruntime's sessions are the product's).
LOG_WORDS = re.compile(r"\b(issues?|closing notes|earlier|this run of ours|sessions?)\b", re.I)
PRODUCT_SESSION = re.compile(r"onnxruntime(?: [\w-]+)? sessions?|InferenceSession", re.I)


def test_pages_speak_of_the_product():
    problems = []
    for page in pages():
        for n, line in enumerate(_prose(page.read_text(encoding="utf-8"))):
            words = PRODUCT_SESSION.sub("", re.sub(r"`[^`]*`", "", line))
            problems += [f"{rel(page)}: {m.group(0)!r} in: {line.strip()[:100]}" for m in LOG_WORDS.finditer(words)]
    assert not problems, "\n".join(problems)


def test_log_words_are_found():
    """The negative case: the word check sees a log word in prose, and lets onnxruntime's sessions be."""
    line = "As the earlier session showed, the onnxruntime CPU session holds `session` options."
    words = PRODUCT_SESSION.sub("", re.sub(r"`[^`]*`", "", line))
    assert [m.group(0) for m in LOG_WORDS.finditer(words)] == ["earlier", "session"]
