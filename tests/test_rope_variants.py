"""RoPE variants transformers implements beyond linear and llama3: yarn (DeepSeek's mscale pair too), dynamic NTK and
longrope, computed to transformers' own arithmetic (modeling_rope_utils.py) in the model, the streamed reference and
(yarn: its tables are fixed) the plain and fused ONNX graphs.

Each case is a tiny seeded Llama saved by the installed transformers with `rope_scaling` of that type; our fp32 logits
must equal transformers' eager fp32 logits (relative RMS <= 1e-4, argmax wherever the top two are apart) at positions
past the original context, where each variant changes the model (the same weights without the scaling are far off:
the positions tested are ones the variant decides). dynamic and longrope pick their tables from the pass's length, as
transformers' RotaryEmbedding does at every forward call; a KV-cache decode step by step through the original
context is compared to transformers' own decode with its cache. Their graphs compute the tables from each pass's
length (tests/test_pass_length_rope.py). Negative cases: yarn with its attention factor dropped is far off, in the model and through
`verify parity` (a graph exported so fails against the checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from config_cases import saved_model  # noqa: E402
from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import config_from_hf, config_to_hf, load_config  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.exporters.fused import export_fused  # noqa: E402
from llama_tools.exporters.onnx_export import export_onnx  # noqa: E402
from llama_tools.exporters.verification.parity import resolve_target  # noqa: E402
from llama_tools.exporters.verification.verdict import parity_inputs, verify  # noqa: E402
from llama_tools.inference.reference import reference_model  # noqa: E402
from llama_tools.modeling.model import model_from_state, rope_tables_of  # noqa: E402

FIXTURES = Path(__file__).parent / "data" / "transformers5"
SEQ = 320  # past every original context below (64, and dynamic's 128)
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_theta=10000.0)
SHORT = [1.0, 1.1, 1.3, 1.5, 2.0, 2.5, 3.0, 3.5]  # longrope's factors: head_dim / 2 = 8 each
LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
# case -> the LlamaConfig keywords besides SIZES, as transformers 4.x takes them
CASES = {
    "yarn": dict(max_position_embeddings=1024, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn-deepseek": dict(max_position_embeddings=1024, rope_scaling={  # DeepSeek's mscale pair, betas, no truncate
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    "dynamic": dict(max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "longrope": dict(max_position_embeddings=1024, original_max_position_embeddings=64, rope_scaling={
        "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}),
}


def _ids(n: int = SEQ, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, n]


def hf_checkpoint(case: str, directory: Path):
    """The case's model as the installed transformers builds and saves it, off its initial values (q and k at 3x
    unit gain, so RoPE's angles decide the attention, and so the logits)."""
    return saved_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SIZES, **CASES[case]), directory)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, hf_checkpoint(request.param, directory)


def relative_rms(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).double().pow(2).mean().sqrt() / expected.double().pow(2).mean().sqrt()).item()


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = torch.as_tensor(got).float(), torch.as_tensor(expected).float()
    assert got.shape == expected.shape
    assert expected.std() > 0.1  # logits that vary: the comparison means something
    assert relative_rms(got, expected) <= 1e-4, relative_rms(got, expected)
    top2 = expected.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 1e-4 * expected.std()  # a closer call is rounding's to make
    assert torch.equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])
    assert decided.float().mean() > 0.99


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("length", [48, SEQ])
def test_model_gives_transformers_logits(case, length):
    """Within the original context (48: longrope's short factors, dynamic's base unchanged) and past it."""
    name, directory, model = case
    ours = load_model(directory)
    assert ours.cfg.rope_scaling.type == CASES[name]["rope_scaling"]["rope_type"]
    expected = _hf_logits(model, _ids(length))
    with torch.no_grad():
        assert_same_logits(ours(_ids(length)).logits, expected)


def test_the_variant_decides_the_positions_tested(case):
    """The same weights without the scaling (or dynamic and longrope with their short-pass tables) are far off at
    SEQ positions: agreement above is the variant's, not RoPE's unscaled."""
    name, directory, model = case
    ours = load_model(directory)
    expected = _hf_logits(model, _ids())
    plain = model_from_state(ours.cfg.replace(rope_scaling=None, max_position_embeddings=SEQ), ours.state_dict(),
                             torch.float32)
    with torch.no_grad():
        assert relative_rms(plain(_ids()).logits, expected) > 1e-2
        if name in ("dynamic", "longrope"):  # the tables of a pass within the original context: far off
            short = rope_tables_of(ours.cfg, length=SEQ)
            assert relative_rms(ours(_ids(), rope_tables=short).logits, expected) > 1e-2


