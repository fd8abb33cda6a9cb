"""The model and its facts: the config, presets and families, the PyTorch LLaMA, RoPE, dtypes, every weight, memory."""
