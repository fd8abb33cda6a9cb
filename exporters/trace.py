"""The plain graph's tracing: the model traced with fake weights, cleaned up, and its layers stamped.

`ExportModel` subclasses `Llama` (flat inputs/outputs, RoPE tables as named buffers passed to
`Llama.forward`); the model's RoPE is already one torch op (`llama_tools::rope`) that rope_ops.py translates
to one ONNX node. Two decoders are traced (torch.export takes seconds a layer); the others are stamped from
the last traced one, and the traced pair can be cached between exports (TRACE_CACHE_ENV). onnx_export.py
attaches the real weights and writes the file.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator

import onnx
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import llama_tools
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.model import Llama, tie_weights
from llama_tools.outputs.progress import Progress, silent

from . import graph_io, rope_ops
from .graph_io import ATTENTION_MASK, io_names

# serialized proto would hold every weight in memory twice).
# Sizes to trace with: >= 2 and distinct, since torch.export specializes dims of size 0 or 1.
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 3, 5
# The RoPE tables' initializer names: (cos, sin), then the sliding layers' pair when they have their own base.
TABLE_NAMES = ("cos_cache", "sin_cache", "cos_cache_local", "sin_cache_local")
# Decoders traced when a model has more; the others are stamped from the last traced one (_stamp_layers).
STAMP_FROM = 2
# A directory to keep the traced graph of those layers in between exports (_trace_cache_path); unset: none.
# Opt-in: the key sees the code's files, not a function patched at run time (tests do that to the model).
TRACE_CACHE_ENV = "LLAMA_TOOLS_TRACE_CACHE"
_CACHED = "llama_tools.cache."  # metadata keys of a cached trace (its fake weights and folded transposes)


# --- The traced module ---------------------------------------------------------------------------------

class ExportModel(Llama):
    """The Llama with flat ONNX inputs and outputs, and its RoPE tables as buffers (named initializers).

    A subclass, not a wrapper: parameter and module names stay the model's own (model.layers.0...),
    so initializers and nodes are named by module path with nothing to strip.
    """

    def __init__(self, cfg: ModelConfig, tables: tuple[torch.Tensor, ...] | None):
        super().__init__(cfg)
        for name, t in zip(TABLE_NAMES, tables or ()):
            self.register_buffer(name, t)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past_key_values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(ids, mask, positions, K0, V0, K1, ...) -> (logits, present K0, V0, K1, ...), as io_names lists them."""
        tables = tuple(getattr(self, n) for n in TABLE_NAMES if hasattr(self, n)) or None
        past = tuple(zip(past_key_values[0::2], past_key_values[1::2]))  # per layer (K, V)
        out = super().forward(input_ids, attention_mask, position_ids, past, rope_tables=tables)
        return (out.logits, *(t for kv in out.past_key_values for t in kv))


def table_dtype(dtype: torch.dtype, rope_op: str) -> torch.dtype:
    """Our op keeps cos/sin in fp32; ORT's and ONNX's ops want them in the activations' type."""
    return torch.float32 if rope_ops.get_rope_op(rope_op).fp32_tables else dtype


