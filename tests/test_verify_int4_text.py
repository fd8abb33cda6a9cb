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


def test_the_default_is_the_built_in_text(int4, tmp_path):
    """No --prompt or --text: the export's own held-out text is scored and its first sentence starts the decode,
    the very figures those given by hand give; a model with no tokenizer falls back to seeded ids."""
    from llama_tools.exporters.prompts import QUALITY_PROMPT, QUALITY_TEXT

    text = tmp_path / "quality.txt"
    text.write_text(QUALITY_TEXT, encoding="utf-8")
    runs = [CliRunner().invoke(cli, ["verify", "int4", str(int4), "--steps", "4", "--format", "json", *extra])
            for extra in ([], ["--prompt", QUALITY_PROMPT, "--text", str(text)])]
    default, by_hand = (json.loads(r.stdout) for r in runs)
    assert default["on"] == "a built-in English text" and by_hand["on"] == "quality.txt"
    # tiny's small vocabulary makes the text longer than --max-tokens: its first 256 tokens are scored.
    assert default["sequence_length"] == min(256, len(load_tokenizer(resolve("tiny")).encode(QUALITY_TEXT))) > 50
    for key in ("reference_ids", "int4_ids", "mean_kl", "top1_agreement", "ppl_reference"):
        assert default[key] == by_hand[key], key


def test_no_tokenizer_means_seeded_ids(tmp_path):
    import torch

    from llama_tools.checkpoints.convert import save_checkpoint
    from llama_tools.exporters.quant_options import PROMPT_IDS
    from llama_tools.modeling.model import build_model
    from llama_tools.modeling.presets import get_preset

    cfg = get_preset("tiny")
    torch.manual_seed(0)
    save_checkpoint(cfg, build_model(cfg, dtype=torch.float32).state_dict(), tmp_path / "hf", to="hf")
    out = tmp_path / "int4" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(tmp_path / "hf"), "-o", str(out), "--quantize", "int4", "-q",
                                 "--max-kl", "none", "--no-client-files"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", "int4", str(out), "--steps", "4", "--format", "json"])
    rep = json.loads(r.stdout)
    assert rep["on"] == "the prompt and fp32's greedy continuation" and rep["sequence_length"] == PROMPT_IDS + 4


def test_the_provider_is_chosen_and_said(int4):
    """--provider cpu runs the int4 graph there and says so; cuda where onnxruntime cannot run it is one line."""
    from llama_tools.exporters.runtime import cuda_unusable

    r = CliRunner().invoke(cli, ["verify", "int4", str(int4), "--steps", "2", "--provider", "cpu", "--format", "json"])
    assert r.exit_code in (0, 1), r.output
    rep = json.loads(r.stdout)
    assert rep["provider"] == "cpu" and "CPU provider" in rep["provider_note"]
    table = CliRunner().invoke(cli, ["verify", "int4", str(int4), "--steps", "2", "--provider", "cpu"])
    assert "int4 graph on onnxruntime, CPU provider (asked for)" in table.output, table.output
    if cuda_unusable() is not None:
        r = CliRunner().invoke(cli, ["verify", "int4", str(int4), "--steps", "2", "--provider", "cuda"])
        # before any weight is read: one line (bad input exits 1, as everywhere in the CLI), no verdict
        assert r.exit_code == 1 and r.output.startswith("Error:") and len(r.output.strip().splitlines()) == 1
        assert "Traceback" not in r.output and "--provider" in r.output and "FAITHFUL" not in r.output, r.output
        assert "CUDA provider" in r.output and "use --provider cpu" in r.output, r.output


@pytest.mark.gpu
def test_gpu_int4_is_judged_on_cuda(int4):
    """MatMulNBits (4- and 8-bit), GatherBlockQuantized and GQA's rotary on the CUDA provider: faithful, said so."""
    r = CliRunner().invoke(cli, ["verify", "int4", str(int4), "--provider", "cuda", "--format", "json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["provider"] == "cuda" and rep["faithful"] and rep["mean_kl"] < 0.01, rep
