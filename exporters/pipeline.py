"""`export onnx` as one call: the plain or the fused graph, int4 on request, and the files clients need beside it.

    MODEL ──plain (onnx_export)──────────────────────────────┐
          └─--optimize: fused (fused.py) ── fallback: plain ─┼─ --quantize int4 (quantize.py) ─► OUT.onnx
                                                             └───────────────────────────────► + config.json,
                                                               genai_config.json, tokenizer files (genai.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llama_tools import files
from llama_tools.progress import Progress, silent
from llama_tools.source import ModelSource

from .fused import check_fusable, export_fused
from .genai import ClientFiles, write_client_files
from .onnx_export import ExportResult, export_onnx
from .quantize import QuantizeResult, quantize_int4

QUANTIZE = ("int4",)


@dataclass
class ExportReport:
    """What `export onnx` wrote, whichever graph it became."""

    path: Path
    graph: str  # "plain" or "fused"
    result: ExportResult  # of the full-precision graph, plain or fused
    quantized: QuantizeResult | None
    client_files: ClientFiles | None
    notes: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.quantized.bytes_after if self.quantized else self.result.bytes


def export(source: ModelSource, output: str | Path, *, dtype: str = "float32", rope_op: str = "llama_tools",
           optimize: bool = False, quantize: str | None = None, static_kv: int | None = None, seed: int = 0,
           client_files: bool = True, progress: Progress = silent,
           say: Callable[[str], None] = lambda msg: None) -> ExportReport:
    """Export SOURCE to OUTPUT: fused when asked and possible (else plain, said in a note), int4 when asked."""
    output = Path(output)
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
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
    if quantize is None:
        result = (export_fused(source, output, static_kv=static_kv or False, **kwargs) if graph == "fused"
                  else export_onnx(source, output, say=say, **kwargs))
        quantized = None
    else:
        # The full-precision graph goes to a scratch dir of ours beside OUTPUT (removed at the end, or by the
        # next run after a kill), then onnxruntime's quantizer writes OUTPUT from it.
        with files.scratch_dir(output) as tmp:
            full = tmp / output.name
            result = (export_fused(source, full, static_kv=static_kv or False, **kwargs) if graph == "fused"
                      else export_onnx(source, full, say=say, **kwargs))
            say("quantizing to int4 (onnxruntime MatMulNBits)")
            quantized = quantize_int4(full, output)
    clients = None
    if client_files:
        if not output.is_file():  # a device or FIFO was written through: there is no directory of ours
            notes.append(f"no client files: {output} is not a regular file")
        else:
            # The source's tokenizer wherever it lives (a checkpoint's, or the one a preset ships as package data).
            clients = write_client_files(output, tokenizer_dir=source.tokenizer.parent if source.tokenizer else None)
            for path in clients.kept:
                notes.append(f"kept {path}: it is not a file llama-tools wrote, so it was not replaced")
    return ExportReport(output, graph, result, quantized, clients, notes)
