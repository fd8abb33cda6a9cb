"""Partial rotary (Phi-4-mini's partial_rotary_factor): RoPE on the first int(n6 x factor) channels of each q/k head.

Each case is a seeded tiny Phi3ForCausalLM with partial_rotary_factor < 1, saved by transformers' `save_pretrained`,
its weights moved off their initial values (q/k scaled so attention scores are O(1) and RoPE decides them). Truth
is transformers' own code (modeling_phi3.apply_rotary_pos_emb: rotate_half on q[..., :rotary_dim], the rest passed
through; modeling_rope_utils: the frequencies over rotary_dim), never our reading of it:

- our fp32 logits and greedy tokens equal transformers', also with longrope at positions past
  original_max_position_embeddings, where the long factors (rotary_dim / 2 of them) apply;
- the plain and the fused (--optimize) exports pass `verify parity`, default and --by-layer, with its source check
  against transformers; onnxruntime-genai runs both with transformers' greedy tokens;
- `convert --to gguf` writes phi3.rope.dimension_count = rotary_dim (as llama.cpp's converter does), llama.cpp
  itself computes transformers' logits and tokens from it, and our reader reads it back;
- negative cases: the model with whole heads rotating is far off transformers, and a GGUF saying whole heads is far
  off in llama.cpp; a reading that dropped the factor fails verify's source check; out-of-range factors are one line.

Two widths: 8 of 16 channels (our RoPE node in the fused graph: GroupQueryAttention's own rotary needs a rotary
width that is a multiple of 16) and 16 of 32 (GroupQueryAttention rotates, its cos_cache 8 wide).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.modeling.config import ModelConfig  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402
from config_cases import saved_model  # noqa: E402
from helpers import genai_greedy  # noqa: E402

SIZES = dict(vocab_size=256, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=1e4)
# case: (hidden_size (n6 = hidden / 4), partial_rotary_factor, rotary width)
CASES = {"r8of16": (64, 0.5, 8), "r16of32": (128, 0.5, 16)}
IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])
RTOL = 2e-5  # of the largest logit: fp32 against fp32, the same arithmetic in another order


def perturb(model) -> None:
    """Weights off their init: norm gains away from 1, q/k scaled so scores are O(1), v/o and the embedding too."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)
        elif "qkv_proj" in name:
            p.mul_(10.0)
        elif "o_proj" in name:
            p.mul_(5.0)
        elif "embed_tokens" in name:
            p.mul_(20.0)


