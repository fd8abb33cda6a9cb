"""The fused decoder graph: onnxruntime's GroupQueryAttention, packed projections and Skip norms, RoPE our own node;
LLaMA's block, and GPT-NeoX's and Falcon's LayerNorm/GELU block in its parallel and sequential forms.

Built node by node with onnx_ir straight from the weights (no torch tracing), as onnxruntime-genai's builder
builds its graphs, for the same model `export_onnx` exports (weights from `llama_tools.load_model`). The graph
has the plain export's inputs and outputs, so `runtime.OnnxLM` and `verify parity` run it unchanged:

    input_ids [batch, seq], attention_mask [batch, past + seq], position_ids [batch, seq],
    past_key_values.N.key/value [batch, kv_heads, past, head_dim]  ->  logits, present.N.key/value

What onnxruntime's com.microsoft.GroupQueryAttention (GQA) is fed, and why (ContribOperators.md, the CPU kernel
in contrib_ops/cpu/bert/gqa_attention_base.h and group_query_attention_helper.h, and tests/test_fused.py):
  - seqlens_k[b] = total - 1 for EVERY row, total_sequence_length = attention_mask's length. GQA reads
    seqlens_k as "row b's keys are slots [0, seqlens_k[b]]" (right padding); with left padding the real keys
    end at the last slot in every row, so every row gets the full length and the padding is masked by
  - attention_bias [batch, 1, seq, total]: 0 where attention_mask is 1, the dtype's minimum where it is 0
    (the model's own mask value). Causality stays GQA's own.
  - rope_op "attention" (the default where head_dim % 16 == 0, fixed tables): do_rotary = 1, the model's cos/sin tables as
    cos_cache/sin_cache, and as GQA's position_ids the slot positions `_slot_positions` derives from
    attention_mask, not the caller's: with left padding each token's cache slot (the same shift for every real
    token of a row; the caller's positions would mix slot and position in the cache and break decode), after a
    gap its position (onnxruntime-genai right-pads a batch's prompts and appends new tokens after the padding:
    by slot, a short row's new tokens would sit too far from its prompt). Scores see only query-key distances,
    so outputs are the row's own. The cache holds left-padded keys rotated by slot: parity.keys_by_position
    turns them back by each row's padding before comparing. With dynamic's or longrope's tables (computed per
    pass, rope_tables.py) a key keeps its padding's turn at the tables it was stored with, which a later pass's
    tables no longer cancel: exact only on rows without left padding, so their default is our node.
  - any other rope_op: do_rotary = 0, q and k arrive rotated by a RoPE node from the caller's position_ids.
  - query = the packed QKV [b, s, (q + 2 kv heads) * head_dim] with key and value omitted (GQA's packed
    form): GQA's rotary, or our RoPE node (it rotates the q and k heads and passes v through unchanged,
    rotary_heads), so no Split runs. onnxruntime's RotaryEmbedding has no such attribute: with it, q, k, v are
    split first. Qwen3 and Gemma 3 normalize q and k apart first, and GQA takes q, k, v apart.
  - GPT-NeoX's and Falcon's packed query_key_value (per head, or per KV head, q k v interleaved) is regrouped into
    q, k, v when the checkpoint is read (checkpoints/formats.py), so their QKV MatMul stacks [all q | all k | all v]
    as every family's does; the qkv bias likewise.
  - past/present in BNSH [batch, kv_heads, slots, head_dim]; GQA writes the new keys at slots
    [total - seq, total) of every row. GQA needs head_dim % 8 == 0 (its own rotary would need % 16).
  - A prompt (seq > 1) continuing a non-empty cache needs batch 1 (GQA refuses otherwise); decode (seq = 1)
    and a first prompt take any batch.

Static KV (`static_kv=max_length`), as onnxruntime-genai's past_present_share_buffer: past and present are
[batch, kv_heads, max_length, head_dim]. GQA shares the buffer when present's memory IS past's (it compares the
pointers), which a caller arranges by binding one OrtValue as both (IOBinding; `StaticKVSession` does it):
decode then writes one slot per layer in place and allocates no cache. The caller feeds, per step:
attention_mask [batch, filled + seq] (filled = slots already written, the same for every row; left padding
stays zeros at the front), position_ids as usual, and keeps filled + seq <= max_length (not checked in the
graph: GQA would grow present past the buffer and stop sharing). Fed plain numpy arrays instead, the same
graph returns a fresh present holding the whole buffer (a copy each step, same numbers).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F
from onnx_ir.tensor_adapters import TorchTensor

from llama_tools.modeling import dtypes
from llama_tools.outputs import paths
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.model import layer_tables, rope_tables_of
from llama_tools.outputs.progress import Progress, peak_rss_bytes, silent
from llama_tools.modeling.rope import context_length, per_pass
from llama_tools.modeling.rope_layouts import INTERLEAVED
from llama_tools.checkpoints.source import ModelSource, resolve
from llama_tools.modeling.weights import weight_specs

from . import rope_ops, rope_tables
from .graph_io import GQA, MS_DOMAIN, io_names
from .onnx_export import META, TABLE_NAMES, ExportResult, real_weights, save_model, set_metadata
from .onnx_save import Rows
from .preflight import DEFAULT_OPSET, EXTERNAL_DATA_THRESHOLD_BYTES, check_args

GRAPH = "fused"  # the llama_tools.graph metadata value
FUSED_ROPE_OPS = (rope_ops.OURS.name, "contrib", rope_ops.IN_ATTENTION.name)  # 3-D [b, s, heads*n6], or GQA's own
GQA_HEAD_DIM_MULTIPLE = 8  # group_query_attention_helper: "head_size must be a multiple of 8"
# The ungated MLP's GELU as onnxruntime's contrib ops compute it (onnxruntime-genai's builder maps transformers'
# "gelu" to Gelu and "gelu_new"/"gelu_fast"/"gelu_pytorch_tanh" to FastGelu alike): exact erf GELU, and the tanh
# approximation. With the up projection's bias: BiasGelu adds it first; FastGelu takes it as its second input.
_GELU_OPS = {"gelu": ("Gelu", "BiasGelu"), "gelu_tanh": ("FastGelu", "FastGelu")}  # act -> (no bias, with bias)
_IR = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16,
       torch.int64: ir.DataType.INT64}


def check_fusable(cfg: ModelConfig) -> None:
    """One-line ValueError naming what the fused attention cannot do; the caller falls back to the plain graph."""
    why = None
    if cfg.position_encoding != "rope":
        why = f"{cfg.position_encoding} position encoding (GroupQueryAttention adds no per-head ALiBi bias)"
    elif cfg.is_moe:
        why = f"mixture of experts ({cfg.num_experts} experts)"
    elif not cfg.gated_mlp and cfg.hidden_act not in _GELU_OPS:
        why = f"an ungated {cfg.hidden_act} MLP (the fused graph's ungated MLP is GPT-NeoX's and Falcon's GELU)"
    elif cfg.head_dim % GQA_HEAD_DIM_MULTIPLE:
        why = f"head_dim {cfg.head_dim} (GroupQueryAttention needs a multiple of {GQA_HEAD_DIM_MULTIPLE})"
    elif cfg.num_attention_heads % cfg.num_key_value_heads:
        why = f"{cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} KV heads (not a multiple)"
    if why:
        raise ValueError(f"{cfg.name}: the fused graph does not support {why}; export the plain graph instead")


# --- A small graph builder: nodes named by module path, outputs by node ---------------------------------------

class _Graph:
    """Collects nodes and initializers; node `/model/layers.0/self_attn/qkv_proj/MatMul` outputs `.../output_0`."""

    def __init__(self, dtype: torch.dtype, as_stored: bool = False):
        self.dtype = dtype
        self.as_stored = as_stored  # MatMul weights [out, in] behind a Transpose (build_graph)
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []
        self.recipes: dict[str, Callable[[], torch.Tensor]] = {}  # initializer name -> its weight, made when written
        self._names: set[str] = set()

    def weight(self, name: str, tensor: torch.Tensor) -> ir.Value:
        """An initializer holding `tensor` (no copy; written when the model is saved)."""
        tensor = tensor.detach().contiguous()
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(_IR[tensor.dtype]),
                         const_value=TorchTensor(tensor, name=name))
        self.initializers.append(value)
        return value

    def lazy(self, name: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor | Rows]) -> ir.Value:
        """An initializer of `shape` in the graph's dtype whose data `make()` reads only when it is saved."""
        value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(_IR[self.dtype]))
        self.initializers.append(value)
        self.recipes[name] = make
        return value

    def const(self, name: str, data: Any, dtype: torch.dtype) -> ir.Value:
        return self.weight(name, torch.tensor(data, dtype=dtype))

    def op(self, path: str, op_type: str, inputs: list[ir.Value | None], attributes: dict | None = None, *,
           domain: str = "", outputs: int | list[str | None] = 1, name: str | None = None) -> Any:
        """Add one node; returns its output, or the list of them when outputs > 1 or is a list.

        outputs as a list: None names the output after the node (`.../output_i`), "" omits it, a string names it.
        """
        node_name = f"{path}/{name or op_type}"
        assert node_name not in self._names, f"two nodes named {node_name}"
        self._names.add(node_name)
        names = outputs if isinstance(outputs, list) else [None] * outputs
        values = [ir.Value(name=f"{node_name}/output_{i}" if n is None else n) for i, n in enumerate(names)]
        node = ir.Node(domain, op_type, inputs, ir.convenience.convert_attributes(attributes or {}),
                       outputs=values, name=node_name)
        self.nodes.append(node)
        return values[0] if len(values) == 1 and not isinstance(outputs, list) else values


