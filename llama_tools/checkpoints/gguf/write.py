"""Write a GGUF file (llama.cpp's one-file checkpoint) with the gguf library's GGUFWriter: `convert --to gguf`.

What is written is what llama.cpp's converter writes and what this package reads back, each from one registry:
- the architecture: architectures.ARCHITECTURES (family -> general.architecture), which also says the q/k row order
  (llama's rows interleaved by llama.cpp's permutation) and whether norm gains are stored as 1 + γ (Gemma's);
- the metadata keys: the gguf library's own (GGUFWriter.add_* formats gguf.Keys with the architecture);
- the tensor names: formats.FORMATS["gguf"] (token_embd, blk.N.attn_q, ..., output_norm, output), the reader's table;
- the vocabulary as tokenizer.ggml.*: vocabulary.py's (a tokenizer.model, a tokenizer.json, a GGUF's own).
Matrices are stored in the source's float type or --dtype's (F32, F16, BF16), 1-D tensors (norms, biases) in F32 as
llama.cpp keeps them. One tensor at a time is converted (rows permuted, cast) and written; the file appears at once
(files.atomic_file). Where a config departs from what llama.cpp fixes per architecture (Gemma 2/3's query scale,
Gemma 2's soft-caps, a window or local RoPE base where llama.cpp has none), the key config.py reads is written and a
warning says what llama.cpp computes instead; Gemma 2/3's layer pattern and local RoPE base llama.cpp reads.
No torch at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ...modeling import dtypes
from ...outputs import files, paths
from ...modeling.config import ModelConfig
from ...modeling.families import FAMILIES, FULL, SLIDING
from ...modeling.rope import yarn_attention_factor
from ..formats import checkpoint_tensors
from ...modeling.weights import weight_specs
from .architectures import (ALWAYS, ARCHITECTURES, GRANITE_KEYS, KEY, LLAMA3_ARCHITECTURES, MOE_FAMILY, ROPE_FACTORS,
                            ROPE_FREQS, WRITTEN_AS, GgufArchitecture, gguf_format)
from .rope_freqs import PUBLISHED, llama3_divisors
from .vocabulary import Vocabulary, write_vocabulary

if TYPE_CHECKING:
    import torch

# Family -> the general.architecture llama.cpp writes it as (one per family in the registry).
ARCH_OF_FAMILY = {**{a.family: name for name, a in ARCHITECTURES.items()},
                  **{family: name for name, family in MOE_FAMILY.items()},  # Mixtral: 'llama' with experts
                  **WRITTEN_AS}  # Mistral: 'llama'
# Our float dtypes -> the GGML type a matrix of it is stored as; any other dtype is stored as F32.
FLOAT_TYPES = {dtypes.FLOAT32.name: "F32", dtypes.FLOAT16.name: "F16", dtypes.BFLOAT16.name: "BF16"}
# llama.cpp's general.file_type (LlamaFileType) of a file whose matrices are all of one GGML type.
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}
# The architectures whose GGUF holds a query scale and soft caps, as config.gguf_config reads them (Gemma 2/3).
_SCALED = ("gemma2", "gemma3")
UINT32_MAX = 2**32 - 1  # GGUF's sizes and token ids are uint32
# ModelConfig fields the reader takes from the architecture's family, not from the file.
_FAMILY_FIELDS = ("qk_norm", "norm_plus_one", "embed_scale", "hidden_act", "sandwich_norms", "post_norms",
                  "qk_norm_whole", "norm_kind", "gated_mlp")


@dataclass
class GgufWritten:
    """What write_gguf wrote."""

    architecture: str
    tensors: int
    params: int
    bytes: int  # tensor data, as stored
    warnings: list[str] = field(default_factory=list)


# --- What a config needs, checked before any weight is read ---------------------------------------------------

def architecture(cfg: ModelConfig) -> tuple[str, GgufArchitecture]:
    """cfg's GGUF architecture (name, registry entry); ValueError naming the family and the ones written."""
    name = ARCH_OF_FAMILY.get(cfg.family)
    if name is None:
        raise ValueError(f"config {cfg.source or cfg.name!r}: family {cfg.family!r} has no GGUF architecture here; "
                         f"llama-tools writes GGUF for {', '.join(ARCH_OF_FAMILY)}; convert it with --to hf")
    return name, ARCHITECTURES[name]


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming the first thing of cfg a GGUF (as llama.cpp writes it, this package reads it) cannot hold."""
    arch, a = architecture(cfg)
    where = f"config {cfg.source or cfg.name!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    family = {**defaults, **FAMILIES[a.family].defaults}
    s = cfg.rope_scaling
    biases = (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias)
    problems = [what for what, bad in (
        (f"a mixture of experts in {arch} (llama.cpp's {', '.join(MOE_FAMILY)} holds Mixtral's)",
         cfg.is_moe and cfg.family not in MOE_FAMILY.values() and not a.moe),
        ("experts of another width than the FFN's (Mixtral's are n7 wide)",
         cfg.is_moe and not a.moe and cfg.moe_intermediate_size != cfg.intermediate_size),
        (f"a dense FFN in {arch} (llama.cpp's {arch} routes every layer to experts)", a.moe and not cfg.is_moe),
        ("top-k expert weights left as the softmax gives them (norm_topk_prob false; llama.cpp renormalizes them)",
         cfg.is_moe and not cfg.norm_topk_prob),
        (f"a parallel block (llama.cpp's {arch} runs attention and the FFN in sequence)",
         cfg.parallel_residual and a.parallel is None),
        (f"a sequential block (llama.cpp's {arch} runs attention and the FFN in parallel)",
         not cfg.parallel_residual and a.parallel == ALWAYS),
        (f"Linears without biases (llama.cpp's {arch} loads the q/k/v, output and FFN biases)",
         a.biases is True and not all(biases)),
        (f"biases on the Linears (llama.cpp's {arch} loads none)", a.biases is False and any(biases)),
        (f"tied embeddings (llama.cpp's {arch} loads its own output.weight)",
         a.untied_output and cfg.tie_word_embeddings),
        ("ALiBi", cfg.position_encoding != "rope"), ("Baichuan2's NormHead", cfg.norm_head),
        (f"rope_scaling {s.type if s else ''!r} (a GGUF holds linear and yarn scaling, Llama 3's as "
         f"rope_freqs.weight with low/high frequency factors 1/4 over 8192 positions, and longrope's factor tensors "
         f"for {', '.join(n for n, x in ARCHITECTURES.items() if x.longrope)}; llama.cpp has no keys for "
         f"dynamic NTK)", s is not None and not (
             s.type in ("linear", "yarn") or (_llama3(cfg) and arch in LLAMA3_ARCHITECTURES)
             or (s.type == "longrope" and a.longrope))),
        (f"longrope with {len(s.long_factor or ()) if s else 0} long and {len(s.short_factor or ()) if s else 0} "
         f"short factors for {cfg.rotary_dim // 2} rotated pairs (llama.cpp reads one of each per pair)",
         s is not None and s.type == "longrope" and not (
             len(s.long_factor or ()) == len(s.short_factor or ()) == cfg.rotary_dim // 2)),
        ("yarn scaling with truncate false (llama.cpp rounds the ramp's ends outwards)",
         s is not None and s.type == "yarn" and not s.truncate),
        *((f"{f} {getattr(cfg, f)!r} (GGUF's {arch} has {family[f]!r})", getattr(cfg, f) != family[f])
          for f in _FAMILY_FIELDS),
        *((f"{f} (GGUF's {arch} has none)", arch not in _SCALED and getattr(cfg, f) is not None)
          for f in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")),
        *((f"{f} {getattr(cfg, f)!r} (GGUF's {arch} has none)", arch != "granite" and getattr(cfg, f) != family[f])
          for f in GRANITE_KEYS),
        (f"partial rotary (RoPE on {cfg.rotary_dim} of {cfg.head_dim} channels; llama.cpp's {arch} turns whole heads)",
         cfg.position_encoding == "rope" and cfg.partial_rotary and not a.partial_rotary),
        (f"{'these' if a.no_rope_every else 'any'} layers without RoPE (llama.cpp's {arch} leaves out "
         f"{f'every {a.no_rope_every}th' if a.no_rope_every else 'none'})", _rope_layers_differ(cfg, a)),
    ) if bad]
    if problems:
        raise ValueError(f"{where}: a GGUF cannot express {problems[0]}; convert it with --to hf")
    sizes = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
             "max_position_embeddings": cfg.max_position_embeddings, "sliding_window": cfg.sliding_window or 0,
             "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id or 0,
             "rope_scaling.original_max_position_embeddings": s.original_max_position_embeddings if s else 0}
    big = next(((k, v) for k, v in sizes.items() if v > UINT32_MAX), None)
    if big:
        raise ValueError(f"{where}: field {big[0]} is {big[1]:,}; a GGUF stores it as a uint32 (at most "
                         f"{UINT32_MAX:,})")


def _rope_layers_differ(cfg: ModelConfig, a: GgufArchitecture) -> bool:
    """Whether cfg's layers without RoPE are not the ones llama.cpp fixes for the architecture (SmolLM3's every 4th)."""
    every = a.no_rope_every
    if cfg.rope_layers is None:  # every layer rotates: llama.cpp's too, unless it reaches its first without
        return bool(every) and cfg.num_hidden_layers >= every
    return cfg.rope_layers != tuple((j + 1) % every != 0 if every else True for j in range(cfg.num_hidden_layers))


def yarn_gguf_attn_factor(s: Any) -> float:
    """{arch}.rope.scaling.attn_factor for yarn: transformers' attention factor over the 1 + 0.1 ln(factor) that
    ggml's rope_yarn multiplies cos and sin by itself (1 for a yarn scaling without mscale or attention_factor)."""
    return float(s.attention_factor if s.attention_factor is not None else 1.0) / yarn_attention_factor(s.factor)


