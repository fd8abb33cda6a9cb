"""Verification: how a verdict is reached, in one room.

    source_check.py      our reading of the checkpoint against its own library (transformers), block by block
    by_layer.py          each decoder layer of a graph alone, fed float64's own input to it
    parity.py            the whole graph: prefill, every layer's K/V, greedy decode through the KV cache
    compare.py           the error budget against float64 (judge) and the fixed tolerances
    verdict.py           the three together: what `verify parity` says and exits with
    parity_options.py, verify_preflight.py   options and inputs checked before any work
"""
