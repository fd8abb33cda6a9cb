"""The shape report: every weight and every activation of one forward pass, in the paper's order.

Weights come from `llama_tools.weights.weight_specs` (the one name table); activations follow
sections 5-7 of the paper (Z^j, rnorm, Q/K/V and their per-head blocks, rope, scores, softmax,
U, R, Y, the SwiGLU intermediates, Z^{j+1}, the final rnorm and the logits H), with the batch
axis in front and the shapes of `llama_tools.model.Llama`'s tensors. A per-head row
(Q^{j,i}, scores, ...) has the shape of one block and `count` blocks; numel and bytes cover all of them.
No torch and no pandas here: `to_frame` imports pandas when asked.
Every decoder has decoder 0's shapes, so `--layers first` costs the same for any depth; `--layers all`
is refused past MAX_ROWS rows (counted from decoder 0 before anything is built) instead of building GBs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_tools import dtypes
from llama_tools.config import ModelConfig
from llama_tools.weights import WeightSpec, weight_specs

if TYPE_CHECKING:
    from llama_tools.transformers_count import ModuleTree

LAYER_CHOICES = ("all", "first")
ONLY_CHOICES = ("all", "weights", "activations")
MAX_DIMS = 4  # no tensor of the forward pass has more axes
# Rows of one report, at most. llama-3.1-405b (126 decoders) has ~4,300 and a 256-expert MoE of 61 decoders
# ~48,000; 50,000 rows take ~300 MB and seconds to render (benchmarks/bench_count_params.py measures it),
# while 10^5 decoders would take GBs. Deeper stacks: --layers first.
MAX_ROWS = 50_000


@dataclass(frozen=True)
class ShapeRow:
    """One weight or activation: where it lives, what the paper calls it, and its shape."""

    kind: str  # "weight" or "activation"
    section: str  # the paper's section ("6.2", "7", ...)
    layer: int | None  # decoder index j; None outside the stack
    symbol: str  # the paper's symbol (j substituted), or ours where the paper has none
    description: str
    module: str  # weights: parameter name (= HF name); activations: the HF module that produces or reads it
    port: str  # "param", "in" / "out" of `module`, or "inside" (computed within its forward)
    shape: tuple[int, ...]  # of one block where count > 1
    count: int = 1  # number of blocks (heads, experts) of this shape
    meta_name: str | None = None  # Meta checkpoint name (weights only)
    dtype: str | None = None  # None: the report's dtype; token and position ids are int64

    @property
    def numel(self) -> int:
        """Elements of all `count` blocks."""
        return math.prod(self.shape) * self.count


@dataclass(frozen=True)
class ShapeReport:
    """The rows of one model at one sequence length, batch, past length and dtype."""

    model: str
    seq_len: int  # n3
    batch: int
    past: int  # cached positions before this step (0: a prompt pass)
    dtype: str
    layers: str  # "all" or "first"
    rows: tuple[ShapeRow, ...]
    notes: tuple[str, ...] = ()  # what the rows leave out (a foreign architecture's activations)

    @property
    def dtype_bytes(self) -> int:
        return int(dtypes.get(self.dtype).bytes)

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (one dict per tensor, fixed columns) for CSV, Markdown and pandas."""
        out = []
        for order, r in enumerate(self.rows):
            dims = list(r.shape) + [None] * (MAX_DIMS - len(r.shape))
            rec: dict[str, Any] = {
                "order": order, "kind": r.kind, "section": r.section, "layer": r.layer, "symbol": r.symbol,
                "description": r.description, "module": r.module, "port": r.port, "meta_name": r.meta_name,
                "shape": "x".join(map(str, r.shape)), "rank": len(r.shape),
            }
            rec.update({f"d{i}": d for i, d in enumerate(dims)})
            dtype = r.dtype or self.dtype
            rec.update({"count": r.count, "numel": r.numel, "dtype": dtype, "bytes": r.numel * int(dtypes.get(dtype).bytes)})
            out.append(rec)
        return out

    def payload(self) -> dict[str, Any]:
        """The JSON form: the inputs of the report, its notes when it has any, and its rows."""
        return {"model": self.model, "seq_len": self.seq_len, "batch": self.batch, "past": self.past,
                "dtype": self.dtype, "layers": self.layers, **({"notes": list(self.notes)} if self.notes else {}),
                "rows": self.records()}


