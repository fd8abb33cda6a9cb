"""verify parity's choices, importable without torch or onnxruntime (the CLI builds its options from them)."""

# What runs: layers = each decoder layer fed float64's own input to it; whole = the graph end to end (prefill and
# greedy decode); both; auto = layers, and the whole graph while the graph's weights are at most WHOLE_GRAPH_BYTES.
MODES = ("auto", "layers", "whole", "both")
# Its onnxruntime session holds every weight (a 0.5B fp32 graph: 2.5 GB) where the layer-local check holds one layer.
WHOLE_GRAPH_BYTES = 1 << 30
