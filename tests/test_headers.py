"""Counting a checkpoint from its headers: what the files hold, against the config, without reading data."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from helpers import write_sparse_safetensors
from llama_tools.cli.model_cmds import checkpoint_rows as render_rows
from llama_tools.checkpoints.header_readers import read_safetensors_header
from llama_tools.checkpoints.torch_headers import read_torch_header
from llama_tools.checkpoints.inspection import inspect_checkpoint
from llama_tools.modeling.model import build_model
from llama_tools.modeling.weights import weight_specs

TINY = get_preset("tiny")


def tiny_state(cfg=TINY):
    return {k: v.detach() for k, v in build_model(cfg, seed=0).state_dict().items()}


def test_safetensors_header_agrees_with_safetensors(tmp_path):
    state = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.ones(7), "c": torch.arange(4)}
    save_file(state, str(tmp_path / "x.safetensors"))
    infos = read_safetensors_header(tmp_path / "x.safetensors")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        truth = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert {t.name: t.shape for t in infos} == {k: v[0] for k, v in truth.items()}
    assert {t.name: t.dtype for t in infos} == {"a": "bfloat16", "b": "float32", "c": "int64"}
    assert {t.name: t.nbytes for t in infos} == {k: v.numel() * v.element_size() for k, v in state.items()}


def test_torch_header_agrees_with_torch_load(tmp_path):
    base = torch.randn(10, 4)
    state = {"half": torch.ones(2, 3, dtype=torch.float16), "view": base[2:5], "param": torch.nn.Parameter(base),
             "bf": torch.zeros(6, dtype=torch.bfloat16)}
    torch.save(state, tmp_path / "x.bin")
    infos = read_torch_header(tmp_path / "x.bin")
    loaded = torch.load(tmp_path / "x.bin", weights_only=True)
    assert [t.name for t in infos] == list(loaded)
    for t in infos:
        assert t.shape == tuple(loaded[t.name].shape), t.name
        assert t.dtype == str(loaded[t.name].dtype).removeprefix("torch."), t.name
        assert t.nbytes == loaded[t.name].numel() * loaded[t.name].element_size()


def test_inspect_hf_sharded_matches_config(tmp_path):
    save_checkpoint(TINY, tiny_state(), tmp_path, shards=2)
    insp = inspect_checkpoint(tmp_path)
    assert insp.format == "safetensors" and insp.layout == "hf" and len(insp.files) == 2
    truth = sum(s.numel for s in weight_specs(TINY))
    assert insp.total_params == insp.expected_params == truth == 158016  # the tiny preset's count
    assert insp.total_bytes == 4 * truth
    assert [(d.dtype, d.params) for d in insp.by_dtype] == [("float32", truth)]
    assert all(c.found_params == c.expected_params for c in insp.by_component)
    assert insp.ok and not insp.unexplained and not insp.missing and not insp.mismatched


def test_inspect_meta_shards_merges_along_shard_axes(tmp_path):
    save_checkpoint(TINY, tiny_state(), tmp_path / "hf")
    save_checkpoint(TINY, tiny_state(), tmp_path / "meta", to="meta", shards=2)
    hf, meta = inspect_checkpoint(tmp_path / "hf"), inspect_checkpoint(tmp_path / "meta")
    assert meta.format == "meta" and meta.layout == "meta" and meta.ok
    by_meta = {s.meta_name: s.shape for s in weight_specs(TINY)}
    assert {t.name: t.shape for t in meta.tensors} == by_meta
    assert meta.total_params == hf.total_params


def test_inspect_flags_unexplained_missing_and_mismatched(tmp_path):
    state = tiny_state()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["model.layers.0.self_attn.mystery.weight"] = torch.ones(3, 3)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(TINY)))
    save_file(state, str(tmp_path / "model.safetensors"))
    insp = inspect_checkpoint(tmp_path)
    assert sorted(t.name for t in insp.unexplained) == ["model.layers.0.self_attn.mystery.weight",
                                                        "model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert [m.name for m in insp.missing] == ["model.layers.1.mlp.up_proj.weight"]
    assert [(m.name, m.expected, m.found) for m in insp.mismatched] == [
        ("model.layers.1.mlp.down_proj.weight", (64, 176), (64, 100))]
    assert not insp.ok
    rows = render_rows(insp)
    sections = [r["section"] for r in rows]
    assert sections.count("unexplained") == 2 and "missing" in sections and "mismatch" in sections
    assert rows[-1]["section"] == "total" and rows[-1]["note"] == "DIFFERS from config"
    assert "skipped when loading" in next(r["note"] for r in rows if r["name"].endswith("inv_freq"))
    # inv_freq alone is benign: the checkpoint still matches its config.
    clean = tiny_state()
    clean["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(clean, str(tmp_path / "model.safetensors"))
    assert inspect_checkpoint(tmp_path).ok


def test_baichuan_w_pack_counts_toward_q_k_v(tmp_path):
    cfg = TINY.replace(family="baichuan", num_key_value_heads=4)
    save_checkpoint(cfg, tiny_state(cfg), tmp_path)
    insp = inspect_checkpoint(tmp_path)
    assert insp.layout == "baichuan" and insp.ok
    comp = {c.component: c.found_params for c in insp.by_component}
    assert comp["attn.q"] == comp["attn.k"] == comp["attn.v"] == 2 * 64 * 64


def test_header_reader_refuses_pickled_objects(tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "executed"), "w"))

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match=r"evil.pth: refused: contains .*open"):
        read_torch_header(tmp_path / "evil.pth")
    assert not (tmp_path / "executed").exists()


def test_70b_sparse_checkpoint_is_counted_from_headers_fast(tmp_path):
    cfg = get_preset("llama-2-70b")
    files = write_sparse_safetensors(cfg, tmp_path, shards=15)
    assert sum(f.stat().st_size for f in files) > 137e9  # apparent size: 69 G params in bf16
    start = time.perf_counter()
    insp = inspect_checkpoint(tmp_path)
    elapsed = time.perf_counter() - start
    assert insp.ok and insp.total_params == 68_976_648_192  # LLaMA-2-70B's published count
    assert elapsed < 0.5
    f = files[0]
    with open(f, "r+b") as fh:  # shrink the last file: the header now promises more than it holds
        fh.truncate(f.stat().st_size - 1)
    with pytest.raises(ValueError, match="truncated"):
        inspect_checkpoint(tmp_path)
