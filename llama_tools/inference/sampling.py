"""Section 7's sampling options and the prompt, checked before any work: no torch, so a refusal is instant."""

from __future__ import annotations

import struct

from ..modeling.config import ModelConfig
from ..checkpoints.tokenizer import check_vocab

# The scores are sampled in float32 (generation.next_token): a temperature or penalty they are divided by must be a
# float32 number, neither 0 there (below its smallest normal) nor inf (above its largest).
FLOAT32_TINY = struct.unpack("<f", struct.pack("<I", 0x00800000))[0]  # 1.1754944e-38
FLOAT32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]  # 3.4028235e+38


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
    if not (temperature == 0 or FLOAT32_TINY <= temperature <= FLOAT32_MAX):
        raise ValueError(f"--temperature must be 0 (greedy) or in {FLOAT32_TINY:.8g}..{FLOAT32_MAX:.8g} (float32, "
                         f"what the scores are divided in), got {temperature}")
    if not FLOAT32_TINY <= repetition_penalty <= FLOAT32_MAX:
        raise ValueError(f"--repetition-penalty must be in {FLOAT32_TINY:.8g}..{FLOAT32_MAX:.8g} (float32, what the "
                         f"scores are scaled in; 1 is off), got {repetition_penalty}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 keeps every token), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if dtype is not None:
        from ..modeling.memory import check_memory, generation_need

        check_memory(generation_need(cfg, len(prompt_ids), max_new_tokens, dtype, weights=not weights_loaded), cfg)
