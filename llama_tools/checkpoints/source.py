"""The MODEL argument, resolved once at the edge into one typed value that every command passes down."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from ..modeling.config import ModelConfig
from .config_files import UnknownArchitecture, is_config_file, load_config, looks_like_path
from .gguf.read import UnmodelledGguf, is_gguf
from .gguf.tensors import read_gguf_headers
from .header_readers import PartialFile, _kind as file_kind, read_safetensors_header
from ..modeling.presets import preset_tokenizer
from .tokenizer import KINDS, Tokenizer, check_fits, check_vocab, find_tokenizer, parse_ids
from .weight_files import NO_WEIGHTS, WeightFiles, checkpoint_config, find_weight_files, read_headers

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


def resolve(spec: str | Path, *, weights_required_in_dir: bool = False, needs_data: bool = False) -> ModelSource:
    """MODEL -> ModelSource; one ValueError line for anything that is not a model.

    weights_required_in_dir: a directory with a config but no weight files is refused (commands that
    would otherwise run seeded random weights without being asked to; a config.json *file* asks).
    needs_data: the command reads the weights, so every weight file's header is read now and a partial file
    (data ending before its header says) is refused here, before anything is written (a GGUF always is).
    """
    if isinstance(spec, ModelSource):
        return spec
    text = str(spec)
    p = Path(text)
    check_model_path(text)
    if p.is_dir():
        path = p.resolve()
        tok = find_tokenizer(path)
        wf = find_weight_files(path)
        if wf is not None:
            if needs_data:
                read_headers(wf)  # milliseconds: sizes against headers, so a partial download is one line now
            return ModelSource(text, "checkpoint", checkpoint_config(p, wf), path, wf, tok)
        cfg = load_config(p)  # a config-only directory: "neither config.json nor params.json" when neither
        if weights_required_in_dir:
            raise ValueError(f"{p}: {NO_WEIGHTS}; to run seeded random weights, pass its config file "
                             f"({p / Path(cfg.source).name}) instead")
        return ModelSource(text, "config", cfg, path, None, tok)
    if is_gguf(p):  # one file that holds config, vocabulary and weights
        h = read_gguf_headers(p)
        return ModelSource(text, "checkpoint", h.cfg, p.resolve(), h.files, None)
    if p.is_file() and p.suffix.lower() in LONE_WEIGHT_SUFFIXES:
        if p.suffix.lower() == ".safetensors":
            read_safetensors_header(p)  # a partial download says so first
        raise ValueError(f"{p}: a weight file alone, without its config; `llama-tools count-params {text}` counts "
                         f"it from its header, other commands take the directory with its config.json")
    if looks_like_path(text):
        cfg = load_config(p)
        return ModelSource(text, "config", cfg, p.resolve(), None, find_tokenizer(p.resolve().parent))
    cfg = load_config(text)
    return ModelSource(text, "preset", cfg, None, None, preset_tokenizer(cfg.name))  # tiny ships one


# --- What count-params and report shapes take beyond a model we build -------------------------------------------

LONE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth")  # weight files count-params reads alone, by their headers
# A MODEL ending so names a file, never a preset (no preset name has a suffix like these).
FILE_SUFFIXES = (*LONE_WEIGHT_SUFFIXES, ".gguf", ".json", ".onnx")


def check_model_path(text: str) -> None:
    """MODEL meant as a path (path-like, or a file suffix): it exists, and is a directory or a regular file.

    Said as typed (`./tiny-hf` keeps its `./`), before anything would take it for a preset name; a FIFO or device
    is refused by its stat alone, never opened (a FIFO would block).
    """
    try:
        st = os.stat(text)
    except (FileNotFoundError, NotADirectoryError):
        if looks_like_path(text) or Path(text).suffix.lower() in FILE_SUFFIXES:
            what = "a broken symbolic link" if os.path.islink(text) else "no such file or directory"
            raise ValueError(f"{text}: {what}; MODEL is a preset name (`llama-tools presets`), a config.json or "
                             f"params.json, a checkpoint directory or a .gguf file") from None
        return  # not a path: a preset name, looked up by load_config
    except OSError as e:
        raise ValueError(f"{text}: cannot be read ({e.strerror})") from None
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise ValueError(f"{text}: is {file_kind(st.st_mode)}, not a regular file; MODEL is a checkpoint directory, "
                         f"a config.json or params.json, or a .gguf file")


@dataclass(frozen=True)
class ForeignConfig:
    """A config.json of an architecture no family here models, for transformers' module tree (transformers_count)."""

    spec: str  # as the user typed it
    path: Path  # the config file, absolute
    data: dict[str, Any]  # its parsed JSON

    @property
    def architecture(self) -> str:
        """The config's first `architectures` entry, else its model_type."""
        archs = self.data.get("architectures")
        return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else self.model_type

    @property
    def model_type(self) -> str:
        return str(self.data.get("model_type"))

    @property
    def name(self) -> str:
        """As config_from_hf names a model: its directory, or the file's stem."""
        return self.path.parent.name or self.path.stem

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.path,)


