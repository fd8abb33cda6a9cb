"""What a model's own files say beside its weights, read bounded and checked, so exports and conversions carry it.

Every client file we write keeps the source's word: the bos/eos/pad ids as its config.json and generation_config.json
write them (eos may be a list), generation_config.json byte for byte, the chat template in the form it ships
(chat_template.jinja, or tokenizer_config.json's `chat_template`), the tokenizer files byte for byte. A file that is
not valid is left out with a one-line warning naming it. A template is only parsed, in jinja2's sandbox, never
rendered here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..modeling.config import ModelConfig
from .header_readers import MAX_HEADER_BYTES, json_object, open_regular

ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# What onnxruntime-genai's model builder takes from generation_config.json into genai_config.json's `search`
# (make_genai_config: do_sample, temperature, top_k, top_p; the ids go to `model`).
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")
TOP_K_WHEN_SAMPLING = 50  # transformers' GenerationConfig default, which the builder also writes when none is given
# Tokenizer files as transformers' save_pretrained leaves them: the fast file, the slow ones, the template file.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
MAX_TEMPLATE_BYTES = 1 << 20  # as tokenizer.read_chat_template: the largest real templates are tens of kB
MAX_GENERATION_CONFIG_BYTES = 1 << 20  # a real one is a few hundred bytes
MAX_TOKENIZER_FILE_BYTES = 512 << 20  # the largest real tokenizer.json files are tens of MB


@dataclass
class SourceFiles:
    """What a source folder says beside the weights, checked; `warnings` name what was left out and why."""

    folder: Path | None
    has_config: bool  # config.json is there: an id it leaves out is one the source does not name
    config_ids: dict[str, int | list[int]]  # bos/eos/pad as config.json writes them (the ones it names)
    generation_raw: bytes | None  # generation_config.json's bytes; None when absent or left out
    generation: dict[str, Any] | None  # the same, parsed
    generation_ids: dict[str, int | list[int]]  # bos/eos/pad as generation_config.json writes them
    warnings: list[str] = field(default_factory=list)


def _shown(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (bool, int, float, str, list, dict, type(None))) else repr(v)
    return text[:60] + ("..." if len(text) > 60 else "")


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most LIMIT; ValueError (one line) for a FIFO, device or bigger file."""
    with open_regular(path) as f:  # a FIFO named like a config never blocks
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: over {limit:,} bytes: not a file of this kind")
    return data


def _is_id(v: Any, vocab_size: int) -> bool:
    return type(v) is int and 0 <= v < vocab_size


def special_ids(data: dict[str, Any], path: Path, vocab_size: int) -> dict[str, int | list[int]]:
    """bos/eos/pad as DATA writes them (null ones left out); ValueError naming the first that is no token id."""
    out: dict[str, int | list[int]] = {}
    for key in ID_KEYS:
        v = data.get(key)
        if v is None:
            continue
        ok = (_is_id(v, vocab_size) or (key == "eos_token_id" and isinstance(v, list) and v
                                          and all(_is_id(i, vocab_size) for i in v)))
        if not ok:
            allowed = " (or a non-empty list of them)" if key == "eos_token_id" else ""
            raise ValueError(f"{path}: field {key!r} must be a token id in 0..{vocab_size - 1}{allowed}, "
                             f"got {_shown(v)}")
        out[key] = list(v) if isinstance(v, list) else v
    return out


def check_sampling(data: dict[str, Any], path: Path) -> None:
    """ValueError naming the first sampling field (SAMPLING_KEYS) a client could not use as written."""
    checks = {
        "do_sample": (lambda v: isinstance(v, bool), "true or false"),
        "temperature": (lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0, "a number >= 0"),
        "top_k": (lambda v: type(v) is int and v >= 0, "an integer >= 0"),
        "top_p": (lambda v: type(v) in (int, float) and 0 <= v <= 1, "a number in [0, 1]"),
    }
    for key, (good, what) in checks.items():
        if data.get(key) is not None and not good(data[key]):
            raise ValueError(f"{path}: field {key!r} must be {what}, got {_shown(data[key])}")


