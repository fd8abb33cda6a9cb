"""Any checkpoint counted from its headers alone, whatever its architecture: no config, no model, no tensor data.

What `count-params` says of weight files no config here describes (a lone model.safetensors, an index, a GGUF
of another architecture, a directory without config.json) or of a partial download: tensors, parameters and
bytes by dtype, per file (bytes present against bytes declared: a shortfall is said, naming the file) and per
layer where the names show one (`model.layers.N.`, `blk.N.`, `h.N.`, `layers.N.`). The headers are read by the
readers every command uses (header_readers, gguf.tensors); nothing here imports torch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.gguf.read import is_gguf
from ..checkpoints.gguf.tensors import read_gguf_tensors
from ..checkpoints.header_readers import FileExtent, TensorInfo, read_safetensors_extent
from ..checkpoints.torch_headers import read_torch_header
from ..checkpoints.inspection import DtypeTotal, dtype_totals
from ..checkpoints.source import HeaderFiles
from ..checkpoints.weight_files import WeightFiles, check_index, find_weight_files, index_files

# The first `<stack>.<N>.` in a name: the decoder stack (model.layers, transformer.h, blk, ...) and the layer index.
# Lazy on the prefix so that experts inside a layer (mlp.experts.7.) never pass for the layer itself.
_LAYER = re.compile(r"^(?P<stack>(?:.*?\.)?(?:layers|layer|h|blk|blocks|block|decoder_layers))\.(?P<index>\d+)\.")
_GGUF_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
MAX_OUTSIDE_ROWS = 32  # tensors outside any numbered layer listed one by one up to this many, else summed


@dataclass(frozen=True)
class LayerTotal:
    """One numbered layer of one stack: its tensors, parameters and stored bytes."""

    stack: str  # the name before the index: "model.layers", "blk", "transformer.h"
    layer: int
    tensors: int
    params: int
    bytes: int


@dataclass(frozen=True)
class LayerRun:
    """Layers first..last of one stack, each holding the same tensors, parameters and bytes."""

    stack: str
    first: int
    last: int
    tensors: int  # per layer
    params: int
    bytes: int

    @property
    def label(self) -> str:
        return f"{self.stack}.{self.first}" if self.first == self.last else f"{self.stack}.{self.first}-{self.last}"

    @property
    def count(self) -> int:
        return self.last - self.first + 1


@dataclass
class HeaderCount:
    """What weight files hold, read from their headers alone (count-params without a config)."""

    model: str
    source: str  # the path given, absolute
    format: str  # safetensors | gguf | bin | meta
    architecture: str | None  # a GGUF's general.architecture, or the config.json's; None when nothing says
    reason: str  # why headers and not a config: said in the output
    files: list[FileExtent]
    tensors: list[TensorInfo]
    by_dtype: list[DtypeTotal]
    layers: list[LayerTotal]  # every numbered layer, in stack and index order
    total: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    counted_from: str = "headers"
    notes: list[str] = field(default_factory=list)

    @property
    def partial(self) -> list[FileExtent]:
        """The files whose data end before their headers say."""
        return [f for f in self.files if f.missing]

    @property
    def outside(self) -> list[TensorInfo]:
        """Tensors in no numbered layer (embeddings, final norm, lm_head, ...)."""
        return [t for t in self.tensors if not _LAYER.match(t.name)]

    def runs(self) -> list[LayerRun]:
        """Consecutive layers of one stack with identical totals, folded into one run."""
        out: list[LayerRun] = []
        for t in self.layers:
            last = out[-1] if out else None
            if (last and last.stack == t.stack and last.last + 1 == t.layer
                    and (last.tensors, last.params, last.bytes) == (t.tensors, t.params, t.bytes)):
                out[-1] = LayerRun(t.stack, last.first, t.layer, t.tensors, t.params, t.bytes)
            else:
                out.append(LayerRun(t.stack, t.layer, t.layer, t.tensors, t.params, t.bytes))
        return out

    def payload(self) -> dict[str, object]:
        """The JSON form: everything but the tensor list (one row per tensor is `report shapes`' job)."""
        return {"model": self.model, "source": self.source, "counted_from": self.counted_from, "format": self.format,
                "architecture": self.architecture, "reason": self.reason, "total": self.total,
                "total_bytes": self.total_bytes, "tensor_count": len(self.tensors),
                "files": [{"file": f.file, "bytes_present": f.present, "bytes_declared": f.declared,
                           "bytes_missing": f.missing} for f in self.files],
                "partial": bool(self.partial),
                "by_dtype": [vars(d) for d in self.by_dtype],
                "layers": [vars(t) for t in self.layers],
                "layer_runs": [{"label": r.label, **vars(r)} for r in self.runs()],
                "outside_layers": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "params": t.numel,
                                    "bytes": t.nbytes, "file": t.file} for t in self.outside],
                "seconds": self.seconds, "notes": self.notes}


