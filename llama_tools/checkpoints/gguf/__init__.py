"""GGUF files (llama.cpp's one-file checkpoints), one module a job, as llama.cpp's gguf-py keeps them in a folder.

architectures: the registry of GGUF architectures read and written; read: opening a file, every header number
bounded; check: metadata sizes against tensor shapes; config: the ModelConfig a file's keys describe; rope_freqs:
Llama 3's RoPE scaling from rope_freqs.weight, longrope's from Phi-3's rope_factors_long/short.weight; tensors:
header counts and dequantized weights (GgufReader);
vocabulary and write: `convert --to gguf`. Inside, `import gguf` is the third-party library (absolute imports).
"""
