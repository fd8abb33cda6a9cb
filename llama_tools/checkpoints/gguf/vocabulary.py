"""A GGUF vocabulary to write (tokenizer.ggml.*): from a sentencepiece tokenizer.model, a byte-level BPE
tokenizer.json, or a GGUF's own fields copied as they are."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...modeling.config import ModelConfig
from ..header_readers import json_object
from ..source_files import MAX_TOKENIZER_FILE_BYTES, read_bounded, template_problem
from ..tokenizer_files import CONTROL, NORMAL, PRE_TOKENIZERS, UNUSED, USER_DEFINED
from .architectures import KIND

if TYPE_CHECKING:
    from ..source import ModelSource

_UNUSED_SCORE = -1000.0  # llama.cpp's score of a [PADn] sentencepiece token


@dataclass
class Vocabulary:
    """tokenizer.ggml.* to write: built from a tokenizer file, or a GGUF's own fields copied as they are."""

    source: str  # the file it comes from, for messages
    model: str = ""  # tokenizer.ggml.model: 'llama' (sentencepiece) or 'gpt2' (byte-level BPE); '' when `fields` say
    tokens: list[str] = field(default_factory=list)
    types: list[int] = field(default_factory=list)  # llama.cpp's token types (tokenizer_files.NORMAL ...)
    scores: list[float] | None = None  # sentencepiece's, one per token
    merges: list[str] | None = None  # byte-level BPE's, "a b" in rank order
    pre: str = "default"  # tokenizer.ggml.pre: llama.cpp's name of the pre-tokenizer
    unk_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    fields: list[tuple[str, Any, Any, Any]] = field(default_factory=list)  # (key, value, value type, item type)



def source_vocabulary(source: ModelSource, cfg: ModelConfig) -> tuple[Vocabulary | None, list[str]]:
    """The vocabulary SOURCE ships, for tokenizer.ggml.*, and warnings; None (said why) when it has none to write."""
    if source.weights is not None and source.weights.kind == KIND and source.path is not None:
        return gguf_vocabulary(source.path), []
    found = source.tokenizer
    if found is None:
        return None, [f"{source.label}: no tokenizer beside it; the GGUF is written without a vocabulary, which "
                      f"llama.cpp needs to run it"]
    folder = found.parent
    spm = found if found.suffix == ".model" else folder / "tokenizer.model"
    try:
        data = _tokenizer_json(folder / "tokenizer.json")
        if data is not None and _byte_level(data):
            vocab = bpe_vocabulary(folder / "tokenizer.json", data, cfg.vocab_size)
        elif spm.is_file():
            vocab = sentencepiece_vocabulary(spm, cfg.vocab_size)
        else:
            raise ValueError(f"{folder / 'tokenizer.json'}: not a byte-level BPE tokenizer, and no tokenizer.model "
                             f"beside it; llama.cpp's 'gpt2' and 'llama' vocabularies are written from those")
        return vocab, _tokenizer_behaviour(vocab, folder / "tokenizer.json" if vocab.model == "gpt2" else spm, cfg)
    except ValueError as e:
        return None, [f"{str(e).splitlines()[0]}; the GGUF is written without a vocabulary"]


def _tokenizer_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json_object(read_bounded(path, MAX_TOKENIZER_FILE_BYTES), path)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: not a tokenizer.json (no 'model' object)")
    return data


def _byte_level(data: dict[str, Any]) -> bool:
    """A BPE tokenizer.json that decodes bytes from GPT-2's byte alphabet: what llama.cpp calls 'gpt2'."""
    decoder = data.get("decoder")
    return data["model"].get("type") == "BPE" and isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"


