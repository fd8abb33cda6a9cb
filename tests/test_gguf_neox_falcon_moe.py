"""GGUF for GPT-NeoX (llama.cpp's `gptneox`), Falcon (`falcon`) and Qwen3-MoE (`qwen3moe`): what `convert --to gguf`
writes, llama.cpp runs as transformers does, and what llama.cpp's converter writes is read back as its source.

Truth is independent of our writer and reader: transformers' own models (GPTNeoXForCausalLM, FalconForCausalLM,
Qwen3MoeForCausalLM; eager, float32), seeded, every norm and bias off its initial value (tests/neox_block.py's
perturbation; test_gguf_llamacpp's for Qwen3-MoE), saved by transformers beside a small trained byte-level tokenizer;
llama.cpp itself (llama-cpp-python) on the GGUF; the gguf library's own tables (MODEL_TENSORS) for the names.
Layouts: Pythia's (parallel, RoPE on a quarter of each head) and a sequential NeoX at half the head; Falcon-7B's
(multi-query, one shared norm) and new_decoder_architecture's (2 KV heads, ln_attn and ln_mlp as attn_norm_2 and
attn_norm, or one input_layernorm); Qwen3-MoE with 4 experts, top 2. Negative cases: a file whose attn_qkv keeps HF's packed row order (the
converter's regrouping left out), and Qwen3-MoE's experts stacked in another order, are far from transformers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from helpers import finish_gguf  # noqa: E402
from neox_block import perturb  # noqa: E402
from test_gguf_llamacpp import (CORPUS, F32_BOUND, F32_GELU_BOUND, STEPS, _perturbed, llama, llama_greedy,  # noqa: E402
                                llama_logits, rel_rms, to_gguf)
from test_gguf_llamacpp import tokenizers_dir  # noqa: E402, F401  (its fixture: the trained tokenizers, made once)
from test_hostile import assert_ok, assert_one_line, invoke  # noqa: E402

SIZES = dict(vocab_size=640, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
CASES = {  # name: (transformers' class prefix, config keywords)
    "neox_parallel": ("GPTNeoX", dict(use_parallel_residual=True, rotary_pct=0.25, intermediate_size=128)),
    "neox_sequential": ("GPTNeoX", dict(use_parallel_residual=False, rotary_pct=0.5, intermediate_size=128)),
    "falcon_7b": ("Falcon", dict(multi_query=True, parallel_attn=True, bias=False)),
    "falcon_40b": ("Falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=False)),
    "falcon_one_norm": ("Falcon", dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
                                       bias=False)),
    "qwen3_moe": ("Qwen3Moe", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=2, head_dim=16,
                                   rope_theta=1e6)),
}
ARCH = {"GPTNeoX": "gptneox", "Falcon": "falcon", "Qwen3Moe": "qwen3moe"}
N = 128  # positions compared
# llama.cpp's CPU GELU is the tanh form read and written through an FP16 table (GGML_GELU_FP16); transformers' "gelu"
# is erf's. Against transformers as it is the GELU families measure 1.9e-4 to 2.1e-4 (relative RMS; max |difference|
# 1.9e-3 to 2.7e-3 on logits up to 5), within test_gguf_llamacpp's F32_GELU_BOUND; against transformers with its GELU
# computed as ggml's (GgmlGelu), 3.9e-6 to 4.1e-6, and 2.2e-5 for the sequential NeoX, where an input one float32 step
# off ggml's lands on the other side of an FP16 rounding and takes the table's neighbouring entry: bounded at 5e-5.
# Qwen3-MoE (SiLU, no GELU): 1.3e-6, within F32_BOUND.
GGML_GELU_BOUND = 5e-5
FAR = 1e-2  # ten times the loosest bound above (measured: 0.097 for two experts swapped, more for q/k/v rows)


class GgmlGelu(torch.nn.Module):
    """ggml's CPU GELU: x rounded to FP16, the tanh form, the result rounded to FP16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()


@dataclasses.dataclass
class Source:
    case: str
    path: Path  # transformers' checkpoint
    gguf: Path  # `convert --to gguf` of it
    hf: Any  # the transformers model
    ids: list[int]  # transformers' tokenization of the corpus, N of them
    logits: np.ndarray  # transformers' logits on ids [N, vocab]
    ggml_gelu: np.ndarray | None  # the same with ggml's GELU; None without a GELU
    greedy: list[int]  # transformers' greedy continuation of ids[:24]

    @property
    def arch(self) -> str:
        return ARCH[CASES[self.case][0]]


