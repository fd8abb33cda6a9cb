"""Shared by tests/test_neox_falcon.py, tests/test_gpt_neox.py and tests/test_falcon.py: seeded tiny transformers models
of the two LayerNorm-and-parallel-block families in each layout (LAYOUTS), every weight off its initial value, saved
by transformers itself.

transformers initializes LayerNorm to γ = 1, β = 0 and every bias to 0: a reader that dropped β or a bias, or
packed q/k/v in another order, would still match on freshly initialized weights. Here γ ~ N(1, 0.3), β and every
Linear bias ~ N(0, 0.2), matrices at unit gain (query_key_value at 3x, so attention scores are O(1) and the
positions matter).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from config_cases import saved_model
from helpers import bench_faults
from llama_tools.cli import cli

IDS = torch.tensor([[1, 17, 200, 5, 99, 42, 7, 250, 3, 64, 128, 11, 33, 90]])  # [1, 14]
SIZES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
HF_CLASSES = {"gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "falcon": ("FalconConfig", "FalconForCausalLM")}


@dataclass(frozen=True)
class Layout:
    """One layout of a family: transformers' config keywords and what we read of them."""

    family: str
    config: dict[str, Any] = field(hash=False)
    kv: int  # KV heads
    rotary: int  # our rotary width (n6 = 16)
    parallel: bool
    shared: bool  # one norm feeding attention and the MLP


# GPT-NeoX: Pythia's parallel block at rotary_pct 0.25; sequential at 0.5 without attention biases (the MLP keeps its).
# Falcon: Falcon-7B's multi_query (one input_layernorm, one KV head, biases); new_decoder_architecture (ln_attn and
# ln_mlp, 2 KV heads grouped with their query heads, no biases); sequential (parallel_attn false, q/k/v per head).
LAYOUTS = {
    "neox-parallel": Layout("gpt_neox", dict(use_parallel_residual=True, rotary_pct=0.25, intermediate_size=128),
                            4, 4, True, False),
    "neox-sequential": Layout("gpt_neox", dict(use_parallel_residual=False, rotary_pct=0.5, attention_bias=False,
                                               intermediate_size=128), 4, 8, False, False),
    "falcon-multi_query": Layout("falcon", dict(multi_query=True, parallel_attn=True, bias=True), 1, 16, True, True),
    "falcon-new_decoder": Layout("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=False),
                                 2, 16, True, False),
    "falcon-sequential": Layout("falcon", dict(multi_query=False, parallel_attn=False, bias=True), 4, 16, False, False),
}


def hf_class(family: str) -> Any:
    """transformers' causal-LM class of FAMILY."""
    import transformers

    return getattr(transformers, HF_CLASSES[family][1])


def make_case(name: str, tmp_path_factory: Any) -> tuple[str, Path, Any, torch.Tensor]:
    """Layout NAME built and saved: (name, directory, the transformers model, its logits on IDS)."""
    import transformers

    layout = LAYOUTS[name]
    d = tmp_path_factory.mktemp(name)
    config = getattr(transformers, HF_CLASSES[layout.family][0])(**SIZES, **layout.config)
    hf = build(hf_class(layout.family), config, d)
    with torch.no_grad():
        expected = hf(IDS).logits  # [1, 14, 256]
    return name, d, hf, expected


def family_layouts(family: str) -> list[str]:
    return [name for name, layout in LAYOUTS.items() if layout.family == family]


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


def planted_verdict(graph: Path, d: Path, mode: str, fault: str = "scale") -> Any:
    """verify's verdict (no source check) on GRAPH with bench_faults' FAULT planted at layer 1 ("scale": its
    down_proj x (1 + 1e-3); "final-norm": the final norm's gain x (1 + 1e-3))."""
    from llama_tools.exporters.verification.parity import resolve_target
    from llama_tools.exporters.verification.verdict import parity_inputs, verify

    faulted = bench_faults().plant(graph, fault, resolve_target(str(graph), str(d)).source.cfg, 1)
    try:
        ft = resolve_target(str(faulted), str(d))
        return verify(ft, parity_inputs(ft, None, 2, None, 0), mode=mode, provider="cpu", steps=2, source_check=False)
    finally:
        faulted.unlink()
