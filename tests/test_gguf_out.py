"""`convert --to gguf`: our GGUF files read back by our reader, by transformers' GGUF loader and by the gguf library.

Each family's source is a seeded tiny checkpoint written by the project (q/k scaled so attention matters, norm gains
far from their init so Gemma's 1 + γ cannot hide). Truth that does not come from the writer: the source's own
tensors and config, llama.cpp's q/k permutation (test_gguf.llama_cpp_permute, numpy) and tensor names
(gguf.TensorNameMap), transformers' logits on the HF source against its own GGUF loader on our file, the gguf
library's reader, and the source's tokenizer (sentencepiece, tokenizers) encoding the same texts as our GGUF
vocabulary reader. Negative cases show each comparison can fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from llama_tools.checkpoints.gguf import vocabulary as gguf_vocabulary, write as gguf_write  # noqa: E402
from llama_tools.checkpoints.load import read_checkpoint  # noqa: E402
from llama_tools.modeling.config import ModelConfig, RopeScaling  # noqa: E402
from llama_tools.checkpoints.convert import convert, save_checkpoint  # noqa: E402
from llama_tools.modeling.families import FAMILIES, FULL, SLIDING  # noqa: E402
from llama_tools.checkpoints.gguf.read import field_value, open_gguf  # noqa: E402
from llama_tools.checkpoints.gguf.tensors import read_gguf_checkpoint, read_gguf_headers  # noqa: E402
from llama_tools.checkpoints.layouts import permute_rope_rows  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.checkpoints.tokenizer import GgufTokenizer, Tokenizer  # noqa: E402
from llama_tools.modeling.weights import weight_specs  # noqa: E402
from helpers import sharp, train_tiny_tokenizer  # noqa: E402
from test_fast_refusals import probe  # noqa: E402
from test_gguf import llama_cpp_permute  # noqa: E402
from test_hostile import assert_ok, assert_one_line, invoke  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)
GEMMA3_LAYERS = (SLIDING,) * 5 + (FULL,)  # llama.cpp's (and transformers') pattern: 5 local, 1 global
# name: (family, what it adds). Gemma 2/3 keep what transformers' GGUF loader takes from its config defaults rather
# than the file (query_pre_attn_scalar 256, Gemma 2's caps 50/30, the layer patterns, Gemma 3's local base).
CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama": ("llama", dict(rope_theta=5e5)),
    # a window longer than IDS: llama.cpp (and transformers' GGUF loader) attend to every position for 'llama'
    "mistral": ("mistral", dict(sliding_window=16)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),  # q/k/v biases (the family's)
    "qwen3": ("qwen3", dict(rope_theta=1e6, head_dim=128)),  # transformers' Qwen3 GGUF config takes head_dim 128
    "gemma": ("gemma", dict(tie_word_embeddings=True, head_dim=32)),
    "gemma2": ("gemma2", dict(tie_word_embeddings=True, query_pre_attn_scalar=256.0, attn_logit_softcap=50.0,
                              final_logit_softcap=30.0, sliding_window=5, layer_types=(SLIDING, FULL))),
    "gemma3": ("gemma3", dict(tie_word_embeddings=True, num_hidden_layers=6, query_pre_attn_scalar=256.0,
                              sliding_window=5, layer_types=GEMMA3_LAYERS, rope_theta=1e6, rope_local_theta=1e4)),
}
# llama.cpp's general.architecture of each: its converter registers MistralForCausalLM as a LlamaModel
ARCH = {name: {"mistral": "llama"}.get(family, family) for name, (family, _) in CASES.items()}
IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])  # longer than the windows
# Fields a GGUF names differently from the source by design: its name, path, stored row order and file dtype.
IGNORED = ("name", "source", "rope_layout", "torch_dtype")
TEXTS = ["Hello world", " leading space", "two  spaces and\nnew lines\n\n", "digits 12345 and 3.14",
         "unicode: 啊 café naïve ß ∑", "", "tabs\tand trailing  ", "print(x)\n\tif y:"]


def family_config(case: str, **more) -> ModelConfig:
    family, extra = CASES[case]
    return ModelConfig(name=case, family=family, **{**SIZES, **FAMILIES[family].defaults, **extra, **more})


def seeded_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded model's tensors, norm gains moved far from their init (0 for Gemma's 1 + γ, 1 elsewhere)."""
    model = sharp(cfg, seed=seed, qk_scale=10.0)
    g = torch.Generator().manual_seed(seed + 1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, w in state.items():
        if "norm" in name:
            w.copy_(torch.randn(w.shape, generator=g) * 0.3 + (0.5 if cfg.norm_plus_one else 1.0))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.fixture(scope="module", params=list(CASES))
def source(request, tmp_path_factory):
    """(case, a seeded HF checkpoint directory written by save_checkpoint)."""
    d = tmp_path_factory.mktemp(request.param) / "hf"
    cfg = family_config(request.param)
    save_checkpoint(cfg, seeded_state(cfg), d)
    return request.param, d


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """(case, source dir, its GGUF in float32 as convert writes it by default, the ConvertResult)."""
    case, d = source
    out = tmp_path_factory.mktemp(case + "-gguf") / "m.gguf"
    return case, d, out, convert(d, out, to="gguf")


def config_fields(cfg: ModelConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in IGNORED}


def half_rows(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k rows in HF's order, whatever order the reader keeps them in."""
    return permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout, "half")


# --- (1) our own reader: the same config and bit-identical tensors ------------------------------------------

def test_round_trip_reads_back_the_same_config_and_tensors(written):
    case, d, out, res = written
    want_cfg, want = resolve(d).cfg, read_checkpoint(d).state
    got = read_gguf_checkpoint(out)  # float32
    assert res.layout == "gguf" and res.files == ["m.gguf"] and res.tensors == len(want) == len(got.state)
    assert res.params == sum(v.numel() for v in want.values()) and res.bytes == 4 * res.params
    # Mistral reads back as the family of its architecture, llama: the same block, its window kept
    assert config_fields(got.cfg) == config_fields(dataclasses.replace(want_cfg, family=got.cfg.family))
    assert got.cfg.family == ("llama" if case == "mistral" else CASES[case][0])
    assert ("mistral: written as llama.cpp's 'llama'" in " ".join(res.warnings)) == (case == "mistral")
    assert got.cfg.rope_layout == ("interleaved" if ARCH[case] == "llama" else "half")
    state = half_rows(got.cfg, got.state)
    assert set(state) == set(want)
    for name, w in want.items():
        if got.cfg.norm_plus_one and name.endswith("norm.weight"):
            # Gemma's gains are stored as float32(1 + γ): what comes back is that minus 1, exactly
            assert torch.equal(state[name], (w.float() + 1.0) - 1.0), name
        else:
            assert torch.equal(state[name], w.float()), name


def test_bfloat16_round_trip_is_bit_identical(source, tmp_path):
    """--dtype bfloat16: matrices cast to BF16 one at a time, 1-D tensors kept in F32 as the source has them."""
    case, d = source
    res = convert(d, tmp_path / "m.gguf", to="gguf", dtype="bfloat16")
    want = read_checkpoint(d).state
    assert res.bytes == sum(2 * v.numel() if v.dim() > 1 else 4 * v.numel() for v in want.values())
    got = read_gguf_checkpoint(tmp_path / "m.gguf")  # float32
    state = half_rows(got.cfg, got.state)
    for name, w in want.items():
        if w.dim() > 1:
            assert torch.equal(state[name], w.to(torch.bfloat16).float()), name
        elif got.cfg.norm_plus_one and name.endswith("norm.weight"):
            assert torch.equal(state[name], (w + 1.0) - 1.0), name
        else:
            assert torch.equal(state[name], w), name
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert {ty for n, ty in types.items() if n.endswith("norm.weight") or n.endswith(".bias")} == {"F32"}
    assert {ty for n, ty in types.items() if not (n.endswith("norm.weight") or n.endswith(".bias"))} == {"BF16"}


def test_negative_a_wrong_permutation_is_seen(tmp_path, monkeypatch):
    """Negative case: rows written in HF's order under 'llama' (no llama.cpp permutation) do not read back."""
    from llama_tools.checkpoints.gguf import architectures as gguf_architectures

    cfg = family_config("llama")
    state = seeded_state(cfg)
    monkeypatch.setitem(gguf_architectures.ARCHITECTURES, "llama",
                        dataclasses.replace(gguf_architectures.ARCHITECTURES["llama"], rope_layout="half"))
    gguf_write.write_gguf(cfg, state, tmp_path / "m.gguf")
    monkeypatch.undo()
    got = read_gguf_checkpoint(tmp_path / "m.gguf")
    back = half_rows(got.cfg, got.state)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(back[name], state[name])
    assert torch.equal(back["model.layers.0.self_attn.v_proj.weight"], state["model.layers.0.self_attn.v_proj.weight"])


# --- (2) independent readers: the gguf library, transformers ------------------------------------------------

def test_the_gguf_library_reads_every_key_and_tensor_as_llama_cpp_writes_them(written):
    case, d, out, _ = written
    cfg, want = resolve(d).cfg, read_checkpoint(d).state
    arch = ARCH[case]
    reader = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in reader.fields.items()}  # every key, decoded by the library
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    expected = {
        "general.architecture": arch, "general.name": "hf", f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": 128, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": cfg.head_dim, f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.rope.dimension_count": cfg.head_dim, f"{arch}.rope.freq_base": f32(cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(1e-5), f"{arch}.vocab_size": 256,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
    }
    if arch == "gemma2":
        expected.update({f"{arch}.attn_logit_softcapping": 50.0, f"{arch}.final_logit_softcapping": 30.0,
                         f"{arch}.attention.sliding_window": 5})
    if arch == "gemma3":
        expected[f"{arch}.attention.sliding_window"] = 5
    assert {k: fields.get(k) for k in expected} == expected
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)  # llama.cpp's table
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in want}
    for name, w in want.items():
        t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        a = np.asarray(t.data).reshape(w.shape)
        expect = w.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            expect = llama_cpp_permute(expect, cfg.num_attention_heads if ".q_proj." in name else 2)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            expect = expect + np.float32(1)  # llama.cpp's converter stores Gemma's gains as 1 + γ
        np.testing.assert_array_equal(a, expect, err_msg=name)


