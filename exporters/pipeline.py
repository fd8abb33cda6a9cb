"""`export onnx` as one call: the plain or the fused graph, int4 on request, and the files clients need beside it.

    MODEL ──plain (onnx_export)──────────────────────────────┐
          └─--optimize: fused (fused.py) ── fallback: plain ─┼─ --quantize int4 (quantize.py) ─► OUT.onnx
                                                             └───────────────────────────────► + config.json,
                                                               genai_config.json, tokenizer files (genai.py)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from llama_tools import dtypes, files
from llama_tools.progress import Progress, release_freed_memory, silent
from llama_tools.source import ModelSource

from .fused import check_fusable, export_fused
from .genai import ClientFiles, write_client_files
from .onnx_export import ExportResult, export_onnx
from .preflight import check_output
from .quant_options import QUANTIZE
from .quantize import QUALITY_TEXT, QuantizeResult, QuickQuality, quantize_int4, quick_quality



@dataclass
class ExportReport:
    """What `export onnx` wrote, whichever graph it became."""

    path: Path
    graph: str  # "plain" or "fused"
    result: ExportResult  # of the full-precision graph, plain or fused
    quantized: QuantizeResult | None
    client_files: ClientFiles | None
    notes: list[str] = field(default_factory=list)
    quality: QuickQuality | None = None  # int4 against the full-precision graph, on real text when there is a tokenizer

    @property
    def bytes(self) -> int:
        return self.quantized.bytes_after if self.quantized else self.result.bytes


def export(source: ModelSource, output: str | Path, *, dtype: str = "float32", rope_op: str = "llama_tools",
           optimize: bool = False, quantize: str | None = None, int4: dict[str, Any] | None = None,
           static_kv: int | None = None, seed: int = 0,
           client_files: bool = True, progress: Progress = silent,
           say: Callable[[str], None] = lambda msg: None) -> ExportReport:
    """Export SOURCE to OUTPUT: fused when asked and possible (else plain, said in a note), int4 when asked.

    int4: quantize_int4's keyword options (block_size, symmetric, accuracy_level, exclude); None: its defaults.
    """
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    output = check_output(source, output, dtype=dtype, quantize=quantize)
    optimize = optimize or quantize is not None or static_kv is not None
    notes: list[str] = []
    graph = "plain"
    if optimize:
        try:
            check_fusable(source.cfg)
            graph = "fused"
        except ValueError as e:
            if static_kv is not None:
                raise
            notes.append(f"{e}: wrote the plain graph")
    kwargs = dict(dtype=dtype, rope_op=rope_op, seed=seed, progress=progress)
    quality = None
    with _long_name(output) as target:  # OUTPUT itself, or a short name of ours moved onto it at the end
        if quantize is None:
            result = (export_fused(source, target, static_kv=static_kv or False, **kwargs) if graph == "fused"
                      else export_onnx(source, target, say=say, **kwargs))
            quantized = None
        else:
            # The full-precision graph goes to a scratch dir of ours beside OUTPUT (removed at the end, or by
            # the next run after a kill), then onnxruntime's quantizer writes OUTPUT from it. Beside a stream,
            # device or FIFO there is no directory of ours: the system's temp directory then.
            scratch = files.temp_dir("int4") if files.written_through(output) else files.scratch_dir(output)
            with scratch as tmp:
                full = tmp / "model.onnx"
                result = (export_fused(source, full, static_kv=static_kv or False, **kwargs) if graph == "fused"
                          else export_onnx(source, full, say=say, **kwargs))
                say("quantizing to int4 (onnxruntime MatMulNBits)")
                quantized = quantize_int4(full, target, **(int4 or {}))
                release_freed_memory()  # the quantizer's garbage is not the quality check's floor
                if not files.written_through(output):  # a stream cannot be read back
                    say("measuring int4 against the full-precision model")
                    quality = _quality(source, target, seed)
    clients = None
    if client_files:
        if files.written_through(output):  # a stream, device or FIFO: there is no directory of ours
            notes.append(f"no client files: {output} is not a regular file")
        else:
            # The source's tokenizer wherever it lives (a checkpoint's, or the one a preset ships as package data).
            clients = write_client_files(output, tokenizer_dir=source.tokenizer.parent if source.tokenizer else None)
            for path in clients.kept:
                notes.append(f"kept {path}: it is not a file llama-tools wrote, so it was not replaced")
    return ExportReport(output, graph, result, quantized, clients, notes, quality)


def _quality(source: ModelSource, int4: Path, seed: int) -> QuickQuality:
    """The int4 graph scored against the full-precision model, streamed a layer at a time (no fp32 session):
    real text through the tokenizer, else seeded ids."""
    from llama_tools.reference import reference_model
    from llama_tools.source import load_tokenizer

    tok = load_tokenizer(source)
    if tok is not None:
        ids, on = tok.encode(QUALITY_TEXT), "a built-in English text"
    else:
        ids = np.random.default_rng(0).integers(3, source.cfg.vocab_size, size=64).tolist()
        on = "64 seeded ids (no tokenizer: random ids hide what real text shows)"
    return quick_quality(reference_model(source, seed=seed), int4, source.cfg, ids, on)


# --- Before any work: where the export goes, and what is there ----------------------------------------------

@contextlib.contextmanager
def _long_name(output: Path) -> Iterator[Path]:
    """A name too long for OUTPUT.data to exist (NAME_MAX) is exported under a short name in a scratch dir of
    ours and moved onto OUTPUT (the graph holds its weights, so nothing refers to the name)."""
    if files.written_through(output) or len((output.name + ".data").encode("utf-8", "surrogateescape")) \
            <= files.NAME_MAX:
        yield output
        return
    with files.scratch_dir(output) as tmp:
        yield tmp / "model.onnx"
        files.move_onto(tmp / "model.onnx", output)
