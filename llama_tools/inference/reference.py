"""A PyTorch fp32 reference that never holds the whole model: one half of a decoder layer's fp32 weights at a time.

For parity checks of big models. The checkpoint stays memory-mapped on disk; each forward pass goes

    ids --rows of D--> Z^0 --layer 0--> Z^1 --layer 1--> ... --layer n8-1--> Z^n8 --rnorm--> --W^8 in row chunks--> H
                        (read, cast to fp32, run for the whole batch, free: half a layer resident at a time)

so the resident weights are half a layer in fp32 (its attention, then its feed-forward) plus a chunk of lm_head and the embedding rows the ids use,
and the files' pages are unmapped after every layer. The arithmetic is `llama_tools.modeling.model`'s own
(the same DecoderLayer, attention_bias and rope tables), so it matches `load_model(dir)` to rounding.
Seeded random sources (presets, configs) have no file to stream from: `reference_model` builds them in fp32 and
reads them layer by layer the same way (StateReader). Any pass can run in another dtype: the weights are cast as
they stream, so `verify parity` gets PyTorch in the graph's dtype and the float64 truth from one reader.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..modeling.config import ModelConfig
from ..checkpoints.formats import BENIGN_SUFFIXES, checkpoint_tensors
from ..checkpoints.header_readers import TensorInfo
from ..checkpoints.inspection import read_checkpoint_headers
from ..checkpoints.layouts import split_parts
from ..modeling.model import (
    CausalLMOutput, DecoderLayer, KVCache, RMSNorm, RopeTables, embedding_scale, final_logits, layer_masks,
    layer_tables, norm, positions, rope_tables_of)
from ..modeling.rope import per_pass
from ..outputs.progress import Progress, silent
from ..checkpoints.source import ModelSource, resolve
from ..modeling.weights import weight_specs

LM_HEAD_CHUNK_BYTES = 16 * 2**20  # fp32 rows of W^8 (and D) materialized at once (plus their mapped pages)
# A second correct implementation of the same arithmetic: every matrix product's dot products summed in chunks of
# this many terms, the chunks added last to first. Another order of the same sums, as another runtime's kernel may
# choose; its error to float64 is a second sample of what a correct runtime may differ by (verify parity's noise).
REASSOCIATE_CHUNK = 64


def reassociated_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with the K axis summed in chunks of REASSOCIATE_CHUNK, last chunk first: [.., K] x [N, K] -> [.., N]."""
    k = w.shape[1]
    y = None
    for a in reversed(range(0, k, REASSOCIATE_CHUNK)):
        part = x[..., a:a + REASSOCIATE_CHUNK] @ w[:, a:a + REASSOCIATE_CHUNK].T
        y = part if y is None else y.add_(part)  # in place: y is the first chunk's own product
    assert y is not None, "a matrix product over at least one term"
    return y


def _reassociated_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = reassociated_matmul(x, self.weight)
    return y + self.bias if self.bias is not None else y


_REASSOCIATED: dict[type, type] = {}  # a Linear class -> its subclass whose forward is _reassociated_linear


