"""The shape report against the tensors a real forward pass produces, captured with hooks.

Truth here is what `Llama` actually computes: forward hooks on its modules, a wrapper around the
hooks on the q_rope / k_rope modules, and a TorchFunctionMode that sees the softmax, matmuls, repeats and cats
inside attention and the FFN, the embedding scale and the soft caps. Each capture is filed under the paper's
symbol, named from what ran (which activation, whether a tanh capped the scores, whether a layer's mask hides
keys past a window, which tensor each norm reads); the report must list exactly those activations with exactly
those shapes (per-head tensors as one block times a count). The families' tiny configs are test_families' own.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.overrides import TorchFunctionMode

from llama_tools.cli import cli
from llama_tools.checkpoints.config_files import config_from_hf
from llama_tools.modeling.presets import PAPER_MODELS, get_preset
from llama_tools.modeling.model import build_model
from llama_tools.reports.regenerate import GENERATED, generated_names, regenerate
from llama_tools.modeling import dtypes
from llama_tools.reports.shapes import row_count, shape_report, to_frame

GQA = get_preset("tiny")  # 4 query heads over 2 KV heads
MHA = GQA.replace(name="tiny-mha", num_key_value_heads=4)
ALIBI = MHA.replace(name="tiny-alibi", family="baichuan", position_encoding="alibi")
MOE = GQA.replace(name="tiny-moe", family="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48)
B, N3 = 2, 7  # N3 > test_families' window of 5: the sliding masks hide keys

Captured = dict[tuple[int | None, str], tuple[tuple[int, ...], int]]  # (layer, symbol) -> (shape, count)
DIV, MUL, ADD = ("__truediv__", "div"), ("__mul__", "mul"), ("__add__", "add")  # an operator's names as recorded
Facts = dict[tuple[int | None, str], float]  # (layer, what) -> a number the pass used (window, rope base, caps, ...)


def family_config(name: str, **sizes):
    """test_families' tiny config of `name` (qwen3, gemma, gemma2, gemma3), read from transformers' config class."""
    transformers = pytest.importorskip("transformers")
    from test_families import CASES, SIZES

    config_cls, _, extra = CASES[name]
    hf = getattr(transformers, config_cls)(**{**SIZES, **sizes}, **extra)
    return config_from_hf(hf.to_dict(), f"{name}/config.json")


# --- capturing a forward pass ---------------------------------------------------------------------

class CallRecorder(TorchFunctionMode):
    """Records (function name, arguments, output, keyword arguments) of torch calls made inside a labelled region."""

    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int | None, str] | None = None
        self.calls: dict[tuple[int | None, str], list[tuple[str, tuple, object, dict]]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.where is not None:
            self.calls[self.where].append((getattr(func, "__name__", str(func)), args, out, kwargs or {}))
        return out

    def named(self, where: tuple[int | None, str], *names: str) -> list[tuple[str, tuple, object, dict]]:
        return [c for c in self.calls[where] if c[0] in names]

    def applied(self, where: tuple[int | None, str], names: tuple[str, ...], to: torch.Tensor) -> tuple[object, object]:
        """The one call of `names` on tensor `to` (by identity): (its other argument, its output)."""
        found = [c for c in self.named(where, *names) if c[1][0] is to]
        assert len(found) == 1, f"{where}: {len(found)} calls of {names} on the tensor"
        return (found[0][1][1] if len(found[0][1]) > 1 else None), found[0][2]


def shape(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    return tuple(t.shape), 1


def heads(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """[b, heads, rows, cols] -> one block [b, rows, cols] and the number of heads."""
    assert t.dim() == 4, f"expected [b, heads, rows, cols], got {tuple(t.shape)}"
    return (t.shape[0], t.shape[2], t.shape[3]), t.shape[1]


def heads_last(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """[b, rows, heads, cols] (q/k before the transpose) -> one block [b, rows, cols] and the number of heads."""
    assert t.dim() == 4, f"expected [b, rows, heads, cols], got {tuple(t.shape)}"
    return (t.shape[0], t.shape[1], t.shape[3]), t.shape[2]


def window_of(bias: torch.Tensor) -> int | None:
    """Keys the last query may see under mask `bias`; None when it sees every position (a plain causal mask).

    A window no shorter than the keys hides nothing, so the family tests run past it (N3 = 7 keys, window 5).
    """
    seen = int((bias[0, 0, -1] > torch.finfo(bias.dtype).min).sum())
    return None if seen == bias.shape[-1] else seen


def rope_base(tables: tuple[torch.Tensor, torch.Tensor], n6: int) -> tuple[float, float]:
    """(base, linear factor) a cos/sin table pair rotates with, read off position 1: θ̄_t = base^(-t/n6) / factor."""
    freq = torch.atan2(tables[1][1, :2].double(), tables[0][1, :2].double())  # θ̄_0, θ̄_2
    return float((freq[1] / freq[0]) ** (-n6 / 2)), float(1 / freq[0])


def capture(model, input_ids: torch.Tensor, past=None, facts: Facts | None = None) -> Captured:
    """Run one forward pass and file every intermediate tensor's shape under the paper's symbol.

    facts, when given, receives the numbers the pass used: each layer's window (0: none), its rope base and
    factor, the score divisor's square, the caps and the embedding scale.
    """
    cfg = model.cfg
    n8 = cfg.num_hidden_layers
    got: Captured = {}
    facts = {} if facts is None else facts
    rec = CallRecorder()
    handles = []
    rope_io: dict[int, list[tuple[torch.Tensor, torch.Tensor, tuple]]] = defaultdict(list)
    experts: dict[int, dict[str, list[tuple[int, ...]]]] = defaultdict(lambda: defaultdict(list))
    seen: dict[tuple[int | None, str], object] = {}  # tensors kept for the identity checks after the pass
    norms: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = defaultdict(list)  # (name, in, out)

    def put(layer, symbol, value):
        assert (layer, symbol) not in got, f"captured {symbol} of layer {layer} twice"
        got[(layer, symbol)] = value

    def keep(layer, what, value):
        seen[(layer, what)] = value

    def hook(module, fn, pre=False):
        def quiet(*args):
            fn(*args)  # a hook's return value would replace the module's input or output
        handles.append(module.register_forward_pre_hook(quiet) if pre else module.register_forward_hook(quiet))

    def label(module, where):
        hook(module, lambda m, a: setattr(rec, "where", where), pre=True)
        hook(module, lambda m, a, o: setattr(rec, "where", None))

    def embedded(m, a, o):
        keep(None, "embedding", o)
        rec.where = (None, "embed")  # what Backbone.embed does to the rows of D, until decoder 0 starts

    def head_starts(m, a, o):
        keep(None, "Zbar", o)
        rec.where = (None, "head")  # lm_head's product and any soft cap, in Llama.forward

    hook(model.model.embed_tokens, embedded)
    hook(model.model.norm, lambda m, a: put(None, f"Z^{{{n8}}}", shape(a[0])), pre=True)
    hook(model.model.norm, lambda m, a, o: put(None, f"Zbar^{{{n8}}}", shape(o)))
    hook(model.model.norm, head_starts)
    for j, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def layer_in(m, a, j=j):
            z, bias, position_ids = a[0], a[1], a[2]
            put(j, f"Z^{{{j}}}", shape(z))
            keep(j, "Z", z)
            keep(j, "bias", bias)
            if j == 0:  # built once by Llama.forward, shared by every layer
                rec.where = None
                put(None, "t", shape(position_ids))
        hook(layer, layer_in, pre=True)
        hook(layer, lambda m, a, o, j=j: put(j, f"Z^{{{j + 1}}}", shape(o[0])))
        hook(layer.input_layernorm, lambda m, a, o, j=j: put(j, f"Zbar^{{{j}}}", shape(o)))
        for proj, sym in ((attn.q_proj, "Q"), (attn.k_proj, "K"), (attn.v_proj, "V")):
            hook(proj, lambda m, a, o, j=j, sym=sym: put(j, f"{sym}^{{{j}}}", shape(o)))
        for qk in ("q", "k"):
            if hasattr(attn, f"{qk}_norm"):  # the blocks enter the norm, the normalized blocks enter rope
                hook(getattr(attn, f"{qk}_norm"), lambda m, a, o, j=j, qk=qk: (
                    put(j, f"{qk.upper()}^{{{j},i}}", heads_last(a[0])),
                    put(j, f"rnorm({qk.upper()}^{{{j},i}})", heads_last(o))))
        hook(attn.o_proj, lambda m, a, j=j: put(j, f"U^{{{j}}}", shape(a[0])), pre=True)
        hook(attn.o_proj, lambda m, a, o, j=j: (put(j, f"R^{{{j}}}", shape(o)), keep(j, "R", o)))
        for name, child in layer.named_children():
            if name.endswith("layernorm") and name != "input_layernorm":  # filed by what they read, after the pass
                hook(child, lambda m, a, o, j=j, name=name: norms[j].append((name, a[0], o)))
        label(attn, (j, "attn"))

        def rope_done(m, a, o, j=j):
            rec.where = (j, "attn")
            rope_io[j].append((a[0], o, a[2]))

        for rope_module in (attn.q_rope, attn.k_rope):
            # rope's own cat/stack is not attention's: record only its input and output
            hook(rope_module, lambda m, a: setattr(rec, "where", None), pre=True)
            hook(rope_module, rope_done)
        ffn = layer.block_sparse_moe if cfg.is_moe else layer.mlp
        hook(ffn, lambda m, a, o, j=j: (keep(j, "ffn in", a[0]), keep(j, "ffn out", o)))
        if cfg.is_moe:
            moe = layer.block_sparse_moe
            label(moe, (j, "ffn"))
            hook(moe.gate, lambda m, a, o, j=j: put(j, f"Ybar^{{{j}}}G^{{{j}T}}", shape(o)))
            hook(moe, lambda m, a, o, j=j: put(j, f"Yhat^{{{j}}}", shape(o)))
            per_expert = experts[j]
            g, u = f"Ybar^{{{j}}}W^{{{j}5T}}_{{e}}", f"Ybar^{{{j}}}W^{{{j}7T}}_{{e}}"
            for ex in moe.experts:
                hook(ex.gate_proj, lambda m, a, o, d=per_expert, g=g: d[g].append(tuple(o.shape)))
                hook(ex.up_proj, lambda m, a, o, d=per_expert, u=u: d[u].append(tuple(o.shape)))
                hook(ex.down_proj, lambda m, a, d=per_expert, k=f"silu({g})⊗{u}": d[k].append(tuple(a[0].shape)), pre=True)
                hook(ex, lambda m, a, o, d=per_expert, k=f"Yhat^{{{j}}}_{{e}}": d[k].append(tuple(o.shape)))
        else:
            mlp = layer.mlp
            label(mlp, (j, "ffn"))
            g, u = f"Ybar^{{{j}}}W^{{{j}5T}}", f"Ybar^{{{j}}}W^{{{j}7T}}"
            hook(mlp.gate_proj, lambda m, a, o, j=j, g=g: put(j, g, shape(o)))
            hook(mlp.up_proj, lambda m, a, o, j=j, u=u: put(j, u, shape(o)))
            hook(mlp.down_proj, lambda m, a, j=j: keep(j, "product", a[0]), pre=True)
            hook(mlp, lambda m, a, o, j=j: put(j, f"Yhat^{{{j}}}", shape(o)))
    try:
        with rec, torch.no_grad():
            out = model(input_ids, past_key_values=past)
    finally:
        for h in handles:
            h.remove()
    put(None, "t^", shape(input_ids))

    # Z^0: the rows of D, or (Gemma) those rows times a scalar; decoder 0 reads exactly that tensor.
    emb = seen[(None, "embedding")]
    scaled = [c for c in rec.named((None, "embed"), *MUL) if c[1][0] is emb]
    if scaled:
        (_, (_, factor), z0, _), = scaled
        facts[(None, "embed scale")] = float(factor)
        put(None, "D[t^]", shape(emb))
        emb = z0
    assert emb is seen[(0, "Z")], "decoder 0 does not read the embedding"
    put(None, "Z^{0}", shape(emb))
    # H = Zbar W^{8T}, or (Gemma 2) cap tanh(that / cap).
    logits = rec.named((None, "head"), "__matmul__", "matmul")
    (_, (zbar, _), raw, _), = logits
    assert zbar is seen[(None, "Zbar")]
    if rec.named((None, "head"), "tanh"):
        facts[(None, "final cap")] = capped_by(rec, (None, "head"), raw, out.logits)
        put(None, f"Zbar^{{{n8}}}W^{{8T}}", shape(raw))
    else:
        assert raw is out.logits
    put(None, "H", shape(out.logits))

    rope = cfg.position_encoding == "rope"
    masks: dict[str, tuple[int, ...]] = {}
    for j, layer in enumerate(model.model.layers):
        k_cache, v_cache = out.past_key_values[j]
        put(j, f"Kcache^{{{j}}}", shape(k_cache))
        put(j, f"Vcache^{{{j}}}", shape(v_cache))
        matmuls = rec.named((j, "attn"), "__matmul__", "matmul")
        assert len(matmuls) == 2, f"layer {j}: expected QK^T and PV matmuls, saw {len(matmuls)}"
        cats = rec.named((j, "attn"), "cat")
        assert len(cats) == (2 if past else 0), f"layer {j}: {len(cats)} cache concatenations"
        if past:
            (k_past, k_new), (v_past, v_new) = cats[0][1][0], cats[1][1][0]
            put(j, f"Kpast^{{{j}}}", shape(k_past))
            put(j, f"Vpast^{{{j}}}", shape(v_past))
        else:
            k_new, v_new = k_cache, v_cache  # nothing cached: the present cache is this step's K/V
        if rope:
            (q_in, q_out, q_tables), (k_in, k_out, k_tables) = rope_io[j]
            if not hasattr(layer.self_attn, "q_norm"):  # else filed by the q/k norm hooks
                put(j, f"Q^{{{j},i}}", heads(q_in))
                put(j, f"K^{{{j},i}}", heads(k_in))
            put(j, f"Qbar^{{{j},i}}", heads(q_out))
            put(j, f"Kbar^{{{j},i}}", heads(k_out))
            assert q_tables is k_tables
            facts[(j, "rope base")], facts[(j, "rope factor")] = rope_base(q_tables, q_out.shape[-1])
        else:
            assert not rope_io[j], "ALiBi models must not call rope"
            put(j, f"Q^{{{j},i}}", heads(matmuls[0][1][0]))  # no rotation: the blocks enter QK^T as they are
            put(j, f"K^{{{j},i}}", heads(k_new))
        put(j, f"V^{{{j},i}}", heads(v_new))
        qs, ks = (f"Qbar^{{{j},i}}", f"Kbar^{{{j},i}}") if rope else (f"Q^{{{j},i}}", f"K^{{{j},i}}")
        for name, t in zip((f"repeat({ks})", f"repeat(V^{{{j},i}})"),
                           [c[2] for c in rec.named((j, "attn"), "repeat_interleave")]):
            put(j, name, heads(t))
        # The scores: QK^T divided by sqrt(n6) (or Gemma's sqrt(s)), perhaps capped, then the layer's mask added.
        n6 = matmuls[1][2].shape[-1]  # the width of one head's output U^{j,i}
        divisor, scores = rec.applied((j, "attn"), DIV, matmuls[0][2])
        facts[(j, "scale")], facts[(j, "n6")] = divisor ** 2, n6
        score = f"{qs}{ks}T/sqrt({'n6' if divisor == math.sqrt(n6) else 's'})"
        if rec.named((j, "attn"), "tanh"):
            _, capped = rec.applied((j, "attn"), MUL, rec.named((j, "attn"), "tanh")[0][2])
            facts[(j, "attn cap")] = capped_by(rec, (j, "attn"), scores, capped)
            put(j, score, heads(scores))
            score = f"softcap({score})"
            put(j, score, heads(capped))
            scores = capped
        bias = seen[(j, "bias")]
        window = window_of(bias)
        facts[(j, "window")] = window or 0
        mask = "M" if window is None else "M^{sw}"
        assert masks.setdefault(mask, tuple(bias.shape)) == tuple(bias.shape), f"two shapes of {mask}"
        (_, (_, added), _, _), = [c for c in rec.named((j, "attn"), *ADD) if c[1][0] is scores]
        assert added is bias, f"layer {j}: the scores are not added to the layer's mask"
        score = f"{score}+{mask}"
        (_, sm_args, probs, _), = rec.named((j, "attn"), "softmax")
        put(j, score, heads(sm_args[0]))
        put(j, f"smax({score})", heads(probs))
        put(j, f"U^{{{j},i}}", heads(matmuls[1][2]))
        # Each norm after attention is filed by the tensor it reads: R^j, Y^j (the FFN's input next), or Yhat^j.
        for name, x, y in norms[j]:
            if x is seen[(j, "R")]:
                put(j, f"rnorm(R^{{{j}}})", shape(y))
            elif y is seen[(j, "ffn in")]:
                put(j, f"Y^{{{j}}}", shape(x))
                put(j, f"Ybar^{{{j}}}", shape(y))
            elif x is seen[(j, "ffn out")]:
                put(j, f"rnorm(Yhat^{{{j}}})", shape(y))
            else:
                raise AssertionError(f"layer {j}: {name} reads none of R, Y, Yhat")
        if cfg.is_moe:
            (_, _, top, _), = rec.named((j, "ffn"), "topk")
            put(j, f"topk(smax(Ybar^{{{j}}}G^{{{j}T}}))", shape(top.values))
            for sym, shapes in experts[j].items():
                assert len(set(shapes)) == 1, f"experts of layer {j} disagree on {sym}: {shapes}"
                put(j, sym, (shapes[0], len(shapes)))
        else:
            (name, _, act, kw), = rec.named((j, "ffn"), "silu", "gelu")
            op = "gelu_tanh" if (name, kw.get("approximate")) == ("gelu", "tanh") else name
            gate = f"{op}(Ybar^{{{j}}}W^{{{j}5T}})"
            put(j, gate, shape(act))
            put(j, f"{gate}⊗Ybar^{{{j}}}W^{{{j}7T}}", shape(seen[(j, "product")]))
    for mask, shp in masks.items():
        put(None, mask, (shp, 1))
    return got


def capped_by(rec: CallRecorder, where, x: torch.Tensor, capped: torch.Tensor) -> float:
    """The cap c of capped = c tanh(x / c), checked call by call; the value the pass used."""
    cap, inner = rec.applied(where, DIV, x)
    (_, (tanh_in,), tanh_out, _), = rec.named(where, "tanh")
    cap2, result = rec.applied(where, MUL, tanh_out)
    assert tanh_in is inner and result is capped and cap == cap2, f"{where}: not cap tanh(x / cap)"
    return float(cap)


def mismatches(report, got: Captured) -> list[str]:
    """Every way the report's activation rows and the captured tensors disagree (empty: they agree)."""
    rows = {(r.layer, r.symbol): (r.shape, r.count) for r in report.rows if r.kind == "activation"}
    out = []
    for key, (shp, count) in rows.items():
        if key not in got:
            out.append(f"report row {key} was never computed")
        elif got[key] != (shp, count):
            out.append(f"{key}: report {shp} x{count}, forward {got[key][0]} x{got[key][1]}")
    out += [f"forward tensor {key} {got[key]} is missing from the report" for key in got if key not in rows]
    return out