def _fake_model(cfg: ModelConfig, dtype: torch.dtype, rope_op: str, fake: FakeTensorMode) -> ExportModel:
    """The export module with fake weights: shapes and dtypes only, nothing allocated."""
    with torch.device("meta"):
        shapes = {name: (t.shape, t.dtype) for name, t in Llama(cfg).to(dtype).state_dict().items()}
    # Fake CPU tensors, not meta ones: a constant made in forward (ALiBi slopes) moved to "meta" loses its data.
    with fake:
        state = {name: torch.empty(shape, dtype=dt) for name, (shape, dt) in shapes.items()}
        tables = ()
        if cfg.position_encoding == "rope":
            shape, dt = (cfg.max_position_embeddings, cfg.rotary_dim // 2), table_dtype(dtype, rope_op)
            tables = tuple(torch.empty(shape, dtype=dt) for _ in range(4 if cfg.rope_local_theta is not None else 2))
    with torch.device("meta"):
        model = ExportModel(cfg, None)
    for name, t in zip(TABLE_NAMES, tables):
        model.register_buffer(name, t)
    model.load_state_dict(state, strict=False, assign=True)
    return tie_weights(model).eval()


def _trace(cfg: ModelConfig, dtype: torch.dtype, rope_op: str, opset: int) -> torch.onnx.ONNXProgram:
    """torch.export + translation to ONNX, on fake weights; the graph is left unoptimized."""
    fake = FakeTensorMode()
    model = _fake_model(cfg, dtype, rope_op, fake)
    b, s, p = TRACE_BATCH, TRACE_SEQ, TRACE_PAST
    kv_shape = (b, cfg.num_key_value_heads, p, cfg.head_dim)  # [batch, kv_heads, past, head_dim]
    with fake:
        args = (torch.zeros(b, s, dtype=torch.long), torch.ones(b, p + s, dtype=torch.long),
                torch.zeros(b, s, dtype=torch.long),
                [torch.empty(kv_shape, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)])
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence_length")
    past = torch.export.Dim("past_sequence_length")
    # The mask's length is past + seq; torch.export finds that relation itself (AUTO), we name it later.
    dynamic_shapes = ({0: batch, 1: seq}, {0: batch, 1: torch.export.Dim.AUTO}, {0: batch, 1: seq},
                      [{0: batch, 2: past}] * (2 * cfg.num_hidden_layers))
    input_names, output_names = io_names(cfg.num_hidden_layers)
    with _exporter_noise_off():
        program = torch.onnx.export(
            model, args, dynamo=True, dynamic_shapes=dynamic_shapes, input_names=input_names,
            output_names=output_names, opset_version=opset, verbose=False,
            custom_translation_table=rope_ops.translation_table(rope_op, cfg.head_dim, cfg.rotary_dim),
            optimize=False)  # we optimize ourselves: the stock pass would read the fake weights
    return program


@contextlib.contextmanager
def _exporter_noise_off() -> Iterator[None]:
    """Silence what torch.onnx and onnx_ir log on every export (missing torchvision, dedup skips, ...)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*axis name.*", category=UserWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# --- Graph clean-up: optimize, name, attach the RoPE function ----------------------------------------

def _optimize(model: ir.Model) -> list[ir.Value]:
    """Constant folding etc. with the fake weights hidden (no data to read); returns those initializers."""
    import onnxscript.optimizer

    fake = [v for v in model.graph.initializers.values()
            if v.const_value is not None and isinstance(getattr(v.const_value, "raw", None), FakeTensor)]
    for v in fake:
        v.const_value = None  # unknown values: the optimizer leaves Transpose(W) etc. to onnxruntime
    with _exporter_noise_off():
        onnxscript.optimizer.optimize_ir(model)
    return [v for v in fake if v.name in model.graph.initializers]


def _fold_weight_transposes(model: ir.Model, hidden: list[ir.Value]) -> tuple[list[ir.Value], dict[str, str]]:
    """MatMul(x, Transpose(W)) -> MatMul(x, W^T), W^T stored [in, out] as `<module>.MatMul.weight`.

    torch.onnx writes every nn.Linear as Transpose(W) -> MatMul; left in, onnxruntime folds them each time a
    session starts (the plain 125M graph loaded in 1.2-1.4 s against the fused graph's 0.5-0.7 s). A weight
    read elsewhere too (a tied embedding's Gather) keeps its Transpose: folding it would store it twice.
    Returns the hidden weights as they now are, and each new name -> the weight it transposes.
    """
    weights = {v.name: v for v in hidden}
    folded: dict[str, str] = {}
    for node in list(model.graph):
        w = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
        perm = node.attributes.get("perm")
        if w is None or w.name not in weights or w.shape is None or len(w.shape) != 2 or len(w.uses()) != 1 \
                or (perm is not None and list(perm.as_ints()) != [1, 0]):
            continue
        name = w.name.removesuffix(".weight") + ".MatMul.weight"
        assert name not in model.graph.initializers, f"{name}: already an initializer"
        wt = ir.Value(name=name, shape=ir.Shape([w.shape[1], w.shape[0]]), type=w.type)  # [in, out]
        node.outputs[0].replace_all_uses_with(wt)
        model.graph.remove(node, safe=True)
        del model.graph.initializers[w.name]
        model.graph.initializers.add(wt)  # its data comes with the weights (apply or stream), as W's would have
        folded[name] = w.name
    kept = [v for v in hidden if v.name in model.graph.initializers]
    return kept + [model.graph.initializers[n] for n in folded], folded


def _module_path(node: ir.Node) -> str:
    """/model/layers.0/self_attn, from the exporter's record of the module a node came from.

    torch.onnx records it in each node's metadata (`pkg.torch.onnx.name_scopes`, a list ending with
    the op itself); it has no public API for it, so this is the one place that reads it.
    """
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")  # e.g. "['', 'model', 'model.layers.0', ...]"
    parts = ast.literal_eval(scopes) if scopes else []
    module = parts[-2] if len(parts) >= 2 and not parts[-2].startswith("_") else ""  # last: the op itself
    path = ""
    for part in module.strip(".").split("."):
        path += f".{part}" if part.isdigit() else f"/{part}" if part else ""  # layers.0 stays one level
    return path


def _name_nodes(model: ir.Model) -> int:
    """Names by module path (RoPE: .../self_attn/q_rope/RotaryEmbedding); drops torch's per-node metadata."""
    taken: dict[str, int] = {}
    ropes = 0
    for node in model.graph:
        base = f"{_module_path(node)}/{node.op_type}"
        if node.op_type == rope_ops.OP_TYPE:
            ropes += 1
            assert base.endswith(("/q_rope/" + node.op_type, "/k_rope/" + node.op_type)), f"RoPE node under {base}"
        taken[base] = taken.get(base, 0) + 1
        node.name = base if taken[base] == 1 else f"{base}_{taken[base] - 1}"
        node.metadata_props.clear()  # stack traces with this machine's paths
    return ropes


def _name_dims(model: ir.Model) -> None:
    """attention_mask's and present.*'s length: total_sequence_length (torch.export calls it s<N> / a + b)."""
    graph = model.graph
    assert graph.inputs[1].name == ATTENTION_MASK, f"input 1 is {graph.inputs[1].name}"
    renames = {str(graph.inputs[1].shape[1]): "total_sequence_length"}
    if len(graph.outputs) > 1:
        renames[str(graph.outputs[1].shape[2])] = "total_sequence_length"
    values = [*graph.inputs, *graph.outputs, *(out for node in graph for out in node.outputs)]
    for v in values:
        if v.shape is not None and any(str(d) in renames for d in v.shape):
            v.shape = ir.Shape([ir.SymbolicDim(renames[str(d)]) if str(d) in renames else d for d in v.shape])


def attach_rope_function(model: ir.Model, rope_op: str, opset: int) -> None:
    """Our op's body goes in model.functions, so any onnxruntime runs it."""
    if rope_op != rope_ops.OURS.name or not any(n.domain == rope_ops.DOMAIN for n in model.graph):
        return
    function = ir.serde.deserialize_function(rope_ops.rope_function(opset))
    model.functions[function.identifier()] = function
    model.opset_imports[rope_ops.DOMAIN] = rope_ops.VERSION


# --- Tracing once per model: two layers traced, the others stamped from layer 1 --------------------------

def traced_graph(cfg: ModelConfig, dtype: torch.dtype, rope_op: str, opset: int, traced: int,
                  progress: Progress) -> tuple[torch.onnx.ONNXProgram, list[ir.Value], dict[str, str], int]:
    """The whole graph on fake weights, optimized and named: its first `traced` layers traced, the others
    stamped from the last of them. Returns the program, its fake weights, the folded transposes, the RoPE nodes.

    Tracing costs ~3 s a layer (torch.export's symbolic shapes) and every layer is the same code on weights of
    the same shapes, so a 30-layer model needs two traced (layer 0 also computes what all layers share).
    """
    n = cfg.num_hidden_layers
    assert 1 <= traced <= n, f"traced {traced} of {n} layers"
    template = cfg.replace(num_hidden_layers=traced)
    cache = _trace_cache_path(template, dtype, rope_op, opset)
    cached = _load_trace(cache) if cache is not None else None
    if cached is not None:
        graph, hidden, folded = cached
        program = torch.onnx.ONNXProgram(graph, None)
    else:
        with _ticking(progress, 0, n, f"tracing {traced} decoder layer{'s' if traced > 1 else ''}"):
            program = _trace(template, dtype, rope_op, opset)
            graph = program.model
            hidden, folded = _fold_weight_transposes(graph, _optimize(graph))
            _name_nodes(graph)
        if cache is not None:
            _save_trace(cache, graph, hidden, folded)
    progress(traced, n, f"{traced} layers traced" + (" (cached)" if cached is not None else ""))
    if traced < n:
        hidden, folded = _stamp_layers(graph.graph, n, hidden, folded,
                                       lambda j: progress(j + 1, n, f"layer {j} stamped"))
    _name_values(graph.graph)
    _name_dims(graph)
    rope_nodes = sum(node.op_type == rope_ops.OP_TYPE for node in graph.graph)
    return program, hidden, folded, rope_nodes


def _trace_cache_path(template: ModelConfig, dtype: torch.dtype, rope_op: str, opset: int) -> Path | None:
    """Where the traced graph of these traced layers is kept, keyed by all that shapes it; None: no cache.

    The trace depends on the config (not its name), dtype, RoPE op, opset, the code that builds and exports
    the model, and the versions of torch and the ONNX libraries: all go into the key, so a change to any
    traces afresh. The directory is TRACE_CACHE_ENV's; unset, empty or "off": no cache.
    """
    import onnxscript

    where = os.environ.get(TRACE_CACHE_ENV, "")
    if where.lower() in ("", "off", "0", "no", "false"):
        return None
    root = Path(where)
    code = hashlib.sha256()
    core, here = Path(llama_tools.__file__).parent, Path(__file__).parent
    for f in (core / "modeling" / "model.py", core / "modeling" / "config.py", here / "trace.py",
              here / "onnx_export.py", here / "rope_ops.py", here / "graph_io.py"):
        code.update(f.read_bytes())
    key = {"config": {k: v for k, v in template.to_dict().items() if k not in ("name", "source")},
           "dtype": str(dtype), "rope_op": rope_op, "opset": opset, "code": code.hexdigest(),
           "versions": [torch.__version__, onnxscript.__version__, ir.__version__, onnx.__version__,
                        llama_tools.__version__]}
    return root / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".onnx")


def _load_trace(path: Path) -> tuple[ir.Model, list[ir.Value], dict[str, str]] | None:
    """A cached trace (graph, fake weights, folded transposes), or None when there is none or it is unreadable."""
    try:
        model = ir.serde.deserialize_model(onnx.load(str(path), load_external_data=False))
        hidden_names = json.loads(model.metadata_props.pop(_CACHED + "hidden"))
        folded = json.loads(model.metadata_props.pop(_CACHED + "folded"))
        hidden = [model.graph.initializers[name] for name in hidden_names]
    except Exception:  # missing, half-written by a killed run, from another layout: trace afresh  # noqa: BLE001
        return None
    for v in hidden:
        v.const_value = None  # fake weights: no data, as the trace leaves them
    return model, hidden, folded


def _save_trace(path: Path, model: ir.Model, hidden: list[ir.Value], folded: dict[str, str]) -> None:
    """Keep the traced graph (a few hundred KB: no weights) for the next export of the same shapes."""
    for v in hidden:  # a placeholder: serialization drops an initializer without data
        v.const_value = ir.ExternalTensor("fake-weights", 0, int(value_bytes(v)), v.dtype, name=v.name,
                                          shape=ir.Shape([int(d) for d in v.shape]))
    model.metadata_props[_CACHED + "hidden"] = json.dumps([v.name for v in hidden])
    model.metadata_props[_CACHED + "folded"] = json.dumps(folded)
    try:
        data = ir.serde.serialize_model(model).SerializeToString()
    finally:
        for v in hidden:
            v.const_value = None
        del model.metadata_props[_CACHED + "hidden"], model.metadata_props[_CACHED + "folded"]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)  # whole or not at all, also with two exports at once
    except OSError:  # a cache we cannot write costs the next export a trace, nothing else
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _ticking(progress: Progress, done: int, total: int, what: str, every: float = 1.0) -> Iterator[None]:
    """progress(done, total, what) now and every `every` s until the block ends, so a long call shows its time."""
    if progress is silent:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while True:
            progress(done, total, what)
            if stop.wait(every):
                return
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _layer_path(j: int) -> str:
    """The node-name prefix of decoder j's nodes (_name_nodes)."""
    return f"/model/layers.{j}/"


