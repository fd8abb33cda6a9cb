"""`verify parity --by-layer`: the exported graph run one decoder layer at a time, each layer judged on its own.

The graph is cut into blocks by its nodes' module-path names (`/model/layers.3/...`, as torch.onnx, our fused
writer and onnxruntime-genai's builder name them):

    embedding:  input_ids ------------------------------> Z^0
    layer j:    Z^j (+ masks, positions, empty past) ---> Z^{j+1}, present.j.key, present.j.value
    head:       Z^n8 --final norm, lm_head------------> logits

A block's hidden-state input is whatever crosses into it from the block before: one value in the plain
graph, two addends (the MLP output and the residual) where a SkipSimplifiedLayerNormalization opens the
layer. Z is fed as the first addend and zeros as the rest, so the block sees exactly Z; its output is the
sum of what crosses into the next block. Every block is fed the float64 reference's own input to it (cast to
the graph's dtype), so a layer's error is its own, not the sum of those before it; PyTorch in the graph's
dtype is fed the same, for the noise (compare.py's budget, as the whole-graph check judges).

A block's sub-graph is serialized without weights: its initializers keep their external-data location and
offset, and onnxruntime reads them from the export's own .data file (the session option
`session.model_external_initializers_file_folder_path`): no copy of the weights, nothing written to disk.
Peak memory is one layer on each side (the graph's session; the reference's layer, whose float64 pass keeps
the matrices in fp32 and widens one at a time) or the embedding block, for a checkpoint source (a seeded source is
built whole in memory first). The head runs a slab of lm_head's vocabulary rows at a time on both sides, its
logits judged chunk by chunk (head_check): neither lm_head nor the logits are ever whole. Prefill only: the whole-graph check covers the decode steps.

(Over 500 lines on purpose: the cut into blocks and the feeding of each share one reading of the graph's
names and inputs; split, each half would lean on the other's private conventions.)
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llama_tools.modeling import dtypes
from llama_tools.outputs import files
from llama_tools.outputs.progress import Progress, bound_heap, release_freed_memory, silent

from .compare import DTYPE_LABEL, FP16_PER_FP32, Budget, BudgetCheck, JudgeSums, judge
from ..graph_io import INPUT_IDS, LOGITS, present_name
from ..onnx_export import export_onnx, read_metadata
from ..prompts import default_prompts, left_pad, positions
from ..emulation import emulate_bf16, is_bf16_graph
from ..runtime import (EMULATED_BF16, bf16_bits_to_float32, cuda_unusable, float32_to_bf16_bits, numpy_to_ortvalue,
                      onnxruntime, ortvalue_to_numpy, provider_list, run_bound, window_slots, windowed_pasts)

LAYER_NODE = re.compile(r"/model/layers\.(\d+)/")
EMBEDDING, HEAD = "embedding", "head"
LAYER_CHECKS = ("hidden", "key", "value")  # a layer block's checks, in this order
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
_SHAPE_OPS = ("Shape", "Size")  # their outputs describe a value, they do not carry it


# --- Cutting the graph -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One runnable piece of the graph: hidden-state values in (their sum is Z), values out, its nodes."""

    name: str  # "embedding", "layer 3", "head"
    layer: int | None
    inputs: tuple[str, ...]  # hidden-state addends fed: Z, then zeros
    outputs: tuple[str, ...]  # hidden-state addends out (summed), or ("logits",)
    presents: tuple[str, str] | None  # this layer's K and V outputs
    nodes: tuple[int, ...]  # indices into the graph's nodes, in graph order


