"""The last LLaMA-family GGUFs: Mixtral's experts (stacked ffn_*_exps) and Llama 3.1's rope_freqs.weight.

Each tiny model is made in HF form by transformers (seeded MixtralForCausalLM / LlamaForCausalLM with 'llama3'
rope_scaling) and written as llama.cpp's convert_hf_to_gguf.py writes it, with the gguf library's writer:
architecture 'llama', q/k rows permuted, experts stacked per projection under the library's tensor names, the
llama3 divisors computed as llama.cpp computes them (float32 torch) and stored as rope_freqs.weight, no
rope_scaling keys. Truth is transformers' logits on the HF form and the library's own dequantization.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from llama_tools.counting.accounting import count_source  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.checkpoints.convert import convert  # noqa: E402
from llama_tools.checkpoints.gguf.tensors import GgufReader, load_gguf_model  # noqa: E402
from llama_tools.checkpoints.loading import load_model  # noqa: E402
from helpers import QK_SCALE, add_llama_hparams, export_and_verify, finish_gguf  # noqa: E402
from test_gguf import add_vocabulary, llama_cpp_permute  # noqa: E402

T = gguf.GGMLQuantizationType
IDS = torch.tensor([[1, 5, 9, 33, 60, 7, 2, 17, 40, 11, 3, 59] * 8])  # 96 positions: slow RoPE pairs turn too
SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)


def mixtral(experts: int = 4, used: int = 2, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(**{**SIZES, "num_hidden_layers": layers}, num_local_experts=experts,
                                     num_experts_per_tok=used, rope_theta=1e4)
    return transformers.MixtralForCausalLM(cfg).eval()


def llama3(factor: float, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**SIZES, "max_position_embeddings": 16384}, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp attention (helpers.QK_SCALE): scores then tell the slow RoPE pairs apart
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= QK_SCALE
            layer.self_attn.k_proj.weight *= QK_SCALE
    return model


def llama_cpp_rope_freqs(hp, factor: float, low: float = 1.0, high: float = 4.0, ctx: int = 8192) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, as llama.cpp computes rope_freqs (float32)."""
    dim = hp.hidden_size // hp.num_attention_heads
    freqs = 1.0 / (hp.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_llama_cpp_gguf(model, path, *, expert_type=T.F32, expert_count: int | None = None,
                         rope_freqs: torch.Tensor | None = None, per_expert: bool = False) -> None:
    """An HF LlamaForCausalLM / MixtralForCausalLM as llama.cpp's converter writes it (F32, experts maybe quantized;
    per_expert: as it wrote them before 2024, blk.N.ffn_gate.E.weight, one tensor an expert)."""
    hp = model.config
    n = hp.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n)
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, hp)
    w.add_vocab_size(hp.vocab_size)
    add_vocabulary(w)
    experts = getattr(hp, "num_local_experts", 0)
    if experts:
        w.add_expert_count(experts if expert_count is None else expert_count)
        w.add_expert_used_count(hp.num_experts_per_tok)
    if rope_freqs is not None:  # llama.cpp yields it before the model's own tensors
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs.numpy())
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    legacy = {}
    for j in range(n):  # llama.cpp's LlamaModel.modify_tensors: each projection's experts merged, then named
        for wn, proj in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            if per_expert:
                for e in range(experts):
                    legacy[f"blk.{j}.ffn_{proj}.{e}.weight"] = sd.pop(
                        f"model.layers.{j}.block_sparse_moe.experts.{e}.{wn}.weight")
                continue
            parts = [sd.pop(f"model.layers.{j}.block_sparse_moe.experts.{e}.{wn}.weight") for e in range(experts)]
            if parts:
                sd[f"model.layers.{j}.block_sparse_moe.experts.{wn}.weight"] = np.stack(parts)
    for name, a in sd.items():
        if ".q_proj." in name:
            a = llama_cpp_permute(a, hp.num_attention_heads)
        elif ".k_proj." in name:
            a = llama_cpp_permute(a, hp.num_key_value_heads)
        q = expert_type if ".experts." in name else T.F32
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), gguf.quants.quantize(a, q), raw_dtype=q)
    for name, a in legacy.items():
        w.add_tensor(name, gguf.quants.quantize(a, expert_type), raw_dtype=expert_type)
    finish_gguf(w)


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def ours(path) -> torch.Tensor:
    with torch.no_grad():
        return load_gguf_model(path)(IDS).logits


