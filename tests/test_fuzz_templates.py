"""A fuzz run of what a checkpoint ships that runs on text: Jinja chat templates and a tokenizer.json's regexes.

Properties, on every generated case:
- a chat template (loops up to 10^9 steps, powers, string doubling, sandbox escapes, lone surrogates, syntax cut
  short) is rendered by exporters.prompts.render_chat to UTF-8 text within its bound of characters, or refused
  with a one-line ValueError, within its time bound, without growing this process;
- a tokenizer.json whose normalizer, pre-tokenizer (alone or in a Sequence) or decoder holds a generated regex
  (nested quantifiers, alternations, lookarounds, back-references, broken syntax) opens and encodes and decodes a
  generated text as the tokenizers library does in-process, or is refused with a one-line ValueError naming the
  file (and, for a pattern that runs past its time or the regex engine's limit, the pattern's key), within
  LOAD_SECONDS plus each call's bound; no Rust panic text ever reaches file descriptor 2.
The time bounds are lowered here (render 1 s, an encode 0.5 s + 20 us a character) so the suite runs in seconds;
LLAMA_TOOLS_FUZZ_EXAMPLES sets how many examples each property runs (benchmarks/bench_fuzz.py runs them longer).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_tools.exporters import prompts
from llama_tools.checkpoints import tokenizer as tokenizer_module
from llama_tools.checkpoints.tokenizer import LOAD_SECONDS, Tokenizer, seconds

FUZZ = settings(max_examples=int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "12")), deadline=None,
                derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
RENDER_SECONDS = 1.0  # prompts.RENDER_SECONDS while these run
ENCODE_BASE = 0.5  # tokenizer.SECONDS_BASE while these run
SLACK = 3.0  # a fork, a busy machine


@pytest.fixture(autouse=True, scope="module")
def short_bounds() -> Iterator[None]:
    """The bounds lowered, so a case that runs to its bound costs a second, not five."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompts, "RENDER_SECONDS", RENDER_SECONDS)
        mp.setattr(tokenizer_module, "SECONDS_BASE", ENCODE_BASE)
        yield


# --- Chat templates -------------------------------------------------------------------------------------------

def _quoted(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


NUMBERS = st.sampled_from(["0", "1", "2", "7", "-3", "48", "1000", "10**9", "2**64", "1000000000"])
STRINGS = st.one_of(st.text(alphabet="ab <|>{}%#'\"\\\n", max_size=6).map(_quoted),
                    st.sampled_from(["'\\udc80'", "'ab' * 10", "'x' * 100000"]))
ATOMS = st.one_of(
    NUMBERS, STRINGS,
    st.sampled_from(["m.content", "m.role", "bos_token", "eos_token", "messages|length", "messages[0].content",
                     "messages[5].content", "add_generation_prompt", "range(3)", "range(10**9)", "ns.s", "x",
                     "''.__class__", "m.__class__.__mro__", "raise_exception('refused')", "namespace(s='ab')",
                     "undefined_name", "messages[0]['role']"]))
EXPRS = st.recursive(ATOMS, lambda e: st.one_of(
    st.tuples(e, st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "~", "==", "and", "or", "in"]), e)
    .map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    st.tuples(e, st.sampled_from(["upper", "length", "trim", "string", "int", "list", "join", "reverse", "first",
                                  "tojson", "safe", "default('d')", "replace('a', 'aa')", "center(1000000)"]))
    .map(lambda t: f"{t[0]}|{t[1]}"),
), max_leaves=4)