@dataclass(frozen=True)
class HeaderFiles:
    """Weight files counted from their headers alone: no config beside them, one of another architecture, or a
    partial file (header_count)."""

    spec: str
    path: Path  # a .safetensors, an index, a .gguf, a .bin/.pth, or a directory of such files; absolute
    reason: str  # why not the native way, said in the output


Countable = Union[ModelSource, ForeignConfig, HeaderFiles]


def resolve_countable(spec: str | Path) -> Countable:
    """MODEL for count-params: a model we build (resolve), else a foreign config, else weight files' headers.

    A family modelled here always goes the native way; only what resolve refuses for its architecture, its missing
    config or a partial file comes back as ForeignConfig or HeaderFiles. Anything else stays resolve's one line.
    """
    if isinstance(spec, (ModelSource, ForeignConfig, HeaderFiles)):
        return spec
    text = str(spec)
    p = Path(text)
    if p.is_file() and p.suffix.lower() in LONE_WEIGHT_SUFFIXES:
        return HeaderFiles(text, p.resolve(), "a weight file given alone")
    if p.is_dir() and not any(is_config_file(p / n) for n in ("config.json", "params.json")) and (
            find_weight_files(p) is not None or any(p.glob("*.gguf"))):
        return HeaderFiles(text, p.resolve(), "no config.json beside the weights")
    try:
        return resolve(text)
    except UnknownArchitecture as e:
        if isinstance(e.data.get("weight_map"), dict):  # an index: its JSON is no config
            return HeaderFiles(text, e.path.resolve(), "a weight index given alone")
        if p.is_dir() and find_weight_files(p) is not None:
            return HeaderFiles(text, p.resolve(), f"{e.path.name} is of architecture {_arch(e.data)}, which no "
                                                  f"family here models")
        if isinstance(e.data.get("model_type"), str):
            return ForeignConfig(text, e.path.resolve(), e.data)
        raise
    except UnmodelledGguf as e:
        return HeaderFiles(text, p.resolve(), str(e).removeprefix(f"{p}: "))
    except PartialFile as e:
        if not p.exists():
            raise
        return HeaderFiles(text, p.resolve(), f"{e.path.name} is partial")


def _arch(data: dict[str, Any]) -> str:
    archs = data.get("architectures")
    return repr(archs[0] if isinstance(archs, list) and archs else data.get("model_type"))


# --- MODEL's tokenizer: the tokenizer files found beside it (tokenizer.py reads them) -------------------------

def load_tokenizer(source: ModelSource, *, fits: bool = True) -> Tokenizer | None:
    """MODEL's tokenizer (KINDS decides the library), or None when it has none; one line naming the file when it is
    not usable. fits: also refused (naming both files) when it has ids past the model's vocab_size (check_fits), as
    every command that runs the model needs; `tokenize` alone reads the tokenizer without the model."""
    found = find_tokenizer(source.path)
    if found is None and source.tokenizer is not None:  # e.g. one shipped with a preset
        found = source.tokenizer
    if found is None:
        return None
    tok = Tokenizer(found)
    if fits:
        check_fits(tok, source.cfg.vocab_size, source.cfg.source or source.spec)
    return tok


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
        check_vocab(out, source.cfg.vocab_size)
    elif tok is None:
        raise no_tokenizer(source, "encode --prompt; pass --ids instead")
    else:
        out = tok.encode(prompt or "", bos=bos)
        if not out:
            raise ValueError(f"--prompt {prompt!r} encodes to no tokens; give some text")
        check_vocab(out, source.cfg.vocab_size, f"{tok.path} (encoding --prompt)")  # the tokenizer's ids, not --ids
    return out, tok
