"""Hostile input, fourth round: each refusal blames the right thing, in one line naming the file and the key or option.

A chat template that is not UTF-8 (a JSON "\\udc80" escape in tokenizer_config.json, bytes in a GGUF's
tokenizer.chat_template) is a broken field: left out of what convert writes, with one warning naming the file and key,
and never needed to encode text. A prompt that is not UTF-8 names its option, not the tokenizer. A device that is full
names the output path, not standard output. A GGUF without a vocabulary is named when converted to HF.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli

CLI = [sys.executable, "-m", "llama_tools.cli"]
MARK = b"QZQZ"  # a template's text, replaced by bytes that are not UTF-8 once written into a GGUF


def invoke(argv: list[str]):
    return CliRunner().invoke(cli, argv)


def one_line(r, *names: str) -> str:
    """Exit 1, one stderr line naming every one of NAMES, no traceback."""
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exit_code, r.output, r.exception)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    for name in names:
        assert name in lines[0], f"{name!r} not in: {lines[0]}"
    return lines[0]


def ok(r) -> None:
    assert r.exit_code == 0 and r.exception is None, (r.exit_code, r.output, r.exception)


def warnings(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("warning: ")]


def gguf_fields(path: Path) -> set[str]:
    import gguf

    return set(gguf.GGUFReader(path).fields)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "hf"
    ok(invoke(["convert", "tiny", str(d), "--to", "hf"]))
    return d


def with_template(src: Path, dst: Path, template_json: str) -> Path:
    """A copy of SRC whose tokenizer_config.json's chat_template is TEMPLATE_JSON, written as JSON text as it is."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    text = (dst / "tokenizer_config.json").read_text().rstrip().rstrip("}")
    (dst / "tokenizer_config.json").write_text(text + f', "chat_template": {template_json}}}\n')
    return dst


@pytest.fixture(scope="module")
def bad_template_gguf(tiny_hf, tmp_path_factory) -> Path:
    """tiny as a GGUF whose tokenizer.chat_template holds bytes that are not UTF-8 (0xff 0xfe)."""
    root = tmp_path_factory.mktemp("badt")
    d = with_template(tiny_hf, root / "hf", json.dumps("{{ '" + MARK.decode() + "' }}"))
    good = root / "good.gguf"
    ok(invoke(["convert", str(d), str(good), "--to", "gguf"]))
    data = good.read_bytes()
    assert data.count(MARK) == 1
    bad = root / "bad.gguf"
    bad.write_bytes(data.replace(MARK, b"\xff\xfe" + MARK[2:]))
    return bad


# --- 1. a chat template holding a lone surrogate ---------------------------------------------------------------

def test_a_surrogate_template_is_left_out_of_the_gguf_in_one_warning_naming_file_and_key(tiny_hf, tmp_path):
    d = with_template(tiny_hf, tmp_path / "m", '"{{ \'\\udc80\' }}"')  # the JSON escape: valid JSON, no UTF-8
    out = tmp_path / "m.gguf"
    r = invoke(["convert", str(d), str(out), "--to", "gguf"])
    ok(r)
    said = warnings(r)
    assert len(said) == 1, r.stderr
    assert str(d / "tokenizer_config.json") in said[0] and "chat_template" in said[0] and "not UTF-8" in said[0]
    fields = gguf_fields(out)
    assert "tokenizer.chat_template" not in fields and "tokenizer.ggml.tokens" in fields  # the vocabulary is kept


# --- 2. a GGUF whose chat template is not UTF-8 ----------------------------------------------------------------

def test_tokenize_needs_no_chat_template(bad_template_gguf):
    r = invoke(["tokenize", str(bad_template_gguf), "hi", "--format", "json"])
    ok(r)
    assert json.loads(r.stdout)["ids"][0] == 1


def test_generate_needs_no_chat_template(bad_template_gguf):
    ok(invoke(["generate", str(bad_template_gguf), "--prompt", "hi", "--max-new-tokens", "2", "-q"]))


def test_the_template_where_used_names_the_file_and_key(bad_template_gguf):
    from llama_tools.checkpoints.gguf.read import HeaderError, field_value, open_gguf, template_problem

    with pytest.raises(HeaderError, match=r"bad\.gguf: GGUF metadata tokenizer\.chat_template is not UTF-8 text"):
        field_value(open_gguf(bad_template_gguf), "tokenizer.chat_template")
    assert "tokenizer.chat_template is not UTF-8" in template_problem(bad_template_gguf)


