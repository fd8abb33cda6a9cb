"""GGUF files: read through the gguf library, counted from headers, converted, exported and verified.

A tiny seeded model is written as GGUF with the library's own writer, as llama.cpp's converter writes one:
llama.cpp's tensor names (gguf.TensorNameMap), q/k rows permuted by llama.cpp's `permute`, F32 and Q8_0
tensors. Truth is independent of our reader: the seeded model itself, gguf.quants on the original
weights, and transformers' GGUF loader. The real SmolLM2 Q4_1 GGUF is checked too (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

gguf = pytest.importorskip("gguf")

from llama_tools.counting.accounting import count_source  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.modeling.config import ModelConfig  # noqa: E402
from llama_tools.checkpoints.convert import convert  # noqa: E402
from llama_tools.checkpoints.formats import FORMATS, checkpoint_tensors  # noqa: E402
from llama_tools.checkpoints.gguf.tensors import GgufReader  # noqa: E402
from llama_tools.checkpoints.loading import load_model  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.modeling.weights import weight_specs  # noqa: E402
from helpers import add_llama_hparams, export_and_verify, finish_gguf  # noqa: E402

Q8_0, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
TOKENS = (["<unk>", "<s>", "</s>"] + [chr(c) for c in range(97, 123)] + [chr(c) for c in range(65, 91)] + ["Ġ"]
          + ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"])  # 64: specials, letters, merges of letter pairs


def tiny_cfg(tied: bool) -> ModelConfig:
    return ModelConfig(name="gguf-tiny", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=tied)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half q/k rows -> GGML's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_type(hf_name: str, ndim: int) -> "gguf.GGMLQuantizationType":
    """q/k stored F32 (their row order is checked exactly), the other matrices Q8_0, norms F32."""
    return Q8_0 if ndim == 2 and not any(p in hf_name for p in (".q_proj.", ".k_proj.")) else F32


def add_vocabulary(w: Any) -> None:
    """TOKENS as a byte-level BPE vocabulary (tokenizer.ggml.*) with <s> 1 and </s> 2, as llama.cpp writes one."""
    w.add_tokenizer_model("gpt2")  # convert carries it as tokenizer.json
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * 61)
    w.add_token_merges([f"{t[0]} {t[1]}" for t in TOKENS[-8:]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(path: Path, *, tied: bool = True, arch: str = "llama", seed: int = 3, block_count: int | None = None,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A seeded tiny model as a GGUF file; returns its HF-named fp32 weights (as the model holds them)."""
    from llama_tools.modeling.model import build_model

    cfg = tiny_cfg(tied)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in build_model(cfg, seed=seed).state_dict().items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_hparams(w, cfg, block_count)
    add_vocabulary(w)
    for s in weight_specs(cfg):
        if tied and s.name == "lm_head.weight":
            continue  # llama.cpp leaves a tied lm_head out
        a = state[s.name]
        if ".q_proj." in s.name:
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif ".k_proj." in s.name:
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        q = quant_type(s.name, a.ndim)
        w.add_tensor(names.get_name(s.name, try_suffixes=(".weight", ".bias")), gguf.quants.quantize(a, q), raw_dtype=q)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    finish_gguf(w)
    return state


def expected_weight(state: dict[str, np.ndarray], name: str) -> np.ndarray:
    """What dequantizing the stored tensor must give: Q8_0 round trip by the library, F32 exact."""
    a = state[name]
    q = quant_type(name, a.ndim)
    return gguf.quants.dequantize(gguf.quants.quantize(a, q), q).reshape(a.shape) if q == Q8_0 else a


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    state = write_gguf(d / "tiny.gguf")
    return d / "tiny.gguf", state


# --- names, config, counting -------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_format_names_are_llama_cpps(tied):
    """Our 'gguf' format names every weight as gguf.TensorNameMap (llama.cpp's table) does."""
    cfg = tiny_cfg(tied)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for ct in checkpoint_tensors(cfg, FORMATS["gguf"]):
        assert ct.name == names.get_name(ct.parts[0], try_suffixes=(".weight", ".bias")), ct