def _llama3(cfg: ModelConfig) -> bool:
    """Whether cfg's RoPE scaling is Llama 3's with published band parameters: stored as rope_freqs.weight, which
    rope_freqs.llama3_scaling reads back."""
    s = cfg.rope_scaling
    return s is not None and s.type == "llama3" and (
        s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) in PUBLISHED


def check_destination(dst: str | Path) -> Path:
    """Cheap checks of DST before any work: a new file (or a stream, device or FIFO to write through)."""
    path = paths.check_output_path(dst)
    if not paths.written_through(path) and os.path.lexists(paths.resolve_output(path)):
        raise ValueError(f"{dst}: already exists; choose a new destination")
    return path


def stored_float(path: str | Path) -> str | None:
    """The float dtype all of a GGUF's matrices are stored in (F32, F16, BF16), None for quantized or mixed ones."""
    from .tensors import read_gguf_tensors

    kinds = {t.dtype for t in read_gguf_tensors(path).tensors if len(t.shape) > 1}
    ours = {ggml: name for name, ggml in FLOAT_TYPES.items()}
    return ours.get(next(iter(kinds))) if len(kinds) == 1 else None


# --- Metadata -------------------------------------------------------------------------------------------------

def _layer_rule(a: GgufArchitecture, layers: int) -> tuple[str, ...] | None:
    """The layer types config.py gives a file that names no pattern: llama.cpp's n - 1 local, 1 global."""
    if not a.swa_pattern:
        return None
    return tuple(SLIDING if (j + 1) % a.swa_pattern else FULL for j in range(layers))