def lone_surrogate(text: str) -> str | None:
    """Where TEXT holds a lone surrogate, which no UTF-8 text can ("a lone surrogate U+DC80 at character 4"); None
    when it holds none."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"


def template_problem(text: Any) -> str | None:
    """None when TEXT parses as a Jinja template (jinja2's sandbox; nothing is rendered), else why not, briefly."""
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(text, str):
        return f"a template must be a string, got {_shown(text)}"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
        return f"over {MAX_TEMPLATE_BYTES:,} bytes"
    where = lone_surrogate(text)
    if where:  # a JSON escape such as "\udc80": no UTF-8 file (a client's config, a GGUF) can hold it
        return f"not UTF-8 text ({where})"
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    except RecursionError:
        return "nested too deeply"
    return None


def _field_templates(value: Any) -> list[Any]:
    """tokenizer_config.json's chat_template: one string, or a list of {"name", "template"} (transformers' form)."""
    if isinstance(value, list):
        return [t.get("template") if isinstance(t, dict) else t for t in value]
    return [value]


def checked_tokenizer_config(data: bytes, path: Path) -> tuple[bytes, str | None]:
    """tokenizer_config.json's bytes as they are, or rewritten without a `chat_template` that does not parse (why)."""
    try:
        config = json_object(data, path)
    except ValueError:
        return data, None  # not ours to judge here: the tokenizer kind that reads it refuses it in its own words
    if config.get("chat_template") is None:
        return data, None
    why = next((p for p in map(template_problem, _field_templates(config["chat_template"])) if p), None)
    if why is None:
        return data, None
    kept = {k: v for k, v in config.items() if k != "chat_template"}
    return ((json.dumps(kept, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
            f"{path}: its chat_template is not a valid Jinja template ({why}); left out of the copy")


def template_of_config(path: Path) -> tuple[str | None, str | None]:
    """(the valid chat template a tokenizer_config.json names in its `chat_template` field (a string), or None;
    why a template it names is left out (a warning naming the file and key), or None)."""
    try:
        config = json_object(read_bounded(path, MAX_HEADER_BYTES), path)
    except (OSError, ValueError):
        return None, None
    t = config.get("chat_template")
    if not isinstance(t, str):
        return None, None
    why = template_problem(t)
    return (t, None) if why is None else (None, f"{path}: chat_template is left out of the client files ({why})")


def tokenizer_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """TOKENIZER_FILES in FOLDER (name -> path: bounded regular files, a template that parses) and what was left out."""
    found: dict[str, Path] = {}
    warnings: list[str] = []
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        why = None
        try:
            if name == "chat_template.jinja":
                why = template_problem(read_bounded(path, MAX_TEMPLATE_BYTES).decode("utf-8"))
            elif path.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
                why = f"over {MAX_TOKENIZER_FILE_BYTES:,} bytes"
        except UnicodeDecodeError as e:
            why = f"not UTF-8 text (byte {e.start})"
        except (OSError, ValueError) as e:
            why = str(e).splitlines()[0].removeprefix(f"{path}: ")
        if why:
            what = "a valid Jinja chat template" if name == "chat_template.jinja" else "a tokenizer file to copy"
            warnings.append(f"{path}: not {what} ({why}); not copied")
            continue
        found[name] = path
    return found, warnings


def read_source_files(folder: Path | None, vocab_size: int) -> SourceFiles:
    """config.json's ids and generation_config.json (bytes, values, ids) of FOLDER, each checked; None: nothing."""
    word = SourceFiles(folder, False, {}, None, None, {})
    if folder is None:
        return word
    config = folder / "config.json"
    if config.is_file():
        word.has_config = True
        try:
            data = json_object(read_bounded(config, MAX_HEADER_BYTES), config)
            word.config_ids = special_ids(data, config, vocab_size)
        except (OSError, ValueError) as e:  # the config was read once already: this is about its ids only
            word.warnings.append(f"{str(e).splitlines()[0]}; the model config's ids are used instead")
    gen = folder / "generation_config.json"
    if gen.exists():
        try:
            raw = read_bounded(gen, MAX_GENERATION_CONFIG_BYTES)
            data = json_object(raw, gen)
            ids = special_ids(data, gen, vocab_size)
            check_sampling(data, gen)
        except (OSError, ValueError) as e:
            word.warnings.append(f"{str(e).splitlines()[0]}; generation_config.json not carried")
        else:
            word.generation_raw, word.generation, word.generation_ids = raw, data, ids
    return word


def agreeing_ids(source_ids: dict[str, int | list[int]], cfg: ModelConfig) -> dict[str, int | list[int]]:
    """The source's ids whose (first) value is the model config's own: how it writes them, an eos list kept."""
    own = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    # A disagreeing file is another model's word (a config given apart from its folder): the config's stands.
    return {k: v for k, v in source_ids.items() if own[k] is None or first(v) == own[k]}
