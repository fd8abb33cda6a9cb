"""A second real trained model: GlubLM 0.3.1 (35M, 8 layers, plain multi-head 10/10, untied, tokenizer.json),
from its PyPI sdist (tests/realmodels.py). Truth: transformers' LlamaForCausalLM on the same checkpoint, and the
model's own known answer; the exports are judged by the error budget like SmolLM2's, faults planted and found.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.verification.parity import resolve_target, verify_parity
from llama_tools.checkpoints.loading import load_model
from llama_tools.checkpoints.source import resolve

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "bench_faults.py")
bf = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = bf
_spec.loader.exec_module(bf)

PROMPT = "do you remember me? ->"  # the package's own chat format: "<bos> text -> ", then the reply
TEXT = "hello little fish. what is the ocean like? i swim around my bowl and forget everything."


def _ids(hf: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return [1] + Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_logits_and_greedy_answer_equal_transformers(glublm_hf):
    from transformers import LlamaForCausalLM

    ids = torch.tensor([_ids(glublm_hf, TEXT)])
    ours = load_model(str(glublm_hf)).eval()
    theirs = LlamaForCausalLM.from_pretrained(glublm_hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    assert a.shape == b.shape == (1, ids.shape[1], 5120) and a.dtype == b.dtype == torch.float32
    assert (b.abs().max() > 5) and torch.allclose(a, b, rtol=0, atol=2e-4 * float(b.abs().max())), (a - b).abs().max()
    # Greedy: our generate's tokens are transformers' (the model's own reply to its chat prompt).
    from llama_tools.inference.generation import generate

    prompt = _ids(glublm_hf, PROMPT)
    with torch.no_grad():
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        got = generate(ours, prompt, max_new_tokens=10).new_ids
    assert got == want and len(got) == 10


@pytest.fixture(scope="module", params=["plain", "fused"])
def glublm_graph(request, glublm_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"glublm-{request.param}") / "model.onnx"
    (export_onnx if request.param == "plain" else export_fused)(str(glublm_hf), out)
    return out


@pytest.mark.slow
def test_exports_pass_for_seeds_and_real_text_and_a_fault_is_found(glublm_graph, glublm_hf):
    target = resolve_target(str(glublm_graph), str(glublm_hf))
    rng = np.random.default_rng(11)
    for prompts in ([_ids(glublm_hf, TEXT), _ids(glublm_hf, PROMPT)],
                    [rng.integers(3, 5120, size=n).tolist() for n in (13, 7)]):
        rep = verify_parity(target, prompts=prompts, steps=3)
        assert rep.passed, [c.figures() for c in rep.checks if not c.passed]
        assert max(abs(c.scale) for c in rep.checks) > 1  # real logits, not a seeded model's small ones
    cfg = resolve(str(glublm_hf)).cfg
    assert bf.check(glublm_graph, "by-layer", str(glublm_hf)).passed
    v = bf.check(bf.plant(glublm_graph, "scale", cfg, 4), "by-layer", str(glublm_hf))
    assert not v.passed and v.located == "layer 4", v
