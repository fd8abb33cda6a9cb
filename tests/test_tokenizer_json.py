"""tokenizer.json through HF `tokenizers`, and tokenizer.json built from a GGUF vocabulary.

Truth from outside our code: transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=)`),
sentencepiece on the model a synthetic GGUF was written from, transformers' AutoTokenizer and onnxruntime-genai's
Tokenizer on the files an export writes, and the real SmolLM2-135M-Instruct (GGUF and its HF checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import finish_gguf, train_tiny_tokenizer
from llama_tools.cli import cli
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.exporters.genai import write_client_files
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.source import resolve
from llama_tools.checkpoints.source import prompt_ids
from llama_tools.checkpoints.tokenizer import GgufTokenizer, JsonTokenizer, Tokenizer
from llama_tools.checkpoints.tokenizer_files import tokenizer_json_from_gguf

# English, code, unicode, emoji, leading and repeated spaces, digits, a chat turn with special tokens.
REAL_TEXTS = ["The capital of France is", "def f(x):\n    return x ** 2  # square\n",
              "  leading spaces,\ttabs and 12345 or 3.14", "naïve café — 東京 ünïcödé", "emoji 🦙🚀 👍🏽!",
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", " x", "I'm sure they'll've 1,000,000!"]
SPM_TEXTS = ["Who is the 45th President of the United States? Donald Trump.",
             "The quick brown fox jumps over the lazy dog.", "你好，世界。我们今天学习数学。", "una fff able unaffable"] * 30
SPM_PROBES = ["The quick brown fox 啊 jumps", " leading  double  spaces ", "una fff able unaffable🙂",
              "45th\ttab\nline", "x", "Donald 🦙 Trump"]
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- A synthetic GGUF with a tiny "llama" (SentencePiece) vocabulary --------------------------------------------

def _write_llama_gguf(spm_model: Path, out: Path, *, space_prefix: bool | None = None) -> Path:
    """SPM_MODEL's pieces, scores and types as llama.cpp's convert script writes them (no tensors needed)."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(spm_model.read_bytes())
    w = gguf.GGUFWriter(out, "llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece for p in proto.pieces])
    w.add_token_scores([p.score for p in proto.pieces])
    w.add_token_types([p.type for p in proto.pieces])
    w.add_bos_token_id(proto.trainer_spec.bos_id)
    w.add_eos_token_id(proto.trainer_spec.eos_id)
    w.add_unk_token_id(proto.trainer_spec.unk_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    finish_gguf(w)
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_tiny_tokenizer(SPM_TEXTS, tmp_path_factory.mktemp("spm") / "tokenizer", vocab_size=320)


@pytest.fixture(scope="module")
def llama_gguf(spm_model, tmp_path_factory) -> Path:
    return _write_llama_gguf(spm_model, tmp_path_factory.mktemp("gguf") / "tiny-spm.gguf")


def test_llama_gguf_encodes_as_sentencepiece_and_transformers(spm_model, llama_gguf):
    """Ids (BOS included, byte fallback) as sentencepiece gives for the model the GGUF was written from."""
    ours, ref = Tokenizer(llama_gguf), Tokenizer(spm_model)
    assert isinstance(ours, GgufTokenizer) and (ours.bos_id, ours.eos_ids, ours.special.add_bos) == (1, (2,), True)
    hf = _hf_gguf_tokenizer(llama_gguf)
    for text in SPM_PROBES + SPM_TEXTS[:4]:
        ids = ref.sp.EncodeAsIds(text)
        assert ours.encode(text) == [1] + ids, text
        assert hf(text)["input_ids"] == [1] + ids, text
        assert ours.decode(ours.encode(text)) == text
    assert ours.pieces(ours.encode("啊", bos=False))[-3:] == ["<0xE5>", "<0x95>", "<0x8A>"]


def test_llama_gguf_without_space_prefix(spm_model, tmp_path):
    """Negative: tokenizer.ggml.add_space_prefix = false drops the dummy "▁": other ids than sentencepiece's,
    still transformers'."""
    bare = _write_llama_gguf(spm_model, tmp_path / "bare.gguf", space_prefix=False)
    ours, ref, hf = Tokenizer(bare), Tokenizer(spm_model), _hf_gguf_tokenizer(bare)
    assert ours.encode("Who is") != ref.encode("Who is")
    for text in SPM_PROBES:
        assert ours.encode(text) == hf(text)["input_ids"], text


def test_gguf_vocabulary_refusals():
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'no-such-pre'"):
        tokenizer_json_from_gguf(fields)
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert'"):
        tokenizer_json_from_gguf({**fields, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="no vocabulary"):
        tokenizer_json_from_gguf({"general.architecture": "llama"})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer_json_from_gguf({**fields, "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.eos_token_id": 7})


# --- The real SmolLM2 GGUF (gpt2 kind, smollm pre-tokenizer, no BOS) ----------------------------------------------

@pytest.mark.slow
def test_smollm2_gguf_encodes_as_transformers(smollm2_gguf):
    """Our tokenizer.json from the GGUF gives transformers' GGUF tokenizer's ids; BOS as the GGUF says (none)."""
    ours = Tokenizer(smollm2_gguf)
    hf = _hf_gguf_tokenizer(smollm2_gguf)
    for text in REAL_TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text  # transformers adds <|im_start|> (LlamaTokenizerFast's default)...
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert not ours.special.add_bos  # ...where the GGUF says tokenizer.ggml.add_bos_token = false
    assert ours.encode(CHAT)[:1] == [1] and ours.eos_ids == (2,)  # <|im_start|> one token, <|im_end|> stops


@pytest.mark.slow
def test_smollm2_gguf_equals_its_hf_tokenizer_json(smollm2_gguf, smollm2_hf):
    """The GGUF's vocabulary and the checkpoint's tokenizer.json (SmolLM2's Digits + ByteLevel) agree."""
    from_gguf, shipped = Tokenizer(smollm2_gguf), Tokenizer(smollm2_hf / "tokenizer.json")
    for text in REAL_TEXTS:
        assert from_gguf.encode(text) == shipped.encode(text), text


# --- A checkpoint with tokenizer.json only -----------------------------------------------------------------------

def test_tokenize_command_on_a_tokenizer_json_checkpoint(smollm2_hf):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    for text in REAL_TEXTS[:5]:
        r = CliRunner().invoke(cli, ["tokenize", str(smollm2_hf), text, "--format", "json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["ids"] == hf(text)["input_ids"], text  # no BOS: SmolLM2's tokenizer_config says so
        assert out["text"] == text
    r = CliRunner().invoke(cli, ["tokenize", str(smollm2_hf), "--ids", "504 3575 282 4649 314", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)["text"] == hf.decode([504, 3575, 282, 4649, 314])
    tok = Tokenizer(smollm2_hf / "tokenizer.json")
    assert isinstance(tok, JsonTokenizer) and tok.bos_id == 1 and not tok.special.add_bos
    # verify parity --prompt takes the same path: the ids hf gives
    assert prompt_ids(resolve(smollm2_hf), REAL_TEXTS[0], None)[0] == hf(REAL_TEXTS[0])["input_ids"]


def test_bos_follows_tokenizer_config(smollm2_hf, tmp_path):
    """Negative: the same tokenizer.json with add_bos_token true in its config starts with BOS."""
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copyfile(smollm2_hf / name, tmp_path / name)
    cfg = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert Tokenizer(tmp_path / "tokenizer.json").encode("Hi") == [1] + Tokenizer(smollm2_hf / "tokenizer.json").encode("Hi")
    gen = json.loads((smollm2_hf / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0]}))
    assert Tokenizer(tmp_path / "tokenizer.json").eos_ids == (2, 0)


def test_no_tokenizer_is_one_line(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_to_hf(get_preset("tiny"))))
    r = CliRunner().invoke(cli, ["tokenize", str(d / "config.json"), "--ids", "1 2"])
    assert r.exit_code == 1 and "no tokenizer there" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_generate_with_a_prompt_stops_at_eos(smollm2_hf):
    r = CliRunner().invoke(cli, ["generate", str(smollm2_hf), "--prompt", CHAT, "--max-new-tokens", "40",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prompt_ids"][0] == 1 and out["prompt_ids"] == Tokenizer(smollm2_hf / "tokenizer.json").encode(CHAT)
    assert out["stopped_by"] == "eos" and out["new_ids"][-1] == 2, out  # <|im_end|> from generation_config.json
    assert "Paris" in out["text"]


# --- What an export writes for clients --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    from llama_tools.exporters.onnx_export import export_onnx

    path = tmp_path_factory.mktemp("plain") / "model.onnx"
    export_onnx("tiny", path)
    return path


def _client_dir(plain: Path, tokenizer: Path, d: Path) -> Path:
    d.mkdir()
    shutil.copyfile(plain, d / "model.onnx")
    write_client_files(d / "model.onnx", get_preset("tiny"), tokenizer_dir=tokenizer)
    return d


def _check_clients(d: Path, ours: Tokenizer, texts: list[str]) -> None:
    """transformers 4.x's AutoTokenizer and onnxruntime-genai's Tokenizer on D give our ids."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    for text in texts:
        assert hf(text)["input_ids"] == ours.encode(text), text
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    tok = og.Tokenizer(og.Model(str(d)))
    tok.update_options(add_special_tokens="true")
    for text in texts:
        assert [int(i) for i in tok.encode(text)] == ours.encode(text), text


@pytest.mark.slow
def test_export_renames_tokenizers_backend(plain, smollm2_hf, tmp_path):
    """A transformers-5 tokenizer_config.json (TokenizersBackend) becomes one 4.57 loads; both clients agree."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(smollm2_hf / "tokenizer.json", src / "tokenizer.json")
    cfg = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "TokenizersBackend"}))
    with pytest.raises(ValueError, match="TokenizersBackend"):  # negative: 4.x cannot load what 5.x wrote
        transformers.AutoTokenizer.from_pretrained(src)
    d = _client_dir(plain, src, tmp_path / "out")
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (d / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    _check_clients(d, Tokenizer(src / "tokenizer.json"), REAL_TEXTS)


@pytest.mark.slow
def test_export_from_gguf_writes_tokenizer_json(plain, smollm2_gguf, llama_gguf, tmp_path):
    """Both GGUF kinds: the files written from the vocabulary load in transformers and genai with our ids."""
    d = _client_dir(plain, smollm2_gguf, tmp_path / "gpt2")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in d.iterdir()}
    _check_clients(d, Tokenizer(smollm2_gguf), REAL_TEXTS)
    d = _client_dir(plain, llama_gguf, tmp_path / "llama")
    _check_clients(d, Tokenizer(llama_gguf), SPM_PROBES)


def test_convert_keeps_a_tokenizer_json(smollm2_hf, tmp_path):
    """A checkpoint with only tokenizer.json converts with its tokenizer: the copy encodes as the original does."""
    src = tmp_path / "src"
    r = CliRunner().invoke(cli, ["convert", "tiny", str(src), "--to", "hf"])
    assert r.exit_code == 0, r.output
    (src / "tokenizer.model").unlink(missing_ok=True)  # tiny's own; this checkpoint holds SmolLM2's tokenizer.json
    (src / "tokenizer_config.json").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(smollm2_hf / name, src / name)
    r = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "hf"])
    assert r.exit_code == 0, r.output
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes(), name
    assert not (tmp_path / "dst" / "tokenizer.model").exists()
    want = Tokenizer(smollm2_hf / "tokenizer.json").encode(REAL_TEXTS[0])
    r = CliRunner().invoke(cli, ["tokenize", str(tmp_path / "dst"), REAL_TEXTS[0], "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)["ids"] == want, r.output
