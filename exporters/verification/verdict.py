"""`verify parity`'s verdict: the layer decides, the whole graph is judged beside it.

    inputs:      real text through the model's tokenizer (prompts.default_inputs), else seeded random ids
    by layer:    each decoder layer of the graph fed float64's own input to it (by_layer.py): PASS/FAIL and the
                 first bad layer come from here, where one layer's error is its own and no later layer amplifies it
    whole graph: the graph end to end, prefill and greedy decode through its KV cache (parity.py): the decode path
                 no layer-local run covers; its noise is measured end to end too, so it carries the same growth
                 through depth that rounding has in every correct runtime

Both compare against PyTorch float64 with the noise of two correct implementations in the graph's dtype (PyTorch's
and PyTorch's with every matrix product summed in another order): the larger is what a correct runtime may differ
by. The default runs the whole graph only while its session fits in little memory (the graph's weights up to
WHOLE_GRAPH_BYTES); past that the layer-local check alone holds about one layer in memory, and
`--whole-graph` asks for the rest.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_tools.outputs import files
from llama_tools.outputs.progress import Progress, bound_heap, release_freed_memory, silent

from .by_layer import ByLayerReport, _by_layer
from .parity_options import MODES, WHOLE_GRAPH_BYTES
from .parity import ParityReport, ParityTarget, _verify, check_inputs, is_int4
from ..prompts import Inputs, default_inputs
from .source_check import SourceReport, check_source, not_checked



@dataclass
class Verdict:
    """The layer-local report, the whole-graph report beside it (either may be absent), and the inputs they ran."""

    inputs: str
    prompt_lengths: list[int]
    by_layer: ByLayerReport | None
    whole: ParityReport | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    export_seconds: float | None = None
    source_check: SourceReport | None = None  # our reading of the checkpoint against its own library

    @property
    def passed(self) -> bool:
        return all(r.passed for r in (self.by_layer, self.whole, self.source_check) if r is not None)

    @property
    def first_bad(self) -> str | None:
        """Where it fails: our reading of the source, else the layer-local check's block ('layer 12'), else the
        whole graph's failing checks."""
        if self.source_check is not None and not self.source_check.passed:
            return self.source_check.failure
        if self.by_layer is not None and not self.by_layer.passed:
            return self.by_layer.first_bad
        if self.whole is not None and not self.whole.passed:
            bad = [c.name for c in self.whole.checks if not c.passed]
            if not self.whole.decode.passed:
                bad.append("greedy decode")
            where = "every layer within its own budget; " if self.by_layer is not None else ""
            return f"{where}the whole graph's {', '.join(bad[:3])}"
        return None

    @property
    def first_bad_layer(self) -> int | None:
        if self.by_layer is not None:
            return self.by_layer.first_bad_layer
        return self.whole.first_bad_layer if self.whole is not None else None

    def to_dict(self) -> dict[str, Any]:
        """One check alone: its own report's fields (and the inputs); both: each report under its key."""
        if (self.by_layer is None) != (self.whole is None):
            rep = self.by_layer or self.whole
            assert rep is not None, "a verdict runs at least one check"
            d = rep.to_dict()
            return {**d, "inputs": self.inputs, "notes": d["notes"] + self.notes, "first_bad": self.first_bad,
                    "export_seconds": self.export_seconds, "passed": self.passed,
                    "source_check": self.source_check.to_dict() if self.source_check is not None else None}
        first = self.by_layer or self.whole
        assert first is not None, "a verdict runs at least one check"
        return {"mode": "verdict", "onnx_path": first.onnx_path, "source": first.source, "graph": first.graph,
                "dtype": first.dtype, "inputs": self.inputs, "prompt_lengths": self.prompt_lengths,
                "passed": self.passed, "first_bad": self.first_bad, "first_bad_layer": self.first_bad_layer,
                "by_layer": self.by_layer.to_dict() if self.by_layer is not None else None,
                "whole_graph": self.whole.to_dict() if self.whole is not None else None,
                "seconds": self.seconds, "notes": self.notes, "export_seconds": self.export_seconds,
                "source_check": self.source_check.to_dict() if self.source_check is not None else None}