@pytest.mark.parametrize("tied", [True, False])
def test_config_and_count_from_headers(tmp_path, tied):
    path = tmp_path / "m.gguf"
    state = write_gguf(path, tied=tied)
    src = resolve(str(path))
    want = tiny_cfg(tied)
    assert src.kind == "checkpoint" and src.weights is not None and src.weights.kind == "gguf"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert getattr(src.cfg, field) == getattr(want, field), field
    count = count_source(src)
    insp = count.checkpoint
    assert insp is not None and insp.ok and insp.layout == "gguf"
    assert count.total == sum(a.size for n, a in state.items() if not (tied and n == "lm_head.weight"))
    assert insp.total_params == count.total
    sizes = {d.dtype: d for d in insp.by_dtype}
    assert set(sizes) == {"F32", "Q8_0"}
    for name, d in sizes.items():  # exact integers: llama.cpp's block of weights and its bytes
        weights, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (d.block_weights, d.block_bytes) == (weights, nbytes)
        assert d.bytes * weights == d.params * nbytes
    assert insp.total_bytes == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)


def test_count_params_cli_table_and_json(tiny_gguf):
    path, _ = tiny_gguf
    r = CliRunner().invoke(cli, ["count-params", str(path)])
    assert r.exit_code == 0, r.output
    assert "34 bytes per 32 weights" in r.output and "matches config" in r.output
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)[0]
    assert data["checkpoint"]["layout"] == "gguf" and data["n8"] == 2


def test_not_llama_is_one_line_and_counted_from_its_header(tmp_path):
    """Another architecture: refused in one line by what runs the model; count-params counts its header."""
    path = tmp_path / "gpt2.gguf"
    state = write_gguf(path, arch="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not LLaMA-family"):
        resolve(str(path))
    r = CliRunner().invoke(cli, ["generate", str(path), "--ids", "1"])
    assert r.exit_code == 1 and "'gpt2'" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)[0]
    tied = sum(a.size for k, a in state.items() if k != "lm_head.weight")  # write_gguf leaves a tied lm_head out
    assert data["counted_from"] == "headers" and data["architecture"] == "gpt2" and data["total"] == tied


