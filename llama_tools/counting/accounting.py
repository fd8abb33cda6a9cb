"""Exact parameter accounting, the paper's formula beside it, memory, KV cache and FLOPs.

Everything is summed from `weights.weight_specs`, the one table of the model's tensors, so the
count is exactly what `Llama(cfg)` holds (tests check it against `numel` on the meta device).
Every decoder has the same shapes and every routed expert the same as the first, so the stack is
counted as decoder 0 (its expert 0 times the expert count) times n8 (`weights.stack_specs`): time and
memory grow with neither (10^6 layers or 65,536 experts count as fast as 2), and the per-layer list
is built only when asked for (`ParamCount.layers`).
The paper (section 10) counts n8(4 n2^2 + 3 n2 n7) + n1 n2: the trainable W^{j1}..W^{j7} and one
n1 x n2 matrix. What it leaves out (norm gains, the second n1 x n2 matrix, GQA's narrower K/V,
biases, experts) is itemized so that formula + left-out == exact, always.
No torch, no pandas: `count-params` answers from this module in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

from ..modeling import dtypes
from ..modeling.config import ModelConfig
from ..checkpoints.inspection import CheckpointInspection, inspect_checkpoint
from ..checkpoints.source import ModelSource, resolve
from ..modeling.memory import gib, nbytes
from ..modeling.weights import COMPONENTS, stack_specs


@dataclass(frozen=True)
class PaperFigure:
    """A count the paper prints (section 10), with the constants it used."""

    params: int
    n1: int
    n2: int
    n7: int
    n8: int
    note: str = ""

    @property
    def formula(self) -> int:
        return paper_formula(self.n1, self.n2, self.n7, self.n8)


def paper_formula(n1: int, n2: int, n7: int, n8: int) -> int:
    """n8 (4 n2^2 + 3 n2 n7) + n1 n2."""
    return n8 * (4 * n2 * n2 + 3 * n2 * n7) + n1 * n2


# Section 10's figures. Baichuan-13B: "n2..n8 the same as LLaMA-13B", so n7 = 13824, while the
# released checkpoint has n7 = 13696 (and ALiBi); the formula on the real config is shown beside it.
PAPER_FIGURES = {
    "llama-7b": PaperFigure(6_607_077_376, 32000, 4096, 11008, 32),
    "llama-13b": PaperFigure(12_851_609_600, 32000, 5120, 13824, 40),
    "baichuan-7b": PaperFigure(6_738_149_376, 64000, 4096, 11008, 32),
    "baichuan-13b": PaperFigure(13_015_449_600, 64000, 5120, 13824, 40,
                                note="the paper takes n7 = 13824 from LLaMA-13B; the released weights have n7 = 13696"),
}


@dataclass(frozen=True)
class Item:
    """One named count (a component, or a term the paper's formula leaves out)."""

    name: str
    params: int
    note: str = ""


@dataclass(frozen=True)
class LayerCount:
    layer: int
    attention: int  # q, k, v, o and their biases
    ffn: int  # gate, up, down (or router and experts)
    norms: int
    total: int


@dataclass(frozen=True)
class LayerGroup:
    """Decoders first..last, all of one shape: each holds `total` parameters."""

    first: int
    last: int
    attention: int  # per decoder, as in LayerCount
    ffn: int
    norms: int
    total: int

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    @property
    def label(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True)
class MemoryRow:
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int  # K and V of every layer for one token, cache kept in this dtype
    kv_bytes_context: int  # ... for `context` tokens times `batch` sequences


@dataclass(frozen=True)
class ParamCount:
    """Everything `count-params` reports for one config."""

    model: str
    source: str
    n1: int
    n2: int
    n5: int
    n6: int
    n7: int
    n8: int
    num_key_value_heads: int
    attention: str  # MHA | GQA | MQA
    total: int
    components: list[Item]
    layer_groups: list[LayerGroup]  # runs of identical decoders (one run for every config we know)
    paper_formula: int  # the formula on this config's constants
    left_out: list[Item]  # formula + sum(left_out) == total
    paper_stated: PaperFigure | None  # the paper's printed figure, for its four models
    active_per_token: int  # MoE: what one token runs through; = total for dense models
    context: int
    batch: int
    memory: list[MemoryRow]
    flops_per_token: int  # forward, 2 per multiply-add of every weight matrix a token passes (no attention)
    attention_flops_per_token: int  # QK^T and PV for one token against `context` keys
    tied: bool = False  # lm_head W^8 is the embedding D itself (counted once)
    notes: list[str] = field(default_factory=list)
    checkpoint: CheckpointInspection | None = None  # what the files hold, when counted from a directory

    @property
    def formula_gap(self) -> int:
        return self.total - self.paper_formula

    @property
    def non_embedding(self) -> int:
        return self.total - self.component("embedding")

    def component(self, name: str) -> int:
        return next((c.params for c in self.components if c.name == name), 0)

    def iter_layers(self) -> Iterator[LayerCount]:
        """Every decoder's count, one at a time (n8 of them: iterate, do not list, for huge stacks)."""
        for g in self.layer_groups:
            for j in range(g.first, g.last + 1):
                yield LayerCount(j, g.attention, g.ffn, g.norms, g.total)

    @property
    def layers(self) -> list[LayerCount]:
        """Every decoder's count as a list: O(n8) memory, built only when asked."""
        return list(self.iter_layers())


def count_params(cfg: ModelConfig, *, context: int | None = None, batch: int = 1) -> ParamCount:
    """Exact accounting of `cfg`; KV cache and attention FLOPs for `context` tokens (default: the max)."""
    context = cfg.max_position_embeddings if context is None else context
    if context <= 0 or batch <= 0:
        raise ValueError(f"--context and --batch must be positive, got context={context}, batch={batch}")
    n1, n2, n7, n8 = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    stack = stack_specs(cfg)
    # Parameters of each component over the whole model: outside the stack once, decoder 0's n8 times (with its
    # expert 0's `experts` times): no loop over decoders or experts, whatever their number.
    by_component = {c: stack.total(pred=lambda s, c=c: s.component == c) for c in COMPONENTS}
    total = sum(by_component.values())
    components = [Item(c, p) for c, p in by_component.items() if p]

    attn = stack.per_decoder(pred=lambda s: s.component.startswith("attn.") and s.component != "attn.qk_norm")
    norms = stack.per_decoder(pred=lambda s: s.component in ("norm", "attn.qk_norm"))
    ffn = stack.per_decoder(pred=lambda s: s.component.startswith(("mlp.", "moe.")))
    layer_groups = [LayerGroup(0, n8 - 1, attn, ffn, norms, attn + ffn + norms)]

    formula = paper_formula(n1, n2, n7, n8)
    per_layer_norms = sum(1 for s in stack.decoder if s.component == "norm")
    weights_of = lambda *comps: sum(by_component[c] for c in comps)  # noqa: E731
    left_out = [
        Item("second n1 x n2 matrix", 0 if cfg.tie_word_embeddings else n1 * n2,
             "the formula counts one of embedding D and lm_head W^8" if not cfg.tie_word_embeddings
             else "tied: D and W^8 are one matrix"),
        Item("RMSNorm gains" if cfg.norm_kind == "rms" else "LayerNorm gains and biases",
             weights_of("norm", "final_norm", "attn.qk_norm"),
             f"{per_layer_norms} per decoder + the final one, n2 = {n2} each"
             + (f"; q and k norms of n6 = {cfg.head_dim}" if cfg.qk_norm else "")),
        Item("attention shapes", weights_of("attn.q", "attn.k", "attn.v", "attn.o") - 4 * n8 * n2 * n2,
             f"{cfg.attention_kind}: K, V have {cfg.num_key_value_heads} x {cfg.head_dim} rows, not n2"
             if cfg.kv_size != n2 or cfg.q_size != n2 else "4 n2^2 per decoder, as the formula has it"),
        Item("attention biases", weights_of("attn.bias"), "Qwen2-style q/k/v (and o) biases"),
        Item("FFN shape", weights_of("mlp.gate", "mlp.up", "mlp.down", "mlp.bias", "moe.router", "moe.experts")
             - 3 * n8 * n2 * n7,
             f"{cfg.num_experts} experts of {cfg.moe_intermediate_size} + router" if cfg.is_moe
             else ("GELU MLP without a gate: 2 n2 n7 per decoder" + (", plus biases" if cfg.mlp_bias else ""))
             if not cfg.gated_mlp
             else ("FFN biases" if cfg.mlp_bias else "3 n2 n7 per decoder, as the formula has it")),
    ]
    assert formula + sum(i.params for i in left_out) == total, (
        f"{cfg.name}: formula {formula} + left out {[i.params for i in left_out]} != exact {total}")

    inactive = 0
    if cfg.is_moe:
        per_expert = 3 * n2 * cfg.moe_intermediate_size
        inactive = n8 * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    active = total - inactive
    # A token multiplies through every active matrix except the embedding (a lookup); lm_head even when tied.
    matmul = active - weights_of("embedding", "norm", "final_norm", "attn.qk_norm") + (n1 * n2 if cfg.tie_word_embeddings else 0)
    kv_elems_per_token = 2 * n8 * cfg.kv_size
    # Weight bytes per dtype (int4 without the per-group scales real formats add); no int4 KV cache.
    memory = []
    for name in dtypes.MEMORY_DTYPES:
        kv = nbytes(kv_elems_per_token, name) if dtypes.get(name).bytes >= 1 else 0
        memory.append(MemoryRow(name, nbytes(total, name), kv, kv * context * batch))

    notes = []
    stated = PAPER_FIGURES.get(cfg.name)
    if stated and stated.formula != formula:
        notes.append(f"paper's figure {stated.params:,} uses n7 = {stated.n7}; this config has n7 = {n7}, "
                     f"so the formula here gives {formula:,}")
    if cfg.position_encoding == "alibi":
        notes.append("ALiBi: no rotary tables, the position bias has no parameters")
    if cfg.norm_head:
        notes.append("lm_head rows are L2-normalized at inference (NormHead): no extra parameters")
    return ParamCount(
        model=cfg.name, source=cfg.source, n1=n1, n2=n2, n5=cfg.num_attention_heads, n6=cfg.head_dim, n7=n7, n8=n8,
        num_key_value_heads=cfg.num_key_value_heads, attention=cfg.attention_kind, total=total,
        components=components, layer_groups=layer_groups, paper_formula=formula, left_out=left_out, paper_stated=stated,
        active_per_token=active, context=context, batch=batch, memory=memory, flops_per_token=2 * matmul,
        attention_flops_per_token=4 * n8 * cfg.q_size * context, tied=cfg.tie_word_embeddings, notes=notes,
    )


def count_source(source: ModelSource | str, *, context: int | None = None, batch: int = 1) -> ParamCount:
    """A preset, a config.json, or a checkpoint directory (counted from its headers, no data read)."""
    src = resolve(source)
    if src.weights is not None:
        assert src.path is not None, "a checkpoint source has a path"
        insp = inspect_checkpoint(src.path)
        return dataclasses.replace(count_params(insp.cfg, context=context, batch=batch), checkpoint=insp)
    return count_params(src.cfg, context=context, batch=batch)


# --- Flat rows for output.render -------------------------------------------------------------------

def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def summary_rows(counts: list[ParamCount]) -> list[dict[str, object]]:
    """Quantities down, models across: the side-by-side table."""
    def line(section: str, what: str, values: list[object]) -> dict[str, object]:
        return {"section": section, "quantity": what, **{c.model: v for c, v in zip(counts, values)}}

    each = lambda f: [f(c) for c in counts]  # noqa: E731
    rows = [
        line("config", "n1 vocab / n2 width", each(lambda c: f"{c.n1:,} / {c.n2:,}")),
        line("config", "n5 heads / kv heads / n6", each(lambda c: f"{c.n5} / {c.num_key_value_heads} / {c.n6} ({c.attention})")),
        line("config", "n7 FFN / n8 layers", each(lambda c: f"{c.n7:,} / {c.n8}")),
        line("params", "exact total", each(lambda c: f"{c.total:,} ({_human(c.total)})")),
    ]
    if any(c.active_per_token != c.total for c in counts):
        rows.append(line("params", "active per token", each(lambda c: f"{c.active_per_token:,}")))
    rows.append(line("params", "non-embedding", each(lambda c: f"{c.non_embedding:,}")))
    names = [n for n in COMPONENTS if any(c.component(n) for c in counts) or (n == "lm_head" and any(c.tied for c in counts))]
    rows += [line("component", n, each(lambda c, n=n: "tied: the embedding (0 more)" if n == "lm_head" and c.tied
                                       else f"{c.component(n):,}")) for n in names]
    rows.append(line("paper", "n8(4 n2² + 3 n2 n7) + n1 n2", each(lambda c: f"{c.paper_formula:,}")))
    if any(c.paper_stated for c in counts):
        rows.append(line("paper", "figure printed in the paper",
                         each(lambda c: f"{c.paper_stated.params:,}" if c.paper_stated else "")))
    for k, item in enumerate(counts[0].left_out):
        values = each(lambda c, k=k: f"{c.left_out[k].params:+,}" if c.left_out[k].params else "0")
        rows.append(line("left out", item.name, values))
    rows.append(line("left out", "exact - formula", each(lambda c: f"{c.formula_gap:+,} ({c.formula_gap / c.total:+.2%})")))
    for m in range(len(counts[0].memory)):
        rows.append(line("weights", counts[0].memory[m].dtype, each(lambda c, m=m: gib(c.memory[m].weight_bytes))))
    rows.append(line("kv cache", "bytes per token (fp16)", each(lambda c: f"{_kv(c).kv_bytes_per_token:,}")))
    rows.append(line("kv cache", "at context x batch (fp16)",
                     each(lambda c: f"{gib(_kv(c).kv_bytes_context)} ({c.context:,} x {c.batch})")))
    rows.append(line("flops", "forward per token, weights", each(lambda c: f"{_human(c.flops_per_token)}")))
    rows.append(line("flops", "+ attention at context", each(lambda c: f"{_human(c.attention_flops_per_token)}")))
    return rows


def _kv(c: ParamCount) -> MemoryRow:
    return next(m for m in c.memory if m.dtype == dtypes.FLOAT16.name)


def layer_rows(count: ParamCount) -> list[dict[str, object]]:
    """Per decoder, runs of identical layers folded into one row ("0-31")."""
    return [{"model": count.model, "layers": g.label, "attention": g.attention, "ffn": g.ffn, "norms": g.norms,
             "each": g.total} for g in count.layer_groups]


def long_rows(counts: list[ParamCount]) -> list[dict[str, object]]:
    """One number per row (model, section, item, value): for CSV, easy to load into a frame.

    Section "layer" has one row per run of identical decoders: item "0-31", value the count of each.
    """
    rows: list[dict[str, object]] = []
    for c in counts:
        add = lambda section, item, value, c=c: rows.append(  # noqa: E731
            {"model": c.model, "section": section, "item": item, "value": value})
        add("params", "total", c.total)
        add("params", "active_per_token", c.active_per_token)
        for item in c.components:
            add("component", item.name, item.params)
        add("paper", "formula", c.paper_formula)
        if c.paper_stated:
            add("paper", "stated", c.paper_stated.params)
        for item in c.left_out:
            add("left_out", item.name, item.params)
        for m in c.memory:
            add("weight_bytes", m.dtype, m.weight_bytes)
            add("kv_bytes_per_token", m.dtype, m.kv_bytes_per_token)
        add("kv_bytes_context", f"float16 x {c.context} x {c.batch}", _kv(c).kv_bytes_context)
        add("flops", "forward_per_token", c.flops_per_token)
        add("flops", f"attention_per_token_at_{c.context}", c.attention_flops_per_token)
        for g in c.layer_groups:
            add("layer", g.label, g.total)
    return rows