def test_streamed_reference_gives_transformers_logits(case):
    name, directory, model = case
    ref = reference_model(resolve(str(directory)))
    assert_same_logits(ref(_ids()).logits, _hf_logits(model, _ids()))


def test_source_check_passes(case):
    """`verify source`: transformers' layers, each fed our float64 input, against our layer reference, whose tables
    are the pass's (a left-padded batch: the longest row's length, as transformers' position_ids give)."""
    from llama_tools.exporters.verification.source_check import check_source

    name, directory, _ = case
    rep = check_source(resolve(str(directory)), [_ids(200, 1).tolist()[0], _ids(150, 2).tolist()[0]])
    assert rep.checked and rep.passed, rep.failure


def _hf_decode(model, ids: torch.Tensor, prefill: int) -> list[torch.Tensor]:
    """transformers' own generation path: prefill, then one token a step through its cache."""
    out = []
    with torch.no_grad():
        o = model(ids[:, :prefill], use_cache=True)
        out.append(o.logits)
        past = o.past_key_values
        for i in range(prefill, ids.shape[1]):
            o = model(ids[:, i:i + 1], past_key_values=past, use_cache=True)
            out.append(o.logits)
            past = o.past_key_values
    return out


@pytest.mark.parametrize("name, prefill, total", [("longrope", 56, 72), ("dynamic", 120, 136), ("yarn", 56, 72)])
def test_kv_cache_decode_through_the_original_context(name, prefill, total, tmp_path):
    """A prefill within the original context, then one token a step past it: each step's new queries and keys use
    the tables of that step's length, the cached keys keep theirs (transformers' decode, step for step)."""
    model = hf_checkpoint(name, tmp_path)
    ids = _ids(total)
    expected = _hf_decode(model, ids, prefill)
    ours = load_model(tmp_path)
    got = []
    with torch.no_grad():
        o = ours(ids[:, :prefill])
        got.append(o.logits)
        past = o.past_key_values
        for i in range(prefill, total):
            o = ours(ids[:, i:i + 1], past_key_values=past)
            got.append(o.logits)
            past = o.past_key_values
    assert_same_logits(torch.cat(got, 1), torch.cat(expected, 1))
    # and the decode is not the prefill: past the switch, the cached keys' rotation differs from a whole pass's
    with torch.no_grad():
        whole = ours(ids).logits[:, -1]
    gap = relative_rms(whole, got[-1][:, -1])
    assert gap > 1e-3 if name != "yarn" else gap < 1e-4


def test_qwen2_yarn_as_qwen25_ships_it(tmp_path):
    """Qwen2.5's long-context recipe: {"type": "yarn", "factor": 4, "original_max_position_embeddings": ...} (the old
    `type` key) on a Qwen2 with q/k/v biases: transformers' logits past the original context."""
    config = transformers.Qwen2Config(**{**SIZES, "max_position_embeddings": 1024, "rope_theta": 1e6},
                                      rope_scaling={"type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 64})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, (3.0 if any(k in name for k in ("q_proj", "k_proj")) else 1.0) / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.cfg.family == "qwen2" and ours.cfg.rope_scaling.type == "yarn"
    with torch.no_grad():
        assert_same_logits(ours(_ids()).logits, _hf_logits(model, _ids()))


def test_yarn_attention_factor_resolved_as_transformers_does(tmp_path):
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], **SIZES, **CASES["yarn"]})
    assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], **SIZES, **CASES["yarn-deepseek"]})
    assert cfg.rope_scaling.attention_factor == pytest.approx((0.1 * np.log(8.0) + 1) / (0.05 * np.log(8.0) + 1))
    assert (cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow, cfg.rope_scaling.truncate) == (16.0, 2.0, False)
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], **SIZES, **CASES["longrope"]})
    s = cfg.rope_scaling
    assert (s.factor, s.original_max_position_embeddings) == (16.0, 64)
    assert s.attention_factor == pytest.approx(np.sqrt(1 + np.log(16.0) / np.log(64)))


