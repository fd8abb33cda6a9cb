"""Int4 that keeps the answer: the matrices whose int4 error moves the model most stay 8-bit until a KL target holds.

    calibration text ──streamed fp32 reference, one half-layer at a time, forward then back──► s_m for every MatMul m:
        s_m = ½ E_u[(G · δ_m)²]   δ_m: m alone in int4 moves its half-layer's output; G: the output's Fisher probes
                                  carried back to there (`sensitivities`: time linear in depth)
        s_head = KL(p || p with W^8 int4)  the lm_head's own KL, on the final normed states
    rank by predicted KL per extra byte (α s_m / the bytes 8-bit adds, α fitted to a measured all-int4 graph)
        ──keep the top ones 8-bit (MatMulNBits bits=8)──► quantize ──onnxruntime──► KL on calibration text
        └── above the target: refit α on that measurement, keep more (a few rounds; at worst every matrix 8-bit,
            or as many as a size cap allows, the closest graph then the answer)
    the chosen graph ──► KL and top-1 on held-out text (QUALITY_TEXT): what the export reports

The target is nats, or a fraction of the all-int4 graph's measured KL (the first graph built); the default
(quant_options.DEFAULT_TARGET) is the lower of 0.1 nats and 0.6x of it, the 8-bit matrices adding at most 0.08x the
int4 matrices' bytes (decode reads them all each step: its time follows them).
Memory: one half-layer's weights, the clean stream at each half-layer boundary (2 n8 + 1 of [n3, n2]), PROBES
gradients, W^8 a chunk of rows at a time, and the graphs' logits a chunk of positions at a time (no [n3, n1] tensor:
Gemma's vocabulary makes those 0.2 GB each).

Why this shape: a 4-bit weight is off by up to half a step (~6% of a block's range), an 8-bit one by 1/16 of that,
so one matrix kept 8-bit removes nearly all of its error; which ones matter is a property of the trained weights
(SmolLM2-135M loses "Paris" at all-int4), found on real text, not guessed by name. The emulation is the
algorithm's own: onnxruntime's symmetric RTN (`fake_quant`, equal to its MatMulNBits output to fp32 rounding,
tests/test_int4_target.py), or int4_blocks' search with the importance measured by `importance` (the very blocks
the graph holds, tests/test_int4_blocks.py), so the ranking sees the error the graph will have; the loop then
judges the real graph, never the emulation.

(Over 500 lines on purpose: the sensitivity pass and the choice it feeds share the int4 emulation and its
bounds; split, the choice would import the pass's private state.)
"""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .quant_options import HEAD, HEAD_FREQUENT, HEAD_PARTS, HEAD_REST, frequent_rows

# A MatMul of a decoder layer, plain or fused graph: /model/layers.{j}/{self_attn|mlp}/{proj}/MatMul
_LAYER_NODE = re.compile(r"^/model/layers\.(\d+)/(self_attn|mlp)/(\w+)/MatMul$")
# A fused graph packs projections along the output axis; int4 blocks run along the input axis, one set per output
# row, so quantizing the packed matrix is quantizing each part on its own.
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MAX_ROUNDS = 4  # graphs built and measured before every matrix is kept 8-bit
# A plan aims this far under the target: the measured KL of the first planned graph came out 6% (Qwen2.5-Coder-0.5B)
# and 11% (SmolLM2-135M) over its prediction. 0.7 kept 63 of Qwen's 97 matrices 8-bit for a target it beat by 28%
# (1.23x the builder's decode time); a miss costs one more graph, an overshoot every decode step.
PLAN_MARGIN = 0.85


@dataclass(frozen=True)
class Matrix:
    """One quantizable MatMul of the graph, as the model knows it."""

    node: str
    layer: int | None  # None: the lm_head
    module: str  # "self_attn" | "mlp" | "lm_head"
    parts: tuple[str, ...]  # the nn.Linear names inside the module


def matrices(nodes: list[str]) -> list[Matrix]:
    """The graph's quantizable MatMul names -> what each is in the model; ValueError for one it cannot place."""
    out = []
    for node in nodes:
        if node == HEAD or node in HEAD_PARTS:  # the head, whole or its rows in two parts
            out.append(Matrix(node, None, "lm_head", ("lm_head",)))
            continue
        m = _LAYER_NODE.match(node)
        if m is None or m.group(2) not in ("self_attn", "mlp"):
            raise ValueError(f"--max-kl: the graph's MatMul {node!r} is not a projection of a decoder layer or the "
                             f"lm_head (mixture-of-experts graphs are quantized without a target)")
        out.append(Matrix(node, int(m.group(1)), m.group(2), _PACKED.get(m.group(3), (m.group(3),))))
    return out


FAKE_QUANT_ROWS_BYTES = 16 * 2**20  # float64 bytes of W rows per step: its few temporaries stay small


