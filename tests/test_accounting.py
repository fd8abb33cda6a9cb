"""Parameter accounting against independent truth: the paper's printed figures, published checkpoint
totals, hand-computed terms, and `numel` of the real module built on the meta device."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llama_tools.counting.accounting import PAPER_FIGURES, count_params, paper_formula
from llama_tools.cli import cli
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.modeling.presets import PAPER_MODELS, PRESETS, get_preset
from helpers import write_sparse_safetensors

# Section 10 of the paper, digits as printed ("66 070 7376", "128 5160 9600", ...).
PAPER_PRINTED = {"llama-7b": 6_607_077_376, "llama-13b": 12_851_609_600,
                 "baichuan-7b": 6_738_149_376, "baichuan-13b": 13_015_449_600}

# Totals of the released checkpoints: the sum of the tensors their safetensors/bin files hold (model
# cards, the HF API's safetensors total, or an index's total_size over the bytes per element; LLaMA-2's
# HF files also hold 64 fp32 rotary_emb.inv_freq values per layer, which are not parameters).
PUBLISHED = {
    "llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192, "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704, "qwen2-7b": 7_615_616_512, "baichuan-7b": 7_000_559_616,
    "baichuan-13b": 13_264_901_120, "yi-34b": 34_388_917_248, "deepseek-67b": 67_425_001_472,
    "internlm2-20b": 19_861_149_696,  # published for internlm2.5-20b, the same architecture
}


def test_paper_formula_reproduces_the_printed_figures():
    for name, printed in PAPER_PRINTED.items():
        fig = PAPER_FIGURES[name]
        assert fig.params == printed
        # The formula written out longhand, on the constants the paper states for each model.
        n1, n2, n7, n8 = fig.n1, fig.n2, fig.n7, fig.n8
        assert 4 * n2 * n2 * n8 + 3 * n2 * n7 * n8 + n1 * n2 == printed == paper_formula(n1, n2, n7, n8)


def test_formula_on_the_real_configs_and_where_baichuan_13b_differs():
    for name in ("llama-7b", "llama-13b", "baichuan-7b"):
        assert count_params(get_preset(name)).paper_formula == PAPER_PRINTED[name]
    c = count_params(get_preset("baichuan-13b"))
    assert c.n7 == 13696 and PAPER_FIGURES["baichuan-13b"].n7 == 13824
    assert c.paper_formula == 40 * (4 * 5120**2 + 3 * 5120 * 13696) + 64000 * 5120 != PAPER_PRINTED["baichuan-13b"]
    assert any("13824" in n for n in c.notes)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_exact_totals_match_the_released_checkpoints(name):
    assert count_params(get_preset(name)).total == PUBLISHED[name]


def test_left_out_terms_by_hand_for_llama_7b_and_llama_2_70b():
    c = count_params(get_preset("llama-7b"))
    terms = {i.name: i.params for i in c.left_out}
    assert terms["second n1 x n2 matrix"] == 32000 * 4096
    assert terms["RMSNorm gains"] == (2 * 32 + 1) * 4096
    assert terms["attention shapes"] == 0
    assert c.total - c.paper_formula == 32000 * 4096 + 65 * 4096
    g = count_params(get_preset("llama-2-70b"))  # GQA: K and V have 8 x 128 rows, not 8192
    terms = {i.name: i.params for i in g.left_out}
    assert terms["attention shapes"] == -2 * 80 * 8192 * (8192 - 8 * 128)
    assert g.paper_formula + sum(terms.values()) == g.total


def test_tied_embeddings_are_counted_once():
    cfg = get_preset("tiny").replace(name="tied", tie_word_embeddings=True)
    untied = count_params(get_preset("tiny"))
    tied = count_params(cfg)
    assert untied.total - tied.total == 512 * 64
    assert tied.component("lm_head") == 0 and tied.component("embedding") == 512 * 64
    assert {i.name: i.params for i in tied.left_out}["second n1 x n2 matrix"] == 0
    # The one matrix still multiplies every token as lm_head: all weights but the 5 norm gains.
    assert tied.flops_per_token == 2 * (tied.total - 5 * 64)


def test_kv_cache_flops_and_memory_by_hand():
    g = count_params(get_preset("llama-2-70b"), context=4096, batch=3)
    fp16 = next(m for m in g.memory if m.dtype == "float16")
    assert fp16.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads of 128, 2 bytes
    assert fp16.kv_bytes_context == 327_680 * 4096 * 3
    assert fp16.weight_bytes == 2 * g.total
    assert next(m for m in g.memory if m.dtype == "int4").weight_bytes == g.total // 2
    # Every matrix but the embedding lookup, one multiply-add (2 FLOPs) per weight per token.
    assert g.flops_per_token == 2 * (g.total - 32000 * 8192 - (2 * 80 + 1) * 8192)
    assert g.attention_flops_per_token == 2 * 2 * 80 * 8192 * 4096  # QK^T and PV against 4096 keys


def test_moe_active_parameters():
    c = count_params(get_preset("mixtral-8x7b"))
    per_expert = 3 * 4096 * 14336
    assert c.total - c.active_per_token == 32 * (8 - 2) * per_expert
    assert round(c.active_per_token / 1e9, 1) == 12.9  # Mistral's published "12.9B active"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counts_equal_numel_of_the_module_on_the_meta_device(name):
    torch = pytest.importorskip("torch")
    from llama_tools.modeling.model import build_model
    from llama_tools.modeling.weights import weight_specs

    cfg = PRESETS[name]
    model = build_model(cfg, device="meta")
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    assert all(p.device == torch.device("meta") for p in params.values())
    c = count_params(cfg)
    assert sum(p.numel() for p in params.values()) == c.total
    for spec in weight_specs(cfg):
        assert tuple(params[spec.name].shape) == spec.shape, spec.name
    assert sum(lay.total for lay in c.layers) == c.total - c.component("embedding") - c.component(
        "final_norm") - c.component("lm_head")


def test_negative_a_wrong_size_is_caught():
    """The meta-device check can fail: one FFN width off by one changes the total."""
    a, b = count_params(get_preset("tiny")), count_params(get_preset("tiny").replace(intermediate_size=177))
    assert b.total - a.total == 2 * 3 * 64


# --- CLI --------------------------------------------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_cli_no_arguments_shows_the_paper_four():
    r = run("count-params")
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0]
    assert all(m in header for m in PAPER_MODELS)
    assert "6,738,415,616" in r.output and "6,607,077,376" in r.output and "13,015,449,600" in r.output


def test_cli_json_csv_markdown():
    r = run("count-params", "llama-2-70b", "tiny", "--format", "json", "--context", "1024")
    data = json.loads(r.output)
    assert [d["model"] for d in data] == ["llama-2-70b", "tiny"]
    assert data[0]["total"] == PUBLISHED["llama-2-70b"] and data[0]["context"] == 1024
    assert data[0]["paper_formula"] + sum(i["params"] for i in data[0]["left_out"]) == data[0]["total"]
    rows = list(csv.DictReader(io.StringIO(run("count-params", "tiny", "--format", "csv").output)))
    assert {r_["item"]: int(r_["value"]) for r_ in rows if r_["section"] == "params"}["total"] == 158_016
    md = run("count-params", "tiny", "--format", "markdown").output
    assert md.startswith("| section") and "|---" in md.replace(" ", "")


def test_cli_per_layer_folds_identical_layers():
    r = run("count-params", "llama-2-7b", "--per-layer")
    assert r.exit_code == 0
    assert "0-31" in r.output


def test_cli_config_json(tmp_path):
    cfg = get_preset("qwen2-7b")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    r = run("count-params", str(tmp_path / "config.json"), "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)[0]["total"] == PUBLISHED["qwen2-7b"]


def test_cli_checkpoint_headers(tmp_path):
    cfg = get_preset("llama-2-70b")
    write_sparse_safetensors(cfg, tmp_path, shards=3)  # real headers, data holes: 138 GB apparent
    r = run("count-params", str(tmp_path), "--format", "json", "--check")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)[0]
    assert data["total"] == PUBLISHED["llama-2-70b"]
    assert data["checkpoint"]["total_params"] == PUBLISHED["llama-2-70b"]
    assert data["checkpoint"]["by_dtype"][0]["dtype"] == "bfloat16"
    table = run("count-params", str(tmp_path)).output
    assert "matches config" in table


def test_cli_checkpoint_that_differs_from_its_config(tmp_path):
    cfg = get_preset("tiny")
    write_sparse_safetensors(cfg, tmp_path, shards=1)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["intermediate_size"] = 160  # the files hold 176-wide FFNs
    (tmp_path / "config.json").write_text(json.dumps(hf))
    # Misshapen tensors fail without --check: the file cannot be the model its config describes.
    r = run("count-params", str(tmp_path))
    assert r.exit_code == 1 and "DIFFERS" in r.output and "mlp.gate_proj" in r.output
    assert "has shape [176, 64], its config predicts [160, 64]" in r.output
    r = run("count-params", str(tmp_path), "--check")
    assert r.exit_code == 1


@pytest.mark.parametrize("args, needle", [
    (("no-such-model",), "Known presets"),
    (("tiny", "--context", "0"), "--context"),
])
def test_cli_errors_are_one_line(args, needle, tmp_path):
    r = run("count-params", *args)
    assert r.exit_code != 0
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_cli_bad_config_json_names_the_field(tmp_path):
    bad = config_to_hf(get_preset("tiny"))
    bad["num_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(bad))
    r = run("count-params", str(tmp_path / "config.json"))
    assert r.exit_code == 1 and "num_key_value_heads 3" in r.output and "Traceback" not in r.output


def test_count_params_imports_neither_torch_nor_pandas(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(get_preset("llama-2-7b"))))
    probe = ("import sys; from llama_tools.cli import cli; "
             "sys.argv = ['llama-tools', 'count-params', 'llama-2-7b', sys.argv[1], '--format', 'json']\n"
             "try: cli()\nexcept SystemExit as e: assert e.code in (0, None), e.code\n"
             "heavy = [m for m in ('torch', 'pandas', 'numpy') if m in sys.modules]\n"
             "assert not heavy, heavy")
    p = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "config.json")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)[0]["total"] == PUBLISHED["llama-2-7b"]


def test_replace_derives_head_dim_and_kv_heads_again():
    """A 150M config made from tiny must not keep tiny's n6 = 64 / 4."""
    c = get_preset("tiny").replace(hidden_size=768, num_attention_heads=12, num_key_value_heads=12)
    assert (c.head_dim, c.q_size) == (64, 768)
    mha = get_preset("llama-7b").replace(num_attention_heads=16)  # kv heads were n5 by default: follow n5
    assert (mha.head_dim, mha.num_key_value_heads) == (256, 16)
    explicit = get_preset("llama-7b").replace(head_dim=32, num_attention_heads=64)
    assert explicit.replace(hidden_size=2048).head_dim == 32  # not n2 / n5 (64): given, kept
    # A function of the values alone: equal configs give equal copies, however they were made.
    assert get_preset("llama-7b").replace(head_dim=128) == get_preset("llama-7b")
    assert (get_preset("llama-7b").replace(head_dim=128).replace(hidden_size=2048)
            == get_preset("llama-7b").replace(hidden_size=2048))
    assert count_params(c).component("attn.q") == 2 * 768 * 768


def test_table_says_tied_in_the_lm_head_row():
    """Tied: the lm_head row says so (and the total counts D once); untied: it holds n1 x n2."""
    from llama_tools.counting.accounting import count_params, summary_rows
    from llama_tools.modeling.presets import get_preset

    cfg = get_preset("tiny")
    for tied in (True, False):
        c = count_params(cfg.replace(tie_word_embeddings=tied))
        row = next(r for r in summary_rows([c]) if r["quantity"] == "lm_head")
        want = "tied: the embedding (0 more)" if tied else f"{cfg.vocab_size * cfg.hidden_size:,}"
        assert row[c.model] == want and c.tied is tied
    untied, tied_ = (count_params(cfg.replace(tie_word_embeddings=t)).total for t in (False, True))
    assert untied - tied_ == cfg.vocab_size * cfg.hidden_size