def one_line_refusal(args, *wanted):
    r = CliRunner().invoke(cli, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    for w in wanted:
        assert w in lines[0], r.output
    return lines[0]


# --- Mixtral -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model = mixtral()
    path = tmp_path_factory.mktemp("moe") / "mixtral.gguf"
    write_llama_cpp_gguf(model, path)
    return model, path


def test_mixtral_gguf_gives_transformers_logits(moe):
    model, path = moe
    reader = GgufReader(path)
    cfg = reader.cfg
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("mixtral", 4, 2, 96)
    want = hf_logits(model)
    torch.testing.assert_close(ours(path), want, rtol=0, atol=2e-5)
    # Negative case: routing each token to one expert, not two, gives other logits.
    one = load_gguf_model(path)
    for layer in one.model.layers:
        layer.block_sparse_moe.k = 1
    with torch.no_grad():
        assert (one(IDS).logits - want).abs().max() > 1e-3


def test_mixtral_counted_from_headers_as_its_hf_form(moe):
    model, path = moe
    hf_total = sum(p.numel() for p in model.parameters())
    count = count_source(str(path))
    insp = count.checkpoint
    assert insp is not None and insp.ok, (insp.missing, insp.mismatched, insp.unexplained)
    assert count.total == insp.total_params == hf_total
    stacked = {t.name: t for t in insp.tensors}["blk.1.ffn_down_exps.weight"]
    assert stacked.shape == (4, 64, 96) and stacked.numel == 4 * 64 * 96
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["total"] == hf_total, r.output


def test_per_expert_tensors_of_older_files(tmp_path):
    """A Mixtral GGUF of before 2024 (blk.N.ffn_gate.E.weight): transformers' logits, counted as its HF form."""
    model = mixtral()
    path = tmp_path / "old.gguf"
    write_llama_cpp_gguf(model, path, per_expert=True)
    assert "blk.1.ffn_down.3.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    torch.testing.assert_close(ours(path), hf_logits(model), rtol=0, atol=2e-5)
    count = count_source(str(path))
    assert count.checkpoint.ok and count.total == count.checkpoint.total_params == sum(
        p.numel() for p in model.parameters())
    fewer = mixtral(experts=3)  # negative case: metadata saying 4 experts over a file holding 3
    write_llama_cpp_gguf(fewer, tmp_path / "fewer.gguf", per_expert=True, expert_count=4)
    one_line_refusal(["generate", str(tmp_path / "fewer.gguf"), "--ids", "1 2"], "expert_count says 4",
                     "'blk.0.ffn_gate_inp.weight' has 3 rows")


def test_stacked_quantized_experts_read_one_at_a_time(tmp_path):
    """Q8_0 experts: each expert's rows equal the library's dequantization of the whole stacked tensor."""
    path = tmp_path / "q8.gguf"
    write_llama_cpp_gguf(mixtral(), path, expert_type=T.Q8_0)
    reader = GgufReader(path)
    whole = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
             if "_exps" in t.name}
    for proj, stored in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
        for e in range(4):
            got = reader.read([f"model.layers.1.block_sparse_moe.experts.{e}.{proj}.weight"])
            np.testing.assert_array_equal(next(iter(got.values())).numpy(), whole[f"blk.1.{stored}.weight"][e])
    assert not np.array_equal(whole["blk.1.ffn_up_exps.weight"][0], whole["blk.1.ffn_up_exps.weight"][1])