class GraphBlocks:
    """An export's nodes grouped by decoder layer, cut into blocks; read without the weights."""

    def __init__(self, path: str | Path, num_layers: int, present: Callable[[int, str], str] = present_name):
        import onnx

        self.path = Path(path)
        self.model = onnx.load(str(path), load_external_data=False)
        g = self.model.graph
        self.nodes = list(g.node)
        self.num_layers = num_layers
        self.present = present
        self.producer = {o: i for i, n in enumerate(self.nodes) for o in n.output if o}
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = {i.name: i for i in g.input if i.name not in self.initializers}
        self.graph_outputs = {o.name: o for o in g.output}
        self.elem = self.graph_inputs[self._first_past()].type.tensor_type.elem_type if self._first_past() else 1
        # The node's layer from its name; the builder names its final norm layers.{n8}: that is the head.
        self.layer_of: list[int | None] = []
        for n in self.nodes:
            m = LAYER_NODE.search(n.name)
            j = int(m.group(1)) if m else None
            self.layer_of.append(j if j is not None and j < num_layers else None)
        if not any(j is not None for j in self.layer_of):
            raise ValueError(f"{path}: no node is named by its decoder layer (like /model/layers.0/...); --by-layer "
                             f"cuts the graph by those names")
        self.embed = self._embedding_node()
        self.stream = self._stream()
        self.blocks = self._blocks()

    def _first_past(self) -> str | None:
        return next((n for n in self.graph_inputs if n not in (INPUT_IDS, "attention_mask", "position_ids",
                                                                   "seqlens_k", "total_sequence_length")), None)

    def _embedding_node(self) -> int:
        """The Gather of a table by input_ids (a weight, or the builder's transposed tied lm_head): Z^0 starts there."""
        for i, n in enumerate(self.nodes):
            if n.op_type == "Gather" and n.input[1] == INPUT_IDS:
                return i
        raise ValueError(f"{self.path}: no Gather of an embedding table by {INPUT_IDS!r}; --by-layer cannot find "
                         f"where the hidden state starts")

    def _stream(self) -> set[str]:
        """Values computed from the hidden state (downstream of the embedding lookup; shapes excluded)."""
        stream = set(o for o in self.nodes[self.embed].output if o)
        for n in self.nodes[self.embed + 1:]:
            if n.op_type not in _SHAPE_OPS and any(x in stream for x in n.input):
                stream.update(o for o in n.output if o)
        return stream

    def _crossing(self, owner: Callable[[int], bool]) -> tuple[str, ...]:
        """Hidden-state values that nodes of this block read but another block's nodes wrote, in reading order."""
        out: list[str] = []
        for i, n in enumerate(self.nodes):
            if not owner(i):
                continue
            for x in n.input:
                p = self.producer.get(x)
                if x in self.stream and p is not None and not owner(p) and x not in out:
                    out.append(x)
        return tuple(out)

    def _blocks(self) -> list[Block]:
        n8 = self.num_layers
        # Nodes outside the layers belong to the head when they read what a layer computed, else to the embedding
        # (Gemma's sqrt(n2) scaling runs between the lookup and layer 0).
        after: set[str] = set()
        for i, n in enumerate(self.nodes):
            if n.op_type not in _SHAPE_OPS and (self.layer_of[i] is not None or any(x in after for x in n.input)):
                after.update(o for o in n.output if o)
        is_head = lambda i: (self.layer_of[i] is None and i != self.embed and  # noqa: E731
                             any(o in self.stream for o in self.nodes[i].output)
                             and any(x in after for x in self.nodes[i].input))
        cuts = [self._crossing(lambda i, j=j: self.layer_of[i] == j) for j in range(n8)] + [self._crossing(is_head)]
        for j, c in enumerate(cuts):
            where = f"layer {j}" if j < n8 else "the final norm"
            if not 1 <= len(c) <= 2:
                raise ValueError(f"{self.path}: {len(c)} hidden-state values cross into {where} ({', '.join(c[:4])}); "
                                 f"--by-layer cuts graphs where one value (or a residual pair) does")
        blocks = [Block(EMBEDDING, None, (), cuts[0], None, ())]
        for j in range(n8):
            blocks.append(Block(f"layer {j}", j, cuts[j], cuts[j + 1],
                                (self.present(j, "key"), self.present(j, "value")), ()))
        blocks.append(Block(HEAD, None, cuts[n8], (LOGITS,), None, ()))
        return [dataclasses.replace(b, nodes=self._slice(b)) for b in blocks]

    def _slice(self, b: Block) -> tuple[int, ...]:
        """The nodes the block's outputs need, back to its inputs, graph inputs and initializers."""
        stop = set(b.inputs) | set(self.graph_inputs) | set(self.initializers)
        want = [*b.outputs, *(b.presents or ())]
        for w in want:
            if w not in self.producer:
                raise ValueError(f"{self.path}: no node writes {w!r}, which {b.name} should output")
        keep: set[int] = set()
        seen: set[str] = set()
        while want:
            v = want.pop()
            if not v or v in seen or v in stop:
                continue
            seen.add(v)
            i = self.producer.get(v)
            if i is None:
                raise ValueError(f"{self.path}: {b.name} needs {v!r}, which no node writes and no input feeds")
            keep.add(i)
            want.extend(self.nodes[i].input)
        return tuple(sorted(keep))

    def block_model(self, b: Block, vocab: tuple[int, int, int] | None = None) -> Any:
        """The block as a model: the graph's nodes, its initializers (external data where the export's are).

        vocab (the head only): (vocab_size, start, stop): every initializer with a vocab_size axis cut to those
        rows of the vocabulary (vocab_rows), so the block's logits are those columns alone."""
        import onnx
        from onnx import helper

        nodes = [self.nodes[i] for i in b.nodes]
        used = {x for n in nodes for x in n.input if x}
        inputs = [helper.make_tensor_value_info(x, self.elem, None) for x in b.inputs]
        inputs += [vi for name, vi in self.graph_inputs.items() if name in used]
        outputs = [(self.graph_outputs.get(x) if vocab is None else None)  # a slab's logits are not [.., vocab]
                   or helper.make_tensor_value_info(x, self.elem, None) for x in (*b.outputs, *(b.presents or ()))]
        inits = [t for name, t in self.initializers.items() if name in used]
        if vocab is not None:
            inits = [self.vocab_rows(t, *vocab) for t in inits]
        graph = helper.make_graph(nodes, f"{self.model.graph.name}/{b.name}", inputs, outputs, initializer=inits)
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                  ir_version=self.model.ir_version, functions=list(self.model.functions))
        assert isinstance(model, onnx.ModelProto), "helper.make_model returns a ModelProto"
        return model

    def vocab_rows(self, t: Any, vocab: int, start: int, stop: int) -> Any:
        """Initializer t cut to vocabulary rows start..stop-1 along its vocab-sized axis (t itself when it has none).

        Rows of a [vocab, n2] table stored outside the graph stay there: the slab is the same file at a later
        offset, read by onnxruntime as the whole table would be. Any other layout is copied out, a slab at a time."""
        from onnx import TensorProto, helper

        dims = list(t.dims)
        if vocab not in dims:
            return t
        axis = dims.index(vocab)
        size = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        inner = math.prod(dims[axis + 1:]) * size  # bytes of one row of that axis
        ext = {e.key: e.value for e in t.external_data}
        out = TensorProto()
        out.name, out.data_type = t.name, t.data_type
        out.dims.extend(dims[:axis] + [stop - start] + dims[axis + 1:])
        if ext and axis == 0:
            out.data_location = TensorProto.EXTERNAL
            for k, v in ext.items():
                if k not in ("offset", "length"):
                    out.external_data.add(key=k, value=v)
            out.external_data.add(key="offset", value=str(int(ext.get("offset", 0)) + start * inner))
            out.external_data.add(key="length", value=str((stop - start) * inner))
            return out
        if ext:
            raw = np.memmap(self.path.parent / ext["location"], np.uint8, "r", int(ext.get("offset", 0)),
                            math.prod(dims) * size)
        else:
            from onnx import numpy_helper

            raw = np.frombuffer(t.raw_data if t.raw_data else numpy_helper.to_array(t).tobytes(), np.uint8)
        whole = raw.reshape(math.prod(dims[:axis]), vocab, inner)  # [rows before the axis, vocab, bytes of a row]
        out.raw_data = np.ascontiguousarray(whole[:, start:stop]).tobytes()
        return out

    def weight_bytes(self, b: Block) -> int:
        """Bytes of the block's initializers (stored or external)."""
        total = 0
        for x in {x for i in b.nodes for x in self.nodes[i].input}:
            t = self.initializers.get(x)
            if t is not None:
                length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
                total += length if length is not None else len(t.raw_data) or math.prod(t.dims) * 4
        return total


