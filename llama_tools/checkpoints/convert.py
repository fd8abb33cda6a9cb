"""Write a checkpoint in HF (config.json + safetensors) or Meta (params.json + consolidated.NN.pth) layout, or as
one GGUF file (llama.cpp's, gguf.write).

Conversions are exact: only row orders change (RoPE q/k rows, W_pack fusing) and no value is cast unless
--dtype asks, so HF -> Meta -> HF gives back the same bytes. A GGUF file is dequantized (float32 unless
--dtype asks otherwise) one tensor at a time, and its vocabulary becomes tokenizer.json beside the weights.
Output appears all at once: files are written to a temporary directory beside DST, which is renamed onto
DST only when everything is written.

What the source says beside its weights travels with them as it says it (source_files): config.json's bos/eos/pad
(an eos list kept), generation_config.json and the tokenizer files byte for byte, the chat template in its own
form (chat_template.jinja, or tokenizer_config.json's field). Meta's params.json has no place for ids or a
template: those files are copied beside consolidated.NN.pth. A file that is not valid is left out, with a warning.
A GGUF holds the config's ids and the vocabulary (tokenizer.ggml.*) in its own metadata; nothing is written beside it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..modeling import dtypes
from ..outputs import files, paths
from ..modeling.memory import nbytes, param_total, tensor_total
from ..modeling.config import ModelConfig
from .config_files import config_to_hf, ffn_hidden_size
from .formats import FORMATS, WRITABLE, checkpoint_tensors, family_format
from .source import MAX_RANDOM_INIT_BYTES, ModelSource, resolve
from .header_readers import MAX_HEADER_BYTES
from .source_files import agreeing_ids, checked_tokenizer_config, read_bounded, read_source_files, tokenizer_files
from .weight_files import write_index
from ..modeling.weights import weight_specs

if TYPE_CHECKING:  # torch is imported where weights are touched: refusals before that need none of it
    import torch


@dataclass
class ConvertResult:
    source: str
    destination: str
    to: str
    layout: str  # tensor naming written: hf, baichuan, internlm2, meta or gguf
    files: list[str]
    tensors: int
    params: int
    bytes: int
    warnings: list[str] = field(default_factory=list)  # source files left out (not valid), one line each


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns its storage: savers would otherwise write the whole base of a view."""
    t = t.contiguous()
    return t.clone() if t._base is not None or t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def meta_params(cfg: ModelConfig) -> dict[str, Any]:
    """Meta's params.json for cfg; ValueError for what that format cannot express."""
    where = f"config {cfg.source or cfg.name!r}"
    problems = [what for what, bad in (
        ("q/k/v or o biases", cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias),
        ("tied embeddings", cfg.tie_word_embeddings), ("Baichuan2's NormHead", cfg.norm_head),
        ("ALiBi", cfg.position_encoding != "rope"), ("mixture of experts", cfg.is_moe),
        ("a sliding window", cfg.sliding_window is not None),
        ("head_dim != hidden_size / num_attention_heads", cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size),
        (f"partial rotary (RoPE on {cfg.rotary_dim} of {cfg.head_dim} channels)", cfg.partial_rotary),
        ("rope_scaling other than llama3 x8", cfg.rope_scaling is not None and (
            cfg.rope_scaling.type != "llama3" or cfg.rope_scaling.factor != 8.0)),
    ) if bad]
    if problems:
        raise ValueError(f"{where}: Meta's params.json cannot express {problems[0]}; convert with --to hf")
    dim, n7 = cfg.hidden_size, cfg.intermediate_size
    # n7 = multiple_of * ceil(mult * int(8 dim / 3) / multiple_of): Meta's defaults if they give n7,
    # else multiple_of = n7 with a multiplier that lands in (0, n7], which rounds up to exactly n7.
    multiple_of, mult = 256, None
    if ffn_hidden_size(dim, multiple_of, mult) != n7:
        multiple_of, mult = n7, n7 / int(2 * (4 * dim) / 3)
    assert ffn_hidden_size(dim, multiple_of, mult) == n7, f"no params.json reproduces intermediate_size {n7}"
    params: dict[str, Any] = {
        "dim": dim, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads, "vocab_size": cfg.vocab_size, "multiple_of": multiple_of,
        "ffn_dim_multiplier": mult, "norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_seq_len": cfg.max_position_embeddings,
    }
    if cfg.rope_scaling is not None:
        params["use_scaled_rope"] = True
    return params


