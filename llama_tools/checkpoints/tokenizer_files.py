"""Tokenizer files built from what a checkpoint holds, with HF's `tokenizers` (never a hand-written BPE).

- `tokenizer_json_from_gguf`: a GGUF vocabulary (tokenizer.ggml.*) -> tokenizer.json, tokenizer_config.json and
  special_tokens_map.json. Two kinds, as llama.cpp names them in tokenizer.ggml.model: "gpt2" (byte-level BPE:
  tokens + merges, the pre-tokenizer named by tokenizer.ggml.pre) and "llama" (SentencePiece BPE: tokens +
  scores + token types, byte fallback, "▁" for spaces).
- `sentencepiece_files`: the same SentencePiece layout from a `tokenizer.model`, for clients (onnxruntime-genai,
  Optimum) that only read tokenizer.json.
- `loadable_tokenizer_config`: a copied tokenizer_config.json rewritten so transformers 4.x and 5.x both load it.

What a file says is checked before the library builds from it (a token that is not a string, a merge that is not
two pieces, an id outside the vocabulary), and whatever the library still raises (`library_errors`) comes back as
one ValueError naming the file. Files are read bounded (source_files.MAX_TOKENIZER_FILE_BYTES).
"""

from __future__ import annotations

import contextlib
import functools
import json
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .source_files import MAX_TOKENIZER_FILE_BYTES, read_bounded

SPACE = "\u2581"  # sentencepiece's "▁": a space, and the dummy prefix before the first word

# Token types: llama.cpp's llama_token_type numbers are sentencepiece's ModelProto.SentencePiece.Type numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# transformers 5 writes its generic class as "TokenizersBackend", which 4.x cannot import; "PreTrainedTokenizerFast"
# is the same thing under the name both know (5.x keeps it as an alias): tokenizer.json alone decides the encoding.
CLASS_RENAMES = {"TokenizersBackend": "PreTrainedTokenizerFast"}

# Llama 3's split (its tokenizer.json): letters, 1-3 digit groups, punctuation runs, newlines, spaces.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# Qwen2's split (its tokenizer.json): Llama 3's with every digit alone.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> Any:
    from tokenizers import pre_tokenizers

    # llama.cpp's regexes for these: "\p{N}" (every digit alone), then GPT-2's; in tokenizers that is Digits + ByteLevel.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(split: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# GPT-2's split, as llama.cpp writes it (tokenizers' ByteLevel regex, less its last "|\s+": llama.cpp keeps what no
# regex matches as a piece of its own anyway).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's "default" BPE split (llm_tokenizer_bpe, its default case): these regexes one after another, each
# splitting the pieces the one before left.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


def _llama_cpp_default() -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in DEFAULT_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _llama3() -> Any:
    return _split_then_bytes(LLAMA3_SPLIT)


