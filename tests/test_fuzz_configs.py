"""A fuzz run of the config readers (issue 21): real config.json and params.json files, mutated.

Bases: HF config.json files as `convert` writes them (config_to_hf) for the presets and for tiny variants of every
family with its own fields (Gemma 2/3's sliding pattern with and without layer_types, Qwen3, Mixtral), and Meta
params.json files (meta_params). Mutations, exhaustive over every field of every base: set to 0, -1, 1, 2^31,
2^63, 2^64, 10^30, to its bound (config.SIZE_LIMITS) and one past it, to each wrong JSON type, deleted; the text cut
at every JSON token; and, at random (hypothesis), several of these at once.
Properties, on every generated file:
- load_config returns a ModelConfig or raises ValueError naming the file in one line: no other exception, within
  the deadline and a bounded traced peak (tracemalloc), whatever a number says;
- what it returns is within every bound and counts (count_params, analytic) to the closed form written out by hand
  (test_bounded.closed_form, the q/k and sandwich norms of the families that have them included);
- a foreign config (the transformers fallback) is refused before anything is built exactly when a number is past
  the bounds the module tree may be built to, by a table written here.
A handful run through `count-params`: exit 0, or exit 1 with one stderr line naming the file; nothing written.
LLAMA_TOOLS_FUZZ_EXAMPLES sets the number of random examples (default 150; a benchmark runs more).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_tools.counting.accounting import count_params
from llama_tools.cli import cli
from llama_tools.modeling.config import INT64_MAX, SIZE_LIMITS, ModelConfig
from llama_tools.checkpoints.config_files import config_to_hf, load_config, size_limit
from llama_tools.checkpoints.convert import meta_params
from llama_tools.modeling.presets import get_preset
from llama_tools.counting.transformers_count import check_tree_sizes
from test_bounded import closed_form
from test_hostile import assert_one_line

EXAMPLES = int(os.environ.get("LLAMA_TOOLS_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CLI_FUZZ = settings(FUZZ, max_examples=max(5, EXAMPLES // 15), deadline=10000)
NUMBERS = [0, -1, 1, 3, 2**31, 2**63, 2**64, 10**30]
WRONG = [None, True, 1.5, 64.0, "7", "", [], {}, [1], {"a": 1}, float("inf"), float("nan")]
MEMORY = 16 * 2**20  # traced peak of reading and counting one config: a few kB of JSON
SECONDS = 2.0
TINY = get_preset("tiny")
SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA = dict(hidden_act="gelu_tanh", norm_plus_one=True, embed_scale=True, sandwich_norms=True,
              query_pre_attn_scalar=16.0, tie_word_embeddings=True, sliding_window=32, layer_types=(SLIDING, FULL))
FAMILY_VARIANTS = {
    "gemma2": TINY.replace(family="gemma2", attn_logit_softcap=50.0, final_logit_softcap=30.0, **_GEMMA),
    "gemma3": TINY.replace(family="gemma3", qk_norm=True, rope_local_theta=10000.0, **_GEMMA),
    "qwen3": TINY.replace(family="qwen3", qk_norm=True),
    "mixtral": TINY.replace(family="mixtral", num_experts=4, num_experts_per_tok=2),
}


def _hf(cfg: ModelConfig, **changes: Any) -> dict[str, Any]:
    d = config_to_hf(cfg)
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


HF_BASES: dict[str, dict[str, Any]] = {
    **{name: _hf(get_preset(name)) for name in ("tiny", "llama-3.1-405b", "mixtral-8x7b", "qwen2-7b", "baichuan2-13b")},
    **{name: _hf(cfg) for name, cfg in FAMILY_VARIANTS.items()},
    # Gemma 3's pattern from sliding_window_pattern (no layer_types): the list built per layer from the count
    "gemma3-pattern": _hf(FAMILY_VARIANTS["gemma3"], layer_types=None, sliding_window_pattern=2),
    "llama3-scaled": _hf(get_preset("llama-3-8b"), rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 8192}),
}
META_BASES = {"tiny": meta_params(TINY), "llama-2-70b": meta_params(get_preset("llama-2-70b"))}
# Keys a base may lack that a hostile file adds.
EXTRA_KEYS = ("num_local_experts", "num_experts_per_tok", "layer_types", "sliding_window", "head_dim",
              "rope_scaling", "use_sliding_window", "sliding_window_pattern", "model_max_length", "rope_parameters")


def values_for(key: str) -> list[Any]:
    """What a field is set to: odd numbers, its bound and one past it, every wrong JSON type."""
    limit = size_limit(key)
    return NUMBERS + ([limit, limit + 1] if limit < INT64_MAX else []) + WRONG


def mutations(base: dict[str, Any], extra: tuple[str, ...] = EXTRA_KEYS) -> list[tuple[str, dict[str, Any]]]:
    """(what, config) for every field of base (and each of `extra`) set to each of values_for, or deleted."""
    out = []
    for key in list(base) + [k for k in extra if k not in base]:
        for v in values_for(key):
            out.append((f"{key} = {v!r}", {**base, key: v}))
        if key in base:
            out.append((f"{key} deleted", {k: x for k, x in base.items() if k != key}))
        if isinstance(base.get(key), dict):  # one level down: rope_scaling's factors and lengths
            for sub in base[key]:
                for v in values_for(sub):
                    out.append((f"{key}.{sub} = {v!r}", {**base, key: {**base[key], sub: v}}))
    return out


def cuts(text: str) -> list[int]:
    """Every JSON token boundary of text: before and after each bracket, comma, colon and quote."""
    return sorted({i + d for i, c in enumerate(text) if c in '{}[],:"' for d in (0, 1)} - {len(text)})


def expected_total(cfg: ModelConfig) -> int:
    """The parameter count by hand: test_bounded's closed form (the q/k-norm and sandwich-norm gains included)."""
    return closed_form(cfg)