def test_verify_says_why_the_chat_turn_is_plain_text(bad_template_gguf):
    from llama_tools.checkpoints.source import load_tokenizer, resolve
    from llama_tools.exporters.prompts import text_inputs

    inputs = text_inputs(load_tokenizer(resolve(str(bad_template_gguf))), 512, 64)
    assert "chat turn as plain text: " in inputs.what and "tokenizer.chat_template is not UTF-8" in inputs.what


@pytest.mark.parametrize("to", ["gguf", "hf"])
def test_convert_leaves_the_template_out_in_one_warning(bad_template_gguf, tmp_path, to):
    out = tmp_path / ("o.gguf" if to == "gguf" else "o")
    r = invoke(["convert", str(bad_template_gguf), str(out), "--to", to])
    ok(r)
    said = warnings(r)
    assert len(said) == 1 and str(bad_template_gguf) in said[0], r.stderr
    assert "tokenizer.chat_template" in said[0] and "not UTF-8" in said[0]
    if to == "gguf":
        assert "tokenizer.chat_template" not in gguf_fields(out) and "tokenizer.ggml.tokens" in gguf_fields(out)
    else:
        assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


def test_a_token_that_is_not_utf8_names_the_key_and_item(tmp_path, bad_template_gguf):
    import gguf

    data = bad_template_gguf.read_bytes()
    tokens = gguf.GGUFReader(bad_template_gguf).fields["tokenizer.ggml.tokens"].contents()
    i, token = next((i, t) for i, t in enumerate(tokens) if len(t) >= 4 and data.count(t.encode()) == 1)
    bad = tmp_path / "tok.gguf"
    bad.write_bytes(data.replace(token.encode(), b"\xff" + token.encode()[1:]))
    one_line(invoke(["tokenize", str(bad), "hi"]), str(bad), f"tokenizer.ggml.tokens item {i}", "not UTF-8")


# --- 3. text options that are not UTF-8 -------------------------------------------------------------------------

BAD = "a\udcff"  # how Python hands over the byte 0xff in argv (surrogateescape)


@pytest.mark.parametrize("argv, option", [
    (["generate", "tiny", "--prompt", BAD], "--prompt"),
    (["tokenize", "tiny", BAD], "TEXT"),
    (["tokenize", "tiny", "--ids", BAD], "--ids"),
    (["verify", "parity", "tiny", "--prompt", BAD], "--prompt"),
    (["verify", "source", "tiny", "--prompt", "ok", "--prompt", BAD], "--prompt"),
    (["verify", "int4", "x.onnx", "--prompt", BAD], "--prompt"),
])
def test_text_that_is_not_utf8_names_its_option(argv, option):
    line = one_line(invoke(argv), option, "not UTF-8", "byte 0xff")
    assert "tokenizer.model" not in line


def test_text_in_utf8_still_reads():
    ok(invoke(["tokenize", "tiny", "héllo ☃"]))