@st.composite
def template_bodies(draw: Any, depth: int = 0) -> str:
    """A template's text: literals, expressions, and (to depth 2) loops, conditions and assignments."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["text", "expr"] + (["for", "if", "set", "double", "messages"] if depth < 2 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "text":
            parts.append(draw(st.text(alphabet="ab <|>\n", max_size=8)))
        elif kind == "expr":
            parts.append("{{ " + draw(EXPRS) + " }}")
        elif kind == "for":
            n = draw(st.sampled_from(["3", "1000", "10**5", "10**9"]))
            parts.append(f"{{% for x in range({n}) %}}{draw(template_bodies(depth + 1))}{{% endfor %}}")
        elif kind == "messages":
            parts.append(f"{{% for m in messages %}}{draw(template_bodies(depth + 1))}{{% endfor %}}")
        elif kind == "if":
            parts.append(f"{{% if {draw(EXPRS)} %}}{draw(template_bodies(depth + 1))}"
                         f"{{% else %}}{draw(template_bodies(depth + 1))}{{% endif %}}")
        elif kind == "set":
            parts.append(f"{{% set x = {draw(EXPRS)} %}}")
        else:  # a string doubled K times: 2^K characters
            k = draw(st.sampled_from([3, 10, 20, 48]))
            parts.append("{% set ns = namespace(s='ab') %}{% for i in range(" + str(k) + ") %}"
                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}")
    return "".join(parts)


@st.composite
def templates(draw: Any) -> str:
    """A chat template, now and then cut short (a syntax error) or with a stray tag."""
    text = draw(template_bodies())
    damage = draw(st.integers(0, 6))
    if damage == 0 and text:
        text = text[:draw(st.integers(0, len(text) - 1))]
    elif damage == 1:
        text += draw(st.sampled_from(["{%", "{{", "{% endfor %}", "{# ", "{% raw %}"]))
    return text


@FUZZ
@given(template=templates(), user=st.text(max_size=20))
def test_fuzzed_chat_template_renders_or_is_refused_in_one_line_within_its_bounds(template, user):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    try:
        out = prompts.render_chat(template, user, "<s>", "</s>")
    except ValueError as e:
        msg = str(e)
        assert msg.strip() and "\n" not in msg and "Traceback" not in msg, msg
    else:
        assert isinstance(out, str) and len(out) <= prompts.RENDER_CHARS
        out.encode("utf-8")  # never a lone surrogate
    assert time.monotonic() - start < RENDER_SECONDS + SLACK
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # kB: the child paid, not us


def test_negative_templates_reach_every_verdict():
    """A real template renders; a loop, a doubling, a syntax error and a sandbox escape are each refused: the
    property can fail both ways."""
    good = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    assert prompts.render_chat(good, "hi", "<s>", "</s>") == "<|user|>hi<|assistant|>"
    for template, says in [("{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}",
                            "ran past"),
                           ("{% set ns = namespace(s='ab') %}{% for i in range(48) %}{% set ns.s = ns.s ~ ns.s %}"
                            "{% endfor %}{{ ns.s|length }}", "ran out|ran past"),  # memory, or time on a busy machine
                           ("{% for m in messages %}", "TemplateSyntaxError"),
                           ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError")]:
        with pytest.raises(ValueError, match=says):
            prompts.render_chat(template, "hi", "<s>", "</s>")


# --- A tokenizer.json's regexes -------------------------------------------------------------------------------

ALPHABET = "ab 1.é\n"
VOCAB = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(ALPHABET)}, "x": len(ALPHABET) + 1}

REGEX_ATOMS = st.sampled_from(["a", "b", " ", ".", r"\d", r"\s", r"\w", r"\p{L}", "[ab]", "[^a]", "é", r"\n", "^", "$",
                               r"\b", "(?=a)", "(?!b)", r"\1", "(", "[", "*", r"\p{Bogus}", ".*", "(?:.*)"])
REGEXES = st.recursive(REGEX_ATOMS, lambda r: st.one_of(
    st.tuples(r, r).map("".join),
    st.tuples(r, r).map(lambda t: f"{t[0]}|{t[1]}"),
    r.map(lambda x: f"(?:{x})"),
    r.map(lambda x: f"({x})"),
    st.tuples(r, st.sampled_from(["*", "+", "?", "{1,3}", "{3}", "*?", "++", "{0,30}"]))
    .map(lambda t: f"(?:{t[0]}){t[1]}"),
), max_leaves=6)
# Shapes known to backtrack: some under onig's retry limit (seconds a line), some past it (a panic).
EVIL = st.sampled_from([r"(?:.*){3}\d", r"(?:.*){5}\d", r"(a+)+b", r"(?:a|a)*\d", r"(?:\S+\s?)+\d", r"(.*?,){11}P"])


def _base(pattern: str, where: str, behavior: str, invert: bool) -> dict[str, Any]:
    """A small BPE tokenizer.json (one id a character of ALPHABET, <unk> else) with PATTERN at WHERE."""
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior, "invert": invert}
    doc: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "[UNK]", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": VOCAB, "merges": []}}
    if where == "split":
        doc["pre_tokenizer"] = split
    elif where == "sequence":
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, split]}
    elif where == "normalizer":
        doc["normalizer"] = {"type": "Replace", "pattern": {"Regex": pattern}, "content": "x"}
    else:
        doc["decoder"] = {"type": "Replace", "pattern": {"Regex": pattern}, "content": "x"}
    return doc


@st.composite
def pattern_cases(draw: Any) -> tuple[str, str]:
    """(tokenizer.json text, a text to encode): a generated or known-evil regex at one of the places it runs."""
    pattern = draw(st.one_of(REGEXES, EVIL))
    where = draw(st.sampled_from(["split", "sequence", "normalizer", "decoder"]))
    doc = _base(pattern, where, draw(st.sampled_from(["Isolated", "Removed", "MergedWithPrevious",
                                                      "MergedWithNext", "Contiguous"])), draw(st.booleans()))
    text = draw(st.one_of(st.text(alphabet=ALPHABET, max_size=40),
                          st.sampled_from(["a" * 30 + "c", "The river, the bridge and the boat. " * 3])))
    return json.dumps(doc), text


def library_ids(text: str, sample: str) -> tuple[list[int], str]:
    """The tokenizers library's own ids of SAMPLE and their decoding, in-process (padding and truncation off)."""
    from tokenizers import Tokenizer as HFTokenizer

    tk = HFTokenizer.from_str(text)
    tk.no_padding()
    tk.no_truncation()
    ids = tk.encode(sample, add_special_tokens=False).ids
    return ids, tk.decode(ids, skip_special_tokens=True)


