"""Any checkpoint counted from its headers, whatever the architecture; partial files counted, and refused by
every command that reads the weights.

The files are written here with the safetensors and gguf libraries' own writers, and truth is what was written:
the numel and bytes of each array, per dtype and per layer, and the complete file's size (a partial file's bytes
missing = complete size - truncated size).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from llama_tools.cli import cli
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.modeling.model import build_model
from llama_tools.modeling.presets import get_preset
from helpers import finish_gguf

gguf = pytest.importorskip("gguf")

from test_gguf import write_gguf  # noqa: E402  (the suite's tiny llama GGUF, as llama.cpp writes one)

RNG = np.random.default_rng(0)


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def gpt2_style() -> dict[str, np.ndarray]:
    """An architecture no family here models: transformer.h.N. names, fp32, fp16 and int64 tensors, a bias."""
    t: dict[str, np.ndarray] = {"transformer.wte.weight": RNG.standard_normal((50, 8)).astype(np.float16),
                                "transformer.wpe.weight": RNG.standard_normal((16, 8)).astype(np.float32)}
    for j in range(3):
        width = 24 if j < 2 else 40  # the last layer differs: its own run
        t[f"transformer.h.{j}.attn.c_attn.weight"] = RNG.standard_normal((8, width)).astype(np.float32)
        t[f"transformer.h.{j}.attn.c_attn.bias"] = np.zeros(width, np.float32)
        t[f"transformer.h.{j}.ln_1.weight"] = np.ones(8, np.float16)
    t["transformer.ln_f.weight"] = np.ones(8, np.float32)
    t["transformer.step"] = np.array([7], np.int64)
    return t


def truth(tensors: dict[str, np.ndarray]) -> dict[str, object]:
    """Totals of what the test wrote, by dtype (safetensors' names) and by layer index."""
    by_dtype: dict[str, list[int]] = {}
    by_layer: dict[int, int] = {}
    for name, a in tensors.items():
        acc = by_dtype.setdefault(str(a.dtype), [0, 0, 0])
        acc[0] += 1
        acc[1] += a.size
        acc[2] += a.nbytes
        parts = name.split(".")
        for k, p in enumerate(parts[:-1]):
            if p in ("h", "layers", "blk") and parts[k + 1].isdigit():
                by_layer[int(parts[k + 1])] = by_layer.get(int(parts[k + 1]), 0) + a.size
                break
    return {"total": sum(a.size for a in tensors.values()), "bytes": sum(a.nbytes for a in tensors.values()),
            "count": len(tensors), "by_dtype": by_dtype, "by_layer": by_layer}


NUMPY_DTYPE = {"float32": "float32", "float16": "float16", "int64": "int64"}  # ours -> numpy's names


def counted(*args: str) -> tuple[dict, object]:
    r = run("count-params", *args, "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)[0], r


def assert_counts(got: dict, want: dict) -> None:
    assert got["counted_from"] == "headers"
    assert (got["total"], got["total_bytes"], got["tensor_count"]) == (want["total"], want["bytes"], want["count"])
    assert {NUMPY_DTYPE[d["dtype"]]: [d["tensors"], d["params"], d["bytes"]] for d in got["by_dtype"]} == \
        want["by_dtype"]
    assert {t["layer"]: t["params"] for t in got["layers"]} == want["by_layer"]


# --- complete files ---------------------------------------------------------------------------------------------

def test_a_lone_safetensors_file_is_counted_from_its_header(tmp_path):
    tensors = gpt2_style()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    got, r = counted(str(path))
    assert_counts(got, truth(tensors))
    assert got["files"] == [{"file": "model.safetensors", "bytes_present": path.stat().st_size,
                             "bytes_declared": path.stat().st_size, "bytes_missing": 0}]
    assert not got["partial"] and r.stderr == ""  # the negative case: a complete file says no shortfall
    runs = [(x["stack"], x["first"], x["last"]) for x in got["layer_runs"]]
    assert runs == [("transformer.h", 0, 1), ("transformer.h", 2, 2)]  # identical layers folded, the odd one apart
    r = run("count-params", str(path))
    assert r.exit_code == 0 and "transformer.h.0-1" in r.stdout and "PARTIAL" not in r.stdout, r.output
    assert f"{truth(tensors)['total']:,}" in r.stdout
    per_layer = run("count-params", str(path), "--per-layer").stdout
    assert all(f"transformer.h.{j} " in per_layer for j in range(3))
    csv = run("count-params", str(path), "--format", "csv").stdout
    assert f"model.safetensors,params,total,{truth(tensors)['total']}" in csv
    md = run("count-params", str(path), "--format", "markdown").stdout
    assert "| file " in md and "transformer.h.0-1" in md
    assert run("count-params", str(path), "--check").exit_code == 0


def test_an_index_and_a_directory_without_config_are_counted_from_every_shard(tmp_path):
    tensors = {f"model.layers.{j}.mlp.up_proj.weight": RNG.standard_normal((6, 4)).astype(np.float32)
               for j in range(4)}
    tensors["model.embed_tokens.weight"] = RNG.standard_normal((10, 4)).astype(np.float16)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / fname))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    via_index, _ = counted(str(index))
    via_dir, _ = counted(str(tmp_path))
    for got in (via_index, via_dir):
        assert_counts(got, truth(tensors))
        assert [f["file"] for f in got["files"]] == list(shards)
    assert via_dir["reason"] == "no config.json beside the weights"
    # An index that names the wrong shard for a tensor is one line naming the index.
    wrong = json.loads(index.read_text())
    wrong["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(wrong))
    r = run("count-params", str(index))
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and str(index) in r.output, r.output


def write_phi2_gguf(path: Path) -> dict[str, np.ndarray]:
    """A GGUF of an architecture no family here models (phi2): blk.N. names, F32 and Q8_0 tensors."""
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(2)
    stored: dict[str, np.ndarray] = {}
    for name, shape, q in [("token_embd.weight", (32, 64), gguf.GGMLQuantizationType.Q8_0),
                           ("blk.0.attn_qkv.weight", (96, 64), gguf.GGMLQuantizationType.Q8_0),
                           ("blk.0.attn_norm.weight", (64,), gguf.GGMLQuantizationType.F32),
                           ("blk.1.attn_qkv.weight", (96, 64), gguf.GGMLQuantizationType.Q8_0),
                           ("blk.1.attn_norm.weight", (64,), gguf.GGMLQuantizationType.F32),
                           ("output_norm.weight", (64,), gguf.GGMLQuantizationType.F32)]:
        a = RNG.standard_normal(shape).astype(np.float32)
        data = gguf.quants.quantize(a, q)
        w.add_tensor(name, data, raw_dtype=q)
        stored[name] = (a, data, q.name)
    finish_gguf(w)
    return stored


def test_a_gguf_of_another_architecture_is_counted_from_its_header(tmp_path):
    path = tmp_path / "phi2.gguf"
    stored = write_phi2_gguf(path)
    got, r = counted(str(path))
    assert got["architecture"] == "phi2" and got["format"] == "gguf" and "'phi2'" in got["reason"]
    assert got["total"] == sum(a.size for a, _, _ in stored.values())
    assert got["total_bytes"] == sum(d.nbytes for _, d, _ in stored.values())  # Q8_0: 34 bytes per 32 weights
    by_type: dict[str, int] = {}
    for a, d, q in stored.values():
        by_type[q] = by_type.get(q, 0) + d.nbytes
    assert {d["dtype"]: d["bytes"] for d in got["by_dtype"]} == by_type
    q8 = next(d for d in got["by_dtype"] if d["dtype"] == "Q8_0")
    assert (q8["block_weights"], q8["block_bytes"]) == (32, 34)
    assert [(x["stack"], x["layer"], x["params"]) for x in got["layers"]] == [("blk", 0, 96 * 64 + 64),
                                                                               ("blk", 1, 96 * 64 + 64)]
    assert not got["partial"] and r.stderr == ""
    # The same file alone in a directory; two GGUFs that are no split set are refused (their sum is no model).
    d = tmp_path / "dir"
    d.mkdir()
    shutil.copy(path, d / "a.gguf")
    assert counted(str(d))[0]["total"] == got["total"]
    shutil.copy(path, d / "b.gguf")
    r = run("count-params", str(d))
    assert r.exit_code == 1 and "not one split set" in r.output and len(r.output.strip().splitlines()) == 1


def test_report_shapes_of_weight_files_without_config_points_to_count_params(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(gpt2_style(), str(path))
    r = run("report", "shapes", str(path))
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "count-params" in lines[0] and "Traceback" not in r.output


# --- partial files ------------------------------------------------------------------------------------------------

def cut(src: Path, dst: Path, size: int) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f:
        dst.write_bytes(f.read(size))
    return dst


def test_a_partial_safetensors_is_counted_with_its_shortfall(tmp_path):
    tensors = gpt2_style()
    full = tmp_path / "full" / "model.safetensors"
    full.parent.mkdir()
    save_file(tensors, str(full))
    size = full.stat().st_size
    part = cut(full, tmp_path / "part" / "model.safetensors", size - 100)
    got, r = counted(str(part))
    assert_counts(got, truth(tensors))  # the header says it all
    assert got["partial"] and got["files"] == [{"file": "model.safetensors", "bytes_present": size - 100,
                                                "bytes_declared": size, "bytes_missing": 100}]
    assert str(part) in r.stderr and "100 missing" in r.stderr
    table = run("count-params", str(part))
    assert table.exit_code == 0 and f"PARTIAL: {size - 100:,} of the {size:,} bytes on disk" in table.stdout
    assert run("count-params", str(part), "--check").exit_code == 1
    # Cut after the header: nothing of the data, still every tensor counted.
    header_end = 8 + int.from_bytes(full.read_bytes()[:8], "little")
    got, _ = counted(str(cut(full, tmp_path / "header" / "model.safetensors", header_end)))
    assert got["total"] == truth(tensors)["total"] and got["files"][0]["bytes_missing"] == size - header_end
    # Cut inside the header: nothing to count, one line.
    r = run("count-params", str(cut(full, tmp_path / "torn" / "model.safetensors", header_end - 5)))
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_a_partial_gguf_is_counted_with_its_shortfall(tmp_path):
    full = tmp_path / "phi2.gguf"
    stored = write_phi2_gguf(full)
    reader = gguf.GGUFReader(full)  # the library's own reading of the complete file: where the data end
    declared = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    part = cut(full, tmp_path / "part" / "phi2.gguf", reader.data_offset)  # the header whole, no data
    got, r = counted(str(part))
    assert got["total"] == sum(a.size for a, _, _ in stored.values()) and got["partial"]
    assert got["files"][0]["bytes_missing"] == declared - reader.data_offset
    assert "phi2.gguf" in r.stderr and "partial" in r.stderr


@pytest.fixture(scope="module")
def partial_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF checkpoint and a tiny llama GGUF, each with its last 1000 bytes cut off."""
    root = tmp_path_factory.mktemp("partial")
    cfg = get_preset("tiny")
    save_checkpoint(cfg, build_model(cfg, seed=0).state_dict(), root / "hf")
    f = root / "hf" / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    write_gguf(root / "tiny.gguf")
    os.truncate(root / "tiny.gguf", (root / "tiny.gguf").stat().st_size - 1000)
    return {"hf": root / "hf", "gguf": root / "tiny.gguf", "file": f}


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("command", ["export", "parity", "convert", "generate"])
def test_commands_that_read_the_weights_refuse_a_partial_file(kind, command, partial_models, tmp_path):
    model = str(partial_models[kind])
    out = tmp_path / "out"
    argv = {"export": ["export", "onnx", model, "-o", str(out / "model.onnx")],
            "parity": ["verify", "parity", model],
            "convert": ["convert", model, str(out), "--to", "hf"],
            "generate": ["generate", model, "--ids", "1 2", "--max-new-tokens", "1"]}[command]
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(Path(model).parent))
    r = run(*argv)
    lines = r.output.strip().splitlines()
    assert r.exit_code != 0 and len(lines) == 1 and "Traceback" not in r.output, r.output
    named = partial_models["file"] if kind == "hf" else partial_models["gguf"]
    assert str(named) in lines[0] and "1,000 missing" in lines[0], lines[0]
    assert not out.exists() and (sorted(os.listdir(tmp_path)), sorted(os.listdir(Path(model).parent))) == before


def test_a_checkpoint_with_its_config_but_a_partial_file_is_counted_from_headers(partial_models):
    got, r = counted(str(partial_models["hf"]))
    cfg = get_preset("tiny")
    n = sum(math.prod(p.shape) for p in build_model(cfg, device="meta").parameters())
    assert got["total"] == n and got["partial"] and "model.safetensors is partial" in got["reason"]
    assert "1,000 missing" in r.stderr