def forward_shapes(cfg, batch=B, n3=N3, past_len=0, seed=0, facts: Facts | None = None) -> Captured:
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    past = None
    if past_len:
        with torch.no_grad():
            past = model(torch.randint(0, cfg.vocab_size, (batch, past_len), generator=gen)).past_key_values
    return capture(model, torch.randint(0, cfg.vocab_size, (batch, n3), generator=gen), past, facts)


# --- activations against the forward pass ---------------------------------------------------------

@pytest.mark.parametrize("cfg", [MHA, GQA], ids=["mha", "gqa"])
def test_activation_rows_match_a_real_forward_pass(cfg):
    got = forward_shapes(cfg)
    report = shape_report(cfg, N3, B)
    assert mismatches(report, got) == []
    # Spot checks against the paper: blocks are n3 x n6 per head, K/V blocks one per KV head.
    rows = {(r.layer, r.symbol): r for r in report.rows}
    q_blk, k_blk = rows[(0, "Q^{0,i}")], rows[(1, "K^{1,i}")]
    assert (q_blk.shape, q_blk.count) == ((B, N3, cfg.head_dim), cfg.num_attention_heads)
    assert (k_blk.shape, k_blk.count) == ((B, N3, cfg.head_dim), cfg.num_key_value_heads)
    assert rows[(None, "H")].shape == (B, N3, cfg.vocab_size)
    assert ((0, "repeat(Kbar^{0,i})") in rows) == (cfg.num_key_value_heads < cfg.num_attention_heads)