@dataclass(frozen=True)
class _Part:
    """One file's header: its tensors, its extent, GGUF block sizes, the architecture it names."""

    tensors: list[TensorInfo]
    extent: FileExtent
    blocks: dict[str, tuple[int, int]]
    architecture: str | None = None


def count_headers(target: HeaderFiles) -> HeaderCount:
    """Read every header of `target`'s weight files (no tensor data) and total them by dtype, file and layer."""
    start = time.perf_counter()
    p = target.path
    fmt, parts = _read_parts(p)
    tensors = [t for part in parts for t in part.tensors]
    seen: dict[str, str] = {}
    for t in tensors:  # one name in two files would be counted twice: say which instead
        if t.name in seen:
            raise ValueError(f"{p}: tensor {t.name!r} is in both {seen[t.name]} and {t.file}; count one of them")
        seen[t.name] = t.file
    blocks = {k: v for part in parts for k, v in part.blocks.items()}
    arch = next((part.architecture for part in parts if part.architecture), None) or _config_architecture(p)
    count = HeaderCount(
        model=p.name, source=str(p), format=fmt, architecture=arch, reason=target.reason,
        files=[part.extent for part in parts], tensors=tensors,
        by_dtype=dtype_totals(tensors, blocks),
        layers=_layers(tensors), total=sum(t.numel for t in tensors), total_bytes=sum(t.nbytes for t in tensors))
    if not count.layers:
        count.notes.append("no tensor name shows a layer index (model.layers.N., blk.N., h.N., layers.N.)")
    for f in count.partial:
        count.notes.append(f"{f.file} is partial: {f.present:,} of the {f.declared:,} bytes its header declares "
                           f"({f.missing:,} missing); counted from its header; commands that read the weights "
                           f"refuse it")
    count.seconds = time.perf_counter() - start
    return count


def _read_parts(p: Path) -> tuple[str, list[_Part]]:
    """(format, one _Part per file) for a weight file, an index, or a directory of them."""
    if p.is_file():
        if is_gguf(p):
            return "gguf", [_gguf_part(p)]
        if p.suffix.lower() == ".json":
            return _files_parts(index_files(p))
        if p.suffix.lower() == ".safetensors":
            return "safetensors", [_safetensors_part(p)]
        return "bin", [_torch_part(p)]
    wf = find_weight_files(p)
    if wf is not None:
        if wf.kind == "meta" and len(wf.files) > 1:
            raise ValueError(f"{p}: {len(wf.files)} Meta model-parallel shards without params.json: their norms are "
                             f"copied into every shard, so no sum of headers is the model's count; put its "
                             f"params.json beside them")
        return _files_parts(wf)
    ggufs = sorted(p.glob("*.gguf"))
    split = {m.group(2) for f in ggufs if (m := _GGUF_SPLIT.search(f.name))}
    if len(ggufs) > 1 and not (len(split) == 1 and all(_GGUF_SPLIT.search(f.name) for f in ggufs)):
        # Several quantizations of one model side by side are common; their sum is no model's count.
        raise ValueError(f"{p}: holds {len(ggufs)} GGUF files that are not one split set ({ggufs[0].name}, "
                         f"{ggufs[1].name}, ...); count one of them")
    if not ggufs:
        raise ValueError(f"{p}: no weight files (*.safetensors, pytorch_model*.bin, consolidated.NN.pth, *.gguf)")
    if split and len(ggufs) != int(next(iter(split))):
        raise ValueError(f"{p}: a split GGUF of {int(next(iter(split)))} files, {len(ggufs)} of them here")
    return "gguf", [_gguf_part(f) for f in ggufs]


def _files_parts(wf: WeightFiles) -> tuple[str, list[_Part]]:
    reader = _safetensors_part if wf.kind == "safetensors" else _torch_part
    parts = [reader(f) for f in wf.files]
    check_index(wf, [part.tensors for part in parts])
    return wf.kind, parts


