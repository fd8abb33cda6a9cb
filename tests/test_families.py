"""The families beyond LLaMA (Qwen3, Gemma, Gemma 2, Gemma 3), each against transformers' own implementation.

Each case is a small random HF model saved with `save_pretrained` (HF's writer, HF's config.json). Its weights
are moved far from their initial values, so that nothing a family adds can hide: norm gains away from 1 (0 for
Gemma's 1 + γ, where a missing "1 +" would otherwise cost nothing), q/k scaled so attention scores are O(1) and
the soft caps bite (Gemma 2's scores and logits reach several times their cap), windows shorter than the prompts.
Then: logits and greedy tokens equal transformers', count-params equals its parameter count, the plain and fused
exports pass `verify parity` and run in onnxruntime-genai with transformers' tokens, and a planted fault is named.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

from llama_tools import load_model  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.exporters.verification.parity import resolve_target  # noqa: E402
from llama_tools.exporters.verification.verdict import parity_inputs, verify  # noqa: E402
from config_cases import saved_model  # noqa: E402
from helpers import bench_faults, genai_greedy, add_llama_hparams, finish_gguf  # noqa: E402
from llama_tools.checkpoints.config_files import load_config  # noqa: E402


SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
WINDOW = 5
CASES = {  # family: (config class, model class, what the family adds)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                                         final_logit_softcapping=3.0, sliding_window=WINDOW)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=WINDOW, rope_local_base_freq=100.0, rope_theta=1e4,
        sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Granite's four multipliers, none of them 1 (transformers' defaults), attention's far from 1 / sqrt(n6)
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=3.0, residual_multiplier=0.4,
                                                           attention_multiplier=0.09, logits_scaling=0.5)),
    # OLMo 2: norms after attention and the FFN only, q/k normalized over the whole projection
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=1e4)),
    # Phi-3: stored packed (qkv_proj, gate_up_proj), a window shorter than the prompt
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, rope_theta=1e4)),
    # SmolLM3: every 2nd layer without RoPE (llama.cpp's 4th is the GGUF case's), those layers sliding
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, rope_theta=1e4,
                                                           use_sliding_window=True, sliding_window=WINDOW)),
}
IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])  # longer than the window


def hf_model(family: str, directory: Path):
    """A seeded transformers model of the family with its weights far from their initial values, saved."""
    config_cls, model_cls, extra = CASES[family]
    gemma = family.startswith("gemma")

    def perturb(model) -> None:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.5 if gemma else 1.0, 0.3)  # HF's init: 0 (Gemma's 1 + γ) or 1
            elif any(k in name for k in ("q_proj", "k_proj")):
                p.mul_(10.0)  # scores O(1): RoPE, windows and caps decide the output
            elif any(k in name for k in ("v_proj", "o_proj")):
                p.mul_(5.0)
            elif "embed_tokens" in name:
                p.mul_(20.0)  # logits of several units: Gemma 2's cap of 3 bites
    config = getattr(transformers, config_cls)(**SIZES, **extra, attn_implementation="eager")
    return saved_model(getattr(transformers, model_cls), config, directory, perturb)


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(family, its HF directory, the transformers model)."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, hf_model(request.param, d)


def test_logits_and_greedy_tokens_equal_transformers(family):
    name, d, hf = family
    ours = load_model(d)
    assert ours.cfg.family == name
    with torch.no_grad():
        expected, got = hf(IDS).logits, ours(IDS).logits
    assert got.shape == expected.shape == (1, IDS.shape[1], SIZES["vocab_size"]) and got.dtype == torch.float32
    assert expected.std() > 0.1
    assert (got - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item())
    want = hf.generate(IDS, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(IDS))[0, IDS.shape[1]:]
    r = CliRunner().invoke(cli, ["generate", str(d), "--ids", " ".join(map(str, IDS[0].tolist())),
                                 "--max-new-tokens", "8", "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)["new_ids"] == want.tolist()


def test_what_the_family_adds_changes_the_output(family):
    """Negative controls: each override, turned off, changes the logits far beyond rounding."""
    from llama_tools.modeling.model import model_from_state

    name, d, _ = family
    model = load_model(d)
    cfg = model.cfg
    with torch.no_grad():
        base = model(IDS).logits
    off = {"qk_norm": False} if cfg.qk_norm else {}
    if cfg.family == "granite":  # each multiplier alone
        for f in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            changed = model_from_state(cfg.replace(**{f: 1.0}), model.state_dict(), torch.float32)
            with torch.no_grad():
                assert (changed(IDS).logits - base).abs().max() > 1e-2, f
        off = {"attention_multiplier": None}
    if cfg.rope_layers is not None:
        off = {"rope_layers": None, "sliding_window": None, "layer_types": None}
    if cfg.final_logit_softcap is not None:
        assert base.abs().max() > 0.9 * cfg.final_logit_softcap  # the cap bites
        off = {"final_logit_softcap": None}
    if cfg.sliding_window is not None and not off:
        off = {"sliding_window": None, "layer_types": None}
    if cfg.norm_plus_one and not off:
        off = {"norm_plus_one": False}
    if off.get("qk_norm") is False:  # remove the norms' weights with the flag
        state = {k: v for k, v in model.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    else:
        state = model.state_dict()
    changed = model_from_state(cfg.replace(**off), state, torch.float32)
    with torch.no_grad():
        assert (changed(IDS).logits - base).abs().max() > 1e-2, off


def test_count_params_is_transformers_count(family):
    _, d, hf = family
    r = CliRunner().invoke(cli, ["count-params", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)[0]["total"] == sum(p.numel() for p in hf.parameters())


@pytest.fixture(scope="module")
def graphs(family, tmp_path_factory):
    """The plain and fused exports of the family's model."""
    name, d, _ = family
    out = tmp_path_factory.mktemp(name + "-onnx")
    paths = {}
    for graph, extra in (("plain", []), ("fused", ["--optimize"])):
        path = out / graph / "model.onnx"
        r = CliRunner().invoke(cli, ["export", "onnx", str(d), "-o", str(path), "-q", *extra])
        assert r.exit_code == 0, r.output[-1500:]
        paths[graph] = path
    return paths


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_exports_pass_verify_parity_and_a_fault_is_named(family, graphs, graph):
    name, d, _ = family
    r = CliRunner().invoke(cli, ["verify", "parity", str(graphs[graph]), "--source", str(d), "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-2500:]
    data = json.loads(r.output)
    assert data["by_layer"]["passed"] and data["whole_graph"]["passed"]
    cfg = resolve_target(str(graphs[graph]), str(d)).source.cfg
    faulted = bench_faults().plant(graphs[graph], "scale", cfg, 1)
    try:
        ft = resolve_target(str(faulted), str(d))
        v = verify(ft, parity_inputs(ft, None, 2, None, 0), provider="cpu", steps=2)
    finally:
        faulted.unlink()
    assert not v.passed and v.first_bad == "layer 1", v.first_bad


def test_onnxruntime_genai_runs_both_graphs_with_transformers_tokens(family, graphs):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    _, _, hf = family
    prompt = IDS[0].tolist()
    want = hf.generate(IDS, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(IDS))[0, len(prompt):]
    for graph, path in graphs.items():
        got = genai_greedy(path.parent, prompt, 6)
        assert got == want.tolist(), graph


# --- Each family's GGUF, written with the gguf library under its architecture's own keys --------------------------

def write_family_gguf(d: Path, hf, path: Path) -> None:
    """The HF model as llama.cpp's converter lays it out: its architecture's keys, llama.cpp's tensor names, q/k rows
    as HF has them (rope type NEOX), Gemma's gains stored as 1 + γ; every tensor F32, so the file is the same model."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    arch = {"qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "granite": "granite",
            "smollm3": "smollm3", "olmo2": "olmo2", "phi3": "phi3"}[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    n = c.num_hidden_layers
    add_llama_hparams(w, load_config(d))  # the keys every architecture shares, from the config.json HF wrote
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    scaling = getattr(c, "rope_scaling", None)
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if getattr(c, "sliding_window", None) and arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if getattr(c, "sliding_window", None) and arch == "phi3":  # llama.cpp's converter writes it (llama.cpp skips it)
        w.add_sliding_window(c.sliding_window)
    if getattr(c, "query_pre_attn_scalar", None):
        w.add_float32(f"{arch}.attention.scale", c.query_pre_attn_scalar ** -0.5)  # llama.cpp assumes n6 without it
    if getattr(c, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if getattr(c, "rope_local_base_freq", None):
        w.add_rope_freq_base_swa(c.rope_local_base_freq)
    if arch == "granite":  # llama.cpp's names for the four multipliers
        for key, value in (("embedding_scale", c.embedding_multiplier), ("residual_scale", c.residual_multiplier),
                           ("attention.scale", c.attention_multiplier), ("logit_scale", c.logits_scaling)):
            w.add_float32(f"granite.{key}", value)
    interleave = arch in ("granite", "smollm3")  # converted as Llama: q/k rows in Meta's order (convert_hf_to_gguf)
    # A byte-level vocabulary of the model's size: specials, letters, then pieces no text reaches.
    tokens = (["<unk>", "<s>", "</s>"] + [chr(c) for c in range(97, 123)] + ["Ġ"]
              + [f"<x{i}>" for i in range(c.vocab_size - 30)])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp leaves a tied lm_head out
        a = t.detach().numpy().astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # convert_hf_to_gguf.py: Gemma's gains as llama.cpp multiplies by them
        if interleave and name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.permute
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), a)
    finish_gguf(w)


def test_family_gguf_is_counted_loaded_exported_and_verified(family, tmp_path):
    name, d, hf = family
    refused = {"smollm3": "layers without RoPE"}  # llama.cpp fixes them at every 4th; this case's are every 2nd
    if name in refused:
        from llama_tools.checkpoints.gguf.write import check_config

        with pytest.raises(ValueError, match=refused[name]):
            check_config(load_model(d).cfg)
        return
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(d, hf, path)
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    assert json.loads(r.output)[0]["total"] == sum(p.numel() for p in hf.parameters())
    ours = load_model(path)
    assert ours.cfg.family == name and ours.cfg.layer_types == load_model(d).cfg.layer_types
    with torch.no_grad():
        expected, got = hf(IDS).logits, ours(IDS).logits
    assert (got - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item())
    graph = tmp_path / "fused" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(path), "-o", str(graph), "--optimize", "-q"])
    assert r.exit_code == 0, r.output[-1500:]
    r = CliRunner().invoke(cli, ["verify", "parity", str(graph), "--source", str(path), "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-2500:]


def test_default_inputs_run_past_a_sliding_window():
    """A window longer than every default row gets a row past it (so the window masks keys); one shorter does not."""
    from types import SimpleNamespace

    from llama_tools.exporters.prompts import WINDOW_EXTRA, default_inputs

    src = SimpleNamespace(cfg=SimpleNamespace(sliding_window=40), path=None, tokenizer=None)
    rows = default_inputs(src, 256, 128, random_ids=2).rows
    assert [len(r) for r in rows] == [11, 6, 40 + WINDOW_EXTRA]
    assert "past the sliding window" in default_inputs(src, 256, 128, random_ids=2).what
    assert len(default_inputs(src, 256, 30, random_ids=2).rows) == 2  # the context ends before the window does
    src = SimpleNamespace(cfg=SimpleNamespace(sliding_window=512), path=None, tokenizer=None)
    big = default_inputs(src, 262144, 1024, random_ids=2)  # Gemma 3's: a batch of its own (test_window_row.py)
    assert [len(r) for r in big.rows] == [11, 6, 512 + WINDOW_EXTRA] and big.groups == ((0, 1), (2,))
    src = SimpleNamespace(cfg=SimpleNamespace(sliding_window=5), path=None, tokenizer=None)
    assert [len(r) for r in default_inputs(src, 256, 128, random_ids=2).rows] == [11, 6]


def test_phi3_is_read_and_written_packed(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are split as transformers splits them (its own modules read them packed),
    and `convert --to hf` packs them again: transformers loads the converted files to the same logits."""
    from safetensors import safe_open

    d = tmp_path / "phi3"
    hf = hf_model("phi3", d)
    out = tmp_path / "converted"
    r = CliRunner().invoke(cli, ["convert", str(d), str(out), "--to", "hf"])
    assert r.exit_code == 0, r.output[-800:]
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, hf(IDS).logits)
    ours = load_model(out)
    gate, up = hf.model.layers[1].mlp.gate_up_proj.weight.chunk(2)  # transformers' own split: gate first
    assert torch.equal(ours.model.layers[1].mlp.gate_proj.weight, gate)
    assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, up)