def _qwen2() -> Any:
    return _split_then_bytes(QWEN2_SPLIT)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp tokenizes a byte-level BPE vocabulary under one tokenizer.ggml.pre name (src/llama-vocab.cpp:
    the name's branch in llama_vocab::impl::load sets the flags, llm_tokenizer_bpe's switch its regexes)."""

    split: Callable[[], Any]  # its regexes, as the tokenizers pre-tokenizer that splits text the same way
    ignore_merges: bool = False  # a pre-token that is a token stays whole (tokenizer.json's model.ignore_merges)
    add_bos: bool = False  # whether llama.cpp adds BOS when the file has no tokenizer.ggml.add_bos_token


_GPT2 = PreTokenizer(_byte_level)
_DIGITS = PreTokenizer(_digits_then_byte_level)
_QWEN2 = PreTokenizer(_qwen2)
_LLAMA3 = PreTokenizer(_llama3, ignore_merges=True, add_bos=True)
_LLAMA3_MERGED = PreTokenizer(_llama3)  # Llama 3's regex, merges always applied, no BOS by default
_LLAMA3_NO_BOS = PreTokenizer(_llama3, ignore_merges=True)

# tokenizer.ggml.pre -> how llama.cpp tokenizes under it: every name llama.cpp accepts whose regexes and flags are one
# of the splits above. Names it gives more (jina-v1-en, roberta-bpe: a SEP added; jais-2: its own whitespace runs;
# tekken, gpt-4o, deepseek-*, ...: regexes of their own) are not here: such a GGUF's vocabulary is refused by name.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open"),
                    _QWEN2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    # chatglm-bpe, glm4, glm5 have no default BOS id either: the file's tokenizer.ggml.bos_token_id is what is read
    **dict.fromkeys(("smaug-bpe", "dbrx", "chatglm-bpe"), _LLAMA3_MERGED),
    **dict.fromkeys(("glm4", "glm5"), _LLAMA3_NO_BOS),
    # llama.cpp's split for a name it does not know of old, or none (a GGUF without tokenizer.ggml.pre): never written
    "default": PreTokenizer(_llama_cpp_default),
}
# The name `convert --to gguf` writes for each split above: convert_hf_to_gguf.py's name for a tokenizer of it.
WRITTEN_PRE = ("gpt-2", "smollm", "qwen2", "llama-bpe", "smaug-bpe")
# Names this package wrote or read before, which llama.cpp refuses ("unknown pre-tokenizer type") -> llama.cpp's name
# for the same split: read as it (older files still read), and renamed when a GGUF's vocabulary is copied.
LEGACY_PRE = {"gpt2": "gpt-2", "minerva": "minerva-7b"}
PRE_TOKENIZERS.update({old: PRE_TOKENIZERS[new] for old, new in LEGACY_PRE.items()})


@contextlib.contextmanager
def library_errors(where: str | Path, what: str) -> Iterator[None]:
    """Whatever a tokenizer library raises in the block, as one ValueError "WHERE: WHAT (its first line)".

    tokenizers raises a bare Exception, and a Rust panic as pyo3's PanicException (a BaseException); sentencepiece
    RuntimeError, OSError or UnicodeDecodeError. A signal's exit and Ctrl-C go through untouched, and a ValueError
    that names WHERE already is ours.
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  (the libraries' own types, a panic included)
        if isinstance(e, ValueError) and str(e).startswith(f"{where}: "):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{where}: {what} ({why})") from None


def _cached_by_file(make: Callable[[Path], dict[str, bytes]]) -> Callable[[str | Path], dict[str, bytes]]:
    """MAKE(path), remembered for the file as it is now (path, size, mtime): an export makes a tokenizer's client files
    in its checks and again when it writes them, and a GGUF vocabulary takes seconds to build."""
    @functools.lru_cache(maxsize=2)
    def cached(path: Path, size: int, mtime_ns: int) -> dict[str, bytes]:
        return make(path)

    @functools.wraps(make)
    def made(path: str | Path) -> dict[str, bytes]:
        real = Path(path).resolve()
        st = real.stat()
        return dict(cached(real, st.st_size, st.st_mtime_ns))  # a copy: callers add files to it

    return made


# --- GGUF fields ----------------------------------------------------------------------------------------------

def gguf_tokenizer_fields(reader_or_fields: Any) -> dict[str, Any]:
    """The tokenizer.* fields as Python values, from a gguf.GGUFReader or a mapping name -> field or value."""
    fields = getattr(reader_or_fields, "fields", reader_or_fields)
    assert isinstance(fields, Mapping), f"expected a GGUFReader or a mapping of fields, got {type(fields).__name__}"
    return {k: (f.contents() if hasattr(f, "contents") else f) for k, f in fields.items() if k.startswith("tokenizer.")}


def _token(fields: dict[str, Any], tokens: Sequence[str], key: str) -> str | None:
    i = fields.get(f"tokenizer.ggml.{key}_token_id")
    if i is None:
        return None
    if not (isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < len(tokens)):
        shown = i if isinstance(i, numbers.Integral) else repr(i)[:40]
        raise ValueError(f"tokenizer.ggml.{key}_token_id is {shown}, outside the vocabulary of {len(tokens)} tokens")
    return tokens[int(i)]


def _list_of(f: dict[str, Any], key: str, kind: Any, what: str) -> list[Any] | None:
    """Field KEY as a list whose every item is a KIND (a bool is no number); None when absent; else a ValueError."""
    value = f.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of {what}, got {str(value)[:40]!r}")
    exact = {str: (str,), numbers.Integral: (int,), numbers.Real: (int, float)}[kind]
    if not all(type(x) in exact for x in value):  # the plain types in C speed (a vocabulary has 10^5 items)
        bad = next((x for x in value if not isinstance(x, kind) or isinstance(x, bool)), None)
        if bad is not None:
            raise ValueError(f"{key} must be a list of {what}; it holds {str(bad)[:40]!r}")
    return list(value)


def tokenizer_json_from_gguf(reader_or_fields: Any) -> dict[str, str]:
    """File name -> text: tokenizer.json, tokenizer_config.json, special_tokens_map.json from a GGUF vocabulary."""
    f = gguf_tokenizer_fields(reader_or_fields)
    kind = f.get("tokenizer.ggml.model")
    tokens = _list_of(f, "tokenizer.ggml.tokens", str, "strings")
    if kind is None or not tokens:
        raise ValueError("the GGUF file holds no vocabulary (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    types = _list_of(f, "tokenizer.ggml.token_type", numbers.Integral, "integers") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    special = {key: _token(f, tokens, key) for key in ("bos", "eos", "unknown", "padding")}
    template = f.get("tokenizer.chat_template")
    build: Callable[[], Any]
    if kind == "gpt2":
        pre = f.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {str(pre)[:40]!r}: no tokenizer.json pre-tokenizer known for it "
                             f"here (known: {', '.join(sorted(PRE_TOKENIZERS))})")
        merges = [tuple(m.split(" ", 1)) for m in _list_of(f, "tokenizer.ggml.merges", str, "strings") or []]
        bad = next((i for i, m in enumerate(merges) if len(m) != 2 or not all(m)), None)
        if bad is not None:
            raise ValueError(f"tokenizer.ggml.merges entry {bad} is {' '.join(merges[bad])[:40]!r}, not two pieces "
                             f"joined by a space")
        split = PRE_TOKENIZERS[pre]
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", split.add_bos))  # llama.cpp's default for the name
        add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
        build = lambda: _byte_level_bpe(tokens, merges, split, types)  # noqa: E731
        cls = "GPT2Tokenizer"
    elif kind == "llama":
        scores = _list_of(f, "tokenizer.ggml.scores", numbers.Real, "numbers")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("a 'llama' GGUF vocabulary needs tokenizer.ggml.scores, one per token")
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for SentencePiece
        add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
        build = lambda: _sentencepiece_bpe(  # noqa: E731
            tokens, [float(s) for s in scores], types, unk=special["unknown"],
            add_dummy_prefix=bool(f.get("tokenizer.ggml.add_space_prefix", True)), byte_fallback=BYTE in types)
        cls = "LlamaTokenizer"
    else:
        raise ValueError(f"tokenizer.ggml.model {str(kind)[:40]!r}: only 'gpt2' (byte-level BPE) and 'llama' "
                         f"(SentencePiece) vocabularies convert to tokenizer.json here")
    with library_errors("the GGUF vocabulary", "the tokenizers library cannot build a tokenizer.json from it"):
        tok = build()
        _post_process(tok, special["bos"], special["eos"], add_bos, add_eos, byte_level=kind == "gpt2")
    config = _config(cls, special, add_bos, add_eos, template if isinstance(template, str) else None)
    return _texts(tok, config)


# --- Building the two kinds -----------------------------------------------------------------------------------

def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, ...]], pre: PreTokenizer, types: list[int]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre.split()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], *, unk: str | None,
                       add_dummy_prefix: bool, byte_fallback: bool) -> Any:
    """LLaMA's SentencePiece BPE: merges are every split a + b of a piece into two pieces, ranked as sentencepiece
    ranks the merged piece (by score, then id), so HF's BPE merges in sentencepiece's order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece in mergeable:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[vocab[piece]], vocab[piece], vocab[left], vocab[right], left, right))
    ranked.sort()
    tok = Tokenizer(models.BPE(vocab, [(m[4], m[5]) for m in ranked], unk_token=unk, fuse_unk=True,
                               byte_fallback=byte_fallback))
    norms = [normalizers.Replace(" ", SPACE)]
    if add_dummy_prefix:
        norms.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(norms)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1 if add_dummy_prefix else 0, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    return tok


def _post_process(tok: Any, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool, *,
                  byte_level: bool) -> None:
    """BOS/EOS as transformers' LlamaTokenizerFast writes them (TemplateProcessing), else byte-level offsets."""
    from tokenizers import processors

    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        if byte_level:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    ids = {t: tok.token_to_id(t) for t in (bos if add_bos else None, eos if add_eos else None) if t is not None}
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(ids.items()))


