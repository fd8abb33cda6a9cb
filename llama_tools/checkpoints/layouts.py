"""Tensor layout conversions between checkpoint formats: the one place they live.

- RoPE row order of W^{j1} (q) and W^{j2} (k). Meta stores each head's rows in the paper's
  interleaved order, pairs (x0, x1), (x2, x3), ... rotate together; HF permutes them so that
  x_i rotates with x_{i + n6/2} (rotate_half). The permutation works per head, so k uses the
  number of KV heads: using the query head count there is the classic GQA bug.
- Fused q/k/v: Baichuan's W_pack and Phi-3's qkv_proj concatenate q, k, v rows; InternLM2's wqkv groups them per KV
  head. Fused gate/up: Phi-3's gate_up_proj concatenates gate and up rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..modeling.rope_layouts import HALF, INTERLEAVED

if TYPE_CHECKING:
    from ..modeling.config import ModelConfig


def _check_rows(w: torch.Tensor, n_heads: int, what: str) -> int:
    rows = w.shape[0]
    assert rows % n_heads == 0 and (rows // n_heads) % 2 == 0, (
        f"{what}: {rows} rows do not split into {n_heads} heads of an even width")
    return rows // n_heads


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta -> HF: per head, rows (0, 1, 2, 3, ...) reorder to (0, 2, 4, ..., 1, 3, 5, ...)."""
    n6 = _check_rows(w, n_heads, "interleaved_to_half")
    rest = w.shape[1:]
    w = w.reshape(n_heads, n6 // 2, 2, *rest)  # [heads, n6/2 pairs, 2, n2...]
    return w.transpose(1, 2).reshape(n_heads * n6, *rest)  # [heads * n6, n2...], evens first then odds


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF -> Meta: the inverse of `interleaved_to_half`."""
    n6 = _check_rows(w, n_heads, "half_to_interleaved")
    rest = w.shape[1:]
    w = w.reshape(n_heads, 2, n6 // 2, *rest)  # [heads, 2 halves, n6/2, n2...]
    return w.transpose(1, 2).reshape(n_heads * n6, *rest)  # [heads * n6, n2...], halves interleaved


def permute_rope_rows(state: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int,
                      src: str, dst: str) -> dict[str, torch.Tensor]:
    """Reorder every q/k projection (HF names, weights and biases) from layout `src` to `dst`."""
    if src == dst:
        return state
    assert {src, dst} == {HALF, INTERLEAVED}, f"unknown RoPE layouts {src!r} -> {dst!r}"
    fn = interleaved_to_half if dst == HALF else half_to_interleaved
    out = dict(state)
    for name, w in state.items():
        if ".self_attn.q_proj." in name:
            out[name] = fn(w, n_heads)
        elif ".self_attn.k_proj." in name:
            out[name] = fn(w, n_kv_heads)  # K has n_kv_heads heads, not n_heads
    return out


def split_qkv(w: torch.Tensor, fused: str, n_heads: int, n_kv_heads: int, head_dim: int,
              name: str) -> list[torch.Tensor]:
    """A fused q/k/v tensor -> [q, k, v]: "concat" (Baichuan's W_pack) is cat(q, k, v); "grouped" (InternLM2's wqkv):

    InternLM2 stores, per KV head g, its n_rep query heads then its k head then its v head:
    rows = [q_{g,0} .. q_{g,n_rep-1}, k_g, v_g] for g = 0 .. kv-1, each block n6 rows.
    """
    q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    if fused == "concat":
        return split_rows(w, [q_rows, kv_rows, kv_rows], name)
    assert fused == "grouped", f"unknown q/k/v fusion {fused!r}"
    if w.shape[0] != q_rows + 2 * kv_rows:
        raise ValueError(f"tensor {name}: fused rows {w.shape[0]} != {q_rows} + 2 * {kv_rows} that the config predicts")
    n_rep = n_heads // n_kv_heads
    g = w.reshape(n_kv_heads, n_rep + 2, head_dim, *w.shape[1:])  # [kv, n_rep + 2, n6, n2...]
    q = g[:, :n_rep].reshape(q_rows, *w.shape[1:])  # [kv * n_rep * n6, n2...]: query head h = g * n_rep + r
    k = g[:, n_rep].reshape(kv_rows, *w.shape[1:])  # [kv * n6, n2...]
    v = g[:, n_rep + 1].reshape(kv_rows, *w.shape[1:])
    return [q, k, v]


def fuse_qkv(parts: list[torch.Tensor], fused: str, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[q, k, v] -> one tensor fused as `fused` (formats.FusedQKV); the inverse of `split_qkv`."""
    if fused == "concat":
        return fuse_rows(parts)
    assert fused == "grouped", f"unknown q/k/v fusion {fused!r}"
    q, k, v = parts
    n_rep, rest = n_heads // n_kv_heads, q.shape[1:]
    q = q.reshape(n_kv_heads, n_rep, head_dim, *rest)  # [kv, n_rep, n6, n2...]
    k = k.reshape(n_kv_heads, 1, head_dim, *rest)  # [kv, 1, n6, n2...]
    v = v.reshape(n_kv_heads, 1, head_dim, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)  # [kv * (n_rep + 2) * n6, n2...]


def split_parts(w: torch.Tensor, parts: tuple[str, ...], fused: str, cfg: "ModelConfig",
                name: str) -> list[torch.Tensor]:
    """A stored tensor holding several module weights (formats.CheckpointTensor.parts) -> those weights."""
    if parts[0].endswith("mlp.gate_proj.weight"):  # Phi-3's gate_up_proj: cat(gate, up)
        return split_rows(w, [cfg.intermediate_size] * len(parts), name)
    return split_qkv(w, fused, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, name)


def fuse_parts(ws: list[torch.Tensor], parts: tuple[str, ...], fused: str, cfg: "ModelConfig") -> torch.Tensor:
    """The inverse of split_parts."""
    if parts[0].endswith("mlp.gate_proj.weight"):
        return fuse_rows(ws)
    return fuse_qkv(ws, fused, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def split_rows(w: torch.Tensor, sizes: list[int], name: str) -> list[torch.Tensor]:
    """A fused tensor (W_pack = cat(q, k, v) along dim 0) -> its parts."""
    if w.shape[0] != sum(sizes):
        raise ValueError(f"tensor {name}: fused rows {w.shape[0]} != {' + '.join(map(str, sizes))} "
                         f"that the config predicts")
    return list(torch.split(w, sizes, dim=0))


def fuse_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """q, k, v -> W_pack, concatenated along the output (row) axis."""
    return torch.cat(parts, dim=0)
