"""The source check: our reading of a checkpoint against the checkpoint's own library, layer by layer.

Every other check compares a graph with our reference, and our reference reads the checkpoint with our own config
reader: a misread (a key in a layout we half-know) would make the export, the reference and the verdict agree on
the wrong model. Here transformers reads the same directory itself (AutoConfig on its config.json, its own module
tree, the tensors under its own names) and runs the same inputs:

    transformers (fp32, eager):  embed ----> layer 0 ----> ... ----> layer n8-1 ----> norm, lm_head
                                   |           ^   |                    ^   |           ^        |
                                   v           |   v                    |   v           |        v
    our reference (float64):    Z^0 --------> Z^1 -------> ... -------> Z^n8 ----------+     logits
                                (each of transformers' blocks fed our float64 input to it, rounded to fp32)

Each block is judged as `verify parity --by-layer` judges a graph: error = RMS |transformers - our float64|,
noise = the larger RMS |our fp32 - our float64| of two correct implementations; pass when error <= 8 x noise +
1 ulp. A misread shows as an error hundreds of times the noise at the first layer it touches. Both sides stream:
transformers' skeleton has its parameters on the meta device and each block's weights are read from the files
as it runs and dropped after, beside one layer of ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llama_tools.modeling import dtypes
from llama_tools.modeling.families import FAMILIES
from llama_tools.outputs.progress import Progress, bound_heap, release_freed_memory, silent

from .by_layer import EMBEDDING, HEAD, BlockResult, LayerReference, per_channel
from .compare import BUDGET, Budget, BudgetCheck, JudgeSums, judge
from ..prompts import left_pad, positions

F32 = dtypes.FLOAT32.name
# A GGUF's library is llama.cpp: its logits against our float64 reference on the same (dequantized) weights, within
# what llama.cpp's own arithmetic costs at the file's weight type, measured (relative RMS of the logits) with the
# child's F32 KV cache and no flash attention (llamacpp_child): F32 files 9.7e-8 to 9.1e-7 on 13 seeded SiLU models
# (Llama, Mistral, Mixtral, Qwen 2/3, Qwen3-MoE, Granite, SmolLM3, OLMo 2, Phi-3, tiny) and 8.4e-7 on the real
# SmolLM2-135M in F32, bounded at 2e-5, 20x the largest (the default F16 cache made them 2.4e-5 to 1.5e-3, SmolLM2
# 5.2e-4: past the 5e-4 bound it had); F16 7.4e-4, BF16 7.4e-3 (activations rounded to the weights' type), quantized
# ones 3.6e-2 (activations quantized to 8 bits: SmolLM2 Q4_1 3.4e-2, Gemma 3 270M Q4_K_M 3.8e-2, Qwen2.5 0.5B
# Q4_K_M 1.4e-2 with the F32 cache; within a tenth of that with F16's), bounds kept. A misread is far past these:
# Gemma 3's global base swapped 0.30, its local base 0.26, its layer pattern lost 0.32, Gemma's (1 + gain) lost 0.96,
# two q/k/v rows swapped 0.33 to 0.81; Llama 3.1's scaling lost 6.4e-4, a Qwen3-MoE RoPE base 0.1% off 2.3e-4 (seen
# in F32 files only).
LLAMACPP_TOLERANCE = {"F32": 2e-5, "F16": 5e-3, "BF16": 3e-2, "quantized": 0.1}
# What llama.cpp computes otherwise than transformers (and our reference), allowed on top of the file's bound: its CPU
# GELU is the tanh form read through an FP16 table (GGML_GELU_FP16: the input rounded to FP16), where transformers'
# "gelu" is erf's exact one and "gelu_pytorch_tanh" the tanh form in fp32. Measured with an F32 cache: GPT-NeoX and
# Falcon ("gelu", 5 tiny layouts) 1.5e-4 to 2.2e-4; Gemma 2 / 3 ("gelu_tanh") 9.8e-5 tiny, 3.3e-4 on the real Gemma 3
# 270M (Q4_K_M's weights stored as F32; 3.4x its tiny model's, so a real NeoX / Falcon, not measured here, may sit
# past 2.2e-4 too). 1e-3: 3x the largest measured, still 5x under a norm eps misread x10 (5.3e-3 on NeoX / Falcon).
# SiLU is computed alike: no allowance.
ACTIVATION_ALLOWANCE = {"gelu": 1e-3, "gelu_tanh": 1e-3}
ACTIVATION_WHY = {"gelu": "its GELU is the tanh form read through an FP16 table, transformers' the exact erf form: "
                          "1.5e-4 to 2.2e-4 measured on tiny GPT-NeoX and Falcon models",
                  "gelu_tanh": "its tanh GELU is read through an FP16 table, transformers' computed in fp32: 9.8e-5 "
                               "measured on tiny Gemma 2 and 3 models, 3.3e-4 on Gemma 3 270M"}
HEAD_POSITIONS = 16  # positions the head is compared at: each row's last (its padding left out)


@dataclass
class SourceReport:
    """Our reading of a checkpoint against its own library: one result per block, or why it was not checked."""

    source: str
    library: str  # "transformers 4.57.6", or "" when none could read it
    reason: str  # why the reading was not checked ("" when it was)
    budget: Budget
    blocks: list[BlockResult] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    mismatch: str = ""  # a structural difference found before any number: a tensor one side has and the other not

    @property
    def checked(self) -> bool:
        return not self.reason

    @property
    def passed(self) -> bool:
        return not self.mismatch and all(b.passed for b in self.blocks)

    @property
    def first_bad(self) -> str | None:
        """'layer 3', 'the embedding', 'the logits', a tensor's name; None when our reading agrees."""
        if self.mismatch:
            return self.mismatch
        bad = next((b for b in self.blocks if not b.passed), None)
        if bad is None:
            return None
        return {EMBEDDING: "the embedding", HEAD: "the logits"}.get(bad.name, bad.name)

    @property
    def headline(self) -> str:
        """One line: what was compared, or why not."""
        if not self.checked:
            return f"source check: not run: {self.reason}"
        how = "" if self.library.startswith("llama.cpp") else " (fp32, eager attention)"
        return f"source check: our reading of {self.source} against {self.library}{how}"

    @property
    def summary(self) -> str:
        """Its figures in a few words: how many blocks agreed, and the worst ratio to the noise against its bound."""
        checks = [c for b in self.blocks for c in b.checks]
        if len(checks) == 1 and isinstance(checks[0], ToleranceCheck):
            return f"{'agrees' if self.passed else 'differs'}: {checks[0].figures()}"
        worst = max(checks, key=lambda c: c.ratio if math.isfinite(c.ratio) else math.inf)
        verdict = "agrees" if self.passed else "differs"
        return (f"{verdict} in all {len(self.blocks)} blocks, at most {worst.ratio:.2g}x the noise (bound "
                f"{worst.allowed_ratio:.3g}x)")

    @property
    def failure(self) -> str:
        """The FAIL line's words (empty when it passes or did not run)."""
        if self.passed:
            return ""
        where = "" if self.library.startswith("llama.cpp") else f", from {self.first_bad} on"
        return (f"our reading of the checkpoint differs from what {self.library.split()[0]} computes{where} (the "
                f"source check): the reference, and any graph judged against it, computes another model")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "library": self.library, "checked": self.checked, "reason": self.reason,
                "passed": self.passed, "first_bad": self.first_bad, "mismatch": self.mismatch,
                "blocks": [{"name": b.name, "layer": b.layer, "passed": b.passed,
                            "checks": [c.to_dict() for c in b.checks]} for b in self.blocks],
                "seconds": self.seconds, "notes": self.notes}


