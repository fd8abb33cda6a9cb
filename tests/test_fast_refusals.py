"""Refusals that need no weights happen before torch is imported (issue 19 item 4), in a real process, in every command.

Each refusal runs the CLI in a fresh interpreter and reports the exit code, its stderr and which packages got
imported. The contract: exit 1, one stderr line naming what is wrong, and no package imported beyond the standard
library, click and ours (onnx and what it pulls in only where the refusal reads a graph's own metadata). What that
costs in CPU time, against a bare `import click`, is benchmarks/bench_startup.py's figure: a time is not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from llama_tools.checkpoints.source import load_tokenizer, resolve
from llama_tools.exporters.prompts import QUALITY_PROMPT
from llama_tools.modeling.presets import get_preset

# Runs the CLI in a fresh interpreter, then reports the exit code and which heavy modules got imported.
HEAVY = ("torch", "onnx", "onnxruntime", "numpy", "pandas", "matplotlib")
PROBE = f"""
import json, sys
from llama_tools.cli import cli
try:
    cli(sys.argv[1:], prog_name="llama-tools")
except SystemExit as e:
    code = e.code
top = {{m.split(".")[0] for m in sys.modules}} - set(sys.stdlib_module_names)
print(json.dumps({{"code": code, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules),
                  "packages": sorted(m for m in top if not m.startswith("_"))}}))
"""
# What any refusal may import besides the standard library: sentencepiece where the refusal reads MODEL's tokenizer
# (a prompt's length, a token id's range; its import costs what click's does). The editable install's finder and
# setuptools' `_distutils_hack` start with an underscore and are left out above.
LIGHT = {"click", "llama_tools", "sentencepiece"}
TINY = get_preset("tiny")  # vocab 512, context 256
BIG = "1" + "0" * 21
GRAPH = ("onnx", "numpy")  # what reading a graph's metadata imports (onnx imports numpy)


def probe(*args: str, cwd=None) -> dict:
    """Run the CLI with `args` in a fresh interpreter: its exit code, stderr, heavy modules and top-level packages."""
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                       stdin=subprocess.DEVNULL)
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


def write_graph(path: Path, op: str = "MatMul", config: dict | None = None, static_kv: int | None = None) -> Path:
    """A one-node ONNX graph (op MatMul, or MatMulNBits as an int4 export has), with our metadata when `config`."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node(op, ["x", "w"], ["y"], domain="com.microsoft" if op == "MatMulNBits" else "")
    model = helper.make_model(helper.make_graph([node], "g", [x, w], [y]))
    if config is not None:
        helper.set_model_props(model, {"llama_tools.config": json.dumps(config), "llama_tools.source": "tiny",
                                       "llama_tools.seed": "0", "llama_tools.dtype": "float32",
                                       "llama_tools.static_kv": "" if static_kv is None else str(static_kv)})
    onnx.save(model, path)
    return path


@pytest.fixture
def graphs(tmp_path) -> Path:
    """In tmp_path: fp32.onnx and int4.onnx of ours (tiny's config), static.onnx (a 16-slot KV buffer), and a
    foreign fp32 graph and int4 graph; a FIFO named x.gguf."""
    write_graph(tmp_path / "fp32.onnx", config=TINY.to_dict())
    write_graph(tmp_path / "int4.onnx", "MatMulNBits", config=TINY.to_dict())
    write_graph(tmp_path / "static.onnx", "MatMulNBits", config=TINY.to_dict(), static_kv=16)
    write_graph(tmp_path / "foreign.onnx")
    write_graph(tmp_path / "foreign-int4.onnx", "MatMulNBits")
    os.mkfifo(tmp_path / "x.gguf")
    (tmp_path / "notes.txt").write_bytes(b"caf\xe9")  # Latin-1: not UTF-8
    return tmp_path


def test_the_graphs_are_what_they_say(graphs):
    """The stand-ins, by onnx itself: MatMulNBits only where named so, our metadata only where written."""
    ops = {p.name: {n.op_type for n in onnx.load(p).graph.node} for p in graphs.glob("*.onnx")}
    assert ops == {"fp32.onnx": {"MatMul"}, "int4.onnx": {"MatMulNBits"}, "static.onnx": {"MatMulNBits"},
                   "foreign.onnx": {"MatMul"}, "foreign-int4.onnx": {"MatMulNBits"}}
    assert not onnx.load(graphs / "foreign.onnx").metadata_props


COMMANDS = [["count-params"], ["presets"], ["report", "shapes"], ["report", "regenerate"], ["convert"],
            ["tokenize"], ["generate"], ["export", "onnx"], ["verify", "parity"], ["verify", "source"], ["verify", "int4"]]

# verify int4 starts from the built-in text's first sentence (tiny's tokenizer: 34 tokens) in a context of 256
_DEFAULT_PROMPT = len(load_tokenizer(resolve("tiny")).encode(QUALITY_PROMPT))

