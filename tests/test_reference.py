"""The layer-streamed fp32 reference: the same numbers as the whole model, one layer's weights at a time.

Truth is `load_model(dir)` (the whole model in fp32) on tiny checkpoints written in every layout we read;
the memory claims are checked by watching which tensors are alive when each layer is read.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.checkpoints.loading import load_model
from llama_tools.modeling.model import Llama
from llama_tools.inference.reference import (
    CheckpointReader, StreamedReference, check_fits, reference_memory, reference_model)
from helpers import sharp

TINY = get_preset("tiny")  # 2 layers, n2 64, n7 176, GQA 4/2 heads of 16, vocab 512
TOL = 1e-6

SOURCES = {  # name -> (config, save_checkpoint kwargs)
    "hf-sharded": (TINY, {"to": "hf", "shards": 2}),
    "meta-2-shards": (TINY, {"to": "meta", "shards": 2}),
    "baichuan2-w-pack-alibi": (TINY.replace(family="baichuan", num_key_value_heads=4, norm_head=True,
                                            position_encoding="alibi"), {"to": "hf"}),
    "internlm2-wqkv": (TINY.replace(family="internlm2"), {"to": "hf"}),
    "tied-embeddings": (TINY.replace(tie_word_embeddings=True), {"to": "hf"}),
}


def write(cfg, tmp_path, **kw):
    state = {k: v.detach().clone() for k, v in sharp(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_checkpoint(cfg, state, tmp_path / "ckpt", **kw)
    return tmp_path / "ckpt"


def run_both(full, streamed, steps: int = 2):
    """Prefill a left-padded batch of 2, then greedy steps fed the full model's tokens to both."""
    ids = torch.randint(3, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # row 1 is left-padded
    pairs = []
    with torch.no_grad():
        a, b = full(ids, attention_mask=mask), streamed(ids, attention_mask=mask)
        pairs.append((a, b))
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)  # [2, past + 1]
            nxt = a.logits[:, -1].argmax(-1)[:, None]  # [2, 1]
            a = full(nxt, attention_mask=mask, past_key_values=a.past_key_values)
            b = streamed(nxt, attention_mask=mask, past_key_values=b.past_key_values)
            pairs.append((a, b))
    return pairs


def max_diff(a, b) -> float:
    d = (a.logits - b.logits).abs().max().item()
    for (ak, av), (bk, bv) in zip(a.past_key_values, b.past_key_values):
        d = max(d, (ak - bk).abs().max().item(), (av - bv).abs().max().item())
    return d


@pytest.mark.parametrize("name", list(SOURCES))
def test_streamed_equals_the_whole_model(tmp_path, name):
    cfg, kw = SOURCES[name]
    d = write(cfg, tmp_path, **kw)
    full, streamed = load_model(d), StreamedReference(d)
    assert streamed.cfg.rope_layout == full.cfg.rope_layout and streamed.cfg.norm_head == cfg.norm_head
    for step, (a, b) in enumerate(run_both(full, streamed)):
        assert b.logits.dtype == torch.float32 and b.logits.shape == a.logits.shape
        assert len(b.past_key_values) == cfg.num_hidden_layers
        assert b.past_key_values[0][0].shape == a.past_key_values[0][0].shape
        assert max_diff(a, b) <= TOL, f"step {step}"
    assert streamed.times.passes == 3 and streamed.times.layers == 3 * cfg.num_hidden_layers


def test_bf16_checkpoint_is_widened_exactly(tmp_path):
    d = write(TINY, tmp_path)
    path = d / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    full, streamed = load_model(d, dtype="float32"), StreamedReference(d)
    (a, b), = run_both(full, streamed, steps=0)
    assert max_diff(a, b) <= TOL


def test_a_wrong_layer_is_seen(tmp_path, monkeypatch):
    """Negative: the comparison above fails when the streamed model reads the wrong weights."""
    d = write(TINY, tmp_path)
    full, streamed = load_model(d), StreamedReference(d)
    real = streamed.reader.read
    monkeypatch.setattr(streamed.reader, "read", lambda names, device="cpu": {
        n: t for n, t in zip(names, real([n.replace("layers.1.", "layers.0.") for n in names], device).values())})
    (a, b), = run_both(full, streamed, steps=0)
    assert max_diff(a, b) > 1e-2