@FUZZ
@given(case=pattern_cases())
def test_fuzzed_pattern_encodes_as_the_library_does_or_is_refused_in_one_line_within_its_bounds(case, capfd):
    text, sample = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokenizer.json"
        path.write_text(text, encoding="utf-8")
        start = time.monotonic()
        try:
            tok = Tokenizer(path)
            ids = tok.encode(sample, bos=False, eos=False)
            decoded = tok.decode(ids)
        except ValueError as e:
            took = time.monotonic() - start
            msg = str(e)
            assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
            if "ran past" in msg or "gave up" in msg:
                assert ".pattern '" in msg, msg  # the key of the pattern that ran
        else:
            took = time.monotonic() - start
            assert (ids, decoded) == library_ids(text, sample)  # in-process only now: it ran within bounds there
        assert took < LOAD_SECONDS + 4 * seconds(len(sample)) + SLACK, took
    err = capfd.readouterr().err
    assert "panicked" not in err and "Traceback" not in err, err


def test_negative_patterns_reach_every_verdict(tmp_path, monkeypatch):
    """A linear pattern encodes as the library does; one that backtracks runs past its bound, one past the regex
    engine's limit is refused as such, and one that is no regex the library refuses to read."""
    path = tmp_path / "tokenizer.json"
    line = "The river, the bridge and the boat. " * 6
    cases = [(r"\s+", None), (r"(?:.*){3}\d", "ran past"), (r"(?:.*){5}\d", "gave up"), ("(", "not a tokenizer.json")]
    for pattern, says in cases:
        # the engine's own limit comes after a second or two of work: a busy machine must not reach the time bound
        # first, so that case runs under a long one
        monkeypatch.setattr(tokenizer_module, "SECONDS_BASE", 30.0 if says == "gave up" else ENCODE_BASE)
        text = json.dumps(_base(pattern, "split", "Isolated", False))  # one piece: the whole line
        path.write_text(text)
        if says is None:
            assert Tokenizer(path).encode(line, bos=False) == library_ids(text, line)[0]
            continue
        with pytest.raises(ValueError, match=says) as e:
            Tokenizer(path).encode(line)
        named = says == "not a tokenizer.json" or "pre_tokenizer.pattern '" in str(e.value)  # the key that ran
        assert "\n" not in str(e.value) and named, e.value