def hf_phi3(directory: Path, hidden: int, factor: float, **extra):
    config = transformers.Phi3Config(**SIZES, hidden_size=hidden, partial_rotary_factor=factor, **extra)
    return saved_model(transformers.Phi3ForCausalLM, config, directory, perturb)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and want.std() > 0.1
    err = (got - want).abs().max().item()
    assert err < RTOL * max(1.0, want.abs().max().item()), err


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, its HF directory, the transformers model, rotary width)."""
    hidden, factor, rotary = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, hf_phi3(d, hidden, factor), rotary


# --- The model: transformers' logits and tokens ---------------------------------------------------------------------

def test_read_as_transformers_reads_it(case):
    _, d, hf, rotary = case
    cfg = load_model(d).cfg
    assert (cfg.family, cfg.rotary_dim, cfg.partial_rotary) == ("phi3", rotary, True)
    assert hf.model.rotary_emb.inv_freq.numel() == rotary // 2  # transformers' own width
    again = config_from_hf(config_to_hf(cfg))
    assert dataclasses.replace(again, name="", source="") == dataclasses.replace(cfg, name="", source="")


def test_logits_and_greedy_tokens_equal_transformers(case):
    _, d, hf, _ = case
    ours = load_model(d)
    with torch.no_grad():
        assert_close(ours(IDS).logits, hf(IDS).logits)
    want = hf.generate(IDS, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(IDS))[0, IDS.shape[1]:]
    r = CliRunner().invoke(cli, ["generate", str(d), "--ids", " ".join(map(str, IDS[0].tolist())),
                                 "--max-new-tokens", "8", "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)["new_ids"] == want.tolist()


def test_streamed_reference_equals_transformers(case):
    from llama_tools.checkpoints.source import resolve
    from llama_tools.inference.reference import reference_model

    _, d, hf, _ = case
    with torch.no_grad():
        assert_close(reference_model(resolve(str(d)))(IDS).logits, hf(IDS).logits)


def test_negative_whole_heads_rotating_is_far_off(case):
    """The same weights with RoPE on all n6 channels (a dropped factor), or on none past the first pair, differ from
    transformers by thousands of times the tolerance: the comparison above would catch either."""
    _, d, hf, rotary = case
    model = load_model(d)
    with torch.no_grad():
        want = hf(IDS).logits
        bound = RTOL * max(1.0, want.abs().max().item())
        for changed in (model.cfg.replace(rotary_dim=0), model.cfg.replace(rotary_dim=rotary - 2)):
            off = model_from_state(changed, model.state_dict(), torch.float32)(IDS).logits
            assert (off - want).abs().max().item() > 1000 * bound, changed.rotary_dim


def test_count_params_is_transformers_and_rope_adds_none(case):
    _, d, hf, _ = case
    r = CliRunner().invoke(cli, ["count-params", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)[0]["total"] == sum(p.numel() for p in hf.parameters())


def test_report_shapes_shows_the_rotated_width(case):
    _, d, _, rotary = case
    r = CliRunner().invoke(cli, ["report", "shapes", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    rows = [row for row in json.loads(r.output)["rows"] if row["module"].endswith("self_attn.rope")]
    assert rows and all(f"rotating channels 0..{rotary - 1} of n6 = {2 * rotary}" in row["description"]
                        for row in rows)


def test_longrope_past_the_original_context(tmp_path):
    """Partial rotary with longrope: rotary_dim / 2 = 4 factors each; positions past original_max_position_embeddings
    (16) take the long ones, in a whole pass and in a greedy continuation of a prompt already past it."""
    long, short = [1.0, 2.0, 4.0, 8.0], [1.0, 1.2, 1.5, 2.0]
    hf = hf_phi3(tmp_path, 64, 0.5, original_max_position_embeddings=16,
                 rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
    ours = load_model(tmp_path)
    assert ours.cfg.rotary_dim == 8 and ours.cfg.rope_scaling.type == "longrope"
    ids = torch.tensor([[(7 * i + 3) % 250 + 3 for i in range(24)]])
    with torch.no_grad():
        want = hf(ids).logits
        assert_close(ours(ids).logits, want)
        assert_close(ours(ids[:, :12]).logits, hf(ids[:, :12]).logits)  # within the original context: short
        swapped = load_model(tmp_path).cfg
        swapped = swapped.replace(rope_scaling=type(swapped.rope_scaling)(
            **{**swapped.rope_scaling.__dict__, "long_factor": tuple(short)}))
        off = model_from_state(swapped, ours.state_dict(), torch.float32)(ids).logits
        assert (off - want).abs().max().item() > 100 * RTOL * want.abs().max().item()  # the long factors decide
    prompt = ids[:, :20]
    expected = hf.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    r = CliRunner().invoke(cli, ["generate", str(tmp_path), "--ids", " ".join(map(str, prompt[0].tolist())),
                                 "--max-new-tokens", "6", "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)["new_ids"] == expected[0, 20:].tolist()


# --- Refusals --------------------------------------------------------------------------------------------------------

PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=256, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("factor, said", [
    (0, "must be a number in (0, 1]"), (1.5, "must be a number in (0, 1]"), (-0.5, "must be a number in (0, 1]"),
    ("0.5", "must be a number in (0, 1]"), (True, "must be a number in (0, 1]"), (None, "must be a number"),
    (float("nan"), "must be a number"), (0.01, "int(16 x 0.01) = 0"), (0.3125, "int(16 x 0.3125) = 5")])
def test_out_of_range_factors_are_one_line_naming_the_key(factor, said):
    with pytest.raises(ValueError) as e:
        config_from_hf({**PHI3, "partial_rotary_factor": factor})
    msg = str(e.value)
    assert "\n" not in msg and "'partial_rotary_factor'" in msg and said in msg, msg


def test_the_5x_layout_reads_the_factor_inside_rope_parameters():
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    assert config_from_hf({**PHI3, "rope_parameters": params}).rotary_dim == 12
    with pytest.raises(ValueError, match="disagree"):
        config_from_hf({**PHI3, "rope_parameters": params, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="rope_parameters.partial_rotary_factor"):
        config_from_hf({**PHI3, "rope_parameters": {**params, "partial_rotary_factor": 2}})


@pytest.mark.parametrize("arch, model_type", [("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"),
                                              ("MistralForCausalLM", "mistral")])
def test_families_whose_code_ignores_the_factor_refuse_it(arch, model_type):
    """Only Phi-3's transformers code slices q[..., :rotary_dim] (4.57); elsewhere a factor below 1 is refused."""
    data = {**PHI3, "architectures": [arch], "model_type": model_type, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="field 'partial_rotary_factor' is 0.5.*does not model it"):
        config_from_hf(data)
    config_from_hf({**data, "partial_rotary_factor": 1.0})  # the neutral value is read