def test_kv_cache_rows_match_a_decoding_step():
    past_len, n3 = 3, 4
    got = forward_shapes(GQA, n3=n3, past_len=past_len)
    report = shape_report(GQA, n3, B, past=past_len)
    assert mismatches(report, got) == []
    rows = {(r.layer, r.symbol): r for r in report.rows}
    kv, n6 = GQA.num_key_value_heads, GQA.head_dim
    assert rows[(0, "Kpast^{0}")].shape == (B, kv, past_len, n6)
    assert rows[(0, "Vcache^{0}")].shape == (B, kv, past_len + n3, n6)
    assert rows[(0, "smax(Qbar^{0,i}Kbar^{0,i}T/sqrt(n6)+M)")].shape == (B, n3, past_len + n3)
    assert rows[(None, "M")].shape == (1, 1, n3, past_len + n3)
    assert (0, "Kpast^{0}") not in {(r.layer, r.symbol) for r in shape_report(GQA, n3, B).rows}


def test_alibi_report_has_no_rope_rows_and_matches():
    got = forward_shapes(ALIBI)
    report = shape_report(ALIBI, N3, B)
    assert mismatches(report, got) == []
    assert not [r.symbol for r in report.rows if "bar^{0,i}" in r.symbol or r.module.endswith(".rope")]
    assert {(r.layer, r.symbol): r.shape for r in report.rows}[(None, "M")] == (1, ALIBI.num_attention_heads, N3, N3)


