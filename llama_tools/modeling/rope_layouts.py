"""How q/k rows are ordered inside each head: a property of the weights, not of the architecture.

- INTERLEAVED: pairs (x0, x1), (x2, x3), ... rotate together (the paper's A_i, Meta checkpoints);
- HALF: x_i rotates with x_{i + n6/2} (rotate_half, HF checkpoints).
Which checkpoint format stores which layout is said once, in formats.py. No imports: config and rope both use it.
"""

from __future__ import annotations

from typing import Literal

RopeLayout = Literal["half", "interleaved"]
HALF: RopeLayout = "half"
INTERLEAVED: RopeLayout = "interleaved"
ROPE_LAYOUTS: tuple[RopeLayout, ...] = (HALF, INTERLEAVED)