def _input(name: str, dtype: ir.DataType, shape: list[int | str]) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))


# --- The graph ------------------------------------------------------------------------------------------------

Read = Callable[[list[str]], dict[str, torch.Tensor]]  # HF names -> tensors (any float dtype; cast when written)


def build_graph(cfg: ModelConfig, read: Read, dtype: torch.dtype, rope_op: str,
                static_kv: int | None, opset: int = DEFAULT_OPSET,
                rows: Callable[[str, int, int], torch.Tensor] | None = None, as_stored: bool = False,
                ) -> tuple[ir.Model, dict[str, Callable[[], Any]]]:
    """The fused decoder, and for each weight initializer the recipe that reads and packs it.

    No weight is read here: `read` is called by a recipe when `onnx_save` writes that initializer, so an
    export holds one packed matrix at a time (the plain export's streaming, for the fused graph too).
    rows(name, a, b): rows a..b of a 2-D weight; given, the embedding is written a slab of rows at a time.
    as_stored: each MatMul's weight [out, in] as the checkpoint holds it, behind a Transpose (onnxruntime folds it),
    written as rows, never a transposed copy: the int4 quantizer's source graph, which reads W's rows.
    """
    g = _Graph(dtype, as_stored)
    shapes = {spec.name: spec.shape for spec in weight_specs(cfg)}

    def stored(name: str) -> ir.Value:
        """A checkpoint tensor as it is (the embedding), in row slabs when the source can hand them out."""
        if rows is not None and len(shapes[name]) == 2:
            shape = shapes[name]
            return g.lazy(name, shape, lambda: Rows((shape[0], shape[1]), lambda a, b: rows(name, a, b)))
        return g.lazy(name, shapes[name], lambda: read([name])[name])
    t = _IR[dtype]
    n_layers, kv_heads, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    slots = static_kv if static_kv is not None else "past_sequence_length"
    present_slots = static_kv if static_kv is not None else "total_sequence_length"
    in_names, out_names = io_names(n_layers)
    input_ids = _input("input_ids", ir.DataType.INT64, ["batch", "sequence_length"])
    mask = _input("attention_mask", ir.DataType.INT64, ["batch", "total_sequence_length"])
    position_ids = _input("position_ids", ir.DataType.INT64, ["batch", "sequence_length"])
    pasts = [_input(n, t, ["batch", kv_heads, slots, hd]) for n in in_names[3:]]

    # --- What every layer's attention shares: GQA's lengths and the padding bias (see the module docstring) ---
    #
    #   attention_mask [b, t] ──Shape──► [b, t] ──Gather 1──► t ──Cast int32──► total_sequence_length []
    #                                           └─Gather 0──► b
    #   t - 1 ──Cast int32──Expand [b]──► seqlens_k [b]      (every row: keys end at the last slot)
    #   attention_mask ──Cast bool──Where(0, min)──Unsqueeze [1, 2]──► [b, 1, 1, t]
    #                  ──Expand [b, 1, s, t]──► attention_bias  (one row per query, as GQA wants)
    p = "/model/attn_mask"
    i64 = torch.int64
    mask_shape = g.op(p, "Shape", [mask], name="Shape_mask")
    batch = g.op(p, "Gather", [mask_shape, g.const(f"{p}/zero", 0, i64)], {"axis": 0}, name="Gather_batch")
    total = g.op(p, "Gather", [mask_shape, g.const(f"{p}/one", 1, i64)], {"axis": 0}, name="Gather_total")
    total_i32 = g.op(p, "Cast", [total], {"to": ir.DataType.INT32}, name="Cast_total")  # total_sequence_length
    last = g.op(p, "Sub", [total, g.const(f"{p}/one_", 1, i64)], name="Sub_last")  # t - 1
    last_i32 = g.op(p, "Cast", [last], {"to": ir.DataType.INT32}, name="Cast_last")
    batch_1d = g.op(p, "Unsqueeze", [batch, g.const(f"{p}/axis0", [0], i64)], name="Unsqueeze_batch")  # [1]
    seqlens_k = g.op(p, "Expand", [last_i32, batch_1d], name="Expand_seqlens_k")  # [b] int32, all t - 1
    keep = g.op(p, "Cast", [mask], {"to": ir.DataType.BOOL}, name="Cast_keep")
    bias_2d = g.op(p, "Where", [keep, g.const(f"{p}/zero_bias", 0.0, dtype),
                                g.const(f"{p}/min_bias", torch.finfo(dtype).min, dtype)])  # [b, t]
    bias_4d = g.op(p, "Unsqueeze", [bias_2d, g.const(f"{p}/axes12", [1, 2], i64)])  # [b, t] -> [b, 1, 1, t]
    ids_shape = g.op(p, "Shape", [input_ids], name="Shape_ids")  # [b, s]
    seq = g.op(p, "Slice", [ids_shape, g.const(f"{p}/from1", [1], i64), g.const(f"{p}/to2", [2], i64)])  # [s]
    total_1d = g.op(p, "Unsqueeze", [total, g.const(f"{p}/axis0_", [0], i64)], name="Unsqueeze_total")  # [t]
    bias_shape = g.op(p, "Concat", [batch_1d, g.const(f"{p}/heads1", [1], i64), seq, total_1d], {"axis": 0})
    attention_bias = g.op(p, "Expand", [bias_4d, bias_shape], name="Expand_bias")  # [b, 1, s, t]
    # What rotates q and k: GQA's slot positions with its rotary, else the caller's position_ids (our RoPE node's)
    rotary_positions = _slot_positions(g, p, mask, total, ids_shape) if rope_op == rope_ops.IN_ATTENTION.name \
        else position_ids

    # RoPE tables: fp32 for our op (it rotates in fp32), the activations' type for ORT's; Gemma 3's sliding
    # layers have their own pair.
    table_dtype = torch.float32 if rope_ops.get_rope_op(rope_op).fp32_tables else dtype
    tables = [g.weight(name, t.to(table_dtype)) for name, t in zip(TABLE_NAMES, rope_tables_of(cfg))]
    if per_pass(cfg):  # dynamic, longrope: (cos, sin) computed from each pass's length (rope_tables.py)
        computed = rope_tables.pass_tables(cfg, position_ids, mask, _IR[table_dtype])
        g.nodes += computed.nodes
        g.initializers += computed.initializers
        g.initializers = [v for v in g.initializers if v not in tables[:2]]
        tables[:2] = [computed.cos, computed.sin]

    # --- Embedding, then the layers ----------------------------------------------------------------------------
    embed = stored("model.embed_tokens.weight")  # [n1, n2]
    z = g.op("/model/embed_tokens", "Gather", [embed, input_ids])  # Z^0: [b, s, n2]
    scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else cfg.embedding_multiplier  # Gemma's, Granite's
    if scale != 1.0:  # in the activations' dtype (Gemma: as HF rounds it)
        z = g.op("/model/embed_tokens", "Mul", [z, g.const("/model/embed_tokens/scale", scale, dtype)],
                 name="Mul_scale")
    if cfg.post_norms:  # OLMo 2: attention reads the residual stream itself
        zbar = z
    else:
        zbar = _norm(g, cfg, read, shapes, "/model/layers.0/input_layernorm", z, "model.layers.0.input_layernorm.weight")
    presents = []
    for j in range(n_layers):
        cos_cache, sin_cache = layer_tables(tables, cfg.slides(j))
        zbar, z, present = _layer(g, cfg, read, shapes, j, zbar, z, rotary_positions, cos_cache, sin_cache, rope_op,
                                  pasts[2 * j], pasts[2 * j + 1], seqlens_k, total_i32, attention_bias, out_names)
        presents += present

    # --- lm_head: H = Zbar W^T, W stored [n2, n1] for MatMul (rows L2-normalized first for norm_head) -----------
    if cfg.tie_word_embeddings and not cfg.norm_head:  # one matrix stored once: the Gather's, transposed here
        w_t = g.op("/lm_head", "Transpose", [embed], {"perm": [1, 0]})  # [n1, n2] -> [n2, n1]
    elif g.as_stored and not cfg.norm_head:  # [n1, n2] as the checkpoint holds it, in slabs of rows
        w_t = g.op("/lm_head", "Transpose", [stored("lm_head.weight")], {"perm": [1, 0]})
    else:
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"

        def finish(w: torch.Tensor) -> torch.Tensor:
            return F.normalize(w.float(), dim=-1) if cfg.norm_head else w  # row-wise: a slab of rows alike

        def lm_head() -> Any:
            if rows is not None:  # W^T written from W's row slabs: neither held whole
                return Rows((cfg.hidden_size, cfg.vocab_size), lambda a, b: finish(rows(head, a, b)), transposed=True)
            return finish(read([head])[head]).T  # [n1, n2] -> [n2, n1], a view: written in slabs
        w_t = g.lazy("lm_head.MatMul.weight", (cfg.hidden_size, cfg.vocab_size), lm_head)
    # H = Zbar W^T ──Div logits_scaling (Granite)──Div cap──Tanh──Mul cap (Gemma 2)──► logits
    cap = cfg.final_logit_softcap
    steps = ["scale"] * (cfg.logits_scaling != 1.0) + ["cap"] * (cap is not None)
    h = g.op("/lm_head", "MatMul", [zbar, w_t], outputs=[None if steps else "logits"])[0]
    if "scale" in steps:
        h = g.op("/lm_head", "Div", [h, g.const("/lm_head/logits_scaling", cfg.logits_scaling, dtype)],
                 outputs=[None if cap is not None else "logits"], name="Div_scaling")[0]
    if cap is not None:  # Gemma 2: H -> cap tanh(H / cap)
        c = g.const("/lm_head/softcap/cap", cap, dtype)
        h = g.op("/lm_head", "Mul", [g.op("/lm_head", "Tanh", [g.op("/lm_head", "Div", [h, c])]), c],
                 outputs=["logits"])[0]
    logits = h

    logits.type, logits.shape = ir.TensorType(t), ir.Shape(["batch", "sequence_length", cfg.vocab_size])
    for v in presents:
        v.type, v.shape = ir.TensorType(t), ir.Shape(["batch", kv_heads, present_slots, hd])
    graph = ir.Graph([input_ids, mask, position_ids, *pasts], [logits, *presents], nodes=g.nodes,
                     initializers=g.initializers, name=f"{cfg.name} (fused)",
                     opset_imports={"": opset, MS_DOMAIN: 1})
    model = ir.Model(graph, ir_version=10, producer_name="llama-tools")
    if rope_op == rope_ops.OURS.name:  # our op's body rides along, so stock onnxruntime runs it on any provider
        function = ir.serde.deserialize_function(rope_ops.rope_function(opset))
        model.functions[function.identifier()] = function
        model.opset_imports[rope_ops.DOMAIN] = rope_ops.VERSION
    return model, g.recipes