def test_moe_rows_match_a_real_forward_pass():
    got = forward_shapes(MOE)
    report = shape_report(MOE, N3, B)
    assert mismatches(report, got) == []
    rows = {(r.layer, r.symbol): r for r in report.rows}
    assert rows[(0, "Ybar^{0}G^{0T}")].shape == (B * N3, MOE.num_experts)
    expert = rows[(0, "Ybar^{0}W^{05T}_{e}")]
    assert (expert.shape, expert.count) == ((B * N3, MOE.moe_intermediate_size), MOE.num_experts)


def test_a_wrong_config_is_caught():
    got = forward_shapes(GQA)
    wrong = shape_report(GQA.replace(num_key_value_heads=4), N3, B)  # claims MHA for a GQA model
    found = mismatches(wrong, got)
    assert any(m.startswith("(0, 'K^{0}')") for m in found), found
    assert any("repeat(Kbar^{0,i})" in m and "missing from the report" in m for m in found), found
    longer = shape_report(GQA, N3 + 1, B)  # a different n3 changes every activation's shape
    assert len(mismatches(longer, got)) == len([r for r in longer.rows if r.kind == "activation"])
    full = shape_report(GQA, N3, B)
    dropped = dataclasses.replace(full, rows=tuple(r for r in full.rows if r.symbol != "U^{1}"))
    assert mismatches(dropped, got) == ["forward tensor (1, 'U^{1}') ((2, 7, 64), 1) is missing from the report"]