def test_half_a_layer_resident_at_a_time(tmp_path):
    d = write(TINY, tmp_path)
    streamed = StreamedReference(d)
    reader, real = streamed.reader, streamed.reader.read
    alive: list[weakref.ref] = []
    biggest = []

    halves = []

    def watched(names, device="cpu"):
        gc.collect()
        biggest.append(sum(r() is not None for r in alive))  # weights of earlier reads still alive
        halves.append(sorted(n.split(".")[3] for n in names if n.startswith("model.layers.")))
        out = real(names, device)
        alive.extend(weakref.ref(t) for t in out.values())
        return out

    reader.read = watched
    calls = []
    streamed.progress = lambda done, total, what: calls.append((done, total))
    run_both(load_model(d), streamed, steps=1)
    assert max(biggest) <= 1  # at most the final norm (kept across passes); never a previous half
    assert calls == [(1, 2), (2, 2)] * 2
    assert ["input_layernorm", "self_attn", "self_attn", "self_attn", "self_attn"] in halves  # 6.1-6.2 alone
    assert ["mlp", "mlp", "mlp", "post_attention_layernorm"] in halves  # then 6.3-6.4 alone
    half_bytes = reference_memory(TINY, 1, 1).weights
    assert half_bytes == 4 * (64 + 3 * 64 * 176)  # the larger half: post-attention norm, gate/up/down


def test_reader_refuses_a_checkpoint_that_does_not_match_its_config(tmp_path):
    d = write(TINY, tmp_path)
    path = d / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has "
                                         r"shape \[100, 64\]"):
        CheckpointReader(d)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path))
    with pytest.raises(ValueError, match="up_proj.weight' that the config predicts is in none of model.safetensors"):
        CheckpointReader(d)


# --- memory model -------------------------------------------------------------------------------------------

def test_memory_model_by_hand():
    cfg = get_preset("llama-2-7b")  # n1 32000, n2 4096, n7 11008, 32 layers, 32 heads of 128
    m = reference_memory(cfg, batch=2, seq=11, steps=8)
    ffn_half = 4 * (4096 + 3 * 4096 * 11008)  # post-attention norm, gate, up, down: the larger half of a layer
    assert m.weights == ffn_half > 4 * (4096 + 4 * 4096 * 4096)
    assert m.head == 16 * 2**20 + 4 * 4096
    assert m.kv_cache == 2 * 32 * 2 * 32 * 19 * 128 * 4
    assert m.activations == 4 * (2 * 11 * (8 * 4096 + 3 * 11008 + 3 * 32 * 19) + 2 * 11 * 32000)
    assert m.tables == 2 * 256 * 64 * 4  # streamed: 256 positions at least, grown by doubling, not all 4,096
    assert reference_memory(cfg, batch=1, seq=300, steps=100).tables == 2 * 800 * 64 * 4
    assert reference_memory(cfg, batch=1, seq=5000).tables == 2 * 5000 * 64 * 4  # past max_position_embeddings
    full = reference_memory(cfg, batch=2, seq=11, steps=8, streamed=False)
    assert full.weights == 4 * 6_738_415_616 and full.head == 0
    assert full.tables == 2 * 4096 * 64 * 4  # the plain model's cover every position
    local = cfg.replace(rope_local_theta=1e4)  # Gemma 3's local base: a second pair of tables
    assert reference_memory(local, batch=2, seq=11, steps=8).tables == 2 * m.tables
    assert m.total < 0.9e9 < 26e9 < full.total  # streaming: ~1/30 of the whole fp32 model


def test_refused_up_front_with_the_figure():
    need = reference_memory(get_preset("llama-2-7b"), 1, 16, streamed=False)
    with pytest.raises(ValueError) as e:
        check_fits(need, "llama-2-7b", available=8 * 2**30)
    msg = str(e.value)
    assert "\n" not in msg and "25.1 GiB" in msg and "8.0 GiB is available" in msg and "checkpoint directory" in msg
    check_fits(need, "llama-2-7b", available=32 * 2**30)  # fits: no error
    with pytest.raises(ValueError, match="beside it 10.0 GiB"):
        check_fits(need, "x", extra_bytes=10 * 2**30, available=32 * 2**30)