# --- Running a block ---------------------------------------------------------------------------------------

class BlockRunner:
    """Sessions over the blocks of one export, each created from the block's bytes and dropped after its run."""

    def __init__(self, blocks: GraphBlocks, kv_heads: int, head_dim: int, provider: str = "cpu", tf32: bool = False,
                 row_by_row: bool = False):
        self.blocks, self.provider, self.tf32, self.row_by_row = blocks, provider, tf32, row_by_row
        self.kv_heads, self.head_dim = kv_heads, head_dim  # the graph may leave them symbolic
        self.emulated = False  # whether a block ran bf16 emulated (the CPU has no bf16 kernels)
        self.windows = windowed_pasts(blocks.nodes, str(blocks.path))  # sliding-window pasts: at least W slots

    def session(self, b: Block, vocab: tuple[int, int, int] | None = None) -> Any:
        ort = onnxruntime()
        opts = ort.SessionOptions()
        opts.log_severity_level = 4  # fatal only: a kernel that refuses to run is raised as one line (run_bound)
        opts.add_session_config_entry(EXTERNAL_FOLDER, str(self.blocks.path.parent.resolve()))
        # A block runs once: MLAS's prepacked copy of each weight would double the block's memory for nothing
        # (Qwen2.5-0.5B's lm_head block: +0.5 GB at the run's peak).
        opts.add_session_config_entry("session.disable_prepacking", "1")
        providers = provider_list(self.provider, self.tf32)
        model = self.blocks.block_model(b, vocab)
        try:
            try:
                return ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=providers)
            except Exception as e:  # noqa: BLE001
                if not ("NOT_IMPLEMENTED" in str(e) and self.provider == "cpu" and is_bf16_graph(model)):
                    raise
            # The CPU has no bf16 kernels: this block in fp32 rounded to bf16 after every op (emulation.py),
            # its weights (one layer's) read into it first.
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(self.blocks.path.parent.resolve()))
            sess = ort.InferenceSession(emulate_bf16(model).SerializeToString(), sess_options=opts,
                                        providers=providers)
            sess.bf16_emulated = self.emulated = True  # its inputs: bf16 values held in fp32 (_run rounds them)
            return sess
        except Exception as e:  # noqa: BLE001  onnxruntime's own exception types: one line
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise ValueError(f"{self.blocks.path}: onnxruntime could not load {b.name} cut from it: "
                             f"{first[:300]}") from None

    def run(self, b: Block, z: np.ndarray | None, ids: np.ndarray, mask: np.ndarray,
            sess: Any = None) -> dict[str, np.ndarray]:
        """Outputs of block `b` fed hidden state z [batch, seq, n2] (None for the embedding), prefill of `ids`;
        in `sess` when given (one session for several batches)."""
        sess = sess or self.session(b)
        if not self.row_by_row:
            return self._run(sess, b, z, ids, mask)
        # A graph whose attention takes no left padding: each row alone, then put back left-padded.
        rows = []
        for r in range(ids.shape[0]):
            keep = mask[r].astype(bool)
            rows.append(self._run(sess, b, None if z is None else z[r:r + 1, keep], ids[r:r + 1, keep],
                                  mask[r:r + 1, keep]))
        out = {}
        seq = ids.shape[1]
        for name, first in rows[0].items():
            axis = 2 if b.presents and name in b.presents else 1  # presents [1, kv_heads, n, n6]; others [1, n, ...]
            shape = list(first.shape)
            shape[0], shape[axis] = len(rows), seq
            full = np.zeros(shape, first.dtype)
            for r, o in enumerate(rows):
                n = o[name].shape[axis]
                index: list[Any] = [r] + [slice(None)] * (len(shape) - 1)
                index[axis] = slice(seq - n, seq)
                full[tuple(index)] = o[name][0]
            out[name] = full
        return out

    def _run(self, sess: Any, b: Block, z: np.ndarray | None, ids: np.ndarray,
             mask: np.ndarray) -> dict[str, np.ndarray]:
        inputs = {i.name: i for i in sess.get_inputs()}
        small = {INPUT_IDS: ids, "attention_mask": mask, "position_ids": positions(mask, ids.shape[1]),
                 "seqlens_k": mask.sum(-1) - 1, "total_sequence_length": np.array(mask.shape[1])}
        binding = sess.io_binding()
        keep = []  # the OrtValues bound must outlive the run
        for name, i in inputs.items():
            if name in small:
                arr = np.ascontiguousarray(small[name], dtype=np.dtype(dtypes.from_onnx_type_string(i.type).numpy))
                binding.bind_cpu_input(name, arr)
                keep.append(arr)
                continue
            if name in b.inputs:
                assert z is not None, f"{b.name} takes a hidden state"
                x = z if name == b.inputs[0] else np.zeros_like(z)  # Z + 0 + ... is exactly Z
            else:  # an empty past (a static buffer: zeros of its length; a sliding-window one: of the window)
                slots = i.shape[2] if isinstance(i.shape[2], int) else 0
                if name in self.windows:
                    slots = window_slots(self.windows[name], ids.shape[1])
                x = np.zeros((ids.shape[0], self.kv_heads, slots, self.head_dim), np.float32)  # [b, kv_heads, past, n6]
            x = x.astype(np.float32)
            if getattr(sess, "bf16_emulated", False):  # what a bf16 input would hold: the value rounded to bf16
                x = bf16_bits_to_float32(float32_to_bf16_bits(x))
            v = numpy_to_ortvalue(x, i.type)
            binding.bind_ortvalue_input(name, v)
            keep.append(v)
        names = [o.name for o in sess.get_outputs()]
        for name in names:
            binding.bind_output(name, "cpu")
        run_bound(sess, binding, f"{self.blocks.path} ({b.name})")
        out = {n: ortvalue_to_numpy(v) for n, v in zip(names, binding.get_outputs())}
        if b.presents:
            for name in b.presents:  # a static buffer: only the slots written are keys
                out[name] = out[name][:, :, :mask.shape[1]]
        return out


