"""Phi-3's longrope in a GGUF, as llama.cpp's converter writes it: rope_factors_long/short.weight (F32, one per rotated
pair), phi3.rope.scaling.original_context_length and attn_factor, no scaling type key.

The source is a tiny seeded Phi3ForCausalLM saved by transformers (test_gguf_llamacpp's phi3 case and byte-level
tokenizer): longrope from 32 to 512 positions, short and long factors off 1, partial rotary 0.75 of 32-wide heads (12
factors each). Truth is transformers 4.57 itself: its logits on 192 positions take the long factors (the pass is longer
than the original context); llama.cpp takes them when its context (n_ctx 512) is, and the short ones when n_ctx is
within it. Checked: llama.cpp's logits and greedy tokens past the original context, the short factors at n_ctx 32,
the config, count and logits read back from the GGUF, and negative cases (the two factor tensors swapped, the
attention factor left at 1) far off.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import test_gguf_llamacpp as lc  # noqa: E402
from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import load_config  # noqa: E402
from llama_tools.checkpoints.gguf.read import field_value, open_gguf  # noqa: E402
from helpers import finish_gguf  # noqa: E402
from test_hostile import assert_ok, invoke  # noqa: E402

ORIGINAL = 32  # original_max_position_embeddings: the 192 positions compared are far past it
SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.3, 2.6, 3.0, 3.5]  # rotary 24 / 2 = 12 each
LONG = [1.0, 1.25, 1.6, 2.0, 2.5, 3.2, 4.0, 5.0, 6.4, 8.0, 10.0, 12.0]
FIELDS = dict(partial_rotary_factor=0.75, hidden_size=128, max_position_embeddings=512,
              original_max_position_embeddings=ORIGINAL,
              rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
PROMPT = 48  # greedy tokens from a prompt past the original context: both sides on the long factors
# llama.cpp against transformers, F32: the bound every F32 family without GELU is held to in test_gguf_llamacpp and
# test_partial_rotary (1e-5). The phi3 GGUFs those tests write measure 2.3e-7 (whole heads) and 3.9e-7 (partial
# rotary 0.75 of 32-wide heads, this source without longrope) on the same 192 positions; longrope only divides each
# pair's frequency and scales cos and sin, in float32 on both sides. Measured here: 3.9e-7 (long), 4.0e-7 (short).
BOUND = lc.F32_BOUND


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(transformers' model, Source with its logits on 192 positions, the GGUF written by `convert --to gguf`)."""
    root = tmp_path_factory.mktemp("longrope")
    tokenizers = {"bpe": lc._tokenizer_files("bpe", root / "tokenizer")}
    src = lc.reference("phi3", root / "hf", tokenizers, **FIELDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src.path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    out = root / "m.gguf"
    assert lc.warnings_of(lc.to_gguf(src.path, out)) == []
    return hf, src, out


def test_the_file_holds_what_llama_cpps_converter_writes(source):
    hf, _, out = source
    reader = open_gguf(out)
    tensors = {t.name: t for t in reader.tensors}
    for name, want in (("rope_factors_long.weight", LONG), ("rope_factors_short.weight", SHORT)):
        t = tensors[name]
        assert t.tensor_type.name == "F32" and list(t.shape) == [12]
        assert np.array_equal(np.asarray(t.data), np.asarray(want, np.float32))
    assert field_value(reader, "phi3.rope.scaling.original_context_length") == ORIGINAL
    assert field_value(reader, "phi3.rope.dimension_count") == 24
    assert field_value(reader, "phi3.context_length") == 512
    assert field_value(reader, "phi3.rope.scaling.type") is None  # the converter writes none; llama.cpp needs none
    # the converter's sqrt(1 + ln(512 / 32) / ln(32)), transformers' attention_scaling
    assert field_value(reader, "phi3.rope.scaling.attn_factor") == pytest.approx(
        hf.model.rotary_emb.attention_scaling, rel=1e-7)


def test_llama_cpp_computes_transformers_past_the_original_context(source):
    hf, src, out = source
    llm = lc.llama(out)  # n_ctx 512 > 32: llama.cpp's long factors
    llm.eval(src.ids)
    got = np.asarray(llm.scores[:lc.N], dtype=np.float64)
    err = lc.rel_rms(got, src.logits)
    print(f"llama.cpp vs transformers, 192 positions, long factors: relative RMS {err:.2e}")
    assert err <= BOUND, err  # measured 3.9e-7
    prompt = torch.tensor([src.ids[:PROMPT]])
    want = hf.generate(prompt, do_sample=False, max_new_tokens=lc.STEPS, min_new_tokens=lc.STEPS, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones_like(prompt))[0, PROMPT:].tolist()
    assert lc.llama_greedy(llm, src.ids[:PROMPT], lc.STEPS) == want


def test_llama_cpp_takes_the_short_factors_within_the_original_context(source):
    """llama.cpp decides by its context, not by the pass: this one pads n_ctx to a multiple of 256 (n_ctx 32 runs as
    256, on the long factors: 4.1e-7 from transformers' long, 9.9e-3 from its short), so the original context is
    told as 256 (kv override) and n_ctx 256 is within it: the short factors, transformers' on a 32-token pass."""
    import llama_cpp

    hf, src, out = source
    ids = src.ids[:ORIGINAL]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, flash_attn=False,
                          type_k=0, type_v=0, n_threads=2, verbose=False,  # lc.llama's settings, but n_ctx
                          kv_overrides={"phi3.rope.scaling.original_context_length": 256})
    assert llm.n_ctx() == 256
    llm.eval(ids)
    err = lc.rel_rms(np.asarray(llm.scores[:ORIGINAL], dtype=np.float64), want)
    print(f"llama.cpp vs transformers, 32 positions, short factors: relative RMS {err:.2e}")
    assert err <= BOUND, err  # measured 4.0e-7