def test_truncated_or_foreign_file_is_one_line(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all" * 10)
    for p in (cut, fake):
        r = CliRunner().invoke(cli, ["count-params", str(p)])
        assert r.exit_code == 1 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_layer_count_and_extra_tensor(tmp_path):
    """Metadata saying another layer count is one line; a tensor no weight explains: flagged, and refused by the reader."""
    write_gguf(tmp_path / "layers.gguf", block_count=3)
    r = CliRunner().invoke(cli, ["count-params", str(tmp_path / "layers.gguf")])
    assert r.exit_code == 1 and "says 3 decoder layers" in r.output and "holds tensors of 2" in r.output, r.output
    path = tmp_path / "extra.gguf"
    write_gguf(path, extra={"blk.0.odd.weight": np.ones(64, np.float32)})
    r = CliRunner().invoke(cli, ["count-params", str(path), "--check"])
    assert r.exit_code == 1 and "blk.0.odd.weight" in r.output
    with pytest.raises(ValueError, match="'blk.0.odd.weight' is not a weight"):
        GgufReader(path)


# --- dequantized weights: reader, convert, transformers ----------------------------------------------------

def test_reader_dequantizes_in_stored_rope_order(tiny_gguf):
    path, state = tiny_gguf
    reader = GgufReader(path)
    assert reader.cfg.rope_layout == FORMATS["gguf"].rope_layout == "interleaved"
    cfg = reader.cfg
    for name in reader.where:
        got = reader.read([name])[name].numpy()
        want = expected_weight(state, name)
        if ".q_proj." in name:
            want = llama_cpp_permute(want, cfg.num_attention_heads)
        elif ".k_proj." in name:
            want = llama_cpp_permute(want, cfg.num_key_value_heads)
        np.testing.assert_array_equal(got, want, err_msg=name)
    rows = reader.rows("model.embed_tokens.weight", [(3, 5), (60, 64)]).numpy()
    emb = expected_weight(state, "model.embed_tokens.weight")
    np.testing.assert_array_equal(rows, np.concatenate([emb[3:5], emb[60:64]]))


@pytest.mark.parametrize("cache", [True, False])
def test_a_layer_read_again_is_dequantized_once(tiny_gguf, monkeypatch, cache):
    """verify parity reads each layer three times (graph dtype, reassociated, float64): each tensor is dequantized
    once, every read still a fresh array of the same values; without the cache (or past its bytes), every time."""
    path, state = tiny_gguf
    reader = GgufReader(path, cache=cache)
    calls = []
    real = reader._dequantized
    monkeypatch.setattr(reader, "_dequantized", lambda stored, ranges=None: calls.append(stored) or real(stored, ranges))
    layer = [n for n in reader.where if n.startswith("model.layers.1.")]
    first = reader.read(layer)
    for name, t in first.items():
        t.fill_(7.0)  # the caller's own memory: the next read is not changed by it
    for _ in range(2):
        again = reader.read(layer)
        for name in layer:
            want = expected_weight(state, name)
            if ".q_proj." in name or ".k_proj." in name:
                want = llama_cpp_permute(want, 4 if ".q_proj." in name else 2)
            np.testing.assert_array_equal(again[name].numpy(), want, err_msg=name)
    assert sorted(calls) == sorted([reader.where[n] for n in layer] * (1 if cache else 3))
    reader.read([n for n in reader.where if n.startswith("model.layers.0.")])  # the next layer: all of it new
    assert len(calls) == len(layer) * (2 if cache else 4)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_to_hf_equals_transformers_gguf_loader(tmp_path, tied):
    """convert FILE.gguf --to hf: q/k rows back in HF order; logits equal transformers' own GGUF loader's."""
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m.gguf"
    state = write_gguf(path, tied=tied)
    res = convert(str(path), tmp_path / "hf", to="hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(res.files)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    for name, arr in saved.items():  # the original HF rows, through Q8_0 where stored so
        np.testing.assert_array_equal(arr, expected_weight(state, name), err_msg=name)
    assert ("lm_head.weight" in saved) == (not tied)
    ids = torch.tensor([[1, 5, 9, 33, 60, 7, 2]])
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    ours_tf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(tmp_path / "hf")
    with torch.no_grad():
        a, b, c = theirs(ids).logits, ours_tf(ids).logits, ours(ids).logits
    assert torch.equal(a, b)  # the same weights in the same model code
    torch.testing.assert_close(c, a, rtol=0, atol=1e-5)  # our model: fp32 rounding
    # Negative case: the rows left in GGUF's interleaved order give other logits.
    sd = {k: torch.from_numpy(v) for k, v in saved.items()}
    from llama_tools.checkpoints.layouts import half_to_interleaved

    for k in sd:
        if ".q_proj." in k:
            sd[k] = half_to_interleaved(sd[k], 4)
    ours_tf.load_state_dict(sd, strict=False)
    with torch.no_grad():
        assert (ours_tf(ids).logits - a).abs().max() > 1e-3


def test_convert_dtype_and_meta(tmp_path):
    path = tmp_path / "m.gguf"
    state = write_gguf(path, tied=False)
    res = convert(str(path), tmp_path / "bf16", to="hf", dtype="bfloat16")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in saved.values()) and res.bytes == 2 * res.params
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(saved[name], torch.from_numpy(expected_weight(state, name)).to(torch.bfloat16))
    r = CliRunner().invoke(cli, ["convert", str(path), str(tmp_path / "meta"), "--to", "meta"])
    assert r.exit_code == 0, r.output
    back = load_model(tmp_path / "meta")
    ref = load_model(tmp_path / "bf16", dtype="float32")
    ids = torch.tensor([[1, 4, 8, 15]])
    with torch.no_grad():  # Meta's interleaved rows (fp32) against HF's (bf16): the same model to bf16 rounding
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=5e-2)


