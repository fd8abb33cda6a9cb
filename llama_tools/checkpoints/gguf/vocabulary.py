"""A GGUF vocabulary to write (tokenizer.ggml.*): from a sentencepiece tokenizer.model, a byte-level BPE
tokenizer.json (llama.cpp's 'gpt2', its split named from tokenizer_files.WRITTEN_PRE), a sentencepiece-style
tokenizer.json alone (Gemma as transformers 5 saves it: llama.cpp's 'llama'), or a GGUF's own fields copied as they
are. Each is checked by llama.cpp itself in tests/test_gguf_llamacpp.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...modeling.config import ModelConfig
from ..header_readers import json_object
from ..source_files import MAX_TOKENIZER_FILE_BYTES, lone_surrogate, read_bounded, template_problem
from ..tokenizer_files import (BYTE, CONTROL, LEGACY_PRE, NORMAL, PRE_TOKENIZERS, SPACE, UNKNOWN, UNUSED,
                               USER_DEFINED, WRITTEN_PRE)
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
    left_out: list[str] = field(default_factory=list)  # fields of `source` not written, one warning line each



def source_vocabulary(source: ModelSource, cfg: ModelConfig) -> tuple[Vocabulary | None, list[str]]:
    """The vocabulary SOURCE ships, for tokenizer.ggml.*, and warnings; None (said why) when it has none to write."""
    if source.weights is not None and source.weights.kind == KIND and source.path is not None:
        vocab = gguf_vocabulary(source.path)
        held = any(key == "tokenizer.ggml.tokens" for key, *_ in vocab.fields)
        return vocab, vocab.left_out + ([] if held else [
            f"{source.path}: holds no vocabulary (tokenizer.ggml.tokens); the GGUF is written without one, which "
            f"llama.cpp needs to run it"])
    found = source.tokenizer
    if found is None:
        return None, [f"{source.label}: no tokenizer beside it; the GGUF is written without a vocabulary, which "
                      f"llama.cpp needs to run it"]
    folder = found.parent
    spm, hf = (found if found.suffix == ".model" else folder / "tokenizer.model"), folder / "tokenizer.json"
    try:
        data = _tokenizer_json(hf)
        if data is not None and _byte_level(data):
            vocab = bpe_vocabulary(hf, data, cfg.vocab_size)
        elif spm.is_file():  # sentencepiece's own file first: its scores and types as llama.cpp's converter reads them
            vocab = sentencepiece_vocabulary(spm, cfg.vocab_size)
        elif data is not None:  # Gemma saved by transformers 5: tokenizer.json alone
            vocab = sentencepiece_json_vocabulary(hf, data, cfg.vocab_size)
        else:
            raise ValueError(f"{folder}: no tokenizer.json or tokenizer.model; llama.cpp's vocabularies are written "
                             f"from those")
        return vocab, _tokenizer_behaviour(vocab, Path(vocab.source), cfg)
    except ValueError as e:
        return None, [f"{str(e).splitlines()[0]}; the GGUF is written without a vocabulary, which llama.cpp needs to "
                      f"run it"]


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
    template = tok.chat_template
    at = lone_surrogate(template) if isinstance(template, str) else None
    why = template_problem(template) if template is not None and at is None else None
    if why:
        warnings.append(f"{path.parent}: its chat template is not a valid Jinja template ({why}); left out")
    elif at is not None:
        # A JSON escape such as "\udc80" in tokenizer_config.json (chat_template.jinja is read with its bad bytes
        # replaced): no UTF-8 string says it, so neither a GGUF nor llama.cpp can hold it
        warnings.append(f"{path.parent / 'tokenizer_config.json'}: chat_template is not UTF-8 text ({at}); "
                        f"the GGUF is written without a chat template")
    else:
        vocab.chat_template = template
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
def _pre_names() -> tuple[tuple[str, Any, bool], ...]:
    """(name, split as tokenizer.json writes it, ignore_merges) of each name `convert --to gguf` writes."""
    return tuple((name, _pre_json(PRE_TOKENIZERS[name].split), PRE_TOKENIZERS[name].ignore_merges)
                 for name in WRITTEN_PRE)


def pre_tokenizer_name(pre: Any, ignore_merges: bool = False) -> str | None:
    """llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer and model.ignore_merges under which
    llama.cpp splits and merges as tokenizers does: None when llama.cpp has none."""
    want = _splitting(pre)
    return next((name for name, built, ignore in _pre_names() if built == want and ignore == ignore_merges), None)


def bpe_vocabulary(path: Path, data: dict[str, Any], vocab_size: int) -> Vocabulary:
    """A byte-level BPE tokenizer.json as llama.cpp's 'gpt2' vocabulary: tokens by id, types, merges, pre."""
    model = data["model"]
    ignore_merges = bool(model.get("ignore_merges", False))
    pre = pre_tokenizer_name(data.get("pre_tokenizer"), ignore_merges)
    if pre is None:
        known = ", ".join(f"{name}{' (ignore_merges)' if ignore else ''}" for name, _, ignore in _pre_names())
        raise ValueError(f"{path}: its pre-tokenizer{' with ignore_merges' if ignore_merges else ''} splits as none "
                         f"that llama.cpp names here ({known})")
    odd = next((k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                if model.get(k)), None)
    if odd:
        raise ValueError(f"{path}: BPE option {odd}={model[odd]!r} has no place in a GGUF vocabulary")
    norm = data.get("normalizer")
    if norm is not None and not (isinstance(norm, dict) and norm.get("type") == "NFC"):
        raise ValueError(f"{path}: normalizer {str(norm)[:60]} has no place in a 'gpt2' GGUF vocabulary")
    tokens, types, vocab = _tokens_by_id(path, data, vocab_size)
    # llama.cpp splits a merge at its first space: a piece holding one cannot be said in a 'gpt2' vocabulary
    merges = [f"{a} {b}" for a, b in _merges(path, model, spaces=False)]
    unk = model.get("unk_token")
    return Vocabulary(str(path), "gpt2", tokens, types, None, merges, pre,
                      unk_id=vocab.get(unk) if isinstance(unk, str) and type(vocab.get(unk)) is int else None)