# (argv, what the one line says, heavy modules allowed: onnx where the graph's metadata must be read)
REFUSALS = [
    # usage errors in every command: an unknown option, a choice, a number out of its range
    *[(c + ["--bogus-option"], "No such option '--bogus-option'", ()) for c in COMMANDS],
    (["generate", "tiny", "--promt", "hi"], "did you mean --prompt?", ()),
    (["count-params", "tiny", "--format", "jsn"], "did you mean json?", ()),
    (["export", "onx"], "did you mean onnx?", ()),
    (["repot", "shapes"], "did you mean report?", ()),
    (["count-params", "tiny", "--batch", "0"], "--batch", ()),
    # count-params, report
    (["count-params", "tinny"], "did you mean tiny?", ()),
    (["count-params", "./nowhere"], "./nowhere: no such file or directory", ()),
    (["count-params", "x.gguf"], "x.gguf: is a FIFO, not a regular file", ()),
    (["report", "shapes", "tiny", "--batch", BIG], "64-bit", ()),
    (["report", "shapes", "tiny", "--seq-len", "300"], "exceeds max_position_embeddings 256", ()),
    (["report", "shapes", "tiny", "--format", "csv", "-o", "/proc/x.csv"], "/proc/x.csv", ()),
    (["report", "regenerate", "-o", "/proc/x"], "/proc/x", ()),
    # convert, tokenize
    (["convert", "tiny", "out"], "Choose from: hf, meta", ()),
    (["convert", "tiny", "out", "--to", "hff"], "did you mean hf?", ()),
    (["convert", "tiny", "/proc/x", "--to", "hf"], "under /proc", ()),
    (["convert", "tiny", "out", "--to", "meta", "--shards", "1000"], "does not split into 1000", ()),
    (["tokenize", "tiny", "hi", "--ids", "1"], "exactly one of TEXT or --ids", ()),
    (["tokenize", "tiny", "--ids", "1 99999"], "99999 is outside the vocabulary", ()),
    # generate
    (["generate", "tiny", "--ids", "1 2", "--max-new-tokens", "300"], "exceeds the model's context of 256", ()),
    (["generate", "tiny", "--ids", "1 999"], "token id 999 is outside the vocabulary", ()),
    (["generate", "tiny", "--ids", "1 2", "--temperature", "-1"], "--temperature", ()),
    (["generate", "tiny", "--ids", "1 2", "--temperature", "1e-40"], "--temperature must be 0 (greedy) or in", ()),
    (["generate", "tiny", "--ids", "1 2", "--repetition-penalty", "1e-300"], "--repetition-penalty must be in", ()),
    (["generate", "tiny", "--prompt", "hi", "--ids", "1"], "exactly one of --prompt", ()),
    (["generate", "./tiny-hf", "--ids", "1"], "./tiny-hf: no such file or directory", ()),
    (["generate", "x.gguf", "--ids", "1"], "x.gguf: is a FIFO", ()),
    (["generate", "tinny", "--ids", "1"], "did you mean tiny?", ()),
    # export onnx
    (["export", "onnx", "tiny", "-o", "x.onnx", "--static-kv", "0"], "--static-kv", ()),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--static-kv", "100000"], "tiny's context of 256", ()),
    (["export", "onnx", "tiny", "-o", "."], "not a file name", ()),
    (["export", "onnx", "tiny", "-o", "/proc/x.onnx"], "under /proc", ()),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--int4-keep", "n"], "go with --quantize int4", ()),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--rope-op", "onxx"], "did you mean onnx?", ()),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--quantize", "int4", "--int4-block-size", "24"], "power of two", ()),
    (["export", "onnx", "tiny"], "Missing option '-o' / '--output'", ()),
    # verify parity
    (["verify", "parity", "missing/model.onnx"], "llama-tools export onnx MODEL -o missing/model.onnx", ()),
    (["verify", "parity", "tiny", "--source", "tiny"], "--source is for an .onnx TARGET", ()),
    (["verify", "parity", "tiny", "--by-layer", "--checks", "whole"], "--by-layer is --checks layers", ()),
    (["verify", "parity", "tiny", "--steps", "300"], "exceeds the model's context of 256", ()),
    (["verify", "parity", "tiny", "--prompt", "Who is", "--steps", "255"], "give --steps <=", ()),
    (["verify", "parity", "tiny", "--ids", "1 999"], "999 is outside the vocabulary", ()),
    (["verify", "parity", "tiny", "--plot", "p.jpg"], "write a .png file", ()),
    (["verify", "parity", "tiny", "--random-ids", "2", "--ids", "1"], "not both", ()),
    (["verify", "parity", "./nowhere"], "./nowhere: no such file or directory", ()),
    (["verify", "parity", "foreign.onnx"], "foreign.onnx was not written by llama-tools; pass --source", ()),
    (["verify", "parity", "int4.onnx"], "verify int4 int4.onnx", GRAPH),
    (["verify", "parity", "fp32.onnx", "--steps", "300"], "exceeds the model's context of 256", GRAPH),
    # verify source
    (["verify", "source", "./nowhere"], "./nowhere: no such file or directory", ()),
    (["verify", "source", "tiny", "--random-ids", "2", "--ids", "1"], "not both", ()),
    (["verify", "source", "tiny", "--ids", "1 999"], "999 is outside the vocabulary", ()),
    # verify int4
    (["verify", "int4", "missing/model.onnx"], "no such file", ()),
    (["verify", "int4", "fp32.onnx"], "nothing in it is int4", ()),
    (["verify", "int4", "foreign.onnx"], "nothing in it is int4", ()),
    (["verify", "int4", "int4.onnx", "--prompt", "hi", "--ids", "1"], "at most one of --prompt", ()),
    (["verify", "int4", "int4.onnx", "--steps", "1000000000"], f"give --steps <= {256 - _DEFAULT_PROMPT}", GRAPH),
    (["verify", "int4", "static.onnx", "--steps", "10"], "static KV buffer of 16 positions", GRAPH),
    (["verify", "int4", "int4.onnx", "--ids", "1 999"], "999 is outside the vocabulary", GRAPH),
    (["verify", "int4", "foreign-int4.onnx"], "was not written by llama-tools; pass --source", GRAPH),
    (["verify", "int4", "int4.onnx", "--text", "notes.txt"], "notes.txt: not UTF-8", GRAPH),
]


