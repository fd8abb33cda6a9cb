"""Graphs llama-tools did not write (onnxruntime-genai's model builder, Optimum): their I/O read from the graph.

`describe_graph` maps a decoder graph's inputs and outputs once, from the proto without its weights:

    input_ids, attention_mask                  always
    position_ids                               Optimum, ours; absent from the builder's (GQA derives positions)
    seqlens_k, total_sequence_length           GQA graphs that take the lengths as inputs
    past_key_values.{i}.{key,value} / past.{i}.{key,value}      ->  present.{i}.* / present_key_values.{i}.*

Anything else is refused in one line. A graph whose attention is GroupQueryAttention with no position_ids
input computes each row's positions from its length, which assumes no left padding: such a graph is run
one row at a time (`RowByRow`) and its cache put back in the padded layout the comparison expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llama_tools.modeling import dtypes
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.rope_layouts import HALF, INTERLEAVED

from .graph_io import ATTENTION_MASK, GQA, INPUT_IDS, LOGITS, POSITION_IDS
from .rope_ops import ATTR_INTERLEAVED, OP_TYPE
from .runtime import OnnxLM, StepOutput

PAST = ("past_key_values.{i}.{kv}", "past.{i}.{kv}")
PRESENT = ("present.{i}.{kv}", "present_key_values.{i}.{kv}")
GQA_LENGTHS = ("seqlens_k", "total_sequence_length")
FED = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *GQA_LENGTHS)


@dataclass(frozen=True)
class GraphIO:
    """A decoder graph's I/O as `verify parity` feeds it."""

    path: str
    producer: str  # who wrote it, as far as the graph says
    past: str  # name pattern with {i} and {kv}
    present: str
    num_layers: int
    kv_heads: int | None  # None where the graph leaves the dimension symbolic
    head_dim: int | None
    vocab: int | None
    dtype: str  # the K/V cache's element type
    position_ids: bool
    row_by_row: bool  # GQA positions from lengths: no left padding, so one row at a time
    rope_layout: str  # of the K rows in the cache

    def past_name(self, i: int, kv: str) -> str:
        return self.past.format(i=i, kv=kv)

    def present_name(self, i: int, kv: str) -> str:
        return self.present.format(i=i, kv=kv)


def _pattern(names: set[str], patterns: tuple[str, ...]) -> tuple[str, int] | None:
    """The first pattern some names follow, and how many layers (0..n-1, key and value each) they cover."""
    for p in patterns:
        n = 0
        while p.format(i=n, kv="key") in names and p.format(i=n, kv="value") in names:
            n += 1
        if n:
            return p, n
    return None


def _dims(value_info: Any) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def describe_graph(path: str | Path) -> GraphIO:
    """Read the graph's inputs, outputs and attention nodes (no weights); ValueError for what cannot be fed."""
    import onnx

    path = str(path)
    if Path(path).is_file() and Path(path).stat().st_size == 0:  # protobuf reads 0 bytes as an empty model
        raise ValueError(f"{path}: empty file; export it again (llama-tools export onnx)")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends  # noqa: BLE001
        raise ValueError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    g = model.graph
    if not g.node:
        raise ValueError(f"{path}: the graph has no nodes")
    init = {t.name for t in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in init}
    outputs = {o.name: o for o in g.output}
    past = _pattern(set(inputs), PAST)
    present = _pattern(set(outputs), PRESENT)
    if INPUT_IDS not in inputs or LOGITS not in outputs:
        raise ValueError(f"{path}: not a decoder graph that verify parity can run (it needs inputs {INPUT_IDS!r} "
                         f"and an output {LOGITS!r}; inputs are {', '.join(sorted(inputs))})")
    if past is None or present is None:
        raise ValueError(f"{path}: no KV cache that verify parity can map (past inputs named like "
                         f"{' or '.join(PAST)}, outputs like {' or '.join(PRESENT)}); inputs are "
                         f"{', '.join(sorted(inputs)[:8])}")
    if past[1] != present[1]:
        raise ValueError(f"{path}: {past[1]} past layers but {present[1]} present layers")
    cache = {past[0].format(i=i, kv=kv) for i in range(past[1]) for kv in ("key", "value")}
    unknown = [n for n in inputs if n not in cache and n not in FED]
    if unknown:
        raise ValueError(f"{path}: input {unknown[0]!r} is not one verify parity can feed (it feeds "
                         f"{', '.join(FED)} and the past K/V)")
    if ATTENTION_MASK not in inputs:
        raise ValueError(f"{path}: no {ATTENTION_MASK!r} input: verify parity runs padded batches and needs one")
    k = _dims(inputs[past[0].format(i=0, kv="key")])
    elem = inputs[past[0].format(i=0, kv="key")].type.tensor_type.elem_type
    logits = _dims(outputs[LOGITS])
    gqa = [n for n in g.node if n.op_type == GQA]
    # GQA's own rotary says "rotary_interleaved"; the RotaryEmbedding ops (ours, contrib, ONNX) ATTR_INTERLEAVED
    interleaved = any(a.name in ("rotary_interleaved", ATTR_INTERLEAVED) and a.i for n in g.node
                      if n.op_type in (GQA, OP_TYPE) for a in n.attribute)
    producer = ("onnxruntime-genai builder" if (Path(path).parent / "genai_config.json").is_file() and gqa
                else "Optimum" if model.producer_name == "pytorch" and POSITION_IDS in inputs else
                model.producer_name or "unknown")
    return GraphIO(
        path=path, producer=producer, past=past[0], present=present[0], num_layers=past[1],
        kv_heads=k[1] if isinstance(k[1], int) else None, head_dim=k[3] if isinstance(k[3], int) else None,
        vocab=logits[2] if len(logits) == 3 and isinstance(logits[2], int) else None,
        dtype=dtypes.from_onnx(elem).name, position_ids=POSITION_IDS in inputs,
        row_by_row=(bool(gqa) and POSITION_IDS not in inputs) or "seqlens_k" in inputs,
        rope_layout=INTERLEAVED if interleaved else HALF)


