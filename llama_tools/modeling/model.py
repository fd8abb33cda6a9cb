"""A readable LLaMA in PyTorch, in the order of the paper ("LLAMA-2 的数学形式", seed 000).

Symbols: n1 vocab, n2 width, n3 sequence length, n5 heads, n6 head width, n7 FFN width, n8 layers.
Rows are tokens (the paper's row-major convention): Z^j is n3 x n2, and X W^T is a Linear layer.
Parameter names equal HF's, so an HF state dict loads as is (see weights.py for the full table).
Beyond the paper: grouped-query attention, a KV cache, ALiBi, Qwen2 biases, Mixtral and Qwen3-MoE experts, and the
families' overrides (families.py): Qwen3's and Gemma 3's q/k norms, Gemma's (1 + γ) norms, GELU gate, scaled
embeddings, Gemma 2/3's norms after attention and FFN, logit soft-capping and local/global layers; GPT-NeoX's and
Falcon's LayerNorms with biases, plain GELU MLP and parallel attention + FFN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import pass_key, per_pass, rope_attention_factor, rope_inv_freq
from .rope_layouts import INTERLEAVED

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (K, V): [batch, kv_heads, past, n6]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # H: [batch, n3, n1]
    past_key_values: KVCache


# --- Section 2: functions ----------------------------------------------------------------------

def wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32: norms, RoPE and softmax run in fp32 for fp16/bf16/fp32, in float64 for a float64 truth."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """rnorm(X): each row divided by its root mean square, then scaled by a learned gain.

    The paper's rnor has no gain; checkpoints do (one vector per norm). Gemma's gain is (1 + γ).
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False, wide_gain: bool = False):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.wide_gain = wide_gain
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 and cast back before the gain, as Meta and HF do. x / sigma (the paper's rnor)
        # rather than x * rsqrt: onnxruntime fuses exactly Pow-ReduceMean-Add-Sqrt-Div into one RMSNorm.
        x32 = wide(x)
        sigma = torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., 1]: one sigma_i per row
        if self.plus_one:  # Gemma applies its gain in fp32, then casts
            return ((x32 / sigma) * (1.0 + wide(self.weight))).to(x.dtype)
        if self.wide_gain:  # OLMo 2 too
            return ((x32 / sigma) * wide(self.weight)).to(x.dtype)
        return self.weight * (x32 / sigma).to(x.dtype)


def norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The family's norm over n2 (or `dim`): RMSNorm (OLMo 2, as Gemma, applies its gain in fp32 before the cast),
    or GPT-NeoX's and Falcon's LayerNorm, (X - mean) / sqrt(var + eps) γ + β, in the input's dtype as theirs."""
    if cfg.norm_kind == "layer":
        return nn.LayerNorm(cfg.hidden_size if dim is None else dim, eps=cfg.rms_norm_eps)
    return RMSNorm(cfg.hidden_size if dim is None else dim, cfg.rms_norm_eps, cfg.norm_plus_one,
                   wide_gain=cfg.post_norms)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap: cap tanh(x / cap), which keeps |x| < cap and is x near 0; identity when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def embedding_scale(cfg: ModelConfig, z: torch.Tensor) -> torch.Tensor:
    """Z^0 as the family scales D's rows: Gemma's sqrt(n2) rounded to z's dtype first (as HF does), Granite's
    embedding_multiplier a Python float (as HF multiplies); others as they are."""
    if cfg.embed_scale:
        return z * torch.tensor(math.sqrt(cfg.hidden_size), dtype=z.dtype)
    return z * cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0 else z


def final_logits(cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """H as the family finishes it: Granite divides by logits_scaling, Gemma 2 soft-caps; any slab of columns alike."""
    if cfg.logits_scaling != 1.0:
        h = h / cfg.logits_scaling
    return softcap(h, cfg.final_logit_softcap)


ACTIVATION = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}  # ACTIVATIONS


