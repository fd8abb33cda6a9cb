"""The README runs as written: every block, top to bottom, in an empty directory, printing what it shows.

The reading, running and masking rules are tests/doc_blocks.py's (docs/*.md run the same way: tests/test_docs.py).
Refresh the outputs the README and the docs show from a real run (after a change to what a command prints):

    python tests/test_readme.py --update                 # README.md and every docs/*.md
    python tests/test_readme.py --update docs/export.md  # the pages named
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import doc_blocks
from doc_blocks import README, ROOT, masked, read_page, run_page

CI_LINES = ["python -m pip install -q torch==2.13.0", 'python -m pip install -q -e ".[genai,test]"', "pytest -n 2 -q"]


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_a_front_page():
    """At most 200 lines; the main job (`verify parity`) and its verdict shown within the first 60."""
    lines = readme().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move depth to docs/"
    first = read_page(readme(), "README.md").steps[0]
    assert first.code == "llama-tools verify parity"
    assert first.span[1] <= 60 and first.expected[-1].startswith("PASS"), first.span


def test_readme_steps_are_found():
    """The extraction sees the tour's commands and the output under each; every block runs or says why not."""
    page = read_page(readme(), "README.md")
    assert not page.problems, page.problems
    cmds = [s.code for s in page.steps]
    assert any(c.startswith("llama-tools convert tiny") for c in cmds)
    assert any(c.startswith("llama-tools export onnx") for c in cmds)
    assert sum(c.startswith("llama-tools verify parity") for c in cmds) == 2
    assert all(s.expected for s in page.steps), "every command shows what it prints"
    assert all(b.reason for b in page.not_run)


def test_readme_holds_the_ci_lines_verbatim():
    """The tests' command in the README is the three lines .ci/run runs, as they are there."""
    page = read_page(readme(), "README.md")
    assert any(b.body == CI_LINES for b in page.not_run), "the README's test block is not CI's three lines"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert all(line in ci for line in CI_LINES), "a README test line is not in .ci/run"


def test_masks_keep_numbers_and_verdicts():
    """Timings and paths are masked; a changed count or verdict is still a difference (the negative case)."""
    a = masked(["tiny-hf  hf  4  21  158,016  632,064", "PASS: checks ran in 0.5 s", "time  13.1 s: graph 12.0 s"])
    assert a == masked(["tiny-hf hf 4 21 158,016 632,064", "PASS: checks ran in 3.2 s", "time 9.9 s: graph 9.0 s"])
    assert a != masked(["tiny-hf hf 4 21 158,017 632,064", "PASS: checks ran in 0.5 s", "time 13.1 s: graph 12.0 s"])
    assert a != masked(["tiny-hf hf 4 21 158,016 632,064", "FAIL: checks ran in 0.5 s", "time 13.1 s: graph 12.0 s"])
    # a near-tie's count is masked, an all-agree verdict is not; int4 figures on tiny are masked, its words are not
    assert masked(["own greedy tokens equal fp32's  4/32 steps"]) == masked(["own greedy tokens equal fp32's  9/32 steps"])
    assert masked(["greedy decode (8 steps x 5 rows)  8/8 steps agree"]) != masked(["greedy decode  7/8 steps agree"])
    assert masked(["mean KL(fp32 || int4)  0.0002 nats  <= 0.1 nats"]) == masked(["mean KL(fp32 || int4)  0.0004 nats"
                                                                                  "  <= 0.1 nats"])
    assert masked(["mean KL(fp32 || int4)  0.0002 nats  <= 0.1 nats"]) != masked(["mean KL(fp32 || int4)  0.0002 bits"
                                                                                  "  <= 0.1 nats"])


WRONG_PAGE = """# a page

```console
$ echo hello
hullo
```
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="shell blocks are bash lines")
def test_a_wrong_page_fails(tmp_path: Path):
    """The block test can fail: an altered output, a wrong exit status, a wrong Python print, an unmarked block."""
    def problems(text: str) -> list[str]:
        page = tmp_path / "page.md"
        page.write_text(text, encoding="utf-8")
        return run_page(page)

    assert problems(WRONG_PAGE.replace("hullo", "hello")) == []  # the same page, shown right, passes
    assert any("prints, masked" in p for p in problems(WRONG_PAGE))
    assert any("exit 1" in p for p in problems("```console\n$ false\n```\n"))
    assert any("exit 0" in p for p in problems("```console\n$ echo Error: no\nError: no\n```\n"))
    right = "```python\nprint(6 * 7)\n```\n\n```text\n42\n```\n"
    assert problems(right) == []
    assert any("prints, masked" in p for p in problems(right.replace("42", "43")))
    assert any("neither runs nor says why" in p for p in problems("```\nls\n```\n"))
    assert any("must say why" in p for p in problems("<!-- not run: -->\n```sh\nls\n```\n"))
    assert problems("<!-- not run: needs a GPU -->\n```sh\nnvidia-smi\n```\n") == []
    assert problems("```sh {skip: needs a GPU}\nnvidia-smi\n```\n") == []


def test_update_rewrites_only_outputs(tmp_path: Path):
    """--update puts what ran in place of what was shown, and adds the ```text block a Python block lacked."""
    page = tmp_path / "page.md"
    page.write_text(WRONG_PAGE + "\n```python\nprint('hi')\n```\n", encoding="utf-8")
    assert run_page(page, update=True) == []
    assert page.read_text(encoding="utf-8") == WRONG_PAGE.replace("hullo", "hello") + \
        "\n```python\nprint('hi')\n```\n\n```text\nhi\n```\n"
    assert run_page(page) == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="the README's commands are bash lines")
def test_readme_runs_as_written():
    problems = run_page(README)
    assert not problems, "\n\n".join(problems) + "\n\n(refresh the outputs with: python tests/test_readme.py --update)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--update":
        print(__doc__)
        return 2
    targets = [ROOT / a for a in argv[1:]] or doc_blocks.pages()
    left = []
    for page in targets:
        left += run_page(page, update=True)
        print(f"rewrote the outputs shown in {doc_blocks.rel(page)}")
    if left:
        print("exit codes that disagree, or pages that changed while they ran:\n" + "\n".join(left))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