def _tokenizer_behaviour(vocab: Vocabulary, path: Path, cfg: ModelConfig) -> list[str]:
    """BOS/EOS and the chat template as the source's tokenizer has them (tokenizer.Tokenizer reads its files)."""
    from ..tokenizer import Tokenizer

    tok = Tokenizer(path)
    vocab.add_bos, vocab.add_eos = tok.special.add_bos, tok.special.add_eos
    bos = tok.special.bos_id if tok.special.add_bos else None
    warnings = []
    if bos is not None and bos != cfg.bos_token_id:
        warnings.append(f"{path}: the tokenizer adds BOS id {bos}, the config's bos_token_id is {cfg.bos_token_id}; "
                        f"a GGUF has one BOS id: the config's is written")
    why = template_problem(tok.chat_template) if tok.chat_template is not None else None
    if why:
        warnings.append(f"{path.parent}: its chat template is not a valid Jinja template ({why}); left out")
    else:
        vocab.chat_template = tok.chat_template
    return warnings


def _pre_json(build: Any) -> Any:
    """A tokenizers pre-tokenizer as tokenizer.json writes it, without what only moves offsets."""
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = build()
    return _splitting(json.loads(t.to_str())["pre_tokenizer"])


def _splitting(value: Any) -> Any:
    """VALUE without `trim_offsets` keys: they change offsets, never how text is split."""
    if isinstance(value, dict):
        return {k: _splitting(v) for k, v in value.items() if k != "trim_offsets"}
    return [_splitting(v) for v in value] if isinstance(value, list) else value


@lru_cache(maxsize=1)
def _pre_names() -> tuple[tuple[str, Any], ...]:
    # llama.cpp's "default" is a regex set of its own, not GPT-2's byte-level split: never written for one.
    return tuple((name, _pre_json(build)) for name, build in PRE_TOKENIZERS.items() if name != "default")


def pre_tokenizer_name(pre: Any) -> str | None:
    """llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer that splits as one we build."""
    want = _splitting(pre)
    return next((name for name, built in _pre_names() if built == want), None)


def bpe_vocabulary(path: Path, data: dict[str, Any], vocab_size: int) -> Vocabulary:
    """A byte-level BPE tokenizer.json as llama.cpp's 'gpt2' vocabulary: tokens by id, types, merges, pre."""
    model = data["model"]
    pre = pre_tokenizer_name(data.get("pre_tokenizer"))
    if pre is None:
        known = ", ".join(name for name, _ in _pre_names())
        raise ValueError(f"{path}: its pre-tokenizer splits as none that llama.cpp names here ({known})")
    odd = next((k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                if model.get(k)), None)
    if odd:
        raise ValueError(f"{path}: BPE option {odd}={model[odd]!r} has no place in a GGUF vocabulary")
    norm = data.get("normalizer")
    if norm is not None and not (isinstance(norm, dict) and norm.get("type") == "NFC"):
        raise ValueError(f"{path}: normalizer {str(norm)[:60]} has no place in a 'gpt2' GGUF vocabulary")
    tokens: list[str | None] = [None] * vocab_size
    types = [NORMAL] * vocab_size
    vocab, added = model.get("vocab"), data.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(added, list):
        raise ValueError(f"{path}: model.vocab must be an object and added_tokens a list")
    entries = [(t, i, NORMAL) for t, i in vocab.items()] + [
        (a.get("content"), a.get("id"), CONTROL if a.get("special") else USER_DEFINED) if isinstance(a, dict)
        else (None, None, NORMAL) for a in added]
    for token, i, kind in entries:
        if not isinstance(token, str) or type(i) is not int or not 0 <= i < vocab_size:
            raise ValueError(f"{path}: token {str(token)[:40]!r} has id {i!r}, not one of the model's {vocab_size} "
                             f"embedding rows")
        tokens[i], types[i] = token, kind
    for i, t in enumerate(tokens):
        if t is None:  # llama.cpp's filler for an id no token has
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = []
    for m in model.get("merges") or []:  # "a b", or ["a", "b"] (tokenizers >= 0.20)
        a, b = m.split(" ", 1) if isinstance(m, str) and " " in m else m if isinstance(m, list) and len(m) == 2 \
            else ("", "")
        if not (isinstance(a, str) and isinstance(b, str) and a and b and " " not in a and " " not in b):
            raise ValueError(f"{path}: merge {str(m)[:40]!r} is not two tokens without spaces")
        merges.append(f"{a} {b}")
    unk = model.get("unk_token")
    return Vocabulary(str(path), "gpt2", tokens, types, None, merges, pre,  # type: ignore[arg-type]
                      unk_id=vocab.get(unk) if isinstance(unk, str) and type(vocab.get(unk)) is int else None)


