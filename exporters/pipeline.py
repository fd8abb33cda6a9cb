"""`export onnx` as one call: the plain or the fused graph, int4 on request, and the files clients need beside it.

    MODEL ──plain (onnx_export)──────────────────────────────┐
          └─--optimize: fused (fused.py) ── fallback: plain ─┼─ --quantize int4 (quantize.py) ─► OUT.onnx
                                                             └───────────────────────────────► + config.json,
                                                               genai_config.json, tokenizer files (genai.py)

All of it is made in a scratch dir of ours beside OUT (the client files as bytes), then moved onto its names
together (files.atomic_files): a failure at any stage (the graph, the quantizer, int4's quality check on
onnxruntime, a client file) leaves nothing of ours and a previous export there as it was, as SIGTERM/SIGINT do.
What can be judged before the work (OUT, the tokenizer) is, by check_output. A stream, device or FIFO is written
through as the graph is made: there is nothing to stage, and no client files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llama_tools.outputs import files, paths
from llama_tools.outputs.progress import Progress, release_freed_memory, silent
from llama_tools.checkpoints.source import ModelSource

from . import rope_ops
from .fused import check_fusable, export_fused
from .genai import ClientFiles, plan_client_files
from .onnx_export import ExportResult, export_onnx
from .preflight import check_output
from .quant_options import DEFAULT_ALGORITHM, QUANTIZE, SEARCHED, int4_target
from .prompts import QUALITY_TEXT
from .quantize import QUALITY_TOKENS, QuantizeResult, QuickQuality, quantize_int4, quick_quality


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
    target: Any = None  # int4_target.TargetResult: what a --max-kl target kept 8-bit and measured

    @property
    def bytes(self) -> int:
        return self.quantized.bytes_after if self.quantized else self.result.bytes


def export(source: ModelSource, output: str | Path, *, dtype: str = "float32", rope_op: str | None = None,
           optimize: bool = False, quantize: str | None = None, int4: dict[str, Any] | None = None,
           static_kv: int | None = None, seed: int = 0,
           client_files: bool = True, progress: Progress = silent,
           say: Callable[[str], None] = lambda msg: None) -> ExportReport:
    """Export SOURCE to OUTPUT: fused when asked and possible (else plain, said in a note), int4 when asked.

    int4: quantize_int4's keyword options (block_size, symmetric, accuracy_level, exclude, algorithm) plus "max_kl"
    (quant_options.parse_max_kl's input; absent: the default target, quant_options.int4_target); None: defaults.
    Everything appears at OUTPUT at the end, together, or (on any failure, or a signal) nothing does.
    """
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    goal = int4_target(int4 or {}) if quantize else None  # a bad --max-kl is refused before any work
    output = check_output(source, output, dtype=dtype, quantize=quantize, client_files=client_files)
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
    kwargs = dict(dtype=dtype, seed=seed, progress=progress)

    def write_graph(path: Path) -> ExportResult:  # rope_op None: each graph's default (fused.default_rope_op)
        # int4's source graph holds W as the checkpoint does (the quantizer reads its rows): no transposed copy
        return (export_fused(source, path, static_kv=static_kv or False, rope_op=rope_op,
                             as_stored=quantize is not None, **kwargs) if graph == "fused"
                else export_onnx(source, path, say=say, rope_op=rope_op or rope_ops.OURS.name, **kwargs))

    chosen: list[Any] = []  # what a --max-kl target chose (int4_target.TargetResult)

    def to_int4(full: Path, target: Path) -> QuantizeResult:
        opts = dict(int4 or {})
        opts.pop("max_kl", None)
        from .int4_target import quantize_to_target, untargetable

        why = untargetable(full, opts) if goal is not None and "max_kl" not in (int4 or {}) else None
        if why:  # the default target, on a graph it cannot place: every matrix int4, said
            notes.append(f"int4 without the default quality target: {why}")
        from llama_tools.inference.reference import reference_model

        if goal is None or why:
            if opts.get("algorithm", DEFAULT_ALGORITHM) in SEARCHED:  # their blocks fit the inputs' measured scale
                from .int4_target import importance, quantize_nodes

                _, windows = _calibration(source)
                say(f"measuring each matrix's inputs on {sum(map(len, windows))} calibration tokens")
                opts["importance"] = importance(reference_model(source, seed=seed), windows,
                                                quantize_nodes(full, opts), progress)
                release_freed_memory()  # the streamed reference's layers are gone
            say("quantizing to int4 (MatMulNBits)")
            return quantize_int4(full, target, **opts)

        say(f"int4 to a quality target: {goal.describe()}")
        ids, windows = _calibration(source)
        made, how = quantize_to_target(full, target, reference_model(source, seed=seed), ids,
                                       goal, opts, say=say, progress=progress, quantize=quantize_int4,
                                       windows=windows)
        chosen.append(how)
        return made

    if paths.written_through(output):  # a stream, device or FIFO: no directory of ours, nothing to stage
        quantized = None
        if quantize is None:
            result = write_graph(output)
        else:
            with files.temp_dir("int4") as tmp:  # the full-precision graph in the system's temp directory
                result = write_graph(tmp / "model.onnx")
                quantized = to_int4(tmp / "model.onnx", output)
        if client_files:
            notes.append(f"no client files: {output} is not a regular file")
        return ExportReport(output, graph, result, quantized, None, notes, target=chosen[0] if chosen else None)
    quantized = quality = plan = None
    with files.scratch_dir(output) as stage:  # removed at the end, on a failure or signal, or by the next run
        staged = stage / _staged_name(output)
        if quantize is None:
            result = write_graph(staged)
        else:
            full = stage / "full-precision" / "model.onnx"
            result = write_graph(full)
            ids, on, zbar = _held_out(source, seed)  # the check's reference pass, before the int4 work
            quantized = to_int4(full, staged)
            shutil.rmtree(full.parent)  # its disk, before the quality check
            release_freed_memory()  # the quantizer's garbage is not the quality check's floor
            say("measuring int4 against the full-precision model")
            from llama_tools.inference.reference import reference_model

            quality = quick_quality(reference_model(source, seed=seed), staged, source.cfg, ids, on, zbar=zbar)
        if client_files:
            # The source's tokenizer wherever it lives (a checkpoint's, or the one a preset ships as package data).
            plan = plan_client_files(staged, tokenizer_dir=source.tokenizer.parent if source.tokenizer else None,
                                     dest=output)
        _commit(staged, output, plan.data if plan else {})
    if quantized is None:
        result = dataclasses.replace(result, path=output, external_data=_data_of(output) if result.external_data
                                     else None)
    else:  # the full-precision graph is gone: what OUTPUT holds is the int4 graph (its .data, if it needs one)
        quantized = dataclasses.replace(quantized, path=output)
        result = dataclasses.replace(result, external_data=_data_of(output) if _data_of(output).exists() else None)
    clients = plan.files if plan else None
    for path in clients.kept if clients else []:
        notes.append(f"kept {path}: it is not a file llama-tools wrote, so it was not replaced")
    return ExportReport(output, graph, result, quantized, clients, notes, quality, chosen[0] if chosen else None)


def _calibration(source: ModelSource) -> tuple[list[int], list[list[int]]]:
    """(the built-in calibration passages as ids, the whole calibration corpus in windows), the tokenizer dropped
    before the work that uses them (a 262,144-token vocabulary's holds 0.3 GB); seeded ids when MODEL has none."""
    from llama_tools.checkpoints.source import load_tokenizer

    from .int4_target import calibration_ids, calibration_windows

    tok = load_tokenizer(source)
    (ids, _), (windows, _) = calibration_ids(tok, source.cfg.vocab_size), calibration_windows(tok, source.cfg.vocab_size)
    del tok
    release_freed_memory()
    return ids, windows


def _held_out(source: ModelSource, seed: int) -> tuple[list[int], str, Any]:
    """What the int4 graph is scored on against the full-precision model (quick_quality): (the ids, what they are,
    the streamed reference's final hidden state on them (a decoder layer at a time, no fp32 session), None for an
    in-memory model); real text through the tokenizer, else seeded ids."""
    import torch

    from llama_tools.inference.reference import reference_model
    from llama_tools.checkpoints.source import load_tokenizer

    from .prompts import positions

    tok = load_tokenizer(source)
    if tok is not None:
        ids, on = tok.encode(QUALITY_TEXT), "a built-in English text"
    else:
        ids = np.random.default_rng(0).integers(3, source.cfg.vocab_size, size=64).tolist()
        on = "64 seeded ids (no tokenizer: random ids hide what real text shows)"
    del tok
    release_freed_memory()  # a 262,144-token vocabulary's tokenizer holds 0.3 GB: not under the check's peak
    ref = reference_model(source, seed=seed)
    ids = ids[:QUALITY_TOKENS]
    x = torch.tensor([ids])  # [1, n]
    mask = torch.ones_like(x)
    zbar = None  # an in-memory model (a preset's) runs whole in quick_quality
    if hasattr(ref, "head"):  # the streamed reference: its pass now, as quick_quality would run it
        with torch.no_grad():
            zbar = ref(x, mask, torch.from_numpy(positions(mask.numpy(), x.shape[1])), hidden=True).logits[0]
        release_freed_memory()  # the streamed layers' pages
    return ids, on, zbar  # zbar: [n, n2]


# --- Staged, then moved into place together -------------------------------------------------------------------

def _data_of(output: Path) -> Path:
    """OUTPUT.data: where a graph's weights live beside it when they do not fit inside."""
    return output.parent / (output.name + ".data")


def _staged_name(output: Path) -> str:
    """OUTPUT's own name in the scratch dir (its .data is named after it), or a short one when OUTPUT.data could not
    exist (NAME_MAX): such a graph holds its weights (check_output), so nothing refers to the name."""
    fits = len(_data_of(output).name.encode("utf-8", "surrogateescape")) <= paths.NAME_MAX
    return output.name if fits else "model.onnx"


def _commit(staged: Path, output: Path, clients: dict[str, bytes]) -> None:
    """The staged graph (its .data first) and the client files onto their names beside OUTPUT, all together."""
    data = _data_of(staged)
    moves = {}
    if data.exists():
        if staged.name != output.name:  # int4 of a big model: its weights outgrew one file
            raise ValueError(f"{output}: the graph's weights need {output.name}.data beside it, a name longer than "
                             f"{paths.NAME_MAX} bytes; choose a shorter output name")
        moves[data.name] = data
    moves[output.name] = staged
    with files.atomic_files([output.parent / name for name in [*moves, *clients]]) as tmp:
        for name, path in moves.items():
            os.replace(path, tmp / name)  # one filesystem: a rename
        for name, content in clients.items():
            (tmp / name).write_bytes(content)
    stale = _data_of(output)
    if data.name not in moves and os.path.isfile(stale):
        stale.unlink()  # a previous export's weights (ours: check_output says so); the new graph holds its own
