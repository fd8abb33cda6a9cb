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

A tokenizer.json is a program of sorts (regexes, a matcher for its added tokens): the tokenizers library reads and
runs it only in a worker process (JsonTokenizer), bounded in memory for its life and in time for each call, its
panic text kept off the terminal; a file past a bound is refused in one line naming it and, where known, its key.
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

# The tokenizers library runs a tokenizer.json in a worker process (JsonTokenizer) bounded in memory for its life and
# in time per call. Real ones load in well under the bound (Gemma 3's 262k entries, 33 MB: about 250 MiB, 1 s); a
# vocabulary of 10^7 entries took 2.5 GB, one special token of 30 MB 2.2 GB, a pattern that backtracks minutes.
LIBRARY_MEMORY_BYTES = 640 << 20
LOAD_SECONDS = 20.0
# A tokenizer.json read here: the largest real ones are tens of MB (Gemma 3's: 33), and the worker's memory holds
# its text twice beside the library's own, so the file stays well inside the bound (source_files' 512 MB would not).
MAX_TOKENIZER_JSON_BYTES = 128 << 20
MAX_ADDED_TOKEN_CHARS = 4096  # real ones: tens of characters (a chat marker, a run of spaces)
MAX_ANSWER_BYTES = 256 << 20  # ids of a long text as JSON
# A call's time: a base for a busy machine, then 20 us a character (or id): ordinary tokenizers take about 1 us.
SECONDS_BASE, SECONDS_PER_ITEM = 2.0, 20e-6


