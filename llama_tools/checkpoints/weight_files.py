"""A checkpoint directory's weight files: which they are, that the set is whole, their headers, its config."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..modeling.config import ModelConfig
from .config_files import config_from_hf, config_from_meta, is_config_file, read_json
from .formats import CheckpointFormat
from .header_readers import HeaderError, TensorInfo, read_safetensors_header, real_path
from .torch_headers import read_torch_header

# What a directory may hold, in the order looked for. HF's model*.safetensors before any *.safetensors:
# Mistral repos also ship the same weights as consolidated.safetensors.
INDEX_FILES = (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin"))
FILE_PATTERNS = ((("model*.safetensors", "*.safetensors"), "safetensors"), (("pytorch_model*.bin",), "bin"),
                 (("consolidated.*.pth",), "meta"))
NO_WEIGHTS = "no weight files (model*.safetensors, pytorch_model*.bin or consolidated.NN.pth)"


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of a checkpoint directory, in load order."""

    kind: str  # "safetensors", "bin" (pytorch_model*.bin) or "meta" (consolidated.NN.pth)
    files: tuple[Path, ...]
    index: Path | None = None  # model.safetensors.index.json / pytorch_model.bin.index.json
    weight_map: dict[str, str] | None = None  # tensor name -> file name, from the index


# --- Finding the files ----------------------------------------------------------------------------

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.(safetensors|bin)$")


def _check_shard_set(directory: Path, files: list[Path]) -> None:
    """model-0000x-of-0000y files without an index: all y must be there."""
    totals = {int(m.group(2)) for f in files if (m := _SHARD.search(f.name))}
    for total in totals:
        have = {int(m.group(1)) for f in files if (m := _SHARD.search(f.name)) and int(m.group(2)) == total}
        gone = sorted(set(range(1, total + 1)) - have)
        if gone:
            example = _SHARD.sub(f"-{gone[0]:05d}-of-{total:05d}.\\3", files[0].name)
            raise ValueError(f"{directory / example}: missing shard {gone[0]} of {total}")


def _inside(d: Path, f: Path, index: Path | None = None) -> Path:
    """f, when it is a file of directory d: resolved (symlinks followed) it stays in d.

    One exception keeps the Hugging Face hub cache working: a snapshot's files are symlinks into the same
    repository's blobs/ (snapshots/<rev>/x -> ../../blobs/<hash>).
    """
    real_d, real_f = real_path(d), real_path(f)  # a symlink loop is one line naming it
    if real_f.parent == real_d:
        return f
    if real_d.parent.name == "snapshots" and real_f.parent == real_d.parent.parent / "blobs":
        return f
    by = f"{index} names {f.name!r}, which" if index else f"{f}"
    raise HeaderError(f"{by} resolves to {real_f}, outside {real_d}: weight files must lie in the checkpoint "
                      f"directory")


def _index_names(index: Path, d: Path) -> tuple[dict[str, str], list[str]]:
    """An index's weight_map, every value a plain file name of d (no path, no '..', no way out of d)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no 'weight_map' object naming the shard of each tensor")
    for k, v in weight_map.items():
        if not isinstance(v, str):
            raise ValueError(f"{index}: weight_map[{k[:80]!r}] is {str(v)[:40]}, not a file name")
        if v in ("", ".", "..") or "/" in v or "\\" in v or "\0" in v or Path(v).name != v:
            raise ValueError(f"{index}: weight_map[{k[:80]!r}] names {v[:80]!r}: shards must be plain file names "
                             f"in {d}, not paths")
    names = list(dict.fromkeys(weight_map.values()))
    for n in names:
        if not (d / n).is_file():
            raise ValueError(f"{index}: names shard {n!r}, which is not a regular file in {d}")
        _inside(d, d / n, index)
    return weight_map, names


def find_weight_files(directory: str | Path) -> WeightFiles | None:
    """Which weight files a directory holds (None: none, i.e. a config-only directory)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    for index_name, kind in INDEX_FILES:
        index = d / index_name
        if index.exists() or index.is_symlink():
            weight_map, names = _index_names(index, d)
            return WeightFiles(kind, tuple(d / n for n in names), index, weight_map)
    for patterns, kind in FILE_PATTERNS:
        files = next((found for p in patterns if (found := sorted(d.glob(p)))), [])
        files = [_inside(d, f) for f in files]
        if files and kind == "meta":
            return WeightFiles(kind, _check_meta_shards(d, files))
        if files:
            _check_shard_set(d, files)
            return WeightFiles(kind, tuple(files))
    return None


