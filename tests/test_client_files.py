"""Client files keep the source's word: `export onnx` and `convert --to hf` carry the source's bos/eos/pad ids,
generation_config.json, chat template and tokenizer files as the source has them, and say what they invent.

Truth is the source's own files, read here with json and compared field by field (ids) or byte by byte
(generation_config.json, the template, the tokenizer files); onnxruntime-genai's chat template path is checked
against transformers' rendering of the source. A seeded source (tiny's weights and tokenizer, a hand-written
generation_config.json and chat template) runs in seconds; the real models of tests/realmodels.py are slow.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.checkpoints.convert import convert
from llama_tools.exporters.pipeline import export
from llama_tools.checkpoints.source import resolve
from llama_tools.checkpoints.tokenizer_files import sentencepiece_files

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SAMPLING = ("do_sample", "temperature", "top_k", "top_p")  # what onnxruntime-genai's builder puts in `search`
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0, "do_sample": True,
              "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}
MESSAGES = [{"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Write hello world in C."}]


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def template_of(folder: Path) -> tuple[str, str] | None:
    """(form, text) of FOLDER's chat template: tokenizer_config.json's field, or chat_template.jinja."""
    config = folder / "tokenizer_config.json"
    field = _json(config).get("chat_template") if config.is_file() else None
    if field is not None:
        return "tokenizer_config.json", field
    jinja = folder / "chat_template.jinja"
    return ("chat_template.jinja", jinja.read_text(encoding="utf-8")) if jinja.is_file() else None


def mismatches(src: Path, out: Path, *, genai: bool) -> list[str]:
    """Every way OUT's files depart from SRC's word (empty: they keep it); genai: OUT is an export's folder."""
    found = []
    said = _json(src / "config.json")
    wrote = _json(out / "config.json")
    for key in IDS:
        if said.get(key) != wrote.get(key):
            found.append(f"config.json {key}: source {said.get(key)!r}, written {wrote.get(key)!r}")
    gen = src / "generation_config.json"
    if gen.is_file() and (not (out / gen.name).is_file() or (out / gen.name).read_bytes() != gen.read_bytes()):
        found.append("generation_config.json: not the source's bytes")
    for name in TOKENIZER_FILES:
        there = out / name
        if (src / name).is_file() and (not there.is_file() or there.read_bytes() != (src / name).read_bytes()):
            found.append(f"{name}: not the source's bytes")
    said_t, wrote_t = template_of(src), template_of(out)
    if said_t != wrote_t:
        found.append(f"chat template: the source's in {said_t and said_t[0]}, written in {wrote_t and wrote_t[0]}"
                     + (" with other text" if said_t and wrote_t and said_t[0] == wrote_t[0] else ""))
    if genai:
        g = _json(out / "genai_config.json")
        sampling = _json(gen) if gen.is_file() else {}
        for key in IDS:  # onnxruntime-genai's builder: generation_config.json's, else config.json's
            want = sampling[key] if sampling.get(key) is not None else said.get(key)
            if want is not None and g["model"][key] != want:
                found.append(f"genai_config.json {key}: source {want!r}, written {g['model'][key]!r}")
        for key in SAMPLING:
            if sampling.get(key) is not None and g["search"][key] != sampling[key]:
                found.append(f"genai_config.json search.{key}: source {sampling[key]!r}, written {g['search'][key]!r}")
    return found


# --- A seeded source: tiny's weights and tokenizer, a hand-written generation_config.json and template ---------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """tiny's seeded weights as a HF checkpoint with its tokenizer.model and a tokenizer.json made from it."""
    d = tmp_path_factory.mktemp("tiny") / "hf"
    convert("tiny", d, to="hf")
    (d / "tokenizer.json").write_text(sentencepiece_files(d / "tokenizer.model")["tokenizer.json"], encoding="utf-8")
    return d


