"""Section 7: the next token from the last row of H, with the paper's score corrections, through the KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..modeling import dtypes
from ..modeling.config import ModelConfig
from ..modeling.model import Llama
from .sampling import check_sampling


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    seconds: float
    stopped_by: str  # "eos" or "length"

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else float("inf")


def apply_repetition_penalty(phi: torch.Tensor, seen: torch.Tensor, alpha1: float) -> torch.Tensor:
    """7.1: for every id i already in the sequence, phi_i < 0 -> alpha1 phi_i, phi_i >= 0 -> phi_i / alpha1.

    phi: [n1] or [batch, n1]; seen: ids (any shape for 1-D phi, [batch, *] for 2-D). Each id counts once.
    """
    if alpha1 <= 0:
        raise ValueError(f"repetition penalty must be > 0, got {alpha1}")
    squeeze = phi.dim() == 1
    phi2 = phi.unsqueeze(0) if squeeze else phi
    ids = seen.reshape(phi2.shape[0], -1)
    picked = phi2.gather(-1, ids)
    picked = torch.where(picked < 0, picked * alpha1, picked / alpha1)
    out = phi2.scatter(-1, ids, picked)
    return out.squeeze(0) if squeeze else out


def filter_top_k_top_p(phi: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the k best scores, then the smallest set whose probability reaches p; the rest get -inf."""
    if top_k > 0:
        kth = torch.topk(phi, min(top_k, phi.shape[-1]), dim=-1).values[..., -1:]
        phi = phi.masked_fill(phi < kth, float("-inf"))
    if top_p < 1.0:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_phi, order = torch.sort(phi, descending=True, dim=-1)
        cum = torch.softmax(sorted_phi, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_phi, dim=-1) >= top_p  # mass before this token already >= p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        phi = phi.masked_fill(drop, float("-inf"))
    return phi


def next_token(phi: torch.Tensor, seen: torch.Tensor, *, temperature: float, repetition_penalty: float,
               top_k: int, top_p: float, generator: torch.Generator | None) -> int:
    """One draw from smax(phi) after 7.1 (penalty) and 7.2 (temperature); temperature 0 is greedy."""
    phi = phi.float()
    if repetition_penalty != 1.0:
        phi = apply_repetition_penalty(phi, seen, repetition_penalty)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(phi.argmax())
    # 7.2, phi / alpha2, with the best score shifted to 0 first: a tiny temperature sends the others to -inf, never
    # to inf - inf = NaN in the softmax (a penalized score past float32's range is clamped back into it first).
    top = torch.finfo(phi.dtype).max
    phi = phi.clamp(-top, top)
    phi = filter_top_k_top_p((phi - phi.max()) / temperature, top_k, top_p)
    probs = torch.softmax(phi, dim=-1)  # 7.3: phihat = smax(phi)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Llama, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
             repetition_penalty: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             eos_token_id: int | tuple[int, ...] | None = None) -> Generation:
    """Append tokens until </s> or max_new_tokens: prefill the prompt once, then one token per step."""
    device = next(model.parameters()).device
    check_sampling(model.cfg, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   repetition_penalty=repetition_penalty, top_k=top_k, top_p=top_p,
                   dtype=dtypes.get(next(model.parameters()).dtype).name if device.type == "cpu" else None,
                   weights_loaded=True)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    seq = list(prompt_ids)
    new: list[int] = []
    start = time.perf_counter()
    past = None
    step_ids = torch.tensor([seq], dtype=torch.long, device=device)
    stopped_by = "length"
    # generation_config.json may list several EOS ids (Llama 3: end of text, of turn, of message)
    stop = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    for _ in range(max_new_tokens):
        out = model(step_ids, past_key_values=past)
        past = out.past_key_values
        phi = out.logits[0, -1].cpu()  # the last row of H: the next token's scores
        if not torch.isfinite(phi).all():
            raise ValueError(f"{model.cfg.source or model.cfg.name}: the model's logits hold NaN or Inf at "
                             f"generated token {len(new)}: its weights are broken")
        tok = next_token(phi, torch.tensor(seq), temperature=temperature, repetition_penalty=repetition_penalty,
                         top_k=top_k, top_p=top_p, generator=generator)
        seq.append(tok)
        new.append(tok)
        if tok in stop:
            stopped_by = "eos"
            break
        step_ids = torch.tensor([[tok]], dtype=torch.long, device=device)
    return Generation(prompt_ids=list(prompt_ids), new_ids=new, seconds=time.perf_counter() - start,
                      stopped_by=stopped_by)