def seconds(n: int) -> float:
    """How long the library may take for a text of N characters (or N ids)."""
    return SECONDS_BASE + n * SECONDS_PER_ITEM


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
    """HF's tokenizer.json through `tokenizers`; BOS as tokenizer_config.json says, else as its post-processor does.

    The library reads the file and runs on text only in a worker process (outputs.bounded.Worker): its memory is
    bounded (LIBRARY_MEMORY_BYTES: a vocabulary of 10^7 entries, a special token of 30 MB), each encode and decode in
    time (seconds(n): a pattern that backtracks), and a Rust panic's text never reaches the terminal; each is refused
    in one line naming the file and, for a pattern, its key.
    """

    def __init__(self, path: str | Path, *, text: str | None = None, config: dict[str, Any] | None = None):
        from ..outputs.bounded import Worker

        self.path = Path(path)
        if text is None:
            super().__init__(path)
            size = self.path.stat().st_size
            if size > MAX_TOKENIZER_JSON_BYTES:
                raise ValueError(f"{self.path}: {size:,} bytes, over {MAX_TOKENIZER_JSON_BYTES:,} bytes: the largest "
                                 f"real tokenizer.json files are tens of MB, and the tokenizers library needs several "
                                 f"times a file's size in memory; give a real tokenizer")
            raw = read_bounded(self.path, MAX_TOKENIZER_JSON_BYTES)  # a FIFO never blocks, nor a file that grows
        else:
            raw = text.encode("utf-8")
        self._raw = raw  # read again by a worker started anew, and measured when it does not load
        self._worker = Worker(lambda: _serve_tokenizer_json(self.path, raw), memory_bytes=LIBRARY_MEMORY_BYTES,
                              answer_bytes=MAX_ANSWER_BYTES, setup_seconds=LOAD_SECONDS)
        self._patterns: list[list[str]] = []
        hello = self._run(self._worker.start, "reading it")
        self._ids, self._patterns = hello["ids"], hello["patterns"]
        before, after, pad = hello["before"], hello["after"], hello["pad"]
        self.special = special_tokens(self.path.parent, self.token_id, add_bos=bool(before),
                                      add_eos=bool(after), bos_id=before[0] if before else None,
                                      eos_ids=tuple(after[-1:]), pad_id=pad if type(pad) is int else None,
                                      config=config, id_space=self._ids)
        self.chat_template = read_chat_template(self.path.parent, config)
        self._check_usable()

    def _run(self, fn: Callable[[], Any], doing: str) -> Any:
        """fn() (a call into the worker), its failures as one ValueError naming the file (and a pattern's key)."""
        from ..outputs.bounded import Exceeded, Raised

        linear = "a pattern that backtracks; give a tokenizer whose patterns run in time linear in the text"
        try:
            return fn()
        except Raised as e:
            if "Regex search error" in e.message:  # onig's own limit (retry-limit-in-match), raised as a Rust panic
                raise ValueError(f"{self.path}: {self._named_patterns()}: the regex engine gave up {doing} "
                                 f"({e.message.split(': ', 1)[-1][:120]}): {linear}") from None
            if e.kind == "ValueError" and e.message.startswith(f"{self.path}: "):
                raise ValueError(e.message) from None  # ours, made in the worker
            raise ValueError(f"{self.path}: its library failed {doing} ({e.message[:200] or e.kind})") from None
        except Exceeded as e:
            if doing == "reading it":
                raise ValueError(f"{self.path}: the tokenizers library {e} reading it (bound: "
                                 f"{LIBRARY_MEMORY_BYTES >> 20} MiB, {LOAD_SECONDS:g} s){_largest(self._raw)}; "
                                 f"give a smaller tokenizer") from None
            if self._patterns:
                raise ValueError(f"{self.path}: {self._named_patterns()}: the tokenizers library {e} {doing}: "
                                 f"{linear}") from None
            raise ValueError(f"{self.path}: the tokenizers library {e} {doing}") from None

    def _named_patterns(self) -> str:
        """The file's regex patterns by key, as a refusal names them (the first three)."""
        shown = [f"{key} {pattern[:80]!r}" for key, pattern in self._patterns[:3]]
        return ", ".join(shown) + (f" (and {len(self._patterns) - 3} more)" if len(self._patterns) > 3 else "") \
            if shown else "its patterns"

    @property
    def vocab_size(self) -> int:
        return self._ids

    def _encode(self, text: str) -> list[int]:
        return self._run(lambda: self._worker.call("encode", text, seconds=seconds(len(text))),
                         f"encoding {len(text):,} characters")

    def _decode(self, ids: list[int]) -> str:
        return self._run(lambda: self._worker.call("decode", ids, seconds=seconds(len(ids))),
                         f"decoding {len(ids):,} ids")

    def _piece(self, i: int) -> str:
        return self.pieces_of([i])[0]

    def pieces_of(self, ids: list[int]) -> list[str]:
        """The pieces of IDS (each one of its ids), in one call to the worker."""
        return self._run(lambda: self._worker.call("pieces", list(ids), seconds=seconds(len(ids))),
                         f"looking up {len(ids):,} ids")

    def pieces(self, ids: list[int]) -> list[str]:
        self.check_ids(ids)
        return self.pieces_of(ids)

    def token_id(self, piece: str) -> int | None:
        return self._run(lambda: self._worker.call("token_id", piece, seconds=seconds(len(piece))),
                         "looking up a token")


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


# --- The tokenizers library's side of JsonTokenizer: what runs in its worker process ------------------------------