def test_model_config_validates_the_width():
    base = dict(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=4)
    assert ModelConfig(**base).rotary_dim == 16 and not ModelConfig(**base).partial_rotary
    for bad in (7, 18, -2):
        with pytest.raises(ValueError, match="rotary_dim"):
            ModelConfig(**base, rotary_dim=bad)


def test_the_factor_written_reads_back_as_the_width():
    """transformers truncates int(n6 x factor): 30 / 44 x 44 is 29.999..., so the factor written is nudged up."""
    from llama_tools.modeling.rope import partial_rotary_factor, rotary_dim_of

    for head, rotary in ((44, 30), (46, 26), (128, 96), (16, 8), (90, 26), (64, 64)):
        cfg = ModelConfig(name="t", vocab_size=8, hidden_size=4 * head, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=4, rotary_dim=rotary, family="phi3")
        assert rotary_dim_of(partial_rotary_factor(cfg), head) == rotary
        assert config_from_hf(config_to_hf(cfg)).rotary_dim == rotary


# --- ONNX: the plain graph (our RoPE node's head_dim) and the fused one (GQA's rotary, or our node) -----------------

@pytest.fixture(scope="module")
def graphs(case, tmp_path_factory):
    name, d, _, _ = case
    out = tmp_path_factory.mktemp(name + "-onnx")
    paths = {}
    for graph, extra in (("plain", []), ("fused", ["--optimize"])):
        path = out / graph / "model.onnx"
        r = CliRunner().invoke(cli, ["export", "onnx", str(d), "-o", str(path), "-q", *extra])
        assert r.exit_code == 0, r.output[-1500:]
        paths[graph] = path
    return paths