@pytest.mark.parametrize("name", ["yarn", "yarn-deepseek"])
def test_yarn_without_its_attention_factor_is_far_off(name, tmp_path):
    """The negative case: the comparison above sees a dropped attention factor (cos and sin unscaled)."""
    model = hf_checkpoint(name, tmp_path)
    ours = load_model(tmp_path)
    s = dataclasses.replace(ours.cfg.rope_scaling, attention_factor=1.0)
    wrong = model_from_state(ours.cfg.replace(rope_scaling=s), ours.state_dict(), torch.float32)
    with torch.no_grad():
        assert relative_rms(wrong(_ids()).logits, _hf_logits(model, _ids())) > 1e-2


def test_config_round_trips_through_transformers(case, tmp_path):
    """config_to_hf writes each type's own keys; transformers and our reader take them back as the same model."""
    name, directory, _ = case
    cfg = load_config(directory / "config.json")
    d = config_to_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_config(tmp_path / "config.json").rope_scaling == cfg.rope_scaling
    hf = transformers.LlamaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theirs = ROPE_INIT_FUNCTIONS[cfg.rope_scaling.type](hf, "cpu", seq_len=SEQ)
    ours = ROPE_INIT_FUNCTIONS[cfg.rope_scaling.type](
        transformers.LlamaConfig(**{**SIZES, **CASES[name]}), "cpu", seq_len=SEQ)
    assert torch.allclose(theirs[0], ours[0]) and theirs[1] == pytest.approx(ours[1])


@pytest.mark.parametrize("name", ["yarn", "longrope"])
def test_transformers5_layout_reads_as_the_same_config(name, tmp_path):
    """tests/data/transformers5/llama-{yarn,longrope}.json are written by hand in transformers 5's `rope_parameters`
    form (rope_theta inside, longrope's original context inside too), transformers 5 not being installed here; they
    must read as the 4.x config transformers 4 saved."""
    v4 = config_from_hf({"architectures": ["LlamaForCausalLM"], **SIZES, **CASES[name]})
    path = tmp_path / "config.json"
    shutil.copy(FIXTURES / f"llama-{name}.json", path)
    v5 = load_config(path)
    assert v5.rope_scaling == v4.rope_scaling and v5.rope_theta == v4.rope_theta


@pytest.mark.parametrize("changes, named", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "beta_fast": 32.0}}, "rope_scaling.beta_fast"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64},
      "max_position_embeddings": 128}, "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG}}, "short_factor"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": LONG}}, "short_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}}, "attention_factor"),
])
def test_bad_variant_parameters_are_one_line(changes, named):
    with pytest.raises(ValueError) as e:
        config_from_hf({"architectures": ["LlamaForCausalLM"], **SIZES, "max_position_embeddings": 1024, **changes})
    assert named in str(e.value) and "\n" not in str(e.value)


# --- Through the graphs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def yarn_source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("yarn-graph")
    return directory, hf_checkpoint("yarn", directory)


def _onnx_logits(graph: Path, ids: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    n = ids.shape[1]
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, SIZES["num_key_value_heads"], 0, 16), np.float32)
    return sess.run(["logits"], feeds)[0]


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_yarn_graph_gives_transformers_logits_and_passes_verify(yarn_source, graph, tmp_path):
    directory, model = yarn_source
    out = tmp_path / "model.onnx"
    (export_onnx if graph == "plain" else export_fused)(str(directory), out)
    assert_same_logits(_onnx_logits(out, _ids()), _hf_logits(model, _ids()))
    target = resolve_target(str(out), str(directory))
    rows = [_ids(n, seed).tolist()[0] for n, seed in ((200, 1), (180, 2))]  # past the original context (64), one
    # row left-padded: the fused graph's keys are turned back from slots to positions by the rotation alone
    v = verify(target, parity_inputs(target, rows, 2), provider="cpu", steps=2)
    assert v.source_check is not None and v.source_check.passed, v.first_bad  # transformers ran the checkpoint
    assert v.passed, v.first_bad


def test_a_graph_without_yarns_attention_factor_fails_verify(yarn_source, tmp_path):
    """The negative case through the parity machinery: a graph whose tables lack the attention factor (exported
    from the same weights with attention_factor 1 written in) FAILS against the checkpoint."""
    directory, _ = yarn_source
    wrong = tmp_path / "wrong"
    shutil.copytree(directory, wrong)
    data = json.loads((wrong / "config.json").read_text())
    data["rope_scaling"]["attention_factor"] = 1.0
    (wrong / "config.json").write_text(json.dumps(data))
    out = tmp_path / "model.onnx"
    export_onnx(str(wrong), out)
    target = resolve_target(str(out), str(directory))
    v = verify(target, parity_inputs(target, [_ids(200, 1).tolist()[0]], 2), provider="cpu", steps=2,
               source_check=False)
    assert not v.passed


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_pass_dependent_variants_export_with_tables_computed_in_the_graph(name, graph, tmp_path):
    """No longer refused: the graph computes each pass's tables from its length (tests/test_pass_length_rope.py
    compares them with transformers through the switch)."""
    hf_checkpoint(name, tmp_path / "src")
    result = (export_onnx if graph == "plain" else export_fused)(str(tmp_path / "src"), tmp_path / "model.onnx")
    assert result.path.is_file()


