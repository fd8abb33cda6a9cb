"""Text <-> ids with the checkpoint's own tokenizer: tokenizer.json through HF's `tokenizers`, tokenizer.model through
sentencepiece, a GGUF file's vocabulary through tokenizer.json built from it (tokenizer_files).

Which library reads which file is one registry (KINDS). BOS/EOS follow the checkpoint: tokenizer_config.json
(add_bos_token, bos_token, eos_token) and generation_config.json (bos_token_id, eos_token_id, maybe a list) beside
the tokenizer; without them, what the tokenizer itself says (SmolLM2 adds no BOS; LLaMA-2's `<s>` = id 1 does).

Byte fallback (sentencepiece and LLaMA-style tokenizer.json): a character outside the vocabulary becomes its
UTF-8 bytes, one piece each (the paper's "啊" -> <0xE5> <0x95> <0x8A>), so every text round-trips.

A file is refused when it is opened, in one line naming it, unless it is usable: read bounded, its library loads
it (whatever the library raises, a Rust panic included, is caught here: tokenizer_files.library_errors), it
encodes PROBE_TEXT to ids of its own, and its BOS/EOS/pad ids are its own. A padding length or truncation the file
chooses is never applied (transformers encodes one text without them). check_fits refuses one whose ids go past a
model's vocab_size: every command that runs the model asks (source.load_tokenizer).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import tokenizer_files
from .tokenizer_files import library_errors
from .header_readers import MAX_HEADER_BYTES
from .header_readers import json_object
from .source_files import MAX_GENERATION_CONFIG_BYTES, MAX_TOKENIZER_FILE_BYTES, read_bounded, special_ids

# Ordinary text that every usable tokenizer encodes to at least one id: one that gives none (an empty vocabulary, a
# BPE whose pieces match nothing) would turn every prompt into nothing, and is refused when it is opened.
PROBE_TEXT = "Hello world"


@dataclass(frozen=True)
class SpecialTokens:
    """What the checkpoint says about BOS/EOS: whether encode adds them, and their ids."""

    add_bos: bool
    add_eos: bool
    bos_id: int | None
    eos_ids: tuple[int, ...]  # generation stops at any of them (generation_config.json may list several)
    pad_id: int | None = None  # what a client pads a batch with; never added by encode


class Tokenizer:
    """A tokenizer file opened by its kind (KINDS): encode (BOS/EOS as the checkpoint says), decode, pieces.

    Tokenizer(path) returns the subclass that reads PATH's kind. Opening it checks that it is usable: its library
    reads it, it encodes PROBE_TEXT to ids of its own, and its BOS/EOS/pad ids are its own; else a one-line
    ValueError naming the file. Whether it fits a model is check_fits'.
    """

    path: Path
    special: SpecialTokens
    chat_template: str | None = None  # the model's Jinja chat template, when it ships one

    def __new__(cls, path: str | Path, *args: Any, **kwargs: Any) -> Tokenizer:
        if cls is Tokenizer:
            cls = kind_of(Path(path)).cls
        return super().__new__(cls)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such tokenizer file")

    # What each library supplies.
    @property
    def vocab_size(self) -> int:
        """How many ids there are: the largest id + 1 (added tokens included; some vocabularies skip an id)."""
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _piece(self, i: int) -> str:
        raise NotImplementedError

    def token_id(self, piece: str) -> int | None:
        raise NotImplementedError

    # Shared.
    @property
    def bos_id(self) -> int:
        """BOS id, -1 when there is none (sentencepiece's convention)."""
        return -1 if self.special.bos_id is None else self.special.bos_id

    @property
    def eos_id(self) -> int:
        """The first EOS id, -1 when there is none."""
        return self.special.eos_ids[0] if self.special.eos_ids else -1

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.special.eos_ids

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        """Ids of TEXT; bos/eos None: as the checkpoint's tokenizer_config.json says."""
        with library_errors(self.path, "its library failed to encode the text"):
            ids = self._encode(text)
        if (self.special.add_bos if bos is None else bos) and self.special.bos_id is not None:
            ids = [self.special.bos_id] + ids
        if (self.special.add_eos if eos is None else eos) and self.special.eos_ids:
            ids = ids + [self.special.eos_ids[0]]
        return ids

    def piece_of(self, i: int | None) -> str | None:
        """The piece of id I (None for None or an id outside the vocabulary)."""
        return self._piece(i) if i is not None and 0 <= i < self.vocab_size else None

    def check_ids(self, ids: list[int]) -> None:
        """ValueError naming the first id outside the vocabulary."""
        check_vocab(ids, self.vocab_size, str(self.path))

    def decode(self, ids: list[int]) -> str:
        """The text of IDS, special tokens (BOS, EOS, control) left out as sentencepiece does."""
        self.check_ids(ids)
        with library_errors(self.path, "its library failed to decode the ids"):
            return self._decode(list(ids))

    def pieces(self, ids: list[int]) -> list[str]:
        self.check_ids(ids)
        return [self._piece(i) for i in ids]

    def _check_usable(self) -> None:
        """ValueError naming the file unless it encodes PROBE_TEXT to ids of its own and its special ids are its own."""
        with library_errors(self.path, f"its library cannot encode text with it ({PROBE_TEXT!r})"):
            ids = self._encode(PROBE_TEXT)
            self._decode(ids)
        if not ids:
            raise ValueError(f"{self.path}: encodes {PROBE_TEXT!r} to no tokens: its vocabulary holds nothing that "
                             f"ordinary text is made of (empty, or no piece matches); give a working tokenizer")
        check_vocab(ids, self.vocab_size, f"{self.path} (encoding {PROBE_TEXT!r})")
        for name, i in _special_ids(self.special):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"{self.path}: its {name} id {i} is none of its own token ids "
                                 f"(0..{self.vocab_size - 1}); fix the file that names it")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece tokenizer.model; without a tokenizer_config.json, BOS is added (LLaMA's convention)."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        super().__init__(path)
        data = read_bounded(self.path, MAX_TOKENIZER_FILE_BYTES)  # the library would read any size, or a FIFO
        self.sp = spm.SentencePieceProcessor()
        with library_errors(self.path, "not a sentencepiece model"):
            self.sp.LoadFromSerializedProto(data)
            own_bos, own_eos, own_pad = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()
        self.special = special_tokens(self.path.parent, self.token_id, add_bos=True,
                                      bos_id=own_bos if own_bos >= 0 else None,
                                      eos_ids=(own_eos,) if own_eos >= 0 else (),
                                      pad_id=own_pad if own_pad >= 0 else None, id_space=self.vocab_size)
        self.chat_template = read_chat_template(self.path.parent)
        self._check_usable()

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def _encode(self, text: str) -> list[int]:
        return list(self.sp.EncodeAsIds(text))

    def _decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds(ids)

    def _piece(self, i: int) -> str:
        return self.sp.IdToPiece(i)

    def token_id(self, piece: str) -> int | None:
        i = self.sp.PieceToId(piece)
        return i if self.sp.IdToPiece(i) == piece else None


class JsonTokenizer(Tokenizer):
    """HF's tokenizer.json through `tokenizers`; BOS as tokenizer_config.json says, else as its post-processor does."""

    def __init__(self, path: str | Path, *, text: str | None = None, config: dict[str, Any] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        if text is None:
            super().__init__(path)
            raw = read_bounded(self.path, MAX_TOKENIZER_FILE_BYTES)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{self.path}: not UTF-8 text (byte {e.start}); a tokenizer.json is JSON") from None
        with library_errors(self.path, "not a tokenizer.json that the tokenizers library reads"):
            self.tk = HFTokenizer.from_str(text)
            padding = self.tk.padding
            # transformers encodes one text without the file's padding and truncation unless asked to, and so do
            # we: a length the file chooses (Fixed 10**9) is then never allocated, and no text is cut.
            self.tk.no_padding()
            self.tk.no_truncation()
            self._ids = max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        with library_errors(self.path, f"its library cannot encode text with it ({PROBE_TEXT!r})"):
            # What the file's post-processor adds around a text: transformers' fast tokenizers follow it.
            bare = self.tk.encode("a", add_special_tokens=False).ids
            full = self.tk.encode("a", add_special_tokens=True).ids
        start = full.index(bare[0]) if bare and bare[0] in full else 0
        before, after = full[:start], full[start + len(bare):]
        pad = padding.get("pad_id") if isinstance(padding, dict) else None
        self.special = special_tokens(self.path.parent, self.token_id, add_bos=bool(before),
                                      add_eos=bool(after), bos_id=before[0] if before else None,
                                      eos_ids=tuple(after[-1:]), pad_id=pad if type(pad) is int else None,
                                      config=config, id_space=self._ids)
        self.chat_template = read_chat_template(self.path.parent, config)
        self._check_usable()

    @property
    def vocab_size(self) -> int:
        return self._ids

    def _encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def _piece(self, i: int) -> str:
        return self.tk.id_to_token(i)

    def token_id(self, piece: str) -> int | None:
        return self.tk.token_to_id(piece)


class GgufTokenizer(JsonTokenizer):
    """A GGUF file's vocabulary, as the tokenizer.json tokenizer_files builds from it (held in memory)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such tokenizer file")
        files = tokenizer_files.gguf_files(path)
        super().__init__(path, text=files["tokenizer.json"].decode("utf-8"),
                         config=json.loads(files["tokenizer_config.json"]))


@dataclass(frozen=True)
class TokenizerKind:
    """A tokenizer file by its name, the class (library) that reads it, and what an export writes for clients."""

    patterns: tuple[str, ...]  # globs of the file's name; a plain name first is what a directory is searched for
    library: str
    cls: type[Tokenizer]
    client_files: Callable[[Path], dict[str, bytes]]  # file name -> bytes: tokenizer.json, tokenizer_config.json, ...
    how: str  # what client_files did, in words


# Looked for in this order: tokenizer.json is what transformers' fast tokenizers read when a checkpoint has both.
KINDS = (
    TokenizerKind(("tokenizer.json",), "tokenizers", JsonTokenizer, tokenizer_files.copied_json_files,
                  "copied tokenizer.json"),
    TokenizerKind(("tokenizer.model", "*.model"), "sentencepiece", SentencePieceTokenizer,
                  tokenizer_files.converted_sentencepiece_files, "converted from tokenizer.model"),
    TokenizerKind(("*.gguf",), "tokenizers (tokenizer.json built from the GGUF vocabulary)", GgufTokenizer,
                  tokenizer_files.gguf_files, "built from the GGUF vocabulary"),
)
FILE_NAMES = tuple(k.patterns[0] for k in KINDS if not any(c in k.patterns[0] for c in "*?["))


def _matches(path: Path, kind: TokenizerKind) -> bool:
    return any(fnmatch.fnmatch(path.name.lower(), g) for g in kind.patterns)


def kind_of(path: Path) -> TokenizerKind:
    """The kind that reads PATH (by its name); ValueError for a file no kind reads."""
    kind = next((k for k in KINDS if _matches(path, k)), None)
    if kind is None:
        raise ValueError(f"{path}: not a tokenizer file; expected one of {', '.join(k.patterns[0] for k in KINDS)}")
    return kind


def find_tokenizer(path: str | Path | None) -> Path | None:
    """The tokenizer of a checkpoint directory, a config file's directory, or a GGUF file; None when there is none."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file() and any(_matches(path, k) for k in KINDS):
        return path
    folder = path if path.is_dir() else path.parent
    return next((folder / n for n in FILE_NAMES if (folder / n).is_file()), None)


def _read_json(path: Path) -> dict[str, Any]:
    """PATH's JSON object, {} when there is no such file; a one-line ValueError naming it when it is not one."""
    if not path.exists():
        return {}
    return json_object(read_bounded(path, MAX_HEADER_BYTES), path)  # a FIFO never blocks, nor a huge file loads


def read_chat_template(folder: Path, config: dict[str, Any] | None = None) -> str | None:
    """The chat template: tokenizer_config.json's `chat_template` (a string, or the one named "default" of a list), or
    chat_template.jinja beside it; None when the model ships none."""
    cfg = config if config is not None else _read_json(folder / "tokenizer_config.json")
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if isinstance(t, str) and t.strip():
        return t
    jinja = folder / "chat_template.jinja"
    if config is None and jinja.is_file() and jinja.stat().st_size < 1 << 20:
        return jinja.read_text(encoding="utf-8", errors="replace")
    return None


def _content(token: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _generation_ids(folder: Path, id_space: int) -> dict[str, int | list[int]]:
    """bos/eos/pad as FOLDER's generation_config.json names them, each one of the tokenizer's ids; {} when there is
    no such file or it is not valid (left out, as exports and conversions say in a warning: source_files)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        return special_ids(json_object(read_bounded(path, MAX_GENERATION_CONFIG_BYTES), path), path, id_space)
    except ValueError:
        return {}


def special_tokens(folder: Path, token_id: Any, *, add_bos: bool, bos_id: int | None, eos_ids: tuple[int, ...],
                   add_eos: bool = False, pad_id: int | None = None, config: dict[str, Any] | None = None,
                   id_space: int) -> SpecialTokens:
    """BOS/EOS/pad from FOLDER's tokenizer_config.json and generation_config.json, the tokenizer's own as defaults.

    id_space: how many ids the tokenizer has; a generation_config.json id outside them is not used.
    """
    tcfg = config if config is not None else _read_json(folder / "tokenizer_config.json")
    gen = _generation_ids(folder, id_space) if config is None else {}
    for key in ("bos", "eos", "pad"):
        value = _content(tcfg.get(f"{key}_token"))
        i = token_id(value) if isinstance(value, str) else None
        if i is None:
            continue
        if key == "bos":
            bos_id = i
        elif key == "eos":
            eos_ids = (i,)
        else:
            pad_id = i
    bos = gen.get("bos_token_id", bos_id)
    eos = gen.get("eos_token_id", list(eos_ids))
    pad = gen.get("pad_token_id", pad_id)
    add_bos = bool(tcfg.get("add_bos_token", add_bos))
    add_eos = bool(tcfg.get("add_eos_token", add_eos))
    return SpecialTokens(add_bos=add_bos, add_eos=add_eos, bos_id=bos if isinstance(bos, int) else None,
                         eos_ids=tuple(eos) if isinstance(eos, list) else (eos,),
                         pad_id=pad if isinstance(pad, int) else None)


def parse_ids(text: str) -> list[int]:
    """'1, 450 29871' -> [1, 450, 29871]."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--ids must be integers separated by spaces or commas, got {text!r}") from None


def check_vocab(ids: list[int], vocab_size: int, what: str = "--ids") -> None:
    """ValueError naming the first id outside 0..vocab_size-1."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _special_ids(special: SpecialTokens) -> list[tuple[str, int]]:
    """(name, id) of every BOS, EOS and pad id a tokenizer names."""
    named = [("bos", special.bos_id), *(("eos", i) for i in special.eos_ids), ("pad", special.pad_id)]
    return [(name, i) for name, i in named if i is not None]


def check_fits(tok: Tokenizer, vocab_size: int, model: str) -> None:
    """ValueError naming the tokenizer file, MODEL (its config) and the numbers when the tokenizer has an id that the
    model's vocab_size has no embedding row for: its largest, added tokens included (its BOS/EOS/pad ids are among
    its own ids: Tokenizer checks that when it opens the file)."""
    if tok.vocab_size > vocab_size:
        raise ValueError(f"{tok.path}: its token ids (added tokens included) go up to {tok.vocab_size - 1}, but "
                         f"{model} says vocab_size {vocab_size} (ids 0..{vocab_size - 1}): the model has no embedding "
                         f"for the rest, so this tokenizer is not the model's; give the model's own tokenizer")