@pytest.mark.parametrize("graph", ["plain", "fused"])
@pytest.mark.parametrize("mode", [[], ["--by-layer"]])
def test_exports_pass_verify_parity_with_the_source_check(case, graphs, graph, mode):
    _, d, _, _ = case
    r = CliRunner().invoke(cli, ["verify", "parity", str(graphs[graph]), "--source", str(d), *mode, "-q",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output[-2500:]
    data = json.loads(r.output)
    assert data["passed"] and data["source_check"]["checked"] and data["source_check"]["passed"]
    if not mode:
        assert data["by_layer"]["passed"] and data["whole_graph"]["passed"]


def test_the_graphs_rotate_with_the_partial_width(case, graphs):
    """The plain graph's RoPE nodes say head_dim with tables rotary / 2 wide; the fused one rotates in
    GroupQueryAttention where the width allows it (16 of 32), else in our node over the packed QKV."""
    import onnx

    name, _, _, rotary = case
    plain = onnx.load(str(graphs["plain"]), load_external_data=False)
    ropes = [n for n in plain.graph.node if n.op_type == "RotaryEmbedding"]
    assert ropes and all({a.name: a.i for a in n.attribute}["head_dim"] == 2 * rotary for n in ropes)
    fused = onnx.load(str(graphs["fused"]), load_external_data=False)
    gqa = [{a.name: a.i for a in n.attribute} for n in fused.graph.node if n.op_type == "GroupQueryAttention"]
    tables = {i.name: list(i.dims) for i in fused.graph.initializer if "cos" in i.name}
    assert tables and all(dims[-1] == rotary // 2 for dims in tables.values()), tables
    assert all(g["do_rotary"] == (name == "r16of32") for g in gqa)


@pytest.mark.parametrize("rope_op", ["contrib", "onnx"])
def test_onnxruntimes_own_rotary_ops_take_the_partial_width(case, rope_op):
    """onnxruntime's RotaryEmbedding (contrib) and opset 23's, each given rotary_embedding_dim, pass verify too."""
    _, d, _, _ = case
    r = CliRunner().invoke(cli, ["verify", "parity", str(d), "--rope-op", rope_op, "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-2500:]
    assert json.loads(r.output)["passed"]


def test_negative_a_reading_that_drops_the_factor_fails_the_source_check(case, graphs, monkeypatch):
    """Were the factor dropped (whole heads read), graph and reference would agree with each other; verify's source
    check against transformers is what fails."""
    import llama_tools.checkpoints.config_files as config_files

    _, d, _, _ = case
    monkeypatch.setattr(config_files, "_rotary_dim", lambda *a, **k: 0)
    r = CliRunner().invoke(cli, ["verify", "parity", str(d), "-q", "--format", "json"])
    assert r.exit_code != 0
    data = json.loads(r.output)
    assert not data["passed"] and data["source_check"]["checked"] and not data["source_check"]["passed"]


def test_onnxruntime_genai_runs_both_graphs_with_transformers_tokens(case, graphs):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    _, _, hf, _ = case
    prompt = IDS[0].tolist()
    want = hf.generate(IDS, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(IDS))[0, len(prompt):]
    for graph, path in graphs.items():
        got = genai_greedy(path.parent, prompt, 6)
        assert got == want.tolist(), graph


# --- GGUF: phi3.rope.dimension_count out and in, llama.cpp itself computing it --------------------------------------

@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory):
    """A phi3 checkpoint with partial rotary 0.75 of 32-wide heads (24 channels) and a trained byte-level tokenizer,
    saved by transformers, with transformers' logits and greedy tokens on its tokenization (test_gguf_llamacpp)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import test_gguf_llamacpp as lc

    root = tmp_path_factory.mktemp("gguf-partial")
    tokenizers = {"bpe": lc._tokenizer_files("bpe", root / "tokenizer")}
    return lc, lc.reference("phi3", root / "hf", tokenizers, full=True, partial_rotary_factor=0.75, hidden_size=128)


def test_llama_cpp_computes_transformers_from_our_gguf(gguf_source, tmp_path):
    lc, src = gguf_source
    out = tmp_path / "m.gguf"
    stderr = lc.to_gguf(src.path, out)
    assert lc.warnings_of(stderr) == []
    from llama_tools.checkpoints.gguf.read import field_value, open_gguf

    reader = open_gguf(out)
    assert field_value(reader, "phi3.rope.dimension_count") == 24  # llama.cpp's converter: int(0.75 x 128) // 4
    assert field_value(reader, "phi3.attention.key_length") == 32
    llm = lc.llama(out)
    llm.eval(src.ids)
    got = np.asarray(llm.scores[:lc.N], dtype=np.float64)
    assert lc.rel_rms(got, src.logits) <= lc.F32_BOUND
    assert lc.llama_greedy(llm, src.ids[:24], lc.STEPS) == src.greedy
    ours = load_model(out)  # and read back: the width from rope.dimension_count
    assert (ours.cfg.rotary_dim, ours.cfg.head_dim) == (24, 32)
    with torch.no_grad():
        mine = ours(torch.tensor([src.ids])).logits[0].double().numpy()
    assert lc.rel_rms(mine, src.logits) <= lc.F32_BOUND


def test_negative_a_gguf_saying_whole_heads_is_far_off_in_llama_cpp(gguf_source, tmp_path, monkeypatch):
    import gguf

    lc, src = gguf_source
    original = gguf.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: original(self, 32))
    out = tmp_path / "whole.gguf"
    lc.to_gguf(src.path, out)
    got = lc.llama_logits(out, src.ids)
    assert lc.rel_rms(got, src.logits) > 1000 * lc.F32_BOUND


def test_gguf_refuses_partial_rotary_where_llama_cpp_turns_whole_heads(tmp_path):
    """llama.cpp's llama architecture refuses rope.dimension_count != the head width ("invalid n_rot"): a config of a
    family written as 'llama' with partial rotary is one line, before any weight is read."""
    from llama_tools.checkpoints.gguf.write import check_config

    cfg = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=4, rotary_dim=8)
    with pytest.raises(ValueError, match="partial rotary .RoPE on 8 of 16 channels"):
        check_config(cfg)
    check_config(cfg.replace(family="phi3"))  # phi3: written


def test_meta_params_cannot_say_partial_rotary():
    from llama_tools.checkpoints.convert import meta_params

    cfg = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=4, rotary_dim=8)
    with pytest.raises(ValueError, match="params.json cannot express partial rotary"):
        meta_params(cfg)
    meta_params(cfg.replace(rotary_dim=0))