def reassociate(module: torch.nn.Module) -> torch.nn.Module:
    """MODULE with every Linear computed by reassociated_matmul (the same weights; another order of its sums).

    Each Linear's class is swapped for a subclass that overrides forward. Not a bound method stored on the
    instance (m.forward = MethodType(f, m)): that is a reference cycle, m -> its __dict__ -> the method -> m, so
    a layer and its weights outlived the pass until the cyclic garbage collector ran (verify parity --by-layer
    held up to 4 decoder layers' fp32 weights at 7B width: 0.54x the weights where one layer is 0.1x)."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and type(m) not in _REASSOCIATED.values():
            cls = type(m)
            if cls not in _REASSOCIATED:
                _REASSOCIATED[cls] = type(f"Reassociated{cls.__name__}", (cls,), {"forward": _reassociated_linear})
            m.__class__ = _REASSOCIATED[cls]
    return module


# --- Memory model ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReferenceMemory:
    """Host bytes the fp32 reference needs for a batch; `total` is what `check_fits` compares."""

    weights: int  # resident fp32 weights: the larger half of a decoder layer (streamed) or the whole model (plain)
    head: int  # streamed: one fp32 chunk of lm_head plus the final norm; plain: 0 (inside weights)
    activations: int  # the largest layer's intermediates plus the logits
    kv_cache: int  # fp32 K and V of every layer at the longest length
    tables: int  # RoPE cos/sin for the positions the pass holds them for
    streamed: bool

    @property
    def total(self) -> int:
        return self.weights + self.head + self.activations + self.kv_cache + self.tables


def _attention_half(name: str, cfg: ModelConfig) -> bool:
    """Whether a decoder weight belongs to 6.1-6.2 (input norm, attention) rather than 6.3-6.4."""
    return (".input_layernorm." in name or ".self_attn." in name
            # Gemma 2/3's and OLMo 2's post_attention_layernorm follows attention
            or ((cfg.sandwich_norms or cfg.post_norms) and ".post_attention_layernorm." in name))


def reference_memory(cfg: ModelConfig, batch: int, seq: int, steps: int = 0, streamed: bool = True,
                     itemsize: int = 4) -> ReferenceMemory:
    """The memory model: bytes for a prefill of [batch, seq] followed by `steps` decode steps.

    itemsize: bytes per element of the pass (4 for fp32, 8 for the float64 truth); a plain (not streamed)
    source also holds its whole fp32 model.
    """
    f32 = itemsize
    specs = weight_specs(cfg)
    per_layer = [sum(s.numel for s in specs if s.layer == j) for j in range(cfg.num_hidden_layers)]
    # Streamed: a decoder's two halves are read one after the other (the larger is what is resident).
    per_half = [sum(s.numel for s in specs if s.layer == j and _attention_half(s.name, cfg) == a)
                for j in range(cfg.num_hidden_layers) for a in (True, False)]
    n1, n2, n7 = cfg.vocab_size, cfg.hidden_size, (cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size)
    total = seq + steps
    if streamed:
        weights = max(per_half, default=0) * f32
        head = min(n1 * n2 * f32, max(LM_HEAD_CHUNK_BYTES, n2 * f32)) + n2 * f32
    else:  # the whole model in fp32, plus one layer cast to the pass's dtype when that is wider
        weights, head = sum(s.numel for s in specs) * 4 + (max(per_layer, default=0) * f32 if f32 > 4 else 0), 0
    # One layer's live tensors: z, y, zbar, ybar, r and q/k/v ([b, n3, n2]-sized, ~8), gate/up/act ([b, n3, n7], 3),
    # scores/probs (+ the bias) [b, n5, n3, total] x 3; then the logits [b, n3, n1] (and a chunk's worth again).
    layer_act = batch * seq * (8 * n2 + 3 * n7 + 3 * cfg.num_attention_heads * total)
    activations = (layer_act + batch * seq * n1) * f32
    kv = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * total * cfg.head_dim * f32
    # RoPE cos and sin [length, rotary_dim/2], twice with a local base (Gemma 3): the plain model's cover max_position_embeddings,
    # the streamed reference's grow by doubling from 256 as far as asked (StreamedReference.tables).
    length = cfg.max_position_embeddings if not streamed else \
        max(min(cfg.max_position_embeddings, max(256, 2 * total)), total)
    pairs = 0 if cfg.position_encoding != "rope" else 2 if cfg.rope_local_theta is not None else 1
    tables = pairs * 2 * length * (cfg.rotary_dim // 2) * f32
    return ReferenceMemory(weights, head, activations, kv, tables, streamed)


def available_host_bytes() -> int:
    """MemAvailable: what the kernel can hand out without swapping (psutil when present, else /proc/meminfo)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(need: ReferenceMemory, what: str, extra_bytes: int = 0, available: int | None = None) -> None:
    """Refuse up front, with the figures, when the reference (plus `extra_bytes` beside it) exceeds free memory."""
    available = available_host_bytes() if available is None else available
    want = need.total + extra_bytes
    if want <= available:
        return
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    parts = (f"weights {gib(need.weights + need.head)}, activations {gib(need.activations)}, "
             f"KV cache {gib(need.kv_cache)}" + (f", beside it {gib(extra_bytes)}" if extra_bytes else ""))
    hint = ("a smaller batch, shorter prompts or fewer --steps" if need.streamed
            else "a checkpoint directory, so that the reference streams one layer at a time")
    raise ValueError(f"{what}: the float32 reference needs {gib(want)} of host memory ({parts}) but "
                     f"{gib(available)} is available; try {hint}, or a machine with more memory")