def _gain(g: _Graph, cfg: ModelConfig, read: Read, shapes: dict[str, tuple[int, ...]], name: str) -> ir.Value:
    """A norm's gain as onnxruntime's norms multiply by it: γ, or Gemma's (1 + γ) folded in (as the builder does)."""
    if not cfg.norm_plus_one:
        return g.lazy(name, shapes[name], lambda: read([name])[name])
    return g.lazy(name + "_plus_one", shapes[name], lambda: 1.0 + read([name])[name].float())


def _beta(g: _Graph, read: Read, shapes: dict[str, tuple[int, ...]], name: str) -> ir.Value:
    """A LayerNorm's β as stored."""
    return g.lazy(name, shapes[name], lambda: read([name])[name])


def _norm(g: _Graph, cfg: ModelConfig, read: Read, shapes: dict[str, tuple[int, ...]], path: str, x: ir.Value,
          name: str) -> ir.Value:
    """The family's norm over n2 of x, γ named `name`: RMSNorm as SimplifiedLayerNormalization, LayerNorm (γ, β) as
    LayerNormalization (opset 17); both in fp32 inside (stash_type 1), as the models compute them."""
    attrs = {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1}
    if cfg.norm_kind == "layer":
        beta = name.removesuffix(".weight") + ".bias"
        return g.op(path, "LayerNormalization", [x, _gain(g, cfg, read, shapes, name), _beta(g, read, shapes, beta)],
                    attrs)
    return g.op(path, "SimplifiedLayerNormalization", [x, _gain(g, cfg, read, shapes, name)], attrs)


