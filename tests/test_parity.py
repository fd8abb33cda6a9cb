"""`verify parity`: the provider choice, the comparison arithmetic, and whole runs that must pass or fail.

Models here have large q/k weights (attention far from uniform), so a wrong RoPE layout or a missing
causal mask changes the logits well beyond tolerance; the negative tests prove that the checks see it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import llama_tools.exporters.runtime as runtime
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.verification.compare import BUDGET, Tolerance, compare
from llama_tools.exporters.verification.parity import resolve_target, verify_parity
from llama_tools.exporters.prompts import left_pad, positions
from llama_tools.cli import cli
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from helpers import sharp

TINY = get_preset("tiny")  # GQA: 4 query heads over 2 KV heads
FP32 = BUDGET["float32"]
PROMPTS = [[1, 17, 300, 5, 99, 42, 7, 250, 3, 64], [1, 450, 29, 8, 77]]


def sharp_state(cfg=TINY, seed=0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sharp(cfg, seed).state_dict().items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny-sharp"
    save_checkpoint(TINY, sharp_state(), d, to="hf")
    return d


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(str(checkpoint), str(out))
    return out


# --- providers ---------------------------------------------------------------------------------------

def test_auto_provider_says_which_ran(exported):
    s = runtime.create_session(exported, "auto")
    assert s.provider == s.session.get_providers()[0].replace("ExecutionProvider", "").lower()
    if s.provider == "cpu":  # CI: no GPU, whether or not the build lists CUDA
        assert s.note.startswith("CPU provider:")
    with pytest.raises(ValueError, match="--provider cpu"):
        if s.provider == "cpu":
            runtime.create_session(exported, "cuda")
        else:
            raise ValueError("--provider cpu (CUDA ran: nothing to refuse here)")


class FakeSession:
    def __init__(self, providers):
        self._providers = providers

    def get_providers(self):
        return self._providers


def test_provider_choice_reads_back_what_the_session_runs(monkeypatch, exported):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "_new_session", lambda path, providers: FakeSession(providers))
    assert runtime.create_session(exported, "auto").provider == "cuda"
    # Listed but silently fallen back: what get_providers() says wins.
    monkeypatch.setattr(runtime, "_new_session", lambda path, providers: FakeSession(["CPUExecutionProvider"]))
    s = runtime.create_session(exported, "auto")
    assert s.provider == "cpu" and "could not start" in s.note
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "no CUDA provider" in runtime.create_session(exported, "auto").note
    with pytest.raises(ValueError, match="not in this onnxruntime build"):
        runtime.create_session(exported, "cuda")


# --- the arithmetic -----------------------------------------------------------------------------------

def test_compare_by_hand():
    ref = np.array([[[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])  # [batch 1, seq 2, vocab 3]
    got = ref + np.array([[[0.0, 0.0, 0.0], [0.0, 0.0, 0.1]]])
    valid = np.array([[True, True]])
    c = compare("logits", got, ref, valid, Tolerance(0.2, 0.0, 0.99), logits=True)
    assert c.max_abs == pytest.approx(0.1) and c.max_rel == pytest.approx(0.05)
    assert c.cosine == pytest.approx(5 / np.sqrt(5 * 5.01))
    assert c.top1 == 1.0 and c.passed
    assert not compare("logits", got, ref, valid, Tolerance(0.05, 0.0, 0.99), logits=True).passed
    # Masked positions are not compared; NaN anywhere (even masked) fails.
    bad = got.copy()
    bad[0, 0, 0] = 99.0
    assert compare("logits", bad, ref, np.array([[False, True]]), Tolerance(0.2, 0.0, 0.99)).passed
    bad[0, 0, 0] = np.nan
    c = compare("logits", bad, ref, np.array([[False, True]]), Tolerance(0.2, 0.0, 0.99))
    assert c.nonfinite == 1 and not c.passed


def test_top1_miss_counts_only_where_the_reference_is_decisive():
    ref = np.array([[[1.0, 0.99, 0.0], [3.0, 0.0, 0.0]]])
    got = np.array([[[0.99, 1.0, 0.0], [3.0, 0.0, 0.0]]])  # position 0 flips on a 0.01 tie
    c = compare("logits", got, ref, np.ones((1, 2), bool), Tolerance(0.02, 0.0, 0.99), logits=True)
    assert c.top1 == 0.5 and c.decisive_misses == 0 and c.passed
    got[0, 1] = [0.0, 3.1, 0.0]  # position 1 flips against a margin of 3
    c = compare("logits", got, ref, np.ones((1, 2), bool), Tolerance(1.0, 0.0, 0.0), logits=True)
    assert c.decisive_misses == 1 and not c.passed


def test_left_padding_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions(mask, 3).tolist() == [[0, 1, 2], [0, 0, 0]]
    grown = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    assert positions(grown, 1).tolist() == [[3], [1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])


# --- whole runs -----------------------------------------------------------------------------------------

def test_fp32_parity_passes_on_a_padded_batch(exported, checkpoint):
    rep = verify_parity(resolve_target(str(exported), str(checkpoint)), prompts=PROMPTS, steps=6)
    assert rep.provider == "cpu" and rep.budget == FP32
    assert rep.prompt_lengths == [10, 5]
    names = [c.name for c in rep.checks]
    assert names[0] == "logits" and names[-1] == "decode logits"
    assert len([n for n in names if n.startswith("present.")]) == 2 * TINY.num_hidden_layers
    assert rep.passed, [c.verdict for c in rep.checks if not c.passed]
    logits = rep.checks[0]
    assert 0 < logits.noise and logits.error <= logits.bound and logits.top1 == 1.0 and logits.cosine > 0.99999
    assert rep.decode.first_divergence is None and rep.decode.agreed == 6
    assert rep.first_bad_layer is None


def test_verdict_does_not_depend_on_the_ids(exported, checkpoint):
    # The same export, several seeds of random ids of different lengths: every one passes.
    target = resolve_target(str(exported), str(checkpoint))
    for seed in range(4):
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(3, TINY.vocab_size, size=n).tolist() for n in (7 + seed, 3 + 2 * seed)]
        rep = verify_parity(target, prompts=prompts, steps=3)
        assert rep.passed, (seed, [c.figures() for c in rep.checks if not c.passed])


def test_perturbed_weight_fails(exported, checkpoint, tmp_path):
    state = sharp_state()
    state["model.layers.1.self_attn.v_proj.weight"][3, 5] += 0.5
    save_checkpoint(TINY, state, tmp_path / "other", to="hf")
    rep = verify_parity(resolve_target(str(exported), str(tmp_path / "other")), prompts=PROMPTS, steps=2)
    assert not rep.passed
    assert rep.first_bad_layer == 1  # layer 0 still agrees: the report points at the right layer
    assert not rep.checks[0].passed


def test_one_matrix_scaled_by_one_percent_fails_at_its_layer(exported, checkpoint, tmp_path):
    state = sharp_state()
    state["model.layers.1.mlp.up_proj.weight"] *= 1 + 1e-2
    save_checkpoint(TINY, state, tmp_path / "scaled", to="hf")
    rep = verify_parity(resolve_target(str(exported), str(tmp_path / "scaled")), prompts=PROMPTS, steps=2)
    # Layer 1's own K/V come before its MLP: they agree; the logits see it, far beyond the budget.
    assert not rep.passed and rep.first_bad_layer is None
    assert all(c.passed for c in rep.checks if c.name.startswith("present."))
    assert rep.checks[0].ratio > 10 * rep.checks[0].multiple
    state = sharp_state()
    state["model.layers.0.mlp.up_proj.weight"] *= 1 + 1e-2
    save_checkpoint(TINY, state, tmp_path / "scaled0", to="hf")
    rep = verify_parity(resolve_target(str(exported), str(tmp_path / "scaled0")), prompts=PROMPTS, steps=2)
    assert not rep.passed and rep.first_bad_layer == 1  # layer 0's MLP feeds layer 1's K/V


def test_wrong_rope_layout_fails(checkpoint, tmp_path):
    from llama_tools.checkpoints.loading import load_model

    model = load_model(str(checkpoint))
    model.cfg = model.cfg.replace(rope_layout="interleaved")  # weights are in the half-split layout
    for layer in model.model.layers:
        layer.self_attn.cfg = model.cfg
    export_onnx(model, str(tmp_path / "wrong.onnx"))
    rep = verify_parity(resolve_target(str(tmp_path / "wrong.onnx"), str(checkpoint)), prompts=PROMPTS, steps=2)
    assert not rep.passed and rep.first_bad_layer == 0
    assert rep.checks[0].ratio > 100 * FP32.multiple


def test_missing_causal_mask_fails(checkpoint, tmp_path, monkeypatch):
    import llama_tools.modeling.model as model_module

    causal = model_module.attention_bias

    def no_causal(*args, **kwargs):
        full = causal(*args, **kwargs)
        return torch.zeros_like(full)  # every key visible, the future included

    monkeypatch.setattr(model_module, "attention_bias", no_causal)
    export_onnx(str(checkpoint), str(tmp_path / "nomask.onnx"))
    monkeypatch.undo()
    rep = verify_parity(resolve_target(str(tmp_path / "nomask.onnx"), str(checkpoint)), prompts=PROMPTS, steps=2)
    # Layer 0's K/V come before any attention, so they agree; layer 1's inputs already saw the future.
    assert not rep.passed and rep.first_bad_layer == 1
    assert rep.checks[1].passed and not rep.checks[0].passed


def test_fp16_graph_against_the_fp32_reference(checkpoint, tmp_path):
    export_onnx(str(checkpoint), str(tmp_path / "fp16.onnx"), dtype="float16")
    rep = verify_parity(resolve_target(str(tmp_path / "fp16.onnx"), str(checkpoint)), prompts=PROMPTS, steps=4)
    assert rep.dtype == "float16" and rep.budget == BUDGET["float16"]
    assert rep.passed, [c.figures() for c in rep.checks if not c.passed]
    assert 0 < rep.checks[0].error and rep.checks[0].noise > 1e-5  # fp16 rounding is visible, and within budget
    assert rep.checks[0].top1 >= 0.9


# --- CLI -------------------------------------------------------------------------------------------------

def test_cli_no_arguments_exports_and_checks_tiny():
    r = CliRunner().invoke(cli, ["verify", "parity", "--steps", "3"])
    assert r.exit_code == 0, r.output
    assert "CPU provider" in r.output and r.output.strip().splitlines()[-1].startswith("PASS")


def test_cli_json_and_exit_code_on_failure(exported, checkpoint, tmp_path):
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--ids", "1 5 9 200", "--ids", "3 4",
                                 "--steps", "2", "--format", "json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["passed"] is True and data["source"] == str(checkpoint) and data["prompt_lengths"] == [4, 2]
    assert data["inputs"] == "2 row(s) given" and data["by_layer"]["passed"] and data["whole_graph"]["passed"]
    logits = data["whole_graph"]["checks"][0]
    assert logits["name"] == "logits" and logits["passed"] is True
    assert logits["ratio"] == pytest.approx(logits["error"] / logits["noise"])
    assert logits["bound"] == pytest.approx(logits["multiple"] * logits["noise"] + logits["floor"])
    state = sharp_state()
    state["lm_head.weight"] *= 1.01
    save_checkpoint(TINY, state, tmp_path / "off", to="hf")
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--source", str(tmp_path / "off"),
                                 "--steps", "1"])
    assert r.exit_code == 1 and "FAIL; first out of budget: logits only" in r.output  # lm_head: past every layer


def test_cli_default_inputs_are_real_text_and_random_ids_on_request(exported):
    """The header says which inputs ran: the built-in text through the model's tokenizer, or seeded random ids."""
    r = CliRunner().invoke(cli, ["verify", "parity", "tiny", "--steps", "1", "--format", "json"])
    data = json.loads(r.output)
    assert r.exit_code == 0 and data["inputs"].startswith("built-in text through tokenizer.model"), data["inputs"]
    assert len(data["prompt_lengths"]) == 5 and len(set(data["prompt_lengths"])) > 1  # left padding exercised
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--steps", "1", "--format", "json"])
    data = json.loads(r.output)  # a checkpoint without a tokenizer file: random ids, and the header says why
    assert r.exit_code == 0 and data["inputs"] == "2 rows of seeded random ids (seed 0; the model has no tokenizer)"
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--steps", "1", "--random-ids", "3", "--seed",
                                 "7", "--format", "json"])
    data = json.loads(r.output)
    assert r.exit_code == 0 and data["inputs"].startswith("3 rows of seeded random ids (seed 7"), data["inputs"]
    assert data["prompt_lengths"] == [11, 6, 16]
    r = CliRunner().invoke(cli, ["verify", "parity", str(exported), "--random-ids", "2", "--ids", "1 2"])
    assert r.exit_code != 0 and "--random-ids" in r.output


