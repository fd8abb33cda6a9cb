"""A fuzz run of the tokenizer.json loader: a valid small tokenizer.json, mutated (fields dropped or retyped, huge ids,
an empty vocabulary, broken merges, padding and truncation numbers, special ids, the text cut short).

Properties, on every generated file:
- our loader (llama_tools.checkpoints.tokenizer.Tokenizer) either opens it or raises a ValueError of one line naming the file:
  no other exception, no panic, no hang or allocation of what a number in the file asks;
- what it opens, the tokenizers library itself reads and encodes the same way (padding and truncation off, as
  transformers encodes one text), to at least one id of its own; what the library cannot read or encode, it
  refuses; it refuses what the library encodes only for a BOS/EOS/pad id that is none of its ids;
- at the command line: `tokenize` and `export onnx` refuse such a file in one line naming it, exit 1, before any
  work and with nothing written; `export` also refuses one whose ids go past the model's vocab_size.
LLAMA_TOOLS_FUZZ_EXAMPLES sets how many examples each property runs (a benchmark may run them longer).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_tools.checkpoints.convert import convert
from llama_tools.checkpoints.tokenizer import PROBE_TEXT, Tokenizer
from test_fuzz_headers import json_values, odd_ints
import test_hostile
from test_hostile import TEXTS, assert_one_line, invoke, tree

tripwires = test_hostile.tripwires  # the fixture: each expensive entry point fails the test if it runs

FUZZ = settings(max_examples=int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "60")), deadline=5000,
                derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
IDS = odd_ints | st.sampled_from([2**32 - 1, 79, 80, 511, 512, 10**6])


def _base() -> dict[str, Any]:
    """A small BPE tokenizer.json made by the tokenizers library: NFC, whitespace split, <unk>, a BOS template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tk = HFTokenizer(models.BPE(unk_token="<unk>"))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.BPEDecoder()
    tk.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"],
                                                      show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return json.loads(tk.to_str())


BASE = _base()