def fake_quant(w: Any, bits: int = 4, block: int = 32) -> Any:
    """W [out, in] as onnxruntime's symmetric RTN MatMulNBits holds it: per row, blocks of `block` along `in`,
    scale = (the block's value of largest magnitude) / -2^(bits-1), q = clamp(round(w / scale), -2^(b-1), 2^(b-1)-1).
    Rows are independent: done a few at a time (float64 temporaries of a whole 9728 x 896 matrix were 0.3 GB)."""
    import torch

    rows, cols = w.shape
    pad = (-cols) % block
    step = max(1, FAKE_QUANT_ROWS_BYTES // (8 * (cols + pad)))
    out = torch.empty_like(w)
    for a in range(0, rows, step):
        x = torch.nn.functional.pad(w[a:a + step].double(), (0, pad)).reshape(-1, (cols + pad) // block, block)
        pick = x.abs().argmax(-1, keepdim=True)  # [r, blocks, 1]
        scale = (x.gather(-1, pick) / -(2 ** (bits - 1))).float().double()  # kept in fp32, as the graph stores it
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round(x / safe), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        out[a:a + step] = (q * scale).reshape(x.shape[0], -1)[:, :cols].to(w.dtype)
    return out


TOP_K = 128  # next-token candidates per position the KL estimate sums over (a trained model's mass is there)


# Random directions of the output's Fisher per position. Measured on SmolLM2-135M's 120 decoder matrices: 8 and 32
# rank alike; 4 against 8, rank correlation 0.995 and 16 of the 18 largest shared, in 0.7x the pass's CPU time (the
# probes' backward pass is most of it); the graphs built then judge the choice.
PROBES = 4


def sensitivities(ref: Any, ids: list[int], mats: list[Matrix], block: int,
                  progress: Callable[[int, int, str], None] = lambda *a: None,
                  states: list[Any] | None = None, emulate: Emulate | None = None,
                  bf16: bool | None = None) -> dict[str, float]:
    """KL_m: the mean next-token KL (nats) with matrix m alone in int4, for every matrix, in time linear in depth.

    A forward pass keeps the clean residual stream Z_b at every half-layer boundary. PROBES random vectors u with
    E[u uᵀ] = F_t, the Fisher of position t's next-token distribution at the final normed state (on its TOP_K
    candidates, `_probes`), are carried back through the layers (vector-Jacobian products, one half-layer's weights
    at a time): G_b = J_bᵀ u at each boundary. Matrix m in int4 moves its half-layer's output by δ_m; then

        KL_m ≈ ½ mean_t E_u[(G_b[t] · δ_m[t])²]     (second order; each position's own term, its cross terms left out)

    Measured on SmolLM2-135M against carrying each δ_m through every later half-layer (the exact second-order
    figure, quadratic in depth): rank correlation 0.98, median ratio 0.88, in a third of the time. The lm_head is
    measured exactly; a tied embedding read through the same int4 blocks adds its δ at Z^0.
    emulate: the quantizer's int4 (default: symmetric RTN, `rtn_emulation`). bf16: the probes carried back through
    the projections in bf16 (`_bf16_products`; None: where the CPU multiplies bf16 natively, `fast_bf16`); each δ_m
    is a difference of two fp32 passes, always.
    """
    import torch

    from llama_tools.modeling.model import layer_masks

    emulate = emulate or rtn_emulation(block)
    cfg = ref.cfg
    by_half: dict[tuple[int, str], list[Matrix]] = {}
    for m in mats:
        if m.layer is not None:
            by_half.setdefault((m.layer, m.module), []).append(m)
    head = any(m.layer is None for m in mats)
    split = any(m.node in HEAD_PARTS for m in mats)
    r = frequent_rows(cfg.vocab_size) if split else 0
    with torch.no_grad():
        x = torch.tensor([ids] if ids and isinstance(ids[0], int) else ids)  # [b, n3]
        n3 = x.shape[1]
        bounds = [ref._embed(x)]  # Z_b at each unit's boundary: Z^0, Y^0, Z^1, ... [b, n3, n2]
        masks = layer_masks(cfg, n3, 0, torch.ones_like(x[:1]), bounds[0].dtype, bounds[0].device)
        units = unit_specs(cfg)
        for i, (j, modules) in enumerate(units):
            bounds.append(_unit(ref, j, modules, masks, n3)[1](bounds[-1]))
            progress(i + 1, 2 * len(units), "int4 sensitivity (forward)")
        z = bounds[-1]
        clean = _clean_logits(ref, _final(ref)(z).reshape(-1, z.shape[-1]))  # [b n3, n1] or None (too big)
        if states is not None:  # the clean final residual stream Z [b, n3, n2]: the reference's logits, later
            states += [z, clean]
        u = _probes(ref, z, PROBES, clean=clean)  # [S b, n3, n2]
    final = _final(ref)
    g = _vjp(lambda zin: final(zin), z, u)  # G at the last boundary: [S b, n3, n2]

    def kl(g: Any, d: Any) -> float:  # ½ mean over probes, windows and positions of (G · δ)²
        return float(0.5 * ((g * d.repeat(PROBES, 1, 1)).sum(-1) ** 2).mean())
    out: dict[str, float] = {}
    b = len(bounds) - 1
    for i, (j, modules) in reversed(list(enumerate(units))):
        owners, run = _unit(ref, j, modules, masks, n3)
        for module in modules:
            owner = owners[module]
            with torch.no_grad():
                for m in by_half.get((j, module), []):
                    saved = {p: getattr(owner, p).weight.data for p in m.parts}
                    at = 0  # each part's rows inside the node's packed matrix
                    for p in m.parts:
                        rows = slice(at, at + saved[p].shape[0])
                        getattr(owner, p).weight.data, at = emulate(saved[p], m.node, rows), rows.stop
                    out[m.node] = kl(g, run(bounds[b - 1]) - bounds[b])
                    for p in m.parts:
                        getattr(owner, p).weight.data = saved[p]
        with _bf16_products(*owners.values(), on=fast_bf16() if bf16 is None else bf16):
            g = _vjp(run, bounds[b - 1], g)  # G at the unit's input
        b -= 1
        del owners, run
        progress(2 * len(units) - i, 2 * len(units), "int4 sensitivity (backward)")
    if head:
        whole, rest = _head_kl(ref, z, emulate, r, clean if z.shape[0] == 1 else None)
        if cfg.tie_word_embeddings:  # the Gather reads the lm_head's int4 blocks: D's rows in int4 move Z^0
            with torch.no_grad():
                flat = x.reshape(-1).tolist()
                rows = ref.reader.rows("model.embed_tokens.weight", [(i, i + 1) for i in flat]).float()  # [b n3, n2]
                # Gemma's sqrt(n2), Granite's embedding_multiplier
                scale = math.sqrt(cfg.hidden_size) if cfg.embed_scale else cfg.embedding_multiplier
                q = emulate(rows, HEAD)
                whole += kl(g, ((q - rows) * scale).reshape(bounds[0].shape))
                if split:  # the frequent ids' rows exact: what is left when HEAD_FREQUENT is kept 8-bit
                    frequent = torch.tensor([i < r for i in flat])[:, None]
                    rest += kl(g, (torch.where(frequent, rows, q) - rows).mul(scale).reshape(bounds[0].shape))
        if split:  # additive, as the plan treats them: the rest's own KL, the first rows' the difference
            out[HEAD_REST], out[HEAD_FREQUENT] = rest, max(whole - rest, 0.0)
        else:
            out[HEAD] = whole
    return out


def _vjp(f: Callable[[Any], Any], zin: Any, g: Any) -> Any:
    """J_f(zin)ᵀ g for each of g's rows [S b, n3, n2] (probe-major), zin [b, n3, n2] (the same input under every
    probe): f runs once and each probe's cotangent goes back through its graph (not f on S copies of zin: the
    forward was 45% of the pass's vector-Jacobian time on Qwen2.5-Coder-0.5B)."""
    import torch

    b = zin.shape[0]
    z = zin.detach().requires_grad_(True)
    with torch.enable_grad():
        out = f(z)
        probes = g.shape[0] // b
        grads = [torch.autograd.grad(out, z, g[i * b:(i + 1) * b], retain_graph=i + 1 < probes)[0]
                 for i in range(probes)]
    return torch.cat(grads).detach()  # [S b, n3, n2]


def unit_specs(cfg: Any) -> list[tuple[int, tuple[str, ...]]]:
    """The passes' units, in order: (layer j, the modules whose weights it holds). A sequential block is two, its
    attention then its FFN (the stream between them is a boundary); a parallel one (GPT-NeoX, Falcon), whose FFN
    reads the layer's input as attention does, is one unit holding both."""
    if cfg.parallel_residual:
        return [(j, ("self_attn", "mlp")) for j in range(cfg.num_hidden_layers)]
    return [(j, module) for j in range(cfg.num_hidden_layers) for module in (("self_attn",), ("mlp",))]


def _unit(ref: Any, j: int, modules: tuple[str, ...], masks: Any, n3: int
          ) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """(module -> the nn.Module holding its Linears (None for a MoE layer's FFN), the unit as a function of its
    input stream [b, n3, n2]: positions 0..n3-1, no cache), its weights read, no gradients for them."""
    import torch

    from llama_tools.modeling.model import layer_tables

    halves = {module: ref._half(j, module == "self_attn").requires_grad_(False) for module in modules}

    def attend(half: Any, zin: Any) -> Any:
        pos = torch.arange(n3).expand(zin.shape[0], n3)  # [b, n3]
        return half.attend(zin, masks[half.sliding], pos, layer_tables(ref.tables(n3), half.sliding), None)[0]

    def run(zin: Any) -> Any:
        if len(modules) == 2:  # parallel: Z^{j+1} = Z^j + R^j + FFN(norm(Z^j))
            return halves["mlp"].feed_forward(attend(halves["self_attn"], zin), zin)
        half = halves[modules[0]]
        return attend(half, zin) if modules[0] == "self_attn" else half.feed_forward(zin)
    return {module: getattr(half, module, None) for module, half in halves.items()}, run


# (W [out, in], the MatMul node it belongs to, W's rows inside the node's packed matrix) -> W as the int4 graph
# will compute with it
Emulate = Callable[..., Any]


def rtn_emulation(block: int) -> Emulate:
    """onnxruntime's symmetric RTN, whatever the node."""
    return lambda w, node, rows=None: fake_quant(w, 4, block)


def imatrix_emulation(importance: dict[str, Any], block: int, scales: Any = None) -> Emulate:
    """int4_blocks' search with each node's importance (the same call quantize_int4 makes); with `scales`
    (int4_scales.Scales, "awq") on the rescaled weights, mapped back."""
    from . import int4_blocks

    def quant(w: Any, a: Any) -> Any:
        return int4_blocks.fake_quant(w, a, block=block)
    if scales is None:
        return lambda w, node, rows=None: quant(w, importance.get(node))
    return lambda w, node, rows=None: scales.emulate(w, node, rows, quant, importance.get(node))


def stored_emulation(store: Any, full: Path, importance: dict[str, Any], block: int, scales: Any = None,
                     fallback: Emulate | None = None) -> Emulate:
    """The int4 the graph will hold, read from STORE (an int4_blocks.BlockStore, searched there on a miss, on FULL's
    own weights): the blocks the candidate graphs are then built from, so no matrix is searched twice. A call
    without `rows` (the tied embedding's rows of the prompt's ids) goes to `fallback`, the same search on W alone."""
    import onnx
    import torch

    from . import int4_blocks
    from .quantize import _columns, _weights_of, stored_rows

    model = onnx.load(str(full), load_external_data=False)
    weights, inits = _weights_of(model), {t.name: t for t in model.graph.initializer}
    readers: dict[str, Callable[[int, int], Any]] = {}
    fallback = fallback or imatrix_emulation(importance, block, scales)

    def emulate(w: Any, node: str, rows: slice | None = None) -> Any:
        name = HEAD if node in HEAD_PARTS else node
        if rows is None or name not in weights:
            return fallback(w, node, rows)
        k, n, cols = _columns(inits[weights[name][0]], full.parent, weights[name][1])
        a = importance.get(name)
        if scales is not None:  # the graph's W^T rows times s, outputs over d: what the blocks are searched on
            cols, a = scales.columns(name, cols), scales.importance(name, a)
        if name not in readers:
            readers[name] = stored_rows(store, name, k, n, cols, a, block)
        p = readers[name](rows.start, rows.stop)
        q = torch.from_numpy(int4_blocks.unpack(p["B"], p["scales"].astype(np.float32), p["zero_points"], bits=4, k=k))
        assert q.shape == w.shape, f"{node}: the graph's rows {rows} are {tuple(q.shape)}, the reference's {tuple(w.shape)}"
        if scales is not None:  # back from the scaled graph's W diag(s) / d to the reference's W
            s, d = scales.inputs.get(name), scales.outputs.get(name)
            if s is not None:
                q = q / torch.from_numpy(s)[None, :]
            if d is not None:
                q = q * torch.from_numpy(d[rows])[:, None]
        return q.to(w.dtype)
    return emulate


def importance(ref: Any, ids: list[int] | list[list[int]], nodes: list[str],
               progress: Callable[[int, int, str], None] = lambda *a: None, bf16: bool | None = None
               ) -> dict[str, Any]:
    """node -> a_k = the mean square of the k-th input of its matrix on `ids` (int4_blocks' importance), for every
    node that is a decoder projection or the lm_head (others get none: uniform), in one clean streamed pass.
    ids: one sequence, or windows of equal length (calibration_windows), each from position 0, run as one batch.
    bf16: the projections' products in bf16 (`_bf16_products`); None: where the CPU multiplies bf16 natively
    (`fast_bf16`)."""
    import torch

    from llama_tools.modeling.model import layer_masks

    mats = []
    for node in nodes:
        try:
            mats += matrices([node])
        except ValueError:  # an expert's matrix: no single input to measure it on
            pass
    by_half: dict[tuple[int, str], list[Matrix]] = {}
    for m in mats:
        if m.layer is not None:
            by_half.setdefault((m.layer, m.module), []).append(m)
    out: dict[str, Any] = {}
    with torch.no_grad():
        x = torch.tensor([ids] if ids and isinstance(ids[0], int) else ids)  # [b, n3]
        n3 = x.shape[1]
        z = ref._embed(x)  # Z^0: [b, n3, n2]
        # Windows a few at a time: SmolLM2-135M peaked at 739 MB with the sensitivity pass's batch, 611 with a quarter.
        step = max(1, stream_batch(ref.cfg, n3) // 4)
        masks = layer_masks(ref.cfg, n3, 0, torch.ones_like(x[:1]), z.dtype, z.device)
        units = unit_specs(ref.cfg)
        for i, (j, modules) in enumerate(units):
            owners, run = _unit(ref, j, modules, masks, n3)
            hooks = []
            for module, owner in owners.items():
                for m in by_half.get((j, module), []) if owner is not None else []:  # a MoE layer has no `mlp`
                    def seen(mod: Any, inp: Any, _out: Any, node: str = m.node) -> None:
                        x = inp[0].detach().reshape(-1, inp[0].shape[-1])  # [b n3, in]
                        # squared in fp32, summed in float64: 1.5x faster than a float64 copy, the same to 3e-9
                        out[node] = out.get(node, 0) + x.square().sum(0, dtype=torch.float64)
                    hooks.append(getattr(owner, m.parts[0]).register_forward_hook(seen))
            with _bf16_products(*owners.values(), on=fast_bf16() if bf16 is None else bf16):
                z = torch.cat([run(z[i:i + step]) for i in range(0, len(z), step)])  # windows a batch at a time
            for h in hooks:
                h.remove()
            del owners, run
            progress(i + 1, len(units), "int4 importance (streamed)")
        if any(m.layer is None for m in mats):
            h = _final(ref)(z).double().reshape(-1, z.shape[-1])  # [b n3, n2]: what the lm_head reads
            out[HEAD] = (h**2).sum(0)
    return {node: (v / x.numel()).float() for node, v in out.items()}  # the mean over every position


@contextmanager
def _bf16_products(*modules: Any, on: bool = True) -> Iterator[None]:
    """Within it, each nn.Linear under MODULES (None: none) computes in bf16 and returns fp32: its input and output,
    the stream, the norms, attention's scores and the bias stay fp32 (Qwen2.5-0.5B's large q/k biases added in bf16
    moved its first o_proj's importance by 11%; so, every matrix's by under 1%). Its hooks see the fp32 input."""
    import torch

    patched = []
    for m in (m for module in modules if on and module is not None for m in module.modules()):
        if isinstance(m, torch.nn.Linear):
            w, b = m.weight.detach().to(torch.bfloat16), m.bias
            m.forward = lambda x, w=w, b=b: _biased(torch.nn.functional.linear(x.to(torch.bfloat16), w).float(), b)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward  # the class's own again


def _biased(y: Any, b: Any) -> Any:
    return y if b is None else y + b


def fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles: 555 against fp32's 149 GFLOPS on two
    Sapphire Rapids cores, a 2816 x 896 by 896 x 4864 product); elsewhere bf16 is converted and no faster."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


# What one batch of calibration windows may take through a half-layer: its intermediates (attention scores, the
# feed-forward's hidden units), not all the windows at once (121 streams of SmolLM2's at once peaked at 1.3 GB).
STREAM_BATCH_BYTES = 128 * 2**20


def stream_batch(cfg: Any, n3: int) -> int:
    """How many windows of n3 positions go through a half-layer together within STREAM_BATCH_BYTES: per window,
    fp32 scores, weights and their mask [n5, n3, n3] x 3, the feed-forward's gate, up and product [n3, n7] x 3,
    and a few [n3, n2] states."""
    per = 4 * n3 * (3 * cfg.num_attention_heads * n3 + 3 * cfg.intermediate_size + 6 * cfg.hidden_size)
    return max(1, STREAM_BATCH_BYTES // per)


def _final(ref: Any) -> Any:
    """The final norm with its weights read: RMSNorm's gain (Gemma's 1 + γ included), LayerNorm's γ and β."""
    from llama_tools.modeling.model import norm
    from llama_tools.modeling.weights import weight_specs

    final = norm(ref.cfg)
    names = [s.name for s in weight_specs(ref.cfg) if s.component == "final_norm"]
    final.load_state_dict({n.removeprefix("model.norm."): t.float() for n, t in ref.reader.read(names).items()})
    # no gradients for its weights: else every product of its output (the head's chunks in _head_kl) is kept for
    # a backward pass that never comes (3.1 GB on Qwen2.5-Coder-0.5B's 151,936-row head)
    return final.requires_grad_(False)


def _head_rows(ref: Any) -> tuple[str, int]:
    cfg = ref.cfg
    return ("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"), \
        max(1, (16 * 2**20) // (4 * cfg.hidden_size))


def _head_chunks(ref: Any, h: Any, emulate: Emulate | None = None, exact_below: int = 0, clean: Any = None) -> Any:
    """(H, H') a row chunk of W^8 at a time: h W^{8T} on `step` vocabulary rows [n3, step], and the same with W^8
    int4-emulated (None unless `emulate`) except its first `exact_below` rows; W^8 is read once per chunk and
    dropped. clean: h W^{8T} made before [n3, n1] (`_clean_logits`), H taken from it (W^8 then read only to emulate)."""
    import torch

    name, step = _head_rows(ref)
    cfg = ref.cfg
    for a in range(0, cfg.vocab_size, step):
        b = min(a + step, cfg.vocab_size)
        if clean is not None and not emulate:
            yield clean[:, a:b], None
            continue
        w = ref.reader.rows(name, [(a, b)]).float()  # [rows, n2]
        if cfg.norm_head:
            w = torch.nn.functional.normalize(w, dim=-1)
        q = None
        if emulate:
            q = emulate(w, HEAD, slice(a, a + w.shape[0]))
            q[: max(0, exact_below - a)] = w[: max(0, exact_below - a)]
        yield h @ w.T if clean is None else clean[:, a:b], (h @ q.T if emulate else None)


def _clean_logits(ref: Any, h: Any) -> Any:
    """h W^{8T} [n3, n1] in one pass over W^8 when it fits in LOGITS_CACHE_BYTES (else None): the probes, the head's
    KL and the reference's calibration logits then share it (W^8's product made once, not three times)."""
    if h.shape[0] * ref.cfg.vocab_size * 4 > LOGITS_CACHE_BYTES:
        return None
    import torch

    return torch.cat([x for x, _ in _head_chunks(ref, h)], -1)


def _probes(ref: Any, z: Any, count: int, seed: int = 0, clean: Any = None) -> Any:
    """`count` vectors u per window [count b, n3, n2] at the final normed state of z [b, n3, n2], each position's
    with E[u uᵀ] = F_t = Σ_v p_v (w'_v - w̄')(w'_v - w̄')ᵀ over the clean distribution's TOP_K candidates (w'_v: W^8's
    row v times the softcap's slope there): u = Σ_v √p_v ε_v (w'_v - w̄'), ε standard normal, seeded. So
    ½ E[(u · δh)²] = ½ Var_p(δh · w'_v), the KL of a small move δh of that state.

    The distribution is read a vocabulary chunk at a time (its log-normalizer and its TOP_K candidates kept as they
    go): no [n3, n1] tensor is held, which for Gemma's 262,144 tokens would be 0.4 GB per copy. The candidates are
    taken in id order, so the probes do not depend on how the vocabulary was chunked.
    """
    import torch

    from llama_tools.modeling.model import final_logits

    cfg = ref.cfg
    h = _final(ref)(z).reshape(-1, z.shape[-1])  # Zbar: [b n3, n2]
    cap = cfg.final_logit_softcap
    finish = lambda raw: final_logits(cfg, raw)  # noqa: E731  (Granite's scaling, Gemma 2's cap)
    k = min(TOP_K, cfg.vocab_size)
    lse = torch.full((h.shape[0],), -math.inf, dtype=torch.float64)  # [b n3]
    top_raw = torch.empty(h.shape[0], 0)  # [b n3, <= K] raw logits of the likeliest so far
    top = torch.empty(h.shape[0], 0, dtype=torch.long)
    a = 0
    for raw, _ in _head_chunks(ref, h, clean=clean):
        lse = torch.logaddexp(lse, torch.logsumexp(finish(raw).double(), -1))
        both = torch.cat([top_raw, raw], -1)
        ids = torch.cat([top, torch.arange(a, a + raw.shape[1]).expand(h.shape[0], -1)], -1)
        top_raw, pick = both.topk(min(k, both.shape[1]), -1)  # softcap is monotonic: the same candidates
        top = ids.gather(-1, pick)
        a += raw.shape[1]
    top, order = top.sort(-1)
    top_raw = top_raw.gather(-1, order)
    p = torch.exp(finish(top_raw).double() - lse[:, None]).float()  # [b n3, K]
    name, _ = _head_rows(ref)
    uniq, inverse = torch.unique(top, return_inverse=True)  # the candidates' rows read once, in runs of ids
    w = ref.reader.rows(name, _runs(uniq.tolist())).float()[inverse]  # [U, n2] -> [b n3, K, n2]
    if cfg.norm_head:
        w = torch.nn.functional.normalize(w, dim=-1)
    if cap:
        w = w * (1 - torch.tanh(top_raw / cfg.logits_scaling / cap) ** 2)[..., None]  # d softcap / d logit
    if cfg.logits_scaling != 1.0:
        w = w / cfg.logits_scaling  # Granite: H divided by logits_scaling
    w = w - (p[..., None] * w).sum(1, keepdim=True)  # w'_v - w̄'
    eps = torch.randn(count, *p.shape, generator=torch.Generator().manual_seed(seed))  # [count, b n3, K]
    u = torch.einsum("stk,tkd->std", eps * p.sqrt(), w)  # [count, b n3, n2]
    return u.reshape(count * z.shape[0], z.shape[1], z.shape[2])


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids -> the [start, stop) ranges of their consecutive runs (a reader's rows call)."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _head_kl(ref: Any, z: Any, emulate: Emulate, exact_below: int = 0, clean: Any = None) -> tuple[float, float]:
    """(KL(p || p'), the same with its first `exact_below` rows exact) of the lm_head alone in int4, exactly, on the
    final states z [1, n3, n2], in one pass over W^8's chunks, each emulated once: with x the clean logits and y the
    int4 ones, KL = Σ_v p_v (x_v - y_v) + lse(y) - lse(x), and Σ_v p_v (x_v - y_v) kept as a running sum rescaled
    to the running max of x (as a streamed softmax), so no [n3, n1] tensor is held."""
    import torch

    from llama_tools.modeling.model import final_logits

    finish = lambda raw: final_logits(ref.cfg, raw).double()  # noqa: E731
    h = _final(ref)(z)[0]  # Zbar: [n3, n2]
    n3 = h.shape[0]
    top = torch.full((n3, 1), -math.inf, dtype=torch.float64)  # running max of x: [n3, 1]
    mass = torch.zeros(n3, 1, dtype=torch.float64)  # Σ exp(x - top)
    gap = torch.zeros(n3, 2, dtype=torch.float64)  # Σ exp(x - top) (x - y), the whole head's and the rest's
    lse_y = torch.full((n3, 2), -math.inf, dtype=torch.float64)
    a = 0
    for x, y in _head_chunks(ref, h, emulate, clean=clean):
        x, y = finish(x), finish(y)  # [n3, rows]
        rest = y.clone()
        keep = max(0, min(exact_below - a, x.shape[1]))
        rest[:, :keep] = x[:, :keep]  # the frequent rows exact
        new_top = torch.maximum(top, x.amax(-1, keepdim=True))
        shrink, e = torch.exp(top - new_top), torch.exp(x - new_top)  # [n3, 1], [n3, rows]
        mass = mass * shrink + e.sum(-1, keepdim=True)
        gap = gap * shrink + torch.stack([(e * (x - y)).sum(-1), (e * (x - rest)).sum(-1)], -1)
        lse_y = torch.logaddexp(lse_y, torch.stack([torch.logsumexp(y, -1), torch.logsumexp(rest, -1)], -1))
        top, a = new_top, a + x.shape[1]
    kl = gap / mass + lse_y - (top + mass.log())  # [n3, 2]
    whole, rest = kl.mean(0).tolist()
    return whole, rest


@dataclass
class Round:
    """One graph built and measured."""

    kept: int  # matrices kept 8-bit
    predicted_kl: float
    measured_kl: float  # on the calibration text
    bytes: int


@dataclass
class TargetResult:
    """What the target chose and what it measured."""

    max_kl: float
    kept_8bit: list[str]
    sensitivity: dict[str, float]  # KL_m: nats with that matrix alone in int4
    alpha: float  # measured KL / the sum of the int4 matrices' KL_m, fitted to the graphs that missed
    rounds: list[Round] = field(default_factory=list)
    calibration_tokens: int = 0
    importance_tokens: int = 0  # the text imatrix/awq measured each matrix's inputs on (0: not measured)
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)  # importance, scales, sensitivity, graphs
    met: bool = False
    fraction: float | None = None  # a relative target: max_kl is this times the all-int4 graph's KL
    size_cap: float | None = None  # the result weighs at most this times the all-int4 graph
    chosen: int = -1  # the round whose graph was written (the last, unless a capped loop's closest was earlier)
    nats: float | None = None  # an absolute bound given with the fraction: max_kl is the lower of the two

    @property
    def calibration_kl(self) -> float:
        return self.rounds[self.chosen].measured_kl

    @property
    def all_int4_kl(self) -> float:
        """The all-int4 graph's KL on the calibration text (the first graph built)."""
        return self.rounds[0].measured_kl


def plan(sens: dict[str, float], alpha: float, max_kl: float, margin: float = PLAN_MARGIN,
         cost: dict[str, int] | None = None, budget: float = math.inf) -> list[str]:
    """The matrices to keep 8-bit so that the predicted KL of the rest, alpha * sum KL_m, is at most margin * max_kl
    (8-bit leaves 1/256 of a matrix's int4 KL: neglected): the most KL per extra byte first (cost: the bytes 8-bit
    adds; None: every matrix alike, so the fewest matrices), skipping any that would take the kept ones' extra bytes
    past `budget`."""
    order = _order(sens, cost)
    rest = alpha * sum(sens.values())
    kept: list[str] = []
    spent = 0
    for n in order:
        if rest <= margin * max_kl:
            break
        extra = cost[n] if cost else 0
        if spent + extra > budget:
            continue
        kept.append(n)
        spent += extra
        rest -= alpha * sens[n]
    return kept


def _order(sens: dict[str, float], cost: dict[str, int] | None) -> list[str]:
    """Most KL removed per byte spent first (stable: ties keep the graph's order)."""
    return sorted(sens, key=lambda n: sens[n] / (cost[n] if cost else 1), reverse=True)


def choose(sens: dict[str, float], max_kl: float | None, build: Callable[[list[str]], tuple[float, int]], *,
           fraction: float | None = None, cost: dict[str, int] | None = None,
           size_cap: float | None = None, base: int | None = None) -> TargetResult:
    """The loop of the module docstring. build(kept) quantizes with `kept` 8-bit -> (KL on calibration, bytes).

    alpha: measured KL / the sum of the int4 matrices' own KL_m, at least 1 (errors compound, and onnxruntime's
    int8 activations add their own), refitted on each graph that misses the target.
    fraction: the target is this times the all-int4 graph's measured KL (the first graph); with max_kl as well, the
    lower of the two.
    cost, size_cap, base: the bytes keeping each matrix 8-bit adds, and the most they may add together: (size_cap - 1)
    x base, the int4 matrices' own bytes (what a decode step reads; None: the all-int4 file's); when no graph within
    the cap meets the target, the closest one built is the answer (not met).
    """
    result = TargetResult(max_kl=max_kl if max_kl is not None else math.nan, kept_8bit=[], sensitivity=sens,
                          alpha=1.0, fraction=fraction, size_cap=size_cap,
                          nats=max_kl if fraction is not None else None)
    kept: list[str] = []
    budget = math.inf
    tried: list[list[str]] = []
    for _ in range(MAX_ROUNDS):
        kl, size = build(kept)
        tried.append(kept)
        rest = sum(v for n, v in sens.items() if n not in kept)
        if not result.rounds:  # the all-int4 graph: what a relative target and the cap are measured against
            if fraction is not None:  # with nats as well, the lower of the two
                result.max_kl = min(fraction * kl, math.inf if max_kl is None else max_kl)
            if size_cap is not None:
                budget = (size_cap - 1) * (base or size)
        result.rounds.append(Round(len(kept), result.alpha * rest, kl, size))
        if kl <= result.max_kl:
            result.kept_8bit, result.met = kept, True
            return result
        result.alpha = max(result.alpha, kl / max(rest, 1e-30))
        spent = sum(cost[n] for n in kept) if cost else 0
        more = plan({n: v for n, v in sens.items() if n not in kept}, result.alpha, result.max_kl, cost=cost,
                    budget=budget - spent) if rest else []
        if not more:  # predicted to meet it, measured not to: keep the next quarter anyway (within the budget)
            left = [n for n in _order(sens, cost) if n not in kept]
            more = _within(left, cost, budget - spent)[: max(1, len(left) // 4)]
        if not more:  # nothing more fits the cap: the closest graph built is the answer
            return _closest(result, tried)
        kept = sorted(set(kept) | set(more), key=list(sens).index)
    # The last resort: every matrix 8-bit, or the most KL per byte the cap allows.
    last = sorted(_within(_order(sens, cost), cost, budget), key=list(sens).index)
    if last != tried[-1]:
        kl, size = build(last)
        tried.append(last)
        result.rounds.append(Round(len(last), 0.0, kl, size))
    return _closest(result, tried)


def _within(order: list[str], cost: dict[str, int] | None, budget: float) -> list[str]:
    """The matrices of `order`, in order, skipping any that would take their extra bytes past `budget`."""
    out, spent = [], 0
    for n in order:
        if spent + (cost[n] if cost else 0) <= budget:
            out.append(n)
            spent += cost[n] if cost else 0
    return out


def _closest(result: TargetResult, tried: list[list[str]]) -> TargetResult:
    """The graph built with the lowest measured KL (ties: the fewest bytes) as the answer; met if it meets it."""
    best = min(range(len(tried)), key=lambda i: (result.rounds[i].measured_kl, result.rounds[i].bytes, -i))
    result.kept_8bit, result.met = tried[best], result.rounds[best].measured_kl <= result.max_kl
    result.chosen = best
    return result


def calibration_ids(tokenizer: Any, vocab_size: int, limit: int = 192) -> tuple[list[int], str]:
    """The built-in passages (prose in three languages, code) through the tokenizer, else seeded ids."""
    from .prompts import PASSAGES

    if tokenizer is None:
        return np.random.default_rng(1).integers(3, vocab_size, size=64).tolist(), "64 seeded ids (no tokenizer)"
    ids = tokenizer.encode("\n\n".join(text for _, text in PASSAGES))[:limit]
    return ids, f"{len(ids)} tokens of built-in prose (English, French, German) and Python code"


# The importance pass reads more text than the sensitivity pass can afford (it carries a perturbed stream per matrix
# through every later layer): a_k is a mean square per input, and 192 tokens leave it noisy. On SmolLM2-135M, every
# matrix int4 by imatrix, held-out KL fell 0.143 -> 0.124 with 2,240 tokens of importance.
WINDOW = 256  # tokens per calibration window: each runs from position 0, as a prompt does
MAX_WINDOWS = 16  # at most this many (4,096 tokens): the pass holds a [windows, WINDOW, n2] stream


MIN_CALIBRATION_TOKENS = 64  # the corpus is ~10 kB: a real tokenizer gives thousands of tokens


def calibration_windows(tokenizer: Any, vocab_size: int) -> tuple[list[list[int]], str]:
    """The built-in calibration corpus (calibration_ids' passages, then llama_tools/data/calibration: stories,
    explanations, chat, French, German, Spanish, Python, SQL/JavaScript/shell, notes and numbers) through the
    tokenizer, cut into windows of WINDOW tokens, each led by what the tokenizer puts before a text (the last one
    ends at the corpus' end); seeded ids without a tokenizer."""
    from importlib import resources

    from .prompts import PASSAGES

    if tokenizer is None:
        rng = np.random.default_rng(1)
        return [rng.integers(3, vocab_size, size=64).tolist()], "64 seeded ids (no tokenizer)"
    folder = resources.files("llama_tools") / "data" / "calibration"
    texts = [text for _, text in PASSAGES] + [f.read_text(encoding="utf-8") for f in
                                              sorted(folder.iterdir(), key=lambda f: f.name) if f.name.endswith(".txt")]
    # What the tokenizer puts before any text (Gemma's and Llama's <bos>) starts every window, as it starts a prompt:
    # Gemma 3 270M without it at the later windows' first position, all-int4 held-out KL 0.168 (0.149 from 192 tokens).
    lead = tokenizer.encode("")
    lead = lead if len(lead) <= WINDOW // 4 else []
    ids = tokenizer.encode("\n\n".join(texts))
    ids = ids[len(lead):] if ids[:len(lead)] == lead else ids
    body = WINDOW - len(lead)
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ValueError(f"{getattr(tokenizer, 'path', 'the tokenizer')}: encodes the built-in calibration text "
                         f"({sum(map(len, texts)):,} characters) to {len(ids)} tokens, too few to measure which int4 "
                         f"matrices matter (at least {MIN_CALIBRATION_TOKENS}); the tokenizer does not read text as "
                         f"the model's does")
    if len(ids) <= body:
        return [lead + ids], f"{len(lead) + len(ids)} tokens of built-in text"
    starts = list(range(0, len(ids) - body, body))[: MAX_WINDOWS - 1] + [len(ids) - body]
    windows = [lead + ids[a:a + body] for a in dict.fromkeys(starts)]
    return windows, f"{len(windows)} windows of {WINDOW} tokens of built-in text (prose in four languages, chat, code)"


def onnx_logits(path: str | Path, cfg: Any, ids: list[int]) -> np.ndarray:
    """The graph's prefill of ids on the CPU (in chunks, as onnx_kl runs it): logits [n, n1] in fp32."""
    from .quantize import onnx_chunks

    return np.concatenate(list(onnx_chunks(path, cfg, ids)))


def onnx_kl(path: str | Path, cfg: Any, ids: list[int], p_logits: Any) -> float:
    """mean_kl(p_logits, onnx_logits(...)) without holding the graph's [n, n1] logits. p_logits: [n, n1], or
    p_logits(a, b) -> its rows a..b (the reference's, made a chunk at a time)."""
    from .quantize import _kl_row, onnx_chunks

    rows, a = [], 0
    for q in onnx_chunks(path, cfg, ids):
        p = p_logits(a, a + len(q)) if callable(p_logits) else p_logits[a:a + len(q)]
        rows += [_kl_row(x, y) for x, y in zip(p, q)]
        a += len(q)
    return float(np.mean(rows))


def states_logits(ref: Any, z: Any, clean: Any = None, scratch: str | Path | None = None) -> Callable[[int, int], np.ndarray]:
    """(a, b) -> the reference's logits of positions a..b [b - a, n1] from its final residual stream z [1, n3, n2]:
    the final norm, then W^8 a chunk at a time. Every position's made at the first call and kept when they fit in
    LOGITS_CACHE_BYTES (W^8 read once, not once per call), else a chunk at a time per call. With SCRATCH, all of
    them made now into an unlinked file there (`spilled_rows`): neither held beside the candidates' sessions (Qwen2.5's
    192 positions: 117 MB) nor made beside them (Gemma's 262,144 tokens: 0.2 GB). clean: Zbar W^{8T} [n3, n1]
    already made (`_clean_logits`)."""
    import torch

    from llama_tools.modeling.model import final_logits

    h = _final(ref)(z)[0]  # Zbar: [n3, n2]
    keep = h.shape[0] * ref.cfg.vocab_size * 4 <= LOGITS_CACHE_BYTES
    made: list[np.ndarray] = []

    def logits(h: Any) -> np.ndarray:
        with torch.no_grad():
            return final_logits(ref.cfg, torch.cat([x for x, _ in _head_chunks(ref, h)], -1)).float().numpy()

    if scratch is not None:  # made before any candidate's session opens, in one pass over W^8 (or from CLEAN)
        from .quantize import spilled_rows

        with torch.no_grad():
            slabs = [clean] if clean is not None else (x for x, _ in _head_chunks(ref, h))  # [n3, <= n1] each
            return spilled_rows((final_logits(ref.cfg, x).numpy() for x in slabs), h.shape[0], ref.cfg.vocab_size,
                                scratch)

    def rows(a: int, b: int) -> np.ndarray:
        if not keep:
            return logits(h[a:b])
        if not made:  # [n3, n1]
            made.append(logits(h) if clean is None else final_logits(ref.cfg, clean).float().numpy())
        return made[0][a:b]
    return rows


# The reference's calibration logits are kept for every candidate graph when they fit in this (Qwen2.5's 151,936
# tokens x 192 positions: 117 MB, and each graph built after the first then skips W^8's 52 GFLOP again); Gemma's
# 262,144 are made again per graph, a chunk at a time.
LOGITS_CACHE_BYTES = 128 * 2**20


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(p || q) in nats, float64 a row at a time."""
    from .quantize import _kl_row

    return float(np.mean([_kl_row(p, q) for p, q in zip(p_logits, q_logits)]))


def reference_logits(ref: Any, ids: list[int]) -> np.ndarray:
    """The streamed fp32 reference's logits on ids: [n, n1]."""
    import torch

    x = torch.tensor([ids])
    return ref(x, torch.ones_like(x)).logits[0].float().numpy()


def quantize_nodes(full: Path, int4: dict[str, Any]) -> list[str]:
    """The MatMuls of the graph at FULL that int4 quantizes (a constant weight, not excluded)."""
    import onnx

    from .quantize import _weights_of

    exclude = set(int4.get("exclude") or ())
    return [n for n in _weights_of(onnx.load(str(full), load_external_data=False)) if n not in exclude]


def untargetable(full: Path, int4: dict[str, Any]) -> str | None:
    """Why the graph at FULL cannot take a target (a MatMul that is no decoder projection), or None."""
    try:
        matrices(quantize_nodes(full, int4))
    except ValueError as e:
        return str(e).removeprefix("--max-kl: ")
    return None


def _shapes(model: Any, nodes: list[str]) -> dict[str, tuple[int, int, bool]]:
    """node -> (K, N, whether its weight is a tied embedding's table)."""
    from .quantize import _weights_of

    inits = {t.name: t for t in model.graph.initializer}
    weights = _weights_of(model)
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    out = {}
    for n in nodes:
        name, transposed = weights[n.split(":")[0]]  # HEAD_PARTS: rows of the head's
        dims = [int(d) for d in inits[name].dims]
        k, rows = (dims[1], dims[0]) if transposed else (dims[0], dims[1])  # stored [out, in] behind a Transpose
        if n in HEAD_PARTS:
            first = frequent_rows(rows)
            rows = first if n == HEAD_FREQUENT else rows - first
        out[n] = k, rows, transposed and name in gathered
    return out


def int4_bytes(model: Any, nodes: list[str], block: int, zero_points: bool = False) -> dict[str, int]:
    """node -> its int4 matrix's bytes: N rows of ceil(K / block) blocks of block / 2 bytes and an fp32 scale, and
    the zero points (two blocks' per byte) when it has them."""
    out = {}
    for n, (k, rows, _) in _shapes(model, nodes).items():
        blocks = -(-k // block)
        out[n] = rows * (blocks * (block // 2 + 4) + (-(-blocks // 2) if zero_points else 0))
    return out


def extra_bytes(model: Any, nodes: list[str], block: int, zero_points: bool = False) -> dict[str, int]:
    """node -> the bytes keeping its matrix 8-bit adds to the int4 graph: N rows of ceil(K / b8) blocks of b8 bytes
    and an fp32 scale (b8 = quantize.eight_bit_block; symmetric, no zero points), less its int4 bytes."""
    from .quantize import eight_bit_block

    four = int4_bytes(model, nodes, block, zero_points)
    out = {}
    for n, (k, rows, tied) in _shapes(model, nodes).items():
        b8 = eight_bit_block(k, tied, block)
        out[n] = rows * -(-k // b8) * (b8 + 4) - four[n]
    return out


def quantize_to_target(full: Path, target: Path, ref: Any, calibration: list[int] | None, goal: Any,
                       int4: dict[str, Any], say: Callable[[str], None] = lambda m: None,
                       progress: Callable[[int, int, str], None] = lambda *a: None,
                       quantize: Callable[..., Any] | None = None,
                       windows: list[list[int]] | None = None) -> tuple[Any, TargetResult]:
    """FULL (the fp32 graph) -> TARGET in int4 with the fewest bytes kept 8-bit that meet `goal` on calibration text.

    goal: nats (an absolute mean KL) or a quant_options.Int4Target (absolute, or a fraction of the all-int4 graph's
    KL, under a size cap). quantize: quantize_int4 (the pipeline passes its own name for it). Returns (the
    quantize_int4 result of the graph written, what the target chose). windows: the text the algorithms that search
    (imatrix, awq) measure each matrix's inputs on (calibration_windows; None: the calibration ids). Candidates are built at TARGET when it is a
    file, else in a directory beside FULL (a stream cannot be read back), and the chosen one is written last.
    """
    import shutil

    import onnx

    from llama_tools.outputs import paths
    from llama_tools.outputs.progress import release_freed_memory

    from .graph_meta import read_metadata
    from . import int4_blocks, int4_scales
    from .quant_options import DEFAULT_ALGORITHM, SEARCHED, Int4Target
    from .quantize import _weights_of, plan_scales, quantize_int4

    quantize = quantize or quantize_int4
    goal = goal if isinstance(goal, Int4Target) else Int4Target(max_kl=float(goal))
    for v, what in ((goal.max_kl, "nats"), (goal.fraction, "a fraction")):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--max-kl must be a positive number ({what}), got {v}")
    if goal.max_kl is None and goal.fraction is None:
        raise ValueError("--max-kl: a target needs nats or a fraction of the all-int4 graph's KL")
    t0 = time.perf_counter()
    full, target = Path(full), Path(target)
    cfg = ref.cfg
    exclude = tuple(int4.get("exclude") or ())
    model = onnx.load(str(full), load_external_data=False)
    nodes = [n for n in _weights_of(model) if n not in exclude]
    if HEAD in nodes:  # the head's first rows, a matrix of their own to the plan, and its others
        nodes = [n for n in nodes if n != HEAD] + list(HEAD_PARTS)
    mats = matrices(nodes)
    block = int4.get("block_size", 32)
    algorithm = int4.get("algorithm", DEFAULT_ALGORITHM)
    zero_points = algorithm in SEARCHED or (algorithm == "rtn" and not int4.get("symmetric", True))
    cost = extra_bytes(model, nodes, block, zero_points)
    base = sum(int4_bytes(model, nodes, block, zero_points).values())  # what a decode step reads of them at int4
    del model
    ids = list(calibration) if calibration is not None else calibration_ids(None, cfg.vocab_size)[0]
    room = read_metadata(full).static_kv or cfg.max_position_embeddings  # a static-KV graph holds that many
    ids = ids[: min(len(ids), room)]
    emulate, measured = None, 0
    stages: dict[str, float] = {}  # seconds each step took, from t0
    through = paths.written_through(target)
    work = full.parent / "int4-candidates"
    work.mkdir(exist_ok=True)
    try:  # the candidates and the searched blocks live in WORK until the answer is written
        if algorithm in SEARCHED:
            text = [w[:room] for w in windows] if windows else [ids]
            measured = sum(map(len, text))
            say(f"measuring each matrix's inputs on {measured} calibration tokens")
            weights = importance(ref, text, nodes, progress)
            stages["importance"] = time.perf_counter() - t0
            release_freed_memory()  # the windows' activations are not the sensitivity pass's floor
            int4 = {**int4, "importance": weights}
            scales = None
            if algorithm == int4_scales.ALGORITHM:  # searched once, for every candidate graph and the emulation
                say("searching each matrix's input scales")
                scales = int4["scales"] = plan_scales(full, weights, block, exclude, progress)
                stages["scales"] = time.perf_counter() - t0 - sum(stages.values())
            # every int4 block searched once, here or by the first graph, then read by the emulation and each graph
            store = int4_blocks.BlockStore(work / "blocks")
            int4["store"] = store
            emulate = stored_emulation(store, full, weights, block, scales)
        say(f"measuring each of {len(mats)} matrices' int4 error on {len(ids)} calibration tokens")
        states: list[Any] = []
        sens = sensitivities(ref, ids, mats, block, progress, states, emulate)
        release_freed_memory()  # the boundaries' streams and the probes are gone
        stages["sensitivity"] = time.perf_counter() - t0 - sum(stages.values())  # with the blocks it first searched
        p = states_logits(ref, *states, scratch=work)
        states.clear()  # the stream and its clean logits: in the file now, not under the sessions' peak
        release_freed_memory()
        where = work / "model.onnx" if through else target
        last: list[Any] = [None, None]  # the last quantize_int4 result, and its kept set

        def build(kept: list[str]) -> tuple[float, int]:
            say(f"int4 with {len(kept)} of {len(mats)} matrices 8-bit")
            last[0], last[1] = quantize(full, where, **{**int4, "keep_8bit": tuple(kept)}), list(kept)
            release_freed_memory()  # the quantizer's garbage is not the session's floor (as the pipeline does)
            kl = onnx_kl(where, cfg, ids, p)
            release_freed_memory()  # nor the session's the next candidate's
            return kl, last[0].bytes_after
        result = choose(sens, goal.max_kl, build, fraction=goal.fraction, cost=cost, size_cap=goal.size_cap, base=base)
        if through or last[1] != result.kept_8bit:  # the answer is not what is at TARGET now
            say(f"writing int4 with {len(result.kept_8bit)} of {len(mats)} matrices 8-bit")
            last[0] = quantize(full, target, **{**int4, "keep_8bit": tuple(result.kept_8bit)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.calibration_tokens, result.importance_tokens = len(ids), measured
    result.seconds = time.perf_counter() - t0
    result.stage_seconds = {**stages, "graphs": result.seconds - sum(stages.values())}  # built, measured, written
    return last[0], result
