"""The shape report against the tensors a real forward pass produces, captured with hooks.

Truth here is what `Llama` actually computes: forward hooks on its modules, a wrapper around the
hooks on the q_rope / k_rope modules, and a TorchFunctionMode that sees the softmax, matmuls, repeats and cats
inside attention and the FFN. Each capture is filed under the paper's symbol; the report must list
exactly those activations with exactly those shapes (per-head tensors as one block times a count).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.overrides import TorchFunctionMode

from llama_tools.cli import cli
from llama_tools.presets import PAPER_MODELS, get_preset
from llama_tools.model import build_model
from llama_tools.reports.regenerate import GENERATED, generated_names, regenerate
from llama_tools import dtypes
from llama_tools.reports.shapes import shape_report, to_frame

GQA = get_preset("tiny")  # 4 query heads over 2 KV heads
MHA = GQA.replace(name="tiny-mha", num_key_value_heads=4)
ALIBI = MHA.replace(name="tiny-alibi", family="baichuan", position_encoding="alibi")
MOE = GQA.replace(name="tiny-moe", family="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48)
B, N3 = 2, 7

Captured = dict[tuple[int | None, str], tuple[tuple[int, ...], int]]  # (layer, symbol) -> (shape, count)


# --- capturing a forward pass ---------------------------------------------------------------------

class CallRecorder(TorchFunctionMode):
    """Records (function name, arguments, output) of torch calls made inside a labelled module."""

    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int, str] | None = None
        self.calls: dict[tuple[int, str], list[tuple[str, tuple, object]]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.where is not None:
            self.calls[self.where].append((getattr(func, "__name__", str(func)), args, out))
        return out

    def named(self, where: tuple[int, str], *names: str) -> list[tuple[str, tuple, object]]:
        return [c for c in self.calls[where] if c[0] in names]


def shape(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    return tuple(t.shape), 1


def heads(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """[b, heads, rows, cols] -> one block [b, rows, cols] and the number of heads."""
    assert t.dim() == 4, f"expected [b, heads, rows, cols], got {tuple(t.shape)}"
    return (t.shape[0], t.shape[2], t.shape[3]), t.shape[1]


def capture(model, input_ids: torch.Tensor, past=None) -> Captured:
    """Run one forward pass and file every intermediate tensor's shape under the paper's symbol."""
    cfg = model.cfg
    got: Captured = {}
    rec = CallRecorder()
    handles = []
    rope_io: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    experts: dict[int, dict[str, list[tuple[int, ...]]]] = defaultdict(lambda: defaultdict(list))

    def put(layer, symbol, value):
        assert (layer, symbol) not in got, f"captured {symbol} of layer {layer} twice"
        got[(layer, symbol)] = value

    def hook(module, fn, pre=False):
        handles.append(module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn))

    def label(module, where):
        hook(module, lambda m, a: setattr(rec, "where", where), pre=True)
        hook(module, lambda m, a, o: setattr(rec, "where", None))

    hook(model.model.embed_tokens, lambda m, a, o: put(None, "Z^{0}", shape(o)))
    hook(model.model.norm, lambda m, a: put(None, f"Z^{{{cfg.num_hidden_layers}}}", shape(a[0])), pre=True)
    hook(model.model.norm, lambda m, a, o: put(None, f"Zbar^{{{cfg.num_hidden_layers}}}", shape(o)))
    for j, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def layer_in(m, a, j=j):
            z, bias, position_ids = a[0], a[1], a[2]
            put(j, f"Z^{{{j}}}", shape(z))
            if j == 0:  # built once by Llama.forward, shared by every layer
                put(None, "M", shape(bias))
                put(None, "t", shape(position_ids))
        hook(layer, layer_in, pre=True)
        hook(layer, lambda m, a, o, j=j: put(j, f"Z^{{{j + 1}}}", shape(o[0])))
        hook(layer.input_layernorm, lambda m, a, o, j=j: put(j, f"Zbar^{{{j}}}", shape(o)))
        for proj, sym in ((attn.q_proj, "Q"), (attn.k_proj, "K"), (attn.v_proj, "V")):
            hook(proj, lambda m, a, o, j=j, sym=sym: put(j, f"{sym}^{{{j}}}", shape(o)))
        hook(attn.o_proj, lambda m, a, j=j: put(j, f"U^{{{j}}}", shape(a[0])), pre=True)
        hook(attn.o_proj, lambda m, a, o, j=j: put(j, f"R^{{{j}}}", shape(o)))
        hook(layer.post_attention_layernorm, lambda m, a, j=j: put(j, f"Y^{{{j}}}", shape(a[0])), pre=True)
        hook(layer.post_attention_layernorm, lambda m, a, o, j=j: put(j, f"Ybar^{{{j}}}", shape(o)))
        label(attn, (j, "attn"))

        def rope_done(m, a, o, j=j):
            rec.where = (j, "attn")
            rope_io[j].append((a[0], o))

        for rope_module in (attn.q_rope, attn.k_rope):
            # rope's own cat/stack is not attention's: record only its input and output
            hook(rope_module, lambda m, a: setattr(rec, "where", None), pre=True)
            hook(rope_module, rope_done)
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
            hook(mlp.down_proj, lambda m, a, j=j, k=f"silu({g})⊗{u}": put(j, k, shape(a[0])), pre=True)
            hook(mlp, lambda m, a, o, j=j: put(j, f"Yhat^{{{j}}}", shape(o)))
    try:
        with rec, torch.no_grad():
            out = model(input_ids, past_key_values=past)
    finally:
        for h in handles:
            h.remove()
    put(None, "t^", shape(input_ids))
    put(None, "H", shape(out.logits))

    rope = cfg.position_encoding == "rope"
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
            (q_in, q_out), (k_in, k_out) = rope_io[j]
            put(j, f"Q^{{{j},i}}", heads(q_in))
            put(j, f"K^{{{j},i}}", heads(k_in))
            put(j, f"Qbar^{{{j},i}}", heads(q_out))
            put(j, f"Kbar^{{{j},i}}", heads(k_out))
        else:
            assert not rope_io[j], "ALiBi models must not call rope"
            put(j, f"Q^{{{j},i}}", heads(matmuls[0][1][0]))  # no rotation: the blocks enter QK^T as they are
            put(j, f"K^{{{j},i}}", heads(k_new))
        put(j, f"V^{{{j},i}}", heads(v_new))
        qs, ks = (f"Qbar^{{{j},i}}", f"Kbar^{{{j},i}}") if rope else (f"Q^{{{j},i}}", f"K^{{{j},i}}")
        for name, t in zip((f"repeat({ks})", f"repeat(V^{{{j},i}})"),
                           [c[2] for c in rec.named((j, "attn"), "repeat_interleave")]):
            put(j, name, heads(t))
        (_, sm_args, probs), = rec.named((j, "attn"), "softmax")
        score = f"{qs}{ks}T/sqrt(n6)+M"
        put(j, score, heads(sm_args[0]))
        put(j, f"smax({score})", heads(probs))
        put(j, f"U^{{{j},i}}", heads(matmuls[1][2]))
        if cfg.is_moe:
            (_, _, top), = rec.named((j, "ffn"), "topk")
            put(j, f"topk(smax(Ybar^{{{j}}}G^{{{j}T}}))", shape(top.values))
            for sym, shapes in experts[j].items():
                assert len(set(shapes)) == 1, f"experts of layer {j} disagree on {sym}: {shapes}"
                put(j, sym, (shapes[0], len(shapes)))
        else:
            (_, _, act), = rec.named((j, "ffn"), "silu")
            put(j, f"silu(Ybar^{{{j}}}W^{{{j}5T}})", shape(act))
    return got


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


def forward_shapes(cfg, batch=B, n3=N3, past_len=0, seed=0) -> Captured:
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    past = None
    if past_len:
        with torch.no_grad():
            past = model(torch.randint(0, cfg.vocab_size, (batch, past_len), generator=gen)).past_key_values
    return capture(model, torch.randint(0, cfg.vocab_size, (batch, n3), generator=gen), past)


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
    code = ("import sys; from llama_tools.reports.shapes import shape_report; from llama_tools.presets import get_preset; "
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