def _safetensors_part(path: Path) -> _Part:
    infos, extent = read_safetensors_extent(path)
    return _Part(infos, extent, {})


def _torch_part(path: Path) -> _Part:
    # A zip's directory is at its end: a partial .bin/.pth cannot be read at all (read_torch_header says
    # "truncated"), so a file that reads is whole.
    size = path.stat().st_size
    return _Part(read_torch_header(path), FileExtent(path.name, size, size), {})


def _gguf_part(path: Path) -> _Part:
    g = read_gguf_tensors(path)
    return _Part(g.tensors, g.extent, g.blocks, g.architecture)


def _config_architecture(p: Path) -> str | None:
    """The architecture a config.json beside the files names, when one is there (counted from headers anyway)."""
    from ..checkpoints.config_files import read_json

    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = read_json(cfg)
    except ValueError:
        return None  # the headers are counted whatever the config is; its own errors belong to other commands
    archs = data.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else data.get("model_type")
    return arch if isinstance(arch, str) else None


def _layers(tensors: list[TensorInfo]) -> list[LayerTotal]:
    acc: dict[tuple[str, int], list[int]] = {}
    for t in tensors:
        m = _LAYER.match(t.name)
        if m:
            a = acc.setdefault((m.group("stack"), int(m.group("index"))), [0, 0, 0])
            a[0] += 1
            a[1] += t.numel
            a[2] += t.nbytes
    return [LayerTotal(s, j, *v) for (s, j), v in sorted(acc.items())]


# --- Rows for output.render -------------------------------------------------------------------------------------

def header_rows(c: HeaderCount, per_layer: bool = False) -> list[dict[str, object]]:
    """Files, dtypes, layers (runs folded unless per_layer), tensors outside layers, then the total."""
    rows: list[dict[str, object]] = []

    def row(section: str, name: str, tensors: object, params: object, nbytes: object, note: str = "") -> None:
        rows.append({"section": section, "name": name, "tensors": tensors, "params": params, "bytes": nbytes,
                     "note": note})

    for f in c.files:
        held = [t for t in c.tensors if t.file == f.file]
        row("file", f.file, len(held), sum(t.numel for t in held), sum(t.nbytes for t in held),
            f"PARTIAL: {f.present:,} of the {f.declared:,} bytes on disk, {f.missing:,} missing" if f.missing
            else f"complete: {f.present:,} bytes on disk")
    for d in c.by_dtype:
        per = (f"{d.block_bytes} bytes per weight" if d.block_weights == 1 else
               f"{d.block_bytes} bytes per {d.block_weights} weights")
        row("dtype", d.dtype, d.tensors, d.params, d.bytes, per)
    if per_layer:
        for t in c.layers:
            row("layer", f"{t.stack}.{t.layer}", t.tensors, t.params, t.bytes)
    else:
        for r in c.runs():
            row("layers", r.label, r.tensors, r.params, r.bytes,
                f"each of {r.count} layers; together {r.params * r.count:,} params" if r.count > 1 else "")
    outside = c.outside
    if len(outside) <= MAX_OUTSIDE_ROWS:
        for t in outside:
            row("tensor", t.name, 1, t.numel, t.nbytes, f"{t.dtype} {list(t.shape)}")
    else:
        row("outside", f"{len(outside)} tensors in no numbered layer", len(outside), sum(t.numel for t in outside),
            sum(t.nbytes for t in outside))
    files = f"{len(c.files)} file" + ("s" if len(c.files) != 1 else "")
    row("total", f"{len(c.tensors)} tensors in {files}", len(c.tensors), c.total, c.total_bytes,
        "PARTIAL: counted from the headers" if c.partial else "counted from the headers")
    return rows


def header_long_rows(c: HeaderCount) -> list[dict[str, object]]:
    """count-params' CSV rows (model, section, item, value) for a header count."""
    rows: list[dict[str, object]] = []
    add = lambda section, item, value: rows.append(  # noqa: E731
        {"model": c.model, "section": section, "item": item, "value": value})
    add("params", "total", c.total)
    add("tensors", "count", len(c.tensors))
    add("bytes", "total", c.total_bytes)
    for d in c.by_dtype:
        add("dtype_params", d.dtype, d.params)
        add("dtype_bytes", d.dtype, d.bytes)
    for f in c.files:
        add("file_bytes_present", f.file, f.present)
        add("file_bytes_declared", f.file, f.declared)
    for r in c.runs():
        add("layer", r.label, r.params)
    return rows
