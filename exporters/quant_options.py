"""What `export --quantize` offers, importable without numpy or onnxruntime: the CLI builds its choices here."""

QUANTIZE = ("int4",)
# algorithm -> what it is; both are onnxruntime's own (matmul_nbits_quantizer), run node by node.
INT4_ALGORITHMS = {
    "rtn": "round to nearest, one scale per block (onnxruntime's C++ kernel; symmetric unless --int4-asymmetric)",
    "hqq": "half-quadratic: scales and zero points fitted per block (onnxruntime's HQQ; always asymmetric)",
}
BLOCK_SIZE = 32
# MLAS's int4 kernels on the CPU: accuracy level 4 quantizes the activations to int8 per block and runs
# an int8 dot product (the fast path); 0/1 dequantize to fp32 first.
ACCURACY_LEVEL = 4
# What runs without --int4-algorithm (quantize_int4's default; tests/test_cli_contract.py holds the two equal).
DEFAULT_ALGORITHM = "rtn"
# `verify int4` without --prompt/--ids starts its greedy decode from this many seeded ids.
PROMPT_IDS = 8