def _stamp_layers(graph: ir.Graph, num_layers: int, hidden: list[ir.Value], folded: dict[str, str],
                  stamped: Callable[[int], None]) -> tuple[list[ir.Value], dict[str, str]]:
    """Decoders 2..n-1 appended as copies of traced decoder 1, each named by its module path and reading its own
    past K/V and weights and the decoder before's output; returns the fake weights and folded transposes, all layers.

    What layer 1 reads from layer 0 is either layer 0's output (its twin by node name produces the value layer 1
    hands on) or something every layer shares (shape values the optimizer computed once, in layer 0); the mask,
    positions and cos/sin come from before the layers. The nodes outside layer 1 that read its past (torch.export
    takes the past length from the last layer's) read the last layer's. tests/test_export_speed_graph.py checks
    the result against graphs traced whole.
    """
    nodes = list(graph)
    zero, one = _layer_path(0), _layer_path(1)
    at = [i for i, node in enumerate(nodes) if node.name.startswith(one)]
    assert at and at == list(range(at[0], at[-1] + 1)), "decoder 1's nodes are not one block"
    template, outside = nodes[at[0]:at[-1] + 1], nodes[:at[0]] + nodes[at[-1] + 1:]
    produced = {v for node in template for v in node.outputs}
    carried = {v for node in nodes[at[-1] + 1:] for v in node.inputs if v in produced}  # layer 1's output
    twins = {node.name: node for node in template}
    recurrent: dict[ir.Value, ir.Value] = {}  # what layer 1 reads of layer 0's output -> its own in that role
    for node in template:
        for v in node.inputs:
            p = v.producer() if v is not None and v not in produced else None
            twin = twins.get(p.name.replace(zero, one, 1)) if p is not None and p.name.startswith(zero) else None
            if twin is not None and twin.op_type == p.op_type and twin.outputs[v.index()] in carried:
                recurrent[v] = twin.outputs[v.index()]
    assert set(recurrent.values()) == carried, f"no layer-0 twin for {[v.name for v in carried]}"
    past = {graph_io.past_name(1, kv): kv for kv in graph_io.KV}
    present = {graph_io.present_name(1, kv): kv for kv in graph_io.KV}
    inputs = [v for v in graph.inputs if v.name in past]
    outputs = [v for v in graph.outputs if v.name in present]
    prefix = "model.layers.1."
    weights = [v for v in graph.initializers.values() if v.name.startswith(prefix)]
    assert len(inputs) == len(outputs) == len(past), f"layer 1's past/present: {inputs}, {outputs}"
    assert all(use.node in twins.values() for v in weights for use in v.uses()), "layer-1 weights read elsewhere"

    listed = list(graph.initializers.values())
    previous = {v: v for v in produced}  # each value of layer 1 -> its copy in the layer before the one being made
    made_in: dict[ir.Value, list[ir.Value]] = {v: [] for v in [*inputs, *outputs, *weights]}  # layers 2..n-1
    new_nodes: list[ir.Node] = []
    for j in range(2, num_layers):
        vmap: dict[ir.Value, ir.Value] = {v0: previous[v1] for v0, v1 in recurrent.items()}
        for v in inputs:
            vmap[v] = ir.Value(name=graph_io.past_name(j, past[v.name]), shape=v.shape.copy(), type=v.type)
        for v in weights:
            vmap[v] = ir.Value(name=f"model.layers.{j}." + v.name.removeprefix(prefix), shape=v.shape.copy(),
                               type=v.type, const_value=v.const_value)
            graph.initializers.add(vmap[v])
        for node in template:
            clone = ir.Node(node.domain, node.op_type, [vmap.get(v, v) if v is not None else None for v in node.inputs],
                            [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in node.attributes.values()],
                            overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                            name=_layer_path(j) + node.name.removeprefix(one), doc_string=node.doc_string)
            for o, c in zip(node.outputs, clone.outputs):
                c.name = graph_io.present_name(j, present[o.name]) if o in outputs else f"{o.name}.{j}"
                c.shape, c.type = (o.shape.copy() if o.shape is not None else None), o.type
                vmap[o] = c
            new_nodes.append(clone)
        previous = {v: vmap[v] for v in produced}
        for v in made_in:
            made_in[v].append(vmap[v])
        stamped(j)
    graph.insert_after(template[-1], new_nodes)
    for group, io in ((inputs, graph.inputs), (outputs, graph.outputs)):  # layer-major, after layer 1's
        at_io = io.index(group[-1]) + 1
        for k, v in enumerate(v for layer in zip(*(made_in[g] for g in group)) for v in layer):
            io.insert(at_io + k, v)
    last = {**{v: made_in[v][-1] for v in inputs}, **{v: previous[v] for v in carried}}
    for node in outside:
        for i, v in enumerate(node.inputs):
            if v in last:
                node.replace_input_with(i, last[v])
    # Initializers in the order a whole trace lists them: each run of layer-1 weights followed by its copies.
    order: list[ir.Value] = []
    run: list[ir.Value] = []
    for v in [*listed, None]:
        if v is not None and v in made_in:
            run.append(v)
            continue
        order += run + [made_in[w][k] for k in range(num_layers - 2) for w in run]
        run = []
        if v is not None:
            order.append(v)
    _reorder_initializers(graph, order)
    fake = set(hidden)
    hidden = hidden + [c for w in weights if w in fake for c in made_in[w]]
    folded = {**folded, **{f"model.layers.{j}." + name.removeprefix(prefix): f"model.layers.{j}." + w.removeprefix(prefix)
                           for name, w in folded.items() if name.startswith(prefix) for j in range(2, num_layers)}}
    return hidden, folded