# --- The reference, one layer at a time --------------------------------------------------------------------

class LayerReference:
    """The streamed reference's arithmetic, one block at a time, in one dtype; weights cast tensor by tensor."""

    def __init__(self, reader: Any, dtype: Any, reassociated: bool = False):
        import torch

        self.reader, self.cfg, self.dtype, self.reassociated = reader, reader.cfg, dtype, reassociated
        self._tables: dict[int, Any] = {}  # by length: the positions a pass reaches, not max_position_embeddings
        self._table_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def tables(self, length: int) -> Any:
        """RoPE tables for positions 0..length-1 (the last length asked for is kept); dynamic's and longrope's those
        of a pass of that length (rope.py)."""
        from llama_tools.modeling.model import rope_tables_of

        if length not in self._tables:
            self._tables = {length: rope_tables_of(self.cfg, "cpu", self._table_dtype, length=length,
                                                   seq_len=length)}
        return self._tables[length]

    def embed(self, ids: np.ndarray) -> Any:
        import torch

        from llama_tools.modeling.model import embedding_scale

        t = torch.from_numpy(ids)
        uniq, inverse = torch.unique(t, return_inverse=True)
        rows = self.reader.rows("model.embed_tokens.weight", [(int(i), int(i) + 1) for i in uniq])
        z = rows.to(self.dtype)[inverse]  # [n_unique, n2] gathered to [b, n3, n2]
        return embedding_scale(self.cfg, z)  # Gemma's sqrt(n2), Granite's multiplier, as the model's embed

    def layer(self, j: int, z: Any, mask: np.ndarray) -> tuple[Any, Any, Any]:
        """Decoder j on z: (Z^{j+1}, K, V); the fp32 weights read one tensor at a time, each cast, then freed."""
        return self.layer_batches(j, [(z, mask)])[0]

    def layer_batches(self, j: int, batches: list[tuple[Any, np.ndarray]]) -> list[tuple[Any, Any, Any]]:
        """Decoder j on each (z, mask) of `batches`, its weights read once: [(Z^{j+1}, K, V), ...]."""
        import torch

        from llama_tools.modeling.model import DecoderLayer, attention_bias, layer_tables
        from llama_tools.modeling.weights import weight_specs

        prefix = f"model.layers.{j}."
        # A pass wider than fp32 (the float64 truth) keeps the matrices in fp32 and widens each one as its
        # Linear runs: one float64 matrix at a time instead of a whole float64 layer (2x its fp32 bytes).
        wide = torch.finfo(self.dtype).bits > 32
        state = {}
        for s in (s for s in weight_specs(self.cfg) if s.layer == j):
            t = self.reader.read([s.name])[s.name]
            state[s.name.removeprefix(prefix)] = t if wide and t.dim() == 2 else t.to(self.dtype)
        with torch.device("meta"):
            layer = DecoderLayer(self.cfg, j)
        layer.load_state_dict(state, strict=True, assign=True)
        del state
        if self.reassociated:
            from llama_tools.inference.reference import reassociate

            reassociate(layer)
        if wide:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_pre_hook(_widen(self.dtype))
                    m.register_forward_hook(_narrow)
        outs = []
        for z, mask in batches:
            m = torch.from_numpy(mask)
            bias = attention_bias(self.cfg, mask.shape[1], 0, m, torch.float32 if self.dtype == torch.float64
                                  else self.dtype, z.device, sliding=layer.sliding).to(self.dtype)
            pos = torch.from_numpy(positions(mask, mask.shape[1]))  # [b, n3]
            with torch.no_grad():
                out, (k, v) = layer.eval()(z, bias, pos, layer_tables(self.tables(int(pos.max()) + 1),
                                                                      layer.sliding), None)
            outs.append((out, k, v))
        return outs

    def final_norm(self, z: Any) -> Any:
        """Zbar: the final norm of Z^n8, [..., n2] -> [..., n2]."""
        import torch

        from llama_tools.modeling.model import norm as family_norm
        from llama_tools.modeling.weights import weight_specs

        with torch.device("meta"):
            norm = family_norm(self.cfg)
        names = [s.name for s in weight_specs(self.cfg) if s.component == "final_norm"]  # γ (and LayerNorm's β)
        norm.load_state_dict({n.removeprefix("model.norm."): t.to(self.dtype) for n, t in
                              self.reader.read(names).items()}, assign=True)
        with torch.no_grad():
            return norm(z)

    def head(self, z: Any) -> Any:
        """Logits from Z^n8: the final norm, then lm_head in row chunks (the streamed reference's own)."""
        import torch

        from llama_tools.inference.reference import StreamedReference

        with torch.no_grad():
            return StreamedReference(self.reader, dtype=self.dtype, reassociated=self.reassociated)._head(
                self.final_norm(z))

    def head_slab(self, zbar: Any, w: Any) -> Any:
        """Logits of vocabulary rows w [cols, n2] (fp32, as read) from Zbar [p, n2]: [p, cols], as _head makes them."""
        import torch
        import torch.nn.functional as F

        from llama_tools.inference.reference import reassociated_matmul
        from llama_tools.modeling.model import final_logits

        w = w.to(self.dtype)
        if self.cfg.norm_head:
            w = F.normalize(w, dim=-1)  # row-wise, so a slab of rows is normalized as the whole table is
        with torch.no_grad():
            return final_logits(self.cfg, reassociated_matmul(zbar, w) if self.reassociated else zbar @ w.T)


