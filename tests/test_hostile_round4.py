"""What a checkpoint's text can make us run, bounded: chat templates rendered in a child bounded in time and memory.

Each hostile template (a loop of 10^10 steps, a power computed in one C call no alarm interrupts, a string doubled
48 times, a lone surrogate, an answer of megabytes) must leave `verify parity` its chat-turn row as plain text with
the reason on the header line, within seconds and without growing the parent; a template that renders is used.
"""

from __future__ import annotations

import json
import re
import resource
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.exporters.prompts import RENDER_SECONDS, render_chat
from llama_tools.outputs.bounded import Exceeded, bounded_call

GOOD = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
HOSTILE = {
    "loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past"),
    "power": ("{{ (2 ** 1000000000) % 7 }}", "ran past"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(48) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s|length }}", "ran out of its|ran past"),  # memory, or time on a busy machine
    "surrogate": ("{{ '\\udc80' }}", "not UTF-8"),
    "output": ("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", "renders past"),
}


def test_a_template_that_renders_is_rendered():
    assert render_chat(GOOD, "hi", "<s>", "</s>") == "<|user|>hi<|assistant|>"


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_is_refused_within_its_bounds(case):
    template, why = HOSTILE[case]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=why):
        render_chat(template, "hi", "<s>", "</s>")
    assert time.monotonic() - t0 < RENDER_SECONDS + 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # kB: the child paid, not us


def test_bounded_call_says_what_the_child_raised_and_returns_only_json():
    assert bounded_call(lambda: "ok", seconds=5, memory_bytes=2**26, answer_bytes=100) == "ok"
    with pytest.raises(Exceeded, match="KeyError: 'x'"):
        bounded_call(lambda: {}["x"], seconds=5, memory_bytes=2**26, answer_bytes=100)
    with pytest.raises(Exceeded, match="answer is over 100 bytes"):
        bounded_call(lambda: "y" * 1000, seconds=5, memory_bytes=2**26, answer_bytes=100)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "tiny-hf"
    r = CliRunner().invoke(cli, ["convert", "tiny", str(d), "--to", "hf"])
    assert r.exit_code == 0, r.output
    return d


@pytest.mark.parametrize("case", ["loop", "doubling"])
def test_verify_parity_runs_the_chat_turn_as_plain_text_and_says_why(tiny_hf, tmp_path, case):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny_hf.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE[case][0]}))
    t0 = time.monotonic()
    r = CliRunner().invoke(cli, ["verify", "source", str(d), "-q"])
    assert time.monotonic() - t0 < 30
    assert r.exit_code == 0, r.output[-1500:]
    first = r.output.splitlines()[0]
    assert re.search("chat turn as plain text: the model's chat template (" + HOSTILE[case][1] + ")", first), first


GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4,
        "vocab_size": 100, "n_positions": 64}


def test_the_transformers_module_tree_is_built_under_a_bound(tmp_path, monkeypatch):
    """Whatever key multiplies what transformers builds, the build stops at its time bound with one line."""
    pytest.importorskip("transformers")
    from llama_tools.counting import transformers_count as tc

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2, "n_layer": 2000}))
    monkeypatch.setattr(tc, "TREE_SECONDS", 0.5)
    tc._tree.cache_clear()
    t0 = time.monotonic()
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    assert time.monotonic() - t0 < 20
    assert r.exit_code == 1 and r.output.startswith(f"Error: {path}: transformers' module tree of it ran past 0.5 s")
    assert len(r.output.strip().splitlines()) == 1


def test_a_negative_count_is_refused(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2, "n_layer": -3}))
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    assert r.exit_code == 1 and r.output.strip() == (f"Error: {path}: field 'n_layer' is -3; a count of layers must "
                                                     f"be >= 0; fix the config")
