"""llama.cpp itself (llama-cpp-python) loads every GGUF `convert --to gguf` writes and computes what transformers does.

The sources are tiny seeded checkpoints built and saved by transformers itself (AutoConfig.for_model ->
save_pretrained: the config layout transformers 4.x writes), their weights moved off their initial values (norm gains,
biases, q/k scaled so attention is far from uniform), a small trained tokenizer beside each. Truth is independent of
our writer: transformers' logits of the source (AutoModelForCausalLM, eager attention, float32), its greedy tokens, and
transformers' (or sentencepiece's) tokenization. For each family the CLI writes and each matrix dtype (F32, F16, BF16)
llama.cpp's logits on transformers' token ids are compared by relative RMS (the RMS of the difference over the
spread of transformers' logits); vocabularies (a sentencepiece model, SmolLM2's real byte-level tokenizer.json, Gemma
saved as tokenizer.json alone) by llama.cpp's tokenization; every pre-tokenizer name we read or write against
llama.cpp's own handling of it. Negative cases (a wrong RoPE base, Gemma's gains without the 1, a layer pattern left
out, scores without the merge order, another pre-tokenizer name) show each comparison fails when it should.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

from llama_tools.checkpoints.gguf import architectures as gguf_architectures  # noqa: E402
from llama_tools.checkpoints.gguf import vocabulary as gguf_vocabulary, write as gguf_write  # noqa: E402
from llama_tools.checkpoints.load import read_checkpoint  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.checkpoints.tokenizer import GgufTokenizer  # noqa: E402
from llama_tools.checkpoints.tokenizer_files import LEGACY_PRE, PRE_TOKENIZERS, WRITTEN_PRE  # noqa: E402
from llama_tools.modeling.families import FULL, SLIDING  # noqa: E402
from test_gguf_out import tiny_with  # noqa: E402
from test_hostile import assert_ok, invoke  # noqa: E402

CORPUS = ["The quick brown fox jumps over the lazy dog, 12345 times! café naïve ß 東京",
          "hello world, hello there!\n\tif x:  return y", "print(x)\n\tif y: return 3.14 and 1000000",
          "She sells sea shells by the sea shore; they're ours, I'VE seen them.",
          "In 1969, 600 million people watched the landing; it's 2024 now and we've 128 GB.",
          "def tokenize(text):\n    return [t for t in text.split()  if t]\n\n",
          "Whereas recognition of the inherent dignity and of the equal and inalienable rights",
          "    indented    by four   spaces,\ttabbed\t\tand\n\n\nnewlines", "UPPER lower MiXeD 'QUOTED' \"double\"",
          "ünïcödé — em dash … ellipsis « guillemets » 你好世界 こんにちは"] * 20
# Digits (one by one, in threes, whole runs), contractions in either case, runs of spaces and newlines, tabs,
# unicode: the splits llama.cpp names differ on these.
TEXTS = ["Hello world", " leading space", "two  spaces and\nnew lines\n\n", "digits 12345 and 3.14 or 1000000",
         "unicode: 東京 café naïve ß ∑", "", "tabs\tand trailing  ", "print(x)\n\tif y:",
         "She sells sea shells; they're ours. I'VE SEEN 'EM", "a qzx and qzxqzx",
         "Hello, world!!! (x) [y] {z}: http://example.com/a?b=c&d=e $100 + 5% = ~^|"]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, max_position_embeddings=512, vocab_size=640)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16)  # llama.cpp's Gemma 2/3 scale queries by n6 below 27B
# case: (transformers model_type, config fields, tokenizer kind). Every optional part of a family is on: Llama's biases
# and Llama 3 scaling (rope_freqs.weight), Mistral's linear scaling, Mixtral's experts, Qwen's biases and q/k norms,
# Gemma 2's caps and alternating window, Gemma 3's window and a local RoPE base other than the global one (4.x layout:
# rope_theta and rope_local_base_freq at the top level) on a layer pattern that is not llama.cpp's default.
CASES = {
    "llama": ("llama", dict(rope_theta=5e5, attention_bias=True, mlp_bias=True, max_position_embeddings=16384,
                            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8192)), "spm"),
    "mistral": ("mistral", dict(rope_theta=1e6, sliding_window=None, rope_scaling=dict(rope_type="linear",
                                                                                       factor=4.0)), "spm"),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "spm"),
    "qwen2": ("qwen2", dict(rope_theta=1e6), "bpe"),
    "qwen3": ("qwen3", dict(rope_theta=1e6, head_dim=16, tie_word_embeddings=True), "bpe"),
    "gemma": ("gemma", dict(GEMMA, hidden_activation="gelu_pytorch_tanh"), "gemma"),
    "gemma2": ("gemma2", dict(GEMMA, sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               "gemma"),
    "gemma3": ("gemma3_text", dict(GEMMA, sliding_window=16, layer_types=[SLIDING, FULL],
                                   rope_theta=1e6, rope_local_base_freq=1e4), "gemma"),
    # Granite's four multipliers off 1; SmolLM3 deep enough that its 4th layer goes without RoPE (llama.cpp's rule)
    "granite": ("granite", dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=0.5, rope_theta=1e4), "bpe"),
    "smollm3": ("smollm3", dict(rope_theta=1e5, num_hidden_layers=4, tie_word_embeddings=False), "bpe"),
    "olmo2": ("olmo2", dict(rope_theta=5e5), "bpe"),
    "phi3": ("phi3", dict(rope_theta=1e4, sliding_window=None), "bpe"),  # llama.cpp's phi3 applies no window
}
DTYPES = {"F32": None, "F16": "float16", "BF16": "bfloat16"}
TORCH = {"F16": torch.float16, "BF16": torch.bfloat16}
N = 192  # positions compared: past Gemma's window of 16, where RoPE's base moves every score
# Measured (relative RMS; these seeds, 192 positions):
#          llama    mistral  mixtral  qwen2    qwen3    gemma    gemma2   gemma3
#   F32    1.7e-7   4.1e-7   3.9e-7   3.1e-7   1.8e-7   4.7e-7   9.5e-5   1.1e-4
#   F16    2.8e-4   6.5e-4   6.2e-4   4.6e-4   3.6e-4   3.4e-4   5.0e-4   7.4e-4
#   BF16   2.3e-3   5.4e-3   7.4e-3   3.6e-3   2.8e-3   2.7e-3   3.9e-3   5.9e-3
# F32: llama.cpp computes in float32 as transformers does. Gemma 2/3 stand apart because of ggml's CPU GELU, which
# reads its input and writes its output through an FP16 table (GGML_GELU_FP16), and their norms after the FFN give
# its output weight: rounding transformers' GELU the same way brings them to 2.2e-6 and 9.9e-6.
F32_BOUND = 1e-5
F32_GELU_BOUND = 1e-3
# F16 / BF16: the matrices are rounded to 11 / 8 significant bits, and ggml's CPU matmul rounds the activations to
# the same type (its vec_dot type): llama.cpp computes as a half-precision run does. So the bound is what transformers
# itself gets running the same source in that dtype (model.to(float16 / bfloat16)): F16 6.2e-4 to 1.4e-3, BF16
# 3.9e-3 to 1.2e-2 here; llama.cpp's error is 0.45 to 0.7 of it in every case.
STEPS = 4  # greedy tokens compared


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    """RMS of the difference over the spread (standard deviation) of the reference logits."""
    return float(np.sqrt(np.mean((got - want) ** 2)) / want.std())


# --- Sources: a tokenizer and a seeded checkpoint, both saved by transformers -------------------------------------

def _sentencepiece(path: Path, gemma: bool) -> Path:
    """A small BPE sentencepiece model with byte fallback: LLaMA's ids and dummy prefix, or Gemma's (pad 0, eos 1,
    bos 2, unk 3, no prefix)."""
    import sentencepiece as spm

    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=600, byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, minloglevel=2, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=not gemma,
        allow_whitespace_only_pieces=True, **ids)
    path.write_bytes(model.getvalue())
    return path


def _split(name: str):
    """SmolLM2's split (digits alone, then GPT-2's) or Llama 3's, as their tokenizer.json write them."""
    from tokenizers import Regex, pre_tokenizers

    from test_gguf_out import LLAMA3_REGEX

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)] if name == "llama3" else
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])