def _hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    from .layouts import fuse_parts

    fmt = family_format(cfg)
    out = {}
    for ct in checkpoint_tensors(cfg, fmt):
        out[ct.name] = state[ct.parts[0]] if len(ct.parts) == 1 else fuse_parts(
            [state[p] for p in ct.parts], ct.parts, fmt.fused_qkv or "", cfg)
    return fmt.name, out


def _write_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], tmp: Path, shards: int,
              ids: dict[str, Any]) -> tuple[str, list[str]]:
    from safetensors.torch import save_file

    from .layouts import permute_rope_rows

    hf_rows = FORMATS["hf"].rope_layout
    state = permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout, hf_rows) \
        if cfg.position_encoding == "rope" else state
    layout, tensors = _hf_tensors(cfg.replace(rope_layout=hf_rows), state)
    (tmp / "config.json").write_text(json.dumps({**config_to_hf(cfg), **ids}, indent=2) + "\n", encoding="utf-8")
    names = list(tensors)
    if shards <= 1:
        save_file({k: _own(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return layout, ["config.json", "model.safetensors"]
    groups = [names[i::shards] for i in range(shards)]
    groups = [sorted(g, key=names.index) for g in groups]
    files, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({k: _own(tensors[k]) for k in group}, str(tmp / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in group})
    index = write_index(tmp, weight_map, sum(v.numel() * v.element_size() for v in tensors.values()))
    return layout, ["config.json", index.name, *files]


def _write_meta(cfg: ModelConfig, state: dict[str, torch.Tensor], tmp: Path, shards: int,
                ids: dict[str, Any]) -> tuple[str, list[str]]:
    import torch

    from .layouts import permute_rope_rows

    params = meta_params(cfg)
    state = permute_rope_rows(state, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout,
                              FORMATS["meta"].rope_layout)
    (tmp / "params.json").write_text(json.dumps(params, indent=2) + "\n", encoding="utf-8")
    specs = weight_specs(cfg)
    files = []
    for i in range(max(shards, 1)):
        shard = {}
        for s in specs:
            w = state[s.name]
            if s.meta_shard_dim is not None and shards > 1:
                if w.shape[s.meta_shard_dim] % shards:
                    raise ValueError(f"tensor {s.name}: axis {s.meta_shard_dim} of size {w.shape[s.meta_shard_dim]} "
                                     f"does not split into {shards} model-parallel shards")
                w = w.chunk(shards, dim=s.meta_shard_dim)[i]
            shard[s.meta_name] = _own(w)
        fname = f"consolidated.{i:02d}.pth"
        torch.save(shard, tmp / fname)
        files.append(fname)
    return "meta", ["params.json", *files]


def save_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor], dst: str | Path, *, to: str = "hf",
                    shards: int = 1, extra_files: tuple[Path, ...] = (),
                    extra_texts: dict[str, str | bytes] | None = None,
                    ids: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """Write module-named tensors (q/k rows in cfg.rope_layout) as a checkpoint directory, atomically."""
    # extra_files are copied beside the weights; extra_texts (file name -> text or bytes) are written there;
    # ids: config.json's bos/eos/pad as the source writes them (an eos list), over cfg's.
    check_target(to, shards, len(state))
    if to == "gguf":
        raise ValueError("a GGUF is one file, not a checkpoint directory: write it with gguf.write.write_gguf")
    with files.atomic_dir(dst) as tmp:  # all files appear at once, or none; a kill leaves nothing
        writer = _write_hf if to == "hf" else _write_meta
        layout, written = writer(cfg, state, tmp, shards, ids or {})
        for f in extra_files:
            shutil.copyfile(f, tmp / f.name)
            written.append(f.name)
        for name, text in (extra_texts or {}).items():
            if isinstance(text, bytes):
                (tmp / name).write_bytes(text)
            else:
                (tmp / name).write_text(text, encoding="utf-8")
            written.append(name)
    return layout, written


def check_target(to: str, shards: int, tensors: int, cfg: ModelConfig | None = None) -> None:
    """Cheap checks of `convert`'s options, before any weight is read (cfg: Meta's shard split, by shapes)."""
    if to not in WRITABLE:
        raise ValueError(f"unknown target layout {to!r}; choose one of {', '.join(WRITABLE)}")
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    if to == "hf" and shards > tensors:
        raise ValueError(f"--shards {shards} is more than the {tensors} tensors to write; give at most {tensors}")
    if to == "gguf" and shards != 1:
        raise ValueError(f"--shards {shards}: a GGUF is one file; --shards applies to --to hf and meta")
    if to == "gguf" and cfg is not None:
        from .gguf.write import check_config

        check_config(cfg)  # the family's GGUF architecture, and what a GGUF can hold of the config
    if to == "meta" and shards > 1 and cfg is not None:
        for s in weight_specs(cfg.replace(num_hidden_layers=1)):  # every layer has the first one's shapes
            if s.meta_shard_dim is not None and s.shape[s.meta_shard_dim] % shards:
                raise ValueError(f"--shards {shards}: tensor {s.name} (axis {s.meta_shard_dim} of size "
                                 f"{s.shape[s.meta_shard_dim]}) does not split into {shards} model-parallel shards")


Weights = tuple[ModelConfig, "dict[str, torch.Tensor]", dict[str, str], list[str]]  # and tokenizer files, warnings


def _gguf_weights(path: Path, dtype: str | None, files: bool) -> Weights:
    """A GGUF's weights dequantized to `dtype` (float32 by default), and (FILES) its vocabulary as tokenizer files."""
    from .gguf.read import NotUtf8
    from .gguf.tensors import read_gguf_checkpoint
    from .tokenizer_files import tokenizer_json_from_gguf

    ck = read_gguf_checkpoint(path, dtypes.to_torch(dtype or dtypes.FLOAT32.name))
    if not files:  # a GGUF written from it copies its tokenizer.* fields (gguf.vocabulary), needing no files
        return ck.cfg, ck.state, {}, []
    fields = {k: v for k, v in ck.tokenizer_fields.items() if not isinstance(v, NotUtf8)}
    said = [f"{v.problem}; tokenizer_config.json is written without it" for v in ck.tokenizer_fields.values()
            if isinstance(v, NotUtf8)]
    try:
        texts = tokenizer_json_from_gguf(fields)
    except ValueError as e:  # its words name fields, not the file
        raise ValueError(e if str(e).startswith(f"{path}: ") else f"{path}: {e}") from None
    return ck.cfg, ck.state, texts, said


def _stored_weights(path: Path, dtype: str | None, files: bool) -> Weights:
    """A checkpoint directory's weights as stored (cast only when `dtype` is given)."""
    from .load import read_checkpoint

    ck = read_checkpoint(path)
    state = ck.state if dtype is None else {k: v.to(dtypes.to_torch(dtype)) for k, v in ck.state.items()}
    return ck.cfg, state, {}, []


# WeightFiles.kind -> how `convert` reads those weights (default: a checkpoint directory's files).
_WEIGHT_READERS = {"gguf": _gguf_weights}


def _output_bytes(source: ModelSource, dtype: str | None) -> int:
    """The weight bytes convert will write: the stored dtype unless a cast is asked (a GGUF dequantizes to fp32)."""
    gguf = source.weights is not None and source.weights.kind == "gguf"
    return nbytes(param_total(source.cfg), dtype or (dtypes.FLOAT32.name if gguf else source.cfg.torch_dtype))


def convert(src: ModelSource | str | Path, dst: str | Path, to: str = "hf", shards: int = 1, seed: int = 0,
            dtype: str | None = None) -> ConvertResult:
    """SRC (a checkpoint, a GGUF file, or a preset/config with seeded weights) -> DST in `to` layout.

    Values are copied bit for bit unless `dtype` asks for a cast; a GGUF is dequantized (float32 by default).
    """
    source = resolve(src)
    if dtype is not None:
        dtype = dtypes.model_dtype(dtype).name  # a ValueError line before any weight is read
    check_target(to, shards, tensor_total(source.cfg), source.cfg)  # constant time: a 10^8-layer config is not listed
    read_dtype = dtype  # what the weights are read in (None: as stored; a GGUF dequantized to float32)
    if to == "gguf":
        from .gguf import write as gguf_write

        gguf_write.check_destination(dst)
        read_dtype = None  # the writer casts one matrix at a time (1-D tensors stay F32): no cast copy of the model
        if dtype is None and source.weights is not None and source.weights.kind == "gguf":
            assert source.path is not None, "a GGUF source has a path"
            dtype = gguf_write.stored_float(source.path)  # F16/BF16 matrices stay so (read exactly in fp32)
    else:
        paths.check_output_path(dst, directory=True)
    need = _output_bytes(source, dtype)
    if source.weights is not None or need <= MAX_RANDOM_INIT_BYTES:  # too big to seed: load_model says so below
        paths.check_space(dst, need)  # before any weight is read: a full disk is one line
    texts: dict[str, str] = {}
    said: list[str] = []  # what of the source's tokenizer is left out
    if source.weights is not None:
        assert source.path is not None, "a checkpoint source has a path"
        read = _WEIGHT_READERS.get(source.weights.kind, _stored_weights)
        cfg, state, texts, said = read(source.path, read_dtype, to != "gguf")
    else:  # a preset or config: the seeded weights `export onnx` and `generate` would use
        from .loading import load_model

        model = load_model(source.cfg, seed=seed)  # refuses a size it will not materialize
        cfg, state = model.cfg, dict(model.state_dict())
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight")
        if read_dtype is not None:
            state = {k: v.to(dtypes.to_torch(read_dtype)) for k, v in state.items()}
    emb = state["model.embed_tokens.weight"]
    cfg = cfg.replace(torch_dtype=dtypes.get(emb.dtype).name)
    if to == "gguf":
        from .gguf.vocabulary import source_vocabulary

        vocabulary, left_out = source_vocabulary(source, cfg)
        res = gguf_write.write_gguf(cfg, state, dst, dtype=dtype, vocabulary=vocabulary)
        return ConvertResult(source=source.label, destination=str(dst), to=to, layout="gguf", files=[Path(dst).name],
                             tensors=res.tensors, params=res.params, bytes=res.bytes, warnings=left_out + res.warnings)
    extra, carried, ids, warnings = _carried(source, cfg, texts)
    warnings = said + warnings
    layout, written = save_checkpoint(cfg, state, dst, to=to, shards=shards, extra_files=extra,
                                      extra_texts={**texts, **carried}, ids=ids)
    return ConvertResult(
        source=source.label, destination=str(dst), to=to, layout=layout, files=written, tensors=len(state),
        params=sum(v.numel() for v in state.values()),
        bytes=sum(v.numel() * v.element_size() for v in state.values()), warnings=warnings,
    )


def _carried(source: ModelSource, cfg: ModelConfig, texts: dict[str, str]
             ) -> tuple[tuple[Path, ...], dict[str, bytes], dict[str, Any], list[str]]:
    """What travels with the weights, as the source has it: (files to copy, bytes to write, config ids, warnings)."""
    path = source.path
    if path is not None and path.is_dir():
        folder: Path | None = path
    elif path is not None and source.kind == "config":
        folder = path.parent  # a config.json given by name
    else:
        folder = None  # a preset or a GGUF file: no folder of its own
    said = read_source_files(folder, cfg.vocab_size)
    warnings = list(said.warnings)
    carried = {} if said.generation_raw is None else {"generation_config.json": said.generation_raw}
    # The tokenizer (tiny's is package data) with every file of it there: tokenizer.json and/or tokenizer.model,
    # the slow vocab/merges, the special tokens, the template file. A GGUF's vocabulary arrived above as texts.
    found: dict[str, Path] = {}
    if source.tokenizer is not None:
        found, why = tokenizer_files(source.tokenizer.parent)
        warnings += why
        found.setdefault(source.tokenizer.name, source.tokenizer)  # e.g. spm.model: no name of TOKENIZER_FILES
    config = found.pop("tokenizer_config.json", None)
    data = read_bounded(config, MAX_HEADER_BYTES) if config else texts.get("tokenizer_config.json", "").encode()
    if data:  # its chat_template, if it does not parse, is left out (said in a warning)
        fixed, why = checked_tokenizer_config(data, config or Path(source.label))
        if config is not None and not why:
            found["tokenizer_config.json"] = config
        else:
            carried["tokenizer_config.json"] = fixed
        warnings += [why] if why else []
    extra = tuple(p for name, p in found.items() if name not in texts and name not in carried)
    return extra, carried, agreeing_ids(said.config_ids, cfg), warnings