def _skip_norm(g: _Graph, cfg: ModelConfig, read: Read, shapes: dict[str, tuple[int, ...]], path: str, x: ir.Value,
               skip: ir.Value, name: str) -> tuple[ir.Value, ir.Value]:
    """(norm(x + skip), x + skip) in one node: onnxruntime's SkipSimplifiedLayerNormalization, or SkipLayerNormalization
    with the LayerNorm's β."""
    inputs = [x, skip, _gain(g, cfg, read, shapes, name)]
    op = "SkipSimplifiedLayerNormalization"
    if cfg.norm_kind == "layer":
        inputs.append(_beta(g, read, shapes, name.removesuffix(".weight") + ".bias"))
        op = "SkipLayerNormalization"
    normed, _, _, total = g.op(path, op, inputs, {"epsilon": float(cfg.rms_norm_eps)}, domain=MS_DOMAIN,
                               outputs=[None, "", "", None])  # (normalized, -, -, the sum x + skip)
    return normed, total


def _slot_positions(g: Any, p: str, mask: Any, total: Any, ids_shape: Any) -> Any:
    """GQA's rotary positions [b, s] for the new tokens: a real token's slot when the padding is all in front (its
    leading zeros plus its position), its position after a gap (onnxruntime-genai right-pads a batch's prompt and
    appends each new token after the padding), a padding slot its own index.

        attention_mask [b, t] ──Cast int32──ArgMax(1)──► lead [b, 1]   (leading zeros)
                              ──CumSum(1)──Slice last s──► c [b, s] ──► lead + c - 1 ──┐
                              ──Slice last s──Cast bool──────────────────── Where ─────┴─► [b, s]
        Range(t - s, t) [s] (the slots) ─────────────────────────────────────┘ (padding)
    """
    i64 = torch.int64
    s = g.op(p, "Gather", [ids_shape, g.const(f"{p}/one_s", 1, i64)], {"axis": 0}, name="Gather_seq")  # s
    first = g.op(p, "Sub", [total, s], name="Sub_first")  # t - s: the first new slot
    minus_s = g.op(p, "Unsqueeze", [g.op(p, "Neg", [s], name="Neg_seq"), g.const(f"{p}/axis0_s", [0], i64)],
                   name="Unsqueeze_neg_seq")  # [-s]
    end, axis1 = g.const(f"{p}/end", [2**62], i64), g.const(f"{p}/axis1", [1], i64)
    lead = g.op(p, "ArgMax", [g.op(p, "Cast", [mask], {"to": ir.DataType.INT32}, name="Cast_mask_i32")],
                {"axis": 1, "keepdims": 1}, name="ArgMax_lead")  # [b, 1]: an all-zero row gives 0
    counted = g.op(p, "CumSum", [mask, g.const(f"{p}/axis1_", 1, i64)], name="CumSum_mask")  # [b, t]
    counted = g.op(p, "Slice", [counted, minus_s, end, axis1], name="Slice_counted")  # [b, s]
    real = g.op(p, "Add", [lead, g.op(p, "Sub", [counted, g.const(f"{p}/one_p", 1, i64)], name="Sub_position")],
                name="Add_lead")  # [b, s]
    keep = g.op(p, "Cast", [g.op(p, "Slice", [mask, minus_s, end, axis1], name="Slice_mask")],
                {"to": ir.DataType.BOOL}, name="Cast_new_keep")  # [b, s]
    slots = g.op(p, "Range", [first, total, g.const(f"{p}/step", 1, i64)], name="Range_slots")  # [s]
    return g.op(p, "Where", [keep, real, slots], name="Where_positions")  # [b, s]


