"""A bf16 graph run where the provider has no bf16 kernels (onnxruntime's CPU): fp32 arithmetic, bf16 rounding.

Every tensor the graph holds in bf16 becomes fp32 holding the same value, and every node that produced a bf16
tensor is followed by a round trip through bf16, so each op computes in fp32 on bf16 values and its result is
rounded to bf16 (round to nearest even: onnxruntime's Cast, as torch's):

    x ──Op──► y (bf16)          x ──Op──► y (fp32) ──Cast bf16──Cast fp32──► y' (bf16 values, fp32 type)

That is what a GPU's bf16 kernels do (fp32 accumulation, a bf16 result); ops that already upcast inside (the
RMSNorm's Cast to fp32, our RoPE node's fp32 rotation) keep doing so. A bf16 export can then be judged on
the CPU by the same error budget (`verify parity`), against PyTorch's own bf16 on the CPU.
"""

from __future__ import annotations

from typing import Any

BF16, FLOAT = 16, 1  # onnx.TensorProto.BFLOAT16, FLOAT
_FLOAT_TYPES = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16: what an op's float output follows
_INT_OUTPUT_OPS = {"Shape", "Size", "ArgMax", "ArgMin", "NonZero", "Equal", "Less", "Greater", "LessOrEqual",
                   "GreaterOrEqual", "Not", "And", "Or", "Range"}  # outputs that are never bf16 (Range: ints here)


def is_bf16_graph(model: Any) -> bool:
    """Whether the graph's float inputs or initializers are bf16 (a `--dtype bfloat16` export)."""
    return any(t.data_type == BF16 for t in model.graph.initializer) or any(
        i.type.tensor_type.elem_type == BF16 for i in model.graph.input)


def _types(model: Any) -> dict[str, int]:
    """Element type of every value: from the graph's own value_info where it has one, else propagated forward
    (Cast: its `to`; CastLike: its target's; other ops: their first float input's)."""
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Cast":
            guess = attrs["to"].i
        elif node.op_type == "CastLike":
            guess = types.get(node.input[1], 0)
        elif node.op_type == "Constant":
            guess = next((a.t.data_type for a in node.attribute if a.name == "value"), FLOAT)
        elif node.op_type in _INT_OUTPUT_OPS:
            guess = 0
        else:
            guess = next((types[i] for i in node.input if types.get(i) in _FLOAT_TYPES), 0)
        for out in node.output:
            types.setdefault(out, guess)
    return types


def emulate_bf16(model: Any) -> Any:
    """The same graph (onnx.ModelProto with its weights loaded) with bf16 emulated in fp32: a new proto."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    types = _types(m)
    for t in g.initializer:  # bf16 -> fp32 holds every value exactly
        if t.data_type == BF16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype("float32"), t.name))
    for v in (*g.input, *g.output, *g.value_info):
        if v.type.tensor_type.elem_type == BF16:
            v.type.tensor_type.elem_type = FLOAT
    nodes = []
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == BF16:
                a.i = FLOAT  # the rounding below does what the cast to bf16 did
            if a.name == "value" and a.t.data_type == BF16:  # Constant, ConstantOfShape
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype("float32"), a.t.name))
        nodes.append(node)
        for i, out in enumerate(node.output):
            if not out or types.get(out) != BF16:
                continue
            raw = f"{out}/fp32"  # the op's fp32 result; `out` (a graph output too) becomes its bf16-rounded value
            node.output[i] = raw
            nodes.append(helper.make_node("Cast", [raw], [f"{out}/bf16"], name=f"{node.name}/round_bf16_{i}", to=BF16))
            nodes.append(helper.make_node("Cast", [f"{out}/bf16"], [out], name=f"{node.name}/back_fp32_{i}", to=FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    g.ClearField("value_info")  # stale types of the renamed values; onnxruntime infers them again
    return m