# --- the families' extra steps against the forward pass ----------------------------------------------

_NUMBER = r"([0-9.]+(?:e[+-]?[0-9]+)?)"


def fact_mismatches(report, facts: Facts) -> list[str]:
    """Every number the report's words state that the forward pass used otherwise: each layer's window, rope base
    and scaling, the score scale s, the caps, the embedding scale (a number the report leaves out must not vary)."""
    desc = {(r.layer, r.symbol): r.description for r in report.rows if r.kind == "activation"}
    out: list[str] = []

    def says(key, what, pattern, value):
        m = re.search(pattern, desc.get(key, ""))
        if value is None and m:
            out.append(f"{key}: says {what} {m.group(1)}, the pass used none")
        elif value is not None and not (m and math.isclose(float(m.group(1)), value, rel_tol=1e-5)):
            out.append(f"{key}: says {what} {m.group(1) if m else 'nothing'}, the pass used {value:g}")

    layers = sorted({j for j, _ in facts if j is not None})
    bases = [facts[(j, "rope base")] for j in layers if (j, "rope base") in facts]
    for j in layers:
        score = [k for k in desc if k[0] == j and re.search(r"\+M(\^\{sw\})?$", k[1]) and not k[1].startswith("smax(")]
        says(score[0] if score else None, "window", r"sliding window of ([0-9]+) keys", facts[(j, "window")] or None)
        scaled = [k for k in desc if k[0] == j and "query_pre_attn_scalar" in desc[k]]
        n6 = facts[(j, "n6")]
        says(scaled[0] if scaled else None, "s", r"query_pre_attn_scalar = " + _NUMBER,
             None if math.isclose(facts[(j, "scale")], n6) else facts[(j, "scale")])
        capped = [k for k in desc if k[0] == j and k[1].startswith("softcap(") and "+M" not in k[1]]
        says(capped[0] if capped else None, "cap", r"^scores soft-capped: " + _NUMBER, facts.get((j, "attn cap")))
        qbar = (j, f"Qbar^{{{j},i}}")
        if qbar in desc and "base" in desc[qbar]:
            says(qbar, "rope base", r"base " + _NUMBER, facts[(j, "rope base")])
            factor = facts[(j, "rope factor")]
            says(qbar, "scaling", r"scaling x" + _NUMBER, None if math.isclose(factor, 1, rel_tol=1e-5) else factor)
        elif bases and not all(math.isclose(b, bases[0], rel_tol=1e-5) for b in bases):
            out.append(f"{qbar}: names no rope base, and the layers rotate with {sorted(set(bases))}")
    says((None, "H"), "final cap", r"soft-capped: " + _NUMBER, facts.get((None, "final cap")))
    says((None, "Z^{0}"), "embedding scale", r"sqrt\(n2\) = " + _NUMBER, facts.get((None, "embed scale")))
    return out


# What each family adds to a LLaMA decoder (layer 0 and outside the stack), by hand from families.py's table.
FAMILY_STEPS = {
    "qwen3": {(0, "rnorm(Q^{0,i})"), (0, "rnorm(K^{0,i})")},
    "gemma": {(None, "D[t^]"), (0, "gelu_tanh(Ybar^{0}W^{05T})")},
    "gemma2": {(None, "D[t^]"), (0, "gelu_tanh(Ybar^{0}W^{05T})"), (0, "rnorm(R^{0})"), (0, "rnorm(Yhat^{0})"),
               (None, "M^{sw}"), (0, "softcap(Qbar^{0,i}Kbar^{0,i}T/sqrt(s))"),
               (0, "softcap(Qbar^{0,i}Kbar^{0,i}T/sqrt(s))+M^{sw}"), (1, "softcap(Qbar^{1,i}Kbar^{1,i}T/sqrt(s))+M"),
               (None, "Zbar^{2}W^{8T}")},
    "gemma3": {(None, "D[t^]"), (0, "gelu_tanh(Ybar^{0}W^{05T})"), (0, "rnorm(R^{0})"), (0, "rnorm(Yhat^{0})"),
               (0, "rnorm(Q^{0,i})"), (0, "rnorm(K^{0,i})"), (None, "M^{sw}"),
               (0, "Qbar^{0,i}Kbar^{0,i}T/sqrt(s)+M^{sw}"),
               (1, "Qbar^{1,i}Kbar^{1,i}T/sqrt(s)+M")},
}