def _layer(g: _Graph, cfg: ModelConfig, read: Read, shapes: dict[str, tuple[int, ...]], j: int, zbar: ir.Value, z: ir.Value,
           position_ids: ir.Value, cos_cache: ir.Value, sin_cache: ir.Value, rope_op: str, past_k: ir.Value,
           past_v: ir.Value, seqlens_k: ir.Value, total: ir.Value, attention_bias: ir.Value,
           out_names: list[str]) -> tuple[ir.Value, ir.Value, list[ir.Value]]:
    """Decoder j: (Zbar^j, Z^j) -> (Zbar^{j+1}, Z^{j+1}), the next norm fused with the residual add.

    zbar [b, s, n2] ──MatMul W_qkv [n2, q + 2 kv] (+ bias)──► qkv [b, s, q + 2 kv]
    attention: qkv as it is (GQA rotates q and k: do_rotary, cos_cache, sin_cache)
    ours:    qkv ──RotaryEmbedding (num_heads q + 2 kv heads, rotary_heads q + kv)──► q, k rotated, v as it was
    contrib: qkv ──Split──► q, k, v;  q, k ──RotaryEmbedding (num_heads)──► rotated, still 3-D
    (packed qkv, or q, k, v; past K/V, seqlens_k, total, attention_bias) ──GroupQueryAttention──► u [b, s, q], K/V
    u ──MatMul W_o──► r ──SkipSimplifiedLayerNormalization(skip z)──► ybar, y = z + r
    ybar ──MatMul W_gate_up [n2, 2 n7] (+ bias)──Split──► gate, up
    gate ──Sigmoid──Mul gate──► silu ──Mul up──MatMul W_down (+ bias)──► d
    d ──SkipSimplifiedLayerNormalization(skip y; next input_layernorm or the final norm)──► zbar', z' = y + d

    GPT-NeoX and Falcon (LayerNorm γ, β; an ungated GELU MLP with biases), parallel_residual:
    zbar ──(attention as above, qkv and o biases)──► r
    z ──LayerNormalization(post_attention_layernorm γ, β)──► ybar   (Falcon-7B's one norm: ybar = zbar)
    z, r ──Add──► y = z + r
    ybar ──MatMul W_up──BiasGelu(b_up) (Gelu without a bias; FastGelu for tanh GELU)──MatMul W_down (+ b_down)──► d
    d ──SkipLayerNormalization(skip y; next input_layernorm's or the final γ, β)──► zbar', z' = z + r + d
    sequential: r ──SkipLayerNormalization(skip z; post_attention_layernorm)──► ybar, y = z + r, then the same MLP.
    """
    pre = f"model.layers.{j}"
    path = f"/model/layers.{j}"
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    i64 = torch.int64

    def stacked(names: list[str]) -> torch.Tensor:
        """The rows of `names` stacked, read when written: [sum of out, ...]."""
        parts = read(names)
        return torch.cat([parts.pop(n) for n in names], dim=0) if len(names) > 1 else parts[names[0]]

    def linear(module: str, names: list[str], bias: bool) -> tuple[ir.Value, ir.Value | None]:
        """One MatMul weight [in, out] from HF's [out, in] rows of `names` stacked (as_stored: their [out, in]
        through a Transpose); their biases likewise."""
        ws = [f"{pre}.{module}.{n}.weight" for n in names]
        out = sum(shapes[w][0] for w in ws)
        packed = "_".join(names) if len(names) > 1 else names[0]
        name = f"{pre}.{module}.{packed}.MatMul.weight"
        if g.as_stored:  # [out, in], rows straight from the checkpoint's
            weight = g.op(f"{path}/{module}/{packed}", "Transpose",
                          [g.lazy(name, (out, shapes[ws[0]][1]), lambda: stacked(ws))], {"perm": [1, 0]})
        else:
            weight = g.lazy(name, (shapes[ws[0]][1], out), lambda: stacked(ws).T)  # [in, out], a view: in slabs
        b = None
        if bias:
            bs = [f"{pre}.{module}.{n}.bias" for n in names]
            b = g.lazy(f"{pre}.{module}.{packed}.Add.bias", (out,), lambda: stacked(bs))
        return weight, b

    def matmul(sub: str, x: ir.Value, weight: ir.Value, bias: ir.Value | None) -> ir.Value:
        y = g.op(f"{path}/{sub}", "MatMul", [x, weight])
        return g.op(f"{path}/{sub}", "Add", [y, bias]) if bias is not None else y

    # --- Attention ---
    attn = f"{path}/self_attn"
    w, b = linear("self_attn", ["q_proj", "k_proj", "v_proj"], cfg.qkv_bias)
    qkv = matmul("self_attn/qkv_proj", zbar, w, b)  # [b, s, q + 2 kv]
    interleaved = int(cfg.rope_layout == INTERLEAVED)
    rotates = cfg.rotates(j)  # SmolLM3: some layers attend without RoPE (no node, GQA's do_rotary 0)
    in_attention = rotates and rope_op == rope_ops.IN_ATTENTION.name
    # Partial rotary: our node is told the head's width (the tables are rotary_dim / 2 wide); onnxruntime's ops
    # take rotary_embedding_dim, GQA's own rotary the tables' width.
    partial = {rope_ops.ATTR_HEAD_DIM: cfg.head_dim} if cfg.partial_rotary else {}
    if cfg.qk_norm:
        # Qwen3, Gemma 3: q and k apart, each head normalized over its n6 before RoPE, then rotated as 3-D heads.
        split = g.const(f"{attn}/qkv_split", [cfg.q_size, cfg.kv_size, cfg.kv_size], i64)
        q, k, v = g.op(attn, "Split", [qkv, split], {"axis": -1}, outputs=3)  # [b, s, q], [b, s, kv], [b, s, kv]
        qkv_in = []
        for which, x, heads in (("q", q, nq), ("k", k, nkv)):
            norm = f"{pre}.self_attn.{which}_norm.weight"
            npath = f"{attn}/{which}_norm"
            if cfg.qk_norm_whole:  # OLMo 2: over the whole projection [b, s, h d]
                x = g.op(npath, "SimplifiedLayerNormalization", [x, _gain(g, cfg, read, shapes, norm)],
                         {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1})
            else:
                heads_shape = g.const(f"{npath}/heads_shape", [0, 0, heads, cfg.head_dim], i64)
                flat_shape = g.const(f"{npath}/flat_shape", [0, 0, heads * cfg.head_dim], i64)
                xh = g.op(npath, "Reshape", [x, heads_shape], name="Reshape_heads")  # [b, s, h d] -> [b, s, h, d]
                xn = g.op(npath, "SimplifiedLayerNormalization", [xh, _gain(g, cfg, read, shapes, norm)],
                          {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1})
                x = g.op(npath, "Reshape", [xn, flat_shape], name="Reshape_flat")  # [b, s, h, d] -> [b, s, h d]
            if in_attention or not rotates:  # GQA rotates it, or nothing does
                qkv_in.append(x)
            elif rope_op == rope_ops.OURS.name:
                attrs = {rope_ops.ATTR_INTERLEAVED: interleaved, "num_heads": heads, **partial}
                qkv_in.append(g.op(attn, rope_ops.OP_TYPE, [x, position_ids, cos_cache, sin_cache], attrs,
                                   domain=rope_ops.DOMAIN, name=f"rope_{which}"))
            else:
                qkv_in.append(g.op(attn, rope_ops.OP_TYPE, [x, position_ids, cos_cache, sin_cache],
                                   {rope_ops.ATTR_INTERLEAVED: interleaved, "num_heads": heads,
                                    "rotary_embedding_dim": cfg.rotary_dim}, domain=MS_DOMAIN, name=f"rope_{which}"))
        qkv_in.append(v)
    elif in_attention or not rotates:  # GQA rotates the q and k heads of the packed QKV itself, or nothing does
        qkv_in = [qkv, None, None]
    elif rope_op == rope_ops.OURS.name:
        # One node rotates the q and k heads of the packed projection and passes v through; GQA takes it packed.
        attrs = {rope_ops.ATTR_INTERLEAVED: interleaved, "num_heads": nq + 2 * nkv, rope_ops.ATTR_ROTARY_HEADS: nq + nkv,
                 **partial}
        packed = g.op(attn, rope_ops.OP_TYPE, [qkv, position_ids, cos_cache, sin_cache], attrs, domain=rope_ops.DOMAIN,
                      name="rope_qk")  # [b, s, q + 2 kv]
        qkv_in = [packed, None, None]
    else:  # ORT's op has no pass-through heads: q and k apart, 3-D [b, s, heads * head_dim] with num_heads
        split = g.const(f"{attn}/qkv_split", [cfg.q_size, cfg.kv_size, cfg.kv_size], i64)
        q, k, v = g.op(attn, "Split", [qkv, split], {"axis": -1}, outputs=3)  # [b, s, q], [b, s, kv], [b, s, kv]
        qkv_in = [g.op(attn, rope_ops.OP_TYPE, [x, position_ids, cos_cache, sin_cache],
                       {rope_ops.ATTR_INTERLEAVED: interleaved, "num_heads": heads, "rotary_embedding_dim": cfg.rotary_dim},
                       domain=MS_DOMAIN, name=f"rope_{which}") for which, x, heads in (("q", q, nq), ("k", k, nkv))]
        qkv_in.append(v)
    gqa = {"num_heads": nq, "kv_num_heads": nkv, "do_rotary": int(in_attention)}
    if in_attention:
        gqa["rotary_interleaved"] = interleaved
    if cfg.query_pre_attn_scalar is not None or cfg.attention_multiplier is not None:
        gqa["scale"] = cfg.score_scale  # Gemma 2/3: 1 / sqrt(query_pre_attn_scalar); Granite: its multiplier
    if cfg.attn_logit_softcap is not None:  # Gemma 2: cap tanh(scores / cap), before the mask, as the model does
        gqa["softcap"] = float(cfg.attn_logit_softcap)
    if cfg.slides(j):  # GQA's window counts the query's own slot: local_window_size = W keys, as the mask's
        gqa["local_window_size"] = cfg.sliding_window
    u, present_k, present_v = g.op(
        attn, GQA,
        [*qkv_in, past_k, past_v, seqlens_k, total, *((cos_cache, sin_cache, position_ids) if in_attention
                                                       else (None, None, None)), attention_bias],
        gqa, domain=MS_DOMAIN,
        outputs=[None, out_names[1 + 2 * j], out_names[2 + 2 * j]])
    w, b = linear("self_attn", ["o_proj"], cfg.o_bias)
    r = matmul("self_attn/o_proj", u, w, b)  # [b, s, n2]
    residual = g.const(f"{path}/residual_multiplier", cfg.residual_multiplier, g.dtype) \
        if cfg.residual_multiplier != 1.0 else None  # Granite: R and the FFN's output scaled before each residual
    norm = f"{pre}.post_attention_layernorm.weight"
    if cfg.sandwich_norms:  # Gemma 2/3: R normalized before the residual; 6.3's norm is pre_feedforward_layernorm
        r = g.op(f"{path}/post_attention_layernorm", "SimplifiedLayerNormalization", [r, _gain(g, cfg, read, shapes, norm)],
                 {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1})
        norm = f"{pre}.pre_feedforward_layernorm.weight"
    if residual is not None:
        r = g.op(f"{path}/residual_mul", "Mul", [r, residual], name="Mul_1")
    if cfg.parallel_residual:  # GPT-NeoX, Falcon: the FFN reads the layer's input Z^j, normed, not Z^j + R^j
        ybar = zbar if cfg.shared_norm else _norm(g, cfg, read, shapes, f"{path}/post_attention_layernorm", z,
                                                  f"{pre}.post_attention_layernorm.weight")
        # Z^{j+1} = (Z^j + R^j) + Yhat^j: the residual add in this layer, as the sequential block's, so what crosses
        # into the next layer is two addends this layer made (layer 0's Z^0 is the embedding's: --by-layer's cut)
        y = g.op(f"{path}/residual_add", "Add", [z, r])  # [b, s, n2]
    elif cfg.post_norms:  # OLMo 2: R normalized, added; the FFN reads the sum itself
        r = g.op(f"{path}/post_attention_layernorm", "SimplifiedLayerNormalization",
                 [r, _gain(g, cfg, read, shapes, norm)], {"axis": -1, "epsilon": float(cfg.rms_norm_eps),
                                                          "stash_type": 1})
        ybar = y = g.op(f"{path}/residual_add", "Add", [z, r], name="Add_1")  # Y^j = Z^j + rnorm(R^j)
    else:
        ybar, y = _skip_norm(g, cfg, read, shapes, f"{path}/{norm.split('.')[-2]}", r, z, norm)  # Y^j = Z^j + R^j

    mlp = f"{path}/mlp"
    if not cfg.gated_mlp:  # --- GPT-NeoX's and Falcon's MLP: up (+ bias) ──GELU──► down (+ bias) ---
        w, b = linear("mlp", ["up_proj"], cfg.mlp_bias)
        up = g.op(f"{path}/mlp/up_proj", "MatMul", [ybar, w])  # [b, s, n7]; the bias goes into the GELU node
        plain_op, bias_op = _GELU_OPS[cfg.hidden_act]
        act = g.op(f"{mlp}/act_fn", bias_op if b is not None else plain_op, [up, *([b] if b is not None else [])],
                   domain=MS_DOMAIN)  # [b, s, n7]
        w, b = linear("mlp", ["down_proj"], cfg.mlp_bias)
        d = matmul("mlp/down_proj", act, w, b)  # [b, s, n2]
        return _residual_and_next_norm(g, cfg, read, shapes, j, d, y, [present_k, present_v])

    # --- SwiGLU ---
    w, b = linear("mlp", ["gate_proj", "up_proj"], cfg.mlp_bias)
    gate_up = matmul("mlp/gate_up_proj", ybar, w, b)  # [b, s, 2 n7]
    split = g.const(f"{mlp}/gate_up_split", [cfg.intermediate_size, cfg.intermediate_size], i64)
    gate, up = g.op(mlp, "Split", [gate_up, split], {"axis": -1}, outputs=2)  # [b, s, n7] each
    if cfg.hidden_act == "gelu_tanh":  # Gemma's GeGLU: ONNX's Gelu, tanh approximation (opset 20)
        act = g.op(f"{mlp}/act_fn", "Gelu", [gate], {"approximate": "tanh"})
    else:
        act = g.op(f"{mlp}/act_fn", "Mul", [gate, g.op(f"{mlp}/act_fn", "Sigmoid", [gate])])  # ORT fuses: QuickGelu
    hidden = g.op(mlp, "Mul", [act, up])
    w, b = linear("mlp", ["down_proj"], cfg.mlp_bias)
    d = matmul("mlp/down_proj", hidden, w, b)  # [b, s, n2]
    if cfg.sandwich_norms or cfg.post_norms:  # Gemma 2/3, OLMo 2: the FFN's output normalized before the residual
        norm = f"{pre}.post_feedforward_layernorm.weight"
        d = g.op(f"{path}/post_feedforward_layernorm", "SimplifiedLayerNormalization",
                 [d, _gain(g, cfg, read, shapes, norm)], {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1})

    if residual is not None:
        d = g.op(f"{path}/residual_mul", "Mul", [d, residual], name="Mul_2")

    # --- The residual add, fused with the next norm (OLMo 2: a plain add; the final norm after the last) ---
    last = j == cfg.num_hidden_layers - 1
    if cfg.post_norms:
        z_next = g.op(f"{path}/residual_add", "Add", [y, d], name="Add_2")  # Z^{j+1} = Y^j + rnorm(Yhat^j)
        zbar_next = g.op("/model/norm", "SimplifiedLayerNormalization", [z_next, _gain(g, cfg, read, shapes,
                                                                                       "model.norm.weight")],
                         {"axis": -1, "epsilon": float(cfg.rms_norm_eps), "stash_type": 1}) if last else z_next
        return zbar_next, z_next, [present_k, present_v]
    return _residual_and_next_norm(g, cfg, read, shapes, j, d, y, [present_k, present_v])


