"""What a model holds and what a command would allocate, in exact bytes, checked before anything is allocated.

No torch: generate and export refuse a model that does not fit in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import dtypes
from .config import ModelConfig
from .weights import stack_specs


def nbytes(elements: int, dtype: str) -> int:
    """Bytes of `elements` values of dtype, in exact integers (int4: half a byte each, rounded up)."""
    bits = round(dtypes.get(dtype).bytes * 8)  # 4, 8, 16, 32, 64: exact
    return (elements * bits + 7) // 8


def param_total(cfg: ModelConfig) -> int:
    """Every parameter of Llama(cfg), in constant time whatever n8 and the expert count are."""
    return stack_specs(cfg).total()


def tensor_total(cfg: ModelConfig) -> int:
    """len(weight_specs(cfg)), in constant time whatever n8 and the expert count are."""
    return stack_specs(cfg).total(key=lambda s: 1)


# --- What a command would allocate, checked before it does ------------------------------------------

@dataclass(frozen=True)
class MemoryNeed:
    """What a command would hold at its peak, by item, in bytes (exact integers)."""

    what: str  # the command, e.g. "generate"
    items: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)


def rope_table_bytes(cfg: ModelConfig) -> int:
    """Building model.rope_cache: float64 angles, cos and sin of [max_pos, rotary_dim/2], kept as fp32 (32 B a cell)."""
    if cfg.position_encoding != "rope":
        return 0
    return 32 * cfg.max_position_embeddings * (cfg.rotary_dim // 2)


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int, dtype: str) -> int:
    """K and V of every layer for `tokens` positions of `batch` sequences."""
    return nbytes(2 * cfg.num_hidden_layers * cfg.kv_size * tokens * batch, dtype)


def activation_bytes(cfg: ModelConfig, tokens: int, past: int, batch: int, dtype: str) -> int:
    """One forward of `tokens` new positions over `past` cached ones, at its peak.

    The mask and the fp32 attention scores and probabilities [b, n5, n3, past + n3], a few hidden-width
    rows (residual, normed, q/k/v, FFN gate and up) and the logits [b, n3, n1], in dtype and once more in fp32.
    """
    keys = past + tokens
    scores = 2 * nbytes(batch * cfg.num_attention_heads * tokens * keys, "float32") + nbytes(batch * tokens * keys,
                                                                                            dtype)
    width = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size, cfg.moe_intermediate_size)
    hidden = nbytes(6 * batch * tokens * width, dtype)
    logits = nbytes(batch * tokens * cfg.vocab_size, dtype) + nbytes(batch * cfg.vocab_size, "float32")
    return scores + hidden + logits


def model_need(cfg: ModelConfig, dtype: str, what: str = "loading the model") -> MemoryNeed:
    """Weights at dtype and the RoPE tables every forward builds: what load_model and a first forward hold."""
    return MemoryNeed(what, (("weights", nbytes(param_total(cfg), dtype)), ("RoPE tables", rope_table_bytes(cfg))))


def generation_need(cfg: ModelConfig, prompt: int, new_tokens: int, dtype: str, batch: int = 1,
                    weights: bool = True) -> MemoryNeed:
    """generate: the model (unless already loaded), its KV cache for prompt + new tokens, the prefill's activations."""
    items = list(model_need(cfg, dtype).items) if weights else [("RoPE tables", rope_table_bytes(cfg))]
    items += [("KV cache", kv_cache_bytes(cfg, prompt + new_tokens, batch, dtype)),
              ("activations", activation_bytes(cfg, max(prompt, 1), 0, batch, dtype))]
    return MemoryNeed("generate", tuple(items))


def available_memory() -> int:
    """Bytes the OS says a new allocation can take without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(need: MemoryNeed, cfg: ModelConfig, available: int | None = None) -> None:
    """ValueError, before anything is allocated, when `need` is more than the memory available, with the figures."""
    available = available_memory() if available is None else available
    if need.total <= available:
        return
    parts = ", ".join(f"{name} {gib(b)}" for name, b in need.items if b)
    raise ValueError(f"config {cfg.source or cfg.name!r}: {need.what} needs {need.total:,} bytes ({gib(need.total)}: "
                     f"{parts}), but only {available:,} bytes ({gib(available)}) of memory are available; "
                     f"check num_hidden_layers, max_position_embeddings and the widths, or use a smaller dtype")



def gib(n: int) -> str:
    """Bytes for people: MiB or GiB (exact figures are printed beside it where they matter)."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"

