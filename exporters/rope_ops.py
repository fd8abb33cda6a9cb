"""RoPE as one ONNX node, and the registry of the nodes it can be: ours, onnxruntime's, or ONNX's.

The model calls the torch custom op `llama_tools::rope` (llama_tools/model.py), which torch.export keeps
as one call; `translation_table` tells torch.onnx which single ONNX node to emit for it. Our op's
FunctionProto is attached after the export (the exporter inlines local functions), so stock onnxruntime
runs the model on any provider with no extra library.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # onnx and torch load inside the functions: the CLI reads ROPE_OPS without them
    import onnx

DOMAIN = "llama_tools"
OP_TYPE = "RotaryEmbedding"
VERSION = 1
ATTR_INTERLEAVED = "interleaved"  # the attribute that picks the channel pairs, in all three ops


@dataclass(frozen=True)
class RopeOp:
    """One way to emit RoPE: the node's domain and name, the opset it needs, its tables' type."""

    name: str  # as --rope-op takes it
    domain: str
    display: str
    min_opset: int
    fp32_tables: bool  # cos/sin stay fp32 in a half-precision graph (else the activations' type)
    help: str


ROPE_OPS: dict[str, RopeOp] = {op.name: op for op in [
    RopeOp("llama_tools", DOMAIN, f"{DOMAIN}.{OP_TYPE}", 18, True,
           "our node, with its ONNX function body: any onnxruntime runs it"),
    RopeOp("contrib", "com.microsoft", f"com.microsoft.{OP_TYPE}", 18, False, "onnxruntime's fused contrib op"),
    RopeOp("onnx", "", f"{OP_TYPE} (opset 23)", 23, False, "the standard op of opset 23"),
]}
OURS = ROPE_OPS["llama_tools"]


def get_rope_op(name: str) -> RopeOp:
    if name not in ROPE_OPS:
        raise ValueError(f"unknown rope_op {name!r}; choose one of {', '.join(ROPE_OPS)}")
    return ROPE_OPS[name]


# --- The ops' contracts: onnxscript builds a node only from a schema -----------------------------------
# Neither is registered in onnx.defs (no process-wide state): the model carries our op's function body,
# and com.microsoft's schema belongs to onnxruntime, which onnx does not ship.

def _schema(op_type: str, domain: str, doc: str, inputs: list[tuple[str, str]], types: list[str],
            attributes: list[tuple[str, bool]]) -> "onnx.defs.OpSchema":
    import onnx

    param, attr = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        op_type, domain, 1, doc,
        inputs=[param(name, type_str) for name, type_str in inputs], outputs=[param("y", "T")],
        type_constraints=[("T", types, "activations")],
        attributes=[attr(name, onnx.defs.OpSchema.AttrType.INT, required=required) for name, required in attributes],
    )


@functools.cache
def our_schema() -> "onnx.defs.OpSchema":
    """Our op's contract, for onnxscript to build the node (not registered process-wide)."""
    return _schema(
        OP_TYPE, DOMAIN,
        "llama_tools.model.rope: x [batch, heads, seq, head_dim] rotated by the angles of position_ids [batch, seq], "
        "in fp32 from fp32 tables [max_pos, head_dim / 2], cast back to x's type. interleaved 1: pairs (x0, x1), "
        "(x2, x3)... (Meta); 0: halves (HF). num_heads > 0 (optional, default 0): x is 3-D "
        "[batch, seq, num_heads * head_dim] instead, as a packed projection leaves it.",
        [("x", "T"), ("position_ids", "tensor(int64)"), ("cos_cache", "tensor(float)"), ("sin_cache", "tensor(float)")],
        ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
        [(ATTR_INTERLEAVED, True), ("num_heads", False)],
    )