def test_reference_model_picks_streaming_for_checkpoints(tmp_path):
    d = write(TINY, tmp_path)
    assert isinstance(reference_model(d, batch=2, seq=11, steps=8), StreamedReference)
    seeded = reference_model("tiny", seed=3)  # built in memory, read layer by layer like a checkpoint
    ids = torch.randint(3, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(seeded(ids).logits, load_model("tiny", seed=3)(ids).logits)
    with pytest.raises(ValueError, match="float32 reference needs"):
        reference_model(d, batch=2, seq=11, available=1000)
    with pytest.raises(ValueError, match="float32 reference needs"):
        reference_model("tiny", available=1000)


def test_float64_pass_is_the_whole_model_in_float64(tmp_path):
    """The streamed float64 pass equals the whole model run in float64 with float64 RoPE tables (independent path);
    the fp32 pass is off by fp32 rounding only, and fp16's by more."""
    from llama_tools.modeling.model import rope_cache

    d = write(TINY, tmp_path)
    ref = StreamedReference(d)
    full = load_model(d).double()
    ids = torch.randint(3, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full(ids, rope_tables=rope_cache(TINY, dtype=torch.float64)).logits
        f64 = ref.with_dtype(torch.float64)(ids).logits
        f32, f16 = ref(ids).logits.double(), ref.with_dtype(torch.float16)(ids).logits.double()
    assert f64.dtype == torch.float64 and (f64 - want).abs().max() < 1e-12
    e32, e16 = (f32 - want).abs().max().item(), (f16 - want).abs().max().item()
    assert 0 < e32 < 1e-4 and e16 > 100 * e32


def test_a_reassociated_layer_is_freed_without_the_cycle_collector():
    """reassociate() leaves no reference cycle: a decoder layer (and its weights) is freed when its last reference
    goes, with the cyclic collector off (a forward bound on the instance kept each layer alive until it ran:
    --by-layer at 7B width held four layers' weights); the plain layer is the control, the numbers unchanged."""
    from llama_tools.inference.reference import reassociate
    from llama_tools.modeling.model import DecoderLayer, build_model

    model = build_model(TINY, seed=3)
    x = torch.randn(1, 5, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    ffn = model.model.layers[0].feed_forward
    want = ffn(x)
    layer = reassociate(DecoderLayer(TINY, 0).eval())
    layer.load_state_dict(model.model.layers[0].state_dict())
    torch.testing.assert_close(layer.feed_forward(x), want, rtol=1e-5, atol=1e-6)  # another order, same sums
    weight = weakref.ref(layer.mlp.gate_proj.weight)
    gc.disable()
    try:
        del layer
        assert weight() is None, "the reassociated layer outlived its last reference (a reference cycle)"
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["hf-sharded", "meta-2-shards", "tied-embeddings"])
def test_scattered_rows_are_read_a_span_at_a_time(tmp_path, monkeypatch, name):
    """rows() of many scattered ranges: the stored rows, in order, the file mapped once per span of
    LM_HEAD_CHUNK_BYTES' rows (not once for them all, whose touched pages would all be resident together)."""
    import llama_tools.inference.reference as reference

    cfg, kw = SOURCES[name]
    d = write(cfg, tmp_path, **kw)
    full, reader = load_model(d), CheckpointReader(d)
    n1, n2 = cfg.vocab_size, cfg.hidden_size
    monkeypatch.setattr(reference, "LM_HEAD_CHUNK_BYTES", 100 * 4 * n2)  # spans of 100 rows
    opened = []
    real_open = reader._open
    monkeypatch.setattr(reader, "_open", lambda names: (opened.append(names), real_open(names))[1])
    ranges = [(0, 3), (5, 6), (90, 130), (131, 132), (300, 301), (n1 - 2, n1)]
    name_w = "model.embed_tokens.weight"
    got = reader.rows(name_w, ranges)
    want = torch.cat([full.model.embed_tokens.weight[a:b] for a, b in ranges]).detach()
    assert got.dtype == torch.float32 and got.shape == (sum(b - a for a, b in ranges), n2)
    assert torch.equal(got, want)
    # a group ends where the next range would reach past its first row + 100: (90, 130) opens the second
    assert list(reference._within(ranges, 100)) == [[(0, 3), (5, 6)], [(90, 130), (131, 132)], [(300, 301)],
                                                               [(n1 - 2, n1)]]
    assert len(opened) == 4
    opened.clear()
    one = reader.rows(name_w, [(7, 9)])
    assert torch.equal(one, full.model.embed_tokens.weight[7:9].detach()) and len(opened) == 1
