"""What a checkpoint directory holds, from headers alone, against what its config predicts."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..modeling.config import ModelConfig
from .formats import BENIGN_SUFFIXES, CheckpointTensor, checkpoint_tensors, detect_format, merge_meta_shards
from .header_readers import TensorInfo
from .weight_files import NO_WEIGHTS, CheckpointHeaders, checkpoint_config, find_weight_files, read_headers
from ..modeling.weights import stack_specs, weight_specs

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # Falcon: transformer.h.j.


@dataclass(frozen=True)
class ShapeMismatch:
    name: str
    expected: tuple[int, ...]
    found: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class DtypeTotal:
    dtype: str
    tensors: int
    params: int
    bytes: int
    block_weights: int = 1  # exactly block_bytes bytes per block_weights weights (GGUF: its quant block)
    block_bytes: int = 0


@dataclass(frozen=True)
class ComponentTotal:
    component: str
    expected_params: int
    found_params: int


@dataclass(frozen=True)
class FileSummary:
    file: str
    bytes: int
    tensors: int


@dataclass
class CheckpointInspection:
    """What a checkpoint directory holds, read from headers only, against what its config predicts."""

    path: str
    format: str  # safetensors | bin | meta
    layout: str  # the checkpoint format's name (formats.FORMATS)
    config: str  # the config's source
    files: list[FileSummary]
    tensors: list[TensorInfo]  # Meta shards merged into whole tensors
    by_dtype: list[DtypeTotal]
    by_component: list[ComponentTotal]
    unexplained: list[TensorInfo]  # stored, but no weight of the config (e.g. rotary_emb.inv_freq)
    missing: list[CheckpointTensor]  # the config predicts them, no file holds them
    mismatched: list[ShapeMismatch]
    cfg: ModelConfig  # the config the tensors are checked against
    total_params: int = 0
    total_bytes: int = 0
    expected_params: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.mismatched or
                    [t for t in self.unexplained if not t.name.endswith(BENIGN_SUFFIXES)])


def read_checkpoint_headers(path: str | Path) -> CheckpointHeaders:
    """Find the weight files, validate every header, read the config and recognize the format; no tensor data."""
    d = Path(path)
    if d.is_file():  # a single-file checkpoint: GGUF, its config in its own metadata
        from .gguf.tensors import read_gguf_headers

        return read_gguf_headers(d)
    if not d.is_dir():
        raise ValueError(f"{d}: not a checkpoint directory")
    wf = find_weight_files(d)
    if wf is None:
        raise ValueError(f"{d}: {NO_WEIGHTS}")
    per_file = read_headers(wf)
    cfg = checkpoint_config(d, wf, per_file)
    tensors = merged_infos(cfg, per_file, wf.files) if wf.kind == "meta" else [t for infos in per_file for t in infos]
    _check_layer_count(d, cfg, tensors)  # before anyone builds n8 layers' worth of expected names
    _check_tensor_count(d, cfg, tensors)  # ... or n8 x experts of them
    return CheckpointHeaders(d, wf, per_file, cfg, tensors, detect_format(wf.kind, [t.name for t in tensors]))


def inspect_checkpoint(path: str | Path) -> CheckpointInspection:
    """Read every header of a checkpoint directory (no tensor data) and compare with its config."""
    start = time.perf_counter()
    h = read_checkpoint_headers(path)
    d, wf, per_file, cfg, tensors, fmt = h.directory, h.files, h.per_file, h.cfg, h.tensors, h.format
    expected = checkpoint_tensors(cfg, fmt)
    exp_by_name = {ct.name: ct for ct in expected}
    spec_by_name = {s.name: s for s in weight_specs(cfg)}
    found = {t.name: t for t in tensors}

    comp_expected: dict[str, int] = {}
    comp_found: dict[str, int] = {}
    for s in spec_by_name.values():
        comp_expected[s.component] = comp_expected.get(s.component, 0) + s.numel
    mismatched, missing = [], []
    for ct in expected:
        t = found.get(ct.name)
        if t is None:
            missing.append(ct)
            continue
        if t.shape != ct.shape:
            mismatched.append(ShapeMismatch(ct.name, ct.shape, t.shape, t.file))
            comp = spec_by_name[ct.parts[0]].component
            comp_found[comp] = comp_found.get(comp, 0) + t.numel
            continue
        for part in ct.parts:  # a fused W_pack counts toward q, k and v by their rows
            s = spec_by_name[part]
            comp_found[s.component] = comp_found.get(s.component, 0) + s.numel
    unexplained = [t for t in tensors if t.name not in exp_by_name]
    for t in unexplained:
        comp_found["unexplained"] = comp_found.get("unexplained", 0) + t.numel
    components = [c for c in list(comp_expected) + ["unexplained"] if c in comp_expected or c in comp_found]
    return CheckpointInspection(
        path=str(d), format=wf.kind, layout=fmt.name, config=cfg.source,
        files=[FileSummary(f.name, f.stat().st_size, len(infos)) for f, infos in zip(wf.files, per_file)],
        tensors=tensors,
        by_dtype=dtype_totals(tensors, h.blocks),
        by_component=[ComponentTotal(c, comp_expected.get(c, 0), comp_found.get(c, 0)) for c in components],
        unexplained=unexplained, missing=missing, mismatched=mismatched, cfg=cfg,
        total_params=sum(t.numel for t in tensors), total_bytes=sum(t.nbytes for t in tensors),
        expected_params=sum(s.numel for s in spec_by_name.values()),
        seconds=time.perf_counter() - start,
    )


def dtype_totals(tensors: list[TensorInfo], blocks: dict[str, tuple[int, int]]) -> list[DtypeTotal]:
    """Tensors, parameters and bytes per stored dtype, with its block size (GGUF's, else from the bytes)."""
    acc: dict[str, list[int]] = {}
    for t in tensors:
        a = acc.setdefault(t.dtype, [0, 0, 0])
        a[0] += 1
        a[1] += t.numel
        a[2] += t.nbytes
    return [DtypeTotal(k, *v, *blocks.get(k, _per_block(v[1], v[2]))) for k, v in sorted(acc.items())]


def _per_block(params: int, nbytes: int) -> tuple[int, int]:
    """(weights, bytes) in lowest terms: (1, 2) for bf16."""
    g = math.gcd(params, nbytes) or 1
    return params // g, nbytes // g


def _check_layer_count(d: Path, cfg: ModelConfig, tensors: list[TensorInfo]) -> None:
    """One line when the files hold another number of decoders than the config says (n8 may be any number)."""
    found = {int(m.group(1)) for t in tensors if (m := _LAYER.search(t.name))}
    held = max(found) + 1 if found else 0
    if held != cfg.num_hidden_layers:
        raise ValueError(f"{d}: {Path(cfg.source).name} says {cfg.num_hidden_layers} decoder layers, the weight "
                         f"files hold {held}; fix num_hidden_layers or the files")


def _check_tensor_count(d: Path, cfg: ModelConfig, tensors: list[TensorInfo]) -> None:
    """One line when the config predicts far more tensors than the files hold (every predicted name is built and
    each missing one listed): counted analytically first, so an expert count of 65,536 costs nothing."""
    predicted = stack_specs(cfg).total(key=lambda s: 1)
    if predicted > 2 * len(tensors) + 1024:
        experts = f" ({cfg.num_experts:,} experts in each of {cfg.num_hidden_layers:,} decoders)" if cfg.num_experts else ""
        raise ValueError(f"{d}: {Path(cfg.source).name} predicts {predicted:,} tensors{experts}, the weight files hold "
                         f"{len(tensors):,}; fix {'num_local_experts' if experts else 'the config'} or the files")


def merged_infos(cfg: ModelConfig, per_file: list[list[TensorInfo]], files: tuple[Path, ...]) -> list[TensorInfo]:
    """Meta shards' header records -> one record per whole tensor (shapes summed along the shard axis)."""
    label = f"consolidated.00-{len(per_file) - 1:02d}.pth"

    def join(name: str, parts: list[TensorInfo], axis: int) -> TensorInfo:
        first = parts[0]
        shape = tuple(sum(p.shape[d] for p in parts) if d == axis else n for d, n in enumerate(first.shape))
        itemsize = first.nbytes // max(first.numel, 1)
        return TensorInfo(name, shape, first.dtype, math.prod(shape) * itemsize, label)

    merged = merge_meta_shards(cfg, [{t.name: t for t in infos} for infos in per_file], join,
                               lambda k: str(files[k].name))
    return list(merged.values())