def _widen(dtype: Any) -> Callable[..., None]:
    def hook(m: Any, args: Any) -> None:
        m._narrow, m._parameters["weight"] = m.weight, m.weight.to(dtype)  # the fp32 matrix kept aside
    return hook


def _narrow(m: Any, args: Any, out: Any) -> None:
    m._parameters["weight"] = m._narrow  # the float64 copy is freed
    del m._narrow


# --- The check -------------------------------------------------------------------------------------------

@dataclass
class BlockResult:
    """One block's checks: hidden state, K, V for a layer; the logits for the head; Z^0 for the embedding."""

    name: str
    layer: int | None
    checks: list[BudgetCheck]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@dataclass
class ByLayerReport:
    onnx_path: str
    source: str
    provider: str
    dtype: str
    graph: str
    prompt_lengths: list[int]
    budget: Budget
    blocks: list[BlockResult]
    seconds: float
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    export_seconds: float | None = None

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.blocks)

    @property
    def first_bad(self) -> str | None:
        """Where the graph first leaves its budget: 'layer 3', 'the embedding', 'logits only'; None when it passes."""
        bad = next((b for b in self.blocks if not b.passed), None)
        if bad is None:
            return None
        return {EMBEDDING: "the embedding", HEAD: "logits only"}.get(bad.name, bad.name)

    @property
    def first_bad_layer(self) -> int | None:
        return next((b.layer for b in self.blocks if not b.passed and b.layer is not None), None)

    @property
    def checks(self) -> list[BudgetCheck]:
        return [c for b in self.blocks for c in b.checks]

    def series(self) -> dict[str, Any]:
        """Per layer error, noise and bound of K, V and the hidden state: what the plot draws (plain data)."""
        layers = [b for b in self.blocks if b.layer is not None]
        out: dict[str, Any] = {"layers": [b.layer for b in layers], "first_bad_layer": self.first_bad_layer,
                               "title": f"{self.onnx_path} ({self.graph}, {self.dtype}), layer by layer"}
        for i, what in enumerate(LAYER_CHECKS):
            cs = [b.checks[i] for b in layers]
            out[what] = {"error": [c.error for c in cs], "noise": [c.noise for c in cs], "bound": [c.bound for c in cs]}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"onnx_path": self.onnx_path, "source": self.source, "provider": self.provider, "dtype": self.dtype,
                "graph": self.graph, "prompt_lengths": self.prompt_lengths, "budget": dataclasses.asdict(self.budget),
                "mode": "by-layer", "blocks": [{"name": b.name, "layer": b.layer, "passed": b.passed,
                                                "checks": [c.to_dict() for c in b.checks]} for b in self.blocks],
                "first_bad": self.first_bad, "first_bad_layer": self.first_bad_layer, "passed": self.passed,
                "seconds": self.seconds, "notes": self.notes, "timings": self.timings,
                "export_seconds": self.export_seconds}


def verify_by_layer(target: Any, *, prompts: list[list[int]] | None = None, provider: str = "cpu",
                    dtype: str = "float32", rope_op: str = "llama_tools", tf32: bool = False,
                    budget: Budget | None = None, progress: Progress = silent) -> ByLayerReport:
    """`verify parity --by-layer` on a ParityTarget: export on the fly when it is a MODEL, then judge block by block."""
    from .parity import check_inputs, is_int4

    check_inputs(prompts or [], 0, target)
    if target.onnx_path is not None and is_int4(target.onnx_path):
        raise ValueError(f"{target.onnx_path}: weight-only int4 (MatMulNBits): an fp32 budget does not apply to it; "
                         f"measure it with `llama-tools verify int4 {target.onnx_path}` (top-1, KL, perplexity)")
    if target.onnx_path is not None:
        return _by_layer(target.onnx_path, target, prompts, provider, tf32, budget, progress)
    with files.temp_dir("parity") as tmp:
        exported = export_onnx(target.source, Path(tmp) / "model.onnx", dtype=dtype, rope_op=rope_op,
                               seed=target.seed, progress=progress)
        meta = read_metadata(exported.path)
        rep = _by_layer(exported.path, dataclasses.replace(target, meta=meta), prompts, provider, tf32, budget,
                        progress)
    rep.onnx_path, rep.export_seconds = f"{target.source.spec} (exported on the fly)", exported.seconds
    return rep