def test_a_real_argv_byte_names_the_option(tmp_path):
    r = subprocess.run([os.fsencode(a) for a in CLI] + [b"tokenize", b"tiny", b"\xff"], capture_output=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1 and b"not UTF-8" in r.stderr, r.stderr


# --- 4. a full device names the output path ---------------------------------------------------------------------

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


@needs_dev_full
@pytest.mark.parametrize("argv", [
    ["convert", "tiny", "/dev/full", "--to", "gguf"],
    ["report", "shapes", "tiny", "--format", "csv", "-o", "/dev/full"],
    ["export", "onnx", "tiny", "-o", "/dev/full"],
], ids=["convert-gguf", "report-shapes", "export-onnx"])
def test_a_full_device_is_named(argv, tmp_path):
    r = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("Error: /dev/full: no space left on the device"), r.stderr
    assert "standard output" not in r.stderr and "bytes free" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@needs_dev_full
def test_standard_output_full_is_named_so(tmp_path):
    with open("/dev/full", "wb") as full:
        r = subprocess.run(CLI + ["convert", "tiny", "-", "--to", "gguf"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: standard output: no space left"), r.stderr
    assert "llama-tools-stream" not in r.stderr  # our temp file is not what filled


# --- 5. a GGUF without a vocabulary -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def novocab_gguf(tiny_hf, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("novocab")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    out = root / "novocab.gguf"
    ok(invoke(["convert", str(root / "cfg" / "config.json"), str(out), "--to", "gguf"]))
    return out


def test_a_gguf_without_vocabulary_is_named_when_converted_to_hf(novocab_gguf, tmp_path):
    one_line(invoke(["convert", str(novocab_gguf), str(tmp_path / "o"), "--to", "hf"]), f"{novocab_gguf}: ",
             "no vocabulary")
    assert list(tmp_path.iterdir()) == []


def test_a_gguf_without_vocabulary_converts_to_gguf_with_a_warning(novocab_gguf, tmp_path):
    r = invoke(["convert", str(novocab_gguf), str(tmp_path / "o.gguf"), "--to", "gguf"])
    ok(r)
    assert any(str(novocab_gguf) in w and "no vocabulary" in w for w in warnings(r)), r.stderr


def test_an_output_name_that_is_not_utf8_is_written(tmp_path):
    """A file name is bytes: one that is not UTF-8 is a name like any other (its temp name too)."""
    out = tmp_path / os.fsdecode(b"out\xff.gguf")
    r = subprocess.run(CLI + ["convert", "tiny", str(out), "--to", "gguf"], capture_output=True, timeout=300,
                       cwd=tmp_path)  # a real process: its stdout writes the name back as the bytes it was
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert os.listdir(tmp_path) == [out.name]


@pytest.mark.parametrize("name, what", [(b"llama.context_length", "key/value"), (b"blk.0.attn_q.weight", "tensor info")])
def test_a_key_or_tensor_name_that_is_not_utf8_is_called_that(bad_template_gguf, tmp_path, name, what):
    data = bad_template_gguf.read_bytes()
    bad = tmp_path / "n.gguf"
    bad.write_bytes(data.replace(name, b"\xff" + name[1:], 1))
    line = one_line(invoke(["count-params", str(bad)]), str(bad), what, "name is not UTF-8 text")
    assert "codec" not in line


def test_a_surrogate_template_is_left_out_of_the_client_files_in_one_warning(tiny_hf, tmp_path):
    """export onnx: the source's tokenizer_config.json holds a template no UTF-8 file can hold; the export is
    written, its client tokenizer_config.json without the template, and one warning names the file and key."""
    d = with_template(tiny_hf, tmp_path / "m", '"{{ \'\\udc80\' }}"')
    out = tmp_path / "out" / "model.onnx"
    r = invoke(["export", "onnx", str(d), "-o", str(out)])
    ok(r)
    said = [w for w in warnings(r) if "chat_template" in w]
    assert len(said) == 1 and str(d / "tokenizer_config.json") in said[0] and "not UTF-8" in said[0], r.stderr
    client = json.loads((out.parent / "tokenizer_config.json").read_text())
    assert "chat_template" not in client and client.get("bos_token")  # the rest of the config is there
    good = with_template(tiny_hf, tmp_path / "g", json.dumps("{{ messages[0]['content'] }}"))  # negative: kept
    r = invoke(["export", "onnx", str(good), "-o", str(tmp_path / "g-out" / "model.onnx")])
    ok(r)
    assert json.loads((tmp_path / "g-out" / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("command", [["verify", "parity"], ["count-params"]])
def test_a_graph_without_its_onnx_name_is_told_what_a_model_file_is(tmp_path, command):
    """A file that is not JSON given as MODEL (an exported graph renamed without .onnx) is refused naming the file,
    why, and what a MODEL file is; a file named .json keeps the JSON error alone."""
    graph = tmp_path / "model-noext"
    graph.write_bytes(b"\x08\x0a\x12\x04\xff\xfe\x00\x01" + bytes(64))  # protobuf-like bytes
    line = one_line(invoke([*command, str(graph)]), str(graph), "not UTF-8 text", "known by its .onnx name")
    assert "config.json, params.json or .gguf" in line
    named = tmp_path / "config.json"
    named.write_bytes(b"\xff{}")
    assert "known by its .onnx name" not in one_line(invoke(["count-params", str(named)]), str(named), "not UTF-8 text")