def _byte_level(split: str = "smollm", ignore_merges: bool = False, across: bool = False) -> str:
    """A small trained byte-level BPE tokenizer.json under SPLIT, with "Ġqzx" added to its vocabulary but to no merge
    (a word only ignore_merges keeps whole). ACROSS: trained on unsplit lines, so its merges join what splits part
    (digits, spaces, punctuation and letters): each split then tokenizes the texts its own way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False) if across else _split(split)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.pre_tokenizer = _split(split)
    data = json.loads(tok.to_str())
    data["model"]["vocab"]["Ġqzx"] = len(data["model"]["vocab"])
    data["model"]["ignore_merges"] = ignore_merges
    return json.dumps(data)


PLAIN = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})  # transformers: tokenizer.json as it is


def _tokenizer_files(kind: str, d: Path) -> Path:
    """Tokenizer files as transformers saves them into D: 'spm' (LlamaTokenizer), 'gemma' (GemmaTokenizerFast, its
    tokenizer.json and tokenizer.model), 'bpe' (a byte-level tokenizer.json)."""
    d.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        from tokenizers import Tokenizer

        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_byte_level()),
                                                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                                                   unk_token="<|endoftext|>")
    else:
        model = _sentencepiece(d / "tokenizer.model", gemma=kind == "gemma")
        cls = transformers.GemmaTokenizerFast if kind == "gemma" else transformers.LlamaTokenizer
        tok = cls(vocab_file=str(model))
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    """kind -> a folder of its tokenizer files (made once; copied beside each checkpoint)."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: _tokenizer_files(kind, root / kind) for kind in ("spm", "gemma", "bpe")}