def _paths(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value: a dict's keys and a list's indices, depth first."""
    if at:
        yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, at + (i,))


def _parent(doc: Any, at: tuple) -> Any:
    for key in at[:-1]:
        doc = doc[key]
    return doc


def _model(doc: dict[str, Any]) -> dict[str, Any] | None:
    m = doc.get("model")
    return m if isinstance(m, dict) else None


@st.composite
def tokenizer_texts(draw: Any) -> str:
    """The text of a tokenizer.json: BASE as is, mutated up to three times, maybe cut short."""
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["drop", "retype", "vocab_id", "added_id", "empty", "merge", "numbers",
                                     "special"]))
        model = _model(doc)
        if kind in ("drop", "retype"):
            at = draw(st.sampled_from(list(_paths(doc))))
            parent = _parent(doc, at)
            if kind == "drop":
                del parent[at[-1]]
            else:
                parent[at[-1]] = draw(json_values)
        elif kind == "vocab_id" and model is not None and isinstance(model.get("vocab"), dict) and model["vocab"]:
            model["vocab"][draw(st.sampled_from(sorted(model["vocab"])))] = draw(IDS)
        elif kind == "added_id" and isinstance(doc.get("added_tokens"), list) and doc["added_tokens"]:
            token = doc["added_tokens"][draw(st.integers(0, len(doc["added_tokens"]) - 1))]
            if isinstance(token, dict):
                token["id"] = draw(IDS)
        elif kind == "empty" and model is not None:
            model.update(vocab={}, merges=[], unk_token=draw(st.sampled_from([None, "<unk>"])))
        elif kind == "merge" and model is not None and isinstance(model.get("merges"), list):
            bad = draw(st.sampled_from([["T", "zzz"], ["T"], "T h", ["", ""], 5, ["T", "h", "e"]]))
            model["merges"].insert(draw(st.integers(0, len(model["merges"]))), bad)
        elif kind == "numbers":
            n, pad = draw(IDS), draw(IDS)
            doc["padding"] = {"strategy": {"Fixed": n}, "direction": "Right", "pad_to_multiple_of": draw(IDS),
                              "pad_id": pad, "pad_type_id": 0, "pad_token": "<unk>"}
            doc["truncation"] = {"direction": "Right", "max_length": draw(IDS), "strategy": "LongestFirst",
                                 "stride": draw(IDS)}
        elif kind == "special" and isinstance(doc.get("post_processor"), dict):
            specials = doc["post_processor"].get("special_tokens")
            if isinstance(specials, dict) and isinstance(specials.get("<s>"), dict):
                specials["<s>"]["ids"] = [draw(IDS)]
    text = json.dumps(doc)
    if draw(st.integers(0, 5)) == 0:
        text = text[:draw(st.integers(0, len(text)))]
    return text


def library_encodes(text: str) -> list[int] | None:
    """The tokenizers library's own ids of PROBE_TEXT (padding and truncation off), None when it cannot read the file
    or encode with it (its post-processor on a short text, and decoding the ids back, included)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tk = HFTokenizer.from_str(text)
        tk.no_padding()
        tk.no_truncation()
        ids = tk.encode(PROBE_TEXT, add_special_tokens=False).ids
        tk.encode("a", add_special_tokens=True)
        tk.decode(ids, skip_special_tokens=True)
        return ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001  (its own Exception, a panic)
        return None


def open_ours(path: Path) -> Tokenizer | ValueError:
    """Our loader's verdict on PATH: the tokenizer, or its ValueError (anything else fails the test)."""
    try:
        return Tokenizer(path)
    except ValueError as e:
        return e


@FUZZ
@given(text=tokenizer_texts())
def test_fuzzed_tokenizer_json_opens_as_the_library_reads_it_or_is_one_named_line(text):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokenizer.json"
        path.write_text(text, encoding="utf-8")
        ours, truth = open_ours(path), library_encodes(text)
        if isinstance(ours, ValueError):
            msg = str(ours)
            assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
            if truth:  # the library reads and encodes it: only a special id that is none of its ids is refused
                assert " id " in msg, msg
        else:
            assert truth, "we opened a tokenizer the library cannot encode text with"
            assert ours.encode(PROBE_TEXT, bos=False, eos=False) == truth
            assert all(0 <= i < ours.vocab_size for i in truth)
            ours.decode(truth)


def test_negative_the_fuzzers_base_opens_and_its_cases_reach_every_verdict(tmp_path):
    """The base file opens as the library reads it; mutated ones the library refuses, or that encode to nothing,
    or that add a BOS id no token has, are refused: the property can fail both ways."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(BASE))
    ok = open_ours(path)
    assert isinstance(ok, Tokenizer) and ok.encode(PROBE_TEXT, bos=False) == library_encodes(json.dumps(BASE))
    cut = json.dumps(BASE)[:100]
    empty = json.dumps({**BASE, "model": {**BASE["model"], "vocab": {}, "merges": [], "unk_token": None}})
    bos = json.dumps({**BASE, "post_processor": {**BASE["post_processor"], "special_tokens": {
        "<s>": {"id": "<s>", "ids": [10**6], "tokens": ["<s>"]}}}})
    assert library_encodes(cut) is None and library_encodes(empty) == [] and library_encodes(bos)  # the library's
    for text, says in ((cut, "not a tokenizer.json"), (empty, "to no tokens"), (bos, "bos id 1000000")):
        path.write_text(text)
        got = open_ours(path)
        assert isinstance(got, ValueError) and says in str(got), got


# --- At the command line --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """tiny's seeded weights (vocab_size 512) as an HF checkpoint, without a tokenizer of its own."""
    d = tmp_path_factory.mktemp("fuzz-ck") / "hf"
    convert("tiny", d, to="hf")
    for name in ("tokenizer.model", "tokenizer.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.mark.usefixtures("tripwires")
@FUZZ
@given(text=tokenizer_texts())
def test_fuzzed_tokenizer_json_at_the_command_line_is_refused_in_one_line_before_any_work(text, tiny_hf):
    with tempfile.TemporaryDirectory() as root:
        ck, work = Path(root) / "ck", Path(root) / "work"
        shutil.copytree(tiny_hf, ck)
        work.mkdir()
        (ck / "tokenizer.json").write_text(text, encoding="utf-8")
        ours = open_ours(ck / "tokenizer.json")
        r = invoke(["tokenize", str(ck), PROBE_TEXT, "--format", "json"])
        if isinstance(ours, ValueError):
            assert_one_line(r, str(ck / "tokenizer.json"))
        else:
            assert r.exit_code == 0 and json.loads(r.stdout)["ids"], r.output
        if isinstance(ours, Tokenizer) and ours.vocab_size <= 512:
            return  # usable and fitting: the export would do its work (the tripwires would stop it)
        r = invoke(["export", "onnx", str(ck), "-o", str(work / "out" / "model.onnx")])
        line = assert_one_line(r, str(ck / "tokenizer.json"))
        if isinstance(ours, Tokenizer):
            assert f"go up to {ours.vocab_size - 1}" in line and "vocab_size 512" in line, line
        assert tree(work) == []