TRANSFORMERS_GGUF = [c for c in CASES if ARCH[c] != "gemma"]  # its GGUF loader has no 'gemma' architecture


@pytest.mark.parametrize("case", TRANSFORMERS_GGUF)
def test_transformers_gguf_loader_gives_the_sources_logits(case, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = family_config(case)
    save_checkpoint(cfg, seeded_state(cfg), tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "m.gguf", to="gguf")
    load = transformers.AutoModelForCausalLM.from_pretrained
    theirs = load(tmp_path, gguf_file="m.gguf", attn_implementation="eager").eval()
    source = load(tmp_path / "hf", attn_implementation="eager").eval()
    assert theirs.config.tie_word_embeddings == cfg.tie_word_embeddings
    with torch.no_grad():
        want, got = source(IDS).logits, theirs(IDS).logits
    assert want.std() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_negative_transformers_sees_unpermuted_rows(tmp_path, monkeypatch):
    """Negative case: without llama.cpp's permutation, transformers' loader (which undoes it) gives other logits."""
    transformers = pytest.importorskip("transformers")
    from llama_tools.checkpoints.gguf import architectures as gguf_architectures

    cfg = family_config("llama")
    save_checkpoint(cfg, seeded_state(cfg), tmp_path / "hf")
    monkeypatch.setitem(gguf_architectures.ARCHITECTURES, "llama",
                        dataclasses.replace(gguf_architectures.ARCHITECTURES["llama"], rope_layout="half"))
    convert(tmp_path / "hf", tmp_path / "m.gguf", to="gguf")
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        want = load(tmp_path / "hf").eval()(IDS).logits
        got = load(tmp_path, gguf_file="m.gguf").eval()(IDS).logits
    assert (got - want).abs().max() > 1e-2


# --- (3) the vocabulary -----------------------------------------------------------------------------------

def encodes_alike(gguf_path: Path, source_tokenizer: Path) -> None:
    ours, theirs = GgufTokenizer(gguf_path), Tokenizer(source_tokenizer)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text


def tiny_with(tokenizer_files: dict[str, Path | str], d: Path, vocab_size: int, **ids) -> Path:
    """The tiny llama checkpoint with VOCAB_SIZE rows and these tokenizer files beside it."""
    cfg = family_config("llama", vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        head_dim=8, pad_token_id=None, tie_word_embeddings=True, **ids)
    save_checkpoint(cfg, seeded_state(cfg), d)
    for name, what in tokenizer_files.items():
        if isinstance(what, str):
            (d / name).write_text(what, encoding="utf-8")
        else:
            shutil.copyfile(what, d / name)
    return d


def test_sentencepiece_vocabulary_encodes_as_sentencepiece(tmp_path):
    corpus = ["The quick brown fox jumps over the lazy dog. 12345 café"] * 20 + ["hello world " * 5] * 10
    spm = train_tiny_tokenizer(corpus, tmp_path / "spm", vocab_size=300)
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    config = json.dumps({"add_bos_token": True, "add_eos_token": False, "chat_template": template})
    d = tiny_with({"tokenizer.model": spm, "tokenizer_config.json": config}, tmp_path / "src", vocab_size=320)
    res = convert(d, tmp_path / "m.gguf", to="gguf")
    assert res.warnings == []
    encodes_alike(tmp_path / "m.gguf", d / "tokenizer.model")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "m.gguf").fields.items()}
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.chat_template"] == template
    assert fields["tokenizer.ggml.tokens"][:300] == [sp.IdToPiece(i) for i in range(300)]
    assert fields["tokenizer.ggml.tokens"][300:] == [f"[PAD{i}]" for i in range(1, 21)]  # llama.cpp's fillers
    assert fields["tokenizer.ggml.token_type"][300:] == [5] * 20  # UNUSED
    assert fields["tokenizer.ggml.scores"][:300] == [float(np.float32(sp.GetScore(i))) for i in range(300)]
    assert fields["tokenizer.ggml.unknown_token_id"] == 0 and fields["tokenizer.ggml.add_bos_token"] is True