def not_checked(source: Any, reason: str) -> SourceReport:
    return SourceReport(str(getattr(source, "spec", source)), "", reason, BUDGET[F32])


# --- transformers' side ------------------------------------------------------------------------------------

def _library(source: Any) -> tuple[Any, Any, str] | str:
    """(transformers, its config of the source, how it was read), or the reason the source cannot be checked."""
    try:
        import transformers
    except ImportError:
        return ("transformers is not installed, so our reading of the checkpoint is not checked against its own "
                "library (pip install 'llama-tools[hf]')")
    try:
        import accelerate  # noqa: F401  (transformers' skeleton with its parameters on the meta device)
    except ImportError:
        return "accelerate is not installed (transformers needs it to build a model without its weights)"
    from llama_tools.checkpoints.config_files import config_to_hf

    cfg = source.cfg
    if getattr(source, "kind", None) == "checkpoint" and source.path is not None:
        if not (source.path / "config.json").is_file():
            return f"{source.path} holds Meta's params.json, which transformers does not read"
        model_type = FAMILIES[cfg.family].model_types[0]
        if model_type not in transformers.CONFIG_MAPPING:
            return (f"transformers {transformers.__version__} has no code of its own for {cfg.family} (its "
                    f"checkpoints carry remote code, which llama-tools never runs)")
        written = _written_by(source.path / "config.json")
        installed = int(transformers.__version__.split(".")[0])
        if written is not None and written[1] and installed < 5:
            return (f"{source.path / 'config.json'} was written by transformers {written[0]} (rope_parameters), a "
                    f"layout the installed {transformers.__version__} does not read; install transformers >= 5 to "
                    f"check it")
        try:
            hf_cfg = transformers.AutoConfig.from_pretrained(str(source.path), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001  (any refusal of the library's is a reason, shown in one line)
            return f"transformers cannot read {source.path / 'config.json'}: {str(e).splitlines()[0][:200]}"
        return transformers, hf_cfg, f"read {source.path / 'config.json'} itself"
    d = config_to_hf(cfg)
    model_type = d.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no code of its own for {cfg.family}"
    return (transformers, transformers.AutoConfig.for_model(model_type, **d),
            f"was given {source.spec}'s config as llama-tools writes it (no checkpoint: seeded weights)")


def _version(transformers: Any) -> tuple[int, int]:
    return tuple(int(x) for x in transformers.__version__.split(".")[:2])  # type: ignore[return-value]


def _written_by(path: Any) -> tuple[str, bool] | None:
    """(the transformers version a config.json names, whether it is in 5.x's rope_parameters layout)."""
    from llama_tools.checkpoints.config_files import read_json

    try:
        data = read_json(path)
    except ValueError:
        return None
    return str(data.get("transformers_version", "?"))[:20], "rope_parameters" in data


class _Stream:
    """transformers' model with its parameters on the meta device; a module's weights read as it runs, then dropped."""

    def __init__(self, transformers: Any, hf_cfg: Any, tensor: Callable[[str], Any]):
        import torch
        from accelerate import init_empty_weights

        # transformers 4.56 renamed torch_dtype to dtype
        dtype_key = "dtype" if _version(transformers) >= (4, 56) else "torch_dtype"
        with init_empty_weights(include_buffers=False):  # buffers (RoPE's inv_freq, Gemma's scale) computed for real
            self.model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager",
                                                                       **{dtype_key: torch.float32}).eval()
        self.tensor = tensor
        self.names: dict[int, str] = {}  # a tied parameter keeps its first name (the embedding's)
        for n, p in self.model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), n)

    def params(self, module: Any) -> list[tuple[Any, str, str]]:
        """(owner module, attribute, full parameter name) of each parameter under `module`."""
        out = []
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is not None:
                    out.append((sub, attr, self.names[id(p)]))
        return out

    @contextlib.contextmanager
    def loaded(self, module: Any, read: Callable[[str], Any] | None = None, name: str | None = None) -> Any:
        """module's weights from the files (fp32) for the duration of the block, then back on the meta device.

        read: how to read them (default: whole tensors); name: the one tensor a single-parameter module reads
        (a tied lm_head reads the embedding's).
        """
        import torch

        saved = []
        for sub, attr, own in self.params(module):
            t = (read or self.tensor)(name or own)
            saved.append((sub, attr, sub._parameters[attr]))
            sub._parameters[attr] = torch.nn.Parameter(t.to(torch.float32), requires_grad=False)
        try:
            yield
        finally:
            for sub, attr, p in saved:
                sub._parameters[attr] = p