def _perturbed(model) -> None:
    """Weights off their init: norm gains (q/k norms large enough to sharpen attention), biases, q/k scaled, and the
    output rows scaled so the logits spread as a trained model's do (N(0, 0.02) rows give a spread of 0.2)."""
    gemma = model.config.model_type.startswith("gemma")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                if "q_norm" in name or "k_norm" in name:  # they set the scores' scale (Qwen 3, Gemma 3)
                    centre = 1.5 if gemma else 2.5
                else:
                    centre = 0.0 if gemma else 1.0  # Gemma keeps γ of its 1 + γ
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + centre)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif ".q_proj." in name or ".k_proj." in name:
                p.mul_(8.0)


def hf_source(case: str, d: Path, tokenizers: dict[str, Path], **changes):
    """CASE's seeded checkpoint saved by transformers into D, its tokenizer beside it: (the eval model, tokenizer)."""
    model_type, fields, kind = CASES[case]
    shutil.copytree(tokenizers[kind], d)
    tok = transformers.AutoTokenizer.from_pretrained(d, use_fast=kind != "spm")  # spm: sentencepiece itself
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **ids, **fields, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _perturbed(model)
    model.save_pretrained(d)
    return model.eval(), tok


@dataclasses.dataclass
class Source:
    case: str
    path: Path
    ids: list[int]  # transformers' tokenization of the corpus, N of them
    logits: np.ndarray  # transformers' float32 logits on `ids` [N, vocab]
    half_errors: dict[str, float]  # dtype -> transformers' own relative RMS computing the source in it
    greedy: list[int]  # transformers' greedy continuation of ids[:24]