def byte_level_tokenizer_json(pre_tokenizer) -> str:
    """A small trained byte-level BPE tokenizer.json (Llama 3's kind) with two special tokens and a BOS template."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin|>", "<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog, 12345 times! café ß"] * 30 + ["print(x)\n\tif y:"] * 10
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    return tok.to_str()


# Llama 3's split, as its tokenizer.json writes it (independent of tokenizer_files' copy).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_pre():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                             use_regex=False)])


def test_byte_level_vocabulary_encodes_as_tokenizers(tmp_path):
    d = tiny_with({"tokenizer.json": byte_level_tokenizer_json(llama3_pre())}, tmp_path / "src", vocab_size=420,
                  bos_token_id=0, eos_token_id=1)
    res = convert(d, tmp_path / "m.gguf", to="gguf")
    assert res.warnings == []
    encodes_alike(tmp_path / "m.gguf", d / "tokenizer.json")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "m.gguf").fields.items()}
    data = json.loads((d / "tokenizer.json").read_text())
    # Llama 3's split, merges always applied (this trained tokenizer.json has no ignore_merges): llama.cpp's 'smaug-bpe'
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smaug-bpe"
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m
                                              for m in data["model"]["merges"]]
    assert fields["tokenizer.ggml.token_type"][:2] == [3, 3]  # the special tokens: CONTROL
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert GgufTokenizer(tmp_path / "m.gguf").encode("12345")[0] == 0  # BOS, as the template adds it


def test_negative_another_pre_tokenizer_name_encodes_otherwise(tmp_path):
    """Negative case: the same vocabulary under GPT-2's split ('gpt-2') encodes "(x" otherwise than Llama 3's."""
    d = tiny_with({"tokenizer.json": byte_level_tokenizer_json(llama3_pre())}, tmp_path / "src", vocab_size=420,
                  bos_token_id=0, eos_token_id=1)
    cfg = resolve(d).cfg
    vocab, _ = gguf_vocabulary.source_vocabulary(resolve(d), cfg)
    assert vocab is not None and vocab.pre == "smaug-bpe"
    gguf_write.write_gguf(cfg, read_checkpoint(d).state, tmp_path / "m.gguf",
                          vocabulary=dataclasses.replace(vocab, pre="gpt-2"))
    text = "print(x)\n\tif y:"  # Llama 3's split keeps "(x" together, GPT-2's does not
    assert GgufTokenizer(tmp_path / "m.gguf").encode(text) != Tokenizer(d / "tokenizer.json").encode(text)


def test_a_vocabulary_llama_cpp_cannot_name_is_left_out_with_a_warning(tmp_path):
    from tokenizers import pre_tokenizers

    d = tiny_with({"tokenizer.json": byte_level_tokenizer_json(pre_tokenizers.Whitespace())}, tmp_path / "src",
                  vocab_size=420)
    r = invoke(["convert", str(d), str(tmp_path / "m.gguf"), "--to", "gguf"])
    assert_ok(r)
    assert "pre-tokenizer splits as none that llama.cpp names" in r.stderr and "without a vocabulary" in r.stderr
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert "tokenizer.ggml.model" not in fields and fields["tokenizer.ggml.bos_token_id"].contents() == 1


@pytest.mark.parametrize("model, pre", [("smollm2_hf", "smollm"), ("qwen2_hf", "qwen2")])
def test_real_vocabularies_encode_as_their_tokenizer_json(model, pre, request, tmp_path):
    """SmolLM2's and Qwen2.5's own tokenizer.json (49k and 152k tokens) through a narrow model of their vocab size."""
    real = request.getfixturevalue(model)
    vocab_size = resolve(real).cfg.vocab_size
    files = {n: real / n for n in ("tokenizer.json", "tokenizer_config.json") if (real / n).is_file()}
    d = tiny_with(files, tmp_path / "src", vocab_size=vocab_size)
    res = convert(d, tmp_path / "m.gguf", to="gguf")
    assert not [w for w in res.warnings if "vocabulary" in w], res.warnings
    assert field_value(open_gguf(tmp_path / "m.gguf"), "tokenizer.ggml.pre") == pre
    encodes_alike(tmp_path / "m.gguf", d / "tokenizer.json")


def test_gguf_to_gguf_keeps_float16_and_every_field(tmp_path):
    """A GGUF source: its F16 matrices stay F16 (read exactly in fp32), its vocabulary fields are copied as they are."""
    assert_ok(invoke(["convert", "tiny", str(tmp_path / "a.gguf"), "--to", "gguf", "--dtype", "float16"]))
    assert_ok(invoke(["convert", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "--to", "gguf"]))
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    fa = {k: f.contents() for k, f in a.fields.items() if k != "general.name"}
    fb = {k: f.contents() for k, f in b.fields.items() if k != "general.name"}
    assert fa == fb and fa["tokenizer.ggml.model"] == "llama"
    assert [(t.name, t.tensor_type.name, bytes(t.data)) for t in a.tensors] == [
        (t.name, t.tensor_type.name, bytes(t.data)) for t in b.tensors]
    assert {t.tensor_type.name for t in a.tensors if len(t.shape) > 1} == {"F16"}


# --- (4) refusals, and nothing of ours left behind --------------------------------------------------------

def test_a_family_without_a_gguf_architecture_is_one_line_before_torch(tmp_path):
    out = probe("convert", "baichuan-7b", "out.gguf", "--to", "gguf", cwd=tmp_path)
    assert out["code"] == 1 and out["heavy"] == [], out
    line = out["stderr"].strip()
    assert len(line.splitlines()) == 1 and "family 'baichuan'" in line
    assert "llama, qwen2, qwen3, gemma, gemma2, gemma3" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset, family", [("internlm2-20b", "internlm2"), ("tiny", None)])
def test_each_family_is_written_or_refused_by_its_architecture(preset, family, tmp_path):
    r = invoke(["convert", preset, str(tmp_path / "out.gguf"), "--to", "gguf"])
    if family is None:  # negative case: a family with an architecture is written
        assert_ok(r)
        assert (tmp_path / "out.gguf").read_bytes()[:4] == b"GGUF"
        return
    assert_one_line(r, f"family {family!r}", "llama, qwen2, qwen3, gemma, gemma2, gemma3")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_destination_or_the_source_itself_is_refused(tmp_path):
    assert_ok(invoke(["convert", "tiny", str(tmp_path / "m.gguf"), "--to", "gguf"]))
    before = (tmp_path / "m.gguf").read_bytes()
    for dst in ("m.gguf", "other.gguf"):
        (tmp_path / "other.gguf").write_bytes(b"keep")
        r = invoke(["convert", str(tmp_path / "m.gguf"), str(tmp_path / dst), "--to", "gguf"])
        assert_one_line(r, str(tmp_path / dst), "this run reads" if dst == "m.gguf" else "already exists")
    assert (tmp_path / "m.gguf").read_bytes() == before and (tmp_path / "other.gguf").read_bytes() == b"keep"
    assert_one_line(invoke(["convert", "tiny", str(tmp_path / "s.gguf"), "--to", "gguf", "--shards", "2"]),
                    "--shards 2", "one file")
    assert_one_line(invoke(["convert", "tiny", str(tmp_path), "--to", "gguf"]), str(tmp_path), "directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "other.gguf"]


def test_what_a_gguf_cannot_hold_is_one_line(tmp_path):
    """Llama 3's scaling with band parameters no published model has (rope_freqs.weight could not be read back as
    them) and a gain a family's architecture fixes: refused."""
    odd = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    for changes, word in ((dict(rope_scaling=odd), "rope_scaling 'llama3'"),
                          (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_tanh'")):
        from llama_tools.checkpoints.config_files import config_to_hf

        data = {**config_to_hf(family_config("llama")), **changes}
        (tmp_path / "config.json").write_text(json.dumps(data))
        assert_one_line(invoke(["convert", str(tmp_path / "config.json"), str(tmp_path / "x.gguf"), "--to", "gguf"]),
                        word, "--to hf")
    assert not (tmp_path / "x.gguf").exists()


def test_a_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    real = gguf_write._stored

    def failing(*args):
        calls.append(args[0])
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(gguf_write, "_stored", failing)
    with pytest.raises(ValueError, match="no space left"):
        convert("tiny", tmp_path / "out" / "m.gguf", to="gguf")
    assert len(calls) == 5 and list(tmp_path.iterdir()) == []  # no file, no temp, not even the parent made


def test_written_through_a_fifo_and_to_standard_output(tmp_path):
    """A FIFO gets the same bytes as a file (the writer's seeks happen on a temp of ours)."""
    import subprocess
    import sys
    import threading

    assert_ok(invoke(["convert", "tiny", str(tmp_path / "file.gguf"), "--to", "gguf"]))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    t.start()
    assert_ok(invoke(["convert", "tiny", str(fifo), "--to", "gguf"]))
    t.join(timeout=30)
    assert got == [(tmp_path / "file.gguf").read_bytes()]
    r = subprocess.run([sys.executable, "-c", "from llama_tools.cli import main; main()", "convert", "tiny", "-",
                        "--to", "gguf"], capture_output=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout == (tmp_path / "file.gguf").read_bytes(), r.stderr[-500:]
    assert b"gguf" in r.stderr  # the summary table went to stderr, not into the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file.gguf"]


# --- a fuzz run: any config the writer accepts reads back as itself ----------------------------------------

FUZZ = settings(max_examples=int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "12")), deadline=10000,
                derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def configs(draw) -> tuple[ModelConfig, str | None]:
    """A small config of a family with a GGUF architecture, its optional parts drawn, and a --dtype."""
    family = draw(st.sampled_from(sorted(gguf_write.ARCH_OF_FAMILY)))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(1, 4))
    extra: dict = dict(FAMILIES[family].defaults)
    window = draw(st.none() | st.integers(1, 64))  # on any architecture: the reader honours what is written
    extra.update(sliding_window=window, rope_local_theta=draw(st.sampled_from([None, 1e4, 1e5])),
                 layer_types=None if window is None or draw(st.booleans()) else tuple(
                     draw(st.sampled_from([SLIDING, FULL])) for _ in range(layers)))
    if family in ("gemma2", "gemma3"):
        extra.update(query_pre_attn_scalar=draw(st.sampled_from([None, 16.0, 64.0, 256.0])),
                     attn_logit_softcap=draw(st.sampled_from([None, 50.0])),
                     final_logit_softcap=draw(st.sampled_from([None, 30.0])))
    if family == "llama":
        extra.update(o_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    if family == "granite":
        extra.update(embedding_multiplier=draw(st.sampled_from([1.0, 12.0])),
                     residual_multiplier=draw(st.sampled_from([1.0, 0.22])),
                     attention_multiplier=draw(st.sampled_from([None, 0.0078125])),
                     logits_scaling=draw(st.sampled_from([1.0, 16.0])))
    if family == "smollm3":  # llama.cpp's own rule: every 4th layer without RoPE
        rotates = tuple((j + 1) % 4 != 0 for j in range(layers))
        extra.update(rope_layers=None if all(rotates) else rotates)
    if family in ("mixtral", "qwen3_moe"):  # stacked ffn_*_exps: Mixtral written as llama.cpp's 'llama' with experts
        experts = draw(st.integers(1, 4))
        extra.update(num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)))
        if family == "qwen3_moe":  # experts of their own width (qwen3moe.expert_feed_forward_length)
            extra.update(moe_intermediate_size=draw(st.integers(1, 48)))
    if family == "gpt_neox":  # llama.cpp's gptneox: every bias, parallel or not, partial rotary
        extra.update(qkv_bias=True, o_bias=True, parallel_residual=draw(st.booleans()),
                     rotary_dim=draw(st.sampled_from([0, 4])))
    if family == "falcon":  # llama.cpp's falcon: parallel, one norm or two (attn_norm_2), no biases
        extra.update(parallel_residual=True, shared_norm=draw(st.booleans()))
    cfg = ModelConfig(
        name="fuzz", family=family, vocab_size=draw(st.integers(8, 64)), hidden_size=16 * heads,
        intermediate_size=draw(st.integers(1, 48)), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=draw(st.sampled_from([0, 8, 16])),
        rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])), rope_theta=draw(st.sampled_from([1e4, 5e5, 1e6])),
        tie_word_embeddings=draw(st.booleans()), pad_token_id=draw(st.none() | st.integers(0, 7)),
        rope_scaling=draw(st.sampled_from([None, RopeScaling("linear", 2.0, original_max_position_embeddings=64)])),
        max_position_embeddings=draw(st.integers(1, 4096)), **extra)
    if family == "gpt_neox":  # llama.cpp's gptneox loads its own output.weight
        cfg = cfg.replace(tie_word_embeddings=False)
    return cfg, draw(st.sampled_from([None, "float16", "bfloat16"]))