def _reorder_initializers(graph: ir.Graph, order: list[ir.Value]) -> None:
    """The graph's initializers, as `order` lists them (the same values)."""
    assert len(order) == len(graph.initializers) and {id(v) for v in order} == {
        id(v) for v in graph.initializers.values()}, "reordering must keep the same initializers"
    for name in list(graph.initializers):
        graph.initializers.pop(name)
    for v in order:
        graph.initializers.add(v)


def _name_values(graph: ir.Graph) -> None:
    """Values named by what makes them, `<node name>_output_<i>`, and the exporter's constants `const_<k>`;
    torch's records of its traced program dropped.

    torch.onnx names values from counters over the whole trace (add_504, val_76) and records its program's
    signature and symbols (pkg.torch.*, on the graph and each value), which a graph stamped from two traced
    layers cannot reproduce, and which name weights the graph no longer has (q_proj.weight, now folded);
    these names are the same either way, and read like the nodes'.
    """
    io = {*graph.inputs, *graph.outputs}
    for node in graph:
        for i, v in enumerate(node.outputs):
            if v not in io:
                v.name = f"{node.name}_output_{i}"
            v.metadata_props.clear()
    order = list(graph.initializers.values())
    for v in [*graph.inputs, *graph.outputs, *order]:
        v.metadata_props.clear()
    for key in [k for k in graph.metadata_props if k.startswith("pkg.torch.")]:
        del graph.metadata_props[key]
    constants = [v for v in order if v.const_value is not None]  # the weights are fake, without data
    for k, v in enumerate(constants):
        v.name = f"const_{k}"
    _reorder_initializers(graph, order)


def value_bytes(v: ir.Value) -> int:
    """An initializer's bytes, from its declared type and shape (its data may not be loaded yet)."""
    import math

    assert v.type is not None and v.shape is not None, f"initializer {v.name} without type or shape"
    return math.prod(int(d) for d in v.shape) * v.type.dtype.itemsize