def _by_layer(onnx_path: Path, target: Any, prompts: list[list[int]] | None, provider: str, tf32: bool,
              budget: Budget | None, progress: Progress,
              batches: list[list[list[int]]] | None = None) -> ByLayerReport:
    """The layer-local check of `prompts`, run as `batches` (each a padded batch of its own; default: one)."""
    import torch

    from llama_tools.inference.reference import reference_model

    from .parity import _channel_order, budget_for, keys_by_position

    start = time.perf_counter()
    meta = target.meta
    bound_heap()  # its many-MB temporaries' pages go back as they are freed (progress.py)
    cfg = meta.config
    io = target.foreign
    blocks = GraphBlocks(onnx_path, cfg.num_hidden_layers, io.present_name if io is not None else present_name)
    batches = batches or [prompts or default_prompts(cfg.vocab_size, meta.seed)]
    prompts = [list(p) for rows in batches for p in rows]
    padded = [left_pad(rows) for rows in batches]  # [(ids [b, n3], mask [b, n3]), ...]
    masks = [mask.astype(bool) for _, mask in padded]  # each batch's valid positions
    # Each check is judged over every batch's valid positions at once, as one row: [1, P, ...] (judge's order).
    count = sum(int(v.sum()) for v in masks)
    valid = np.ones((1, count), bool)
    # auto: CUDA when a session really runs there (a one-node probe), as the whole-graph check decides
    run_on = provider if provider != "auto" else ("cuda" if cuda_unusable() is None else "cpu")
    runner = BlockRunner(blocks, cfg.num_key_value_heads, cfg.head_dim, run_on, tf32,
                         row_by_row=io is not None and io.row_by_row)
    largest = max(blocks.weight_bytes(b) for b in blocks.blocks)
    widest = max(padded, key=lambda p: p[0].size)[0].shape  # the batch with the most padded positions
    ref = reference_model(target.source, seed=target.seed, progress=progress, batch=widest[0], seq=widest[1],
                          extra_bytes=largest if run_on == "cpu" else 0,
                          dtype=getattr(torch, dtypes.get(meta.dtype).torch), float64_pass=True)
    chosen, tf32_note = budget_for(meta.dtype, run_on, {"use_tf32": "1" if tf32 else "0"})
    budget = budget or chosen
    truth_side, noise_side = LayerReference(ref.reader, torch.float64), LayerReference(ref.reader, ref.dtype)
    alt_side = LayerReference(ref.reader, ref.dtype, reassociated=True)  # a second correct implementation
    k_order = _channel_order(meta.rope_layout, ref.cfg.rope_layout, cfg.head_dim)
    by_position = [keys_by_position(meta, mask) for _, mask in padded]  # keys rotated by slot turned back
    f64 = lambda t: t.to(torch.float64).numpy()  # noqa: E731
    graph_in = lambda t: t.to(torch.float32).numpy()  # noqa: E731  the graph's dtype rounding happens in the cast below
    laps: dict[str, float] = {"onnxruntime": 0.0, f"PyTorch {meta.dtype}": 0.0,
                              f"PyTorch {meta.dtype} reassociated": 0.0, "PyTorch float64": 0.0}
    alt_key = f"PyTorch {meta.dtype} reassociated"
    # fp16 only: where PyTorch fp16 overflows in a block, its noise is estimated from fp32's (compare.judge)
    wide_sides = ((LayerReference(ref.reader, torch.float32), LayerReference(ref.reader, torch.float32,
                                                                            reassociated=True))
                  if meta.dtype == dtypes.FLOAT16.name else ())
    wide_key = "PyTorch float32 (where fp16 overflows)"

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            laps[key] = laps.get(key, 0.0) + time.perf_counter() - t0

    def once(fn: Callable[[], Any]) -> Callable[[], Any]:
        """fn, run at its first call only (a block's fp32 pass, shared by its checks)."""
        memo: list[Any] = []
        return lambda: memo[0] if memo else memo.append(fn()) or memo[0]

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        """Each batch's [b, n3, ...] at its valid positions, joined: [1, P, ...]."""
        return np.concatenate([x[v] for x, v in zip(parts, masks)])[None]

    results: list[BlockResult] = []
    n8 = cfg.num_hidden_layers

    def hidden(outs: dict[str, np.ndarray], b: Block) -> np.ndarray:
        return sum(outs[x].astype(np.float64) for x in b.outputs)  # the addends crossing into the next block

    # Embedding: Z^0 from the ids.
    emb = blocks.blocks[0]
    got = [hidden(timed("onnxruntime", lambda: runner.run(emb, None, ids, mask)), emb) for ids, mask in padded]
    zs = [timed("PyTorch float64", lambda: truth_side.embed(ids)) for ids, _ in padded]  # Z^0 f64: [b, n3, n2]
    ref_z = [f64(timed(f"PyTorch {meta.dtype}", lambda: noise_side.embed(ids))) for ids, _ in padded]
    results.append(BlockResult(EMBEDDING, None, [judge("embedding Z^0", joined(got), joined(ref_z),
                                                       joined([f64(z) for z in zs]), valid, meta.dtype, budget)]))
    for j in range(n8):
        b = blocks.blocks[1 + j]
        z_in = [z.to(ref.dtype) for z in zs]  # the truth's input, rounded to the graph's dtype: both sides get it
        sess = timed("onnxruntime", lambda: runner.session(b))
        got = [timed("onnxruntime", lambda: runner.run(b, graph_in(z), ids, mask, sess))
               for z, (ids, mask) in zip(z_in, padded)]
        del sess
        fed = [(z, m) for z, (_, m) in zip(z_in, padded)]
        rs = timed(f"PyTorch {meta.dtype}", lambda: noise_side.layer_batches(j, fed))
        als = timed(alt_key, lambda: alt_side.layer_batches(j, fed))
        ts = timed("PyTorch float64", lambda: truth_side.layer_batches(j, [(z, m) for z, (_, m) in zip(zs, padded)]))
        assert b.presents is not None, "a layer block outputs its K and V"
        # [batch, kv_heads, seq, n6] -> [batch, seq, kv_heads, n6]: positions on axis 1 for the mask
        kv = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        t_z64_raw = joined([f64(t[0]) for t in ts])
        g_z, r_z64, a_z64, t_z64 = per_channel(joined([hidden(g, b) for g in got]), t_z64_raw, valid,
                                               joined([f64(r[0]) for r in rs]), joined([f64(a[0]) for a in als]))
        wide = once(lambda: [timed(wide_key, lambda: w.layer_batches(j, [(z.to(torch.float32), m) for z, (_, m)
                                                                          in zip(zs, padded)])) for w in wide_sides])
        fb = ((lambda: [per_channel(joined([f64(o[0]) for o in w]), t_z64_raw, valid)[0] for w in wide()])
              if wide_sides else None)
        checks = [judge(f"layer {j} hidden Z^{j + 1}", g_z, (r_z64, a_z64), t_z64, valid, meta.dtype, budget,
                        fallback=fb, peak=float(np.abs(t_z64_raw).max()) if count else 0.0)]
        for i, what in enumerate(("key", "value"), 1):
            name = b.presents[i - 1]
            g = joined([kv(by_position[n](j, o[name])[..., k_order] if i == 1 else o[name])
                        for n, o in enumerate(got)])
            fb = (lambda i=i: [joined([kv(f64(o[i])) for o in w]) for w in wide()]) if wide_sides else None
            checks.append(judge(f"present.{j}.{what}", g, (joined([kv(f64(r[i])) for r in rs]),
                                                            joined([kv(f64(a[i])) for a in als])),
                                joined([kv(f64(t[i])) for t in ts]), valid, meta.dtype, budget, fallback=fb))
        results.append(BlockResult(b.name, j, checks))
        zs = [t[0] for t in ts]
        del got, rs, als, ts
        progress(j + 1, n8, "layer by layer")
    release_freed_memory()  # the layers' sessions and tensors are gone: their pages go back before the head's
    z = torch.from_numpy(joined([f64(z) for z in zs]))  # Z^n8 [1, P, n2]: the head is position-wise
    results.append(BlockResult(HEAD, None, [head_check(runner, blocks.blocks[-1], z, valid, meta.dtype, budget,
                                                       (truth_side, noise_side, alt_side), wide_sides, timed,
                                                       (f"PyTorch {meta.dtype}", alt_key, wide_key))]))
    label = DTYPE_LABEL.get(meta.dtype, meta.dtype)
    notes = [f"each block fed PyTorch float64's own input to it (in {label}); error = RMS |onnxruntime - float64|, "
             f"noise = the larger RMS |PyTorch {label} - float64| of two correct implementations (PyTorch's, and "
             f"PyTorch's with every matrix product summed in another order; the hidden state's channels each in "
             f"units of their RMS); "
             f"pass when error <= {budget.multiple:g} x noise + {budget.floor_ulps:g} ulp; the prefill only (the "
             f"whole-graph check covers decode)",
             f"blocks cut from the graph by node names; weights read from its own files (largest block "
             f"{largest / 2**20:,.1f} MiB)"]
    if tf32_note:
        notes.append(tf32_note)
    if runner.emulated:
        notes.append(EMULATED_BF16)
    estimated = [c.name for c in (c for r in results for c in r.checks) if c.estimate]
    if estimated:
        notes.append(f"PyTorch fp16 overflows (NaN/Inf where float64 is finite) in {len(estimated)} check(s) from "
                     f"{estimated[0]} on: their noise is PyTorch fp32's x {FP16_PER_FP32:g} (the smallest fp16/fp32 "
                     f"noise ratio measured where fp16 is finite)")
    graph = io.producer if io is not None else f"llama-tools {meta.graph}"
    return ByLayerReport(str(onnx_path), target.source.label, run_on, meta.dtype, graph, [len(p) for p in prompts],
                         budget, results, time.perf_counter() - start, notes, laps)