def reference(case: str, d: Path, tokenizers: dict[str, Path], *, full: bool = False, **changes) -> Source:
    """CASE's source saved into D (config CHANGES on top) and transformers' logits on its tokenization of the corpus;
    FULL: also its own F16/BF16 errors and greedy tokens."""
    model, tok = hf_source(case, d, tokenizers, **changes)
    ids = tok(" ".join(CORPUS)).input_ids[:N]
    assert len(ids) == N
    half, greedy = {}, []
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double().numpy()
        if full:
            half = {name: rel_rms(copy.deepcopy(model).to(t)(torch.tensor([ids])).logits[0].double().numpy(), want)
                    for name, t in TORCH.items()}
            greedy = model.generate(torch.tensor([ids[:24]]), do_sample=False, max_new_tokens=STEPS,
                                    min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
    assert want.std() > 0.5  # logits that vary as a trained model's: a wrong norm or RoPE base moves them far
    return Source(case, d, ids, want, half, greedy)


@pytest.fixture(scope="module", params=list(CASES))
def source(request, tmp_path_factory, tokenizers_dir) -> Source:
    return reference(request.param, tmp_path_factory.mktemp(request.param) / "hf", tokenizers_dir, full=True)


def to_gguf(src: Path, out: Path, dtype: str | None = None) -> str:
    """`llama-tools convert SRC OUT --to gguf [--dtype]` through the CLI; its stderr (the summary and warnings)."""
    r = invoke(["convert", str(src), str(out), "--to", "gguf"] + (["--dtype", dtype] if dtype else []))
    assert_ok(r)
    return r.stderr


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def llama(path: Path, **kw) -> "llama_cpp.Llama":
    """llama.cpp on PATH: every position's logits kept, the KV cache in F32 (its default F16 would round K and V),
    no flash attention (on CPU it rounds scores through F16)."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
                           flash_attn=False, type_k=0, type_v=0, n_threads=2, verbose=False, **kw)


def llama_logits(path: Path, ids: list[int], **kw) -> np.ndarray:
    llm = llama(path, **kw)
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], dtype=np.float64)


def llama_greedy(llm, prompt: list[int], steps: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


# --- (1) every family and dtype: llama.cpp's logits and greedy tokens are transformers' ------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_llama_cpp_computes_what_transformers_computes(source, dtype, tmp_path):
    stderr = to_gguf(source.path, tmp_path / "m.gguf", DTYPES[dtype])
    said = [w for w in warnings_of(stderr) if "written as llama.cpp's 'llama'" not in w]  # Mistral, Mixtral: expected
    assert said == [], said
    llm = llama(tmp_path / "m.gguf")
    llm.eval(source.ids)
    got = np.asarray(llm.scores[:N], dtype=np.float64)
    err = rel_rms(got, source.logits)
    gelu = source.case.startswith("gemma")
    bound = (F32_GELU_BOUND if gelu else F32_BOUND) if dtype == "F32" else source.half_errors[dtype]
    assert err <= bound, f"{source.case} {dtype}: relative RMS {err:.2e} > {bound:.2e}"
    assert llama_greedy(llm, source.ids[:24], STEPS) == source.greedy


def test_what_llama_cpp_reads_of_the_vocabulary(source, tmp_path):
    """BOS/EOS ids, the chat template, and llama.cpp's tokenization of the corpus equal transformers' ids."""
    to_gguf(source.path, tmp_path / "m.gguf")
    tok = transformers.AutoTokenizer.from_pretrained(source.path, use_fast=CASES[source.case][2] != "spm")
    llm = llama(tmp_path / "m.gguf", vocab_only=True)
    assert (llm.token_bos(), llm.token_eos()) == (tok.bos_token_id, tok.eos_token_id)
    assert llm.metadata["tokenizer.chat_template"] == tok.chat_template
    assert llm.tokenize(" ".join(CORPUS).encode(), add_bos=True, special=False)[:N] == source.ids


# --- (2) negative cases: the comparison sees a wrong file -------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizers_dir) -> tuple[Path, Source]:
    """Gemma 3's source and its F32 GGUF."""
    d = tmp_path_factory.mktemp("gemma3-negative")
    src = reference("gemma3", d / "hf", tokenizers_dir)
    to_gguf(src.path, d / "m.gguf")
    return d / "m.gguf", src


@pytest.mark.parametrize("key, value", [("gemma3.rope.freq_base", 1e4), ("gemma3.rope.freq_base_swa", 1e6)])
def test_negative_a_wrong_rope_base_is_seen(gemma3, key, value):
    """The same file with its global or local base swapped for the other (llama.cpp's kv_overrides): errors of
    order 1, where the file as written is within F32_GELU_BOUND."""
    path, src = gemma3
    assert rel_rms(llama_logits(path, src.ids), src.logits) <= F32_GELU_BOUND
    assert rel_rms(llama_logits(path, src.ids, kv_overrides={key: value}), src.logits) > 0.05  # 0.30, 0.26


def test_negative_gemma_gains_without_the_one_are_seen(tmp_path, tokenizers_dir, monkeypatch):
    """Gemma's norms written as γ, not llama.cpp's 1 + γ."""
    src = reference("gemma", tmp_path / "hf", tokenizers_dir)
    monkeypatch.setitem(gguf_architectures.ARCHITECTURES, "gemma", dataclasses.replace(
        gguf_architectures.ARCHITECTURES["gemma"], gains_plus_one=False))
    to_gguf(src.path, tmp_path / "m.gguf")
    assert rel_rms(llama_logits(tmp_path / "m.gguf", src.ids), src.logits) > 0.05  # 0.96


def test_negative_gemma3_without_its_layer_pattern(gemma3, tmp_path, monkeypatch):
    """Gemma 3's pattern (local, global) left out: llama.cpp then makes both layers local (its 5-to-1 default), so
    the pattern the file writes is what llama.cpp reads."""
    path, src = gemma3
    monkeypatch.setattr(gguf_write, "_layer_rule", lambda a, layers: (SLIDING, FULL))  # "the rule": not written
    to_gguf(src.path, tmp_path / "m.gguf")
    assert rel_rms(llama_logits(tmp_path / "m.gguf", src.ids), src.logits) > 0.05  # 0.32


def test_gemma2_without_soft_caps_is_said_and_differs(tmp_path, tokenizers_dir):
    """A Gemma 2 config that caps nothing: llama.cpp's gemma2 caps at 50 and 30 whatever the file says (0 would
    divide by zero), so the writer says so, and llama.cpp's logits are indeed not transformers'."""
    src = reference("gemma2", tmp_path / "hf", tokenizers_dir, attn_logit_softcapping=None,
                    final_logit_softcapping=None)
    said = warnings_of(to_gguf(src.path, tmp_path / "m.gguf"))
    assert [w.split(";")[0] for w in said] == ["warning: gemma2: the config soft-caps no attention scores",
                                               "warning: gemma2: the config soft-caps no logits"], said
    assert rel_rms(llama_logits(tmp_path / "m.gguf", src.ids), src.logits) > 10 * F32_GELU_BOUND  # 4.9e-2


# --- (3) vocabularies: llama.cpp tokenizes as transformers does ------------------------------------------------

def tokenizes_alike(gguf: Path, tok, texts=TEXTS, special: bool = False) -> list[str]:
    """The texts llama.cpp tokenizes otherwise than TOK (BOS/EOS as each adds them)."""
    llm = llama(gguf, vocab_only=True)
    return [t for t in texts if llm.tokenize(t.encode(), add_bos=True, special=special) != tok(t).input_ids]


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path, tokenizers_dir):
    d = tiny_with({n.name: n for n in tokenizers_dir["spm"].iterdir()}, tmp_path / "src", vocab_size=640)
    assert warnings_of(to_gguf(d, tmp_path / "m.gguf")) == []
    assert tokenizes_alike(tmp_path / "m.gguf", transformers.AutoTokenizer.from_pretrained(d, use_fast=False)) == []


