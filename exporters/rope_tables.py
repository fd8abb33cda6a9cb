"""RoPE's cos/sin tables computed in the graph from the pass's length, for the scalings whose tables depend on it.

dynamic NTK and longrope (llama_tools/modeling/rope.py) pick their frequencies from the pass's length L, as
transformers 4.57's RotaryEmbedding does at every forward call (modeling_rope_utils.dynamic_rope_update): L is
the largest position of the pass + 1 (`torch.max(position_ids) + 1`, over the whole batch); longrope divides by
long_factor once L > original_max_position_embeddings, else by short_factor; dynamic raises the base to
base (factor max(L, m) / m - factor + 1)^(d / (d - 2)), m = max_position_embeddings (unchanged within it). So one
graph serves prefill and decode at any length: each pass computes its own tables, every RoPE node of the graph (ours,
onnxruntime's, opset 23's, GroupQueryAttention's own rotary) reads them as it would read fixed ones, and the keys
already in the cache keep the rotation they were stored with, as transformers' cache keeps them.

The tables have max(L, t) rows (t = attention_mask's length): every position the caller gives, and every cache slot
GroupQueryAttention's rotary turns a token by. Angles in float64 as the model's own tables (model.rope_cache), then
cast to the tables' type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.rope import per_pass, rope_attention_factor, rope_inv_freq

from .graph_io import ATTENTION_MASK, POSITION_IDS

PATH = "/model/rotary_emb"  # the nodes' module path (transformers' name for the module computing the tables)
TABLES = ("cos_cache", "sin_cache")  # the tables' value names: those of the fixed initializers they replace


@dataclass
class PassTables:
    """The nodes and constants that compute one pass's (cos, sin), and those two values."""

    nodes: list[ir.Node] = field(default_factory=list)
    initializers: list[ir.Value] = field(default_factory=list)
    cos: ir.Value | None = None
    sin: ir.Value | None = None

    def op(self, op_type: str, inputs: list[ir.Value], attributes: dict | None = None, *, name: str | None = None,
           output: str | None = None) -> ir.Value:
        """One node `/model/rotary_emb/<name or op_type>`, its output `<node name>/output_0` (or `output`)."""
        node_name = f"{PATH}/{name or op_type}"
        value = ir.Value(name=output or f"{node_name}/output_0")
        self.nodes.append(ir.Node("", op_type, inputs, ir.convenience.convert_attributes(attributes or {}),
                                  outputs=[value], name=node_name))
        return value

    def const(self, name: str, data: object, dtype: type) -> ir.Value:
        array = np.asarray(data, dtype=dtype)
        value = ir.Value(name=f"{PATH}/{name}", shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         const_value=ir.tensor(array, name=f"{PATH}/{name}"))
        self.initializers.append(value)
        return value


def inv_freq_tables(cfg: ModelConfig) -> tuple[list[float], list[float]]:
    """longrope's θ̄ within the original context and past it (short and long factors), as rope.py computes them."""
    s = cfg.rope_scaling
    assert s is not None and s.type == "longrope", "longrope's two frequency sets"
    return rope_inv_freq(cfg, None), rope_inv_freq(cfg, s.original_max_position_embeddings + 1)


