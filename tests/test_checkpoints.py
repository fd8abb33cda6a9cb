"""Checkpoint layouts on disk: every format a user's 7B ships in, written as a tiny model and loaded
through `load_model(DIR)`, must compute the same logits as the model it was written from.

The Meta files are written here by hand (own name table, own q/k permutation, own shard axes), not by
the package's converter, so the loader is checked against an independent writer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from llama_tools import load_model
from llama_tools.checkpoints.load import load_checkpoint, read_checkpoint, torch_load
from llama_tools.cli import cli
from llama_tools.checkpoints.config_files import config_from_meta, config_to_hf
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.checkpoints.layouts import half_to_interleaved, interleaved_to_half
from llama_tools.modeling.model import build_model

TINY = get_preset("tiny")  # 4 query heads over 2 KV heads: GQA, so a k permutation with n5 would show
IDS = torch.tensor([[1, 17, 300, 5, 99, 42, 7, 250, 3, 64, 128, 11]])


def reference(cfg=TINY, seed=0):
    """A random model with large attention weights (RoPE and masking matter) and its state dict."""
    model = build_model(cfg, seed=seed, init_std=0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(15.0)
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # gains differ per row: a row order mistake in norms shows
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return model, state


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def assert_same(model, ref, tol=1e-5):
    a, b = logits(model), logits(ref)
    assert a.shape == b.shape == (1, IDS.shape[1], ref.cfg.vocab_size)
    assert a.dtype == b.dtype == torch.float32
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def write_hf_config(d: Path, cfg) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_to_hf(cfg)))


# --- HF layouts ----------------------------------------------------------------------------------

def test_hf_safetensors_single_and_sharded(tmp_path):
    ref, state = reference()
    save_checkpoint(TINY, state, tmp_path / "one")
    save_checkpoint(TINY, state, tmp_path / "sharded", shards=3)
    assert (tmp_path / "sharded" / "model-00003-of-00003.safetensors").is_file()
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    for d in ("one", "sharded"):
        model = load_model(tmp_path / d)
        assert model.cfg.rope_layout == "half"
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k  # bit-exact
        assert_same(model, ref, tol=0)


def test_hf_bin_single_and_indexed(tmp_path):
    ref, state = reference()
    write_hf_config(tmp_path / "bin", TINY)
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    assert_same(load_model(tmp_path / "bin"), ref, tol=0)
    d = tmp_path / "bin2"
    write_hf_config(d, TINY)
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for fname, keys in halves.items():
        torch.save({k: state[k] for k in keys}, d / fname)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    assert_same(load_model(d), ref, tol=0)


def test_bf16_stored_weights_and_dtype_cast(tmp_path):
    ref, state = reference()
    write_hf_config(tmp_path, TINY.replace(torch_dtype="bfloat16"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    as_fp32 = load_model(tmp_path)
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    bf = build_model(TINY, seed=0)
    bf.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    assert_same(as_fp32, bf, tol=0)  # bf16 values, upcast exactly
    as_bf16 = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in as_bf16.parameters()} == {torch.bfloat16}


def test_tied_embeddings_and_qwen2_biases(tmp_path):
    for name, cfg in (("tied", TINY.replace(tie_word_embeddings=True)),
                      ("qwen2", TINY.replace(family="qwen2", qkv_bias=True))):
        ref, state = reference(cfg)
        save_checkpoint(cfg, state, tmp_path / name)
        stored = load_file(str(tmp_path / name / "model.safetensors"))
        assert ("lm_head.weight" in stored) == (name != "tied")
        assert ("model.layers.0.self_attn.q_proj.bias" in stored) == (name == "qwen2")
        model = load_model(tmp_path / name)
        if name == "tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight
        assert_same(model, ref, tol=0)


def test_rotary_inv_freq_buffer_is_skipped(tmp_path):
    ref, state = reference()
    write_hf_config(tmp_path, TINY)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(TINY.head_dim // 2)}
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"))
    assert_same(load_model(tmp_path), ref, tol=0)


# --- Meta layout, written independently -----------------------------------------------------------

META_NAMES = {"model.embed_tokens": "tok_embeddings", "self_attn.q_proj": "attention.wq",
              "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
              "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
              "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm", "model.norm": "norm",
              "lm_head": "output", "model.layers": "layers"}
SHARD_AXIS = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}


def to_meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF half-split rows -> Meta interleaved rows, by explicit indices: row 2i <- i, row 2i+1 <- i + n6/2."""
    n6 = w.shape[0] // heads
    idx = [h * n6 + i + half for h in range(heads) for i in range(n6 // 2) for half in (0, n6 // 2)]
    return w[idx]


def write_meta(d: Path, cfg, state, shards: int, k_heads: int | None = None, params: dict | None = None) -> None:
    d.mkdir(parents=True)
    meta = {}
    for name, w in state.items():
        if "q_proj" in name:
            w = to_meta_rows(w, cfg.num_attention_heads)
        if "k_proj" in name:
            w = to_meta_rows(w, k_heads or cfg.num_key_value_heads)
        mname = name
        for a, b in META_NAMES.items():
            mname = mname.replace(a, b)
        meta[mname] = w
    for i in range(shards):
        shard = {}
        for name, w in meta.items():
            axis = SHARD_AXIS.get(name.split(".")[-2])
            shard[name] = w if axis is None else w.chunk(shards, dim=axis)[i].clone()
        torch.save(shard, d / f"consolidated.{i:02d}.pth")
    (d / "params.json").write_text(json.dumps(params or {
        "dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads, "vocab_size": -1, "multiple_of": 16, "norm_eps": cfg.rms_norm_eps}))


def test_layout_permutations_are_inverse_and_match_index_formula():
    w = torch.randn(2 * 8, 3)  # 2 heads of n6 = 8
    assert torch.equal(half_to_interleaved(w, 2), to_meta_rows(w, 2))
    assert torch.equal(interleaved_to_half(half_to_interleaved(w, 2), 2), w)
    assert not torch.equal(half_to_interleaved(w, 1), half_to_interleaved(w, 2))  # the head count matters


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_shards_give_same_logits_in_both_rope_layouts(tmp_path, shards):
    ref, state = reference()
    assert TINY.intermediate_size == 176  # int(8 * 64 / 3) = 170 rounded up to multiple_of 16
    write_meta(tmp_path / "meta", TINY, state, shards)
    hf_dir = tmp_path / "hf"
    save_checkpoint(TINY, state, hf_dir)
    hf = load_model(hf_dir)
    native = load_model(tmp_path / "meta")  # kept interleaved: the model rotates pairs (x0, x1), ...
    assert native.cfg.rope_layout == "interleaved" and native.cfg.vocab_size == TINY.vocab_size
    permuted = load_checkpoint(tmp_path / "meta", rope_layout="half")  # rows reordered for rotate_half
    assert permuted.cfg.rope_layout == "half"
    for k, v in permuted.state_dict().items():
        assert torch.equal(v, hf.state_dict()[k]), k
    assert_same(permuted, hf, tol=0)
    assert_same(native, hf, tol=1e-5)  # same function, different float summation order


def test_meta_names_in_safetensors_mistral_style(tmp_path):
    """Mistral's repos ship Meta-named, interleaved weights as consolidated.safetensors next to params.json."""
    ref, state = reference()
    write_meta(tmp_path / "m", TINY, state, 1)
    pth = tmp_path / "m" / "consolidated.00.pth"
    save_file(torch.load(pth, weights_only=True), str(tmp_path / "m" / "consolidated.safetensors"))
    pth.unlink()
    model = load_model(tmp_path / "m")
    assert model.cfg.rope_layout == "interleaved"
    assert_same(model, ref, tol=1e-5)


def test_meta_k_permuted_with_query_heads_is_caught(tmp_path):
    """The classic GQA bug (k permuted per query head) must change the logits."""
    ref, state = reference()
    write_meta(tmp_path / "buggy", TINY, state, 1, k_heads=TINY.num_attention_heads)
    a, b = logits(load_model(tmp_path / "buggy")), logits(ref)
    assert (a - b).abs().max().item() > 1e-2


def test_meta_ffn_dim_multiplier(tmp_path):
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "multiple_of": 32,
              "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5}
    cfg = config_from_meta(params)
    assert cfg.intermediate_size == 224  # int(1.3 * int(8 * 64 / 3)) = 221 -> next multiple of 32
    ref, state = reference(TINY.replace(intermediate_size=224))
    write_meta(tmp_path / "m", cfg, state, 2, params=params)
    assert_same(load_model(tmp_path / "m"), ref, tol=1e-5)


# --- Baichuan --------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["baichuan-7b", "baichuan2-13b"])
def test_baichuan_w_pack(tmp_path, variant):
    cfg = TINY.replace(family="baichuan", num_key_value_heads=4, norm_head=variant.startswith("baichuan2"),
                       position_encoding="alibi" if variant.endswith("13b") else "rope")
    ref, state = reference(cfg)
    save_checkpoint(cfg, state, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    w_pack = stored["model.layers.1.self_attn.W_pack.weight"]
    assert w_pack.shape == (3 * 64, 64)
    assert torch.equal(w_pack, torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert "model.layers.1.self_attn.q_proj.weight" not in stored
    model = load_model(tmp_path)
    assert model.cfg.norm_head == cfg.norm_head and model.cfg.position_encoding == cfg.position_encoding
    assert_same(model, ref, tol=0)


def test_internlm2_wqkv_grouped_per_kv_head(tmp_path):
    cfg = TINY.replace(family="internlm2")  # 4 query heads over 2 KV heads of n6 = 16
    ref, state = reference(cfg)
    save_checkpoint(cfg, state, tmp_path)
    wqkv = load_file(str(tmp_path / "model.safetensors"))["model.layers.0.attention.wqkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    blocks = lambda w: list(w.split(16))  # noqa: E731  (one block of n6 rows per head)
    # Per KV head g: its two query heads, then k_g, then v_g (InternLM2's layout, built here by hand).
    expected = torch.cat([torch.cat(blocks(q)[2 * g: 2 * g + 2] + [blocks(k)[g], blocks(v)[g]]) for g in range(2)])
    assert torch.equal(wqkv, expected)
    assert_same(load_model(tmp_path), ref, tol=0)


# --- convert ---------------------------------------------------------------------------------------

def test_convert_round_trip_is_exact(tmp_path):
    ref, state = reference()
    save_checkpoint(TINY, state, tmp_path / "hf")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "hf"), str(tmp_path / "meta"), "--to", "meta",
                                 "--shards", "2"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "meta").iterdir()) == ["consolidated.00.pth", "consolidated.01.pth",
                                                                      "params.json"]
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "meta"), str(tmp_path / "back"), "--to", "hf",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tensors"] == len(state)
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same(load_model(tmp_path / "meta"), ref, tol=1e-5)
    # Meta's format cannot hold Qwen2's biases: refused in one line, nothing written.
    cfg = TINY.replace(family="qwen2", qkv_bias=True)
    save_checkpoint(cfg, reference(cfg)[1], tmp_path / "qwen")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "qwen"), str(tmp_path / "qm"), "--to", "meta"])
    assert r.exit_code == 1 and "biases" in r.output and not (tmp_path / "qm").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


# --- bad input -------------------------------------------------------------------------------------

def run_error(model_dir: Path) -> str:
    r = CliRunner().invoke(cli, ["generate", str(model_dir), "--ids", "1 2", "--max-new-tokens", "1"])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output, r.output
    return lines[0]


def test_bad_checkpoints_give_one_line_naming_the_file(tmp_path):
    _, state = reference()
    sharded = tmp_path / "sharded"
    save_checkpoint(TINY, state, sharded, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    msg = run_error(sharded)
    assert "model.safetensors.index.json" in msg and "model-00002-of-00002.safetensors" in msg

    no_index = tmp_path / "no_index"
    save_checkpoint(TINY, state, no_index, shards=2)
    (no_index / "model.safetensors.index.json").unlink()
    (no_index / "model-00001-of-00002.safetensors").unlink()
    assert "missing shard 1 of 2" in run_error(no_index)

    trunc = tmp_path / "trunc"
    save_checkpoint(TINY, state, trunc)
    f = trunc / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    msg = run_error(trunc)
    assert "model.safetensors" in msg and "truncated" in msg
    r = CliRunner().invoke(cli, ["convert", str(trunc), str(tmp_path / "out"), "--to", "meta"])
    assert r.exit_code == 1 and "truncated" in r.output and not (tmp_path / "out").exists()

    big = tmp_path / "big_header"
    write_hf_config(big, TINY)
    (big / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    assert "header length 1000000 is larger than the file" in run_error(big)

    shape = tmp_path / "shape"
    save_checkpoint(TINY, state, shape)
    write_hf_config(shape, TINY.replace(intermediate_size=180))
    msg = run_error(shape)
    assert "model.safetensors" in msg and "[176, 64]" in msg and "[180, 64]" in msg

    nodim = tmp_path / "nodim"
    write_meta(nodim, TINY, state, 1, params={"n_layers": 2, "n_heads": 4})
    msg = run_error(nodim)
    assert "params.json" in msg and "'dim'" in msg


class Payload:
    """Unpickling this would create a file: the loader must refuse it before it runs."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pth_with_objects_is_refused_never_executed(tmp_path):
    _, state = reference()
    d = tmp_path / "evil"
    write_meta(d, TINY, state, 1)
    marker = tmp_path / "executed"
    shard = torch.load(d / "consolidated.00.pth", weights_only=True)
    torch.save({**shard, "extra": Payload(str(marker))}, d / "consolidated.00.pth")
    msg = run_error(d)
    assert "consolidated.00.pth" in msg and "refused" in msg
    with pytest.raises(ValueError, match="refused"):
        read_checkpoint(d)  # refused by the header reader's restricted unpickler
    with pytest.raises(ValueError, match=r"consolidated.00.pth: refused"):
        torch_load(d / "consolidated.00.pth")  # and by torch.load(weights_only=True) behind it
    assert not marker.exists()


def test_config_only_directory_still_means_random_init(tmp_path):
    write_hf_config(tmp_path, TINY)
    model = load_model(tmp_path, seed=3)
    assert_same(model, build_model(TINY, seed=3), tol=0)