def _config(cls: str, special: dict[str, str | None], add_bos: bool, add_eos: bool,
            chat_template: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": cls, "add_bos_token": add_bos, "add_eos_token": add_eos,
        "bos_token": special["bos"], "eos_token": special["eos"], "unk_token": special["unknown"],
        "pad_token": special["padding"], "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    if cls == "LlamaTokenizer":
        config["legacy"] = True  # the "▁"-prefix normalizer above, as LLaMA-2's tokenizer.json
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _texts(tok: Any, config: dict[str, Any]) -> dict[str, str]:
    keys = ("bos_token", "eos_token", "unk_token", "pad_token")
    special_map = {k: config[k] for k in keys if config.get(k) is not None}
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n", "tokenizer_config.json": _json(config),
            "special_tokens_map.json": _json(special_map)}


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# --- sentencepiece tokenizer.model -> tokenizer.json ------------------------------------------------------------

def sentencepiece_files(path: str | Path) -> dict[str, str]:
    """File name -> text: tokenizer.json etc. that encode exactly as the LLaMA sentencepiece model at PATH does.

    Only the LLaMA kind converts: BPE, identity normalization, spaces kept, a dummy "▁" prefix.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    path = Path(path)
    proto = pb.ModelProto()
    data = read_bounded(path, MAX_TOKENIZER_FILE_BYTES)
    try:
        proto.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError  # noqa: BLE001
        raise ValueError(f"{path}: not a sentencepiece model ({type(e).__name__})") from None
    if not proto.pieces:
        raise ValueError(f"{path}: not a sentencepiece model (no pieces)")
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type != pb.TrainerSpec.ModelType.Value("BPE"):
        kind = pb.TrainerSpec.ModelType.Name(trainer.model_type)
        raise ValueError(f"{path}: a sentencepiece {kind} model; only BPE (LLaMA's kind) converts to tokenizer.json")
    if norm.precompiled_charsmap or norm.remove_extra_whitespaces:
        raise ValueError(f"{path}: normalization {norm.name!r} (remove_extra_whitespaces="
                         f"{norm.remove_extra_whitespaces}) has no tokenizer.json equivalent here; only LLaMA's "
                         f"identity normalization converts")
    tokens = [p.piece for p in proto.pieces]

    def piece(i: int) -> str | None:
        return tokens[i] if 0 <= i < len(tokens) else None

    special = {"bos": piece(trainer.bos_id), "eos": piece(trainer.eos_id), "unknown": piece(trainer.unk_id),
               "padding": piece(trainer.pad_id)}
    add_bos = special["bos"] is not None
    with library_errors(path, "the tokenizers library cannot build a tokenizer.json from it"):
        tok = _sentencepiece_bpe(tokens, [p.score for p in proto.pieces], [p.type for p in proto.pieces],
                                 unk=special["unknown"], add_dummy_prefix=norm.add_dummy_prefix,
                                 byte_fallback=trainer.byte_fallback)
        _post_process(tok, special["bos"], special["eos"], add_bos, False, byte_level=False)
    return _texts(tok, _config("LlamaTokenizer", special, add_bos, False, None))


# --- tokenizer_config.json that transformers 4.x and 5.x both load -------------------------------------------------

def loadable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """CONFIG with a tokenizer_class that transformers 4.x and 5.x both import (5.x's TokenizersBackend renamed)."""
    cls = config.get("tokenizer_class")
    return {**config, "tokenizer_class": CLASS_RENAMES[cls]} if cls in CLASS_RENAMES else config


# --- What a client needs beside the graph, per tokenizer kind (tokenizer.KINDS points here) ----------------------

def copied_json_files(path: str | Path) -> dict[str, bytes]:
    """tokenizer.json and its neighbours as they are; tokenizer_config.json rewritten only when 4.x cannot load it."""
    folder = Path(path).parent
    if not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"{folder}: has tokenizer.json but no tokenizer_config.json, which onnxruntime-genai also "
                         f"opens; add it (transformers' save_pretrained writes both)")
    out = {n: read_bounded(folder / n, MAX_TOKENIZER_FILE_BYTES) for n in (
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model") if (folder / n).is_file()}
    try:
        config = json.loads(out["tokenizer_config.json"])
    except ValueError as e:
        raise ValueError(f"{folder / 'tokenizer_config.json'}: not a JSON file ({e})") from None
    loadable = loadable_tokenizer_config(config) if isinstance(config, dict) else config
    if loadable != config:
        out["tokenizer_config.json"] = _json(loadable).encode("utf-8")
    return out


@_cached_by_file
def converted_sentencepiece_files(path: Path) -> dict[str, bytes]:
    """tokenizer.json etc. from a tokenizer.model, which comes along for transformers' slow tokenizer."""
    made = {n: t.encode("utf-8") for n, t in sentencepiece_files(path).items()}
    return {**made, "tokenizer.model": read_bounded(path, MAX_TOKENIZER_FILE_BYTES)}


@_cached_by_file
def gguf_files(path: Path) -> dict[str, bytes]:
    """tokenizer.json etc. from the vocabulary in a GGUF file."""
    from .gguf.read import open_gguf  # the one (cached) parse of the file that resolving MODEL made

    try:
        texts = tokenizer_json_from_gguf(open_gguf(path))
    except ValueError as e:
        raise ValueError(e if str(e).startswith(f"{path}: ") else f"{path}: {e}") from None
    return {n: t.encode("utf-8") for n, t in texts.items()}
