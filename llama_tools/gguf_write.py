"""Write a GGUF file (llama.cpp's one-file checkpoint) with the gguf library's GGUFWriter: `convert --to gguf`.

What is written is what llama.cpp's converter writes and what gguf_files reads back, each from one registry:
- the architecture: gguf_files.ARCHITECTURES (family -> general.architecture), which also says the q/k row order
  (llama's rows interleaved by llama.cpp's permutation) and whether norm gains are stored as 1 + γ (Gemma's);
- the metadata keys: the gguf library's own (GGUFWriter.add_* formats gguf.Keys with the architecture);
- the tensor names: formats.FORMATS["gguf"] (token_embd, blk.N.attn_q, ..., output_norm, output), the reader's table;
- the vocabulary as tokenizer.ggml.*: a sentencepiece tokenizer.model as 'llama' (pieces, scores, types), a byte-level
  BPE tokenizer.json as 'gpt2' (tokens, types, merges, its pre-tokenizer by llama.cpp's name), a GGUF's own fields as
  they are; padded to the embedding's rows with [PADn] tokens as llama.cpp pads them.
Matrices are stored in the source's float type or --dtype's (F32, F16, BF16), 1-D tensors (norms, biases) in F32 as
llama.cpp keeps them. One tensor at a time is converted (rows permuted, cast) and written; the file appears at once
(files.atomic_file). Where a config departs from what llama.cpp fixes per architecture (Gemma's layer pattern, query
scale, local RoPE base), the key gguf_files reads is written and a warning says that llama.cpp does not read it.
No torch at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from . import dtypes, files, paths
from .config import ModelConfig
from .families import FAMILIES, FULL, SLIDING
from .formats import checkpoint_tensors
from .gguf_files import ARCHITECTURES, GGUF, KIND, GgufArchitecture
from .source_files import MAX_TOKENIZER_FILE_BYTES, json_object, read_bounded, template_problem
from .tokenizer_files import CONTROL, NORMAL, PRE_TOKENIZERS, UNUSED, USER_DEFINED

if TYPE_CHECKING:
    import torch

    from .source import ModelSource

# Family -> the general.architecture llama.cpp writes it as (one per family in the registry).
ARCH_OF_FAMILY = {a.family: name for name, a in ARCHITECTURES.items()}
# Our float dtypes -> the GGML type a matrix of it is stored as; any other dtype is stored as F32.
FLOAT_TYPES = {dtypes.FLOAT32.name: "F32", dtypes.FLOAT16.name: "F16", dtypes.BFLOAT16.name: "BF16"}
# llama.cpp's general.file_type (LlamaFileType) of a file whose matrices are all of one GGML type.
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}
# The architectures whose GGUF holds a query scale and soft caps, as gguf_files.gguf_config reads them (Gemma 2/3).
_SCALED = ("gemma2", "gemma3")
UINT32_MAX = 2**32 - 1  # GGUF's sizes and token ids are uint32
# ModelConfig fields the reader takes from the architecture's family, not from the file.
_FAMILY_FIELDS = ("qk_norm", "norm_plus_one", "embed_scale", "hidden_act", "sandwich_norms")
_UNUSED_SCORE = -1000.0  # llama.cpp's score of a [PADn] sentencepiece token


@dataclass
class Vocabulary:
    """tokenizer.ggml.* to write: built from a tokenizer file, or a GGUF's own fields copied as they are."""

    source: str  # the file it comes from, for messages
    model: str = ""  # tokenizer.ggml.model: 'llama' (sentencepiece) or 'gpt2' (byte-level BPE); '' when `fields` say
    tokens: list[str] = field(default_factory=list)
    types: list[int] = field(default_factory=list)  # llama.cpp's token types (tokenizer_files.NORMAL ...)
    scores: list[float] | None = None  # sentencepiece's, one per token
    merges: list[str] | None = None  # byte-level BPE's, "a b" in rank order
    pre: str = "default"  # tokenizer.ggml.pre: llama.cpp's name of the pre-tokenizer
    unk_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    fields: list[tuple[str, Any, Any, Any]] = field(default_factory=list)  # (key, value, value type, item type)


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
    """ValueError naming the first thing of cfg a GGUF (as llama.cpp writes it, gguf_files reads it) cannot hold."""
    arch, a = architecture(cfg)
    where = f"config {cfg.source or cfg.name!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    family = {**defaults, **FAMILIES[a.family].defaults}
    s = cfg.rope_scaling
    problems = [what for what, bad in (
        ("a mixture of experts", cfg.is_moe), ("ALiBi", cfg.position_encoding != "rope"),
        ("Baichuan2's NormHead", cfg.norm_head),
        (f"rope_scaling {s.type if s else ''!r} (a GGUF holds linear scaling; llama.cpp stores Llama 3's as "
         f"rope_freqs.weight, which llama-tools does not read back)", s is not None and s.type != "linear"),
        *((f"{f} {getattr(cfg, f)!r} (GGUF's {arch} has {family[f]!r})", getattr(cfg, f) != family[f])
          for f in _FAMILY_FIELDS),
        *((f"{f} (GGUF's {arch} has none)", arch not in _SCALED and getattr(cfg, f) is not None)
          for f in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")),
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


def check_destination(dst: str | Path) -> Path:
    """Cheap checks of DST before any work: a new file (or a stream, device or FIFO to write through)."""
    path = paths.check_output_path(dst)
    if not paths.written_through(path) and os.path.lexists(paths.resolve_output(path)):
        raise ValueError(f"{dst}: already exists; choose a new destination")
    return path


def stored_float(path: str | Path) -> str | None:
    """The float dtype all of a GGUF's matrices are stored in (F32, F16, BF16), None for quantized or mixed ones."""
    from .gguf_files import read_gguf_tensors

    kinds = {t.dtype for t in read_gguf_tensors(path).tensors if len(t.shape) > 1}
    ours = {ggml: name for name, ggml in FLOAT_TYPES.items()}
    return ours.get(next(iter(kinds))) if len(kinds) == 1 else None


# --- The vocabulary -----------------------------------------------------------------------------------------

def source_vocabulary(source: ModelSource, cfg: ModelConfig) -> tuple[Vocabulary | None, list[str]]:
    """The vocabulary SOURCE ships, for tokenizer.ggml.*, and warnings; None (said why) when it has none to write."""
    if source.weights is not None and source.weights.kind == KIND and source.path is not None:
        return gguf_vocabulary(source.path), []
    found = source.tokenizer
    if found is None:
        return None, [f"{source.label}: no tokenizer beside it; the GGUF is written without a vocabulary, which "
                      f"llama.cpp needs to run it"]
    folder = found.parent
    spm = found if found.suffix == ".model" else folder / "tokenizer.model"
    try:
        data = _tokenizer_json(folder / "tokenizer.json")
        if data is not None and _byte_level(data):
            vocab = bpe_vocabulary(folder / "tokenizer.json", data, cfg.vocab_size)
        elif spm.is_file():
            vocab = sentencepiece_vocabulary(spm, cfg.vocab_size)
        else:
            raise ValueError(f"{folder / 'tokenizer.json'}: not a byte-level BPE tokenizer, and no tokenizer.model "
                             f"beside it; llama.cpp's 'gpt2' and 'llama' vocabularies are written from those")
        return vocab, _tokenizer_behaviour(vocab, folder / "tokenizer.json" if vocab.model == "gpt2" else spm, cfg)
    except ValueError as e:
        return None, [f"{str(e).splitlines()[0]}; the GGUF is written without a vocabulary"]


def _tokenizer_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json_object(read_bounded(path, MAX_TOKENIZER_FILE_BYTES), path)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: not a tokenizer.json (no 'model' object)")
    return data


def _byte_level(data: dict[str, Any]) -> bool:
    """A BPE tokenizer.json that decodes bytes from GPT-2's byte alphabet: what llama.cpp calls 'gpt2'."""
    decoder = data.get("decoder")
    return data["model"].get("type") == "BPE" and isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"


def _tokenizer_behaviour(vocab: Vocabulary, path: Path, cfg: ModelConfig) -> list[str]:
    """BOS/EOS and the chat template as the source's tokenizer has them (tokenizer.Tokenizer reads its files)."""
    from .tokenizer import Tokenizer

    tok = Tokenizer(path)
    vocab.add_bos, vocab.add_eos = tok.special.add_bos, tok.special.add_eos
    bos = tok.special.bos_id if tok.special.add_bos else None
    warnings = []
    if bos is not None and bos != cfg.bos_token_id:
        warnings.append(f"{path}: the tokenizer adds BOS id {bos}, the config's bos_token_id is {cfg.bos_token_id}; "
                        f"a GGUF has one BOS id: the config's is written")
    why = template_problem(tok.chat_template) if tok.chat_template is not None else None
    if why:
        warnings.append(f"{path.parent}: its chat template is not a valid Jinja template ({why}); left out")
    else:
        vocab.chat_template = tok.chat_template
    return warnings


def _pre_json(build: Any) -> Any:
    """A tokenizers pre-tokenizer as tokenizer.json writes it, without what only moves offsets."""
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = build()
    return _splitting(json.loads(t.to_str())["pre_tokenizer"])


def _splitting(value: Any) -> Any:
    """VALUE without `trim_offsets` keys: they change offsets, never how text is split."""
    if isinstance(value, dict):
        return {k: _splitting(v) for k, v in value.items() if k != "trim_offsets"}
    return [_splitting(v) for v in value] if isinstance(value, list) else value


@lru_cache(maxsize=1)
def _pre_names() -> tuple[tuple[str, Any], ...]:
    # llama.cpp's "default" is a regex set of its own, not GPT-2's byte-level split: never written for one.
    return tuple((name, _pre_json(build)) for name, build in PRE_TOKENIZERS.items() if name != "default")


def pre_tokenizer_name(pre: Any) -> str | None:
    """llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer that splits as one we build."""
    want = _splitting(pre)
    return next((name for name, built in _pre_names() if built == want), None)


def bpe_vocabulary(path: Path, data: dict[str, Any], vocab_size: int) -> Vocabulary:
    """A byte-level BPE tokenizer.json as llama.cpp's 'gpt2' vocabulary: tokens by id, types, merges, pre."""
    model = data["model"]
    pre = pre_tokenizer_name(data.get("pre_tokenizer"))
    if pre is None:
        known = ", ".join(name for name, _ in _pre_names())
        raise ValueError(f"{path}: its pre-tokenizer splits as none that llama.cpp names here ({known})")
    odd = next((k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                if model.get(k)), None)
    if odd:
        raise ValueError(f"{path}: BPE option {odd}={model[odd]!r} has no place in a GGUF vocabulary")
    norm = data.get("normalizer")
    if norm is not None and not (isinstance(norm, dict) and norm.get("type") == "NFC"):
        raise ValueError(f"{path}: normalizer {str(norm)[:60]} has no place in a 'gpt2' GGUF vocabulary")
    tokens: list[str | None] = [None] * vocab_size
    types = [NORMAL] * vocab_size
    vocab, added = model.get("vocab"), data.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(added, list):
        raise ValueError(f"{path}: model.vocab must be an object and added_tokens a list")
    entries = [(t, i, NORMAL) for t, i in vocab.items()] + [
        (a.get("content"), a.get("id"), CONTROL if a.get("special") else USER_DEFINED) if isinstance(a, dict)
        else (None, None, NORMAL) for a in added]
    for token, i, kind in entries:
        if not isinstance(token, str) or type(i) is not int or not 0 <= i < vocab_size:
            raise ValueError(f"{path}: token {str(token)[:40]!r} has id {i!r}, not one of the model's {vocab_size} "
                             f"embedding rows")
        tokens[i], types[i] = token, kind
    for i, t in enumerate(tokens):
        if t is None:  # llama.cpp's filler for an id no token has
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = []
    for m in model.get("merges") or []:  # "a b", or ["a", "b"] (tokenizers >= 0.20)
        a, b = m.split(" ", 1) if isinstance(m, str) and " " in m else m if isinstance(m, list) and len(m) == 2 \
            else ("", "")
        if not (isinstance(a, str) and isinstance(b, str) and a and b and " " not in a and " " not in b):
            raise ValueError(f"{path}: merge {str(m)[:40]!r} is not two tokens without spaces")
        merges.append(f"{a} {b}")
    unk = model.get("unk_token")
    return Vocabulary(str(path), "gpt2", tokens, types, None, merges, pre,  # type: ignore[arg-type]
                      unk_id=vocab.get(unk) if isinstance(unk, str) and type(vocab.get(unk)) is int else None)


def sentencepiece_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """A sentencepiece BPE tokenizer.model as llama.cpp's 'llama' vocabulary: pieces, scores, types."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(read_bounded(path, MAX_TOKENIZER_FILE_BYTES))
    except Exception as e:  # protobuf's DecodeError  # noqa: BLE001
        raise ValueError(f"{path}: not a sentencepiece model ({type(e).__name__})") from None
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    n = len(proto.pieces)
    if not n:
        raise ValueError(f"{path}: not a sentencepiece model (no pieces)")
    if trainer.model_type != pb.TrainerSpec.ModelType.Value("BPE"):
        raise ValueError(f"{path}: a sentencepiece {pb.TrainerSpec.ModelType.Name(trainer.model_type)} model; "
                         f"llama.cpp's 'llama' vocabulary is BPE")
    if norm.precompiled_charsmap or norm.remove_extra_whitespaces:  # as tokenizer_files.sentencepiece_files
        raise ValueError(f"{path}: normalization {norm.name!r} has no place in a 'llama' GGUF vocabulary")
    if n > vocab_size:
        raise ValueError(f"{path}: {n} pieces, more than the model's {vocab_size} embedding rows")
    pad = vocab_size - n  # llama.cpp's fillers up to the embedding's rows: [PAD1], [PAD2], ...
    return Vocabulary(
        str(path), "llama", [p.piece for p in proto.pieces] + [f"[PAD{i}]" for i in range(1, pad + 1)],
        [int(p.type) for p in proto.pieces] + [UNUSED] * pad,  # sentencepiece's type numbers are llama.cpp's
        [float(p.score) for p in proto.pieces] + [_UNUSED_SCORE] * pad,
        unk_id=trainer.unk_id if 0 <= trainer.unk_id < n else None, add_space_prefix=bool(norm.add_dummy_prefix))


def gguf_vocabulary(path: Path) -> Vocabulary:
    """A GGUF's tokenizer.* fields, to be written as they are (their value types kept)."""
    import gguf

    from .gguf_files import open_gguf

    out = Vocabulary(str(path))
    for key, f in open_gguf(path).fields.items():
        if not key.startswith("tokenizer.") or key in _ID_KEYS:
            continue  # the ids are the config's (write_gguf)
        kinds = list(f.types)
        value = f.contents()
        if kinds[0] == gguf.GGUFValueType.ARRAY and (not value or len(kinds) != 2):
            continue  # empty, or arrays of arrays: the writer has no form for them, and no vocabulary uses one
        out.fields.append((key, value, kinds[0], kinds[1] if len(kinds) > 1 else None))
    return out


_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")


def _write_vocabulary(w: Any, cfg: ModelConfig, v: Vocabulary | None) -> None:
    w.add_bos_token_id(cfg.bos_token_id)  # the config's ids, which gguf_files reads back as the config's
    w.add_eos_token_id(cfg.eos_token_id)
    if cfg.pad_token_id is not None:
        w.add_pad_token_id(cfg.pad_token_id)
    if v is None:
        return
    for key, value, kind, item in v.fields:
        w.add_key_value(key, value, kind, sub_type=item)
    if not v.model:
        return
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    for value, add in ((v.unk_id, w.add_unk_token_id), (v.add_bos, w.add_add_bos_token),
                       (v.add_eos, w.add_add_eos_token), (v.add_space_prefix, w.add_add_space_prefix)):
        if value is not None:
            add(value)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


# --- Metadata -------------------------------------------------------------------------------------------------

def _layer_rule(a: GgufArchitecture, layers: int) -> tuple[str, ...] | None:
    """The layer types gguf_files gives a file that names no pattern: llama.cpp's n - 1 local, 1 global."""
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
    w.add_rope_dimension_count(cfg.head_dim)  # whole heads rotate (check_config refuses nothing else here)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    s = cfg.rope_scaling
    if s is not None:  # linear (check_config)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.layer_types != _layer_rule(a, n):
            w.add_sliding_window_pattern([cfg.slides(j) for j in range(n)])
            if a.swa_pattern:
                said.append(f"{arch}: local layers {[j for j in range(n) if cfg.slides(j)]} are not llama.cpp's "
                            f"pattern ({a.swa_pattern - 1} local, 1 global); written as "
                            f"{arch}.attention.sliding_window_pattern, which llama.cpp does not read for {arch}")
        if not a.swa_pattern:
            said.append(f"{arch}: llama.cpp attends to all positions for {arch}; the sliding window of "
                        f"{cfg.sliding_window} is read back by llama-tools only")
    elif a.swa_pattern:
        said.append(f"{arch}: no sliding window in the config; llama.cpp's {arch} expects one "
                    f"({arch}.attention.sliding_window)")
    if arch in _SCALED:
        # llama.cpp's query scale (gguf_files reads the same rule): n2 / n5 for the 27B sizes, else n6.
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
        if cfg.final_logit_softcap:
            w.add_final_logit_softcapping(cfg.final_logit_softcap)
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else (
        cfg.rope_theta if a.swa_base is not None else None)  # None: the local layers use the global base
    if local is not None and local != a.swa_base:
        w.add_rope_freq_base_swa(local)
        said.append(f"{arch}: the local layers' RoPE base {local:g} is written as {arch}.rope.freq_base_swa; "
                    f"llama.cpp " + (f"fixes it at {a.swa_base:g}" if a.swa_base is not None else "has none")
                    + f" for {arch}")
    return said


def _f32(value: float) -> float:
    """VALUE rounded to float32, as the shortest decimal that is that float32 (as gguf_files reads floats)."""
    import numpy as np

    return float(str(np.float32(value)))


def _query_scale(q: float) -> float:
    """attention.scale for scores divided by sqrt(q): the float32 nearest 1 / sqrt(q) whose 1 / scale², rounded to
    float32 as gguf_files reads it, is q (a neighbour when rounding moves it: q = 1000 reads back exactly too)."""
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

    from .layouts import permute_rope_rows

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
    plan = []  # (stored name, module name, shape, GGML type): every tensor checked before the file is opened
    for ct in checkpoint_tensors(cfg, GGUF):
        part = ct.parts[0]
        t = state.get(part)
        if t is None:
            raise ValueError(f"tensor {part} of the {cfg.family} model {cfg.name!r} is missing")
        if tuple(t.shape) != ct.shape:
            raise ValueError(f"tensor {part} has shape {list(t.shape)}, the config predicts {list(ct.shape)}")
        plan.append((ct.name, part, ct.shape, _ggml_type(t, dtype)))
    odd = sorted({dtypes.get(state[p].dtype).name for _, p, s, _ in plan if len(s) > 1} - set(FLOAT_TYPES))
    warnings = [f"{', '.join(odd)} matrices written as F32 (a GGUF's float types here: F32, F16, BF16)"] if odd else []
    sizes = {q: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]] for *_, q in plan}
    nbytes = [math.prod(shape) * sizes[q][1] // sizes[q][0] for _, _, shape, q in plan]
    with _target(dst) as path:
        w = gguf.GGUFWriter(path, arch)
        try:
            w.add_type(gguf.GGUFType.MODEL)
            w.add_name(cfg.name)
            first = plan[0][3]  # the embedding's type names the file's (llama.cpp's general.file_type)
            w.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[first])))
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            warnings += _hparams(w, cfg, arch, a)
            _write_vocabulary(w, cfg, vocabulary)
            for (name, _, shape, q), size in zip(plan, nbytes):
                w.add_tensor_info(name, shape, np.dtype(np.float32), size, raw_dtype=gguf.GGMLQuantizationType[q])
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for name, part, _, q in plan:  # one converted tensor in memory at a time
                w.write_tensor_data(_stored(part, state[part], cfg, a, q))
        finally:
            w.close()
    return GgufWritten(arch, len(plan), sum(math.prod(s) for _, _, s, _ in plan), sum(nbytes), warnings)