@functools.cache
def ort_schema() -> "onnx.defs.OpSchema":
    """As onnxruntime's ContribOperators.md documents it: input 3-D or 4-D, tables of the input's type."""
    return _schema(
        OP_TYPE, "com.microsoft", "onnxruntime's fused RotaryEmbedding (contrib op)",
        [("input", "T"), ("position_ids", "tensor(int64)"), ("cos_cache", "T"), ("sin_cache", "T")],
        ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
        [(ATTR_INTERLEAVED, False), ("is_packed_batching", False), ("num_heads", False), ("rotary_embedding_dim", False)],
    )


# --- The function body: the same math as llama_tools.model.rope, in ONNX ------------------------------
#
#   x [b, h, s, d] ──Cast fp32──Reshape [0, 0, 0, -1] (a no-op)──► xf [b, h, s, d]
#   x [b, s, h d] (num_heads = h > 0) ──Cast fp32──Reshape [0, 0, h, -1]──► xf [b, s, h, d]   (no Transpose)
#   position_ids [b, s] ──Gather(cos_cache)──Unsqueeze 1 (4-D) or 2 (3-D)──► cos [b, 1, s, d/2] or [b, s, 1, d/2]
#   (fp32, likewise sin): either way it broadcasts over the heads axis.
#   The layout only says which channels pair up; the rotation itself is written once:
#   If interleaved:  xf ──Reshape [.., d/2, 2]──Split──Squeeze──► x0, x1 [.., d/2]   (evens, odds)
#   else (halves):   xf ──Split──► x0, x1 [.., d/2]                                   (first, second half)
#   (x0 cos - x1 sin, x1 cos + x0 sin) ──► y0, y1 [.., d/2]
#   If interleaved:  (y0, y1) ──Unsqueeze──Concat -1──Reshape──► rotated [.., d]   (pairs back in place)
#   else (halves):   (y0, y1) ──Concat -1──► rotated [.., d]
#   rotated ──Reshape Shape(x)──CastLike x──► y, x's own shape
#
# The Ifs see a 4-D tensor either way; subgraph outputs need a declared shape, whose dim names are labels only.
_FUNCTION_TEXT = """
<domain: "llama_tools", opset_import: ["": {opset}]>
RotaryEmbedding <interleaved, num_heads: int = 0> (x, position_ids, cos_cache, sin_cache) => (y) {{
    x32 = Cast <to = 1> (x)
    one = Constant <value_ints = [1]> ()
    last = Constant <value_ints = [-1]> ()
    heads_scalar = Constant <value_int: int = @num_heads> ()
    heads = Reshape (heads_scalar, one)  # [] -> [1]
    zero_zero = Constant <value_ints = [0, 0]> ()
    view_shape = Concat <axis = 0> (zero_zero, heads, last)  # [0, 0, 0, -1] keeps 4-D x; [0, 0, h, -1] splits heads
    xf = Reshape (x32, view_shape)  # [b, h, s, d] as is, or [b, s, h d] -> [b, s, h, d]
    zero_scalar = Constant <value_int = 0> ()
    is_3d = Greater (heads_scalar, zero_scalar)
    is_3d_int = Cast <to = 7> (is_3d)
    one_scalar = Constant <value_int = 1> ()
    heads_axis_scalar = Add (one_scalar, is_3d_int)  # 1 for [b, h, s, d], 2 for [b, s, h, d]
    heads_axis = Reshape (heads_axis_scalar, one)
    cos_rows = Gather (cos_cache, position_ids)
    sin_rows = Gather (sin_cache, position_ids)
    cos = Unsqueeze (cos_rows, heads_axis)  # [b, s, d/2] -> [b, 1, s, d/2] or [b, s, 1, d/2]: every head
    sin = Unsqueeze (sin_rows, heads_axis)
    flag = Constant <value_int: int = @interleaved> ()
    is_interleaved = Cast <to = 9> (flag)
    x0, x1 = If (is_interleaved) <
        then_branch = split_pairs () => (float[batch, heads, seq, half] evens, float[batch, heads, seq, half] odds) {{
            pair_shape = Constant <value_ints = [0, 0, 0, -1, 2]> ()
            pairs = Reshape (xf, pair_shape)  # [b, h, s, d] -> [b, h, s, d/2, 2]
            e5, o5 = Split <axis = -1, num_outputs = 2> (pairs)
            evens = Squeeze (e5, last)  # [b, h, s, d/2, 1] -> [b, h, s, d/2]
            odds = Squeeze (o5, last)
        }},
        else_branch = split_halves () => (float[batch, heads, seq, half] first, float[batch, heads, seq, half] second) {{
            first, second = Split <axis = -1, num_outputs = 2> (xf)
        }}
    >
    x0c = Mul (x0, cos)
    x1s = Mul (x1, sin)
    x1c = Mul (x1, cos)
    x0s = Mul (x0, sin)
    y0 = Sub (x0c, x1s)
    y1 = Add (x1c, x0s)
    rotated = If (is_interleaved) <
        then_branch = join_pairs () => (float[batch, heads, seq, dim] joined_pairs) {{
            y0_5 = Unsqueeze (y0, last)  # [b, h, s, d/2] -> [b, h, s, d/2, 1]
            y1_5 = Unsqueeze (y1, last)
            pairs_out = Concat <axis = -1> (y0_5, y1_5)
            flat_shape = Constant <value_ints = [0, 0, 0, -1]> ()
            joined_pairs = Reshape (pairs_out, flat_shape)  # [b, h, s, d/2, 2] -> [b, h, s, d]
        }},
        else_branch = join_halves () => (float[batch, heads, seq, dim] joined_halves) {{
            joined_halves = Concat <axis = -1> (y0, y1)
        }}
    >
    x_shape = Shape (x)
    out = Reshape (rotated, x_shape)  # back to x's own shape: a no-op for 4-D x
    y = CastLike (out, x)
}}
"""


