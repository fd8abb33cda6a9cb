"""The llama.cpp source check on GPT-NeoX (Pythia's parallel block, RoPE on a quarter of each head), Falcon and
Qwen3-MoE GGUFs: the default `verify parity GRAPH --source X.gguf` passes on a file read right, and fails, naming
the source check, on a reading made wrong on purpose.

llama.cpp runs with an F32 KV cache (its default F16 one measured 9.2e-4 to 1.4e-3 relative RMS on these models, past
the F32 bound); GELU models' bound is wider by ACTIVATION_ALLOWANCE, as llama.cpp's GELU is the tanh form through an
FP16 table (1.5e-4 to 2.2e-4 against our erf GELU here), and SiLU's is not: a Qwen3-MoE RoPE base 0.1% off (2.3e-4,
within the F32 bound of 5e-4 before) fails.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_gguf_llamacpp import to_gguf  # noqa: E402
from test_gguf_llamacpp import tokenizers_dir  # noqa: E402, F401  (its fixture: the trained tokenizers, made once)
from test_gguf_neox_falcon_moe import hf_checkpoint  # noqa: E402
from test_hostile import assert_ok, invoke  # noqa: E402

from llama_tools.checkpoints.gguf import tensors  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.exporters.prompts import default_inputs  # noqa: E402
from llama_tools.exporters.verification.source_check import (ACTIVATION_ALLOWANCE, LLAMACPP_TOLERANCE,  # noqa: E402
                                                              check_source)

CASES = ["neox_parallel", "falcon_7b", "falcon_40b", "qwen3_moe"]  # tests/test_gguf_neox_falcon_moe.py's layouts


@pytest.fixture(scope="module", params=CASES)
def exported(request, tmp_path_factory, tokenizers_dir):
    """(case, its GGUF from `convert --to gguf` of the seeded transformers checkpoint, the GGUF's ONNX export)."""
    d = tmp_path_factory.mktemp(request.param)
    hf_checkpoint(request.param, d / "hf", tokenizers_dir)
    to_gguf(d / "hf", d / "m.gguf")
    graph = d / "onnx" / "model.onnx"
    assert_ok(invoke(["export", "onnx", str(d / "m.gguf"), "-o", str(graph), "-q"]))
    return request.param, d / "m.gguf", graph


def test_the_default_verify_parity_passes_with_the_source_check(exported):
    """llama.cpp agrees within the F32 bound, plus the GELU allowance for NeoX and Falcon, which the note explains."""
    case, gguf, graph = exported
    r = invoke(["verify", "parity", str(graph), "--source", str(gguf), "-q", "--format", "json"])
    assert_ok(r)
    data = json.loads(r.stdout)
    source = data["source_check"]
    assert data["passed"] and source["checked"] and source["passed"], source
    assert source["library"].startswith("llama.cpp")
    check = source["blocks"][0]["checks"][0]
    assert check["kind"] == "F32" and check["top1"] == 1.0
    wider = [n for n in source["notes"] if n.startswith("the bound is wider")]
    if case == "qwen3_moe":  # SiLU: no allowance; measured 5.6e-7
        assert check["allowance"] == 0 and check["tolerance"] == LLAMACPP_TOLERANCE["F32"] and not wider
        assert check["error"] < LLAMACPP_TOLERANCE["F32"] / 10
    else:  # measured 1.5e-4 to 2.2e-4: past the F32 bound alone, so the allowance is what passes them
        assert (check["activation"], check["allowance"]) == ("gelu", ACTIVATION_ALLOWANCE["gelu"])
        assert check["tolerance"] == LLAMACPP_TOLERANCE["F32"] + ACTIVATION_ALLOWANCE["gelu"]
        assert LLAMACPP_TOLERANCE["F32"] < check["error"] < check["tolerance"] / 2
        assert len(wider) == 1 and "hidden_act gelu" in wider[0] and "FP16 table" in wider[0]


# Misreads planted in our reading of the file: llama.cpp reads it right, so each is the source check's to see.
# Measured (relative RMS): two v rows swapped 0.37 (NeoX), 0.81 / 0.80 (Falcon), 0.40 (Qwen3-MoE); norm eps x10
# 5.3e-3 (NeoX, Falcon: 5x the GELU models' bound); Qwen3-MoE's RoPE base 0.1% off 2.3e-4 (11x the F32 bound).
def _swap_v_rows(monkeypatch) -> None:
    """Our GGUF reader gives layer 0's v_proj with rows 0 and 1 swapped, as a wrong split of attn_qkv would."""
    weight = tensors.GgufReader._weight

    def swapped(self, name):
        a = weight(self, name)
        if name == "model.layers.0.self_attn.v_proj.weight":
            a[[0, 1]] = a[[1, 0]]
        return a

    monkeypatch.setattr(tensors.GgufReader, "_weight", swapped)


def test_two_qkv_rows_misread_fail_the_default_verify_naming_the_source_check(exported, monkeypatch):
    case, gguf, graph = exported
    _swap_v_rows(monkeypatch)
    r = invoke(["verify", "parity", str(graph), "--source", str(gguf), "-q"])
    assert r.exit_code == 1, r.output[-2000:]
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("FAIL; our reading of the checkpoint differs from what llama.cpp computes (the source "
                           "check)"), last


def test_a_small_misread_is_past_the_bound(exported, monkeypatch):
    """A misread a few times the measured error: the norms' eps x10 (GELU models), a RoPE base 0.1% off (SiLU)."""
    case, gguf, _ = exported
    read = tensors.gguf_config

    def wrong(reader, path):
        cfg = read(reader, path)
        if case == "qwen3_moe":
            return cfg.replace(rope_theta=cfg.rope_theta * 1.001)
        return cfg.replace(rms_norm_eps=cfg.rms_norm_eps * 10)

    monkeypatch.setattr(tensors, "gguf_config", wrong)
    src = resolve(str(gguf))
    rows = default_inputs(src, src.cfg.vocab_size, src.cfg.max_position_embeddings).rows
    rep = check_source(src, rows)
    check = rep.blocks[0].checks[0]
    assert rep.checked and not rep.passed and check.error > 3 * check.tolerance, check.figures()
    if case == "qwen3_moe":
        assert check.error < 5e-4  # within the bound before llama.cpp's cache was F32: a misread it let through
