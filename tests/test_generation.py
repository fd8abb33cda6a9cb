"""Section 7 sampling: repetition penalty, temperature, top-k/top-p, greedy decoding through the cache."""

from __future__ import annotations

import pytest
import torch

from llama_tools.modeling.presets import get_preset
from llama_tools.inference.generation import apply_repetition_penalty, filter_top_k_top_p, generate, next_token
from llama_tools.modeling.model import build_model

TINY = get_preset("tiny")


def test_repetition_penalty_hand_computed():
    phi = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0])
    seen = torch.tensor([0, 1, 1, 4])  # id 1 twice: penalized once
    got = apply_repetition_penalty(phi, seen, alpha1=2.0)
    assert got.shape == phi.shape and got.dtype == phi.dtype
    # phi_i >= 0 -> phi_i / alpha1; phi_i < 0 -> alpha1 phi_i; unseen ids untouched
    assert torch.equal(got, torch.tensor([1.0, -2.0, 0.5, -3.0, 0.0]))
    assert torch.equal(apply_repetition_penalty(phi, seen, 1.0), phi)
    with pytest.raises(ValueError):
        apply_repetition_penalty(phi, seen, 0.0)


def test_temperature_scales_the_scores():
    phi = torch.tensor([1.0, 2.0, 4.0])
    # with temperature 2, p ∝ exp(phi / 2): draw many and compare frequencies
    gen = torch.Generator().manual_seed(0)
    draws = [next_token(phi, torch.tensor([0]), temperature=2.0, repetition_penalty=1.0, top_k=0, top_p=1.0,
                        generator=gen) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 4000
    expected = torch.softmax(phi / 2.0, -1)
    assert torch.allclose(freq, expected, atol=0.03)
    assert next_token(phi, torch.tensor([0]), temperature=0.0, repetition_penalty=1.0, top_k=0, top_p=1.0,
                      generator=None) == 2


def test_top_k_and_top_p_filters():
    phi = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    k2 = filter_top_k_top_p(phi, top_k=2)
    assert torch.isinf(k2[2:]).all() and torch.isfinite(k2[:2]).all()
    p = filter_top_k_top_p(phi, top_p=0.75)  # 0.5 < 0.75 <= 0.8: the two best tokens
    assert torch.isfinite(p[:2]).all() and torch.isinf(p[2:]).all()
    p = filter_top_k_top_p(phi, top_p=0.5)  # the best token alone reaches 0.5
    assert torch.isfinite(p[:1]).all() and torch.isinf(p[1:]).all()


def test_greedy_generation_equals_argmax_loop_without_cache():
    model = build_model(TINY, init_std=0.1)
    prompt = [1, 17, 42, 99]
    got = generate(model, prompt, max_new_tokens=8)
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert got.new_ids == seq[len(prompt):]
    assert got.stopped_by == "length" and got.tokens_per_s > 0


def test_generation_stops_at_eos_and_seeded_sampling_is_reproducible():
    model = build_model(TINY, init_std=0.1)
    greedy = generate(model, [1, 5], max_new_tokens=6)
    eos = greedy.new_ids[2]
    stopped = generate(model, [1, 5], max_new_tokens=6, eos_token_id=eos)
    assert stopped.stopped_by == "eos" and stopped.new_ids[-1] == eos
    assert len(stopped.new_ids) == greedy.new_ids.index(eos) + 1
    a = generate(model, [1, 5], max_new_tokens=10, temperature=1.5, seed=3)
    b = generate(model, [1, 5], max_new_tokens=10, temperature=1.5, seed=3)
    c = generate(model, [1, 5], max_new_tokens=10, temperature=1.5, seed=4)
    assert a.new_ids == b.new_ids
    assert a.new_ids != c.new_ids


def test_repetition_penalty_changes_greedy_output():
    model = build_model(TINY, init_std=0.1)
    plain = generate(model, [1, 5, 5, 5], max_new_tokens=12)
    penalized = generate(model, [1, 5, 5, 5], max_new_tokens=12, repetition_penalty=5.0)
    assert len(set(penalized.new_ids)) >= len(set(plain.new_ids))
    assert plain.new_ids != penalized.new_ids


def test_bad_generation_arguments():
    model = build_model(TINY)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], max_new_tokens=2, temperature=-1.0)