def _residual_and_next_norm(g: _Graph, cfg: ModelConfig, read: Read, shapes: dict[str, tuple[int, ...]], j: int,
                            d: ir.Value, y: ir.Value, presents: list[ir.Value]) -> tuple[ir.Value, ir.Value, list[ir.Value]]:
    """Decoder j's last residual add Z^{j+1} = Y^j + d fused with the norm after it (the next input_layernorm, or
    the final norm), named by that norm's module so --by-layer sees two addends cross into the next block."""
    last = j == cfg.num_hidden_layers - 1
    norm_path, norm_name = (("/model/norm", "model.norm.weight") if last else
                            (f"/model/layers.{j + 1}/input_layernorm", f"model.layers.{j + 1}.input_layernorm.weight"))
    zbar_next, z_next = _skip_norm(g, cfg, read, shapes, norm_path, d, y, norm_name)
    return zbar_next, z_next, presents


# --- The entry point -------------------------------------------------------------------------------------------

def default_rope_op(cfg: ModelConfig) -> str:
    """The fused graph's RoPE: GQA's own rotary where its head size allows (no node of ours: SmolLM2-135M's int4
    decoded at 11.6 ms a token against 14.5 with our node, onnxruntime-genai, one thread), else our node.

    dynamic and longrope (tables computed per pass): our node. GQA's rotary turns a key by its cache slot, so a
    left-padded row's keys carry its padding's turn at the tables of the pass that stored them; once the tables
    change between passes the padding no longer cancels (exact only on rows without left padding)."""
    if per_pass(cfg):
        return rope_ops.OURS.name
    return rope_ops.IN_ATTENTION.name if rope_ops.in_attention_refusal(cfg.head_dim, cfg.rotary_dim) is None \
        else rope_ops.OURS.name


