"""Shared by tests/test_gpt_neox.py and tests/test_falcon.py: seeded tiny transformers models of the two
LayerNorm-and-parallel-block families, every weight off its initial value, saved by transformers itself.

transformers initializes LayerNorm to γ = 1, β = 0 and every bias to 0: a reader that dropped β or a bias, or
packed q/k/v in another order, would still match on freshly initialized weights. Here γ ~ N(1, 0.3), β and every
Linear bias ~ N(0, 0.2), matrices at unit gain (query_key_value at 3x, so attention scores are O(1) and the
positions matter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from config_cases import saved_model
from llama_tools.cli import cli

IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])  # [1, 14]
SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)


def perturb(model: Any) -> None:
    """Every parameter off transformers' initial value (see the module docstring), from a fixed generator."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if any(k in name for k in ("layernorm", "layer_norm", "ln_")):
            p.copy_(noise * 0.3 + (1.0 if name.endswith("weight") else 0.0))
        elif name.endswith("bias"):
            p.copy_(noise * 0.2)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5 * (3.0 if "query_key_value" in name else 1.0))


def build(model_cls: Any, config: Any, directory: Path) -> Any:
    """The perturbed transformers model, saved to DIRECTORY by save_pretrained."""
    return saved_model(model_cls, config, directory, perturb)


def assert_logits_equal(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Shapes and dtypes first, then the values within rtol of the largest logit."""
    assert got.shape == expected.shape == (1, IDS.shape[1], SIZES["vocab_size"])
    assert got.dtype == expected.dtype == torch.float32
    assert expected.std() > 0.1  # logits of several units: nothing hides in a flat output
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= rtol * scale, (got - expected).abs().max().item()


def far(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of the largest logit (a negative case wants this far above 1e-5)."""
    return (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def greedy_ids(directory: Path, n: int = 8) -> list[int]:
    """`llama-tools generate --ids` on the checkpoint: its greedy continuation of IDS."""
    r = CliRunner().invoke(cli, ["generate", str(directory), "--ids", " ".join(map(str, IDS[0].tolist())),
                                 "--max-new-tokens", str(n), "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-800:]
    return json.loads(r.output)["new_ids"]


def hf_greedy(hf: Any, n: int = 8) -> list[int]:
    return hf.generate(IDS, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(IDS),
                       pad_token_id=0)[0, IDS.shape[1]:].tolist()


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def one_line_error(r: Any) -> str:
    """A refusal: exit 1, one line, no traceback."""
    assert r.exit_code == 1, r.output[-800:]
    text = r.output.strip()
    assert text.startswith("Error: ") and "\n" not in text and "Traceback" not in text, text
    return text
