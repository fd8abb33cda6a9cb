"""`verify parity` on graphs other exporters wrote: onnxruntime-genai's model builder and Optimum, on a tiny checkpoint.

The builder of onnxruntime-genai 0.18 imports model classes that transformers 4.x lacks (it wants 5.x) and reads
`rope_scaling` as a dict: it runs here with stand-ins for those classes and `rope_scaling: {"rope_type": "default"}`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters.foreign import describe_graph
from llama_tools.exporters.verification.parity import resolve_target, verify_parity
from llama_tools.modeling.presets import get_preset
from helpers import sharp

TINY = get_preset("tiny")  # GQA 4/2 heads of 16, 2 layers, vocab 512
PROMPTS = [[1, 17, 300, 5, 99, 42, 7, 250, 3, 64], [1, 450, 29, 8, 77]]

BUILDER = """
import runpy, sys, transformers
t = sys.modules["transformers"]
names = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLForConditionalGeneration",
         "Lfm2VlForConditionalGeneration", "Mistral3ForConditionalGeneration", "Gemma3ForConditionalGeneration",
         "Qwen2_5_VLForConditionalGeneration")
missing = [n for n in names if not hasattr(t, n)]
for n in missing:
    setattr(sys.modules["transformers"], n, type(n, (), {}))
sys.argv[0] = "builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def write_hf(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    from llama_tools.exporters.genai import sentencepiece_to_tokenizer_json
    from helpers import train_tiny_tokenizer

    save_checkpoint(TINY, state, directory, to="hf")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "default"}  # the builder iterates over it
    (directory / "config.json").write_text(json.dumps(cfg))
    spm = train_tiny_tokenizer(["The quick brown fox jumps over the lazy dog."] * 20, directory / "tok", 320)
    for name, data in zip(("tokenizer.json", "tokenizer_config.json"), sentencepiece_to_tokenizer_json(spm)):
        (directory / name).write_text(json.dumps(data))
    return directory


def state(scale_v_of: int | None = None) -> dict[str, torch.Tensor]:
    s = {k: v.detach().clone() for k, v in sharp(TINY).state_dict().items()}
    if scale_v_of is not None:
        s[f"model.layers.{scale_v_of}.self_attn.v_proj.weight"] *= 1 + 1e-2
    return s


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_hf(tmp_path_factory.mktemp("hf") / "tiny", state())