def has_weights(directory: str | Path) -> bool:
    """Whether a directory holds weight files (a config-only directory means random init)."""
    return find_weight_files(directory) is not None


def _check_meta_shards(d: Path, shards: list[Path]) -> tuple[Path, ...]:
    """consolidated.00.pth .. consolidated.NN.pth, none missing, in shard order."""
    numbers = []
    for f in shards:
        # At most 6 digits: the number is only ever compared with how many shards there are (never looped to).
        m = re.fullmatch(r"consolidated\.(\d{1,6})\.pth", f.name)
        if not m:
            raise ValueError(f"{f}: unexpected shard name; Meta shards are consolidated.00.pth, consolidated.01.pth, ...")
        numbers.append(int(m.group(1)))
    have = set(numbers)
    if len(have) != len(numbers):
        dup = next(n for i, n in enumerate(numbers) if n in numbers[:i])
        raise ValueError(f"{d}: two files are model-parallel shard {dup} "
                         f"({', '.join(f.name for f, n in zip(shards, numbers) if n == dup)}); keep one")
    gone = next((k for k in range(len(have) + 1) if k not in have), None)
    if max(numbers) + 1 != len(have) and gone is not None:
        raise ValueError(f"{d / f'consolidated.{gone:02d}.pth'}: missing model-parallel shard {gone} "
                         f"of {max(numbers) + 1}")
    return tuple(sorted(shards, key=lambda f: int(f.name.split(".")[1])))


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> Path:
    """model.safetensors.index.json, as HF writes it beside sharded files."""
    path = directory / INDEX_FILES[0][0]
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n",
                    encoding="utf-8")
    return path


def read_headers(wf: WeightFiles) -> list[list[TensorInfo]]:
    """Per file, its tensors; an index must agree with the files it names. A partial file is refused (PartialFile)."""
    per_file = [read_safetensors_header(f) if wf.kind == "safetensors" else read_torch_header(f) for f in wf.files]
    check_index(wf, per_file)
    return per_file


def check_index(wf: WeightFiles, per_file: list[list[TensorInfo]]) -> None:
    """An index's weight_map must name, for every tensor, the file that holds it."""
    if wf.weight_map is None:
        return
    where = {t.name: t.file for infos in per_file for t in infos}
    for name, fname in wf.weight_map.items():
        if where.get(name) != fname:
            raise ValueError(f"{wf.index}: says {name!r} is in {fname}, but "
                             + (f"it is in {where[name]}" if name in where else "no shard holds it"))


def index_files(index: Path) -> WeightFiles:
    """The files an index (model.safetensors.index.json or any other name) names, checked as find_weight_files does."""
    d = index.parent
    weight_map, names = _index_names(index, d)
    kind = "bin" if all(n.endswith(".bin") for n in names) else "safetensors"
    return WeightFiles(kind, tuple(d / n for n in names), index, weight_map)


def checkpoint_config(directory: str | Path, wf: WeightFiles | None = None,
                      headers: list[list[TensorInfo]] | None = None) -> ModelConfig:
    """config.json or params.json; Meta's vocab_size -1 is read from tok_embeddings' stored shape."""
    d = Path(directory)
    if is_config_file(d / "config.json"):
        return config_from_hf(read_json(d / "config.json"), d / "config.json")
    if not is_config_file(d / "params.json"):
        raise ValueError(f"{d}: checkpoint directory has neither config.json nor params.json")
    data = read_json(d / "params.json")
    vocab = None
    if not isinstance(data.get("vocab_size"), int) or data["vocab_size"] <= 0:
        if headers is None and wf is not None:
            headers = read_headers(wf)
        emb = next((t for infos in (headers or []) for t in infos if t.name == "tok_embeddings.weight"), None)
        vocab = emb.shape[0] if emb and emb.shape else None
    return config_from_meta(data, d / "params.json", vocab_size=vocab)


@dataclass(frozen=True)
class CheckpointHeaders:
    """A checkpoint directory read as far as its headers go: files, config, whole tensors, format."""

    directory: Path
    files: WeightFiles
    per_file: list[list[TensorInfo]]  # as each file stores them
    cfg: ModelConfig  # the config file's, q/k rows as the config says
    tensors: list[TensorInfo]  # Meta shards merged into whole tensors
    format: CheckpointFormat
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # dtype -> (weights, bytes) per block