def _tokens_by_id(path: Path, data: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int], dict[str, Any]]:
    """A tokenizer.json's tokens by id, one per embedding row, and their llama.cpp types (added tokens CONTROL if
    special, else USER_DEFINED; an id no token has is llama.cpp's filler [PADn], UNUSED); and model.vocab."""
    model = data["model"]
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
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    return tokens, types, vocab  # type: ignore[return-value]


def _merges(path: Path, model: dict[str, Any], *, spaces: bool) -> list[tuple[str, str]]:
    """model.merges as pairs, in rank order: "a b", or ["a", "b"] (tokenizers >= 0.20, whose pieces may hold spaces:
    allowed when SPACES)."""
    out = []
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) and " " in m else m if isinstance(m, list) and len(m) == 2 \
            else ("", "")
        if not (isinstance(a, str) and isinstance(b, str) and a and b and (spaces or " " not in a + b)):
            raise ValueError(f"{path}: merge {str(m)[:40]!r} is not two tokens{'' if spaces else ' without spaces'}")
        out.append((a, b))
    return out


# A sentencepiece-style BPE tokenizer.json (transformers' conversion of a tokenizer.model: Gemma's, Llama 2's): spaces
# become "▁" in its normalizer, a character no piece holds becomes its bytes <0xXX>. Its normalizer is one of these
# (the second puts "▁" before the text too: llama.cpp's add_space_prefix); its pre-tokenizer none, or Gemma's split on
# " ", which finds none once the normalizer has run.
_REPLACE_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
_NORMALIZERS = {False: (_REPLACE_SPACES, {"type": "Sequence", "normalizers": [_REPLACE_SPACES]}),
                True: ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, _REPLACE_SPACES]},)}