def _serve_tokenizer_json(path: Path, raw: bytes) -> tuple[Callable[[str, Any], Any], dict[str, Any]]:
    """In the worker: RAW read by the library; (serve, what JsonTokenizer needs of it); ValueErrors name PATH."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); a tokenizer.json is JSON") from None
    _check_added_tokens(path, text)
    with library_errors(path, "not a tokenizer.json that the tokenizers library reads"):
        tk = HFTokenizer.from_str(text)
        del text
        padding = tk.padding
        # transformers encodes one text without the file's padding and truncation unless asked to, and so do
        # we: a length the file chooses (Fixed 10**9) is then never allocated, and no text is cut.
        tk.no_padding()
        tk.no_truncation()
        ids = max(tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    patterns = _patterns(tk)
    with library_errors(path, f"its library cannot encode text with it ({PROBE_TEXT!r})"):
        # What the file's post-processor adds around a text: transformers' fast tokenizers follow it.
        bare = tk.encode("a", add_special_tokens=False).ids
        full = tk.encode("a", add_special_tokens=True).ids
    start = full.index(bare[0]) if bare and bare[0] in full else 0
    pad = padding.get("pad_id") if isinstance(padding, dict) else None

    def serve(op: str, arg: Any) -> Any:
        if op == "encode":
            return tk.encode(arg, add_special_tokens=False).ids
        if op == "decode":
            return tk.decode(arg, skip_special_tokens=True)
        if op == "pieces":
            return [tk.id_to_token(i) for i in arg]
        if op == "token_id":
            return tk.token_to_id(arg)
        raise ValueError(f"no such operation {op!r}")

    return serve, {"ids": ids, "before": full[:start], "after": full[start + len(bare):],
                   "pad": pad if type(pad) is int else None, "patterns": patterns}


def _check_added_tokens(path: Path, text: str) -> None:
    """ValueError naming the first added token longer than MAX_ADDED_TOKEN_CHARS: the library's time to read one
    grows with its length squared (10^4 characters: 1 s; 10^5: a minute), long before the worker's memory bound.

    The array is found by its key and parsed alone (the whole file is the library's to parse); a key placed to
    mislead this only leaves the worker's bounds to stop the library.
    """
    import itertools
    import re

    decoder = json.JSONDecoder()
    for found in itertools.islice(re.finditer(r'"added_tokens"\s*:\s*\[', text), 3):  # the first is the real one
        try:
            tokens, _ = decoder.raw_decode(text, found.end() - 1)
        except ValueError:
            return  # the library says what is wrong with it
        for i, t in enumerate(tokens if isinstance(tokens, list) else []):
            content = t.get("content") if isinstance(t, dict) else None
            if isinstance(content, str) and len(content) > MAX_ADDED_TOKEN_CHARS:
                raise ValueError(f"{path}: added_tokens[{i}].content is {len(content):,} characters, past "
                                 f"{MAX_ADDED_TOKEN_CHARS:,}: the tokenizers library's time to read a token grows "
                                 f"with its length squared (10^5 characters: a minute); give a real tokenizer")


def _patterns(tk: Any) -> list[list[str]]:
    """[key, regex] of every regex the library runs on text (normalizer, pre-tokenizer, decoder), keyed as in the
    file: pre_tokenizer.pretokenizers[0].pattern."""
    found: list[list[str]] = []

    def walk(value: Any, at: str) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("Regex"), str):
                found.append([at, value["Regex"]])
            for k, v in value.items():
                walk(v, f"{at}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{at}[{i}]")

    for key in ("normalizer", "pre_tokenizer", "decoder"):
        part = getattr(tk, key)
        if part is not None:
            walk(json.loads(part.__getstate__()), key)
    return found


def _largest(raw: bytes) -> str:
    """What makes a tokenizer.json this large, for a refusal: its vocabulary's and merges' entries and its longest
    added token, from a parse in a child bounded in memory and to 5 s (so the refusal comes within 30 s of the
    start; one that runs out says only the file's size)."""
    from ..outputs.bounded import Exceeded, bounded_call

    def measure() -> list[str]:
        doc = json.loads(raw)
        model = doc.get("model") if isinstance(doc, dict) else None
        parts = [f"model.{k} {len(model[k]):,} entries" for k in ("vocab", "merges")
                 if isinstance(model, dict) and isinstance(model.get(k), (dict, list))]
        added = doc.get("added_tokens") if isinstance(doc, dict) else None
        sizes = [(len(t["content"]), i) for i, t in enumerate(added if isinstance(added, list) else [])
                 if isinstance(t, dict) and isinstance(t.get("content"), str)]
        if sizes:
            n, i = max(sizes)
            parts.append(f"added_tokens[{i}].content {n:,} characters")
        return parts

    try:
        parts = bounded_call(measure, seconds=5, memory_bytes=LIBRARY_MEMORY_BYTES, answer_bytes=4096)
    except Exceeded:
        return f"; {len(raw):,} bytes, too many to parse as JSON within the bound"
    return f"; it holds: {', '.join(parts)}" if parts else ""