def _tensor_reader(ref: Any) -> tuple[Callable[[str], Any], set[str], set[str]]:
    """name -> fp32 tensor under the checkpoint's own (transformers') names; the names the files hold; the names
    our reading reads."""
    reader = ref.reader
    if hasattr(reader, "stored_tensor"):
        return reader.stored_tensor, set(reader.info), {w.stored for w in reader.where.values()}
    return (lambda name: reader.read([name])[name]), set(reader.state), set(reader.state)


# --- The check -----------------------------------------------------------------------------------------------

def check_source(source: Any, rows: list[list[int]], *, seed: int = 0, progress: Progress = silent,
                 budget: Budget | None = None, batches: list[list[list[int]]] | None = None) -> SourceReport:
    """Our float64 reference against transformers on the same rows, block by block (see the module's sketch);
    `batches`: the rows as padded batches of their own (default: one), each block judged over all of them."""
    import torch

    from llama_tools.inference.reference import reference_model

    if getattr(source, "kind", None) == "checkpoint" and source.path is not None and not source.path.is_dir():
        return check_gguf(source, rows, progress=progress)
    got = _library(source)
    if isinstance(got, str):
        return not_checked(source, got)
    transformers, hf_cfg, how = got
    start = time.perf_counter()
    bound_heap()  # its many-MB temporaries' pages go back as they are freed (progress.py)
    budget = budget or BUDGET[F32]
    library = f"transformers {transformers.__version__}"
    # The smallest batches first: their blocks' valid positions wait for the last batch's (judged as it runs).
    padded = sorted((left_pad(b) for b in (batches or [rows])), key=lambda p: p[0].size)
    widest = padded[-1][0].shape
    ref = reference_model(source, seed=seed, batch=widest[0], seq=widest[1], float64_pass=True)
    tensor, held, ours = _tensor_reader(ref)
    stream = _Stream(transformers, hf_cfg, tensor)
    report = SourceReport(str(getattr(source, "spec", source)), library, "", budget,
                          notes=[f"transformers {how}; each of its blocks fed our float64 input to it (in "
                                 f"fp32); error = RMS |transformers - our float64|, noise = the larger RMS |our fp32 "
                                 f"- float64| of two correct implementations; pass when error <= "
                                 f"{budget.multiple:g} x noise + {budget.floor_ulps:g} ulp"])
    tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
    head = stream.model.get_output_embeddings()
    embed_name = stream.names[id(stream.model.get_input_embeddings().weight)]
    head_name = embed_name if tied else stream.names[id(head.weight)]
    wanted = {n for n in stream.names.values() if not (tied and n == stream.names[id(head.weight)])}
    missing = [n for n in stream.names.values() if n in wanted and n not in held]  # in the model's own order
    if missing:
        report.mismatch = (f"transformers' {type(stream.model).__name__} has a weight {missing[0]!r} that the "
                           f"checkpoint does not hold ({len(missing)} such)")
    unread = sorted(ours - wanted - ({embed_name.replace("model.embed_tokens", "lm_head")} if tied else set()))
    if unread and not report.mismatch:
        report.mismatch = (f"the checkpoint's tensor {unread[0]!r} is read by llama-tools but not by transformers' "
                           f"{type(stream.model).__name__} ({len(unread)} such)")
    if report.mismatch:
        report.seconds = time.perf_counter() - start
        return report

    truth, noise, alt = (LayerReference(ref.reader, torch.float64), LayerReference(ref.reader, torch.float32),
                         LayerReference(ref.reader, torch.float32, reassociated=True))
    f64 = lambda t: t.detach().to(torch.float64).numpy()  # noqa: E731
    n8 = ref.cfg.num_hidden_layers
    # The batch running now: ids, mask, valid positions, our float64 Z^j (advanced one layer per transformers'),
    # and each block's valid positions from the batches before (name -> [(transformers, float64, fp32, fp32 alt)]).
    state: dict[str, Any] = {}
    earlier: dict[str, list[tuple[np.ndarray, ...]]] = {}

    def judged(name: str, got_t: Any, t: Any, r: Any, a: Any, hidden: bool) -> BudgetCheck | None:
        """The block's check over every batch's valid positions, once the last batch has run (before: None)."""
        v = torch.from_numpy(state["valid"][:, -got_t.shape[1]:])
        f32 = lambda x: x.detach().to(torch.float32)[v].numpy()  # noqa: E731  [P, n2]: the valid positions only
        parts = earlier.setdefault(name, [])
        parts.append((f32(got_t), t.detach().to(torch.float64)[:, -got_t.shape[1]:][v].numpy(),
                      f32(r[:, -got_t.shape[1]:]), f32(a[:, -got_t.shape[1]:])))
        if not state["last"]:
            return None
        g, tt, rr, aa = (np.concatenate([x[i] for x in parts])[None] for i in range(4))  # [1, P, n2]
        del earlier[name]
        ones = np.ones(g.shape[:2], bool)
        if hidden:
            g, rr, aa, tt = per_channel(g.astype(np.float64), tt, ones, rr.astype(np.float64), aa.astype(np.float64))
        return judge(name, g, (rr, aa), tt, ones, F32, budget, logits=not hidden)

    def judged_block(block: str, j: int | None, *args: Any) -> None:
        check = judged(*args)
        if check is not None:
            report.blocks.append(BlockResult(block, j, [check]))

    model = stream.model
    base, stack, last = FAMILIES[ref.cfg.family].hf_modules  # model.layers, gpt_neox.layers, transformer.h, ...
    inner = getattr(model, base)
    embed, layers, final_norm = model.get_input_embeddings(), getattr(inner, stack), getattr(inner, last)

    def embed_pre(m: Any, args: tuple) -> tuple:
        return (torch.from_numpy(state["inverse"]),) + tuple(args[1:])  # the rows the batch uses, gathered once

    def layer_pre(j: int) -> Callable[..., Any]:
        def hook(m: Any, args: tuple, kwargs: dict) -> tuple:
            if j == 0:  # transformers' own Z^0: what its embedding and any scale of the family's made of the ids
                z = state["z"]
                z0 = args[0] if args else kwargs["hidden_states"]
                r = noise.embed(state["ids"])  # ours in fp32 (Gemma's sqrt(n2) rounded as the dtype rounds it)
                judged_block(EMBEDDING, None, "embedding Z^0", z0, z, r, r, True)
            stack = contextlib.ExitStack()
            stack.enter_context(stream.loaded(m))
            m._source_stack = stack
            z_in = state["z"].to(torch.float32)
            if args:
                args = (z_in,) + tuple(args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": z_in}
            return args, kwargs
        return hook

    def layer_post(j: int) -> Callable[..., None]:
        def hook(m: Any, args: tuple, kwargs: dict, out: Any) -> None:
            m._source_stack.close()
            del m._source_stack
            hf = out[0] if isinstance(out, tuple) else out
            z, mask = state["z"], state["mask"]
            t, _, _ = truth.layer(j, z, mask)
            r, _, _ = noise.layer(j, z.to(torch.float32), mask)
            a, _, _ = alt.layer(j, z.to(torch.float32), mask)
            judged_block(f"layer {j}", j, f"layer {j} hidden Z^{j + 1}", hf, t, r, a, True)
            state["z"] = t
            progress(state["done"] + j + 1, n8 * len(padded), "source check")
        return hook

    def norm_pre(m: Any, args: tuple) -> tuple:
        return (state["z"].to(torch.float32),) + tuple(args[1:])

    rows_of = lambda name, ranges: ref.reader.rows(name, ranges)  # noqa: E731  (row ranges from the files)
    embed_rows = lambda name: rows_of(embed_name, [(int(i), int(i) + 1) for i in state["uniq"]])  # noqa: E731
    handles = [embed.register_forward_pre_hook(embed_pre), final_norm.register_forward_pre_hook(norm_pre)]
    assert type(head) is torch.nn.Linear and head.bias is None, f"{type(model).__name__}'s head is a plain Linear"
    model.set_output_embeddings(slab_head(lambda a, b: rows_of(head_name, [(a, b)]), head.out_features))
    assert model.get_output_embeddings() is not head, "transformers' head replaced by the slabbed one"
    for j, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(layer_pre(j), with_kwargs=True))
        handles.append(layer.register_forward_hook(layer_post(j), with_kwargs=True))
    # The head is the same function at every position: each row's last HEAD_POSITIONS (padding left out) show
    # any misread of it, at a fraction of the vocabulary-wide logits' memory.
    keeps = [min(HEAD_POSITIONS, ids.shape[1]) for ids, _ in padded]
    forward = inspect.signature(model.forward).parameters
    keep_key = "logits_to_keep" if "logits_to_keep" in forward else "num_logits_to_keep"
    heads = JudgeSums(sum(int(mask[:, -k:].sum()) for (_, mask), k in zip(padded, keeps)), 2, logits=True)
    first = nonfinite = 0
    padding_idx = getattr(embed, "padding_idx", None)
    embed.padding_idx = None  # only gradients read it, and the gathered table has fewer rows than its index
    try:
        for n, ((ids, mask), keep) in enumerate(zip(padded, keeps)):
            uniq, inverse = np.unique(ids, return_inverse=True)
            state.update(ids=ids, mask=mask, valid=mask.astype(bool), uniq=uniq, inverse=inverse.reshape(ids.shape),
                         z=truth.embed(ids), last=n == len(padded) - 1, done=n * n8)
            with torch.no_grad(), stream.loaded(embed, read=embed_rows), stream.loaded(final_norm):
                out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                            position_ids=torch.from_numpy(positions(mask, ids.shape[1])), use_cache=False,
                            **{keep_key: keep})
            v = torch.from_numpy(state["valid"][:, -keep:])
            logits = out.logits[:, -keep:]  # [b, keep, n1]: transformers' own
            del out
            release_freed_memory()  # transformers' forward is over: its pages back before our heads'
            nonfinite += head_sums(heads, first, logits, v, state["z"][:, -keep:][v], (truth, noise, alt))
            first += int(v.sum())
            del logits
    except (RuntimeError, ValueError, TypeError, AssertionError, IndexError, KeyError, AttributeError) as e:
        # transformers' own code failing on this checkpoint says nothing of our reading: not checked, and why
        return not_checked(source, f"{library} failed to run it: {type(e).__name__}: "
                                   f"{(str(e).splitlines() or [''])[0][:200]}")
    finally:
        embed.padding_idx = padding_idx
        for h in handles:
            h.remove()
    del stream
    assert first == heads.positions, f"the head judged {first} positions of {heads.positions}"
    report.blocks.append(BlockResult(HEAD, None, [heads.check(f"logits (from Z^n8, last {max(keeps)} positions)",
                                                              F32, budget, nonfinite)]))
    report.seconds = time.perf_counter() - start
    return report