def rope_cache(cfg: ModelConfig, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32, local: bool = False,
               length: int | None = None, seq_len: int | None = None,
               rotation_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(i θ̄_t), sin(i θ̄_t) for every position i < max_position_embeddings (or `length`): [max_pos, r/2] with r
    the rotary width (n6, or rotary_dim under partial rotary), fp32 (or `dtype`); times yarn's or longrope's
    attention factor, as transformers scales them.

    local: the sliding layers' tables (Gemma 3: base rope_local_theta, no scaling).
    seq_len: the pass's length, for the scalings whose tables depend on it (dynamic, longrope: rope.py).
    rotation_only: without the attention factor (a rotation by the angles alone, as turning keys back needs).
    """
    if local:
        cfg = cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=None)
    inv_freq = torch.tensor(rope_inv_freq(cfg, seq_len), dtype=torch.float64, device=device)  # θ̄_t, t = 0, 2, ...
    pos = torch.arange(cfg.max_position_embeddings if length is None else length, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)  # [max_pos, rotary_dim/2]: i θ̄_t
    scale = 1.0 if rotation_only else rope_attention_factor(cfg)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


RopeTables = tuple[torch.Tensor, ...]  # (cos, sin), then the sliding layers' (cos, sin) when they differ


def rope_tables_of(cfg: ModelConfig, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32, length: int | None = None,
                   seq_len: int | None = None, rotation_only: bool = False) -> RopeTables | None:
    """Every table the layers read: (cos, sin), plus the local layers' pair when cfg has a local base; None: ALiBi.

    length: positions 0..length-1 only (default: max_position_embeddings).
    seq_len: the pass's length (its largest position + 1) for dynamic and longrope (rope.py); their tables then
    cover at least seq_len positions. None: a pass within the original context.
    rotation_only: cos and sin of the angles alone, without yarn's or longrope's attention factor."""
    if cfg.position_encoding != "rope":
        return None
    if seq_len is not None and per_pass(cfg):
        length = max(length or cfg.max_position_embeddings, seq_len)
    tables = rope_cache(cfg, device, dtype, length=length, seq_len=seq_len, rotation_only=rotation_only)
    return tables + rope_cache(cfg, device, dtype, local=True, length=length) if cfg.rope_local_theta is not None \
        else tables


def layer_tables(tables: RopeTables | None, sliding: bool) -> RopeTables | None:
    """The (cos, sin) pair a layer rotates with: the local one for a sliding layer when there is one."""
    if tables is None:
        return None
    return tables[2:4] if sliding and len(tables) == 4 else tables[:2]


def rope(x: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
         interleaved: bool) -> torch.Tensor:
    """rope(x, i) = x ⊗ ξ1 + x' ⊗ ξ2: row i of every head rotated by the angles i θ̄_t, θ̄_t = base^(-t/n6).

    ξ1 = (cos i θ̄_0, cos i θ̄_0, cos i θ̄_2, ...), ξ2 likewise with sin; x' pairs each channel with its
    partner, negated first: x' = (-x1, x0, -x3, x2, ...) when interleaved (the paper, Meta), or
    (-x_{n6/2..}, x_{..n6/2}) in HF's half-split layout. Per pair (x0, x1) that is
    (x0 cos - x1 sin, x1 cos + x0 sin), written once below; the layout only picks the pairs.
    Partial rotary: the tables are r/2 wide for a rotary width r < n6 (rotary_dim); the first r channels of each
    head rotate as above (pairs within them), the other n6 - r pass through unchanged (transformers' q[..., :r]).
    x: [batch, heads, n3, n6]; position_ids: [batch, n3]; caches: [max_pos, r/2] in fp32.
    """
    cos = cos_cache[position_ids].unsqueeze(1)  # ξ1's distinct values: [batch, 1, n3, r/2]
    sin = sin_cache[position_ids].unsqueeze(1)  # ξ2's: [batch, 1, n3, r/2]
    r = 2 * cos_cache.shape[-1]  # the rotary width: n6, or the first r channels of a partial rotary
    xf = wide(x)
    xr, passed = (xf, None) if r == x.shape[-1] else (xf[..., :r], xf[..., r:])
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]  # [batch, heads, n3, r/2] each
    else:
        x0, x1 = xr.chunk(2, dim=-1)  # [batch, heads, n3, r/2] each
    y0, y1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin
    if interleaved:
        out = torch.stack((y0, y1), dim=-1).flatten(-2)  # [..., r/2, 2] -> [batch, heads, n3, r]
    else:
        out = torch.cat((y0, y1), dim=-1)  # [batch, heads, n3, r]
    if passed is not None:
        out = torch.cat((out, passed), dim=-1)  # [batch, heads, n3, n6]: the channels past r as they were
    return out.to(x.dtype)


# RoPE as one opaque torch op: eager runs `rope`; torch.export keeps it as a single call, which the
# ONNX exporter translates to one node (exporters/rope_ops.py). Its gradient is the inverse rotation.
@torch.library.custom_op("llama_tools::rope", mutates_args=())
def rope_op(x: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """`rope` as a torch custom op."""
    return rope(x, position_ids, cos_cache, sin_cache, interleaved)


@rope_op.register_fake
def _(x, position_ids, cos_cache, sin_cache, interleaved):
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output) -> None:
    _, position_ids, cos_cache, sin_cache, interleaved = inputs
    ctx.save_for_backward(position_ids, cos_cache, sin_cache)
    ctx.interleaved = interleaved


def _rope_backward(ctx, grad):
    position_ids, cos_cache, sin_cache = ctx.saved_tensors
    # A rotation's transpose is the rotation by -θ: same cos, negated sin.
    return rope(grad, position_ids, cos_cache, -sin_cache, ctx.interleaved), None, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


class RotaryEmbedding(nn.Module):
    """Qbar = rope(Q) (or Kbar = rope(K)): a module so that its node is named by its path (.../q_rope)."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.export: the one opaque op
            return rope_op(x, position_ids, tables[0], tables[1], self.interleaved)
        # eager: the same function, called directly (a custom op's first call imports torch._dynamo, 2.5 s)
        return rope(x, position_ids, tables[0], tables[1], self.interleaved)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes m_h (Press et al.), as Baichuan-13B computes them for any head count."""
    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = pow2(closest)
    if closest < n_heads:
        slopes += pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


# --- Section 5: the mask M ---------------------------------------------------------------------

def attention_bias(cfg: ModelConfig, n3: int, past: int, attention_mask: torch.Tensor | None,
                   dtype: torch.dtype, device: torch.device, sliding: bool = True) -> torch.Tensor:
    """M (+ ALiBi, + padding): [batch, 1 or n5, n3, past + n3], 0 where allowed, dtype's minimum elsewhere.

    The paper's -inf is the dtype's minimum, as it says, so a fully padded row stays finite.
    sliding: apply cfg's sliding window (False: the full causal mask of Gemma's global layers).
    """
    total = past + n3
    q_pos = torch.arange(past, total, device=device)[:, None]  # [n3, 1]
    k_pos = torch.arange(total, device=device)[None, :]  # [1, past + n3]
    allowed = k_pos <= q_pos  # causal: key j visible from query i when j <= i
    if sliding and cfg.sliding_window is not None:
        allowed = allowed & (q_pos - k_pos < cfg.sliding_window)
    allowed = allowed[None, None]  # [1, 1, n3, total]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()  # [batch, 1, n3, total]
    neg = torch.finfo(dtype).min
    wide_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # holds the fill value exactly
    bias = torch.zeros(allowed.shape, dtype=wide_dtype, device=device).masked_fill(~allowed, neg)
    if cfg.position_encoding == "alibi":
        # -m_h (i - j): a per-head penalty growing with the distance to the key.
        slopes = alibi_slopes(cfg.num_attention_heads).to(device)[None, :, None, None]  # [1, n5, 1, 1]
        dist = (q_pos - k_pos).float()[None, None]  # [1, 1, n3, total]
        bias = torch.where(allowed, bias - slopes * dist, bias)  # [batch, n5, n3, total]
    return bias.to(dtype)


def layer_masks(cfg: ModelConfig, n3: int, past: int, attention_mask: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> dict[bool, torch.Tensor]:
    """M for each kind of layer the model has: {sliding: bias}; Gemma 2/3 mix sliding and full layers."""
    kinds = {cfg.slides(j) for j in range(cfg.num_hidden_layers)}
    return {s: attention_bias(cfg, n3, past, attention_mask, dtype, device, sliding=s) for s in kinds}


def positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: int) -> torch.Tensor:
    """Position i of each new token: [b, n3]. Left padding counts real tokens only, so a padded row
    gets the positions (and the numbers) of its unpadded run."""
    b, n3 = input_ids.shape
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # [b, past + n3] -> [b, n3]
    return torch.arange(past, past + n3, device=input_ids.device).expand(b, n3)


# --- Section 6: the decoder --------------------------------------------------------------------

class Attention(nn.Module):
    """Self-attention sublayer (6.2) with grouped-query heads and a KV cache."""

    def __init__(self, cfg: ModelConfig, j: int = 0):
        super().__init__()
        self.cfg = cfg
        self.rotates = cfg.rotates(j)  # SmolLM3: some layers attend without RoPE
        n2 = cfg.hidden_size
        self.q_proj = nn.Linear(n2, cfg.q_size, bias=cfg.qkv_bias)  # W^{j1}: (n5 n6) x n2
        self.k_proj = nn.Linear(n2, cfg.kv_size, bias=cfg.qkv_bias)  # W^{j2}: (kv_heads n6) x n2
        self.v_proj = nn.Linear(n2, cfg.kv_size, bias=cfg.qkv_bias)  # W^{j3}: (kv_heads n6) x n2
        self.o_proj = nn.Linear(cfg.q_size, n2, bias=cfg.o_bias)  # W^{j4}: n2 x (n5 n6)
        if cfg.qk_norm:  # Qwen3, Gemma 3: one gain of n6 shared by every q head, one by every k head; OLMo 2: one
            # gain over the whole projection (n5 n6 and kv n6)
            q, k = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
            self.q_norm, self.k_norm = norm(cfg, q), norm(cfg, k)
        interleaved = cfg.rope_layout == INTERLEAVED
        self.q_rope, self.k_rope = RotaryEmbedding(interleaved), RotaryEmbedding(interleaved)

    def forward(self, zbar: torch.Tensor, bias: torch.Tensor, position_ids: torch.Tensor,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        b, n3, _ = zbar.shape
        # Q^j = Zbar^j W^{j1 T}, split by columns into n5 blocks Q^{j,i} of n3 x n6.
        q, k = self.q_proj(zbar), self.k_proj(zbar)  # [b, n3, n5 n6], [b, n3, kv n6]
        if cfg.qk_norm and cfg.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # OLMo 2: each row normalized over the whole projection
        q = q.view(b, n3, cfg.num_attention_heads, cfg.head_dim)  # [b, n3, n5, n6]
        k = k.view(b, n3, cfg.num_key_value_heads, cfg.head_dim)  # [b, n3, kv, n6]
        if cfg.qk_norm and not cfg.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's row normalized over its n6
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, n5 or kv, n3, n6]
        v = self.v_proj(zbar).view(b, n3, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # [b, kv, n3, n6]
        if rope_tables is not None and self.rotates:
            q = self.q_rope(q, position_ids, rope_tables)  # Qbar^{j,i} = rope(Q^{j,i})
            k = self.k_rope(k, position_ids, rope_tables)  # Kbar^{j,i} = rope(K^{j,i})
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # [b, kv, past + n3, n6]
            v = torch.cat((past[1], v), dim=2)
        present = (k, v)
        # Grouped-query attention: each K/V head serves n_rep consecutive query heads.
        if cfg.n_rep > 1:
            k = k.repeat_interleave(cfg.n_rep, dim=1)  # [b, n5, past + n3, n6]
            v = v.repeat_interleave(cfg.n_rep, dim=1)
        # U^{j,i} = smax(Qbar Kbar^T / sqrt(n6) + M) V, softmax in fp32 as the references do; Gemma scales by
        # its own scalar, Granite multiplies by its own, and Gemma 2 caps the scores before the mask.
        qk = q @ k.transpose(-1, -2)  # [b, n5, n3, past + n3]
        qk = qk * cfg.attention_multiplier if cfg.attention_multiplier is not None \
            else qk / math.sqrt(cfg.attention_scale)
        scores = softcap(qk, cfg.attn_logit_softcap)
        scores = scores + bias  # [b, n5, n3, past + n3]
        probs = torch.softmax(wide(scores), dim=-1).to(q.dtype)
        u = probs @ v  # [b, n5, n3, n6]
        u = u.transpose(1, 2).reshape(b, n3, cfg.q_size)  # U^j = [U^{j,0}, ..., U^{j,n5-1}]: [b, n3, n5 n6]
        return self.o_proj(u), present  # R^j = U^j W^{j4 T}


class FeedForward(nn.Module):
    """SwiGLU (6.4): Yhat = (silu(Ybar W^{j5 T}) ⊗ (Ybar W^{j7 T})) W^{j6 T}; Gemma's GeGLU puts GELU for silu.

    gated=False (GPT-NeoX, Falcon): no gate, Yhat = gelu(Ybar W^{j7 T} + b^{j7}) W^{j6 T} + b^{j6}.
    """

    def __init__(self, n2: int, n7: int, bias: bool = False, act: str = "silu", gated: bool = True):
        super().__init__()
        self.act = ACTIVATION[act]
        if gated:
            self.gate_proj = nn.Linear(n2, n7, bias=bias)  # W^{j5}: n7 x n2
        self.up_proj = nn.Linear(n2, n7, bias=bias)  # W^{j7}: n7 x n2 (GPT-NeoX's and Falcon's dense_h_to_4h)
        self.down_proj = nn.Linear(n7, n2, bias=bias)  # W^{j6}: n2 x n7 (dense_4h_to_h)

    def forward(self, ybar: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_proj"):
            return self.down_proj(self.act(self.up_proj(ybar)))  # [b, n3, n7] -> [b, n3, n2]
        return self.down_proj(self.act(self.gate_proj(ybar)) * self.up_proj(ybar))  # [b, n3, n7] -> [b, n3, n2]


class MixtureOfExperts(nn.Module):
    """Mixtral's and Qwen3-MoE's sparse FFN: a router picks k experts per token, their outputs weighted by the
    softmax over all experts, the k weights renormalized to sum 1 (always in Mixtral; Qwen3-MoE's norm_topk_prob)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router: experts x n2
        self.experts = nn.ModuleList(FeedForward(cfg.hidden_size, cfg.moe_intermediate_size, act=cfg.hidden_act)
                                     for _ in range(cfg.num_experts))

    def forward(self, ybar: torch.Tensor) -> torch.Tensor:
        b, n3, n2 = ybar.shape
        x = ybar.reshape(-1, n2)  # [b n3, n2]
        weights, chosen = torch.topk(torch.softmax(self.gate(x).float(), dim=-1), self.k, dim=-1)  # [b n3, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)  # [b n3, 1], 0 where e was not chosen
            out = out + w * expert(x)
        return out.view(b, n3, n2)  # [b n3, n2] -> [b, n3, n2]


class DecoderLayer(nn.Module):
    """Decoder j: Z^j -> Z^{j+1} (6.1-6.4).

    Gemma 2/3 ("sandwich" norms) also normalize what attention and the FFN add, before each residual; there
    HF's post_attention_layernorm is that norm after attention, and pre_feedforward_layernorm is 6.3's. OLMo 2
    ("post" norms) keeps only those two norms after: attention and the FFN read the residual stream itself.
    GPT-NeoX and Falcon ("parallel"): attention and the FFN both read Z^j, Z^{j+1} = Z^j + (R^j + Yhat^j); the FFN's
    norm is post_attention_layernorm (Falcon's ln_mlp), or input_layernorm itself when one norm feeds both.
    """

    def __init__(self, cfg: ModelConfig, j: int = 0):
        super().__init__()
        self.sliding = cfg.slides(j)  # this layer's mask and RoPE tables are the local ones
        self.residual_multiplier = cfg.residual_multiplier  # Granite: R and Yhat scaled before each residual
        self.post_norms = cfg.post_norms
        self.parallel, self.shared_norm = cfg.parallel_residual, cfg.shared_norm
        if not cfg.post_norms:
            self.input_layernorm = norm(cfg)
        self.self_attn = Attention(cfg, j)
        if not cfg.shared_norm:
            self.post_attention_layernorm = norm(cfg)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(cfg), norm(cfg)
        elif cfg.post_norms:
            self.post_feedforward_layernorm = norm(cfg)
        if cfg.is_moe:
            self.block_sparse_moe = MixtureOfExperts(cfg)
        else:
            self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, act=cfg.hidden_act,
                                   gated=cfg.gated_mlp)

    def forward(self, z: torch.Tensor, bias: torch.Tensor, position_ids: torch.Tensor,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        y, present = self.attend(z, bias, position_ids, rope_tables, past)  # Y^j (parallel: R^j)
        return self.feed_forward(y, z), present

    # The two halves apart, so a streamed reference can hold one half's weights at a time.
    def attend(self, z: torch.Tensor, bias: torch.Tensor, position_ids: torch.Tensor,
               rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
               past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """6.1-6.2: Z^j -> Y^j and the layer's K/V; in the parallel form R^j alone (feed_forward adds it)."""
        zbar = z if self.post_norms else self.input_layernorm(z)  # Zbar^j = rnorm(Z^j): [b, n3, n2]
        r, present = self.self_attn(zbar, bias, position_ids, rope_tables, past)
        if self.parallel:
            return r, present  # R^j: [b, n3, n2]
        if hasattr(self, "post_feedforward_layernorm"):
            r = self.post_attention_layernorm(r)  # Gemma 2/3, OLMo 2: R^j normalized before the residual
        if self.residual_multiplier != 1.0:
            r = r * self.residual_multiplier
        return z + r, present  # Y^j = Z^j + R^j

    def feed_forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """6.3-6.4: Y^j -> Z^{j+1}; in the parallel form y is R^j and z the layer's input Z^j."""
        if self.parallel:
            if z is None:
                raise ValueError("the parallel block's FFN reads the layer's input Z^j: pass it as z")
            ln = self.input_layernorm if self.shared_norm else self.post_attention_layernorm
            yhat = self.mlp(ln(z))  # Yhat^j = FFN(norm(Z^j)): [b, n3, n2]
            return z + (y + yhat)  # Z^{j+1} = Z^j + (R^j + Yhat^j), summed in transformers' order
        if self.post_norms:  # OLMo 2: the FFN reads Y^j itself
            ybar = y
        elif hasattr(self, "pre_feedforward_layernorm"):  # Gemma 2/3
            ybar = self.pre_feedforward_layernorm(y)
        else:
            ybar = self.post_attention_layernorm(y)  # Ybar^j = rnorm(Y^j)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        yhat = ffn(ybar)
        if hasattr(self, "post_feedforward_layernorm"):
            yhat = self.post_feedforward_layernorm(yhat)
        if self.residual_multiplier != 1.0:
            yhat = yhat * self.residual_multiplier
        return y + yhat  # Z^{j+1} = Y^j + Yhat^j


class Backbone(nn.Module):
    """Embedding D and the n8 decoders plus the final rnorm; named `model` as in HF checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # D: n1 x n2
        self.layers = nn.ModuleList(DecoderLayer(cfg, j) for j in range(cfg.num_hidden_layers))
        self.norm = norm(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Z^0: row t_i of D for each token, scaled as the family scales it (embedding_scale)."""
        return embedding_scale(self.cfg, self.embed_tokens(input_ids))  # [b, n3, n2]


class Llama(nn.Module):
    """The whole model: token ids -> logits H (section 7), with an optional KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # W^8: n1 x n2
        tie_weights(self)
        # cos/sin tables: plain attributes, not buffers, so that .half() leaves them in fp32.
        self._rope_tables: RopeTables | None = None

    def rope_tables(self, device: torch.device) -> RopeTables | None:
        """cos/sin of every position (fp32, cached per device); None under ALiBi."""
        if self.cfg.position_encoding != "rope":
            return None
        if self._rope_tables is None or self._rope_tables[0].device != device:
            self._rope_tables = rope_tables_of(self.cfg, device)
        return self._rope_tables

    def pass_tables(self, device: torch.device, position_ids: torch.Tensor) -> RopeTables | None:
        """The tables of this pass: the model's own, or for dynamic and longrope those of its length (its largest
        position + 1), made anew when that length changes (rope.py: transformers' per-call semantics)."""
        if not per_pass(self.cfg):
            return self.rope_tables(device)
        seq_len = int(position_ids.max()) + 1 if position_ids.numel() else 1
        key = (pass_key(self.cfg, seq_len), device)  # longrope: two tables; dynamic: one within the context
        if getattr(self, "_pass_key", None) != key:
            self._pass_tables = rope_tables_of(self.cfg, device, seq_len=seq_len)  # >= max_position_embeddings rows
            self._pass_key = key
        return self._pass_tables

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                rope_tables: RopeTables | None = None) -> CausalLMOutput:
        """input_ids [batch, n3]; attention_mask [batch, past + n3] (1 keep, 0 pad); past K/V per layer.

        rope_tables: cos/sin caches to use instead of the model's own (the exporter passes them as inputs).
        """
        n3 = input_ids.shape[1]
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None:
            position_ids = positions(input_ids, attention_mask, past)  # t: [b, n3]
        z = self.model.embed(input_ids)  # Z^0: [b, n3, n2], row t_i = row \hat t_i of D
        masks = layer_masks(self.cfg, n3, past, attention_mask, z.dtype, z.device)  # M: [b or 1, 1 or n5, n3, past + n3]
        tables = rope_tables if rope_tables is not None else self.pass_tables(z.device, position_ids)
        presents = []
        for j, layer in enumerate(self.model.layers):
            z, present = layer(z, masks[layer.sliding], position_ids, layer_tables(tables, layer.sliding),
                               past_key_values[j] if past_key_values else None)
            presents.append(present)
        zbar = self.model.norm(z)  # Zbar^{n8} = rnorm(Z^{n8})
        w = F.normalize(self.lm_head.weight, dim=-1) if self.cfg.norm_head else self.lm_head.weight
        logits = final_logits(self.cfg, zbar @ w.T)  # H = Zbar^{n8} W^{8 T}: [b, n3, n1]
        return CausalLMOutput(logits=logits, past_key_values=tuple(presents))


# --- Section 8: the fine-tuning loss ------------------------------------------------------------

def lm_loss(logits: torch.Tensor, input_ids_or_labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """L = -sum_{i: tbar_i != -100} log smax(Hbar)_{i, tbar_i}, with tbar the labels shifted by one.

    reduction "sum" is the paper's form; "mean" divides by the number of unmasked labels (HF's).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    hbar = logits[:, :-1, :].float()  # drop H's last row: [b, n3 - 1, n1]
    tbar = input_ids_or_labels[:, 1:]  # tbar_i = \hat t_{i+1}: [b, n3 - 1]
    return F.cross_entropy(hbar.reshape(-1, hbar.shape[-1]), tbar.reshape(-1), ignore_index=-100, reduction=reduction)


# --- Construction -------------------------------------------------------------------------------

def tie_weights(model: Llama) -> Llama:
    """W^8 = D when the config ties them (one tensor, as checkpoints store it), after any re-assignment."""
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def build_model(cfg: ModelConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, init_std: float = 0.02) -> Llama:
    """A model with seeded N(0, init_std) weights and unit norm gains (or empty on the meta device), in eval mode."""
    with torch.device("meta"):
        model = Llama(cfg)
    if str(device) == "meta":
        return model.to(dtype).eval()
    model = tie_weights(model.to_empty(device="cpu"))  # to_empty replaces each tensor separately: tie again
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if cfg.norm_plus_one else 1.0)  # the identity gain
            elif name.endswith("norm.bias"):
                p.zero_()  # LayerNorm's β
            else:
                p.normal_(0.0, init_std, generator=gen)
    return model.to(device=device, dtype=dtype).eval()


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: str | torch.device = "cpu", consume: bool = False) -> Llama:
    """Assign tensors into a Llama built on the meta device (no random init), cast to dtype.

    consume=True empties `state` while casting, one tensor at a time, so that peak memory stays
    near one copy of the model instead of the stored copy plus the cast one.
    """
    model = build_model(cfg, device="meta", dtype=dtype)
    source = state if consume else dict(state)
    state = {k: source.pop(k).to(dtype=dtype) for k in list(source)}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    tie_weights(model)
    return model.to(device).eval()
