"""Exact parameter counts: from a config (the paper's formula beside it), from headers alone, from transformers' module tree."""