SLAB_BYTES = 16 * 2**20  # lm_head rows read at a time by the source check's head


def head_sums(sums: JudgeSums, first: int, got: Any, valid: Any, z: Any, sides: tuple[Any, Any, Any]) -> int:
    """transformers' logits got [b, n3, n1] at the valid [b, n3] positions against ours from float64's Z^n8 there
    (z [P, n2]), added to `sums` as positions first.. on; ours made a slab of vocabulary rows at a time (each row
    read once for the three sides) and each slab added as it is made: a 262,144-piece vocabulary's float64 logits
    are never whole. sides: (float64, fp32, fp32 reassociated). Returns the NaN/Inf count of got."""
    import torch

    from .by_layer import head_columns

    truth, noise, alt = sides
    cfg = truth.cfg
    table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    zbar = (truth.final_norm(z), noise.final_norm(z.to(torch.float32)), alt.final_norm(z.to(torch.float32)))
    cols = head_columns(cfg, z.shape[0])
    nonfinite = 0
    for a in range(0, cfg.vocab_size, cols):
        c = min(a + cols, cfg.vocab_size)
        g = got[:, :, a:c][valid].detach().to(torch.float32).numpy()  # [P, c - a]
        nonfinite += int(g.size - np.isfinite(g).sum())
        w = truth.reader.rows(table, [(a, c)])  # [c - a, n2] fp32
        t, r, r2 = (side.head_slab(zb, w) for side, zb in zip(sides, zbar))
        sums.add(first, a, g, (r.to(torch.float32).numpy(), r2.to(torch.float32).numpy()), t.numpy())
    return nonfinite