# --- weights --------------------------------------------------------------------------------------

def _weight_section(spec: WeightSpec) -> str:
    """Where the paper introduces the weight: D in 4, attention in 6.2, FFN in 6.4, W^8 in 7."""
    if spec.component == "embedding":
        return "4"
    if spec.component == "lm_head":
        return "7"
    if spec.component == "final_norm":
        return "6.6"
    if spec.component == "norm":
        return "6.1" if "input_layernorm" in spec.name else "6.4"
    return "6.2" if spec.component.startswith("attn") else "6.4"


def _first_decoder_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """weight_specs(cfg) without decoders 1..n8-1, built from a one-decoder copy (constant time in n8)."""
    n8 = cfg.num_hidden_layers
    specs = weight_specs(cfg.replace(num_hidden_layers=1))
    # The one symbol outside the stack that names n8: the final norm's gain γ^{n8}.
    return [dataclasses.replace(s, symbol=f"γ^{{{n8}}}") if s.component == "final_norm" and s.symbol == "γ^{1}"
            else s for s in specs]


def weight_rows(cfg: ModelConfig, layers: str = "all") -> list[ShapeRow]:
    """One row per parameter, straight from weight_specs (a tied lm_head appears once, as D)."""
    specs = weight_specs(cfg) if layers == "all" else _first_decoder_specs(cfg)
    return [ShapeRow("weight", _weight_section(s), s.layer, s.symbol, f"weight ({s.component})", s.name, "param",
                     s.shape, meta_name=s.meta_name) for s in specs]


# --- activations ----------------------------------------------------------------------------------

def _layer_activations(cfg: ModelConfig, j: int, b: int, n3: int, past: int) -> list[ShapeRow]:
    """Decoder j, 6.1 to 6.4: Z^j -> Z^{j+1}."""
    n2, n5, kv, n6 = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    total = past + n3  # key positions each query sees: cached ones plus this step's
    p = f"model.layers.{j}."
    a = lambda sec, sym, desc, mod, port, shape, count=1: ShapeRow(  # noqa: E731
        "activation", sec, j, sym, desc, mod, port, tuple(shape), count)
    rope = cfg.position_encoding == "rope"
    qs, ks = (f"Qbar^{{{j},i}}", f"Kbar^{{{j},i}}") if rope else (f"Q^{{{j},i}}", f"K^{{{j},i}}")
    score = f"{qs}{ks}T/sqrt(n6)+M"
    rows = [
        a("6.1", f"Z^{{{j}}}", f"decoder {j} input", p.rstrip("."), "in", (b, n3, n2)),
        a("6.1", f"Zbar^{{{j}}}", "rnorm(Z^j)", p + "input_layernorm", "out", (b, n3, n2)),
        a("6.2", f"Q^{{{j}}}", "queries Zbar^j W^{j1T}", p + "self_attn.q_proj", "out", (b, n3, cfg.q_size)),
        a("6.2", f"K^{{{j}}}", "keys Zbar^j W^{j2T}", p + "self_attn.k_proj", "out", (b, n3, cfg.kv_size)),
        a("6.2", f"V^{{{j}}}", "values Zbar^j W^{j3T}", p + "self_attn.v_proj", "out", (b, n3, cfg.kv_size)),
        a("6.2", f"Q^{{{j},i}}", "query block of one head (column split of Q^j)", p + "self_attn", "inside",
          (b, n3, n6), n5),
        a("6.2", f"K^{{{j},i}}", "key block of one KV head", p + "self_attn", "inside", (b, n3, n6), kv),
        a("6.2", f"V^{{{j},i}}", "value block of one KV head", p + "self_attn", "inside", (b, n3, n6), kv),
    ]
    if rope:
        rows += [
            a("6.2", f"Qbar^{{{j},i}}", "rope(Q^{j,i})", p + "self_attn.rope", "out", (b, n3, n6), n5),
            a("6.2", f"Kbar^{{{j},i}}", "rope(K^{j,i})", p + "self_attn.rope", "out", (b, n3, n6), kv),
        ]
    if past:
        rows += [
            a("6.2", f"Kpast^{{{j}}}", "cached keys read (past_key_values)", p + "self_attn", "in", (b, kv, past, n6)),
            a("6.2", f"Vpast^{{{j}}}", "cached values read (past_key_values)", p + "self_attn", "in",
              (b, kv, past, n6)),
        ]
    rows += [
        a("6.2", f"Kcache^{{{j}}}", "present keys (cache after this step)", p + "self_attn", "out",
          (b, kv, total, n6)),
        a("6.2", f"Vcache^{{{j}}}", "present values (cache after this step)", p + "self_attn", "out",
          (b, kv, total, n6)),
    ]
    if cfg.n_rep > 1:
        # Grouped-query attention: each K/V head is repeated for the n_rep query heads that share it.
        rows += [
            a("6.2", f"repeat({ks})", f"keys repeated {cfg.n_rep}x to n5 heads (GQA)", p + "self_attn", "inside",
              (b, total, n6), n5),
            a("6.2", f"repeat(V^{{{j},i}})", f"values repeated {cfg.n_rep}x to n5 heads (GQA)", p + "self_attn",
              "inside", (b, total, n6), n5),
        ]
    rows += [
        a("6.2", score, "attention scores (+ALiBi in M)" if not rope else "attention scores", p + "self_attn",
          "inside", (b, n3, total), n5),
        a("6.2", f"smax({score})", "attention probabilities", p + "self_attn", "inside", (b, n3, total), n5),
        a("6.2", f"U^{{{j},i}}", "smax(...) V^{j,i}: one head's output", p + "self_attn", "inside", (b, n3, n6), n5),
        a("6.2", f"U^{{{j}}}", "[U^{j,0}, ..., U^{j,n5-1}]", p + "self_attn.o_proj", "in", (b, n3, cfg.q_size)),
        a("6.2", f"R^{{{j}}}", "U^j W^{j4T}", p + "self_attn.o_proj", "out", (b, n3, n2)),
        a("6.3", f"Y^{{{j}}}", "Z^j + R^j", p + "post_attention_layernorm", "in", (b, n3, n2)),
        a("6.4", f"Ybar^{{{j}}}", "rnorm(Y^j)", p + "post_attention_layernorm", "out", (b, n3, n2)),
    ]
    rows += _moe_activations(cfg, j, b, n3) if cfg.is_moe else _ffn_activations(cfg, j, b, n3)
    rows.append(a("6.4", f"Z^{{{j + 1}}}", "Y^j + Yhat^j: decoder output", p.rstrip("."), "out", (b, n3, n2)))
    return rows


