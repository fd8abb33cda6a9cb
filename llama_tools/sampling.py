"""Section 7's sampling options and the prompt, checked before any work: no torch, so a refusal is instant."""

from __future__ import annotations

import math

from .config import ModelConfig
from .tokenizer import check_vocab


def check_sampling(cfg: ModelConfig, prompt_ids: list[int], *, max_new_tokens: int, temperature: float,
                   repetition_penalty: float, top_k: int, top_p: float, dtype: str | None = None,
                   weights_loaded: bool = False) -> None:
    """Every sampling option and the prompt checked before any work: one ValueError naming the option.

    With `dtype`, also what the run would allocate (the model unless `weights_loaded`, RoPE tables, KV cache,
    activations) against the memory available: refused here, with the figures, rather than by the allocator.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token id (e.g. BOS)")
    check_vocab(prompt_ids, cfg.vocab_size)
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's context of {cfg.max_position_embeddings} positions")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"--repetition-penalty must be a finite number > 0, got {repetition_penalty}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 keeps every token), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if dtype is not None:
        from .accounting import check_memory, generation_need

        check_memory(generation_need(cfg, len(prompt_ids), max_new_tokens, dtype, weights=not weights_loaded), cfg)