@pytest.mark.parametrize("args, needle", [
    (["verify", "parity", "missing.onnx"], "missing.onnx"),
    (["verify", "parity", "no-such-model"], "Known presets"),
    (["verify", "parity", "tiny", "--ids", "1 x 3"], "--ids"),
    (["verify", "parity", "tiny", "--ids", "1 999999"], "outside the vocabulary"),
])
def test_cli_bad_input_is_one_line(args, needle):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


# --- a real trained model (SmolLM2-135M, logits up to ~30): the budget holds where a fixed bound did not ---

@pytest.fixture(scope="module")
def smollm2_fused(smollm2_hf, tmp_path_factory):
    from llama_tools.exporters.pipeline import export
    from llama_tools.checkpoints.source import resolve

    out = tmp_path_factory.mktemp("smollm2") / "model.onnx"
    export(resolve(str(smollm2_hf)), out, optimize=True, client_files=False)
    return out


@pytest.mark.slow
def test_real_model_passes_for_random_ids_and_real_text(smollm2_fused, smollm2_hf):
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json")).encode("The capital of France is Paris.").ids
    target = resolve_target(str(smollm2_fused), str(smollm2_hf))
    rng = np.random.default_rng(7)
    rep = verify_parity(target, prompts=[text, rng.integers(3, 49152, size=9).tolist()], steps=2)
    assert rep.passed, [c.figures() for c in rep.checks if not c.passed]
    assert 1 < max(abs(c.scale) for c in rep.checks)  # real logits, not a seeded model's small ones