def test_smollm2_vocabulary_tokenizes_as_its_tokenizer_json(smollm2_hf, tmp_path):
    """SmolLM2's real byte-level tokenizer.json (49,152 tokens): llama.cpp's 'smollm', specials parsed as transformers
    parses them; negative case: the same vocabulary under llama.cpp's 'default' split (punctuation runs apart first)
    tokenizes otherwise. (Its merges never cross GPT-2's split, so GPT-2's, Llama 3's and Qwen2's give its tokens.)"""
    files = {n: smollm2_hf / n for n in ("tokenizer.json", "tokenizer_config.json")}
    d = tiny_with(files, tmp_path / "src", vocab_size=49152)
    assert warnings_of(to_gguf(d, tmp_path / "m.gguf")) == []
    tok = transformers.AutoTokenizer.from_pretrained(d)
    texts = TEXTS + ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "emoji 🦙🚀 👍🏽!"]
    assert tokenizes_alike(tmp_path / "m.gguf", tok, texts, special=True) == []
    cfg = resolve(d).cfg
    vocab, _ = gguf_vocabulary.source_vocabulary(resolve(d), cfg)
    assert vocab is not None and vocab.pre == "smollm"
    gguf_write.write_gguf(cfg, read_checkpoint(d).state, tmp_path / "default.gguf",
                          vocabulary=dataclasses.replace(vocab, pre="default"))
    assert tokenizes_alike(tmp_path / "default.gguf", tok, texts, special=True) != []