def check_rope_op(cfg: ModelConfig | None, rope_op: str) -> None:
    """One-line ValueError when the fused graph cannot hold `rope_op` (for this model, when cfg is given)."""
    if rope_op not in FUSED_ROPE_OPS:
        raise ValueError(f"rope_op {rope_op!r} is not available in the fused graph; choose one of "
                         f"{', '.join(FUSED_ROPE_OPS)}")
    why = None if cfg is None or rope_op != rope_ops.IN_ATTENTION.name else \
        rope_ops.in_attention_refusal(cfg.head_dim, cfg.rotary_dim)
    if why:
        raise ValueError(f"{cfg.name}: {why}; use --rope-op {rope_ops.OURS.name}")  # type: ignore[union-attr]


def export_fused(source: Any, output: str | Path, *, dtype: Any = "float32", rope_op: str | None = None,
                 static_kv: bool | int = False, seed: int = 0, progress: Progress = silent,
                 external_data_threshold_bytes: int = EXTERNAL_DATA_THRESHOLD_BYTES,
                 as_stored: bool = False) -> ExportResult:
    """Write the fused graph of a preset, config.json, checkpoint directory, ModelConfig or Llama (+ .data).

    rope_op: one of FUSED_ROPE_OPS, or None: default_rope_op(the model's config). as_stored: build_graph's."""
    t0 = time.perf_counter()
    output = Path(output)
    if rope_op is not None:
        check_rope_op(None, rope_op)  # by name, before any reading
    dt, opset = check_args(dtype, rope_op or rope_ops.OURS.name, None)
    paths.check_output_path(output)
    torch_dtype = dtypes.to_torch(dt.name)
    if isinstance(source, (str, Path)):
        source = resolve(source)
    if isinstance(source, ModelSource) and source.weights is not None:  # a checkpoint: read when written
        from llama_tools.inference.reference import open_reader

        assert source.path is not None, "a checkpoint source has a path"
        reader = open_reader(source.path)
        cfg, read = reader.cfg, reader.read
        rows = lambda name, a, b: reader.rows(name, [(a, b)])  # noqa: E731
        check_fusable(cfg)
        label, seed_used, params = source.label, None, sum(spec.numel for spec in weight_specs(cfg))
    else:  # a preset, config or module: its weights exist in memory once anyway
        weights = real_weights(source, torch_dtype, seed, progress)
        cfg, state = weights.cfg, weights.state
        check_fusable(cfg)
        read = lambda names: {n: state[n] for n in names}  # noqa: E731
        rows = lambda name, a, b: state[name][a:b]  # noqa: E731
        label, seed_used, params = weights.source, weights.seed, weights.params
    rope_op = rope_op or default_rope_op(cfg)
    check_rope_op(cfg, rope_op)
    max_length = _static_length(static_kv, cfg)
    model, recipes = build_graph(cfg, read, torch_dtype, rope_op, max_length, opset, rows, as_stored)
    set_metadata(model, cfg, rope_op, dt.name, label, seed_used)
    model.metadata_props[META + "graph"] = GRAPH
    model.metadata_props[META + "static_kv"] = "" if max_length is None else str(max_length)
    # No onnx.checker: it knows no SimplifiedLayerNormalization (onnxruntime's, in the default domain, as
    # onnxruntime-genai's builder writes it); onnxruntime itself is the check (tests/test_fused.py).
    data = save_model(model, output, external_data_threshold_bytes, False, progress,
                      source=lambda name: recipes[name]() if name in recipes else None)
    size = output.stat().st_size + (data.stat().st_size if data else 0)
    counts: dict[str, int] = {}
    for node in model.graph:
        key = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return ExportResult(
        path=output, external_data=data, bytes=size, params=params, num_nodes=len(model.graph),
        rope_nodes=sum(n.op_type == rope_ops.OP_TYPE for n in model.graph), opset=opset,
        dtype=dt.name, rope_op=rope_op, seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(), graph=GRAPH, op_counts=counts,
        static_kv=max_length)


