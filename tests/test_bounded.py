"""Work bounded whatever one number says: count-params and report shapes on stacks of 10^5..10^6 decoders.

Truth: the full per-layer table (`weight_specs`, what the old per-layer loop summed) on every preset, and
a closed form of the parameter count written out here from the paper's terms (section 10) plus what the
formula leaves out. Memory bounds are checked with tracemalloc, never with a clock.
"""

from __future__ import annotations

import csv
import io
import json
import sysconfig
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_tools.counting.accounting import count_params, layer_rows, long_rows, paper_formula
from llama_tools.cli import cli
from llama_tools.modeling.config import ModelConfig
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.modeling.presets import PRESETS, get_preset
from llama_tools.modeling.weights import weight_specs
from llama_tools.reports import shapes
from llama_tools.reports.regenerate import generated_names, regenerate
from llama_tools.reports.shapes import row_count, shape_report, weight_rows

MILLION = 10**6


def closed_form(cfg: ModelConfig) -> int:
    """Parameters written out: n8 decoders of (attention + biases + FFN + 2 norms, Gemma 2/3's two more, the q/k
    norms of Qwen3 and Gemma 3, OLMo 2's over the whole projection), D, the final norm, W^8."""
    n1, n2, n7, n8 = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = 2 * q * n2 + 2 * kv * n2  # W^{j1}, W^{j4} (q x n2) and W^{j2}, W^{j3} (kv x n2)
    biases = (q + 2 * kv if cfg.qkv_bias else 0) + (n2 if cfg.o_bias else 0)
    if cfg.num_experts:
        e7 = cfg.moe_intermediate_size
        ffn = cfg.num_experts * n2 + cfg.num_experts * 3 * n2 * e7  # router + experts
    elif cfg.gated_mlp:
        ffn = 3 * n2 * n7 + (2 * n7 + n2 if cfg.mlp_bias else 0)
    else:  # GPT-NeoX, Falcon: up and down, no gate
        ffn = 2 * n2 * n7 + (n7 + n2 if cfg.mlp_bias else 0)
    qk = (q + kv if cfg.qk_norm_whole else 2 * cfg.head_dim) if cfg.qk_norm else 0  # OLMo 2's over the projection
    per_norm = 2 * n2 if cfg.norm_kind == "layer" else n2  # LayerNorm: γ and β
    norms = per_norm * ((1 if cfg.shared_norm else 2) + (2 if cfg.sandwich_norms else 0)) + qk  # Falcon-7B: one
    decoder = attention + biases + ffn + norms
    return n8 * decoder + n1 * n2 + per_norm + (0 if cfg.tie_word_embeddings else n1 * n2)


def full_table_count(cfg: ModelConfig) -> tuple[int, list[int]]:
    """The old way: the whole per-layer table, each layer's sum filtered out of it."""
    specs = weight_specs(cfg)
    per_layer = [sum(s.numel for s in specs if s.layer == j) for j in range(cfg.num_hidden_layers)]
    return sum(s.numel for s in specs), per_layer


def peak_bytes(f) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = f()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


DEEP = ["llama-7b", "llama-2-70b", "mixtral-8x7b", "qwen2-7b", "baichuan-13b"]


# --- count-params --------------------------------------------------------------------------------------------

def test_the_closed_form_is_the_papers_formula_plus_what_it_leaves_out():
    cfg = get_preset("llama-7b")
    n1, n2, n7, n8 = 32000, 4096, 11008, 32
    assert closed_form(cfg) == paper_formula(n1, n2, n7, n8) + n1 * n2 + (2 * n8 + 1) * n2 == 6_738_415_616


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_counts_as_the_full_per_layer_table(name):
    cfg = PRESETS[name]
    total, per_layer = full_table_count(cfg)
    c = count_params(cfg)
    assert c.total == total == closed_form(cfg)
    assert [lay.total for lay in c.layers] == per_layer
    assert [lay.layer for lay in c.layers] == list(range(cfg.num_hidden_layers))


def test_a_tied_config_and_a_changed_width_count_right():
    tied = get_preset("tiny").replace(tie_word_embeddings=True, num_hidden_layers=MILLION)
    assert count_params(tied).total == closed_form(tied)
    # Negative: the closed form sees a one-unit change in n7 (2 x 3 n2 per decoder... times a million).
    wider = tied.replace(intermediate_size=177)
    assert count_params(wider).total - count_params(tied).total == MILLION * 3 * 64


@pytest.mark.parametrize("name", DEEP)
def test_a_million_decoders_count_exactly_in_constant_memory(name):
    cfg = get_preset(name).replace(num_hidden_layers=MILLION)
    c, peak = peak_bytes(lambda: count_params(cfg))
    assert c.total == closed_form(cfg)
    assert c.paper_formula + sum(i.params for i in c.left_out) == c.total
    assert {i.name: i.params for i in c.left_out}["RMSNorm gains"] == (2 * MILLION + 1) * cfg.hidden_size
    assert [(g.first, g.last, g.count) for g in c.layer_groups] == [(0, MILLION - 1, MILLION)]
    assert [r["layers"] for r in layer_rows(c)] == ["0-999999"]
    assert len(long_rows([c])) == len(long_rows([count_params(get_preset(name))]))
    assert peak < 2 * 2**20, f"{peak:,} bytes to count {name} at 10^6 decoders"