def _ffn_activations(cfg: ModelConfig, j: int, b: int, n3: int) -> list[ShapeRow]:
    """SwiGLU: Yhat^j = (silu(Ybar W^{j5T}) ⊗ (Ybar W^{j7T})) W^{j6T}."""
    n2, n7, p = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{j}.mlp"
    gate, up = f"Ybar^{{{j}}}W^{{{j}5T}}", f"Ybar^{{{j}}}W^{{{j}7T}}"
    a = lambda sym, desc, mod, port, shape: ShapeRow("activation", "6.4", j, sym, desc, mod, port, shape)  # noqa: E731
    return [
        a(gate, "gate projection", p + ".gate_proj", "out", (b, n3, n7)),
        a(f"silu({gate})", "gate after silu", p, "inside", (b, n3, n7)),
        a(up, "up projection", p + ".up_proj", "out", (b, n3, n7)),
        a(f"silu({gate})⊗{up}", "gated product", p + ".down_proj", "in", (b, n3, n7)),
        a(f"Yhat^{{{j}}}", "(...) W^{j6T}: FFN output", p + ".down_proj", "out", (b, n3, n2)),
    ]


def _moe_activations(cfg: ModelConfig, j: int, b: int, n3: int) -> list[ShapeRow]:
    """Mixtral's sparse FFN as the model runs it: every expert on every token, weighted by the router."""
    n2, e7, ne, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    p, t = f"model.layers.{j}.block_sparse_moe", b * n3  # tokens are flattened: [b n3, n2]
    a = lambda sym, desc, mod, port, shape, count=1: ShapeRow(  # noqa: E731
        "activation", "6.4", j, sym, desc, mod, port, shape, count)
    gate, up = f"Ybar^{{{j}}}W^{{{j}5T}}_{{e}}", f"Ybar^{{{j}}}W^{{{j}7T}}_{{e}}"
    rows = [
        a(f"Ybar^{{{j}}}G^{{{j}T}}", "router logits", p + ".gate", "out", (t, ne)),
        a(f"topk(smax(Ybar^{{{j}}}G^{{{j}T}}))", f"routing weights of the top {k} experts", p, "inside", (t, k)),
    ]
    what, m = "routed expert (run densely here; a sparse kernel sees ~k/E of the rows)", f"{p}.experts.*"
    rows += [
        a(gate, f"{what}: gate projection", m + ".gate_proj", "out", (t, e7), ne),
        a(up, f"{what}: up projection", m + ".up_proj", "out", (t, e7), ne),
        a(f"silu({gate})⊗{up}", f"{what}: gated product", m + ".down_proj", "in", (t, e7), ne),
        a(f"Yhat^{{{j}}}_{{e}}", f"{what}: output", m, "out", (t, n2), ne),
    ]
    rows.append(a(f"Yhat^{{{j}}}", "weighted sum of the expert outputs", p, "out", (b, n3, n2)))
    return rows


