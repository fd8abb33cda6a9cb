"""The MODEL argument, resolved once at the edge into one typed value that every command passes down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .config import ModelConfig
from .config_files import load_config, looks_like_path
from .gguf_files import is_gguf, read_gguf_headers
from .presets import preset_tokenizer
from .tokenizer import KINDS, Tokenizer, check_vocab, find_tokenizer, parse_ids
from .weight_files import NO_WEIGHTS, WeightFiles, checkpoint_config, find_weight_files

MAX_RANDOM_INIT_BYTES = 8 * 2**30  # seeded weights above this are refused (load_model) rather than materialized

SourceKind = Literal["preset", "config", "checkpoint"]
# What commands read beside the weights or a config file: configs, tokenizers (genai copies them).
READ_BESIDE = ("config.json", "params.json", "generation_config.json", "tokenizer.model", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ModelSource:
    """A preset name, a config file, a checkpoint directory or a GGUF file: what it is, its config, weights and tokenizer."""

    spec: str  # as the user typed it
    kind: SourceKind
    cfg: ModelConfig
    path: Path | None  # absolute; None for a preset
    weights: WeightFiles | None  # a checkpoint's files; None means seeded random weights
    tokenizer: Path | None  # tokenizer.json or tokenizer.model beside the config or weights (tokenizer.KINDS)

    @property
    def label(self) -> str:
        """What export metadata records: the preset's name or the absolute path, found again from anywhere."""
        return str(self.path) if self.path is not None else self.cfg.name

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file a command may read for this model (weights, index, config, tokenizer): never an output."""
        if self.path is None:
            return ()
        d = self.path if self.path.is_dir() else self.path.parent
        found = [*(self.weights.files if self.weights else ()), *([self.weights.index] if self.weights and
                                                                   self.weights.index else [])]
        if not self.path.is_dir():
            found.append(self.path)  # a config file given by name
        found += [d / n for n in READ_BESIDE if (d / n).is_file()]
        return tuple(dict.fromkeys(found))

    @property
    def seeded(self) -> bool:
        """Random weights from a seed (a preset or config), not a checkpoint's."""
        return self.weights is None


def resolve(spec: str | Path, *, weights_required_in_dir: bool = False) -> ModelSource:
    """MODEL -> ModelSource; one ValueError line for anything that is not a model.

    weights_required_in_dir: a directory with a config but no weight files is refused (commands that
    would otherwise run seeded random weights without being asked to; a config.json *file* asks).
    """
    if isinstance(spec, ModelSource):
        return spec
    text = str(spec)
    p = Path(text)
    if p.is_dir():
        path = p.resolve()
        tok = find_tokenizer(path)
        wf = find_weight_files(path)
        if wf is not None:
            return ModelSource(text, "checkpoint", checkpoint_config(p, wf), path, wf, tok)
        cfg = load_config(p)  # a config-only directory: "neither config.json nor params.json" when neither
        if weights_required_in_dir:
            raise ValueError(f"{p}: {NO_WEIGHTS}; to run seeded random weights, pass its config file "
                             f"({p / Path(cfg.source).name}) instead")
        return ModelSource(text, "config", cfg, path, None, tok)
    if is_gguf(p):  # one file that holds config, vocabulary and weights
        h = read_gguf_headers(p)
        return ModelSource(text, "checkpoint", h.cfg, p.resolve(), h.files, None)
    if looks_like_path(text):
        cfg = load_config(p)
        return ModelSource(text, "config", cfg, p.resolve(), None, find_tokenizer(p.resolve().parent))
    cfg = load_config(text)
    return ModelSource(text, "preset", cfg, None, None, preset_tokenizer(cfg.name))  # tiny ships one


# --- MODEL's tokenizer: the tokenizer files found beside it (tokenizer.py reads them) -------------------------

def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """MODEL's tokenizer (KINDS decides the library), or None when it has none."""
    found = find_tokenizer(source.path)
    if found is None and source.tokenizer is not None:  # e.g. one shipped with a preset
        found = source.tokenizer
    return Tokenizer(found) if found is not None else None


def no_tokenizer(source: ModelSource, need: str) -> ValueError:
    """The one-line refusal when MODEL has no tokenizer file for NEED."""
    return ValueError(f"{source.spec}: no tokenizer there ({' or '.join(k.patterns[0] for k in KINDS)}) to {need}")


def prompt_ids(source: ModelSource, prompt: str | None, ids: str | None,
               bos: bool | None = None) -> tuple[list[int], Tokenizer | None]:
    """The prompt as ids, checked against the vocabulary: --ids raw, or --prompt through MODEL's tokenizer.

    bos None: as the checkpoint says. The tokenizer comes back (None when MODEL has none) for decoding the output.
    """
    if (prompt is None) == (ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --ids '1 2 3'")
    tok = load_tokenizer(source)
    if ids is not None:
        out = parse_ids(ids)
        if not out:
            raise ValueError("--ids: no token ids given")
    elif tok is None:
        raise no_tokenizer(source, "encode --prompt; pass --ids instead")
    else:
        out = tok.encode(prompt or "", bos=bos)
        if not out:
            raise ValueError(f"--prompt {prompt!r} encodes to no tokens; give some text")
    check_vocab(out, source.cfg.vocab_size)
    return out, tok