def check_config(path: Path) -> str:
    """load_config(path): a one-line ValueError naming the file, or a config within bounds that counts by hand;
    either within SECONDS and MEMORY (traced peak)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            cfg = load_config(path)
            total = count_params(cfg).total
        except ValueError as e:
            cfg, msg = None, str(e)
            assert str(path) in msg and "\n" not in msg, msg
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    took = time.perf_counter() - start
    assert peak < MEMORY and took < SECONDS, f"{path.read_text()[:200]}: {peak:,} bytes, {took:.2f} s"
    if cfg is None:
        return "refused"
    assert total == expected_total(cfg), path.read_text()[:300]
    limits = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "head_dim": cfg.head_dim,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "num_hidden_layers": cfg.num_hidden_layers, "num_local_experts": cfg.num_experts,
              "num_experts_per_tok": cfg.num_experts_per_tok,
              "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": cfg.sliding_window or 0}
    for field, v in limits.items():
        assert v <= SIZE_LIMITS[field], f"{field} {v:,} read from {path.read_text()[:200]}"
    return "read"


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(HF_BASES))
def test_every_field_of_a_real_config_json_at_every_odd_value(name, tmp_path):
    path = tmp_path / "config.json"
    seen: dict[str, int] = {}
    for what, data in mutations(HF_BASES[name]):
        r = check_config(_write(path, data))
        seen[r] = seen.get(r, 0) + 1
    assert seen["refused"] > 200 and seen["read"] > 20, seen  # both answers really happen


@pytest.mark.parametrize("name", sorted(META_BASES))
def test_every_field_of_a_real_params_json_at_every_odd_value(name, tmp_path):
    path = tmp_path / "params.json"
    seen: dict[str, int] = {}
    for what, data in mutations(META_BASES[name], extra=("n_kv_heads", "ffn_dim_multiplier", "use_scaled_rope")):
        if "dim" not in data:  # load_config tells params.json by its `dim`; without it the file is an HF config
            continue
        r = check_config(_write(path, data))
        seen[r] = seen.get(r, 0) + 1
    assert seen["refused"] > 100 and seen["read"] > 10, seen


@pytest.mark.parametrize("name", ["tiny", "mixtral", "gemma3-pattern", "llama3-scaled"])
def test_a_config_cut_at_any_json_token_is_refused_in_one_line(name, tmp_path):
    path = tmp_path / "config.json"
    text = json.dumps(HF_BASES[name])
    for cut in cuts(text):
        assert check_config(_write(path, text[:cut])) == "refused", f"cut at {cut}: {text[:cut][-40:]!r}"


def test_negative_the_intact_bases_are_read_and_count_by_hand(tmp_path):
    """Every base is accepted and counts to the hand formula (so refusals above are about the mutation), and the
    formula itself is not vacuous: a config one expert bigger counts 3 n2 e7 + n2 more per decoder."""
    for name, data in HF_BASES.items():
        assert check_config(_write(tmp_path / f"{name}.json", data)) == "read", name
    for name, data in META_BASES.items():
        assert check_config(_write(tmp_path / f"{name}.params.json", data)) == "read", name
    moe = FAMILY_VARIANTS["mixtral"]
    more = moe.replace(num_experts=5)
    assert expected_total(more) - expected_total(moe) == 2 * (3 * 64 * 176 + 64)  # 2 decoders, n2 64, e7 176


@FUZZ
@given(st.data())
def test_several_mutations_of_a_real_config_at_once(data):
    base = HF_BASES[data.draw(st.sampled_from(sorted(HF_BASES)), label="base")]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        base = data.draw(st.sampled_from(mutations(base)), label="mutation")[1]
    with tempfile.TemporaryDirectory() as d:
        check_config(_write(Path(d) / "config.json", base))


# --- The transformers fallback: refused before anything is built, by a table written here -------------------

QWEN2_MOE = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=512, hidden_size=64,
                 intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0,
                 text_config={"num_hidden_layers": 2, "vocab_size": 512})
# The bound each field of QWEN2_MOE is held to, by hand: 4,096 layers and experts, 65,536 heads, 2^40 else; and
# layers x (experts + 1) at most 32,768 expert blocks.
TREE_BOUND = {"num_hidden_layers": 2**12, "num_experts": 2**12, "num_experts_per_tok": 2**12,
              "num_attention_heads": 2**16, "num_key_value_heads": 2**16}


def tree_refuses(data: dict[str, Any]) -> bool:
    """Whether the table above says the module tree may not be built for data."""
    ints = [(k, v) for k, v in data.items() if type(v) is int] + [
        (k, v) for k, v in data.get("text_config", {}).items() if type(v) is int]
    if any(abs(v) > TREE_BOUND.get(k, 2**40) for k, v in ints):
        return True
    if any(v < 0 and k in TREE_BOUND for k, v in ints):  # a negative count of layers, experts or heads
        return True
    layers = max(v for k, v in ints if k == "num_hidden_layers")
    experts = max(v for k, v in ints if k.startswith("num_experts"))
    return layers * (experts + 1) > 2**15


@FUZZ
@given(st.data())
def test_a_foreign_config_is_refused_exactly_past_the_bounds_of_the_tree(data):
    cfg = dict(QWEN2_MOE)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        key = data.draw(st.sampled_from([k for k, v in QWEN2_MOE.items() if type(v) is int] + ["text_config"]),
                        label="key")
        value = data.draw(st.sampled_from(NUMBERS + [2**12, 2**12 + 1, 2**15 // 3, 2**16, 2**16 + 1, 2**40 + 1]),
                          label="value")
        if key == "text_config":
            cfg["text_config"] = {**cfg["text_config"], "num_hidden_layers": value}
        else:
            cfg[key] = value
    try:
        check_tree_sizes(cfg, "config.json")
        refused = False
    except ValueError as e:
        assert str(e).startswith("config.json: ") and "\n" not in str(e)
        refused = True
    assert refused == tree_refuses(cfg), cfg


def test_negative_the_tree_bounds_pass_real_sizes():
    """DeepSeek-V3's 61 x 256 and a small qwen2_moe are let through; one expert block more than allowed is not."""
    check_tree_sizes({**QWEN2_MOE, "num_hidden_layers": 61, "num_experts": 256}, "c.json")
    check_tree_sizes(QWEN2_MOE, "c.json")
    with pytest.raises(ValueError, match="expert blocks"):
        check_tree_sizes({**QWEN2_MOE, "num_hidden_layers": 8, "num_experts": 2**12}, "c.json")


# --- The CLI on a few of them: one line, exit 1, nothing written --------------------------------------------------

@CLI_FUZZ
@given(st.data())
def test_count_params_on_a_mutated_config_is_a_count_or_one_line(data):
    name = data.draw(st.sampled_from(["tiny", "mixtral", "gemma3-pattern", "llama-3.1-405b"]), label="base")
    what, cfg = data.draw(st.sampled_from(mutations(HF_BASES[name], extra=("num_local_experts", "layer_types"))),
                          label="mutation")
    if cfg.get("architectures") != HF_BASES[name].get("architectures") or cfg.get("model_type") != HF_BASES[name].get(
            "model_type"):
        return  # another architecture goes to transformers' module tree: its own tests
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d) / "config.json", cfg)
        r = CliRunner().invoke(cli, ["count-params", str(path)])
        if r.exit_code != 0:
            assert_one_line(r, "config.json")
        assert [p.name for p in Path(d).iterdir()] == ["config.json"]
        assert path.read_text() == json.dumps(cfg)