def slab_head(rows: Callable[[int, int], Any], vocab: int) -> Any:
    """transformers' lm_head (a Linear without bias) computed a slab of vocabulary rows at a time from the files."""
    import torch

    class SlabHead(torch.nn.Module):
        def forward(self, x: Any) -> Any:  # x: [b, n3, n2] -> [b, n3, n1]
            step = max(1, SLAB_BYTES // (4 * x.shape[-1]))
            release_freed_memory()  # the last layer's weights and activations: their pages back before the logits
            out = x.new_empty((*x.shape[:-1], vocab))  # filled in place: a list of slabs joined would be two copies
            for a in range(0, vocab, step):
                out[..., a:a + step] = x @ rows(a, min(a + step, vocab)).T
            return out

    return SlabHead()


@dataclass(frozen=True)
class ToleranceCheck:
    """llama.cpp's logits against our float64: a relative RMS within what llama.cpp's arithmetic costs the file."""

    name: str
    error: float  # RMS |llama.cpp - our float64| / RMS |our float64| over every position of every row
    tolerance: float
    kind: str  # the file's weight type: F32, F16, BF16, quantized
    max_error: float
    cosine: float
    top1: float  # positions whose argmax agrees
    nonfinite: int
    activation: str = ""  # the FFN's activation when llama.cpp computes it otherwise (ACTIVATION_ALLOWANCE)
    allowance: float = 0.0  # the part of tolerance allowed for that activation

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.error <= self.tolerance

    @property
    def ratio(self) -> float:
        return self.error / self.tolerance

    @property
    def verdict(self) -> str:
        if self.passed:
            return "pass"
        return f"FAIL: {self.nonfinite} NaN/Inf" if self.nonfinite else "FAIL: error over its bound"

    def figures(self) -> str:
        why = f" + {self.allowance:g} for its {self.activation} table" if self.allowance else ""
        return (f"llama.cpp {self.error:.2g} relative RMS (bound {self.tolerance:g}, llama.cpp's rounding of a "
                f"{self.kind} file{why}); top-1 {self.top1:.1%}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed, "verdict": self.verdict, "ratio": self.ratio}


def gguf_kind(path: Any) -> str:
    """The weight type of a GGUF's matrices: F32, F16, BF16 or quantized (any other)."""
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {t.tensor_type for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
    named = {GGMLQuantizationType.F32: "F32", GGMLQuantizationType.F16: "F16", GGMLQuantizationType.BF16: "BF16"}
    names = {named.get(k, "quantized") for k in kinds}
    for kind in ("quantized", "BF16", "F16"):  # the coarsest type present decides
        if kind in names:
            return kind
    return "F32"


def check_gguf(source: Any, rows: list[list[int]], *, progress: Progress = silent) -> SourceReport:
    """A GGUF judged by its own library: llama.cpp's logits on each row against our float64 reference's."""
    import importlib.metadata
    import importlib.util

    import torch

    from llama_tools.inference.reference import reference_model

    if importlib.util.find_spec("llama_cpp") is None:  # not imported here: llama.cpp runs in a child process
        return not_checked(source, "a GGUF's library is llama.cpp, which is not installed here (pip install "
                                   "llama-cpp-python); transformers' GGUF loader is no judge of one (it ignores "
                                   "Gemma's caps, layer pattern and local base)")
    from llama_tools.outputs import files

    from .llamacpp_child import llamacpp_logits

    start = time.perf_counter()
    kind = gguf_kind(source.path)
    longest = max(len(r) for r in rows)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    sq_e = sq_t = dot = sq_g = 0.0
    max_error, agree, n, nonfinite = 0.0, 0, 0, 0
    with files.temp_dir("gguf-check") as scratch:
        # llama.cpp in a child process, before our reference is built: its crash is a line, its memory not ours
        got_rows = llamacpp_logits(source.path, rows, threads, scratch)
        if isinstance(got_rows, str):
            return not_checked(source, got_rows)
        ref = reference_model(source, dtype=torch.float64, batch=1, seq=longest, float64_pass=True)
        for i, (row, got_path) in enumerate(zip(rows, got_rows)):
            got = np.load(got_path).astype(np.float64)  # [n3, n1]
            assert got.shape == (len(row), ref.cfg.vocab_size), f"llama.cpp gave {got.shape} logits for row {i}"
            with torch.no_grad():
                truth = ref(torch.tensor([row])).logits[0].numpy()  # [n3, n1] float64
            nonfinite += int(got.size - np.isfinite(got).sum())
            d = got - truth
            sq_e, sq_t = sq_e + float(np.square(d).sum()), sq_t + float(np.square(truth).sum())
            dot, sq_g = dot + float((got * truth).sum()), sq_g + float(np.square(got).sum())
            max_error = max(max_error, float(np.abs(d).max()))
            agree, n = agree + int((got.argmax(-1) == truth.argmax(-1)).sum()), n + len(row)
            progress(i + 1, len(rows), "source check (llama.cpp)")
    error = math.sqrt(sq_e / sq_t) if sq_t else 0.0
    act = source.cfg.hidden_act
    allowance = ACTIVATION_ALLOWANCE.get(act, 0.0)
    check = ToleranceCheck(f"logits ({n} positions)", error, LLAMACPP_TOLERANCE[kind] + allowance, kind, max_error,
                           dot / math.sqrt(sq_g * sq_t) if sq_g and sq_t else 1.0, agree / max(n, 1), nonfinite,
                           act if allowance else "", allowance)
    version = importlib.metadata.version("llama-cpp-python")
    report = SourceReport(str(getattr(source, "spec", source)), f"llama.cpp (llama-cpp-python {version})", "",
                          BUDGET[F32], [BlockResult("whole model", None, [check])],  # type: ignore[list-item]
                          notes=[f"llama.cpp read {source.path} itself and ran each row whole; error = RMS "
                                 f"|llama.cpp - our float64| / RMS |our float64| over the logits, within what "
                                 f"llama.cpp's own arithmetic costs a {kind} file (measured); the misreads measured "
                                 f"were 0.26-0.96 (Gemma's bases, layer pattern, gains), and 6.4e-4 for a lost "
                                 f"Llama 3.1 scaling, which only an F32 file's bound sees; each row whole, so no "
                                 f"layer is named; its KV cache in F32"])
    if allowance:
        report.notes.append(f"the bound is wider by {allowance:g} for hidden_act {act}, which llama.cpp computes "
                            f"otherwise: {ACTIVATION_WHY[act]} (relative RMS of the logits)")
    report.seconds = time.perf_counter() - start
    return report


def source_rows(rep: SourceReport) -> list[dict[str, Any]]:
    """The table: one row per block."""
    rows = []
    for b in rep.blocks:
        c = max(b.checks, key=lambda c: c.ratio if math.isfinite(c.ratio) else math.inf)
        rows.append({"block": b.name, "check": c.name, "RMS error to our float64 (ratio; bound)":
                     c.figures().replace("onnxruntime", "transformers").replace("PyTorch fp32", "ours fp32"),
                     "max abs": f"{c.max_error:.3g}", "cosine": f"{c.cosine:.7f}", "result": c.verdict})
    return rows
