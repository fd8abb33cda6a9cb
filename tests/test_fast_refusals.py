"""Refusals that need no model happen before torch or onnx is imported (issue 19 item 4), in a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs the CLI in a fresh interpreter, then reports the exit code and which heavy modules got imported.
PROBE = """
import json, sys
from llama_tools.cli import cli
try:
    cli(sys.argv[1:], prog_name="llama-tools")
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "onnx", "onnxruntime") if m in sys.modules)}))
"""


def probe(*args: str, cwd=None) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, timeout=120)
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


@pytest.mark.parametrize("args, says", [
    (["generate", "tiny", "--ids", "1 2", "--max-new-tokens", "300"], "exceeds the model's context of 256"),
    (["generate", "tiny", "--ids", "1 999"], "token id 999 is outside the vocabulary"),
    (["generate", "tiny", "--ids", "1 2", "--temperature", "-1"], "--temperature"),
    (["generate", "tiny", "--prompt", "hi", "--ids", "1"], "exactly one of --prompt"),
    (["verify", "parity", "missing/model.onnx"], "llama-tools export onnx MODEL -o missing/model.onnx"),
    (["verify", "int4", "missing/model.onnx"], "no such file"),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--static-kv", "0"], "--static-kv"),
    (["export", "onnx", "tiny", "-o", "."], "not a file name"),
    (["export", "onnx", "tiny", "-o", "/proc/x.onnx"], "under /proc"),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--quantize", "int4", "--int4-block-size", "24"], "power of two"),
    (["convert", "tiny", "/proc/x", "--to", "hf"], "under /proc"),
    (["convert", "tiny", "out", "--to", "meta", "--shards", "1000"], "does not split into 1000"),
])
def test_refused_before_torch(args, says, tmp_path):
    out = probe(*args, cwd=tmp_path)
    assert out["code"] == 1 and says in out["stderr"], out
    assert out["heavy"] == [], f"{' '.join(args)} imported {out['heavy']} before refusing"


def test_export_refuses_to_overwrite_its_input_before_torch(tmp_path):
    """OUTPUT that is the checkpoint's own weights file: refused by the export's own pre-flight (preflight.py)."""
    assert probe("convert", "tiny", "ck", "--to", "hf", "--format", "json", cwd=tmp_path)["code"] in (0, None)
    out = probe("export", "onnx", "ck", "-o", "ck/model.safetensors", cwd=tmp_path)
    assert out["code"] == 1 and "this run reads" in out["stderr"] and out["heavy"] == [], out


def test_the_probe_sees_torch(tmp_path):
    """Negative case: a command that runs the model does import torch, and the probe says so."""
    out = probe("generate", "tiny", "--ids", "1 2", "--max-new-tokens", "1", "-q", cwd=tmp_path)
    assert out["code"] in (0, None) and "torch" in out["heavy"], out