@pytest.mark.parametrize("kind", ["gemma", "llama2"])
def test_sentencepiece_tokenizer_json_alone(kind, tmp_path, tokenizers_dir):
    """A sentencepiece-style tokenizer.json with no tokenizer.model beside it: Gemma's as transformers saves it (spaces
    as "▁", no prefix; transformers 5 writes it alone), and Llama 2's layout ("▁" before the text too, as
    tokenizer_files.sentencepiece_files writes it). Written as llama.cpp's 'llama' vocabulary, tokenized as
    transformers tokenizes; negative case: one score for every token (what llama.cpp's own LlamaHfVocab writes)
    merges in another order."""
    from llama_tools.checkpoints.tokenizer_files import sentencepiece_files

    if kind == "gemma":
        files = {n.name: n for n in tokenizers_dir["gemma"].iterdir() if n.name != "tokenizer.model"}
        ids = dict(bos_token_id=2, eos_token_id=1)
    else:
        files = {**sentencepiece_files(tokenizers_dir["spm"] / "tokenizer.model"), "tokenizer_config.json": PLAIN}
        ids = {}
    d = tiny_with(files, tmp_path / "src", vocab_size=640, **ids)
    assert warnings_of(to_gguf(d, tmp_path / "m.gguf")) == []
    tok = transformers.AutoTokenizer.from_pretrained(d)
    texts = TEXTS + [" ".join(CORPUS)]
    if kind == "llama2":  # the file is sentencepiece's own tokenization (so its "▁" prefix is there to be lost)
        spm = transformers.LlamaTokenizer(vocab_file=str(tokenizers_dir["spm"] / "tokenizer.model"))
        assert [tok(t).input_ids for t in texts] == [spm(t).input_ids for t in texts]
    llm = llama(tmp_path / "m.gguf", vocab_only=True)
    assert llm.metadata["tokenizer.ggml.model"] == "llama"
    assert llm.metadata["tokenizer.ggml.add_space_prefix"] == ("true" if kind == "llama2" else "false")
    assert tokenizes_alike(tmp_path / "m.gguf", tok, texts) == []
    cfg = resolve(d).cfg
    vocab, _ = gguf_vocabulary.source_vocabulary(resolve(d), cfg)
    assert vocab is not None and vocab.model == "llama"
    gguf_write.write_gguf(cfg, read_checkpoint(d).state, tmp_path / "flat.gguf",
                          vocabulary=dataclasses.replace(vocab, scores=[-1000.0] * len(vocab.tokens)))
    assert tokenizes_alike(tmp_path / "flat.gguf", tok, texts) != []


def test_a_gguf_without_a_vocabulary_is_never_written_silently(tmp_path):
    """No tokenizer beside a checkpoint: the warning says the GGUF has no vocabulary, which llama.cpp refuses to load
    without; a GGUF source without one says so too (the vocabulary it would copy)."""
    d = tiny_with({}, tmp_path / "src", vocab_size=640)
    said = warnings_of(to_gguf(d, tmp_path / "a.gguf"))
    assert len(said) == 1 and "no tokenizer beside it" in said[0] and "without a vocabulary" in said[0], said
    with pytest.raises(ValueError):
        llama(tmp_path / "a.gguf", vocab_only=True)
    source = resolve(tmp_path / "a.gguf")
    vocab, said = gguf_vocabulary.source_vocabulary(source, source.cfg)
    assert vocab is not None and said == [f"{tmp_path / 'a.gguf'}: holds no vocabulary (tokenizer.ggml.tokens); the "
                                          f"GGUF is written without one, which llama.cpp needs to run it"]