# position_ids [b, s] ──ReduceMax──► p [] ──Add 1──► L []        (the pass's length: its largest position + 1)
# attention_mask [b, t] ──Shape 1:2──Squeeze──► t []
# Max(L, t) ──Range(0, ·, 1)──Cast double──Unsqueeze──► i [n, 1]  (rows: every position and every cache slot)
# longrope: Greater(L, original) ──Where(long θ̄, short θ̄)──► θ̄ [r/2]
# dynamic:  Max(L, m) ──Cast double──Mul factor──Div m──Sub (factor - 1)──Pow d/(d-2)──Mul base──► base' []
#           base' ──Pow (t / d) [r/2]──Reciprocal──► θ̄ [r/2]
# i [n, 1] ──Mul θ̄──► angles [n, r/2] ──Cos / Sin──Mul attention factor──Cast──► cos_cache, sin_cache [n, r/2]
def pass_tables(cfg: ModelConfig, position_ids: ir.Value, attention_mask: ir.Value,
                dtype: ir.DataType) -> PassTables:
    """The nodes computing cos_cache and sin_cache [max(L, t), r/2] of `dtype` from the pass's length."""
    assert per_pass(cfg), "fixed tables are initializers"
    s = cfg.rope_scaling
    assert s is not None
    out = PassTables()
    i64, f64 = np.int64, np.float64
    largest = out.op("ReduceMax", [position_ids], {"keepdims": 0}, name="ReduceMax_positions")  # []
    length = out.op("Add", [largest, out.const("one", 1, i64)], name="Add_length")  # L []
    slots_1d = out.op("Shape", [attention_mask], {"start": 1, "end": 2}, name="Shape_slots")  # [1]
    slots = out.op("Squeeze", [slots_1d], name="Squeeze_slots")  # t []
    rows = out.op("Max", [length, slots], name="Max_rows")
    index = out.op("Range", [out.const("zero", 0, i64), rows, out.const("step", 1, i64)])  # [n]
    index_f = out.op("Cast", [index], {"to": ir.DataType.DOUBLE}, name="Cast_rows")
    column = out.op("Unsqueeze", [index_f, out.const("axis1", [1], i64)])  # [n] -> [n, 1]
    if s.type == "longrope":
        short, long = inv_freq_tables(cfg)
        past = out.op("Greater", [length, out.const("original", s.original_max_position_embeddings, i64)])
        inv = out.op("Where", [past, out.const("long_inv_freq", long, f64), out.const("short_inv_freq", short, f64)])
    else:  # dynamic, to rope.rope_inv_freq's arithmetic
        m, d, factor = cfg.max_position_embeddings, cfg.rotary_dim, float(s.factor)
        clamped = out.op("Max", [length, out.const("max_position_embeddings", m, i64)], name="Max_length")
        x = out.op("Cast", [clamped], {"to": ir.DataType.DOUBLE}, name="Cast_length")
        x = out.op("Mul", [x, out.const("factor", factor, f64)], name="Mul_factor")
        x = out.op("Div", [x, out.const("m", float(m), f64)], name="Div_max")
        x = out.op("Sub", [x, out.const("factor_minus_one", factor - 1, f64)], name="Sub_factor")
        x = out.op("Pow", [x, out.const("exponent", d / (d - 2), f64)], name="Pow_exponent")
        base = out.op("Mul", [x, out.const("base", float(cfg.rope_theta), f64)], name="Mul_base")  # base' []
        powers = out.op("Pow", [base, out.const("t_over_d", [t / d for t in range(0, d, 2)], f64)],
                        name="Pow_inv_freq")  # base'^(t/d) [r/2]
        inv = out.op("Reciprocal", [powers])
    angles = out.op("Mul", [column, inv], name="Mul_angles")  # [n, 1] x [r/2] -> [n, r/2]
    scale = rope_attention_factor(cfg)  # longrope's, 1 for dynamic
    factor_value = out.const("attention_factor", scale, f64) if scale != 1.0 else None
    for which, op_type, name in (("cos", "Cos", TABLES[0]), ("sin", "Sin", TABLES[1])):
        y = out.op(op_type, [angles])
        if factor_value is not None:
            y = out.op("Mul", [y, factor_value], name=f"Mul_{which}_attention_factor")
        setattr(out, which, out.op("Cast", [y], {"to": dtype}, name=f"Cast_{which}", output=name))
    return out


def replace_fixed_tables(model: ir.Model, cfg: ModelConfig, hidden: list[ir.Value]) -> list[ir.Value]:
    """The traced plain graph's cos_cache/sin_cache initializers (fake, fixed) replaced by pass_tables' nodes, put
    first in the graph, in the initializers' type; returns the fake weights without them."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    old = [graph.initializers[name] for name in TABLES]
    computed = pass_tables(cfg, inputs[POSITION_IDS], inputs[ATTENTION_MASK], old[0].dtype)
    for value, new in zip(old, (computed.cos, computed.sin)):
        del graph.initializers[value.name]
        value.replace_all_uses_with(new)
    for value in computed.initializers:
        graph.initializers.add(value)
    first = next(iter(graph))
    graph.insert_before(first, computed.nodes)
    return [v for v in hidden if v not in old]