def activation_rows(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0,
                    layers: str = "all") -> list[ShapeRow]:
    """Every tensor of one forward pass over `seq_len` new tokens after `past` cached ones."""
    b, n3, n8 = batch, seq_len, cfg.num_hidden_layers
    total = past + n3
    a = lambda sec, sym, desc, mod, port, shape, dtype=None: ShapeRow(  # noqa: E731
        "activation", sec, None, sym, desc, mod, port, shape, dtype=dtype)
    # M is built once per pass and broadcast over the batch; ALiBi adds a per-head slope, hence n5 planes.
    m_heads = cfg.num_attention_heads if cfg.position_encoding == "alibi" else 1
    rows = [
        a("4", "t^", "token ids", "model", "in", (b, n3), "int64"),
        a("4", "t", "position ids", "model", "inside", (b, n3), "int64"),
        a("5", "M", "mask (+ALiBi)" if m_heads > 1 else "causal mask", "model", "inside", (1, m_heads, n3, total)),
        a("6", "Z^{0}", "token embeddings: rows of D", "model.embed_tokens", "out", (b, n3, cfg.hidden_size)),
    ]
    for j in range(n8 if layers == "all" else 1):
        rows += _layer_activations(cfg, j, b, n3, past)
    rows += [
        a("6.5", f"Z^{{{n8}}}", "output of the decoder stack", "model.norm", "in", (b, n3, cfg.hidden_size)),
        a("6.6", f"Zbar^{{{n8}}}", "rnorm(Z^n8): the model's output", "model.norm", "out", (b, n3, cfg.hidden_size)),
        a("7", "H", "logits Zbar^n8 W^{8T}", "lm_head", "out", (b, n3, cfg.vocab_size)),
    ]
    return rows


def shape_report(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0, dtype: str | None = None,
                 layers: str = "all", only: str = "all") -> ShapeReport:
    """Weights then activations of `cfg` for a batch of `batch` sequences of `seq_len` new tokens."""
    dtype = dtypes.model_dtype(dtype).name if dtype else (
        cfg.torch_dtype if dtypes.get(cfg.torch_dtype).float else dtypes.FLOAT32.name)
    for name, v, low in (("seq_len", seq_len, 1), ("batch", batch, 1), ("past", past, 0)):
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if layers not in LAYER_CHOICES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)}, got {layers!r}")
    if only not in ONLY_CHOICES:
        raise ValueError(f"only must be one of {', '.join(ONLY_CHOICES)}, got {only!r}")
    if cfg.position_encoding == "rope" and past + seq_len > cfg.max_position_embeddings:
        # The rope tables stop there; ALiBi has no table to run out of.
        raise ValueError(f"past + seq_len = {past + seq_len} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings} of {cfg.name!r}; use a shorter --seq-len or --past")
    n = row_count(cfg, seq_len, batch, past, layers, only)
    if n > MAX_ROWS:
        raise ValueError(f"{cfg.name}: --layers all gives {n:,} rows for {cfg.num_hidden_layers:,} decoders, over the "
                         f"limit of {MAX_ROWS:,}; pass --layers first (every decoder has decoder 0's shapes)")
    weights = weight_rows(cfg, layers)
    rows = ([] if only == "activations" else weights) + (
        [] if only == "weights" else activation_rows(cfg, seq_len, batch, past, layers))
    return ShapeReport(cfg.name, seq_len, batch, past, dtype, layers, tuple(rows))