def sentencepiece_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """A sentencepiece BPE tokenizer.model as llama.cpp's 'llama' vocabulary: pieces, scores, types."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(read_bounded(path, MAX_TOKENIZER_FILE_BYTES))
    except Exception as e:  # protobuf's DecodeError  # noqa: BLE001
        raise ValueError(f"{path}: not a sentencepiece model ({type(e).__name__})") from None
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    n = len(proto.pieces)
    if not n:
        raise ValueError(f"{path}: not a sentencepiece model (no pieces)")
    if trainer.model_type != pb.TrainerSpec.ModelType.Value("BPE"):
        raise ValueError(f"{path}: a sentencepiece {pb.TrainerSpec.ModelType.Name(trainer.model_type)} model; "
                         f"llama.cpp's 'llama' vocabulary is BPE")
    if norm.precompiled_charsmap or norm.remove_extra_whitespaces:  # as tokenizer_files.sentencepiece_files
        raise ValueError(f"{path}: normalization {norm.name!r} has no place in a 'llama' GGUF vocabulary")
    if n > vocab_size:
        raise ValueError(f"{path}: {n} pieces, more than the model's {vocab_size} embedding rows")
    pad = vocab_size - n  # llama.cpp's fillers up to the embedding's rows: [PAD1], [PAD2], ...
    return Vocabulary(
        str(path), "llama", [p.piece for p in proto.pieces] + [f"[PAD{i}]" for i in range(1, pad + 1)],
        [int(p.type) for p in proto.pieces] + [UNUSED] * pad,  # sentencepiece's type numbers are llama.cpp's
        [float(p.score) for p in proto.pieces] + [_UNUSED_SCORE] * pad,
        unk_id=trainer.unk_id if 0 <= trainer.unk_id < n else None, add_space_prefix=bool(norm.add_dummy_prefix))


def gguf_vocabulary(path: Path) -> Vocabulary:
    """A GGUF's tokenizer.* fields, to be written as they are (their value types kept)."""
    import gguf

    from .read import open_gguf

    out = Vocabulary(str(path))
    for key, f in open_gguf(path).fields.items():
        if not key.startswith("tokenizer.") or key in _ID_KEYS:
            continue  # the ids are the config's (write_gguf)
        kinds = list(f.types)
        value = f.contents()
        if kinds[0] == gguf.GGUFValueType.ARRAY and (not value or len(kinds) != 2):
            continue  # empty, or arrays of arrays: the writer has no form for them, and no vocabulary uses one
        out.fields.append((key, value, kinds[0], kinds[1] if len(kinds) > 1 else None))
    return out


_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")


def write_vocabulary(w: Any, cfg: ModelConfig, v: Vocabulary | None) -> None:
    """tokenizer.ggml.* on the writer: the config's special ids, then V's fields or built vocabulary."""
    w.add_bos_token_id(cfg.bos_token_id)  # the config's ids, which config.py reads back as the config's
    w.add_eos_token_id(cfg.eos_token_id)
    if cfg.pad_token_id is not None:
        w.add_pad_token_id(cfg.pad_token_id)
    if v is None:
        return
    for key, value, kind, item in v.fields:
        w.add_key_value(key, value, kind, sub_type=item)
    if not v.model:
        return
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    for value, add in ((v.unk_id, w.add_unk_token_id), (v.add_bos, w.add_add_bos_token),
                       (v.add_eos, w.add_add_eos_token), (v.add_space_prefix, w.add_add_space_prefix)):
        if value is not None:
            add(value)
    if v.chat_template:
        w.add_chat_template(v.chat_template)

