"""A resolved MODEL -> a PyTorch model: a checkpoint's weights, or seeded random ones for a preset or config."""

from __future__ import annotations

from typing import Any

import torch

from ..modeling import dtypes
from ..modeling.config import ModelConfig
from ..modeling.model import Llama, build_model
from ..outputs.progress import Progress, silent
from .source import MAX_RANDOM_INIT_BYTES, ModelSource, resolve



def load_model(source: ModelSource | ModelConfig | str, dtype: Any = "float32", device: str = "cpu", seed: int = 0,
               progress: Progress = silent) -> Llama:
    """A checkpoint gets its own weights; a preset or config gets seeded random ones (device 'meta': shapes only)."""
    torch_dtype = dtypes.to_torch(dtypes.model_dtype(dtype).name)
    if isinstance(source, ModelConfig):
        cfg = source
    else:
        src = resolve(source)
        if src.weights is not None and str(device) != "meta":
            from ..modeling.memory import check_memory, model_need
            from .load import load_checkpoint

            assert src.path is not None, "a checkpoint source has a path"
            if str(device).startswith("cpu"):
                check_memory(model_need(src.cfg, dtypes.get(torch_dtype).name, "loading the checkpoint"), src.cfg)
            return load_checkpoint(src.path, dtype=torch_dtype, device=device, progress=progress)
        cfg = src.cfg
    if str(device) != "meta":
        from ..modeling.memory import gib, check_memory, model_need, nbytes, param_total

        name = dtypes.get(torch_dtype).name
        weights = nbytes(param_total(cfg), name)  # constant time: n8 = 10^8 is refused at once, never looped
        if weights > MAX_RANDOM_INIT_BYTES:
            raise ValueError(f"model {cfg.source or cfg.name!r} needs {weights:,} bytes ({gib(weights)}) of random "
                             f"weights at {name}, over the {MAX_RANDOM_INIT_BYTES // 2**30} GiB that llama-tools "
                             f"materializes; count "
                             f"it or report its shapes instead")
        if str(device).startswith("cpu"):
            check_memory(model_need(cfg, name, "building the model"), cfg)
    return build_model(cfg, device=device, dtype=torch_dtype, seed=seed)
