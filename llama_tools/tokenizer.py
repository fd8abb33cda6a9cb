"""Text <-> ids with the checkpoint's own tokenizer: tokenizer.json through HF's `tokenizers`, tokenizer.model through
sentencepiece, a GGUF file's vocabulary through tokenizer.json built from it (tokenizer_files).

Which library reads which file is one registry (KINDS). BOS/EOS follow the checkpoint: tokenizer_config.json
(add_bos_token, bos_token, eos_token) and generation_config.json (bos_token_id, eos_token_id, maybe a list) beside
the tokenizer; without them, what the tokenizer itself says (SmolLM2 adds no BOS; LLaMA-2's `<s>` = id 1 does).

Byte fallback (sentencepiece and LLaMA-style tokenizer.json): a character outside the vocabulary becomes its
UTF-8 bytes, one piece each (the paper's "啊" -> <0xE5> <0x95> <0x8A>), so every text round-trips.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import tokenizer_files


@dataclass(frozen=True)
class SpecialTokens:
    """What the checkpoint says about BOS/EOS: whether encode adds them, and their ids."""

    add_bos: bool
    add_eos: bool
    bos_id: int | None
    eos_ids: tuple[int, ...]  # generation stops at any of them (generation_config.json may list several)


class Tokenizer:
    """A tokenizer file opened by its kind (KINDS): encode (BOS/EOS as the checkpoint says), decode, pieces.

    Tokenizer(path) returns the subclass that reads PATH's kind.
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
        return self._decode(list(ids))

    def pieces(self, ids: list[int]) -> list[str]:
        self.check_ids(ids)
        return [self._piece(i) for i in ids]


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece tokenizer.model; without a tokenizer_config.json, BOS is added (LLaMA's convention)."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        super().__init__(path)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.path}: not a sentencepiece model ({str(e).splitlines()[0]})") from None
        own_bos, own_eos = self.sp.bos_id(), self.sp.eos_id()
        self.special = special_tokens(self.path.parent, self.token_id, add_bos=True,
                                      bos_id=own_bos if own_bos >= 0 else None,
                                      eos_ids=(own_eos,) if own_eos >= 0 else ())
        self.chat_template = read_chat_template(self.path.parent)

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
            text = self.path.read_text(encoding="utf-8", errors="replace")
        try:
            self.tk = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own Exception subclass  # noqa: BLE001
            raise ValueError(f"{self.path}: not a tokenizer.json that the tokenizers library reads "
                             f"({str(e).splitlines()[0][:200]})") from None
        # What the file's post-processor adds around a text: transformers' fast tokenizers follow it.
        bare = self.tk.encode("a", add_special_tokens=False).ids
        full = self.tk.encode("a", add_special_tokens=True).ids
        start = full.index(bare[0]) if bare and bare[0] in full else 0
        before, after = full[:start], full[start + len(bare):]
        self.special = special_tokens(self.path.parent, self.token_id, add_bos=bool(before),
                                      add_eos=bool(after), bos_id=before[0] if before else None,
                                      eos_ids=tuple(after[-1:]), config=config)
        self.chat_template = read_chat_template(self.path.parent, config)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    return data if isinstance(data, dict) else {}


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


def special_tokens(folder: Path, token_id: Any, *, add_bos: bool, bos_id: int | None, eos_ids: tuple[int, ...],
                   add_eos: bool = False, config: dict[str, Any] | None = None) -> SpecialTokens:
    """BOS/EOS from FOLDER's tokenizer_config.json and generation_config.json, the tokenizer's own as defaults."""
    tcfg = config if config is not None else _read_json(folder / "tokenizer_config.json")
    gcfg = _read_json(folder / "generation_config.json") if config is None else {}
    for key, value in (("bos", _content(tcfg.get("bos_token"))), ("eos", _content(tcfg.get("eos_token")))):
        i = token_id(value) if isinstance(value, str) else None
        if i is not None and key == "bos":
            bos_id = i
        elif i is not None:
            eos_ids = (i,)
    if isinstance(gcfg.get("bos_token_id"), int):
        bos_id = gcfg["bos_token_id"]
    eos = gcfg.get("eos_token_id")
    if isinstance(eos, int) or (isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos)):
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    add_bos = bool(tcfg.get("add_bos_token", add_bos))
    add_eos = bool(tcfg.get("add_eos_token", add_eos))
    return SpecialTokens(add_bos=add_bos, add_eos=add_eos, bos_id=bos_id, eos_ids=eos_ids)


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