def _static_length(static_kv: bool | int, cfg: ModelConfig) -> int | None:
    """static_kv False -> None; True -> the model's context (rope.context_length); an int -> that many slots."""
    if static_kv is False or static_kv is None:
        return None
    context = context_length(cfg)  # max_position_embeddings (fixed RoPE tables end there), dynamic NTK's x factor
    if static_kv is True:
        return context
    if not isinstance(static_kv, int) or not 1 <= static_kv <= context:
        raise ValueError(f"static_kv (max_length) must be an int in 1..{context} "
                         f"(the model's context: fixed RoPE tables end there), got {static_kv!r}")
    return static_kv


# --- Driving a static_kv graph -----------------------------------------------------------------------------

class StaticKVSession:
    """One step of a static_kv graph with past and present bound to the same preallocated buffer per layer.

    Feed attention_mask [batch, filled + seq] and position_ids as for the plain graph; the cache is never
    passed around: after a step, slots [0, filled + seq) of `cache(i)` hold layer i's K/V.
    """

    def __init__(self, session: Any, cfg: ModelConfig, batch: int, max_length: int, dtype: Any = np.float32):
        import onnxruntime as ort

        self.sess, self.cfg, self.max_length = session, cfg, max_length
        shape = (batch, cfg.num_key_value_heads, max_length, cfg.head_dim)  # [batch, kv_heads, max_length, hd]
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype))
                        for _ in range(2 * cfg.num_hidden_layers)]
        self.binding = session.io_binding()
        self._names = io_names(cfg.num_hidden_layers)
        for buf, past in zip(self.buffers, self._names[0][3:]):
            self.binding.bind_ortvalue_input(past, buf)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """logits [batch, seq, vocab] for input_ids [batch, seq]; the cache advances in place."""
        if attention_mask.shape[1] > self.max_length:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions but the KV buffer "
                             f"holds {self.max_length}; export with a larger static_kv")
        for name, x in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            self.binding.bind_cpu_input(name, np.ascontiguousarray(x, dtype=np.int64))
        # Rebound every step: logits change shape (a bound output keeps its first shape); outputs come back in
        # binding order, logits first.
        self.binding.clear_binding_outputs()
        self.binding.bind_output("logits")
        for buf, present in zip(self.buffers, self._names[1][1:]):
            self.binding.bind_ortvalue_output(present, buf)  # the same memory as the past: GQA writes in place
        self.sess.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[0].numpy()

    def cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s K and V buffers: [batch, kv_heads, max_length, head_dim] (copies)."""
        return self.buffers[2 * layer].numpy(), self.buffers[2 * layer + 1].numpy()