# --- Reading one tensor at a time -----------------------------------------------------------------------

@dataclass(frozen=True)
class _Stored:
    """Where a module-named weight lives: the stored tensor, and which part of a fused q/k/v it is."""

    stored: str
    part: int | None  # None: the whole tensor; else its index among the fused tensor's parts (q/k/v, gate/up)
    parts: int


class CheckpointReader:
    """Module-named fp32 tensors of a checkpoint directory, read on demand from its memory-mapped files.

    Headers are validated up front (names and shapes against the config), no weight is read until asked.
    Files are opened per `read` call and closed after it, so the pages a layer touched are unmapped again.
    """

    def __init__(self, directory: str | Path):
        h = read_checkpoint_headers(directory)
        d, wf, cfg, infos = h.directory, h.files, h.cfg, h.tensors
        self.directory, self.files, self.format = d, wf, h.format
        self.cfg = cfg.replace(rope_layout=self.format.rope_layout)  # as stored
        self.info: dict[str, TensorInfo] = {t.name: t for t in infos}
        self.where: dict[str, _Stored] = {}
        self._parts: dict[str, tuple[str, ...]] = {}  # stored name -> the module weights it holds
        for ct in checkpoint_tensors(cfg, self.format):
            t = self.info.get(ct.name)
            if t is None:
                raise ValueError(f"{d}: tensor {ct.name!r} that the config predicts is in none of "
                                 f"{', '.join(f.name for f in wf.files)}")
            if tuple(t.shape) != ct.shape:
                raise ValueError(f"{d / t.file}: tensor {ct.name!r} has shape {list(t.shape)}, but the config "
                                 f"predicts {list(ct.shape)}")
            for i, part in enumerate(ct.parts):
                self.where[part] = _Stored(ct.name, i if len(ct.parts) > 1 else None, len(ct.parts))
            self._parts[ct.name] = ct.parts
        known = {w.stored for w in self.where.values()}
        extra = [n for n in self.info if n not in known and not n.endswith(BENIGN_SUFFIXES)
                 and not (cfg.tie_word_embeddings and n in ("lm_head.weight", "output.weight"))]
        if extra:
            raise ValueError(f"{d / self.info[extra[0]].file}: tensor {extra[0]!r} is not a weight of the "
                             f"{cfg.family} model that {Path(cfg.source).name} describes")
        self._shard_dim = {s.meta_name: s.meta_shard_dim for s in weight_specs(cfg)} if wf.kind == "meta" else {}
        self.weight_bytes = sum(t.nbytes for t in infos)

    def _paths(self, stored: str) -> list[Path]:
        if self.files.kind == "meta":
            return list(self.files.files)  # every model-parallel shard holds a slice of every tensor
        return [self.directory / self.info[stored].file]

    @contextlib.contextmanager
    def _open(self, stored_names: list[str]) -> Iterator[dict[Path, Any]]:
        """The files holding these tensors, open (memory-mapped) for the duration of the block."""
        from ..checkpoints.load import torch_load

        paths = list(dict.fromkeys(p for n in stored_names for p in self._paths(n)))
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for p in paths:
                if self.files.kind == "safetensors":
                    from safetensors import safe_open

                    handles[p] = stack.enter_context(safe_open(str(p), framework="pt", device="cpu"))
                else:
                    handles[p] = torch_load(p)  # mmap'd dict: only the slices indexed are read
            yield handles
            handles.clear()

    def _slice(self, handles: dict[Path, Any], stored: str, rows: slice | None) -> torch.Tensor:
        """A stored tensor (or a row range of it), Meta shards joined, still in the stored dtype."""
        def get(p: Path, r: slice | None) -> torch.Tensor:
            h = handles[p]
            if self.files.kind == "safetensors":
                return h.get_slice(stored)[r] if r is not None else h.get_tensor(stored)
            return h[stored][r] if r is not None else h[stored]  # a view of the mmap: only these rows are read

        paths = self._paths(stored)
        dim = self._shard_dim.get(stored)
        if len(paths) == 1 or dim is None:
            return get(paths[0], rows)  # one file, or a replicated tensor (norms)
        if dim != 0 or rows is None:
            return torch.cat([get(p, rows) for p in paths], dim=dim)
        pieces, offset = [], 0  # rows split across shards: take each shard's share of start..stop
        for p in paths:
            n = handles[p][stored].shape[0]
            a, b = max(rows.start, offset), min(rows.stop, offset + n)
            if a < b:
                pieces.append(get(p, slice(a - offset, b - offset)))
            offset += n
        return torch.cat(pieces, dim=0)

    def read(self, names: list[str], device: Any = "cpu") -> dict[str, torch.Tensor]:
        """Module-named weights as fp32 tensors that own their memory (the files are closed on return)."""
        stored = list(dict.fromkeys(self.where[n].stored for n in names))
        out = {}
        with self._open(stored) as handles:
            for s in stored:  # one stored tensor in flight at a time
                t = self._slice(handles, s, None)
                for n in (n for n in names if self.where[n].stored == s):
                    part = self.where[n].part
                    piece = t if part is None else split_parts(
                        t, self._parts[s], self.format.fused_qkv or "", self.cfg, s)[part]
                    out[n] = self._owned(piece, device)
                del t
        return out

    def stored_tensor(self, name: str) -> torch.Tensor:
        """A tensor under its stored name (the checkpoint's own), in fp32, as stored: no layout applied."""
        if name not in self.info:
            raise KeyError(f"{self.directory}: no tensor {name!r}")
        with self._open([name]) as handles:
            return self._owned(self._slice(handles, name, None), "cpu")

    def _owned(self, t: torch.Tensor, device: Any, fresh: bool = False) -> torch.Tensor:
        """fp32 on `device`, never a view of a mapped file: copied unless `fresh` (made here, e.g. by torch.cat).

        Neither torch's mmap'd load nor safetensors' get_tensor/get_slice copies (safetensors >= 0.8 serves
        tensors straight from its memory map, a slice's storage being the whole tensor): a view kept a mapping of
        the file, and the pages it touched in RSS, for as long as the tensor lived."""
        copy = not fresh and torch.device(device).type == "cpu"  # a dtype or device change copies anyway
        return t.to(device=device, dtype=torch.float32, copy=copy)

    def rows(self, name: str, ranges: list[tuple[int, int]], device: Any = "cpu") -> torch.Tensor:
        """Row ranges [start, stop) of a module-named 2-D weight (embedding, lm_head), joined, in fp32; `name` may
        be the stored name of an unfused one too (GPT-NeoX's gpt_neox.embed_in, as transformers names it)."""
        w = self.where[name] if name in self.where or name not in self.info else _Stored(name, None, 1)
        if len(ranges) == 1:
            with self._open([w.stored]) as handles:
                return self._owned(self._slice(handles, w.stored, slice(*ranges[0])), device)  # [rows, n2]
        out = torch.empty(sum(b - a for a, b in ranges), self.cfg.hidden_size, device=device)  # [sum of rows, n2]
        i = 0
        for group in _within(ranges, max(1, LM_HEAD_CHUNK_BYTES // (4 * self.cfg.hidden_size))):
            # The file mapped for one span at a time: scattered rows (the KL probes' 24,576 candidates of Gemma's
            # 262,144) would otherwise fault the whole tensor's pages in, and read-ahead's, under one mapping.
            with self._open([w.stored]) as handles:
                for a, b in group:
                    out[i:i + b - a].copy_(self._slice(handles, w.stored, slice(a, b)))
                    i += b - a
        return out


def _within(ranges: list[tuple[int, int]], span: int) -> Iterator[list[tuple[int, int]]]:
    """Row ranges in groups, each group's rows within `span` rows of its first (or one range longer than that)."""
    group: list[tuple[int, int]] = []
    for a, b in ranges:
        if group and b - group[0][0] > span:
            yield group
            group = []
        group.append((a, b))
    if group:
        yield group


def open_reader(path: str | Path) -> Any:
    """The tensor reader for a checkpoint: a directory's files, or one GGUF file (dequantized per tensor)."""
    from ..checkpoints.gguf.read import is_gguf
    from ..checkpoints.gguf.tensors import GgufReader

    return GgufReader(path) if is_gguf(path) else CheckpointReader(path)


class StateReader:
    """The reader interface (`cfg`, `read`, `rows`) over a model already in memory: a seeded source's weights."""

    def __init__(self, model: Any):
        self.cfg = model.cfg
        self.state = dict(model.state_dict())  # module-named, fp32; a tied lm_head is the embedding itself
        self.weight_bytes = sum(t.nbytes for t in {id(t): t for t in self.state.values()}.values())

    def read(self, names: list[str], device: Any = "cpu") -> dict[str, torch.Tensor]:
        return {n: self.state[n].to(device=device, dtype=torch.float32) for n in names}

    def rows(self, name: str, ranges: list[tuple[int, int]], device: Any = "cpu") -> torch.Tensor:
        w = self.state[name]
        return torch.cat([w[a:b] for a, b in ranges]).to(device=device, dtype=torch.float32)  # [sum of rows, n2]


# --- The streamed forward --------------------------------------------------------------------------------

@dataclass
class StreamTimes:
    """Where the reference's time goes, summed over passes."""

    read: float = 0.0  # reading weights and casting them to fp32
    compute: float = 0.0  # the layers, the norm, the lm_head
    layers: int = 0  # layer passes run (prefill and each decode step count n8 each)
    passes: int = 0
    per_pass: list[float] = field(default_factory=list)


class StreamedReference:
    """Callable like `Llama`: (input_ids, attention_mask, position_ids, past_key_values) -> CausalLMOutput.

    Weights come from `CheckpointReader` half a decoder layer at a time (attention, then feed-forward); `progress(j, n8)` after each layer.
    """

    def __init__(self, directory: str | Path | Any, *, device: Any = "cpu", progress: Progress = silent,
                 dtype: torch.dtype = torch.float32, reassociated: bool = False):
        # A directory or GGUF file to open, or a reader already open (shared by the passes of several dtypes).
        self.reader = open_reader(directory) if isinstance(directory, (str, Path)) else directory
        self.cfg = self.reader.cfg
        self.device = torch.device(device)
        self.dtype = dtype  # each layer's weights are cast to it as they stream: fp32, fp16, bf16 or float64
        self.reassociated = reassociated  # matrix products summed in another order (reassociated_matmul)
        self.progress = progress
        self.times = StreamTimes()
        self._rope: RopeTables | None = None  # made for the positions a pass reaches (tables())
        self._final_norm: torch.nn.Module | None = None  # RMSNorm or LayerNorm

    def tables(self, positions: int) -> RopeTables | None:
        """RoPE tables for positions 0..positions-1 at least, in fp32 as the model keeps them (float64 for a float64
        truth): grown by doubling, never past max_position_embeddings (Gemma 3's 32,768 x 2 tables would be 67 MB
        held for a 192-token pass)."""
        if per_pass(self.cfg):  # dynamic, longrope: the tables of this pass's length (rope.py), never reused
            dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            return rope_tables_of(self.cfg, self.device, dtype, length=positions, seq_len=positions)
        have = 0 if self._rope is None else self._rope[0].shape[0]
        if self._rope is None or have < positions:
            length = min(max(positions, 2 * have, 256), self.cfg.max_position_embeddings)
            length = max(length, positions)  # past max_position_embeddings: as far as asked, as the model's own would fail
            dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            self._rope = rope_tables_of(self.cfg, self.device, dtype, length=length)
        return self._rope

    def eval(self) -> "StreamedReference":
        return self

    def with_dtype(self, dtype: torch.dtype, reassociated: bool = False) -> "StreamedReference":
        """The same weights (the same open reader), another arithmetic: e.g. the float64 truth beside fp32."""
        return StreamedReference(self.reader, device=self.device, progress=self.progress, dtype=dtype,
                                 reassociated=reassociated)

    def _half(self, j: int, attention: bool) -> DecoderLayer:
        """Decoder j with one half's weights (the attention's, or the feed-forward's) read, the other half left
        on the meta device: built there first, so nothing random is allocated either."""
        prefix = f"model.layers.{j}."
        names = [s.name for s in weight_specs(self.cfg) if s.layer == j and (
            _attention_half(s.name, self.cfg) == attention
            or (not attention and self.cfg.shared_norm and ".input_layernorm." in s.name))]  # Falcon's one norm
        state = {n: t.to(self.dtype) for n, t in self.reader.read(names, self.device).items()}
        with torch.device("meta"):
            layer = DecoderLayer(self.cfg, j)
        layer.load_state_dict({n.removeprefix(prefix): t for n, t in state.items()}, strict=False, assign=True)
        return reassociate(layer.eval()) if self.reassociated else layer.eval()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Z^0: only the rows of D the ids name are read; [b, n3] -> [b, n3, n2]."""
        uniq, inverse = torch.unique(input_ids, return_inverse=True)
        rows = self.reader.rows("model.embed_tokens.weight", [(int(i), int(i) + 1) for i in uniq], self.device)
        z = rows.to(self.dtype)[inverse]  # [n_unique, n2] gathered to [b, n3, n2]
        return embedding_scale(self.cfg, z)  # Gemma's sqrt(n2), Granite's multiplier, as the model's embed

    @torch.no_grad()
    def head(self, zbar: torch.Tensor) -> torch.Tensor:
        """H = Zbar W^{8 T}, finished as the model finishes it (final_logits): [..., n2] -> [..., n1]."""
        return self._head(zbar)

    def _head(self, zbar: torch.Tensor) -> torch.Tensor:
        """H = Zbar W^{8 T}, W^8 read in row chunks of LM_HEAD_CHUNK_BYTES: [b, n3, n2] -> [b, n3, n1]."""
        return torch.cat(list(self.head_slabs(zbar)), dim=-1)

    @torch.no_grad()
    def head_slabs(self, zbar: torch.Tensor) -> Iterator[torch.Tensor]:
        """H's columns a row chunk of W^8 (LM_HEAD_CHUNK_BYTES) at a time, in vocabulary order, finished as the
        model finishes them (final_logits works on any slab of columns): [..., n2] -> [..., rows] each."""
        cfg = self.cfg
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        step = max(1, LM_HEAD_CHUNK_BYTES // (4 * cfg.hidden_size))
        for a in range(0, cfg.vocab_size, step):
            t0 = time.perf_counter()
            w = self.reader.rows(name, [(a, min(a + step, cfg.vocab_size))], self.device)  # [rows, n2]
            w = w.to(self.dtype)
            t1 = time.perf_counter()
            if cfg.norm_head:
                w = F.normalize(w, dim=-1)  # row-wise, so chunking does not change it
            h = reassociated_matmul(zbar, w) if self.reassociated else zbar @ w.T  # [..., rows]
            self.times.read += t1 - t0
            self.times.compute += time.perf_counter() - t1
            yield final_logits(cfg, h)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None, *,
                 hidden: bool = False) -> CausalLMOutput:
        """The same contract and arithmetic as Llama.forward, in the reference's dtype.

        hidden: `logits` is the final norm's output Zbar [b, n3, n2] instead, for a caller that applies the head a
        few positions at a time (`head`): a 262,144-token vocabulary's logits are 1 MB per position."""
        start = time.perf_counter()
        cfg, dev = self.cfg, self.device
        input_ids = input_ids.to(dev)
        attention_mask = attention_mask.to(dev) if attention_mask is not None else None
        b, n3 = input_ids.shape
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        position_ids = (position_ids if position_ids is not None else positions(input_ids, attention_mask, past)).to(dev)
        t0 = time.perf_counter()
        z = self._embed(input_ids)  # Z^0: [b, n3, n2]
        self.times.read += time.perf_counter() - t0
        # The mask is built in fp32 for a float64 pass (its fill value is fp32's minimum; ALiBi's slopes are fp32).
        tables = self.tables(int(position_ids.max()) + 1 if position_ids.numel() else 1)
        masks = {s: m.to(z.dtype) for s, m in layer_masks(
            cfg, n3, past, attention_mask, torch.float32 if z.dtype == torch.float64 else z.dtype, z.device).items()}
        presents = []
        for j in range(cfg.num_hidden_layers):
            z_in = z  # Z^j: the parallel form's FFN reads it too
            for attention in (True, False):  # one half's weights resident at a time: read, run, free
                t0 = time.perf_counter()
                half = self._half(j, attention)
                t1 = time.perf_counter()
                if attention:
                    z, present = half.attend(z, masks[half.sliding], position_ids,
                                             layer_tables(tables, half.sliding),
                                             past_key_values[j] if past_key_values else None)  # Y^j (or R^j)
                else:
                    z = half.feed_forward(z, z_in)  # Z^{j+1}
                del half
                self.times.read += t1 - t0
                self.times.compute += time.perf_counter() - t1
            self.times.layers += 1
            presents.append(present)
            self.progress(j + 1, cfg.num_hidden_layers, "reference layer (streamed)")
        if self._final_norm is None:
            with torch.device("meta"):
                self._final_norm = norm(cfg)
            names = [s.name for s in weight_specs(cfg) if s.component == "final_norm"]  # γ (and LayerNorm's β)
            self._final_norm.load_state_dict({n.removeprefix("model.norm."): t.to(self.dtype) for n, t in
                                              self.reader.read(names, dev).items()}, assign=True)
        logits = self._final_norm(z) if hidden else self._head(self._final_norm(z))  # Zbar [b, n3, n2] / H [b, n3, n1]
        self.times.passes += 1
        self.times.per_pass.append(time.perf_counter() - start)
        return CausalLMOutput(logits=logits, past_key_values=tuple(presents))

    forward = __call__


def reference_model(source: Any, *, seed: int = 0, progress: Progress = silent, device: Any = "cpu",
                    batch: int = 1, seq: int = 1, steps: int = 0, extra_bytes: int = 0,
                    available: int | None = None, dtype: torch.dtype = torch.float32,
                    float64_pass: bool = False) -> "StreamedReference":
    """The reference for `verify parity`, one decoder layer at a time, in `dtype` (`.with_dtype` for another).

    Streamed from a checkpoint directory; a seeded source is built in fp32 in memory and read layer by layer
    the same way. Refuses up front (ValueError with the figures) when the memory model says it will not fit
    beside `extra_bytes` (e.g. an onnxruntime CPU session's weights) in the host memory available;
    `float64_pass`: sized for a float64 pass too (8 bytes an element).
    """
    from ..checkpoints.loading import load_model

    itemsize = 8 if float64_pass else max(4, torch.finfo(dtype).bits // 8)
    if not isinstance(source, ModelConfig):
        source = resolve(source)
    if isinstance(source, ModelSource) and source.weights is not None:
        assert source.path is not None, "a checkpoint source has a path"
        ref = StreamedReference(source.path, device=device, progress=progress, dtype=dtype)
        if str(device) == "cpu":
            check_fits(reference_memory(ref.cfg, batch, seq, steps, streamed=True, itemsize=itemsize), str(source),
                       extra_bytes, available)
        return ref
    model = load_model(source, dtype="float32", device="meta", seed=seed)  # shapes only: size it first
    if str(device) == "cpu":
        check_fits(reference_memory(model.cfg, batch, seq, steps, streamed=False, itemsize=itemsize), model.cfg.name,
                   extra_bytes, available)
    model = load_model(source, dtype="float32", device=device, seed=seed)
    return StreamedReference(StateReader(model), device=device, progress=progress, dtype=dtype)