@FUZZ
@given(drawn=configs(), seed=st.integers(0, 2**31))
def test_fuzzed_configs_read_back_as_themselves(drawn, seed, tmp_path_factory):
    cfg, dtype = drawn
    g = torch.Generator().manual_seed(seed)
    state = {s.name: torch.randn(s.shape, generator=g) for s in weight_specs(cfg)}
    out = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    written = gguf_write.write_gguf(cfg, state, out, dtype=dtype)
    got = read_gguf_checkpoint(out)
    headers = read_gguf_headers(out)
    assert headers.cfg == got.cfg
    want = config_fields(cfg)
    if cfg.family == "mistral":  # written as 'llama', as llama.cpp's converter does: read back as a llama, said so
        want["family"] = "llama"
        assert any(w.startswith("mistral: written as llama.cpp's 'llama'") for w in written.warnings)
    if cfg.family in ("gemma2", "gemma3") and cfg.query_pre_attn_scalar is None:
        want["query_pre_attn_scalar"] = got.cfg.query_pre_attn_scalar  # None: n6, which the reader names
        assert got.cfg.attention_scale == cfg.attention_scale
    if cfg.family == "gemma3" and cfg.rope_local_theta is None:
        want["rope_local_theta"] = cfg.rope_theta  # None: the global base, which the file names
        assert got.cfg.rope_local_theta == cfg.rope_theta
    if cfg.layer_types is None and got.cfg.layer_types is not None:  # None: the window on every layer, said so
        want["layer_types"] = got.cfg.layer_types
        assert cfg.sliding_window is not None and set(got.cfg.layer_types) == {SLIDING}
    assert config_fields(got.cfg) == want, written.warnings
    back = half_rows(got.cfg, got.state)
    for name, w in state.items():
        cast = w.to(dtypes_of(dtype)) if w.dim() > 1 and dtype else w
        expect = (cast.float() + 1.0) - 1.0 if cfg.norm_plus_one and name.endswith("norm.weight") else cast.float()
        assert torch.equal(back[name], expect), name


def dtypes_of(name: str | None) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name or "", torch.float32)