@pytest.mark.parametrize("past_len", [0, 3], ids=["prompt", "decode"])
@pytest.mark.parametrize("name", list(FAMILY_STEPS))
def test_family_rows_match_a_real_forward_pass(name, past_len):
    cfg = family_config(name)
    n3 = N3 if not past_len else 4  # past + n3 = 7 keys: past the window of 5 either way
    facts: Facts = {}
    got = forward_shapes(cfg, n3=n3, past_len=past_len, facts=facts)
    report = shape_report(cfg, n3, B, past=past_len)
    assert mismatches(report, got) == []
    assert fact_mismatches(report, facts) == []
    assert FAMILY_STEPS[name] <= set(got)  # the pass did run the family's steps, and the report lists them
    plain = {(r.layer, r.symbol) for r in shape_report(GQA, n3, B, past=past_len).rows}
    assert not FAMILY_STEPS[name] & plain
    rows = {(r.layer, r.symbol): r for r in report.rows}
    if cfg.qk_norm:  # one block per head, as rope reads them
        q, k = rows[(0, "rnorm(Q^{0,i})")], rows[(0, "rnorm(K^{0,i})")]
        assert (q.shape, q.count, k.count) == ((B, n3, cfg.head_dim), cfg.num_attention_heads, cfg.num_key_value_heads)
    if cfg.sandwich_norms:  # γ^{j,o} sits where its activation does, before 6.3's residual
        assert rows[(0, "γ^{0,o}")].section == rows[(0, "rnorm(R^{0})")].section == "6.3"
    for layers in ("all", "first"):  # mixed layers: one mask row per kind, counted before anything is built
        for only in ("all", "weights", "activations"):
            assert row_count(cfg, n3, B, past_len, layers, only) == len(shape_report(cfg, n3, B, past_len, None,
                                                                                     layers, only).rows)


def test_family_weight_rows_match_named_parameters():
    for name in FAMILY_STEPS:
        cfg = family_config(name)
        assert weight_table(shape_report(cfg, 4)) == param_table(build_model(cfg, device="meta")), name


@pytest.mark.parametrize("name, change, expected", [
    ("qwen3", {"qk_norm": False}, ["forward tensor (0, 'rnorm(Q^{0,i})') ((2, 7, 16), 4) is missing from the report"]),
    ("gemma", {"hidden_act": "silu"}, ["report row (0, 'silu(Ybar^{0}W^{05T})') was never computed"]),
    ("gemma", {"embed_scale": False}, ["forward tensor (None, 'D[t^]') ((2, 7, 64), 1) is missing from the report"]),
    ("gemma2", {"sandwich_norms": False}, ["forward tensor (1, 'rnorm(Yhat^{1})') ((2, 7, 64), 1) is missing"]),
    ("gemma2", {"attn_logit_softcap": None}, ["report row (0, 'Qbar^{0,i}Kbar^{0,i}T/sqrt(s)+M^{sw}') was never"]),
    ("gemma2", {"final_logit_softcap": None}, ["forward tensor (None, 'Zbar^{2}W^{8T}') ((2, 7, 256), 1) is missing"]),
    ("gemma2", {"query_pre_attn_scalar": 16.0}, ["report row (0, 'softcap(Qbar^{0,i}Kbar^{0,i}T/sqrt(n6))') was"]),
    # sliding and global swapped: each layer's scores name the other mask
    ("gemma3", {"layer_types": ("full_attention", "sliding_attention")},
     ["report row (0, 'Qbar^{0,i}Kbar^{0,i}T/sqrt(s)+M') was never computed"]),
    ("gemma3", {"sliding_window": None, "layer_types": None}, ["forward tensor (None, 'M^{sw}') ((1, 1, 7, 7), 1) is"]),
])
def test_a_missing_or_wrong_family_step_is_caught(name, change, expected):
    cfg = family_config(name)
    got = forward_shapes(cfg)
    found = mismatches(shape_report(cfg.replace(**change), N3, B), got)
    for e in expected:
        assert any(m.startswith(e) for m in found), (e, found)


def test_a_wrong_shape_or_a_dropped_family_row_is_caught():
    cfg = family_config("gemma3")
    got = forward_shapes(cfg)
    full = shape_report(cfg, N3, B)
    wrong = dataclasses.replace(full, rows=tuple(dataclasses.replace(r, count=cfg.num_attention_heads)
                                                 if r.symbol == "rnorm(K^{1,i})" else r for r in full.rows))
    assert mismatches(wrong, got) == ["(1, 'rnorm(K^{1,i})'): report (2, 7, 16) x4, forward (2, 7, 16) x2"]
    dropped = dataclasses.replace(full, rows=tuple(r for r in full.rows if r.symbol != "rnorm(R^{0})"))
    assert mismatches(dropped, got) == ["forward tensor (0, 'rnorm(R^{0})') ((2, 7, 64), 1) is missing from the report"]