def run_builder(hf: Path, out: Path, precision: str) -> Path:
    """onnxruntime-genai's model builder on the checkpoint, for the CPU: out/model.onnx."""
    pytest.importorskip("onnxruntime_genai")
    r = subprocess.run([sys.executable, "-c", BUILDER, "-i", str(hf), "-o", str(out), "-p", precision, "-e", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "model.onnx"


@pytest.fixture(scope="module")
def builder(hf, tmp_path_factory) -> Path:
    return run_builder(hf, tmp_path_factory.mktemp("builder") / "fp32", "fp32")


@pytest.fixture(scope="module")
def optimum(hf, tmp_path_factory) -> Path:
    pytest.importorskip("optimum.exporters.onnx")
    out = tmp_path_factory.mktemp("optimum") / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(hf),
                        "--task", "text-generation-with-past", str(out)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "model.onnx"


def test_builder_graph_is_read_and_passes(builder, hf):
    io = describe_graph(builder)
    assert io.producer == "onnxruntime-genai builder" and not io.position_ids and io.row_by_row
    assert io.num_layers == TINY.num_hidden_layers and io.kv_heads == TINY.num_key_value_heads
    rep = verify_parity(resolve_target(str(builder), str(hf)), prompts=PROMPTS, steps=4)
    assert rep.passed, [c.figures() for c in rep.checks if not c.passed]
    assert rep.graph == "onnxruntime-genai builder" and any("one row at a time" in n for n in rep.notes)


def test_optimum_graph_passes(optimum, hf):
    io = describe_graph(optimum)
    assert io.position_ids and not io.row_by_row
    rep = verify_parity(resolve_target(str(optimum), str(hf)), prompts=PROMPTS, steps=4)
    assert rep.passed, [c.figures() for c in rep.checks if not c.passed]


def test_graph_whose_weights_differ_from_the_source_fails_at_the_layer(builder, optimum, tmp_path):
    other = write_hf(tmp_path / "other", state(scale_v_of=1))  # layer 1's V matrix x (1 + 1e-2)
    for graph in (builder, optimum):
        rep = verify_parity(resolve_target(str(graph), str(other)), prompts=PROMPTS, steps=2)
        assert not rep.passed and rep.first_bad_layer == 1, graph
        bad = next(c for c in rep.checks if c.name == "present.1.value")
        assert not bad.passed and bad.ratio > bad.allowed_ratio


def test_cli_foreign_graph_needs_source_in_one_line(builder, hf):
    r = CliRunner().invoke(cli, ["verify", "parity", str(builder)])
    assert r.exit_code == 1 and "pass --source" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["verify", "parity", str(builder), "--source", str(hf), "--steps", "1",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["graph"] == "onnxruntime-genai builder"


def _io_graph(path: Path, extra_input: str | None) -> Path:
    h, T = onnx.helper, onnx.TensorProto
    ins = [h.make_tensor_value_info("input_ids", T.INT64, ["b", "s"]),
           h.make_tensor_value_info("attention_mask", T.INT64, ["b", "t"])]
    ins += [h.make_tensor_value_info(f"past_key_values.0.{kv}", T.FLOAT, ["b", 2, "p", 16]) for kv in ("key", "value")]
    if extra_input:
        ins.append(h.make_tensor_value_info(extra_input, T.INT64, ["s"]))
    outs = [h.make_tensor_value_info("logits", T.FLOAT, ["b", "s", 512])]
    outs += [h.make_tensor_value_info(f"present.0.{kv}", T.FLOAT, ["b", 2, "t", 16]) for kv in ("key", "value")]
    nodes = [h.make_node("Identity", [f"past_key_values.0.{kv}"], [f"present.0.{kv}"]) for kv in ("key", "value")]
    nodes.append(h.make_node("Cast", ["input_ids"], ["logits"], to=T.FLOAT))
    onnx.save(h.make_model(h.make_graph(nodes, "g", ins, outs)), str(path))
    return path


def test_what_cannot_be_mapped_is_refused_in_one_line(tmp_path, hf):
    with pytest.raises(ValueError, match="'cache_position' is not one verify parity can feed"):
        describe_graph(_io_graph(tmp_path / "a.onnx", "cache_position"))
    io = describe_graph(_io_graph(tmp_path / "b.onnx", None))
    assert io.num_layers == 1 and io.head_dim == 16
    with pytest.raises(ValueError, match="has 1 layers but"):
        resolve_target(str(tmp_path / "b.onnx"), str(hf))


@pytest.fixture(scope="module")
def builder_int4(hf, tmp_path_factory) -> Path:
    return run_builder(hf, tmp_path_factory.mktemp("builder") / "int4", "int4")


def test_verify_int4_judges_the_builders_int4_graph(builder_int4, hf, tmp_path):
    """The builder's int4 graph is scored by the same statistics as ours (no llama-tools metadata needed); a source
    whose weights differ from the graph's by far more than int4 rounding is NOT FAITHFUL."""
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(builder_int4), load_external_data=False).graph.node)
    r = CliRunner().invoke(cli, ["verify", "int4", str(builder_int4)])
    assert r.exit_code == 1 and "pass --source" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, ["verify", "int4", str(builder_int4), "--source", str(hf), "--steps", "6",
                                 "--format", "json"])
    assert r.exit_code in (0, 1), r.output
    good = json.loads(r.output)
    assert good["steps"] == 6 and 0 <= good["mean_kl"] < 0.05, good  # top-1 on a seeded model is decided by near-ties
    s = state()
    s = {k: (v.roll(1, 0) if k.endswith("embed_tokens.weight") else v) for k, v in s.items()}  # each id gets another row
    other = write_hf(tmp_path / "other", s)
    r = CliRunner().invoke(cli, ["verify", "int4", str(builder_int4), "--source", str(other), "--steps", "6",
                                 "--format", "json"])
    bad = json.loads(r.output)
    assert r.exit_code == 1 and bad["mean_kl"] > 10 * good["mean_kl"], (good["mean_kl"], bad["mean_kl"])