def _hparams(w: Any, cfg: ModelConfig, arch: str, a: GgufArchitecture) -> list[str]:
    """cfg's <arch>.* metadata on the writer; warnings for what llama.cpp fixes otherwise for this architecture."""
    import gguf

    said = []
    n = cfg.num_hidden_layers
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)  # llama.cpp's Gemma 2/3 converters always write them; readers derive n2/n5 else
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)  # n6, or partial rotary's width where llama.cpp turns only that many
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.norm_kind == "layer":  # LayerNorm's epsilon has a key of its own
        w.add_layer_norm_eps(cfg.rms_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if a.parallel == KEY:
        w.add_parallel_residual(cfg.parallel_residual)
    s = cfg.rope_scaling
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if a.moe:
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if s is not None and s.type == "linear":  # llama3: rope_freqs.weight, no keys (llama.cpp's converter)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
    if s is not None and s.type == "longrope":  # as llama.cpp's converter: no type key, the factors as tensors
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)  # llama.cpp's switch to the long factors
        # transformers' attention factor (the converter's sqrt(1 + ln(context / original) / ln(original)) unless the
        # config gives its own): llama.cpp multiplies cos and sin by it, short or long factors alike, as transformers
        w.add_rope_scaling_attn_factors(float(s.attention_factor if s.attention_factor is not None else 1.0))
    if s is not None and s.type == "yarn":  # ggml's rope_yarn: cos, sin x attn_factor x (1 + 0.1 ln factor)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
        w.add_rope_scaling_attn_factors(yarn_gguf_attn_factor(s))
        if (s.beta_fast, s.beta_slow) != (32.0, 1.0):
            said.append(f"{arch}: llama.cpp reads no yarn beta keys for {arch} (it ramps between 32 and 1 "
                        f"rotations); the betas {s.beta_fast:g}/{s.beta_slow:g} are read back by llama-tools only")
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.layer_types != _layer_rule(a, n):  # llama.cpp's Gemma 2/3 read it (per layer, true = local)
            w.add_sliding_window_pattern([cfg.slides(j) for j in range(n)])
        if not a.swa_pattern:
            said.append(f"{arch}: llama.cpp attends to all positions for {arch}; the sliding window of "
                        f"{cfg.sliding_window} is read back by llama-tools only")
    elif a.swa_pattern:
        said.append(f"{arch}: no sliding window in the config; llama.cpp's {arch} expects one "
                    f"({arch}.attention.sliding_window)")
    if arch in _SCALED:
        # llama.cpp's query scale (config.py reads the same rule): n2 / n5 for the 27B sizes, else n6.
        rule = float(cfg.hidden_size // cfg.num_attention_heads if n == a.big_layers else cfg.head_dim)
        if cfg.attention_scale != rule:
            scale = _query_scale(cfg.attention_scale)
            w.add_attention_scale(scale)
            said.append(f"{arch}: scores are divided by sqrt({cfg.attention_scale:g}), llama.cpp's rule gives "
                        f"sqrt({rule:g}); written as {arch}.attention.scale, which llama.cpp does not read for {arch}")
            back = _f32(1.0 / scale ** 2)
            if back != cfg.attention_scale:  # no float32 scale gives it back: said, with what is read
                said.append(f"{arch}.attention.scale {scale!r} (float32) reads back as query_pre_attn_scalar "
                            f"{back!r}, not {cfg.attention_scale!r}")
        if cfg.attn_logit_softcap:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
            if not a.caps_attention:
                said.append(f"{arch}: attention scores are soft-capped at {cfg.attn_logit_softcap:g}, written as "
                            f"{arch}.attn_logit_softcapping; llama.cpp's {arch} applies no attention cap")
        if cfg.final_logit_softcap:
            w.add_final_logit_softcapping(cfg.final_logit_softcap)
        for what, mine, theirs in (("attention scores", cfg.attn_logit_softcap, a.default_caps[0]),
                                   ("logits", cfg.final_logit_softcap, a.default_caps[1])):
            if not mine and theirs:  # a GGUF has no way to say "no cap" to it (a cap of 0 divides by zero)
                said.append(f"{arch}: the config soft-caps no {what}; llama.cpp's {arch} caps them at {theirs:g} "
                            f"all the same (a GGUF cannot say 'no cap'): its large {what} come out smaller")
    if arch == "granite":  # llama.cpp reads all four; an attention.scale of 0 is its 1 / sqrt(n6), as None ours
        for f, key in GRANITE_KEYS.items():
            w.add_float32(f"{arch}.{key}", float(getattr(cfg, f) or 0.0))
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else (
        cfg.rope_theta if a.swa_base is not None else None)  # None: the local layers use the global base
    if local is not None and local != a.swa_base:
        w.add_rope_freq_base_swa(local)  # llama.cpp's Gemma 2/3 read it
        if not a.swa_pattern:
            said.append(f"{arch}: the local layers' RoPE base {local:g} is written as {arch}.rope.freq_base_swa; "
                        f"llama.cpp has none for {arch}")
    return said


def _f32(value: float) -> float:
    """VALUE rounded to float32, as the shortest decimal that is that float32 (as config.py reads floats)."""
    import numpy as np

    return float(str(np.float32(value)))


def _query_scale(q: float) -> float:
    """attention.scale for scores divided by sqrt(q): the float32 nearest 1 / sqrt(q) whose 1 / scale², rounded to
    float32 as config.py reads it, is q (a neighbour when rounding moves it: q = 1000 reads back exactly too)."""
    import numpy as np

    lo = hi = np.float32(1.0 / math.sqrt(q))
    near = [lo]
    for _ in range(16):  # a few float32 steps either side: one step of s moves 1 / s² by about 2 steps of q
        lo, hi = np.nextafter(lo, np.float32(0)), np.nextafter(hi, np.float32(np.inf))
        near += [lo, hi]
    want = np.float32(q)
    return float(next((s for s in near if np.float32(1.0 / float(s) ** 2) == want), near[0]))


# --- Tensors ------------------------------------------------------------------------------------------------

def _ggml_type(w: torch.Tensor, dtype: str | None) -> str:
    """The GGML type a tensor is stored as: 1-D ones F32 (llama.cpp's kernels read norms and biases only so),
    matrices in `dtype`, else in their own float type."""
    if w.dim() < 2:
        return "F32"
    return FLOAT_TYPES.get(dtype or dtypes.get(w.dtype).name, "F32")


def _stored(name: str, w: torch.Tensor, cfg: ModelConfig, a: GgufArchitecture, qtype: str) -> Any:
    """One module-named tensor as the file stores it: q/k rows in the architecture's order, Gemma's gains as 1 + γ,
    cast; a numpy array of its bytes (BF16 as int16 bits)."""
    import torch

    from ..layouts import permute_rope_rows

    if cfg.position_encoding == "rope" and cfg.rope_layout != a.rope_layout:
        w = permute_rope_rows({name: w}, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_layout,
                              a.rope_layout)[name]
    if a.gains_plus_one and name.endswith("norm.weight"):
        w = w.to(torch.float32) + 1.0  # in fp32: 1 + γ rounded once (llama.cpp adds in the source's dtype)
    w = w.detach().to(device="cpu", dtype=dtypes.to_torch({"F32": "float32", "F16": "float16",
                                                             "BF16": "bfloat16"}[qtype])).contiguous()
    return w.view(torch.int16).numpy() if qtype == "BF16" else w.numpy()


@contextlib.contextmanager
def _target(dst: str | Path) -> Iterator[Path]:
    """The path GGUFWriter writes: a temp renamed onto DST (files.atomic_file); for a FIFO, a temp file whose bytes
    are then sent through it (GGUFWriter asks the file its position between tensors, which a FIFO cannot say)."""
    try:
        fifo = stat.S_ISFIFO(os.stat(dst).st_mode) and paths.stream_fd(dst) is None
    except OSError:
        fifo = False
    if not fifo:
        with files.atomic_file(dst) as tmp:
            yield tmp
        return
    with files.temp_dir("gguf") as d:
        yield d / "out.gguf"
        files.write_chunks(dst, _chunks(d / "out.gguf"))


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def write_gguf(cfg: ModelConfig, state: dict[str, torch.Tensor], dst: str | Path, *, dtype: str | None = None,
               vocabulary: Vocabulary | None = None) -> GgufWritten:
    """Module-named tensors (q/k rows in cfg.rope_layout) as one GGUF file at DST, atomically, a tensor at a time.

    dtype: the matrices' float type (default: each one's own; types other than F32/F16/BF16 become F32).
    """
    import gguf
    import numpy as np

    check_config(cfg)
    arch, a = architecture(cfg)
    dtype = dtypes.model_dtype(dtype).name if dtype is not None else None
    plan = []  # (stored name, module names, shape, GGML type): every tensor checked before the file is opened
    spec_shape = {s.name: s.shape for s in weight_specs(cfg)}
    for ct in checkpoint_tensors(cfg, gguf_format(arch)):
        stacked = len(ct.shape) == 3  # a layer's experts, one projection: [experts, rows, columns]
        for part in ct.parts:
            want = ct.shape[1:] if stacked else spec_shape[part]  # a fused tensor's parts: each its own rows
            t = state.get(part)
            if t is None:
                raise ValueError(f"tensor {part} of the {cfg.family} model {cfg.name!r} is missing")
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {part} has shape {list(t.shape)}, the config predicts {list(want)}")
        plan.append((ct.name, ct.parts, ct.shape, _ggml_type(state[ct.parts[0]], dtype)))
    odd = sorted({dtypes.get(state[p[0]].dtype).name for _, p, s, _ in plan if len(s) > 1} - set(FLOAT_TYPES))
    params = sum(math.prod(s) for _, _, s, _ in plan)
    extras = _rope_tensors(cfg)
    plan[:0] = [(name, (), (len(v),), "F32") for name, v in extras.items()]  # llama.cpp's place for them: first
    warnings = [f"{', '.join(odd)} matrices written as F32 (a GGUF's float types here: F32, F16, BF16)"] if odd else []
    if cfg.family in WRITTEN_AS:
        warnings.append(f"{cfg.family}: written as llama.cpp's {arch!r}, as its converter writes it; it reads back as "
                        f"{a.family} (the same block)")
    sizes = {q: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]] for *_, q in plan}
    nbytes = [math.prod(shape) * sizes[q][1] // sizes[q][0] for _, _, shape, q in plan]
    with _target(dst) as path:
        w = gguf.GGUFWriter(path, arch)
        try:
            w.add_type(gguf.GGUFType.MODEL)
            w.add_name(cfg.name)
            first = next(q for _, parts, _, q in plan if parts)  # the embedding's names the file's (file_type)
            w.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[first])))
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            warnings += _hparams(w, cfg, arch, a)
            write_vocabulary(w, cfg, vocabulary)
            for (name, _, shape, q), size in zip(plan, nbytes):
                w.add_tensor_info(name, shape, np.dtype(np.float32), size, raw_dtype=gguf.GGMLQuantizationType[q])
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for name, parts, shape, q in plan:  # one converted tensor in memory at a time
                if not parts:  # rope_freqs.weight, longrope's factors
                    w.write_tensor_data(np.asarray(extras[name], np.float32))
                    continue
                if len(shape) == 3:
                    w.write_tensor_data(_stored(parts[0], _stack([state[p] for p in parts]), cfg, a, q))
                else:  # one tensor, or a fused one's parts one after another (Phi-3's attn_qkv, ffn_up: gate, up)
                    w.write_tensor_data(np.concatenate([_stored(p, state[p], cfg, a, q) for p in parts]))
        finally:
            w.close()
    return GgufWritten(arch, len(plan), params, sum(nbytes), warnings)


def _rope_tensors(cfg: ModelConfig) -> dict[str, list[float]]:
    """The RoPE tensors llama.cpp's converter writes for cfg's scaling, in its order: Llama 3's divisors, or
    longrope's long then short factors."""
    s = cfg.rope_scaling
    if _llama3(cfg):
        return {ROPE_FREQS: llama3_divisors(cfg.rope_theta, cfg.rotary_dim, s)}  # type: ignore[arg-type]
    if s is not None and s.type == "longrope":
        return {name: list(getattr(s, field)) for field, name in ROPE_FACTORS.items()}
    return {}


def _stack(experts: list[torch.Tensor]) -> torch.Tensor:
    """One projection's experts as GGUF stacks them: [experts, rows, columns]."""
    import torch

    return torch.stack(experts)
