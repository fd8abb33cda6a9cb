"""Checkpoint files and formats: the format registry, headers, configs, weights, GGUF, tokenizers, MODEL resolved once, loading, convert."""