@pytest.mark.parametrize("args, says, allowed", REFUSALS, ids=[" ".join(a)[:60] for a, _, _ in REFUSALS])
def test_refused_before_torch(args, says, allowed, graphs):
    out = probe(*args, cwd=graphs)
    lines = out["stderr"].strip().splitlines()
    assert out["code"] == 1 and len(lines) == 1 and says in lines[0], out
    assert lines[0].startswith("Error: ") and "Traceback" not in out["stderr"], out
    heavy = [m for m in out["heavy"] if m not in allowed]
    assert heavy == [], f"{' '.join(args)} imported {heavy} before refusing"
    if not allowed:
        assert set(out["packages"]) <= LIGHT, f"{' '.join(args)} imported {set(out['packages']) - LIGHT}"


def test_every_command_is_covered():
    """Each command of the tree has refusals in REFUSALS (a new command must add its own)."""
    import click

    from llama_tools.cli import cli

    def leaves(group: click.Group, path: list[str]):
        for name, cmd in group.commands.items():
            yield from leaves(cmd, path + [name]) if isinstance(cmd, click.Group) else [path + [name]]

    covered = {tuple(a[:len(c)]) for a, _, _ in REFUSALS for c in COMMANDS if a[:len(c)] == c}
    assert {tuple(p) for p in leaves(cli, [])} == covered


@pytest.mark.parametrize("args", [["verify", "parity", "tiny"], ["verify", "int4", "int4.onnx"]])
def test_cuda_asked_where_onnxruntime_has_none_is_one_line_before_torch(args, graphs):
    """--provider cuda on a machine whose onnxruntime cannot run it: one line naming the option, before torch (and
    before onnxruntime could print its own warning for a provider it lacks)."""
    from llama_tools.exporters.runtime import cuda_unusable

    if cuda_unusable() is None:
        pytest.skip("onnxruntime runs CUDA here: nothing to refuse")
    out = probe(*args, "--provider", "cuda", cwd=graphs)
    lines = out["stderr"].strip().splitlines()
    assert out["code"] == 1 and len(lines) == 1 and lines[0].startswith("Error: "), out
    assert "--provider" in lines[0] and "use --provider cpu" in lines[0], out
    assert "torch" not in out["heavy"], out


def test_export_refuses_to_overwrite_its_input_before_torch(tmp_path):
    """OUTPUT that is the checkpoint's own weights file: refused by the export's own pre-flight (preflight.py)."""
    assert probe("convert", "tiny", "ck", "--to", "hf", "--format", "json", cwd=tmp_path)["code"] in (0, None)
    out = probe("export", "onnx", "ck", "-o", "ck/model.safetensors", cwd=tmp_path)
    assert out["code"] == 1 and "this run reads" in out["stderr"] and "torch" not in out["heavy"], out


def test_the_probe_sees_torch(tmp_path):
    """Negative case: a command that runs the model does import torch, and the probe says so in both lists."""
    out = probe("generate", "tiny", "--ids", "1 2", "--max-new-tokens", "1", "-q", cwd=tmp_path)
    assert out["code"] in (0, None) and "torch" in out["heavy"], out
    assert "torch" in out["packages"] and not set(out["packages"]) <= LIGHT, out
