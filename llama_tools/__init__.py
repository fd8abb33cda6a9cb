"""llama-tools: understand, count, export and verify LLaMA-family models.

The package root stays light (no torch import) so that `count-params` answers fast;
`load_model` imports torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .modeling.config import ModelConfig
from .checkpoints.config_files import load_config
from .modeling.presets import get_preset, preset_names

if TYPE_CHECKING:
    from .modeling.model import Llama

__version__ = "0.1.0"
__all__ = ["ModelConfig", "get_preset", "load_config", "preset_names", "load_model", "__version__"]


def load_model(source: Any, dtype: Any = "float32", device: str = "cpu", seed: int = 0) -> "Llama":  # noqa: D401
    """A preset name, a config.json, or a checkpoint directory -> an eval-mode `Llama`."""
    from .checkpoints.loading import load_model as _load

    return _load(source, dtype=dtype, device=device, seed=seed)