def test_negative_the_per_layer_list_is_what_costs_memory():
    """tracemalloc does see O(n8) work: every layer's row of 3 x 10^4 decoders is over the 2 MB bound above."""
    c = count_params(get_preset("tiny").replace(num_hidden_layers=30_000))
    layers, peak = peak_bytes(lambda: c.layers)
    assert len(layers) == 30_000 and peak > 2 * 2**20


def test_cli_counts_a_million_layer_config_json(tmp_path):
    cfg = get_preset("llama-2-70b").replace(num_hidden_layers=MILLION)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_hf(cfg)))
    r = CliRunner().invoke(cli, ["count-params", str(path), "--per-layer"])
    assert r.exit_code == 0, r.output
    assert f"{closed_form(cfg):,}" in r.output and "0-999999" in r.output
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(r.output)))
    assert [(x["item"], int(x["value"])) for x in rows if x["section"] == "layer"] == [
        ("0-999999", (closed_form(cfg) - 2 * 32000 * 8192 - 8192) // MILLION)]
    data = json.loads(CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"]).output)
    assert data[0]["total"] == closed_form(cfg) and len(data[0]["layer_groups"]) == 1


# --- report shapes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_row_count_and_first_layer_weights_match_the_built_report(name):
    cfg = PRESETS[name]
    for layers in ("all", "first"):
        for only in ("all", "weights", "activations"):
            assert row_count(cfg, 8, 2, 3, layers, only) == len(shape_report(cfg, 8, 2, 3, None, layers, only).rows)
    # --layers first builds decoder 0 from a one-decoder copy: the same rows the full table gives.
    assert weight_rows(cfg, "first") == [w for w in weight_rows(cfg) if w.layer in (None, 0)]


def test_a_deep_stack_is_refused_in_one_line_before_anything_is_built():
    cfg = get_preset("llama-7b").replace(num_hidden_layers=10**5)

    def refused() -> str:
        with pytest.raises(ValueError) as e:
            shape_report(cfg, 128)
        return str(e.value)

    msg, peak = peak_bytes(refused)
    assert "\n" not in msg and "--layers first" in msg and f"{10 + 34 * 10**5:,} rows" in msg  # by hand, below
    assert peak < 2 * 2**20
    first, peak = peak_bytes(lambda: shape_report(cfg, 128, layers="first"))
    assert len(first.rows) == 44 and peak < 4 * 2**20
    assert [r.symbol for r in first.rows if r.module == "model.norm.weight"] == ["γ^{100000}"]


def test_rows_by_hand_for_llama_7b():
    """10 rows outside the stack (D, final norm, W^8; ids, positions, M, Z^0, Z^n8, Zbar^n8, H) and 34 per decoder
    (9 weights; 25 activations with RoPE and MHA, no past)."""
    rep = shape_report(get_preset("llama-7b"), 128)
    assert sum(r.layer is None for r in rep.rows) == 10
    assert sum(r.layer == 0 and r.kind == "weight" for r in rep.rows) == 9
    assert sum(r.layer == 0 and r.kind == "activation" for r in rep.rows) == 25


def test_the_limit_is_exact(monkeypatch):
    cfg = get_preset("tiny")
    n = row_count(cfg, 4)
    monkeypatch.setattr(shapes, "MAX_ROWS", n)
    assert len(shape_report(cfg, 4).rows) == n
    monkeypatch.setattr(shapes, "MAX_ROWS", n - 1)  # negative: one row over
    with pytest.raises(ValueError, match=f"gives {n:,} rows"):
        shape_report(cfg, 4)


def test_cli_report_shapes_on_a_deep_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_hf(get_preset("llama-7b").replace(num_hidden_layers=10**5))))
    r = CliRunner().invoke(cli, ["report", "shapes", str(path)])
    assert r.exit_code == 1 and "--layers first" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["report", "shapes", str(path), "--layers", "first", "--format", "csv"])
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 1 + 44


# --- report regenerate ---------------------------------------------------------------------------------------

def test_regenerate_writes_into_the_current_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    written = regenerate()
    assert [p.name for p in written] == generated_names()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(generated_names())  # no temp left


@pytest.mark.parametrize("where", ["fake", "real"])
def test_regenerate_refuses_site_packages(tmp_path, where):
    target = (tmp_path / "lib" / "python3.11" / "site-packages" / "reports" / "generated" if where == "fake"
              else Path(sysconfig.get_paths()["purelib"]) / "reports" / "generated")
    existed = target.exists()
    with pytest.raises(ValueError, match=r"inside the installed packages .*pass --out DIR"):
        regenerate(target)
    assert target.exists() == existed
    # Negative: a directory merely named like a package is fine.
    assert regenerate(tmp_path / "reports" / "generated")[0].is_file()