def hf_checkpoint(case: str, d: Path, tokenizers: dict[str, Path], **changes: Any) -> tuple[Any, Any]:
    """CASE's seeded transformers model saved into D beside the byte-level tokenizer: (model, tokenizer)."""
    prefix, fields = CASES[case]
    shutil.copytree(tokenizers["bpe"], d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    config = getattr(transformers, f"{prefix}Config")(**SIZES, **fields, bos_token_id=tok.bos_token_id,
                                                       eos_token_id=tok.eos_token_id, **changes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        (_perturbed if prefix == "Qwen3Moe" else perturb)(model)
    model.save_pretrained(d)
    return model, tok


def with_ggml_gelu(model: Any) -> Any:
    """MODEL with each MLP's GELU computed as ggml's (in place); None for a model without one."""
    mlps = [m for m in model.modules() if hasattr(m, "dense_4h_to_h") and hasattr(m, "act")]
    for m in mlps:
        m.act = GgmlGelu()
    return model if mlps else None


@pytest.fixture(scope="module", params=list(CASES))
def source(request, tmp_path_factory, tokenizers_dir) -> Source:
    d = tmp_path_factory.mktemp(request.param)
    hf, tok = hf_checkpoint(request.param, d / "hf", tokenizers_dir)
    ids = tok(" ".join(CORPUS)).input_ids[:N]
    assert len(ids) == N
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
        greedy = hf.generate(torch.tensor([ids[:24]]), do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS,
                             eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
        gelu = with_ggml_gelu(getattr(transformers, f"{CASES[request.param][0]}ForCausalLM").from_pretrained(
            d / "hf", attn_implementation="eager").eval())
        ggml = gelu(torch.tensor([ids])).logits[0].double().numpy() if gelu is not None else None
    assert want.std() > 0.5  # logits that spread as a trained model's: a wrong layout moves them far
    assert to_gguf(d / "hf", d / "m.gguf").count("warning:") == 0
    return Source(request.param, d / "hf", d / "m.gguf", hf, ids, want, ggml, greedy)


# --- (1) llama.cpp runs the file as transformers runs the source --------------------------------------------------

def test_llama_cpp_computes_what_transformers_computes(source):
    llm = llama(source.gguf)
    llm.eval(source.ids)
    got = np.asarray(llm.scores[:N], dtype=np.float64)
    err = rel_rms(got, source.logits)
    if source.ggml_gelu is None:
        assert err <= F32_BOUND, f"{source.case}: relative RMS {err:.2e}"
    else:
        assert err <= F32_GELU_BOUND, f"{source.case}: relative RMS {err:.2e}"
        err = rel_rms(got, source.ggml_gelu)
        assert err <= GGML_GELU_BOUND, f"{source.case}: relative RMS {err:.2e} against ggml's GELU"
    assert llama_greedy(llm, source.ids[:24], STEPS) == source.greedy


def _regrouped(case: str, w: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """HF's query_key_value rows (or bias) as llama.cpp's converter stores them: cat(q, k, v)."""
    rest, d = w.shape[1:], SIZES["hidden_size"] // heads
    if case.startswith("neox"):  # per head [q_h, k_h, v_h]
        g = w.reshape(heads, 3, d, *rest)  # [n5, 3, n6, n2...]
        return torch.cat([g[:, i].reshape(-1, *rest) for i in range(3)])
    g = w.reshape(kv, heads // kv + 2, d, *rest)  # Falcon: per KV group [its q heads, k, v]
    return torch.cat([g[:, :-2].reshape(-1, *rest), g[:, -2].reshape(-1, *rest), g[:, -1].reshape(-1, *rest)])


def test_the_file_is_named_and_keyed_as_llama_cpps_converter_writes_it(source):
    """Every tensor name is one of the gguf library's MODEL_TENSORS for the architecture; attn_qkv holds HF's packed
    rows regrouped as the converter regroups them; the keys llama.cpp reads for the block are there."""
    r = gguf.GGUFReader(source.gguf)
    arch = source.arch
    assert r.fields["general.architecture"].contents() == arch
    allowed = {gguf.TENSOR_NAMES[t].format(bid=j) for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]
               for j in range(SIZES["num_hidden_layers"])}
    names = {t.name for t in r.tensors}
    assert {n.rsplit(".", 1)[0] for n in names} <= allowed, sorted(names)
    value = lambda key: r.fields[f"{arch}.{key}"].contents()  # noqa: E731
    cfg = source.hf.config
    if arch == "qwen3moe":
        assert (value("expert_count"), value("expert_used_count"), value("expert_feed_forward_length")) == (4, 2, 32)
        assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.attn_q_norm.weight" in names
        return
    heads = cfg.num_attention_heads
    kv = heads if arch == "gptneox" else cfg.num_kv_heads if cfg.new_decoder_architecture else 1
    assert value("attention.head_count_kv") == kv
    assert value("attention.layer_norm_epsilon") == pytest.approx(1e-5)
    if arch == "gptneox":
        assert value("rope.dimension_count") == int(cfg.rotary_pct * 16)  # the converter's int(rotary_pct x n6)
        assert value("use_parallel_residual") == cfg.use_parallel_residual
    two = arch == "falcon" and cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn != 1  # ln_attn, ln_mlp
    if arch == "falcon":  # one norm (input_layernorm) is attn_norm; two: ln_attn is attn_norm_2, ln_mlp attn_norm
        assert ("blk.0.attn_norm_2.weight" in names) == two
    state = source.hf.state_dict()
    base = "gpt_neox.layers.1.attention" if arch == "gptneox" else "transformer.h.1.self_attention"
    stored = {t.name: np.asarray(t.data) for t in r.tensors if t.name.startswith("blk.1.attn_qkv")}
    for part in ("weight", "bias") if arch == "gptneox" else ("weight",):
        want = _regrouped(source.case, state[f"{base}.query_key_value.{part}"], heads, kv).numpy()
        assert np.array_equal(stored[f"blk.1.attn_qkv.{part}"], want)
    if arch == "falcon":
        norm = state["transformer.h.1.ln_mlp.weight" if two else "transformer.h.1.input_layernorm.weight"].numpy()
        assert np.array_equal(next(np.asarray(t.data) for t in r.tensors if t.name == "blk.1.attn_norm.weight"), norm)


# --- (2) the file read back: count, transformers, export and verify parity -----------------------------------------

def test_the_gguf_reads_back_as_its_source(source, tmp_path):
    """count-params equals transformers' count; `convert --to hf` of the GGUF gives transformers its logits again."""
    r = invoke(["count-params", str(source.gguf), "--format", "json"])
    assert_ok(r)
    assert json.loads(r.stdout)[0]["total"] == sum(p.numel() for p in source.hf.parameters())
    assert_ok(invoke(["convert", str(source.gguf), str(tmp_path / "hf"), "--to", "hf"]))
    again = getattr(transformers, f"{CASES[source.case][0]}ForCausalLM").from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        got = again(torch.tensor([source.ids])).logits[0].double().numpy()
    assert np.array_equal(got, source.logits)


def test_export_onnx_from_the_gguf_passes_verify_parity(source, tmp_path):
    """The export of the GGUF passes verify parity against the GGUF with its source check (llama.cpp on the file,
    with an F32 KV cache and, for the GELU families, the allowance for ggml's tanh GELU table:
    tests/test_source_check_families.py)."""
    out = tmp_path / "onnx" / "model.onnx"
    assert_ok(invoke(["export", "onnx", str(source.gguf), "-o", str(out), "-q"]))
    r = invoke(["verify", "parity", str(out), "--source", str(source.gguf), "-q", "--format", "json"])
    assert_ok(r)
    data = json.loads(r.stdout)
    assert data["passed"] and data["source_check"]["checked"]


def rewrite(src: Path, dst: Path, drop: tuple[str, ...] = (), tensors: dict[str, np.ndarray] | None = None) -> Path:
    """SRC's keys (less DROP) and tensors (those in TENSORS replaced), written to DST by the gguf library's writer."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop:
            continue
        kind = gguf.GGUFValueType(f.types[0])
        w.add_key_value(f.name, f.contents(), kind,
                        sub_type=gguf.GGUFValueType(f.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name  # the tiny sources' float32, as written
        w.add_tensor(t.name, np.ascontiguousarray((tensors or {}).get(t.name, t.data)))
    finish_gguf(w)
    return dst


def test_a_file_with_only_the_converters_keys_reads_the_same(source, tmp_path):
    """llama.cpp's converter writes fewer keys than we do (no vocab_size, key/value_length, rope.freq_base; gptneox no
    head_count_kv): what it leaves out is read as llama.cpp defaults it, the same config and tensors."""
    from llama_tools.checkpoints.gguf.tensors import read_gguf_checkpoint

    arch = source.arch
    left_out = {"gptneox": ("vocab_size", "attention.key_length", "attention.value_length", "rope.freq_base",
                            "attention.head_count_kv"),
                "falcon": ("vocab_size", "attention.key_length", "attention.value_length", "rope.freq_base",
                           "rope.dimension_count"),
                "qwen3moe": ("vocab_size",)}[arch]
    lean = rewrite(source.gguf, tmp_path / "lean.gguf", tuple(f"{arch}.{k}" for k in left_out))
    ours, theirs = read_gguf_checkpoint(source.gguf), read_gguf_checkpoint(lean)
    assert theirs.cfg.replace(name="m", source="") == ours.cfg.replace(name="m", source="")
    assert all(torch.equal(theirs.state[k], v) for k, v in ours.state.items())


# --- (3) negative cases: the comparison sees a wrong file ----------------------------------------------------------

def test_negative_qkv_rows_in_hfs_packed_order_are_far(source, tmp_path):
    """attn_qkv with HF's query_key_value rows as they are (the converter's regrouping left out; Falcon-7B's one KV
    group needs none, so its k and v rows swapped): llama.cpp's logits are far from transformers' where the file as
    written is within bound. Qwen3-MoE: experts 0 and 1 swapped."""
    r = gguf.GGUFReader(source.gguf)
    state = source.hf.state_dict()
    if source.arch == "qwen3moe":
        swap = {}
        for t in r.tensors:
            if "_exps" in t.name:
                a = np.array(t.data)
                a[[0, 1]] = a[[1, 0]]  # [experts, rows, columns]: experts 0 and 1 trade places
                swap[t.name] = a
    else:
        base = "gpt_neox.layers.{}.attention" if source.arch == "gptneox" else "transformer.h.{}.self_attention"
        swap = {f"blk.{j}.attn_qkv.{p}": state[f"{base.format(j)}.query_key_value.{p}"].numpy()
                for j in range(SIZES["num_hidden_layers"]) for p in ("weight", "bias")
                if f"{base.format(j)}.query_key_value.{p}" in state}
        if source.case == "falcon_7b":  # one KV group: HF's rows are cat(q, k, v) already; k and v swapped instead
            q = SIZES["hidden_size"]
            swap = {n: np.concatenate([w[:q], w[q + 16:], w[q:q + 16]]) for n, w in swap.items()}  # n6 = 16
    bad = rewrite(source.gguf, tmp_path / "bad.gguf", tensors=swap)
    assert rel_rms(llama_logits(bad, source.ids), source.logits) > FAR


# --- (4) what llama.cpp's architecture cannot hold is refused in one line ------------------------------------------

@pytest.mark.parametrize("case, changes, named", [
    ("falcon_7b", dict(bias=True), "biases on the Linears"),
    ("falcon_7b", dict(parallel_attn=False, multi_query=False), "a sequential block"),
    ("neox_parallel", dict(attention_bias=False), "Linears without biases"),
    ("neox_parallel", dict(tie_word_embeddings=True), "tied embeddings"),
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob false"),
])
def test_what_the_architecture_cannot_hold_is_one_line(case, changes, named, tmp_path):
    prefix, fields = CASES[case]
    getattr(transformers, f"{prefix}Config")(**SIZES, **{**fields, **changes}).save_pretrained(tmp_path / "c")
    r = invoke(["convert", str(tmp_path / "c" / "config.json"), str(tmp_path / "x.gguf"), "--to", "gguf"])
    assert_one_line(r, named, "--to hf")
    assert not (tmp_path / "x.gguf").exists()
