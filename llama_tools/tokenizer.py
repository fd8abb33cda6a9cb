"""The checkpoint's `tokenizer.model` through sentencepiece: text <-> ids, BOS as the paper shows (`<s>` = id 1).

Byte fallback: a character outside the vocabulary becomes its UTF-8 bytes, one piece each
(the paper's "啊" -> <0xE5> <0x95> <0x8A>), so every text round-trips.
"""

from __future__ import annotations

from pathlib import Path

from .source import ModelSource


class Tokenizer:
    """A sentencepiece model: encode (optionally with BOS/EOS), decode, pieces."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such tokenizer file")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.path}: not a sentencepiece model ({str(e).splitlines()[0]})") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(self.sp.EncodeAsIds(text))
        if bos and self.bos_id >= 0:
            ids = [self.bos_id] + ids
        if eos and self.eos_id >= 0:
            ids = ids + [self.eos_id]
        return ids

    def check_ids(self, ids: list[int]) -> None:
        """ValueError naming the first id outside the vocabulary."""
        check_vocab(ids, self.vocab_size, str(self.path))

    def decode(self, ids: list[int]) -> str:
        self.check_ids(ids)
        return self.sp.DecodeIds(list(ids))

    def pieces(self, ids: list[int]) -> list[str]:
        self.check_ids(ids)
        return [self.sp.IdToPiece(i) for i in ids]


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


def prompt_ids(source: ModelSource, prompt: str | None, ids: str | None, bos: bool = True) -> tuple[list[int], Tokenizer | None]:
    """The prompt as ids, checked against the vocabulary: --ids raw, or --prompt through MODEL's tokenizer.model."""
    if (prompt is None) == (ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --ids '1 2 3'")
    tok = Tokenizer(source.tokenizer) if source.tokenizer is not None else None
    if ids is not None:
        out = parse_ids(ids)
        if not out:
            raise ValueError("--ids: no token ids given")
    elif tok is None:
        raise ValueError(f"{source.spec}: no tokenizer.model there to encode --prompt; pass --ids instead")
    else:
        out = tok.encode(prompt or "", bos=bos)
    check_vocab(out, source.cfg.vocab_size)
    return out, tok