def rope_function(opset: int) -> "onnx.FunctionProto":
    """The FunctionProto of llama_tools::RotaryEmbedding, over the model's default-domain opset."""
    import onnx.parser

    assert opset >= 18, f"the function body uses Split(num_outputs), opset 18+; got {opset}"
    return onnx.parser.parse_function(_FUNCTION_TEXT.format(opset=opset))


# --- The ONNX side: what node each choice emits ----------------------------------------------------------

def translation_table(rope_op: str, head_dim: int) -> dict:
    """custom_translation_table for torch.onnx.export: llama_tools::rope -> one node of `rope_op`."""
    import onnxscript
    import torch
    from onnxscript import opset18 as op

    get_rope_op(rope_op)

    def ours(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        our_rope = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, VERSION), OP_TYPE, our_schema())
        return our_rope(x, position_ids, cos_cache, sin_cache, interleaved=int(interleaved))

    def contrib(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        # ORT's op takes 4-D [batch, heads, seq, head_dim] as is; it wants the tables in x's type (the
        # exporter hands them over so, and the optimizer drops the no-op CastLike) and num_heads whenever
        # rotary_embedding_dim is given (heads differ for q and k under GQA).
        ort_rope = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), OP_TYPE, ort_schema())
        return ort_rope(x, position_ids, op.CastLike(cos_cache, x), op.CastLike(sin_cache, x),
                        interleaved=int(interleaved), num_heads=int(x.shape[1]), rotary_embedding_dim=head_dim)

    def standard(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        from onnxscript import opset23

        # Opset 23's op: 4-D input as ORT's, tables in x's type too, but the order is (X, cos, sin, position_ids).
        return opset23.RotaryEmbedding(x, op.CastLike(cos_cache, x), op.CastLike(sin_cache, x), position_ids,
                                       interleaved=int(interleaved), rotary_embedding_dim=head_dim)

    fn = {"llama_tools": ours, "contrib": contrib, "onnx": standard}[rope_op]
    return {torch.ops.llama_tools.rope.default: fn}
