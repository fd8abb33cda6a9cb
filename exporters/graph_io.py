"""The exported graph's names, typed here once: inputs and outputs as Optimum and onnxruntime-genai use them, and
the onnxruntime contrib ops the fused and int4 graphs hold."""

from __future__ import annotations

INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
KV = ("key", "value")
MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops
GQA = "GroupQueryAttention"  # its attention with a KV cache, which fused.py writes and runtime.py feeds


def past_name(layer: int, kv: str) -> str:
    return f"past_key_values.{layer}.{kv}"


def present_name(layer: int, kv: str) -> str:
    return f"present.{layer}.{kv}"


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph inputs (ids, mask, positions, past K/V per layer) and outputs (logits, present K/V per layer)."""
    kv = [(i, k) for i in range(num_layers) for k in KV]
    inputs = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *(past_name(i, k) for i, k in kv)]
    return inputs, [LOGITS, *(present_name(i, k) for i, k in kv)]