# --- GGUF: yarn in and out as llama.cpp keeps it; dynamic has no llama.cpp keys, longrope only Phi-3's tensors ---

YARN_GGUF = {"yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
             "yarn-deepseek": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, mscale=1.0,
                                   mscale_all_dim=0.5, beta_fast=16.0, beta_slow=2.0)}


@pytest.fixture(scope="module")
def gguf_helpers():
    pytest.importorskip("llama_cpp")
    import test_gguf_llamacpp

    return test_gguf_llamacpp


@pytest.fixture(scope="module", params=list(YARN_GGUF))
def yarn_gguf(request, gguf_helpers, tmp_path_factory):
    """transformers' checkpoint (tests/test_gguf_llamacpp.py's Llama with a sentencepiece vocabulary, 192 positions
    of text: past the original context of 64) and its GGUF by `convert --to gguf`, with that command's stderr."""
    t = gguf_helpers
    d = tmp_path_factory.mktemp(request.param)
    tokenizers = {"spm": t._tokenizer_files("spm", d / "tok")}
    src = t.reference("llama", d / "hf", tokenizers, rope_scaling=YARN_GGUF[request.param],
                      max_position_embeddings=512)
    stderr = t.to_gguf(src.path, d / "m.gguf")
    return request.param, src, d / "m.gguf", stderr


def test_yarn_gguf_llama_cpp_computes_transformers(yarn_gguf, gguf_helpers):
    """llama.cpp itself on the GGUF: transformers' logits (its F32 bound). Its attention factor is
    rope.scaling.attn_factor x (1 + 0.1 ln factor), which ggml multiplies in; this llama.cpp reads no yarn beta keys
    for 'llama', so betas other than 32/1 are said, and hold when given to llama.cpp by hand (and not otherwise)."""
    t = gguf_helpers
    name, src, path, stderr = yarn_gguf
    warned = [w for w in t.warnings_of(stderr) if "yarn beta" in w]
    if name == "yarn":
        assert warned == []
        assert t.rel_rms(t.llama_logits(path, src.ids), src.logits) <= t.F32_BOUND
    else:
        assert len(warned) == 1 and "16/2" in warned[0], stderr
        assert t.rel_rms(t.llama_logits(path, src.ids, yarn_beta_fast=16.0, yarn_beta_slow=2.0),
                         src.logits) <= t.F32_BOUND
        assert t.rel_rms(t.llama_logits(path, src.ids), src.logits) > 1e-3


def test_yarn_gguf_reads_back_as_the_checkpoint(yarn_gguf):
    name, src, path, _ = yarn_gguf
    ours = load_model(path)
    want = load_config(src.path / "config.json").rope_scaling
    got = ours.cfg.rope_scaling
    assert dataclasses.replace(got, attention_factor=None) == dataclasses.replace(want, attention_factor=None)
    assert got.attention_factor == pytest.approx(want.attention_factor, rel=1e-6)
    with torch.no_grad():
        logits = ours(torch.tensor([src.ids])).logits[0]
    assert_same_logits(logits, torch.from_numpy(src.logits).float())


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_gguf_out_refuses_variants_llama_cpp_has_no_keys_for(name, tmp_path):
    """Llama with dynamic NTK, or with longrope, which llama.cpp reads as factor tensors for phi3 alone (written and
    checked against llama.cpp there: tests/test_gguf_longrope.py)."""
    from click.testing import CliRunner

    from llama_tools.cli import cli

    hf_checkpoint(name, tmp_path / "src")
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "src"), str(tmp_path / "m.gguf"), "--to", "gguf"])
    assert r.exit_code == 1 and f"rope_scaling {name!r}" in r.output and len(r.output.strip().splitlines()) == 1, \
        r.output
    assert not (tmp_path / "m.gguf").exists()