@pytest.mark.parametrize("name, change, expected", [
    ("gemma2", {"sliding_window": 6}, "(0, 'softcap(Qbar^{0,i}Kbar^{0,i}T/sqrt(s))+M^{sw}'): says window 6, the pass"),
    ("gemma2", {"attn_logit_softcap": 2.5}, "(1, 'softcap(Qbar^{1,i}Kbar^{1,i}T/sqrt(s))'): says cap 2.5, the pass used"),
    ("gemma2", {"final_logit_softcap": 30.0}, "(None, 'H'): says final cap 30, the pass used 3"),
    ("gemma2", {"query_pre_attn_scalar": 32.0}, "says s 32, the pass used 24"),
    ("gemma3", {"rope_local_theta": 1000.0}, "(0, 'Qbar^{0,i}'): says rope base 1000, the pass used 100"),
    ("gemma3", {"rope_scaling": None}, "(1, 'Qbar^{1,i}'): says scaling nothing, the pass used 2"),
    ("gemma3", {"rope_local_theta": None}, "(1, 'Qbar^{1,i}'): names no rope base, and the layers rotate with"),
    ("gemma", {"hidden_size": 100, "head_dim": 16}, "(None, 'Z^{0}'): says embedding scale 10, the pass used 8"),
])
def test_a_wrong_number_in_the_words_is_caught(name, change, expected):
    cfg = family_config(name)
    facts: Facts = {}
    forward_shapes(cfg, facts=facts)
    assert fact_mismatches(shape_report(cfg, N3, B), facts) == []
    found = fact_mismatches(shape_report(cfg.replace(**change), N3, B), facts)
    assert any(expected in m for m in found), found


def test_plain_llama_gets_none_of_the_family_rows():
    for cfg in (GQA, MOE, ALIBI):
        rows = shape_report(cfg, N3, B, past=2).rows
        symbols = " ".join(r.symbol for r in rows)
        for step in ("rnorm(", "softcap", "M^{sw}", "D[t^]", "gelu"):
            assert step not in symbols, (cfg.name, step)
        words = " ".join(r.description + " " + r.module for r in rows)
        for step in ("1 + γ", "window", "base", "cap", "feedforward", "q_norm", "global"):
            assert step not in words, (cfg.name, step)
        assert {r.port for r in rows} == {"param", "in", "out", "inside"}
        assert not shape_report(cfg, N3, B).notes