_NO_OP_SPLITS = (None, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False})
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def _sentencepiece_style(data: dict[str, Any]) -> bool:
    """A BPE tokenizer.json with byte fallback: sentencepiece's kind, as transformers converts a tokenizer.model."""
    return data["model"].get("type") == "BPE" and data["model"].get("byte_fallback") is True


def sentencepiece_json_vocabulary(path: Path, data: dict[str, Any], vocab_size: int) -> Vocabulary:
    """A sentencepiece-style BPE tokenizer.json (Gemma's, saved without its tokenizer.model) as llama.cpp's 'llama'
    vocabulary: tokens, types, and scores that make llama.cpp's merges tokenizers' own.

    llama.cpp's 'llama' tokenizer merges, among adjacent pieces whose join is a token, the join of highest score
    (leftmost first), as sentencepiece does; tokenizers applies the merge of lowest rank. transformers lists a
    tokenizer.model's merges by the merged piece's score (every split of it into two tokens), so a token's score is
    minus the rank of its first merge: llama.cpp then merges in tokenizers' order. A token no merge makes is scored
    below all of them (sentencepiece's BPE never makes one; llama.cpp joins it last, if ever).
    """
    model = data["model"]
    if not _sentencepiece_style(data):
        raise ValueError(f"{path}: not a byte-level BPE tokenizer, nor a BPE with byte fallback (sentencepiece's "
                         f"kind), and no tokenizer.model beside it; llama.cpp's 'gpt2' and 'llama' vocabularies are "
                         f"written from those")
    odd = next((k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges")
                if model.get(k)), None)
    if odd:
        raise ValueError(f"{path}: BPE option {odd}={model[odd]!r} has no place in a 'llama' GGUF vocabulary")
    norm, pre = data.get("normalizer"), data.get("pre_tokenizer")
    prefix = next((p for p, forms in _NORMALIZERS.items() if norm in forms), None)
    if prefix is None or pre not in _NO_OP_SPLITS:
        what = f"normalizer {str(norm)[:60]}" if prefix is None else f"pre-tokenizer {str(pre)[:60]}"
        raise ValueError(f"{path}: {what} is not sentencepiece's (spaces as {SPACE!r}, no split); llama.cpp's 'llama' "
                         f"vocabulary has no equivalent")
    tokens, types, vocab = _tokens_by_id(path, data, vocab_size)
    for piece, i in vocab.items():
        if types[i] == NORMAL and _BYTE_PIECE.fullmatch(piece):
            types[i] = BYTE
    unk = model.get("unk_token")
    unk_id = vocab.get(unk) if isinstance(unk, str) else None
    if type(unk_id) is int:
        types[unk_id] = UNKNOWN
    merges = _merges(path, model, spaces=True)
    last = -float(len(merges) + 1)
    scores = [last] * vocab_size
    for rank in range(len(merges) - 1, -1, -1):  # the first (lowest) rank that makes a token wins
        i = vocab.get(merges[rank][0] + merges[rank][1])
        if type(i) is int and 0 <= i < vocab_size:
            scores[i] = -float(rank)
    return Vocabulary(str(path), "llama", tokens, types, scores, unk_id=unk_id if type(unk_id) is int else None,
                      add_space_prefix=prefix)


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

    from .read import NotUtf8, field_value, open_gguf

    out = Vocabulary(str(path))
    reader = open_gguf(path)
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer.") or key in _ID_KEYS:
            continue  # the ids are the config's (write_gguf)
        kinds = list(f.types)
        value = field_value(reader, key, lazy=True)
        if isinstance(value, NotUtf8):  # a template llama.cpp could not use either: not copied, said
            out.left_out.append(f"{value.problem}; the GGUF is written without it")
            continue
        if kinds[0] == gguf.GGUFValueType.ARRAY and (not value or len(kinds) != 2):
            continue  # empty, or arrays of arrays: the writer has no form for them, and no vocabulary uses one
        if key == "tokenizer.ggml.pre" and value in LEGACY_PRE:  # what we wrote before llama.cpp's names
            value = LEGACY_PRE[value]
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