def check_matches(io: GraphIO, cfg: ModelConfig, source: str) -> None:
    """The graph's fixed dimensions against the source's config: one line naming the first that differs."""
    for what, got, want in (("layers", io.num_layers, cfg.num_hidden_layers),
                            ("KV heads", io.kv_heads, cfg.num_key_value_heads),
                            ("head dim", io.head_dim, cfg.head_dim), ("vocabulary", io.vocab, cfg.vocab_size)):
        if got is not None and got != want:
            raise ValueError(f"{io.path} has {got} {what} but {source} has {want}; pass the model it was exported from")


def foreign_lm(session: Any, io: GraphIO, cfg: ModelConfig) -> Any:
    """An OnnxLM over the graph's own names, one row at a time where the graph cannot take left padding."""
    lm = OnnxLM(session, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                past=io.past_name, present=io.present_name)
    return RowByRow(lm) if io.row_by_row else lm


class _Padded(StepOutput):
    """Per-row steps seen as one padded batch: presents put back left-padded (zeros where the mask is 0)."""

    def __init__(self, logits: np.ndarray, rows: list[StepOutput], total: int):
        super().__init__(logits, [r.cache for r in rows])
        self._rows, self._total = rows, total

    @property
    def presents(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._host is None:
            out = []
            for layer in range(len(self._rows[0].presents)):
                pair = []
                for w in range(2):
                    first = self._rows[0].presents[layer][w]
                    full = np.zeros((len(self._rows), first.shape[1], self._total, first.shape[3]), first.dtype)
                    for r, row in enumerate(self._rows):
                        t = row.presents[layer][w]  # [1, kv_heads, its own length, n6]
                        full[r, :, self._total - t.shape[2]:] = t[0]
                    pair.append(full)  # [batch, kv_heads, total, n6], left-padded
                out.append((pair[0], pair[1]))
            self._host = out
        return self._host


class RowByRow:
    """Runs a left-padded batch through a graph one row at a time, each row without its padding."""

    def __init__(self, lm: OnnxLM):
        self.lm = lm

    def empty_cache(self, batch: int) -> list[Any]:
        return [self.lm.empty_cache(1) for _ in range(batch)]

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                 past: list[Any]) -> StepOutput:
        n = input_ids.shape[1]
        rows = []
        for r in range(input_ids.shape[0]):
            keep = attention_mask[r, -n:].astype(bool)  # this row's real tokens among the new ones
            own = np.ones((1, int(attention_mask[r].sum())), np.int64)  # [1, its past + its new tokens]
            rows.append(self.lm(input_ids[r:r + 1, keep], own, position_ids[r:r + 1, keep], past[r]))
        vocab = rows[0].logits.shape[-1]
        logits = np.zeros((len(rows), n, vocab), rows[0].logits.dtype)  # [batch, n, vocab], padding left as 0
        for r, o in enumerate(rows):
            logits[r, n - o.logits.shape[1]:] = o.logits[0]
        return _Padded(logits, rows, attention_mask.shape[1])
