"""The ids both sides run: left-padded batches, the positions padding implies, reproducible default prompts."""

from __future__ import annotations

import numpy as np


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths -> input_ids and attention_mask [batch, longest], padding on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    n = max(len(p) for p in prompts)
    ids = np.full((len(prompts), n), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), n), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = p
        mask[row, n - len(p):] = 1
    return ids, mask


def positions(mask: np.ndarray, new: int) -> np.ndarray:
    """Position of each of the last `new` tokens: real tokens before it (padding does not count)."""
    return np.clip(mask.cumsum(-1) - 1, 0, None)[:, -new:]


def default_prompts(vocab_size: int, seed: int | None) -> list[list[int]]:
    """Two seeded rows of 11 and 6 ids (>= 3, past <unk>, <s>, </s>): a batch that needs padding.

    The same rows every run, also for checkpoint exports (no seed: 0).
    """
    rng = np.random.default_rng(seed or 0)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (11, 6)]