def seeded_source(d: Path, tiny_hf: Path, *, template_in_config: bool = False,
                  generation: dict | None = GENERATION, pad_in_config: int | None = None) -> Path:
    """A copy of tiny_hf with an eos list in config.json, a generation_config.json, the template in either form."""
    shutil.copytree(tiny_hf, d)
    config = _json(d / "config.json")
    config["eos_token_id"] = [2, 5]  # Llama 3's form: a list in config.json
    config.pop("pad_token_id", None)
    if pad_in_config is not None:
        config["pad_token_id"] = pad_in_config
    (d / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation, indent=1), encoding="utf-8")
    if template_in_config:
        tok = _json(d / "tokenizer_config.json")
        (d / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": TEMPLATE}, indent=2),
                                                 encoding="utf-8")
    else:
        (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


# The fused graph exports in a fraction of a second (the plain one traces for seconds) and gets the same client
# files; the real models below run the plain graph.
FAST = "--optimize"


def run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.mark.parametrize("template_in_config", [False, True], ids=["jinja-file", "tokenizer_config-field"])
def test_seeded_source_is_carried_into_export_and_convert(tmp_path, template_in_config, tiny_hf):
    src = seeded_source(tmp_path / "src", tiny_hf, template_in_config=template_in_config)
    res = run("export", "onnx", str(src), "-o", str(tmp_path / "onnx" / "model.onnx"), FAST, "--format", "json")
    payload = json.loads(res.stdout)
    assert payload["client_files_invented"] == [] and payload["client_files_warnings"] == [], payload
    run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")
    for out, genai in ((tmp_path / "onnx", True), (tmp_path / "hf", False)):
        assert mismatches(src, out, genai=genai) == [], out
    g = _json(tmp_path / "onnx" / "genai_config.json")
    assert (g["model"]["eos_token_id"], g["model"]["pad_token_id"]) == ([2, 7], 0)  # generation_config.json's
    assert g["search"]["top_k"] == 50  # sampling asked, no top_k given: transformers' default, not greedy's 1
    assert g["search"]["repetition_penalty"] == 1.0  # the builder does not take it from generation_config.json
    assert _json(tmp_path / "hf" / "config.json")["eos_token_id"] == [2, 5]  # config.json's own list, kept
    assert "chat_template" not in g["model"]  # genai refuses the key: the tokenizer files carry the template
    # Meta's params.json has no place for ids or a template: the source's files go beside consolidated.00.pth.
    run("convert", str(src), str(tmp_path / "meta"), "--to", "meta")
    beside = [n for n in (*TOKENIZER_FILES, "generation_config.json") if (src / n).is_file()]
    assert {"tokenizer.model", "generation_config.json"} <= set(beside)
    assert [n for n in beside if (tmp_path / "meta" / n).read_bytes() != (src / n).read_bytes()] == []


def test_a_converted_tokenizer_keeps_the_template_field(tmp_path, tiny_hf):
    """tokenizer.model alone: the tokenizer.json and tokenizer_config.json made for genai keep the source's template."""
    src = seeded_source(tmp_path / "src", tiny_hf, template_in_config=True)
    (src / "tokenizer.json").unlink()
    client = export(resolve(str(src)), tmp_path / "onnx" / "model.onnx", optimize=True).client_files
    assert client.tokenizer == "converted from tokenizer.model"
    assert template_of(tmp_path / "onnx") == ("tokenizer_config.json", TEMPLATE)
    run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")  # convert copies: the very bytes
    assert mismatches(src, tmp_path / "hf", genai=False) == []


def test_the_comparison_fails_on_drift(tmp_path, tiny_hf):
    """Negative control: each drift the issue saw, planted in a good export, is named by the comparison."""
    src = seeded_source(tmp_path / "src", tiny_hf)
    out = tmp_path / "onnx"
    export(resolve(str(src)), out / "model.onnx", optimize=True)
    assert mismatches(src, out, genai=True) == []
    g = _json(out / "genai_config.json")
    g["model"]["pad_token_id"] = 2  # the old rule: pad = eos, where the source says 0
    (out / "genai_config.json").write_text(json.dumps(g))
    hf = _json(out / "config.json")
    hf["eos_token_id"] = 2  # the list flattened
    (out / "config.json").write_text(json.dumps(hf))
    (out / "chat_template.jinja").unlink()
    (out / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes() + b" ")
    found = mismatches(src, out, genai=True)
    named = ["config.json eos_token_id: source [2, 5], written 2", "tokenizer.json: not", "chat_template.jinja: not",
             "chat template: the source's in chat_template.jinja, written in None",
             "genai_config.json pad_token_id: source 0, written 2"]
    assert len(found) == len(named) and all(f.startswith(n) for f, n in zip(found, named)), found


def test_what_the_source_does_not_say_is_invented_and_said(tmp_path, tiny_hf):
    """No pad anywhere, no generation_config.json: pad = the first eos, said in the table and the JSON."""
    src = seeded_source(tmp_path / "src", tiny_hf, generation=None)
    out = tmp_path / "onnx" / "model.onnx"
    payload = json.loads(run("export", "onnx", str(src), "-o", str(out), FAST, "--format", "json").stdout)
    invented = payload["client_files_invented"]
    assert len(invented) == 2 and invented[0].startswith("pad_token_id = 2: the source names no pad id"), invented
    assert invented[1].startswith("generation_config.json: the source has none"), invented
    g = _json(out.parent / "genai_config.json")
    assert (g["model"]["eos_token_id"], g["model"]["pad_token_id"]) == ([2, 5], 2)  # config.json's list; invented pad
    assert _json(out.parent / "generation_config.json")["eos_token_id"] == [2, 5]
    assert "pad_token_id" not in _json(out.parent / "config.json")  # config.json keeps the source's silence
    table = run("export", "onnx", str(src), "-o", str(tmp_path / "again" / "model.onnx"), FAST).stdout
    assert "invented      pad_token_id = 2: the source names no pad id" in table
    run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")  # convert invents nothing: no file appears
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    assert "pad_token_id" not in _json(tmp_path / "hf" / "config.json")


def test_config_pad_is_kept_by_convert(tmp_path, tiny_hf):
    """config.json's own pad (Qwen2.5's 151643 beside eos 151645) survives `convert --to hf` and the export."""
    src = seeded_source(tmp_path / "src", tiny_hf, generation=None, pad_in_config=0)
    run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")
    assert _json(tmp_path / "hf" / "config.json")["pad_token_id"] == 0
    export(resolve(str(src)), tmp_path / "onnx" / "model.onnx", optimize=True)
    assert _json(tmp_path / "onnx" / "genai_config.json")["model"]["pad_token_id"] == 0


def test_onnxruntime_genai_renders_the_carried_template_as_transformers(tmp_path, tiny_hf):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    transformers = pytest.importorskip("transformers")
    src = seeded_source(tmp_path / "src", tiny_hf)
    out = tmp_path / "onnx"
    export(resolve(str(src)), out / "model.onnx", optimize=True)
    want = transformers.AutoTokenizer.from_pretrained(str(src)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    got = og.Tokenizer(og.Model(str(out))).apply_chat_template(json.dumps(MESSAGES), add_generation_prompt=True)
    assert got == want and want.startswith("<|system|>\nAnswer in one line.</s>")


# --- Files that are not valid: left out with one line naming them --------------------------------------------

BAD = [
    ("chat_template.jinja", "{% for m in messages %}{{ m['content'] }", "chat_template.jinja: not a valid Jinja"),
    ("generation_config.json", '{"eos_token_id": "two"}', "field 'eos_token_id' must be a token id"),
    ("generation_config.json", '{"eos_token_id": 99999}', "field 'eos_token_id' must be a token id in 0..511"),
    ("generation_config.json", '{"temperature": -1}', "field 'temperature' must be a number >= 0"),
    ("generation_config.json", "{not json", "generation_config.json: not valid JSON"),
]


@pytest.mark.parametrize("name,text,message", BAD, ids=[b[2][:30] for b in BAD])
def test_a_file_that_is_not_valid_is_left_out_with_a_warning(tmp_path, name, text, message, tiny_hf):
    src = seeded_source(tmp_path / "src", tiny_hf)
    (src / name).write_text(text, encoding="utf-8")
    res = run("export", "onnx", str(src), "-o", str(tmp_path / "onnx" / "model.onnx"), FAST)
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(src / name) in warnings[0] and message in warnings[0], res.stderr
    conv = run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")
    assert [line for line in conv.stderr.splitlines() if line.startswith("warning:")] == warnings
    for out in (tmp_path / "onnx", tmp_path / "hf"):
        assert not (out / name).exists() or name == "generation_config.json" and out.name == "onnx"
    if name == "generation_config.json":  # genai falls back to config.json's ids, and says it made the file
        g = _json(tmp_path / "onnx" / "genai_config.json")
        assert (g["model"]["eos_token_id"], g["search"]["do_sample"]) == ([2, 5], False)


def test_a_template_field_that_does_not_parse_is_dropped_from_the_copy(tmp_path, tiny_hf):
    src = seeded_source(tmp_path / "src", tiny_hf, template_in_config=True)
    tok = _json(src / "tokenizer_config.json")
    (src / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": "{% if %}"}), encoding="utf-8")
    res = run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")
    assert "tokenizer_config.json: its chat_template is not a valid Jinja template" in res.stderr
    kept = _json(tmp_path / "hf" / "tokenizer_config.json")
    assert "chat_template" not in kept and kept == {k: v for k, v in tok.items() if k != "chat_template"}


def test_a_template_is_parsed_never_rendered(tmp_path, tiny_hf):
    """A template that would loop for ever, or reach for Python internals, is carried as text in no time."""
    src = seeded_source(tmp_path / "src", tiny_hf)
    hostile = "{% for i in range(10**15) %}{{ ''.__class__.__mro__[1].__subclasses__() }}{% endfor %}"
    (src / "chat_template.jinja").write_text(hostile, encoding="utf-8")
    started = time.monotonic()
    export(resolve(str(src)), tmp_path / "onnx" / "model.onnx", optimize=True)
    assert time.monotonic() - started < 60
    assert (tmp_path / "onnx" / "chat_template.jinja").read_text(encoding="utf-8") == hostile


def test_a_fifo_named_generation_config_never_blocks(tmp_path, tiny_hf):
    src = seeded_source(tmp_path / "src", tiny_hf, generation=None)
    os.mkfifo(src / "generation_config.json")
    res = run("convert", str(src), str(tmp_path / "hf"), "--to", "hf")
    assert "generation_config.json: is a FIFO" in res.stderr and "not carried" in res.stderr, res.stderr


# --- The real models ----------------------------------------------------------------------------------------

REAL = ["smollm2_hf", "glublm_hf", "qwen2_hf"]


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_real_model_client_files_keep_the_source_word(name, request, tmp_path):
    """A plain fp32 export and `convert --to hf` of each real model, compared with its own files; on the one with
    a chat template (Qwen2.5-Coder), onnxruntime-genai renders the carried template as transformers does."""
    src = Path(request.getfixturevalue(name))
    rep = export(resolve(str(src)), tmp_path / "onnx" / "model.onnx")
    assert mismatches(src, tmp_path / "onnx", genai=True) == []
    assert rep.client_files.invented == [] and rep.client_files.warnings == []  # each names its bos, eos and pad
    if template_of(src) is not None:
        _genai_renders_as_transformers(src, tmp_path / "onnx")
    shutil.rmtree(tmp_path / "onnx")  # a GB or more: gone before the conversion's copy
    res = convert(str(src), tmp_path / "hf", to="hf")
    assert mismatches(src, tmp_path / "hf", genai=False) == [] and res.warnings == []
    shutil.rmtree(tmp_path / "hf")


def _genai_renders_as_transformers(src: Path, onnx_dir: Path) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    transformers = pytest.importorskip("transformers")
    want = transformers.AutoTokenizer.from_pretrained(str(src)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    got = og.Tokenizer(og.Model(str(onnx_dir))).apply_chat_template(json.dumps(MESSAGES), add_generation_prompt=True)
    assert got == want and MESSAGES[1]["content"] in want, (got, want)