def test_cli_names_the_sliding_and_global_layers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_families import CASES, SIZES

    config_cls, _, extra = CASES["gemma3"]
    getattr(transformers, config_cls)(**{**SIZES, "num_hidden_layers": 4}, **extra).save_pretrained(tmp_path)
    cfg = family_config("gemma3", num_hidden_layers=4)
    facts: Facts = {}
    got = forward_shapes(cfg, facts=facts)
    sliding = [j for j in range(4) if facts[(j, "window")]]
    assert sliding == [0, 2]  # transformers' pattern of 2: every other layer slides
    r = CliRunner().invoke(cli, ["report", "shapes", str(tmp_path), "--seq-len", str(N3), "--batch", str(B),
                                 "--only", "activations", "--format", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    note = ("layers differ in attention: 2 sliding (mask M^{sw}, window 5, local base 100): layers 0, 2; "
            "2 global (mask M, full causal, base 10000 (linear scaling x2)): layers 1, 3")
    assert data["notes"] == [note] and f"note: {note}" in r.stderr
    masks = {row["layer"]: row["symbol"].rsplit("+", 1)[1] for row in data["rows"]
             if row["layer"] is not None and row["symbol"].startswith("Qbar") and "+M" in row["symbol"]}
    assert masks == {j: "M^{sw}" if j in sliding else "M" for j in range(4)}
    assert mismatches(shape_report(cfg, N3, B), got) == []
    r = CliRunner().invoke(cli, ["report", "shapes", str(tmp_path), "--layers", "first", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["notes"][0].endswith(
        "; --layers first shows decoder 0 only, a sliding layer")


# --- weights against named_parameters -------------------------------------------------------------

def param_table(model) -> dict[str, tuple[tuple[int, ...], int]]:
    return {n: (tuple(p.shape), p.numel()) for n, p in model.named_parameters()}


def weight_table(report) -> dict[str, tuple[tuple[int, ...], int]]:
    """Weight rows by name (the report keeps the paper's order: biases after their q/k/v weights)."""
    rows = [r for r in report.rows if r.kind == "weight"]
    table = {r.module: (r.shape, r.numel) for r in rows}
    assert len(table) == len(rows), "a weight is listed twice"
    return table


@pytest.mark.parametrize("cfg", [GQA, MOE, GQA.replace(name="tiny-qwen", family="qwen2", qkv_bias=True,
                                                        tie_word_embeddings=True)], ids=["gqa", "moe", "bias-tied"])
def test_weight_rows_match_named_parameters(cfg):
    model = build_model(cfg, device="meta")
    assert weight_table(shape_report(cfg, 4)) == param_table(model)
    other = weight_table(shape_report(cfg.replace(num_key_value_heads=1), 4))
    diff = {n for n in other if other[n] != param_table(model)[n]}  # the check can fail: K/V rows shrink
    assert diff and all(".k_proj." in n or ".v_proj." in n for n in diff), diff


def test_layers_first_keeps_decoder_zero_only():
    full, first = shape_report(GQA, N3, B), shape_report(GQA, N3, B, layers="first")
    assert {r.layer for r in first.rows} == {None, 0}
    assert [r for r in full.rows if r.layer in (None, 0)] == list(first.rows)


def test_bytes_follow_dtype_and_ids_stay_int64():
    f32 = shape_report(GQA, N3, B, dtype="float32").records()
    f16 = shape_report(GQA, N3, B, dtype="bf16").records()
    for a, b in zip(f32, f16):
        assert a["numel"] == b["numel"]
        if a["symbol"] in ("t^", "t"):
            assert a["bytes"] == b["bytes"] == 8 * a["numel"]
        else:
            assert (a["bytes"], b["bytes"]) == (4 * a["numel"], 2 * a["numel"])
    assert set(dtypes.MODEL_DTYPES) >= {"float32", "float16", "bfloat16"}


def test_paper_typical_sizes_for_llama_7b():
    rows = {(r.layer, r.symbol): r for r in shape_report(get_preset("llama-7b"), 128, 1, layers="first").rows}
    assert rows[(0, "W^{01}")].shape == (4096, 4096)  # "W^{01} ... 典型值 4096×4096"
    assert rows[(0, "W^{05}")].shape == (11008, 4096)
    assert rows[(0, "W^{06}")].shape == (4096, 11008)
    assert (rows[(0, "Qbar^{0,i}")].shape, rows[(0, "Qbar^{0,i}")].count) == ((1, 128, 128), 32)  # n3 x 128
    assert rows[(0, "U^{0}")].shape == (1, 128, 4096)
    assert rows[(None, "H")].shape == (1, 128, 32000)  # n3 x 32000
    assert rows[(None, "W^8")].section == "7" and rows[(0, "Y^{0}")].section == "6.3"


def test_row_builder_needs_neither_torch_nor_pandas():
    code = ("import sys; from llama_tools.reports.shapes import shape_report; from llama_tools.modeling.presets import get_preset; "
            "shape_report(get_preset('llama-13b'), 128).records(); "
            "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- CLI --------------------------------------------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(cli, ["report", *args])


def test_cli_writes_csv_that_pandas_reads_back(tmp_path):
    import pandas as pd

    path = tmp_path / "out" / "tiny.csv"
    res = run("shapes", "tiny", "--seq-len", "7", "--batch", "2", "--past", "3", "--dtype", "float16", "-o", str(path))
    assert res.exit_code == 0, res.output
    df = pd.read_csv(path, keep_default_na=False)
    expected = shape_report(GQA, 7, 2, past=3, dtype="float16")
    assert len(df) == len(expected.rows)
    assert list(df.columns) == list(to_frame(expected).columns)
    for rec, (_, row) in zip(expected.records(), df.iterrows()):
        dims = [int(row[f"d{i}"]) for i in range(4) if row[f"d{i}"] != ""]
        assert "x".join(map(str, dims)) == row["shape"] == rec["shape"]
        assert int(row["bytes"]) == rec["bytes"]
    assert not list(path.parent.glob(".*"))  # the temp file of the atomic write is gone


def test_cli_stdout_formats():
    res = run("shapes", "tiny", "--seq-len", "5", "--format", "json", "--layers", "first")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["seq_len"], data["batch"], data["layers"]) == (5, 1, "first")
    assert data["rows"][0]["symbol"] == "D"
    res = run("shapes", "tiny", "--seq-len", "5")  # no -o, no --format: CSV
    assert res.exit_code == 0
    head = next(csv.reader(io.StringIO(res.output)))
    assert head[:5] == ["order", "kind", "section", "layer", "symbol"]
    res = run("shapes", "tiny", "--seq-len", "5", "--format", "markdown")
    assert res.exit_code == 0 and res.output.startswith("|")
    res = run("shapes", "tiny", "--seq-len", "5", "--only", "weights", "--format", "json")
    kinds = {r["kind"] for r in json.loads(res.output)["rows"]}
    assert res.exit_code == 0 and kinds == {"weight"}
    res = run("shapes", "tiny", "--seq-len", "5", "--only", "activations", "--format", "json")
    assert {r["kind"] for r in json.loads(res.output)["rows"]} == {"activation"}


@pytest.mark.parametrize("args, message", [
    (["shapes", "tiny", "-o", "report.txt"], "cannot tell the format"),
    (["shapes", "tiny", "--dtype", "int4"], "'--dtype': 'int4' is not one of"),
    (["shapes", "tiny", "--batch", "0"], "'--batch': 0 is not in the range x>=1"),
    (["shapes", "tiny", "--seq-len", "300"], "exceeds max_position_embeddings 256"),
    (["shapes", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_cli_errors_are_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(*args)
    assert res.exit_code == 1
    assert message in res.output and res.output.count("\n") == 1, res.output
    assert "Traceback" not in res.output
    assert not list(tmp_path.iterdir())  # nothing written on failure


# --- checked-in reports ----------------------------------------------------------------------------

def test_generated_reports_are_current(tmp_path):
    written = regenerate(tmp_path)
    assert [p.name for p in written] == generated_names()
    stale = [p.name for p in written if not (GENERATED / p.name).is_file()
             or (GENERATED / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"reports/generated is stale ({stale}): run `python -m reports.regenerate`"
    assert sorted(p.name for p in GENERATED.iterdir()) == sorted(generated_names())
    assert [m + ".csv" for m in PAPER_MODELS] == generated_names()[:-1]


def test_cli_regenerate_writes_the_same_files(tmp_path):
    res = run("regenerate", "--out", str(tmp_path), "--format", "json")
    assert res.exit_code == 0, res.output
    files = json.loads(res.output)
    assert [Path(f["file"]).name for f in files] == generated_names()
    assert all(f["bytes"] == Path(f["file"]).stat().st_size > 0 for f in files)
    assert (tmp_path / "llama-7b.csv").read_bytes() == (GENERATED / "llama-7b.csv").read_bytes()
