"""verify int4 scores real text: --text FILE (through the model's tokenizer), --prompt/--ids for the decode."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.checkpoints.source import resolve
from llama_tools.checkpoints.source import load_tokenizer

TEXT = ("The weights of a transformer are matrices. Each layer normalizes its input, attends over the "
        "previous tokens, and passes the result through a gated feed-forward network. " * 4)


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(out), "--quantize", "int4", "-q",
                                 "--no-client-files"])
    assert r.exit_code == 0, r.output
    return out


def test_text_is_scored_through_the_tokenizer(int4, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    ids = load_tokenizer(resolve("tiny")).encode(TEXT)
    for cap in (30, 10_000):
        r = CliRunner().invoke(cli, ["verify", "int4", str(int4), "--text", str(text), "--max-tokens", str(cap),
                                     "--prompt", "Who is", "--steps", "3", "--format", "json"])
        assert r.exit_code in (0, 1), r.output
        rep = json.loads(r.stdout)
        assert rep["sequence_length"] == min(cap, len(ids), 256)  # tiny's context is 256 positions
        assert len(rep["reference_ids"]) == 3


def test_refusals_are_one_line(int4, tmp_path):
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    for argv, says in ((["--prompt", "x", "--ids", "1 2"], "at most one of --prompt"),
                       (["--text", str(binary)], "not UTF-8 text"),
                       (["--text", str(tmp_path / "missing.txt")], "does not exist")):
        r = CliRunner().invoke(cli, ["verify", "int4", str(int4), *argv])
        assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output, r.output