def test_load_gguf_model_in_either_row_order(tiny_gguf, tmp_path):
    from llama_tools.checkpoints.gguf.tensors import load_gguf_model

    path, _ = tiny_gguf
    convert(str(path), tmp_path / "hf", to="hf")
    ids = torch.tensor([[1, 5, 9, 33, 60]])
    with torch.no_grad():
        want = load_model(tmp_path / "hf")(ids).logits
        for layout in (None, "half"):
            model = load_gguf_model(path, rope_layout=layout)
            assert model.cfg.rope_layout == (layout or "interleaved")
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-5)


def test_load_model_generate_and_fused_export_take_a_gguf(tiny_gguf, tmp_path):
    """MODEL may be the .gguf itself wherever a checkpoint directory is taken: the same logits and tokens."""
    path, _ = tiny_gguf
    convert(str(path), tmp_path / "hf", to="hf")
    ids = torch.tensor([[1, 5, 9, 33, 60]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(ids).logits, load_model(tmp_path / "hf")(ids).logits,
                                   rtol=0, atol=1e-5)
    runs = [CliRunner().invoke(cli, ["generate", str(m), "--ids", "1 5 9", "--max-new-tokens", "6", "--format", "json"])
            for m in (path, tmp_path / "hf")]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert json.loads(runs[0].stdout)["new_ids"] == json.loads(runs[1].stdout)["new_ids"]
    r = CliRunner().invoke(cli, ["export", "onnx", str(path), "-o", str(tmp_path / "f" / "m.onnx"), "--optimize",
                                 "--no-client-files", "--format", "json"])
    assert r.exit_code == 0, r.output


def test_streamed_reference_reads_gguf(tiny_gguf, tmp_path):
    from llama_tools.inference.reference import reference_model

    path, _ = tiny_gguf
    convert(str(path), tmp_path / "hf", to="hf")
    ref = reference_model(str(path))
    ids = torch.tensor([[1, 5, 9, 33, 60], [2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, load_model(tmp_path / "hf")(ids).logits, rtol=0, atol=1e-5)


def test_export_onnx_and_verify_parity_from_gguf(tiny_gguf, tmp_path):
    pytest.importorskip("onnxruntime")
    path, _ = tiny_gguf
    export_and_verify(path, tmp_path)


# --- the real file (SmolLM2-135M-Instruct Q4_1) ------------------------------------------------------------

_RSS_SCRIPT = """
import resource, sys, time
from llama_tools.counting.accounting import count_source
import gguf  # imported before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
c = count_source(sys.argv[1])
print(time.perf_counter() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024,
      c.checkpoint.ok, c.total)
"""


@pytest.mark.slow
def test_real_gguf_counted_without_reading_data(smollm2_gguf):
    """count-params on the 98 MB file: the headers' parse adds far less memory than the tensor data."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(smollm2_gguf)], capture_output=True, text=True,
                         check=True).stdout.split()
    grew, ok, total = int(out[1]), out[2] == "True", int(out[3])
    assert ok and total == 134_515_008
    assert grew < 0.5 * smollm2_gguf.stat().st_size, f"RSS grew by {grew} bytes"


@pytest.mark.slow
def test_real_gguf_convert_equals_transformers(smollm2_gguf, smollm2_hf, tmp_path):
    """Our dequantization and q/k order equal transformers' GGUF loader's, bit for bit, on the real file."""
    from safetensors import safe_open

    res = convert(str(smollm2_gguf), tmp_path / "hf", to="hf")
    assert "tokenizer.json" in res.files
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as ours, \
            safe_open(str(smollm2_hf / "model.safetensors"), "pt") as theirs:
        names = set(ours.keys())
        assert names == set(theirs.keys()) - {"lm_head.weight"}  # transformers may save the tied copy
        for n in names:
            assert torch.equal(ours.get_tensor(n), theirs.get_tensor(n)), n
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 28]])
    with torch.no_grad():
        a = load_model(tmp_path / "hf")(ids).logits
        b = load_model(smollm2_hf)(ids).logits
    assert torch.equal(a, b)
