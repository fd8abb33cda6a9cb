"""RoPE as one ONNX node, and the registry of the nodes it can be: ours, onnxruntime's, or ONNX's.

The model calls the torch custom op `llama_tools::rope` (llama_tools/modeling/model.py), which torch.export keeps
as one call; `translation_table` tells torch.onnx which single ONNX node to emit for it. Our op's
FunctionProto is attached after the export (the exporter inlines local functions), so stock onnxruntime
runs the model on any provider with no extra library.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .graph_io import MS_DOMAIN

if TYPE_CHECKING:  # onnx and torch load inside the functions: the CLI reads ROPE_OPS without them
    import numpy as np
    import onnx

DOMAIN = "llama_tools"
OP_TYPE = "RotaryEmbedding"
VERSION = 1
ATTR_INTERLEAVED = "interleaved"  # the attribute that picks the channel pairs, in all three ops
ATTR_ROTARY_HEADS = "rotary_heads"  # ours only: rotate the first heads of a packed QKV, pass the V heads through
ATTR_HEAD_DIM = "head_dim"  # ours only: a head's width when only its first 2 x (the tables' width) channels rotate


@dataclass(frozen=True)
class RopeOp:
    """One way to emit RoPE: the node's domain and name, the opset it needs, its tables' type."""

    name: str  # as --rope-op takes it
    domain: str
    display: str
    min_opset: int
    fp32_tables: bool  # cos/sin stay fp32 in a half-precision graph (else the activations' type)
    help: str
    fused_only: bool = False  # no node of its own: only the fused graph's attention can hold it


ROPE_OPS: dict[str, RopeOp] = {op.name: op for op in [
    RopeOp("llama_tools", DOMAIN, f"{DOMAIN}.{OP_TYPE}", 18, True,
           "our node, with its ONNX function body: any onnxruntime runs it"),
    RopeOp("contrib", MS_DOMAIN, f"{MS_DOMAIN}.{OP_TYPE}", 18, False, "onnxruntime's fused contrib op"),
    RopeOp("onnx", "", f"{OP_TYPE} (opset 23)", 23, False, "the standard op of opset 23"),
    RopeOp("attention", MS_DOMAIN, f"{MS_DOMAIN}.GroupQueryAttention (do_rotary)", 18, False,
           "onnxruntime's attention rotates q and k itself, the fused graph's default (its cache holds keys rotated "
           "by slot)", fused_only=True),
]}
OURS = ROPE_OPS["llama_tools"]
IN_ATTENTION = ROPE_OPS["attention"]
IN_ATTENTION_HEAD_DIM_MULTIPLE = 16  # GroupQueryAttention's rotary: "head_size shall be a multiple of 16"
# ... and of partial rotary: "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8" (its rotary width r
# is 2 x that dimension, so r a multiple of 16 too)
IN_ATTENTION_ROTARY_MULTIPLE = 16


def in_attention_refusal(head_dim: int, rotary_dim: int) -> str | None:
    """Why GroupQueryAttention's own rotary cannot rotate heads of head_dim whose first rotary_dim channels turn;
    None when it can."""
    if head_dim % IN_ATTENTION_HEAD_DIM_MULTIPLE:
        return (f"head_dim {head_dim}: GroupQueryAttention's own rotary needs a multiple of "
                f"{IN_ATTENTION_HEAD_DIM_MULTIPLE}")
    if rotary_dim % IN_ATTENTION_ROTARY_MULTIPLE:
        return (f"rotary width {rotary_dim} (partial rotary): GroupQueryAttention's own rotary needs a multiple of "
                f"{IN_ATTENTION_ROTARY_MULTIPLE}")
    return None


def unrotate_slots(keys: "np.ndarray", offsets: "np.ndarray", cos: "np.ndarray", sin: "np.ndarray",
                   interleaved: bool) -> "np.ndarray":
    """Keys rotated by their cache slot (IN_ATTENTION) -> rotated by their position: each row turned back by its
    left padding. keys [b, kv_heads, slots, n6]; offsets [b] (a row's padding); cos, sin [max_pos, r/2], r the
    rotary width (n6, or fewer channels under partial rotary: those past r were never turned and stay as they are).

    RoPE's angles are linear in the position (i θ_t, scaled or not), so R(pad + i) = R(pad) R(i), and R(-pad)
    undoes the padding's share exactly (in float64).
    """
    import numpy as np

    c = np.asarray(cos, np.float64)[offsets][:, None, None, :]  # [b, 1, 1, r/2]
    s = -np.asarray(sin, np.float64)[offsets][:, None, None, :]  # sin(-a) = -sin(a)
    k = np.asarray(keys, np.float64)
    r = 2 * c.shape[-1]
    kr, passed = k[..., :r], k[..., r:]  # partial rotary: the channels past r pass through
    if interleaved:  # pairs (x0, x1), (x2, x3), ...
        x0, x1 = kr[..., 0::2], kr[..., 1::2]
        out = np.empty_like(kr)
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x1 * c + x0 * s
    else:
        half = r // 2  # HF's half split: (x_t, x_{t + r/2})
        x0, x1 = kr[..., :half], kr[..., half:]
        out = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)
    return np.concatenate([out, passed], axis=-1)


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
        "llama_tools.modeling.model.rope: x [batch, heads, seq, head_dim] rotated by the angles of position_ids [batch, seq], "
        "in fp32 from fp32 tables [max_pos, rotary_dim / 2], cast back to x's type. interleaved 1: pairs (x0, x1), "
        "(x2, x3)... (Meta); 0: halves (HF). num_heads > 0 (optional, default 0): x is 3-D "
        "[batch, seq, num_heads * head_dim] instead, as a packed projection leaves it. rotary_heads > 0 (optional, "
        "with num_heads): only the first rotary_heads heads are rotated, the others pass through unchanged (the V "
        "heads of a packed QKV). head_dim > 0 (optional, default 0: 2 x the tables' width): a head's width when only "
        "its first 2 x (the tables' width) channels rotate (partial rotary); the rest pass through unchanged.",
        [("x", "T"), ("position_ids", "tensor(int64)"), ("cos_cache", "tensor(float)"), ("sin_cache", "tensor(float)")],
        ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
        [(ATTR_INTERLEAVED, True), ("num_heads", False), (ATTR_ROTARY_HEADS, False), (ATTR_HEAD_DIM, False)],
    )


@functools.cache
def ort_schema() -> "onnx.defs.OpSchema":
    """As onnxruntime's ContribOperators.md documents it: input 3-D or 4-D, tables of the input's type."""
    return _schema(
        OP_TYPE, MS_DOMAIN, "onnxruntime's fused RotaryEmbedding (contrib op)",
        [("input", "T"), ("position_ids", "tensor(int64)"), ("cos_cache", "T"), ("sin_cache", "T")],
        ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
        [(ATTR_INTERLEAVED, False), ("is_packed_batching", False), ("num_heads", False), ("rotary_embedding_dim", False)],
    )


# --- The function body: the same math as llama_tools.modeling.model.rope, in ONNX ------------------------------
#
# Channel i of a head of width d, i < r (the rotary width, 2 x the tables' width: d itself unless partial rotary),
# is rotated with its partner channel p(i) by the angle in column c(i) of the tables:
#   halves (HF):        p(i) = (i + r/2) mod r,   c(i) = i mod r/2,   x0 = the first half
#   interleaved (Meta): p(i) = i xor 1,           c(i) = i div 2,     x0 = the even channels
#   y_i = x_i cos_c(i) + x_p(i) (s_i sin_c(i)),   s_i = -1 where channel i is an x0, else +1
# i.e. y0 = x0 cos - x1 sin, y1 = x1 cos + x0 sin, bit for bit (a sign flip is exact; the products and the
# one add are the model's own). Over the last axis of x ([.., d], or [.., h d] with num_heads = h), channel
# j = head * d + i. With rotary_heads = r_h, the heads from r_h on (a packed QKV's V) get cos 1 and sin 0:
# y = x * 1 + partner * 0 = x, unchanged; so do the channels i >= r of every head (partial rotary, head_dim = d
# given), each its own partner. c and s depend only on the tables' shape and the attributes, cos and sin only on
# position_ids: onnxruntime folds the first at load and computes the second once per run for every node of
# the graph (common subexpressions). The partners are one Gather over the last axis, by an index that is
# folded at load too. What is left per node at run time: Gather, Mul, Mul, Add; at decode a node's cost is
# its kernel count (a row of a few hundred channels), so fewer kernels is what makes it cheap.
#
#   position_ids [b, s] ──Gather(cos_cache) [b, s, r/2]──Gather c, axis -1──► [b, s, h d] ──Reshape──► cos
#   position_ids [b, s] ──Gather(sin_cache)──Gather c──Mul s──Reshape──► sin     (signed)
#       cos, sin: [b, s, h d] for 3-D x, [b, 1, s, d] for 4-D x [b, h, s, d] (broadcast over the heads)
#   x ──Cast fp32──► xf ──Gather head d + p(i), axis -1──► partner
#   xf cos + partner sin ──CastLike x──► y, x's own shape
_FUNCTION_TEXT = """
<domain: "llama_tools", opset_import: ["": {opset}]>
RotaryEmbedding <interleaved, num_heads: int = 0, rotary_heads: int = 0, head_dim: int = 0> (x, position_ids, cos_cache, sin_cache) => (y) {{
    zero = Constant <value_int = 0> ()
    one = Constant <value_int = 1> ()
    two = Constant <value_int = 2> ()
    one_1d = Constant <value_ints = [1]> ()
    heads_attr = Constant <value_int: int = @num_heads> ()
    flag = Constant <value_int: int = @interleaved> ()
    is_interleaved = Cast <to = 9> (flag)
    is_3d = Greater (heads_attr, zero)
    is_3d_int = Cast <to = 7> (is_3d)
    heads = Max (heads_attr, one)  # heads along x's last axis: 1 for 4-D x

    half_1d = Shape <start = 1, end = 2> (cos_cache)  # [r/2]
    half = Squeeze (half_1d)
    rdim = Mul (half, two)  # r, the rotary width
    head_attr = Constant <value_int: int = @head_dim> ()
    head_given = Greater (head_attr, zero)
    dim = Where (head_given, head_attr, rdim)  # d: r unless head_dim says more (partial rotary)
    width = Mul (dim, heads)  # x's last axis
    j = Range (zero, width, one)
    i = Mod (j, dim)  # the channel within its head
    in_rotary = Less (i, rdim)
    ir = Where (in_rotary, i, zero)  # the channel within the rotary part (0 past it: passed through)
    i_mod_2 = Mod (ir, two)
    pair_column = Div (ir, two)
    half_column = Mod (ir, half)
    column = Where (is_interleaved, pair_column, half_column)  # c(i)
    minus = Constant <value_float = -1.0> ()
    plus = Constant <value_float = 1.0> ()
    is_even = Equal (i_mod_2, zero)
    in_first_half = Less (ir, half)
    pair_sign = Where (is_even, minus, plus)
    half_sign = Where (in_first_half, minus, plus)
    rotary_sign = Where (is_interleaved, pair_sign, half_sign)  # s(i): -1 on the x0 channels
    rotary_attr = Constant <value_int: int = @rotary_heads> ()
    some_heads = Greater (rotary_attr, zero)
    rotated_heads = Where (some_heads, rotary_attr, heads)  # r_h: every head unless told
    head = Div (j, dim)
    head_rotated = Less (head, rotated_heads)
    is_rotated = And (head_rotated, in_rotary)
    zero_float = Constant <value_float = 0.0> ()
    sign = Where (is_rotated, rotary_sign, zero_float)  # sin 0 on the heads and channels passed through
    width_1d = Reshape (width, one_1d)
    zero_1d = Constant <value_ints = [0]> ()
    three_1d = Constant <value_ints = [3]> ()
    is_3d_1d = Reshape (is_3d_int, one_1d)
    four_d_shape = Constant <value_ints = [0, 1, -1]> ()  # [b, 1, s, ..]; 3-D x drops the 1: [b, s, ..]
    lead = Slice (four_d_shape, zero_1d, one_1d)
    skip = Add (one_1d, is_3d_1d)
    rest = Slice (four_d_shape, skip, three_1d)
    table_shape = Concat <axis = 0> (lead, rest, width_1d)

    cos_rows = Gather (cos_cache, position_ids)  # [b, s, r/2]
    sin_rows = Gather (sin_cache, position_ids)
    cos_wide = Gather <axis = -1> (cos_rows, column)  # [b, s, h d]
    sin_unsigned = Gather <axis = -1> (sin_rows, column)
    sin_wide = Mul (sin_unsigned, sign)
    cos_rotated = Where (is_rotated, cos_wide, plus)  # cos 1 on the heads and channels passed through
    cos = Reshape (cos_rotated, table_shape)
    sin = Reshape (sin_wide, table_shape)

    # The partner of every channel, one index over x's last axis (folded at load): head * d + p(i), i past r its own.
    i_plus_one = Add (ir, one)
    odd_twice = Mul (i_mod_2, two)
    pair_partner = Sub (i_plus_one, odd_twice)  # i xor 1
    i_plus_half = Add (ir, half)
    half_partner = Mod (i_plus_half, rdim)  # (i + r/2) mod r
    rotary_partner = Where (is_interleaved, pair_partner, half_partner)  # p(i)
    partner_in_head = Where (in_rotary, rotary_partner, i)
    head_start = Mul (head, dim)
    partner = Add (head_start, partner_in_head)

    xf = Cast <to = 1> (x)
    partner_x = Gather <axis = -1> (xf, partner)  # channel j holds x_p(j)
    x_cos = Mul (xf, cos)
    partner_sin = Mul (partner_x, sin)
    rotated = Add (x_cos, partner_sin)
    y = CastLike (rotated, x)
}}
"""


def rope_function(opset: int) -> "onnx.FunctionProto":
    """The FunctionProto of llama_tools::RotaryEmbedding, over the model's default-domain opset."""
    import onnx.parser

    assert opset >= 18, f"our graphs are opset 18+ (the op's min_opset); got {opset}"
    return onnx.parser.parse_function(_FUNCTION_TEXT.format(opset=opset))


# --- The ONNX side: what node each choice emits ----------------------------------------------------------

def translation_table(rope_op: str, head_dim: int, rotary_dim: int | None = None) -> dict:
    """custom_translation_table for torch.onnx.export: llama_tools::rope -> one node of `rope_op`.

    rotary_dim: the channels of a head that rotate (partial rotary); None: all head_dim of them."""
    import onnxscript
    import torch
    from onnxscript import opset18 as op

    get_rope_op(rope_op)
    rotary = head_dim if rotary_dim is None else rotary_dim
    partial = {ATTR_HEAD_DIM: int(head_dim)} if rotary < head_dim else {}  # full heads: the attribute left out

    def ours(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        our_rope = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, VERSION), OP_TYPE, our_schema())
        return our_rope(x, position_ids, cos_cache, sin_cache, interleaved=int(interleaved), **partial)

    def contrib(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        # ORT's op takes 4-D [batch, heads, seq, head_dim] as is; it wants the tables in x's type (the
        # exporter hands them over so, and the optimizer drops the no-op CastLike) and num_heads whenever
        # rotary_embedding_dim is given (heads differ for q and k under GQA).
        ort_rope = onnxscript.values.Op(onnxscript.values.Opset(MS_DOMAIN, 1), OP_TYPE, ort_schema())
        return ort_rope(x, position_ids, op.CastLike(cos_cache, x), op.CastLike(sin_cache, x),
                        interleaved=int(interleaved), num_heads=int(x.shape[1]), rotary_embedding_dim=rotary)

    def standard(x, position_ids, cos_cache, sin_cache, interleaved: bool):
        from onnxscript import opset23

        # Opset 23's op: 4-D input as ORT's, tables in x's type too, but the order is (X, cos, sin, position_ids).
        return opset23.RotaryEmbedding(x, op.CastLike(cos_cache, x), op.CastLike(sin_cache, x), position_ids,
                                       interleaved=int(interleaved), rotary_embedding_dim=rotary)

    fn = {"llama_tools": ours, "contrib": contrib, "onnx": standard}[rope_op]
    return {torch.ops.llama_tools.rope.default: fn}
