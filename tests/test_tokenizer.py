"""tokenizer.model through sentencepiece: a tiny BPE with byte fallback, trained here, never downloaded."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.modeling.model import build_model
from helpers import train_tiny_tokenizer
from llama_tools.checkpoints.tokenizer import Tokenizer

TEXTS = ["Who is the 45th President of the United States? Donald Trump.",
         "The quick brown fox jumps over the lazy dog.", "你好，世界。我们今天学习数学。",
         "una fff able unaffable"] * 30


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return train_tiny_tokenizer(TEXTS, tmp_path_factory.mktemp("tok") / "tokenizer", vocab_size=320)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok_path):
    """A tiny checkpoint whose vocabulary is the tokenizer's, with tokenizer.model beside it."""
    cfg = get_preset("tiny").replace(vocab_size=Tokenizer(tok_path).vocab_size)
    d = tmp_path_factory.mktemp("ck") / "model"
    state = {k: v.detach() for k, v in build_model(cfg, seed=0, init_std=0.1).state_dict().items()}
    save_checkpoint(cfg, state, d)
    shutil.copyfile(tok_path, d / "tokenizer.model")
    return d


def test_special_ids_and_bos(tok_path):
    tok = Tokenizer(tok_path)
    assert (tok.sp.unk_id(), tok.bos_id, tok.eos_id) == (0, 1, 2)  # LLaMA's <unk>, <s>, </s>
    ids = tok.encode("Who is the 45th President")
    assert ids[0] == 1 and tok.pieces(ids)[0] == "<s>"
    assert tok.encode("Who", bos=False)[0] != 1
    assert tok.encode("Who", eos=True)[-1] == 2


@pytest.mark.parametrize("text", ["Who is the 45th President of the United States?", "你好，世界。",
                                  "啊 unaffable 🦙 ÆØÅ", "  leading and  double spaces"])
def test_round_trip(tok_path, text):
    tok = Tokenizer(tok_path)
    assert tok.decode(tok.encode(text)) == text
    assert 0 not in tok.encode(text)  # byte fallback: nothing becomes <unk>


def test_byte_fallback_pieces_as_in_the_paper(tok_path):
    tok = Tokenizer(tok_path)
    pieces = tok.pieces(tok.encode("啊", bos=False))  # not in the training text
    assert pieces[-3:] == ["<0xE5>", "<0x95>", "<0x8A>"]  # "啊".encode("utf-8") == b"\xe5\x95\x8a"
    assert [tok.sp.PieceToId(f"<0x{b:02X}>") for b in "啊".encode()] == [3 + 0xE5, 3 + 0x95, 3 + 0x8A]
    assert tok.pieces(tok.encode("你好", bos=False))[-2:] == ["你", "好"]  # seen characters are their own pieces


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="tokenizer.model: not a sentencepiece model"):
        Tokenizer(tmp_path / "tokenizer.model")


def test_tokenize_command(model_dir):
    r = CliRunner().invoke(cli, ["tokenize", str(model_dir), "啊 the", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["ids"][0] == 1 and out["text"] == "啊 the"
    assert [t["piece"] for t in out["tokens"]][2:5] == ["<0xE5>", "<0x95>", "<0x8A>"]
    r = CliRunner().invoke(cli, ["tokenize", str(model_dir), "--ids", "1 3"])
    assert r.exit_code == 0 and "<0x00>" in r.output


def test_generate_with_prompt(model_dir):
    run = lambda *a: CliRunner().invoke(cli, ["generate", str(model_dir), "--max-new-tokens", "6", *a])  # noqa: E731
    r = run("--prompt", "Who is the")
    assert r.exit_code == 0, r.output
    text, speed = r.output.strip().splitlines()[-2:]
    assert text.startswith("Who is the") and "tokens/s" in speed
    greedy = json.loads(run("--prompt", "Who is the", "--format", "json").output)
    assert greedy["prompt_ids"] == Tokenizer(model_dir / "tokenizer.model").encode("Who is the")
    same = json.loads(run("--ids", " ".join(map(str, greedy["prompt_ids"])), "--format", "json").output)
    assert same["new_ids"] == greedy["new_ids"]  # --prompt is only a way to write the ids
    sampled = [json.loads(run("--prompt", "Who", "--temperature", "1.5", "--top-p", "0.9", "--seed", "7",
                              "--repetition-penalty", "1.2", "--format", "json").output)["new_ids"] for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded


def test_prompt_needs_a_tokenizer():
    r = CliRunner().invoke(cli, ["generate", "llama-7b", "--prompt", "hi"])  # a preset without a tokenizer (tiny has one)
    assert r.exit_code == 1 and "pass --ids" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["generate", "tiny", "--ids", "1 2 x"])
    assert r.exit_code == 1 and "--ids must be integers" in r.output


def test_verify_parity_encodes_prompts_with_the_checkpoint_tokenizer(model_dir):
    tok = Tokenizer(model_dir / "tokenizer.model")
    prompts = ["The quick brown fox", "你好，世界"]
    r = CliRunner().invoke(cli, ["verify", "parity", str(model_dir), "--prompt", prompts[0], "--prompt", prompts[1],
                                 "--steps", "3", "--format", "json", "-q"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["passed"] is True
    assert data["prompt_lengths"] == [len(tok.encode(p, bos=True)) for p in prompts]
    assert all(len(row) == 3 for row in data["whole_graph"]["decode"]["reference_ids"])
