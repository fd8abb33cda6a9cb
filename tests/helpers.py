"""Models for numeric tests: seeded, tiny, and with attention that matters.

With the default N(0, 0.02) init, attention scores are nearly uniform and a wrong RoPE layout or a
missing mask barely moves the logits; scaling q and k up makes both errors visible.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from llama_tools.modeling import dtypes
from llama_tools.modeling.config import ModelConfig
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.checkpoints.formats import checkpoint_tensors
from llama_tools.modeling.model import Llama, build_model
from llama_tools.checkpoints.weight_files import write_index

QK_SCALE = 15.0


def sharp(cfg, seed: int = 0, qk_scale: float = QK_SCALE) -> Llama:
    """A seeded model whose q/k weights are scaled by qk_scale: attention far from uniform."""
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model


def token_ids(batch: int, n: int, cfg, seed: int = 0) -> torch.Tensor:
    """Seeded ids in [0, vocab): [batch, n]."""
    return torch.randint(0, cfg.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


def write_sparse_safetensors(cfg: ModelConfig, directory: str | Path, shards: int, dtype: str = "BF16") -> list[Path]:
    """A sharded HF checkpoint of cfg whose headers are real and whose data are holes (for benchmarks, tests).

    Each file is its header followed by `truncate` to the full size: no tensor byte is written, so a
    70B checkpoint takes a few hundred kB of disk.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    itemsize = int(dtypes.from_safetensors(dtype).bytes)
    tensors = checkpoint_tensors(cfg)
    groups = [tensors[i * len(tensors) // shards:(i + 1) * len(tensors) // shards] for i in range(shards)]
    files, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for ct in group:
            n = math.prod(ct.shape) * itemsize
            header[ct.name] = {"dtype": dtype, "shape": list(ct.shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[ct.name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data start 8-byte aligned, as safetensors writes it
        with open(d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # the data: a hole
        files.append(d / fname)
    write_index(d, weight_map, sum(math.prod(ct.shape) * itemsize for ct in tensors))
    (d / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2), encoding="utf-8")
    return files


def train_tiny_tokenizer(texts: list[str], prefix: str | Path, vocab_size: int = 300) -> Path:
    """Train a small BPE model with byte fallback and LLaMA's special ids (<unk> 0, <s> 1, </s> 2); for tests."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2, split_digits=True,
        # LLaMA's tokenizer.model: no NFKC, spaces kept as they are, so every text round-trips.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    path = Path(f"{prefix}.model")
    path.write_bytes(model.getvalue())
    return path


def add_llama_hparams(w: Any, cfg: Any, block_count: int | None = None) -> None:
    """cfg's llama.* hyperparameters on a gguf.GGUFWriter, as llama.cpp's converter writes them (cfg: our
    ModelConfig or a transformers config, which name these fields alike)."""
    w.add_block_count(cfg.num_hidden_layers if block_count is None else block_count)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def export_and_verify(path: Path, tmp_path: Path) -> None:
    """`export onnx PATH` then `verify parity` of the graph against PATH itself: exit 0 and a PASS."""
    from click.testing import CliRunner

    from llama_tools.cli import cli

    out = tmp_path / "m.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(path), "-o", str(out), "--no-client-files", "--format", "json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", "parity", str(out), "--source", str(path), "--ids", "1 5 9 33",
                                 "--steps", "2"])
    assert r.exit_code == 0 and r.output.strip().splitlines()[-1].startswith("PASS"), r.output


def bench_faults() -> Any:
    """benchmarks/bench_faults.py as a module (its `plant`: the planted faults the tests check verify against)."""
    import importlib.util
    import sys

    if "bench_faults" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_faults.py"
        spec = importlib.util.spec_from_file_location("bench_faults", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_faults"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_faults"]


def finish_gguf(w: Any) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def genai_greedy(model_dir: str | Path, prompt: list[int], steps: int) -> list[int]:
    """onnxruntime-genai's greedy tokens after `prompt` from the export in model_dir (its genai_config.json)."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    return got
