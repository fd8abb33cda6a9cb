"""The exported graph's input and output names, as Optimum and onnxruntime-genai use them: typed here once."""

from __future__ import annotations

INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
KV = ("key", "value")


def past_name(layer: int, kv: str) -> str:
    return f"past_key_values.{layer}.{kv}"


def present_name(layer: int, kv: str) -> str:
    return f"present.{layer}.{kv}"


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph inputs (ids, mask, positions, past K/V per layer) and outputs (logits, present K/V per layer)."""
    kv = [(i, k) for i in range(num_layers) for k in KV]
    inputs = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *(past_name(i, k) for i, k in kv)]
    return inputs, [LOGITS, *(present_name(i, k) for i, k in kv)]