def test_read_back_as_the_checkpoint(source):
    hf, src, out = source
    ours = load_model(out)
    want = load_config(src.path / "config.json")
    assert ours.cfg.rope_scaling == want.rope_scaling  # type, factor, original context, attention factor, factors
    assert (ours.cfg.rotary_dim, ours.cfg.max_position_embeddings) == (want.rotary_dim, 512)
    with torch.no_grad():
        mine = ours(torch.tensor([src.ids])).logits[0].double().numpy()
    assert lc.rel_rms(mine, src.logits) <= BOUND
    r = invoke(["count-params", str(out), "--format", "json"])
    assert_ok(r)
    assert json.loads(r.stdout)[0]["total"] == sum(p.numel() for p in hf.parameters())


def test_count_params_check_passes(source):
    _, _, out = source
    assert_ok(invoke(["count-params", str(out), "--check"]))


def _rewritten(out: Path, dst: Path, tensors: dict[str, str] | None = None, floats: dict[str, float] | None = None,
               drop: tuple[str, ...] = (), arrays: dict[str, np.ndarray] | None = None) -> Path:
    """OUT copied to DST with tensors renamed (old -> new), dropped or replaced (F32 ARRAYS), and float32 keys
    set."""
    import gguf

    reader = gguf.GGUFReader(out)
    arch = field_value(reader, "general.architecture")
    w = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if floats and name in floats:
            w.add_float32(name, floats[name])
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), t)
    for t in reader.tensors:
        if arrays and t.name in arrays:
            w.add_tensor(t.name, arrays[t.name])
        elif t.name not in drop:
            w.add_tensor((tensors or {}).get(t.name, t.name), np.asarray(t.data),
                         raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    finish_gguf(w)
    return dst


def test_negative_swapped_factor_tensors_are_far_off(source, tmp_path):
    _, src, out = source
    swapped = _rewritten(out, tmp_path / "swapped.gguf", tensors={
        "rope_factors_long.weight": "rope_factors_short.weight",
        "rope_factors_short.weight": "rope_factors_long.weight"})
    err = lc.rel_rms(lc.llama_logits(swapped, src.ids), src.logits)
    print(f"swapped factor tensors: relative RMS {err:.2e}")
    assert err > 100 * BOUND, err  # measured 2.0e-2: 5e4 times the file as written


def test_negative_attention_factor_left_at_one_is_far_off(source, tmp_path):
    _, src, out = source
    plain = _rewritten(out, tmp_path / "plain.gguf", floats={"phi3.rope.scaling.attn_factor": 1.0})
    err = lc.rel_rms(lc.llama_logits(plain, src.ids), src.logits)
    print(f"attention factor 1: relative RMS {err:.2e}")
    assert err > 100 * BOUND, err  # measured 1.7e-2


def test_one_factor_tensor_alone_is_one_line(source, tmp_path):
    _, _, out = source
    one = _rewritten(out, tmp_path / "one.gguf", drop=("rope_factors_short.weight",))
    with pytest.raises(ValueError, match="holds 'rope_factors_long.weight' but not 'rope_factors_short.weight'"):
        load_model(one)


@pytest.mark.parametrize("values, said", [(np.ones(11, np.float32), "must hold 12 finite factors > 0"),
                                          (np.r_[np.ones(11), 0.0].astype(np.float32), "must hold 12 finite")])
def test_bad_factor_tensors_are_one_line_naming_them(source, tmp_path, values, said):
    _, _, out = source
    bad = _rewritten(out, tmp_path / "bad.gguf", arrays={"rope_factors_long.weight": values})
    with pytest.raises(ValueError, match=f"tensor 'rope_factors_long.weight' {said}"):
        load_model(bad)
