"""The PyTorch LLaMA against the paper's formulas, hand-computed cases and second implementations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llama_tools.modeling.presets import get_preset
from llama_tools.modeling.rope import rope_inv_freq
from llama_tools.checkpoints.loading import load_model
from llama_tools.modeling.model import Llama, RMSNorm, alibi_slopes, build_model, lm_loss, rope, rope_cache

TINY = get_preset("tiny")
MHA = TINY.replace(name="tiny-mha", num_key_value_heads=4)


def sharp(cfg, seed=0, qk_std=0.3):
    """A model whose attention matters: large q/k weights make scores far from uniform."""
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                lin.weight.normal_(0.0, qk_std, generator=gen)
    return model


def ids(batch, n3, cfg=TINY, seed=0):
    return torch.randint(0, cfg.vocab_size, (batch, n3), generator=torch.Generator().manual_seed(seed))


# --- forward basics ------------------------------------------------------------------------------

def test_forward_shapes_and_dtypes():
    model = build_model(TINY)
    out = model(ids(2, 7))
    assert out.logits.shape == (2, 7, TINY.vocab_size)
    assert out.logits.dtype == torch.float32
    assert len(out.past_key_values) == TINY.num_hidden_layers
    k, v = out.past_key_values[0]
    assert k.shape == v.shape == (2, TINY.num_key_value_heads, 7, TINY.head_dim)
    half = build_model(TINY, dtype=torch.bfloat16)
    assert half(ids(1, 3)).logits.dtype == torch.bfloat16


def test_rmsnorm_matches_the_formula():
    norm = RMSNorm(4, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0]])
    sigma = math.sqrt((9 + 16) / 4)  # sigma_i = sqrt(1/n sum x_ij^2)
    expected = torch.tensor([[3 / sigma, 2 * 4 / sigma, 0.0, 0.0]])
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_logits_are_lm_head_of_final_norm():
    model = build_model(TINY)
    x = ids(1, 5)
    captured = {}
    model.model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("zbar", o))
    logits = model(x).logits
    assert torch.allclose(logits, captured["zbar"] @ model.lm_head.weight.T, atol=1e-6)


# --- RoPE ------------------------------------------------------------------------------------------

def paper_rotation_matrix(i: int, n6: int, base: float = 10000.0) -> torch.Tensor:
    """A_i exactly as section 2 writes it: 2x2 blocks [[cos, sin], [-sin, cos]] on the diagonal."""
    a = torch.zeros(n6, n6, dtype=torch.float64)
    for t in range(0, n6, 2):
        theta = base ** (-t / n6)
        c, s = math.cos(i * theta), math.sin(i * theta)
        a[t, t], a[t, t + 1], a[t + 1, t], a[t + 1, t + 1] = c, s, -s, c
    return a


def _rope1(x, positions, cfg, interleaved):
    cos, sin = rope_cache(cfg)
    pos = torch.as_tensor(positions).view(1, -1)
    return rope(x.view(1, 1, *x.shape), pos, cos, sin, interleaved).view(x.shape)


def test_interleaved_rope_is_the_papers_matrix_product():
    cfg = TINY
    x = torch.randn(5, cfg.head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).float()
    got = _rope1(x, range(5), cfg, interleaved=True)
    assert got.shape == x.shape and got.dtype == torch.float32
    expected = torch.stack([x[i].double() @ paper_rotation_matrix(i, cfg.head_dim) for i in range(5)])
    assert torch.allclose(got.double(), expected, atol=1e-5)
    # negative: the half-split form is a different function of the same rows
    assert not torch.allclose(_rope1(x, range(5), cfg, interleaved=False).double(), expected, atol=1e-3)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_preserves_norms_and_depends_only_on_relative_position(interleaved):
    cfg = TINY
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(cfg.head_dim, generator=g), torch.randn(cfg.head_dim, generator=g)
    rq = _rope1(q.view(1, -1), [37], cfg, interleaved)[0]
    assert torch.allclose(rq.norm(), q.norm(), atol=1e-5)
    dots = [torch.dot(_rope1(q.view(1, -1), [m], cfg, interleaved)[0], _rope1(k.view(1, -1), [n], cfg, interleaved)[0])
            for m, n in ((5, 2), (13, 10), (103, 100))]
    assert max(abs(float(d - dots[0])) for d in dots) < 1e-4
    other = torch.dot(_rope1(q.view(1, -1), [6], cfg, interleaved)[0], _rope1(k.view(1, -1), [2], cfg, interleaved)[0])
    assert abs(float(other - dots[0])) > 1e-3, "a different offset must change the score"


def test_interleaved_and_half_split_agree_after_row_permutation():
    cfg = TINY
    d = cfg.head_dim
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(2))
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # HF's q/k row order within a head
    inter = _rope1(x, range(6), cfg, interleaved=True)
    half = _rope1(x[:, perm], range(6), cfg, interleaved=False)
    assert torch.allclose(half, inter[:, perm], atol=1e-6)


def test_interleaved_model_with_permuted_weights_equals_half_split_model():
    hf = sharp(TINY)
    meta_cfg = TINY.replace(rope_layout="interleaved")
    meta = build_model(meta_cfg)
    sd = hf.state_dict()
    d = TINY.head_dim
    inv = torch.argsort(torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]))
    for key in list(sd):
        for proj, heads in (("q_proj", TINY.num_attention_heads), ("k_proj", TINY.num_key_value_heads)):
            if key.endswith(f"{proj}.weight"):
                w = sd[key].view(heads, d, -1)  # [heads, n6, n2]
                sd[key] = w[:, inv].reshape(heads * d, -1)
    meta.load_state_dict(sd)
    x = ids(2, 9)
    assert torch.allclose(meta(x).logits, hf(x).logits, atol=1e-5)
    # negative: the same permuted weights under the half-split layout give another function
    wrong = build_model(TINY)
    wrong.load_state_dict(sd)
    assert (wrong(x).logits - hf(x).logits).abs().max() > 1e-2


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies():
    cfg = get_preset("llama-3.1-405b")
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    scaled = rope_inv_freq(cfg)
    assert scaled[0] == plain[0]  # wavelength 2 pi: far below 8192/4, untouched
    assert math.isclose(scaled[-1], plain[-1] / 8.0)  # wavelength far above 8192: slowed by the factor
    assert all(p / 8.0 - 1e-12 <= s <= p + 1e-12 for p, s in zip(plain, scaled))


# --- mask, cache, GQA ------------------------------------------------------------------------------

def test_causal_mask_future_tokens_do_not_change_past_logits():
    model = sharp(TINY)
    a = ids(1, 10, seed=3)
    b = a.clone()
    b[0, 6:] = (b[0, 6:] + 1) % TINY.vocab_size
    la, lb = model(a).logits, model(b).logits
    assert torch.allclose(la[:, :6], lb[:, :6], atol=1e-6)
    assert (la[:, 6:] - lb[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("cfg", [TINY, MHA, TINY.replace(num_key_value_heads=1),
                                 TINY.replace(position_encoding="alibi"), TINY.replace(rope_layout="interleaved"),
                                 TINY.replace(sliding_window=4)], ids=["gqa", "mha", "mqa", "alibi", "meta", "swa"])
def test_cached_decoding_equals_full_forward(cfg):
    model = sharp(cfg)
    x = ids(2, 11)
    full = model(x).logits
    out = model(x[:, :6])
    pieces = [out.logits]
    past = out.past_key_values
    for t in range(6, 11):  # one token at a time through the cache
        step = model(x[:, t:t + 1], past_key_values=past)
        pieces.append(step.logits)
        past = step.past_key_values
    assert past[0][0].shape == (2, cfg.num_key_value_heads, 11, cfg.head_dim)
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=2e-5)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = sharp(TINY)
    mha = build_model(MHA)
    sd = gqa.state_dict()
    rep, d = TINY.n_rep, TINY.head_dim
    for key in list(sd):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = sd[key].view(TINY.num_key_value_heads, d, -1)  # [kv, n6, n2]
            sd[key] = w.repeat_interleave(rep, dim=0).reshape(MHA.kv_size, -1)  # [n5 n6, n2]
    mha.load_state_dict(sd)
    x = ids(2, 8)
    assert torch.allclose(gqa(x).logits, mha(x).logits, atol=1e-5)


def test_attention_matches_torch_sdpa():
    model = sharp(TINY)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 7, TINY.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(7).expand(2, 7)
    cos, sin = rope_cache(TINY)
    from llama_tools.modeling.model import attention_bias

    bias = attention_bias(TINY, 7, 0, None, x.dtype, x.device)
    got, _ = attn(x, bias, pos, (cos, sin), None)
    q = rope(attn.q_proj(x).view(2, 7, 4, -1).transpose(1, 2), pos, cos, sin, False)
    k = rope(attn.k_proj(x).view(2, 7, 2, -1).transpose(1, 2), pos, cos, sin, False)
    v = attn.v_proj(x).view(2, 7, 2, -1).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = attn.o_proj(ref.transpose(1, 2).reshape(2, 7, -1))
    assert torch.allclose(got, ref, atol=1e-5)


def test_left_padding_gives_each_row_its_unpadded_logits():
    model = sharp(TINY)
    a, b = ids(1, 8, seed=5), ids(1, 5, seed=6)
    pad = torch.zeros(1, 3, dtype=torch.long)
    batch = torch.cat([a, torch.cat([pad, b], dim=1)])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    out = model(batch, attention_mask=mask).logits
    assert torch.allclose(out[0], model(a).logits[0], atol=1e-5)
    assert torch.allclose(out[1, 3:], model(b).logits[0], atol=1e-5)
    assert torch.isfinite(out).all(), "fully masked pad rows must stay finite"
    # negative: without the mask, the padded row attends to the pads
    assert (model(batch).logits[1, 3:] - model(b).logits[0]).abs().max() > 1e-3


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s40 = alibi_slopes(40)  # Baichuan-13B: 32 geometric slopes, then every other one of the 64-head series
    assert s40.shape == (40,)
    assert torch.allclose(s40[:32], torch.tensor([2.0 ** (-(i + 1) / 4) for i in range(32)]))
    assert torch.allclose(s40[32:], torch.tensor([2.0 ** (-(2 * i + 1) / 8) for i in range(8)]))


def test_alibi_model_uses_no_rope_and_penalizes_distance():
    cfg = TINY.replace(position_encoding="alibi")
    model = sharp(cfg)
    assert model.rope_tables(torch.device("cpu")) is None
    x = ids(1, 6)
    assert not torch.allclose(model(x).logits, sharp(TINY)(x).logits, atol=1e-3)


def test_moe_matches_per_token_reference():
    cfg = TINY.replace(name="tiny-moe", num_experts=4, num_experts_per_tok=2, family="mixtral")
    model = build_model(cfg, init_std=0.1)
    moe = model.model.layers[0].block_sparse_moe
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    got = moe(x)
    for t in range(5):
        probs = torch.softmax(moe.gate(x[0, t]), -1)
        top = torch.topk(probs, 2)
        w = top.values / top.values.sum()
        ref = sum(w[i] * moe.experts[int(e)](x[0, t]) for i, e in enumerate(top.indices))
        assert torch.allclose(got[0, t], ref, atol=1e-5)


# --- loss -------------------------------------------------------------------------------------------

def test_loss_hand_computed_with_minus_100_mask():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [9.0, 9.0, 9.0]]])  # [1, 4, 3]
    labels = torch.tensor([[0, -100, 2, 1]])  # tbar = (-100, 2, 1): position 0 is masked
    lse = lambda row: math.log(sum(math.exp(v) for v in row))  # noqa: E731
    # tbar_0 = -100 skipped; tbar_1 = 2 on row 1: log p = 0 - lse(0,1,0); tbar_2 = 1 on row 2: 0 - lse(0,0,3)
    expected = -((0.0 - lse([0.0, 1.0, 0.0])) + (0.0 - lse([0.0, 0.0, 3.0])))
    assert math.isclose(float(lm_loss(logits, labels, reduction="sum")), expected, rel_tol=1e-6)
    assert math.isclose(float(lm_loss(logits, labels, reduction="mean")), expected / 2, rel_tol=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        lm_loss(logits, labels, reduction="max")


def test_loss_of_model_matches_manual_log_softmax():
    model = build_model(TINY)
    x = ids(1, 6)
    labels = x.clone()
    labels[0, :3] = -100  # the question's tokens (8.2)
    logits = model(x).logits
    logp = torch.log_softmax(logits[0, :-1], -1)
    manual = -sum(logp[i, x[0, i + 1]] for i in range(2, 5))
    assert torch.allclose(lm_loss(logits, labels, reduction="sum"), manual, atol=1e-5)


# --- construction -----------------------------------------------------------------------------------

def test_seeded_init_is_reproducible_and_seed_sensitive():
    a, b, c = build_model(TINY, seed=1), build_model(TINY, seed=1), build_model(TINY, seed=2)
    x = ids(1, 4)
    assert torch.equal(a(x).logits, b(x).logits)
    assert not torch.equal(a(x).logits, c(x).logits)


def test_tied_embeddings_share_one_tensor():
    cfg = TINY.replace(tie_word_embeddings=True)
    model = build_model(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = sum(p.numel() for p in build_model(TINY).parameters())
    assert sum(p.numel() for p in model.parameters()) == untied - cfg.vocab_size * cfg.hidden_size


def test_big_presets_are_refused_unless_on_meta():
    with pytest.raises(ValueError, match="over the 8 GiB"):
        load_model("llama-2-70b")
    meta = load_model("llama-2-70b", device="meta")
    assert isinstance(meta, Llama)
    assert next(meta.parameters()).device.type == "meta"