def parity_inputs(target: ParityTarget, prompts: list[list[int]] | None, steps: int, random_ids: int | None = None,
                  seed: int = 0) -> Inputs:
    """The rows to run: the user's, else the default (real text when MODEL has a tokenizer), checked cheaply."""
    cfg = target.meta.config if target.meta is not None else target.source.cfg
    if prompts:
        inputs = Inputs(prompts, f"{len(prompts)} row(s) given")
    else:
        room = cfg.max_position_embeddings - steps
        if target.meta is not None and target.meta.static_kv is not None:
            room = min(room, target.meta.static_kv - steps)
        inputs = default_inputs(target.source, cfg.vocab_size, room, random_ids=random_ids, seed=seed)
    check_inputs(inputs.rows, steps, target)
    return inputs


def verify(target: ParityTarget, inputs: Inputs, *, mode: str = "auto", provider: str = "auto", steps: int = 8,
           dtype: str = "float32", rope_op: str = "llama_tools", tf32: bool = False, source_check: bool = True,
           progress: Progress = silent) -> Verdict:
    """Our reading of the source against its own library; export on the fly when the target is a MODEL; then the
    layer-local check and, as MODE says, the whole graph."""
    assert mode in MODES, f"mode {mode!r} is one of {MODES}"
    bound_heap()  # many-MB temporaries come and go in every check: their pages go back as they are freed
    if target.onnx_path is not None and is_int4(target.onnx_path):
        raise ValueError(f"{target.onnx_path}: weight-only int4 (MatMulNBits): fp32 tolerances do not apply to it; "
                         f"measure it with `llama-tools verify int4 {target.onnx_path}` (top-1, KL, perplexity)")
    checked = (check_source(target.source, inputs.rows, seed=target.seed, progress=progress,
                            batches=inputs.batches()) if source_check else
               not_checked(target.source, "--no-source-check"))
    release_freed_memory()  # transformers' blocks and the source check's logits: their pages back before the graph's
    verdict = _verify_graph(target, inputs, mode, provider, steps, dtype, rope_op, tf32, progress)
    verdict.source_check = checked
    return verdict


def _verify_graph(target: ParityTarget, inputs: Inputs, mode: str, provider: str, steps: int, dtype: str,
                  rope_op: str, tf32: bool, progress: Progress) -> Verdict:
    if target.onnx_path is not None:
        return _run(target.onnx_path, target, inputs, mode, provider, steps, tf32, progress)
    from ..onnx_export import export_onnx, read_metadata

    with files.temp_dir("parity") as tmp:  # removed on SIGTERM too, and after a SIGKILL by the next run
        exported = export_onnx(target.source, Path(tmp) / "model.onnx", dtype=dtype, rope_op=rope_op,
                               seed=target.seed, progress=progress)
        meta = read_metadata(exported.path)
        verdict = _run(exported.path, dataclasses.replace(target, meta=meta), inputs, mode, provider, steps, tf32,
                       progress)
    on_the_fly = f"{target.source.spec} (exported on the fly)"
    for rep in (verdict.by_layer, verdict.whole):
        if rep is not None:
            rep.onnx_path = on_the_fly
    verdict.export_seconds = exported.seconds
    return verdict


def graph_bytes(onnx_path: Path) -> int:
    """The graph's file and every external-data file its initializers name (read without the weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    files = {(onnx_path.parent / n).resolve() for n in names}
    return onnx_path.stat().st_size + sum(f.stat().st_size for f in files if f.is_file())


def _run(onnx_path: Path, target: ParityTarget, inputs: Inputs, mode: str, provider: str, steps: int, tf32: bool,
         progress: Progress) -> Verdict:
    start = time.perf_counter()
    weights = graph_bytes(onnx_path)
    whole = mode in ("whole", "both") or (mode == "auto" and weights <= WHOLE_GRAPH_BYTES)
    notes = []
    if mode == "auto" and not whole:
        notes.append(f"the whole-graph check (decode through the KV cache) is left out by default: the graph's "
                     f"{weights / 2**30:.1f} GiB of weights are over {WHOLE_GRAPH_BYTES / 2**30:g} GiB; "
                     f"`--checks both` runs it too")
    by_layer = None
    if mode != "whole":
        by_layer = _by_layer(onnx_path, target, inputs.rows, provider, tf32, None, progress, inputs.batches())
    rows, left_out = inputs.whole_graph(target.meta.config.vocab_size)
    if whole and left_out:
        notes.append(left_out)
    rep = _verify(onnx_path, target, rows, provider, steps, tf32, None, progress) if whole else None
    return Verdict(inputs.what, [len(p) for p in inputs.rows], by_layer, rep, time.perf_counter() - start, notes)
