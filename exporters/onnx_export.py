"""Export a Llama to ONNX: one graph for prefill and decode with a KV cache, RoPE as one node.

The seam with the model: `ExportModel` subclasses `Llama` (flat inputs/outputs, RoPE tables as named
buffers passed to `Llama.forward`), and the model's RoPE is already one torch op (`llama_tools::rope`)
that rope_ops.py translates to one ONNX node; nothing in the model is replaced or written from here.

The graph is traced with fake weights (no data), the real weights are attached afterwards and
streamed to disk, so peak memory stays near one copy of the weights. The file appears atomically.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx_ir as ir
import torch

import llama_tools
from llama_tools.modeling import dtypes
from llama_tools.outputs import files, paths
from llama_tools.modeling.config import ModelConfig
from llama_tools.checkpoints.loading import load_model
from llama_tools.modeling.model import Llama, rope_tables_of
from llama_tools.modeling.rope import per_pass
from llama_tools.outputs.progress import Progress, peak_rss_bytes, silent
from llama_tools.checkpoints.source import ModelSource, resolve
from llama_tools.modeling.weights import weight_specs

from . import onnx_save, rope_ops, rope_tables
from .preflight import EXTERNAL_DATA_THRESHOLD_BYTES, check_args
from .graph_meta import META, ExportMetadata, read_metadata  # noqa: F401  (re-exported: readable without torch)

# Above this many bytes of weights they stream to OUT.onnx.data (protobuf caps a file at 2 GiB, and one
from .trace import STAMP_FROM, TABLE_NAMES, attach_rope_function, table_dtype, traced_graph, value_bytes


@dataclass
class ExportResult:
    """What export_onnx (plain graph) or export_fused (fused graph) wrote."""

    path: Path
    external_data: Path | None  # OUT.onnx.data, or None when the weights are inside OUT
    bytes: int  # on disk, both files
    params: int
    num_nodes: int  # top-level graph nodes
    rope_nodes: int
    opset: int
    dtype: str
    rope_op: str
    seconds: float
    peak_rss_bytes: int  # the process's high-water mark (VmHWM), export included
    graph: str = "plain"  # the llama_tools.graph metadata value: "plain" or "fused"
    op_counts: dict[str, int] = field(default_factory=dict)  # fused: "com.microsoft.GroupQueryAttention": 12, ...
    static_kv: int | None = None  # fused: max_length of the shared past/present buffer; None: past grows



# --- Weights, metadata, file -----------------------------------------------------------------------------

@dataclass
class Weights:
    """The real weights of a source, module-named, in the export dtype."""

    state: dict[str, torch.Tensor]
    cfg: ModelConfig
    params: int
    source: str  # for the metadata: preset name, path, or the config's name
    seed: int | None  # None: from a checkpoint or a given module, no seed reproduces them


def real_weights(source: ModelSource | ModelConfig | Llama, dtype: torch.dtype, seed: int,
                  progress: Progress) -> Weights:
    """One copy of the weights: a checkpoint's (memory-mapped where possible), seeded random, or a module's."""
    if isinstance(source, Llama):
        state = {k: v.detach().to(dtype) for k, v in source.state_dict().items()}  # the caller's module untouched
        params = sum(p.numel() for p in source.parameters())
        return Weights(state, source.cfg, params, source.cfg.source or source.cfg.name, None)
    if isinstance(source, ModelConfig):
        label, seeded = source.source or source.name, True
    else:
        label, seeded = source.label, source.seeded
    model = load_model(source, dtype=dtype, seed=seed, progress=progress)
    params = sum(p.numel() for p in model.parameters())
    return Weights(model.state_dict(), model.cfg, params, label, seed if seeded else None)


def _apply_weights(program: torch.onnx.ONNXProgram, hidden: list[ir.Value], state: dict[str, torch.Tensor],
                   folded: dict[str, str]) -> None:
    """Give each fake initializer its real tensor (no copy; a folded one its weight's transposed view)."""
    state = {**state, **{name: state[w].T for name, w in folded.items()}}
    for v in hidden:
        assert v.name in state, f"initializer {v.name} has no weight in the state dict"
        assert tuple(state[v.name].shape) == tuple(v.shape), f"{v.name}: weight {list(state[v.name].shape)} vs {v.shape}"
    program.apply_weights({v.name: state[v.name] for v in hidden})


def _checkpoint_source(reader: Any, cfg: ModelConfig, hidden: list[ir.Value], tables: dict[str, torch.Tensor],
                       folded: dict[str, str]) -> onnx_save.Source:
    """Initializer name -> its weight read from the checkpoint when it is written (transposed where folded),
    a RoPE table, or None (a constant the exporter made, which keeps its own data)."""
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    names = {alias.get(folded.get(v.name, v.name), folded.get(v.name, v.name)) for v in hidden}
    assert names <= set(reader.where) | set(tables), f"initializers the checkpoint lacks: {names - set(reader.where)}"

    shapes = {v.name: tuple(int(d) for d in v.shape) for v in hidden}

    def read(name: str) -> torch.Tensor | onnx_save.Rows | None:
        if name in tables:
            return tables[name]
        weight = alias.get(folded.get(name, name), folded.get(name, name))
        if weight not in reader.where:
            return None
        if weight in VOCABULARY_ROWS:  # vocabulary x width: a slab of rows at a time, W^T from W's rows
            rows = lambda a, b: reader.rows(weight, [(a, b)])  # noqa: E731
            return onnx_save.Rows(shapes[name], rows, transposed=name in folded)  # type: ignore[arg-type]
        t = reader.read([weight])[weight]
        return t.T if name in folded else t  # a view: made contiguous as it is written, one tensor at a time
    return read


# Read a slab of rows at a time when written, never whole: Qwen2.5-1.5B's untied embedding and lm_head are 0.93 GB
# each in fp32 (the lm_head's MatMul weight W^T written from W's row slabs).
VOCABULARY_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def set_metadata(model: ir.Model, cfg: ModelConfig, rope_op: str, dtype: str, source: str,
                  seed: int | None) -> None:
    """The llama_tools.* keys read_metadata reads back."""
    model.metadata_props.update({
        META + "config": json.dumps(cfg.to_dict(), sort_keys=True),
        META + "rope_layout": cfg.rope_layout,
        META + "rope_op": rope_op,
        META + "dtype": dtype,
        META + "version": llama_tools.__version__,
        META + "source": source,
        META + "seed": "" if seed is None else str(seed),
    })




def save_model(model: ir.Model, output: Path, threshold: int, check: bool, progress: Progress,
               source: onnx_save.Source | None = None) -> Path | None:
    """Write OUT (and OUT.data) in a temp dir beside OUT, then rename: a killed export leaves no OUT."""  # noqa: D401
    data_name = output.name + ".data"
    weight_bytes = sum(value_bytes(v) for v in model.graph.initializers.values())
    external = weight_bytes > threshold
    if external and output.exists() and not output.is_file():
        raise ValueError(f"{output}: not a regular file, and the weights ({weight_bytes:,} bytes) need an "
                         f"external-data file beside it; give a file path")
    # Both files appear together (the data first), or neither; a kill leaves none of ours behind. The
    # weights stream into the .data file one tensor at a time, and the check reads none of them (onnx_save).
    with files.atomic_files([output.parent / data_name, output]) as tmp:
        onnx_save.save_model(model, tmp, output.name, external=external, check=check, source=source,
                             callback=lambda done, total: progress(done, total, "weights written"))
    if not external and (output.parent / data_name).is_file():
        (output.parent / data_name).unlink()  # a previous export's weights, now stale
    return output.parent / data_name if external else None


# --- The entry points ----------------------------------------------------------------------------------------

def export_onnx(source: ModelSource | ModelConfig | Llama | str, output: str | Path, *, dtype: Any = "float32",
                rope_op: str = rope_ops.OURS.name, opset: int | None = None, seed: int = 0, check: bool = True,
                external_data_threshold_bytes: int = EXTERNAL_DATA_THRESHOLD_BYTES,
                progress: Progress = silent, say: Callable[[str], None] = lambda msg: None,
                _stamp: bool = True) -> ExportResult:
    """Export a preset, config.json, checkpoint directory, ModelConfig or Llama to one ONNX file (+ .data).

    _stamp=False traces every layer (the way before layer stamping; tests and benchmarks compare the two)."""
    t0 = time.perf_counter()
    output = Path(output)
    dt, opset = check_args(dtype, rope_op, opset)
    if rope_ops.get_rope_op(rope_op).fused_only:
        raise ValueError(f"rope_op {rope_op!r} is {rope_ops.get_rope_op(rope_op).display}: the plain graph has no "
                         f"such attention; export the fused graph (--optimize) or choose another --rope-op")
    paths.check_output_path(output)
    paths.check_output_path(output.parent / (output.name + ".data"))
    if isinstance(source, (str, Path)):
        source = resolve(source)
    torch_dtype = dtypes.to_torch(dt.name)
    streamed = isinstance(source, ModelSource) and source.weights is not None
    if streamed:  # a checkpoint: each weight is read from its file when it is written, one at a time
        from llama_tools.inference.reference import open_reader

        assert isinstance(source, ModelSource) and source.path is not None, "a checkpoint source has a path"
        reader = open_reader(source.path)
        weights = Weights({}, reader.cfg, sum(s.numel for s in weight_specs(reader.cfg)), source.label, None)
    else:
        weights = real_weights(source, torch_dtype, seed, progress)
    cfg, state = weights.cfg, weights.state
    # Layers of different kinds (Gemma's local and global) are each traced: stamping copies one kind.
    stamp = _stamp and cfg.uniform_layers
    traced = min(cfg.num_hidden_layers, STAMP_FROM) if stamp else cfg.num_hidden_layers
    say(f"tracing {cfg.name} ({traced} of {cfg.num_hidden_layers} layers, {dt.name}, rope_op={rope_op})")
    program, hidden, folded, rope_nodes = traced_graph(cfg, torch_dtype, rope_op, opset, traced, progress)
    graph = program.model
    tables: dict[str, torch.Tensor] = {}
    if cfg.position_encoding == "rope":
        tables = {name: t.to(table_dtype(torch_dtype, rope_op))
                  for name, t in zip(TABLE_NAMES, rope_tables_of(cfg))}
    if per_pass(cfg):  # dynamic, longrope: the graph computes each pass's (cos, sin) (rope_tables.py)
        hidden = rope_tables.replace_fixed_tables(graph, cfg, hidden)
        tables = {name: t for name, t in tables.items() if name not in rope_tables.TABLES}  # local ones stay
    lazy = _checkpoint_source(reader, cfg, hidden, tables, folded) if streamed else None
    if not streamed:
        _apply_weights(program, hidden, {**state, **tables}, folded)
    attach_rope_function(graph, rope_op, opset)
    rotating = 0 if cfg.position_encoding != "rope" else (
        cfg.num_hidden_layers if cfg.rope_layers is None else sum(cfg.rope_layers))  # SmolLM3: some layers none
    assert rope_nodes == 2 * rotating, f"{rope_nodes} RoPE nodes for {rotating} layers with RoPE"
    set_metadata(graph, cfg, rope_op, dt.name, weights.source, weights.seed)
    say(f"writing {output}")
    data = save_model(graph, output, external_data_threshold_bytes, check, progress, source=lazy)
    size = output.stat().st_size + (data.stat().st_size if data else 0)
    return ExportResult(
        path=output, external_data=data, bytes=size, params=weights.params, num_nodes=len(graph.graph),
        rope_nodes=rope_nodes, opset=opset, dtype=dt.name, rope_op=rope_op,
        seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes())

