"""Load the weights LLaMA-family checkpoints ship in: HF safetensors/.bin (sharded or not), Meta .pth shards,
Baichuan's W_pack, InternLM2's wqkv.

Every path goes: find the files (weight_files.py) -> validate the headers -> read the tensors (memory-mapped)
-> map the stored names to the module's names through the format's table (formats.py) -> fix the
layout (layouts.py: split fused q/k/v, reorder q/k rows for RoPE) -> assign into a `Llama` built on the
meta device, so no random init is ever materialized.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..modeling.config import ModelConfig
from .formats import BENIGN_SUFFIXES, CheckpointFormat, checkpoint_tensors, detect_format, merge_meta_shards
from .layouts import permute_rope_rows, split_parts
from ..modeling.model import model_from_state
from ..outputs.progress import Progress, silent
from .inspection import read_checkpoint_headers
from .weight_files import WeightFiles, read_headers


@dataclass
class LoadedCheckpoint:
    """A checkpoint's config and its tensors under the module's (HF) names, in the rope layout of `cfg`."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    format: CheckpointFormat  # the format the files were in
    files: WeightFiles


def torch_load(path: Path) -> dict[str, torch.Tensor]:
    """torch.load restricted to tensors (weights_only), memory-mapped; anything else is refused, never run."""
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # the legacy non-zip format cannot be memory-mapped
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused: holds objects other than tensors ({first})") from None
    # A damaged record: torch says which, we name the file (TypeError: a size or stride past int64, which
    # read_torch_header refuses first when the headers are read).
    except (RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: cannot read torch file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        bad = type(obj).__name__ if not isinstance(obj, dict) else \
            next(type(v).__name__ for v in obj.values() if not isinstance(v, torch.Tensor))
        raise ValueError(f"{path}: refused: holds a {bad}, not only tensors")
    return obj


def _read_file(wf: WeightFiles, path: Path) -> dict[str, torch.Tensor]:
    if wf.kind == "safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:  # memory-mapped
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types  # noqa: BLE001
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: cannot read safetensors ({first})") from None
    return torch_load(path)


def read_tensors(directory: str | Path, cfg: ModelConfig, wf: WeightFiles,
                 progress: Progress = silent) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All stored tensors by stored name (Meta shards joined), plus the file each came from."""
    d = Path(directory)
    read_headers(wf)  # validates every header first: truncation, bad offsets, index vs files
    per_file = []
    for k, f in enumerate(wf.files):
        per_file.append(_read_file(wf, f))
        progress(k + 1, len(wf.files), f"read {f.name}")
    if wf.kind != "meta" or len(per_file) == 1:
        where = {k: f.name for f, sd in zip(wf.files, per_file) for k in sd}
        return {k: v for sd in per_file for k, v in sd.items()}, where
    label = f"consolidated.00-{len(per_file) - 1:02d}.pth"

    def join(name: str, parts: list[torch.Tensor], axis: int) -> torch.Tensor:
        # Column-parallel (wq, wk, wv, w1, w3, output) split rows, row-parallel (wo, w2, embeddings) columns.
        try:
            return torch.cat(parts, dim=axis)
        except RuntimeError:
            shapes = ", ".join(f"{f.name} {list(p.shape)}" for f, p in zip(wf.files, parts))
            raise ValueError(f"{d}: shards of tensor {name!r} do not join along axis {axis}: {shapes}") from None

    merged = merge_meta_shards(cfg, per_file, join, lambda k: str(wf.files[k]))
    return merged, {k: label for k in merged}


def read_checkpoint(directory: str | Path, rope_layout: str | None = None,
                    progress: Progress = silent) -> LoadedCheckpoint:
    """A checkpoint directory -> config + module-named tensors; rope_layout None keeps the files' own."""
    d = Path(directory)
    # Headers, config and their agreement (the decoder count first: a config saying 10^8 layers is refused
    # before anyone lists 10^8 layers' names), all before any tensor is read.
    h = read_checkpoint_headers(d)
    cfg, wf = h.cfg, h.files
    stored, where = read_tensors(d, cfg, wf, progress)
    fmt = detect_format(wf.kind, list(stored))
    state: dict[str, torch.Tensor] = {}
    for ct in checkpoint_tensors(cfg, fmt):
        if ct.name not in stored:
            files = ", ".join(f.name for f in wf.files)
            raise ValueError(f"{d}: tensor {ct.name!r} that the config predicts is in none of {files}")
        w = stored.pop(ct.name)
        if tuple(w.shape) != ct.shape:
            raise ValueError(f"{d / where[ct.name]}: tensor {ct.name!r} has shape {list(w.shape)}, but the config "
                             f"predicts {list(ct.shape)}; check {Path(cfg.source).name}")
        if len(ct.parts) == 1:
            state[ct.parts[0]] = w
        else:
            assert fmt.fused_qkv is not None, f"{fmt.name}: a multi-part tensor without a fusion rule"
            pieces = split_parts(w, ct.parts, fmt.fused_qkv, cfg, ct.name)
            state.update(zip(ct.parts, pieces))
    for name in list(stored):
        if name.endswith(BENIGN_SUFFIXES):
            stored.pop(name)  # recomputed from the config
        elif cfg.tie_word_embeddings and name in ("lm_head.weight", "output.weight"):
            stored.pop(name)  # a redundant copy of the tied embedding
    if stored:
        name = next(iter(stored))
        raise ValueError(f"{d / where[name]}: tensor {name!r} is not a weight of the {cfg.family} model that "
                         f"{Path(cfg.source).name} describes")
    cfg = cfg.replace(rope_layout=fmt.rope_layout)
    if rope_layout is not None and rope_layout != fmt.rope_layout and cfg.position_encoding == "rope":
        state = permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, fmt.rope_layout, rope_layout)
        cfg = cfg.replace(rope_layout=rope_layout)
    return LoadedCheckpoint(cfg, state, fmt, wf)


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                    rope_layout: str | None = None, progress: Progress = silent) -> Any:
    """A checkpoint directory (or a GGUF file) -> an eval-mode Llama holding its weights."""
    from .gguf.read import is_gguf
    from .gguf.tensors import load_gguf_model

    if is_gguf(directory):  # one file holding config, weights and vocabulary
        return load_gguf_model(directory, dtype=dtype, device=device, rope_layout=rope_layout)
    ck = read_checkpoint(directory, rope_layout=rope_layout, progress=progress)
    return model_from_state(ck.cfg, ck.state, dtype, device, consume=True)