def test_a_tokenizer_json_llama_cpp_cannot_say_leaves_a_warning(tmp_path, tokenizers_dir):
    """A sentencepiece-style tokenizer.json whose normalizer llama.cpp's 'llama' has no form for: the GGUF is written
    without a vocabulary, said in one warning naming the file (never silently)."""
    data = json.loads((tokenizers_dir["gemma"] / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFKC"}
    d = tiny_with({"tokenizer.json": json.dumps(data), "tokenizer_config.json": PLAIN}, tmp_path / "src",
                  vocab_size=640)
    said = warnings_of(to_gguf(d, tmp_path / "m.gguf"))
    assert len(said) == 1 and str(d / "tokenizer.json") in said[0] and "without a vocabulary" in said[0], said


@pytest.mark.parametrize("ignore_merges", [True, False])
def test_llama3_split_with_and_without_ignore_merges(ignore_merges, tmp_path):
    """Llama 3's split is llama.cpp's 'llama-bpe' with ignore_merges (a word that is a token stays one) and
    'smaug-bpe' without: each tokenizes " qzx" (a token no merge makes) as transformers does; the other name not."""
    d = tiny_with({"tokenizer.json": _byte_level("llama3", ignore_merges), "tokenizer_config.json": PLAIN},
                  tmp_path / "src", vocab_size=640)
    assert warnings_of(to_gguf(d, tmp_path / "m.gguf")) == []
    tok = transformers.AutoTokenizer.from_pretrained(d)
    cfg = resolve(d).cfg
    vocab, _ = gguf_vocabulary.source_vocabulary(resolve(d), cfg)
    assert vocab is not None and vocab.pre == ("llama-bpe" if ignore_merges else "smaug-bpe")
    assert tokenizes_alike(tmp_path / "m.gguf", tok) == []
    assert len(tok(" qzx").input_ids) == (1 if ignore_merges else 4)
    gguf_write.write_gguf(cfg, read_checkpoint(d).state, tmp_path / "other.gguf", vocabulary=dataclasses.replace(
        vocab, pre="smaug-bpe" if ignore_merges else "llama-bpe"))
    assert "a qzx and qzxqzx" in tokenizes_alike(tmp_path / "other.gguf", tok)


@pytest.fixture(scope="module")
def byte_level_source(tmp_path_factory) -> tuple[Path, gguf_vocabulary.Vocabulary]:
    """A tiny model and a byte-level vocabulary whose merges cross every split (trained on unsplit lines)."""
    d = tiny_with({"tokenizer.json": _byte_level(across=True), "tokenizer_config.json": PLAIN},
                  tmp_path_factory.mktemp("bl") / "s", vocab_size=640)
    vocab, _ = gguf_vocabulary.source_vocabulary(resolve(d), resolve(d).cfg)
    assert vocab is not None
    return d, vocab


def _with_pre(d: Path, vocab: gguf_vocabulary.Vocabulary, pre: str, out: Path) -> Path:
    """D's tiny model as a GGUF at OUT, its vocabulary VOCAB under tokenizer.ggml.pre PRE."""
    gguf_write.write_gguf(resolve(d).cfg, read_checkpoint(d).state, out, vocabulary=dataclasses.replace(vocab, pre=pre))
    return out


@pytest.mark.parametrize("pre", sorted(set(PRE_TOKENIZERS) - set(LEGACY_PRE)))
def test_every_pre_tokenizer_name_we_read_is_llama_cpps(pre, byte_level_source, tmp_path):
    """Each name our GGUF reader accepts: llama.cpp loads it and tokenizes as our reader's tokenizer.json does, BOS
    added or not by the same default (the vocabulary is written without tokenizer.ggml.add_bos_token)."""
    d, vocab = byte_level_source
    path = _with_pre(d, dataclasses.replace(vocab, add_bos=None), pre, tmp_path / "m.gguf")
    ours = GgufTokenizer(path)
    llm = llama(path, vocab_only=True)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ours.encode(text), (pre, text)


def test_the_texts_tell_every_entry_apart(byte_level_source, tmp_path):
    """Negative case for the test above: under each distinct entry of the table (split, ignore_merges, BOS default)
    llama.cpp tokenizes the texts differently, so a name read as another entry would be seen."""
    d, vocab = byte_level_source
    first = {}  # entry -> the first name of it
    for name, entry in PRE_TOKENIZERS.items():
        first.setdefault(entry, name)
    seen = set()
    for entry, pre in first.items():
        llm = llama(_with_pre(d, dataclasses.replace(vocab, add_bos=None), pre, tmp_path / f"{pre}.gguf"),
                    vocab_only=True)
        seen.add(tuple(tuple(llm.tokenize(t.encode(), add_bos=True, special=False)) for t in TEXTS))
    assert len(first) == 7 and len(seen) == len(first), sorted(first.values())


@pytest.mark.parametrize("pre", list(LEGACY_PRE))
def test_names_we_wrote_before_are_read_and_renamed(pre, byte_level_source, tmp_path):
    """'gpt2' and 'minerva' (what we wrote and read before): llama.cpp refuses them; we still read them, and
    `convert OLD.gguf NEW.gguf --to gguf` writes llama.cpp's name, which it loads and tokenizes as we read the old."""
    d, vocab = byte_level_source
    old = _with_pre(d, vocab, pre, tmp_path / "old.gguf")
    with pytest.raises(ValueError):
        llama(old, vocab_only=True)
    to_gguf(old, tmp_path / "new.gguf")
    llm = llama(tmp_path / "new.gguf", vocab_only=True)
    assert llm.metadata["tokenizer.ggml.pre"] == LEGACY_PRE[pre] and pre not in WRITTEN_PRE
    ours = GgufTokenizer(old)
    assert [llm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