def module_tree_report(tree: ModuleTree, seq_len: int, batch: int = 1, past: int = 0, dtype: str | None = None,
                       layers: str = "all", only: str = "all") -> ShapeReport:
    """A foreign architecture's weights from transformers' module tree (transformers_count); no activation rows.

    Each parameter once (a tied lm_head is the embedding's row), with its shape, elements and bytes; the paper's
    symbols and sections do not apply, and its activations are not modelled here: the report's note says so.
    """
    dtype = dtypes.model_dtype(dtype).name if dtype else tree.torch_dtype
    for name, v, low in (("seq_len", seq_len, 1), ("batch", batch, 1), ("past", past, 0)):
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if layers not in LAYER_CHOICES or only not in ONLY_CHOICES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)} and only one of {', '.join(ONLY_CHOICES)}")
    rows = () if only == "activations" else tuple(
        ShapeRow("weight", "", w.layer, "", f"weight ({w.component})", w.name, "param", w.shape)
        for w in tree.weights if layers == "all" or w.layer is None or w.layer == 0)
    if len(rows) > MAX_ROWS:
        raise ValueError(f"{tree.model}: --layers all gives {len(rows):,} rows, over the limit of {MAX_ROWS:,}; pass "
                         f"--layers first")
    notes = [f"{tree.class_name} (model_type {tree.model_type}) is no family llama-tools models: its weights come "
             f"from transformers {tree.transformers_version}'s module tree (no paper symbols); its activations are "
             f"left out"]
    if tree.tied:
        notes.append("lm_head is tied to the embedding: one row, counted once")
    return ShapeReport(tree.model, seq_len, batch, past, dtype, layers, rows, tuple(notes))


def row_count(cfg: ModelConfig, seq_len: int, batch: int = 1, past: int = 0, layers: str = "all",
              only: str = "all") -> int:
    """len(shape_report(...).rows), from decoder 0 alone: constant time and memory in n8."""
    one = cfg.replace(num_hidden_layers=1)
    rows = ([] if only == "activations" else weight_rows(one, "first")) + (
        [] if only == "weights" else activation_rows(one, seq_len, batch, past, "first"))
    per_decoder = sum(r.layer == 0 for r in rows)
    return len(rows) + per_decoder * ((cfg.num_hidden_layers if layers == "all" else 1) - 1)


def to_frame(report: ShapeReport) -> Any:
    """The report as a pandas DataFrame, integer columns kept integer where some rows are empty."""
    import pandas as pd

    df = pd.DataFrame(report.records())
    for col in ["layer"] + [f"d{i}" for i in range(MAX_DIMS)]:
        df[col] = df[col].astype("Int64")
    return df


FORMATS = ("csv", "json", "markdown", "table")
_SUFFIX_FORMATS = {".csv": "csv", ".json": "json", ".md": "markdown", ".markdown": "markdown"}


def infer_format(path: str | None, fmt: str | None) -> str:
    """An explicit --format wins; else the file's suffix decides; else CSV."""
    if fmt:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    if path is None:
        return "csv"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ValueError(f"{path}: cannot tell the format from suffix {suffix!r}; pass --format csv|json|markdown")
    return _SUFFIX_FORMATS[suffix]


def render_report(report: ShapeReport, fmt: str) -> str:
    """The report as text; CSV through pandas, the rest through llama_tools.output.render."""
    if fmt == "csv":
        return to_frame(report).to_csv(index=False, lineterminator="\n")
    from llama_tools.output import render

    return render(report.records(), fmt, json_payload=report.payload()) + "\n"


def write_report(report: ShapeReport, path: str | Path, fmt: str) -> None:
    """Write atomically (a reader never sees half a report); a device or FIFO is written through."""
    from llama_tools.files import check_output_path, write_chunks

    check_output_path(path)  # a directory or /proc path is refused before rendering
    write_chunks(path, [render_report(report, fmt)])