def test_mixtral_gguf_converts_to_hf_and_back(moe, tmp_path):
    """convert --to hf gives transformers' Mixtral its own logits; --to gguf writes llama.cpp's stacked names."""
    model, path = moe
    convert(str(path), tmp_path / "hf", to="hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    torch.testing.assert_close(hf_logits(back), hf_logits(model), rtol=0, atol=1e-6)
    res = convert(str(tmp_path / "hf"), tmp_path / "again.gguf", to="gguf")
    assert res.params == sum(p.numel() for p in model.parameters())
    names = {t.name for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"} <= names
    torch.testing.assert_close(ours(tmp_path / "again.gguf"), hf_logits(model), rtol=0, atol=2e-5)


@pytest.mark.slow
def test_mixtral_export_and_verify_parity_from_gguf(moe, tmp_path):
    pytest.importorskip("onnxruntime")
    _, path = moe
    export_and_verify(path, tmp_path)


@pytest.mark.parametrize("count, used, layers, said", [
    (3, 2, 2, "expert_count says 3"), (4, 5, 2, "expert_used_count is 5"), (1 << 17, 2, 2, "expert_count is 131,072"),
    (1 << 16, 2, 3, "3 decoder layers x 65,536 experts")])  # past the bounds: said before any loop over experts
def test_inconsistent_expert_counts_are_one_line(tmp_path, count, used, layers, said):
    model = mixtral(layers=layers)
    model.config.num_experts_per_tok = used
    path = tmp_path / "bad.gguf"
    write_llama_cpp_gguf(model, path, expert_count=count)
    one_line_refusal(["count-params", str(path)], said)
    one_line_refusal(["generate", str(path), "--ids", "1 2"], said)


# --- Llama 3.1 / 3.2: rope_freqs.weight ------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [8.0, 32.0, 16.0])  # Llama 3.1, 3.2, and a factor only the tensor says
def test_rope_freqs_recovers_llama3_scaling(tmp_path, factor):
    model = llama3(factor)
    path = tmp_path / "l3.gguf"
    write_llama_cpp_gguf(model, path, rope_freqs=llama_cpp_rope_freqs(model.config, factor))
    s = GgufReader(path).cfg.rope_scaling
    assert s is not None and (s.type, s.factor, s.low_freq_factor, s.high_freq_factor,
                              s.original_max_position_embeddings) == ("llama3", factor, 1.0, 4.0, 8192)
    want = hf_logits(model)
    torch.testing.assert_close(ours(path), want, rtol=0, atol=2e-5)
    convert(str(path), tmp_path / "hf", to="hf")  # the scaling goes on into config.json
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"]["factor"] == factor
    torch.testing.assert_close(hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()),
                               want, rtol=0, atol=1e-6)
    convert(str(tmp_path / "hf"), tmp_path / "again.gguf", to="gguf")  # written back as llama.cpp writes it
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    np.testing.assert_allclose(stored["rope_freqs.weight"].data, llama_cpp_rope_freqs(model.config, factor).numpy(),
                               rtol=1e-6)
    assert not any(f.startswith("llama.rope.scaling") for f in gguf.GGUFReader(tmp_path / "again.gguf").fields)
    torch.testing.assert_close(ours(tmp_path / "again.gguf"), want, rtol=0, atol=2e-5)
    no_scaling = tmp_path / "plain"  # negative case: the same weights without the scaling
    convert(str(path), no_scaling, to="hf")
    data = json.loads((no_scaling / "config.json").read_text())
    data["rope_scaling"] = None
    (no_scaling / "config.json").write_text(json.dumps(data))
    with torch.no_grad():
        assert (load_model(no_scaling)(IDS).logits - want).abs().max() > 1e-4


@pytest.mark.parametrize("how", ["perturbed", "other_context"])
def test_rope_freqs_matching_no_scaling_is_refused(tmp_path, how):
    model = llama3(8.0)
    freqs = llama_cpp_rope_freqs(model.config, 8.0) if how == "perturbed" else \
        llama_cpp_rope_freqs(model.config, 8.0, ctx=4096)
    if how == "perturbed":
        freqs[4] *= 1.01  # one blended divisor 1% off
    path = tmp_path / "odd.gguf"
    write_llama_cpp_gguf(model, path, rope_freqs=freqs)
    line = one_line_refusal(["generate", str(path), "--ids", "1 2"], "rope_freqs.weight", "matches no 'llama3'")
    assert str(path) in line
    r = CliRunner().invoke(cli, ["count-params", str(path)])  # still counted, from its header
    assert r.exit_code == 0 and "rope_freqs.weight" in r.output, r.output