# Logits made and judged at once, [positions, vocabulary columns]: a 262,144-piece vocabulary's logits are 1 MB a
# position in fp32 (Gemma 3's 654 default positions: 0.7 GB a copy, four copies judged), and its lm_head 671 MB.
HEAD_CHUNK_ELEMENTS = 1 << 21
HEAD_MIN_COLUMNS = 1024  # a slab's columns at least: each slab is a session of its own
HEAD_SLAB_BYTES = 8 * 2**20  # fp32 rows of lm_head at once, at most (the float64 pass widens them: twice that)


def head_columns(cfg: Any, positions: int) -> int:
    """Vocabulary rows a slab of the head: HEAD_CHUNK_ELEMENTS logits over the positions, HEAD_SLAB_BYTES of lm_head."""
    if cfg.hidden_size == cfg.vocab_size:  # the slab of such a head could be cut on the wrong axis: it runs whole
        return cfg.vocab_size
    fit = min(HEAD_CHUNK_ELEMENTS // max(1, positions), HEAD_SLAB_BYTES // (4 * cfg.hidden_size))
    return min(cfg.vocab_size, max(HEAD_MIN_COLUMNS, fit))


def head_check(runner: BlockRunner, head: Block, z: Any, valid: np.ndarray, dtype: str, budget: Budget,
               sides: tuple[LayerReference, LayerReference, LayerReference], wide_sides: tuple[LayerReference, ...],
               timed: Callable[[str, Callable[[], Any]], Any], keys: tuple[str, str, str]) -> BudgetCheck:
    """The logits of Z^n8 (float64's [b, n3, n2]) at the valid positions, made and judged a slab at a time.

    Vocabulary rows start..stop of lm_head go to each side at once: onnxruntime runs the head block with its
    vocab-sized initializers cut to those rows (GraphBlocks.vocab_rows), PyTorch reads the same rows from the
    checkpoint; a chunk of positions at a time, each [positions, columns] chunk judged as it is made
    (compare.JudgeSums) and dropped. Neither lm_head nor the logits are ever whole. Only the valid positions run:
    the head is position-wise (the final norm, lm_head, a cap), so padding has no logits to judge.
    sides: (float64, the graph's dtype, reassociated); wide_sides: fp32's pair for fp16's fallback (compare.judge).
    """
    import torch

    from ..graph_io import LOGITS

    truth, noise, alt = sides
    cfg = truth.cfg
    vocab = cfg.vocab_size
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    zv = z[torch.from_numpy(valid)]  # [b, n3, n2] -> [P, n2]: the valid positions, in judge's (row-major) order
    count = zv.shape[0]
    z_in = zv.to(noise.dtype)  # the truth's input rounded to the graph's dtype: both sides get the same
    zbar = [timed(k, lambda s=s, x=x: s.final_norm(x)) for k, s, x in
            (("PyTorch float64", truth, zv), (keys[0], noise, z_in), (keys[1], alt, z_in))]
    cols = head_columns(cfg, count)
    step = max(1, HEAD_CHUNK_ELEMENTS // cols)  # positions a chunk
    feed = z_in.to(torch.float32).numpy()[None]  # [1, P, n2]: the graph's input, the positions as one row
    ids, mask = np.zeros((1, count), np.int64), np.ones((1, count), np.int64)
    sums = JudgeSums(count, 2, logits=True)
    nonfinite = 0
    for a in range(0, vocab, cols):
        c = min(a + cols, vocab)
        sess = timed("onnxruntime", lambda: runner.session(head, None if cols == vocab else (vocab, a, c)))
        w = timed("PyTorch float64", lambda: truth.reader.rows(name, [(a, c)]))  # [cols, n2] fp32
        for p in range(0, count, step):
            q = min(p + step, count)
            got = timed("onnxruntime", lambda: runner._run(sess, head, feed[:, p:q], ids[:, p:q], mask[:, p:q]))
            g = got[LOGITS][0]  # [1, q - p, cols] -> [q - p, cols]
            assert g.shape == (q - p, c - a), f"head slab {a}:{c}: onnxruntime gave {g.shape}, not {(q - p, c - a)}"
            nonfinite += int(g.size - np.isfinite(g).sum())
            t = timed("PyTorch float64", lambda: truth.head_slab(zbar[0][p:q], w))
            r = timed(keys[0], lambda: noise.head_slab(zbar[1][p:q], w))
            r2 = timed(keys[1], lambda: alt.head_slab(zbar[2][p:q], w))
            # The fp32 copies of the graph-dtype logits: what the whole-tensor judge was given (graph_in)
            sums.add(p, a, g, (r.to(torch.float32).numpy(), r2.to(torch.float32).numpy()), t.numpy())
        del sess, w
    wide_sums = None
    if wide_sides:
        def wide_sums() -> tuple[list[float], float]:
            """fp32's squared errors to float64 over the same slabs (fp16's fallback): a second pass."""
            wide_bar = [timed(keys[2], lambda s=s: s.final_norm(zv.to(torch.float32))) for s in wide_sides]
            sq, top = [0.0] * len(wide_sides), 0.0
            for a in range(0, vocab, cols):
                w = truth.reader.rows(name, [(a, min(a + cols, vocab))])
                for p in range(0, count, step):
                    t = truth.head_slab(zbar[0][p:p + step], w).numpy()
                    for i, (s, zb) in enumerate(zip(wide_sides, wide_bar)):
                        d = np.abs(timed(keys[2], lambda: s.head_slab(zb[p:p + step], w)).to(torch.float32)
                                   .numpy().astype(np.float64) - t)
                        sq[i] += float(np.square(d).sum())
                        top = max(top, float(d.max()) if d.size else 0.0)
            return sq, top
    return sums.check("logits (from Z^n8)", dtype, budget, nonfinite, wide_sums)


def per_channel(got: np.ndarray, truth: np.ndarray, valid: np.ndarray, *refs: np.ndarray) -> tuple[np.ndarray, ...]:
    """(got, *refs, truth) [batch, seq, n2], each divided by its channel's float64 RMS over the valid positions:
    errors in channel units.

    A trained model's residual stream has a few channels hundreds of times larger than the rest (SmolLM2: RMS
    15-370 in its middle layers); their rounding would set the whole tensor's RMS noise and hide an error
    elsewhere (a down_proj 1e-4 off passed), and one element's rounding would decide the ratio (6.9x on a correct
    export). Measured per channel, both go away: the correct export's worst ratio is 1.5x and 1e-5 fails.
    """
    scale = np.sqrt(np.mean(np.square(truth[valid]), axis=0))  # [n2]
    scale = np.where(scale > 0, scale, 1.0)[None, None, :]  # an all-zero channel stays as it is
    return (got / scale, *(r / scale for r in refs), truth / scale)


def by_layer_rows(rep: ByLayerReport, all_layers: bool = False) -> list[dict[str, Any]]:
    """The table: one row per block (the worst of its checks), every check of a failing block, or of all."""
    rows = []
    for b in rep.blocks:
        worst = max(b.checks, key=lambda c: c.ratio if math.isfinite(c.ratio) else math.inf)
        shown = b.checks if (all_layers or not b.passed) and len(b.checks) > 1 else [worst]
        for c in shown:
            # A passing block's one row: the worst of its checks, named by what it covers (which check is worst is
            # a near-tie of rounding, ~1x each; the JSON names it)
            name = c.name if len(shown) > 1 or len(b.checks) == 1 else f"worst of {len(b.checks)}: hidden, K, V"
            rows.append({"block": b.name, "check": name, "RMS error to float64 (ratio; bound)": c.figures(),
                         "max abs": f"{c.max_error:.3g}", "cosine": f"{c.cosine:.7f}", "result": c.verdict})
    return rows


def whole_graph_series(rep: Any) -> dict[str, Any]:
    """The whole-graph check's K and V per layer (each the sum of the errors before it) as the plot draws them."""
    kv = {c.name: c for c in rep.checks if c.name.startswith("present.")}
    layers = sorted({int(n.split(".")[1]) for n in kv})
    out: dict[str, Any] = {"layers": layers, "first_bad_layer": rep.first_bad_layer,
                           "title": f"{rep.onnx_path} ({rep.graph}, {rep.dtype}), whole graph"}
    for what in ("key", "value"):
        cs = [kv[f"present.{j}.{what}"] for j in layers]
        out[what] = {"error": [c.error for c in cs], "noise": [c.noise for c in cs], "bound": [c.bound for c in cs]}
    return out
