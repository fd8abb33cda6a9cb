"""`verify parity`'s and `verify int4`'s checks of TARGET, --source and --steps before any work: no torch or numpy.

As preflight.py is for `export onnx`: what can be refused from the arguments, MODEL's config and the graph's own
metadata (read without its weights, onnx imported only when the graph may be ours) is refused here, in the time
`count-params` takes. The commands' library functions (parity.resolve_target, check_inputs, quantize's
measure_quant_parity) check the same things again, so the library refuses them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.rope import context_length
from llama_tools.checkpoints.source import ModelSource, resolve

from ..graph_meta import INT4_OP, check_int4_graph, has_our_metadata, is_int4, read_metadata


@dataclass(frozen=True)
class Room:
    """How many positions a run through TARGET may use: the model's context, or a static KV buffer's length."""

    cfg: ModelConfig
    static_kv: int | None  # a fused graph's preallocated KV length, if it has one
    where: str  # what to name in a refusal
    source: ModelSource | None = None  # the PyTorch side when known without the graph's metadata (its tokenizer)

    @property
    def positions(self) -> int:
        return min(context_length(self.cfg), self.static_kv or context_length(self.cfg))

    @property
    def what(self) -> str:
        if self.static_kv is not None and self.static_kv < context_length(self.cfg):
            return f"{self.where}'s static KV buffer of {self.static_kv} positions"
        return f"the model's context of {context_length(self.cfg)} positions"

    def check(self, prompt: int, steps: int) -> None:
        """A prompt of `prompt` tokens and `steps` decode steps fit, or one line saying by how much they do not."""
        if prompt + steps > self.positions:
            fits = f"give --steps <= {self.positions - prompt}" if prompt < self.positions else "give a shorter prompt"
            if self.positions < context_length(self.cfg):
                fits += ", or export with a larger --static-kv"
            raise ValueError(f"--steps {steps}: a prompt of {prompt} tokens + {steps} steps exceeds {self.what}; "
                             f"{fits}")


def _not_ours(target: str | Path) -> ValueError:
    return ValueError(f"{target} was not written by llama-tools; pass --source with the checkpoint it was exported "
                      f"from")


def parity_room(target: str | None, source: str | None) -> Room:
    """TARGET and --source of `verify parity` (TARGET an .onnx or a MODEL; default tiny), checked; its Room."""
    target = target or "tiny"
    if not target.endswith(".onnx"):
        if source is not None:
            raise ValueError("--source is for an .onnx TARGET; a MODEL target is its own source")
        model = resolve(target, weights_required_in_dir=True, needs_data=True)
        return Room(model.cfg, None, target, model)
    if is_int4(target):
        raise ValueError(f"{target}: weight-only int4 ({INT4_OP}): fp32 tolerances do not apply to it; measure it "
                         f"with `llama-tools verify int4 {target}` (top-1, KL, perplexity)")
    if not has_our_metadata(target):
        if source is None:
            raise _not_ours(target)
        model = resolve(source, weights_required_in_dir=True, needs_data=True)
        return Room(model.cfg, None, target, model)
    meta = read_metadata(target)
    model = resolve(source, weights_required_in_dir=True, needs_data=True) if source is not None else None
    return Room(meta.config, meta.static_kv, target, model)


def int4_source(target: Path, source: ModelSource | None) -> tuple[ModelSource, Room]:
    """TARGET of `verify int4` (it must hold int4 weights) and its fp32 side: --source, else its metadata's source."""
    check_int4_graph(target)
    ours = has_our_metadata(target)
    if source is None and not ours:
        raise _not_ours(target)
    meta = read_metadata(target) if ours else None
    model = source if source is not None else resolve(meta.source, needs_data=True)  # type: ignore[union-attr]
    return model, Room(meta.config if meta else model.cfg, meta.static_kv if meta else None, str(target), model)
