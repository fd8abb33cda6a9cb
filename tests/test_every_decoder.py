"""Every decoder transformers ships, counted exactly: the native way where a family here models it, else from
transformers' module tree (llama_tools/counting/transformers_count.py).

Truth is transformers' own count, made here independently of the code under test: its default config for each
model type built by `AutoModelForCausalLM.from_config` on the meta device (weight init left on, nothing
allocated), `sum(p.numel() for p in model.parameters())` (a tied lm_head once). The three MoE defaults with
thousands of expert modules (DeepSeek-V3's 671B: 47k Linears) are built as from_pretrained builds a model instead
(init skipped, then the weights tied): the same modules, 4x faster; the miniature DeepSeek-V3 below checks MoE and
MLA against the fully initialized build. The lead adds native families (Qwen3, Gemma...) in parallel: each test
accepts either path and holds it to the same number.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from llama_tools.counting import transformers_count  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.checkpoints.config_files import config_to_hf  # noqa: E402
from llama_tools.modeling.presets import get_preset  # noqa: E402

# Decoders with a CausalLM class in transformers 4.57: dense, MoE (Mixtral, Qwen2/3-MoE, DeepSeek-V3 with MLA),
# parallel attention (Falcon, GPT-NeoX), tied and untied heads, LayerNorm and RMSNorm, q/k norms.
MODEL_TYPES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma", "gemma2",
               "gemma3_text", "phi3", "olmo2", "granite", "starcoder2", "cohere", "stablelm", "deepseek_v3", "smollm3",
               "falcon", "gpt_neox", "exaone4", "glm4", "ernie4_5"]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


# Default configs whose build with init takes 10-20 s on this project's 2-core machine.
BUILT_AS_FROM_PRETRAINED = {"deepseek_v3", "qwen3_moe", "qwen2_moe"}


def hf_count(config, init: bool = True) -> int:
    """transformers' own count: the model built on the meta device as from_config builds it (init and all), or as
    from_pretrained builds it (transformers' no_init_weights, then tie_weights)."""
    from transformers.modeling_utils import no_init_weights

    with torch.device("meta"):
        if init:
            model = AutoModelForCausalLM.from_config(config)
        else:
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(config)
            model.tie_weights()
    return sum(p.numel() for p in model.parameters())


def write_config(directory: Path, model_type: str, **overrides) -> tuple[Path, object]:
    """transformers' default config of model_type (plus overrides) as a config.json naming its CausalLM class."""
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no causal LM of model_type {model_type!r}")
    config = AutoConfig.for_model(model_type, **overrides)
    data = json.loads(config.to_json_string(use_diff=False))
    data["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    path = directory / model_type / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path, config


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_decoder_counts_as_transformers_does(model_type, tmp_path):
    path, config = write_config(tmp_path, model_type)
    truth = hf_count(config, init=model_type not in BUILT_AS_FROM_PRETRAINED)
    r = run("count-params", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)[0]
    assert got["total"] == truth, (model_type, got.get("counted_from", "native"))
    if "counted_from" in got:  # the fallback: its parts add up, and it says they have no formula
        assert sum(c["params"] for c in got["components"]) == truth
        assert "no paper formula" in got["paper_formula"]
    # The shape report runs on it, and its weight rows hold every parameter once (a tied lm_head as the embedding).
    r = run("report", "shapes", str(path), "--only", "weights", "--format", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert rows and all(row["kind"] == "weight" for row in rows)
    assert sum(row["numel"] for row in rows) == truth


def test_a_family_modelled_here_goes_the_native_way_without_transformers(tmp_path):
    """A llama config: the paper's formula beside it, and transformers never imported (cheap, as before)."""
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(get_preset("llama-2-7b"))))
    probe = ("import sys; from llama_tools.cli import cli; "
             "sys.argv = ['llama-tools', 'count-params', sys.argv[1], '--format', 'json']\n"
             "try: cli()\nexcept SystemExit as e: assert e.code in (0, None), e.code\n"
             "assert 'transformers' not in sys.modules and 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "config.json")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)[0]
    assert "counted_from" not in got and got["paper_formula"] > 0 and got["total"] == 6_738_415_616


def small_deepseek(tmp_path: Path) -> tuple[Path, object]:
    """DeepSeek-V3 in miniature: MLA attention, 1 dense decoder then 3 MoE ones (router, 8 routed, 1 shared)."""
    return write_config(tmp_path, "deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96,
                        moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16)


def by_name(config) -> dict[str, int]:
    """Components from the parameter names alone (not the module tree the code walks): an independent split."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ("embedding" if "embed_tokens" in name else "lm_head" if name.startswith("lm_head") else
                "final_norm" if name == "model.norm.weight" else "attention" if ".self_attn." in name else
                "moe.shared_experts" if ".shared_experts." in name else "moe.experts" if ".experts." in name else
                "moe.router" if ".mlp.gate." in name else "mlp" if ".mlp." in name else
                "norms" if "layernorm" in name else "?")
        out[part] = out.get(part, 0) + p.numel()
    return out


def test_moe_and_mla_components_and_per_layer_from_the_module_tree(tmp_path):
    path, config = small_deepseek(tmp_path)
    r = run("count-params", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)[0]
    if "counted_from" not in got:
        pytest.skip("deepseek_v3 is modelled natively now")
    assert {c["name"]: c["params"] for c in got["components"]} == by_name(config)
    assert got["total"] == hf_count(config) == sum(by_name(config).values())
    assert [g["first"] for g in got["layer_groups"]] == [0, 1]  # the dense decoder, then three MoE ones
    assert [g["last"] for g in got["layer_groups"]] == [0, 3]
    table = run("count-params", str(path), "--per-layer")
    assert table.exit_code == 0, table.output
    assert "moe.experts" in table.stdout and "no paper formula" in table.stdout and "per layer" in table.stdout
    for line in ("deepseek_v3  0  ", "deepseek_v3  1-3"):
        assert line in table.stdout, table.stdout
    csv = run("count-params", str(path), "--format", "csv")
    assert f"deepseek_v3,params,total,{got['total']}" in csv.stdout
    md = run("count-params", str(path), "--format", "markdown")
    assert md.exit_code == 0 and "| component " in md.stdout and f"{got['total']:,}" in md.stdout
    # report shapes: one row per parameter, with its shape; activations left out with a note saying so.
    r = run("report", "shapes", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert any("activations are left out" in n for n in rep["notes"]) and "left out" in r.stderr
    with torch.device("meta"):
        shapes = {n: list(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    assert {row["module"]: [row[f"d{i}"] for i in range(row["rank"])] for row in rep["rows"]} == shapes
    first = json.loads(run("report", "shapes", str(path), "--layers", "first", "--format", "json").stdout)["rows"]
    assert {row["layer"] for row in first} == {None, 0}


def test_mixing_native_and_foreign_models_in_one_run(tmp_path):
    path, config = write_config(tmp_path, "starcoder2", num_hidden_layers=2)
    r = run("count-params", "tiny", str(path))
    assert r.exit_code == 0, r.output
    assert "n8(4 n2² + 3 n2 n7) + n1 n2" in r.stdout and "Starcoder2ForCausalLM (starcoder2)" in r.stdout
    data = json.loads(run("count-params", "tiny", str(path), "--format", "json").stdout)
    assert data[0]["model"] == "tiny" and data[1]["total"] == hf_count(config)


def test_without_transformers_the_refusal_is_one_line_with_the_pip_command(tmp_path, monkeypatch):
    path, _ = write_config(tmp_path, "cohere", num_hidden_layers=1)
    transformers_count._tree.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for argv in (["count-params", str(path)], ["report", "shapes", str(path)]):
        r = run(*argv)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
        assert "CohereForCausalLM" in lines[0] and 'pip install "transformers' in lines[0] and str(path) in lines[0]


def test_configs_transformers_cannot_build_are_one_line(tmp_path):
    unknown = tmp_path / "unknown" / "config.json"
    unknown.parent.mkdir()
    unknown.write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "no_such_model"}))
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"architectures": ["StableLmForCausalLM"], "model_type": "stablelm",
                               "hidden_size": "wide"}))
    no_type = tmp_path / "no_type" / "config.json"
    no_type.parent.mkdir()
    no_type.write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    for path, words in ((unknown, ["'no_such_model'", "remote code"]), (bad, ["transformers", "cannot build"]),
                        (no_type, ["unknown architecture"])):
        r = run("count-params", str(path))
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
        assert str(path) in lines[0] and all(w in lines[0] for w in words), lines[0]
