"""Configs as their library writes them: every family and RoPE variant, in both layouts, computes transformers' model.

Each case (tests/config_cases.py) is a seeded transformers model saved by the installed transformers (its own
config.json, 4.x layout here), then the same config as transformers 5 writes it (a literal fixture,
tests/data/transformers5/, `rope_parameters` flat or per layer type). Our fp32 logits must equal transformers'
eager fp32 logits over SEQ positions, past every sliding window and original context; the two layouts must read as
one config; counts must equal transformers' own. A negative case proves the comparison sees a misread base.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from config_cases import CASES, SEQ, saved_model, v4_kwargs  # noqa: E402

from llama_tools import load_model  # noqa: E402
from llama_tools.checkpoints.config_files import config_from_hf, load_config  # noqa: E402
from llama_tools.counting.accounting import count_params  # noqa: E402
from llama_tools.modeling.families import FAMILIES, HF_NAMES  # noqa: E402
from llama_tools.modeling.model import model_from_state  # noqa: E402

FIXTURES = Path(__file__).parent / "data" / "transformers5"
V5 = int(transformers.__version__.split(".")[0]) >= 5


def _ids() -> torch.Tensor:
    return torch.randint(3, 256, (1, SEQ), generator=torch.Generator().manual_seed(7))  # [1, SEQ]


def hf_checkpoint(case: str, directory: Path):
    """The case's model as the installed transformers builds and saves it, its numbers off their initial values."""
    config_cls, model_cls, _, _ = CASES[case]
    cls = getattr(transformers, config_cls)
    # transformers 5 takes the fixture's own layout; 4.x the top-level keys
    config = (cls.from_dict(json.loads((FIXTURES / f"{case}.json").read_text())) if V5 else cls(**v4_kwargs(case)))
    return saved_model(getattr(transformers, model_cls), config, directory)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = hf_checkpoint(request.param, directory)
    with torch.no_grad():
        expected = model(_ids()).logits  # [1, SEQ, vocab]
    return request.param, directory, model, expected


def relative_rms(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    assert expected.std() > 0.1  # logits that vary: the comparison means something
    assert relative_rms(got, expected) <= 1e-4
    top2 = expected.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 1e-4 * expected.std()  # a closer call is rounding's to make
    assert torch.equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])
    assert decided.float().mean() > 0.99


def test_installed_layout_gives_transformers_logits(case):
    name, directory, _, expected = case
    ours = load_model(directory)
    with torch.no_grad():
        got = ours(_ids()).logits
    assert_same_logits(got, expected)


def test_other_layout_reads_as_the_same_config_and_logits(case, tmp_path):
    name, directory, _, expected = case
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    if V5:  # the installed one writes 5.x: the other is 4.x's top-level keys
        text = json.dumps({**json.loads((directory / "config.json").read_text()), **v4_kwargs(name)})
        text = json.dumps({k: v for k, v in json.loads(text).items() if k != "rope_parameters"})
    else:
        text = (FIXTURES / f"{name}.json").read_text()  # literally as transformers 5 saved it
    assert ("rope_parameters" in text) != V5
    (other / "config.json").write_text(text)
    installed, fixture = load_config(directory), load_config(other)
    strip = lambda c: dataclasses.replace(c, name="", source="", torch_dtype="float32")  # noqa: E731
    assert strip(installed) == strip(fixture)
    ours = load_model(other)
    with torch.no_grad():
        assert_same_logits(ours(_ids()).logits, expected)


def test_counts_equal_transformers_in_both_layouts(case):
    name, directory, model, _ = case
    for data in (json.loads((directory / "config.json").read_text()),
                 json.loads((FIXTURES / f"{name}.json").read_text())):
        assert count_params(config_from_hf(data)).total == model.num_parameters()


def test_a_misread_base_is_seen(tmp_path):
    """The negative case: Gemma 3's sliding layers at the global base (the transformers 5 misread) are far off."""
    model = hf_checkpoint("gemma3", tmp_path)
    with torch.no_grad():
        expected = model(_ids()).logits
    ours = load_model(tmp_path)
    misread = model_from_state(ours.cfg.replace(rope_local_theta=None), ours.state_dict(), torch.float32)
    with torch.no_grad():
        assert_same_logits(ours(_ids()).logits, expected)
        assert relative_rms(misread(_ids()).logits, expected) > 1e-2


def test_family_defaults_are_transformers_defaults():
    """Each family's hf_keys default is what its transformers config class takes for an absent key."""
    checked = 0
    for family in FAMILIES.values():
        name = next((c for c in family.hf_classes if hasattr(transformers, c.replace("ForCausalLM", "Config"))),
                    None)
        if name is None:
            continue  # Baichuan, InternLM2: remote code
        cls = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(name, name.replace("ForCausalLM",
                                                                                                   "Config")))
        params = inspect.signature(cls.__init__).parameters
        for key, default in family.hf_keys.items():
            if key in params and key not in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
                assert params[key].default == default, (family.name, key)
                checked += 1
            elif key in ("rope_theta", "rope_local_base_freq") and key in params:
                assert params[key].default == default, (family.name, key)
                checked += 1
    assert checked > 40
    assert set(HF_NAMES.values()) == set(FAMILIES)


def _written(tmp_path: Path, case: str, **changes) -> Path:
    data = {**json.loads((FIXTURES / f"{case}.json").read_text()), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case, changes, named", [
    ("llama", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor'"),
    ("gemma3", {"use_bidirectional_attention": True}, "'use_bidirectional_attention'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "beta_fast": 32}},
     "'rope_parameters.beta_fast'"),
    ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "'rope_parameters'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 1e4}}},
     "'rope_parameters.sliding_attention.rope_type'"),
    ("llama", {"rope_theta": 10000.0}, "'rope_theta' and 'rope_parameters'"),
    ("qwen3", {"num_experts": 8}, "'num_experts'"),
])
def test_a_key_that_changes_the_math_and_is_not_read_is_refused(tmp_path, case, changes, named):
    path = _written(tmp_path, case, **changes)
    with pytest.raises(ValueError) as e:
        load_config(path)
    message = str(e.value)
    assert str(path) in message and named in message
    assert "\n" not in message


def test_what_transformers_ignores_is_ignored(tmp_path):
    """A key a family's code does not read changes nothing here either (Llama has no window, Mistral no biases)."""
    base = load_config(_written(tmp_path, "llama"))
    assert load_config(_written(tmp_path, "llama", sliding_window=4)) == base
    mistral = load_config(_written(tmp_path, "mistral"))
    assert load_config(_written(tmp_path, "mistral", attention_bias=True)) == mistral
    assert not mistral.qkv_bias
