"""`export onnx`: one graph for prefill and decode, plus the files clients need."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import click

from ..modeling import dtypes
from ..outputs.paths import stream_fd
from ..outputs.tables import render
from ..exporters.preflight import SINGLE_FILE_MAX_BYTES
from ..exporters.quant_options import (
    ACCURACY_LEVEL, BLOCK_SIZE, DEFAULT_ALGORITHM, DEFAULT_TARGET, INT4_ALGORITHMS, QUANTIZE, SEARCHED, matrix_labels)
from ..outputs.progress import peak_rss_bytes, terminal

from .app import cli
from .params import (
    Choice, DTYPE_CHOICE, Group, MaxKl, ModelArg, SEED, rope_op_option, output_options, say, size_words)


@cli.group(cls=Group, short_help="Export a model to ONNX (plain, fused or int4) with its client files.")
def export() -> None:
    """Export a model for deployment.

    \b
    Example:
      llama-tools export onnx tiny -o plain/model.onnx
    """


@export.command("onnx", short_help="One ONNX graph for prefill and decode, plus the files clients need.")
@click.argument("model", type=ModelArg(weights_required_in_dir=True))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), metavar="PATH",
              help=f"The .onnx file to write (atomically; weights over {size_words(SINGLE_FILE_MAX_BYTES)} stream to "
                   f"OUTPUT.data beside it).")
@click.option("--dtype", type=DTYPE_CHOICE, default=dtypes.FLOAT32.name, show_default=True,
              help="Element type of the graph's weights and activations.")
@rope_op_option(fused=True)
@click.option("--optimize", is_flag=True, help="The fused graph: GroupQueryAttention, packed QKV and gate/up "
                                               "MatMuls, Skip RMSNorms, our RoPE node (plain attention, with a note, "
                                               "where the fused ops cannot run the model).")
@click.option("--static-kv", type=click.IntRange(min=1), default=None, metavar="LENGTH",
              help="One preallocated KV buffer of LENGTH positions (at most the model's context) shared by past and "
                   "present (onnxruntime-genai's past_present_share_buffer); implies --optimize [default: none, the "
                   "cache grows with each step].")
@click.option("--quantize", type=Choice(QUANTIZE), default=None,
              help=f"Weight-only int4 (onnxruntime's MatMulNBits quantizer, block {BLOCK_SIZE}); implies --optimize "
                   f"[default: none, the weights in --dtype].")
@click.option("--int4-block-size", type=click.IntRange(min=16), default=None, metavar="N",
              help=f"With --quantize int4: weights per scale, a power of two >= 16 [default: {BLOCK_SIZE}].")
@click.option("--int4-asymmetric", is_flag=True,
              help="With --quantize int4: a zero point per block (costs the tied embedding's sharing).")
@click.option("--int4-accuracy-level", type=click.IntRange(0, 4), default=None, metavar="0-4",
              help=f"With --quantize int4: MatMulNBits' compute type; 4 = int8 activations, the CPU's fast path "
                   f"[default: {ACCURACY_LEVEL}].")
@click.option("--int4-algorithm", type=Choice(list(INT4_ALGORITHMS)), default=None,
              help="With --quantize int4: " + "; ".join(f"{k}: {v}" for k, v in INT4_ALGORITHMS.items())
                   + f" [default: {DEFAULT_ALGORITHM}].")
@click.option("--int4-keep", multiple=True, metavar="NODE",
              help="With --quantize int4: keep this MatMul in full precision (repeatable), e.g. /lm_head/MatMul "
                   "[default: none kept].")
@click.option("--max-kl", type=MaxKl(), default=None, metavar="NATS|Fx|auto|none",
              help="With --quantize int4: a quality target. The matrices whose int4 error moves the next-token "
                   "distribution most per extra byte (measured on built-in text) stay 8-bit until the mean KL to the "
                   "full-precision model is at most NATS, or F times the all-int4 graph's KL (e.g. 0.5x); none: "
                   f"every matrix int4 [default: auto = {DEFAULT_TARGET.describe()}; {', '.join(SEARCHED)} and "
                   "symmetric RTN only].")
@click.option("--no-client-files", is_flag=True, help="Do not write config.json, genai_config.json and the "
                                                      "tokenizer files beside OUTPUT.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Random init of a preset or config.json.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on the terminal.")
@output_options(("table", "json"))
def export_onnx(model: Any, output: Path, dtype: str, rope_op: str | None, optimize: bool, static_kv: int | None,
                quantize: str | None, int4_block_size: int | None, int4_asymmetric: bool,
                int4_accuracy_level: int | None, int4_algorithm: str | None, int4_keep: tuple[str, ...],
                max_kl: str | None, no_client_files: bool, seed: int,
                quiet: bool, fmt: str) -> None:
    """Write MODEL as one ONNX graph for prefill and decode, with the files clients need beside it.

    MODEL: a preset (tiny: seeded weights and its tokenizer), a config.json file (seeded random weights),
    a checkpoint directory or a GGUF file. The table's time row is the wall time you waited, from the
    process start, with its phases.

    \b
    Examples:
      llama-tools export onnx tiny -o plain/model.onnx
      llama-tools export onnx ./tiny-hf -o int4/model.onnx --quantize int4
    """
    from ..exporters.preflight import check_args, check_output  # no torch: a refusal here is quick
    from ..exporters.rope_ops import ROPE_OPS, OURS

    int4 = {k: v for k, v in (("block_size", int4_block_size), ("symmetric", False if int4_asymmetric else None),
                              ("accuracy_level", int4_accuracy_level), ("exclude", int4_keep or None),
                              ("algorithm", int4_algorithm), ("max_kl", max_kl))
            if v is not None}
    if int4 and quantize != "int4":
        raise click.UsageError("the --int4-* options go with --quantize int4")
    if int4_block_size is not None and int4_block_size & (int4_block_size - 1):
        raise click.BadParameter(f"{int4_block_size} is not a power of two", param_hint="--int4-block-size")
    check_args(dtype, rope_op or OURS.name, None)
    if rope_op is not None and ROPE_OPS[rope_op].fused_only and not (optimize or quantize or static_kv is not None):
        raise click.UsageError(f"--rope-op {rope_op} is {ROPE_OPS[rope_op].display}: it needs the fused graph "
                               f"(add --optimize)")
    if static_kv is not None and static_kv > model.cfg.max_position_embeddings:
        raise click.BadParameter(f"{static_kv} positions is more than {model.spec}'s context of "
                                 f"{model.cfg.max_position_embeddings} (its RoPE tables end there); give at most that",
                                 param_hint="--static-kv")
    # inputs, streams, a .data not ours, free space, the tokenizer it reads and writes beside the graph
    check_output(model, output, dtype=dtype, quantize=quantize, client_files=not no_client_files)
    if model.kind == "config":  # a preset is random by name; a config file gets random weights by asking
        click.echo(f"note: {model.spec} is a config without weights: exporting seeded random weights (seed {seed})",
                   err=True)
    started = time.time()
    from ..exporters.pipeline import export

    rep = export(model, output, dtype=dtype, rope_op=rope_op, optimize=optimize, quantize=quantize, int4=int4,
                 static_kv=static_kv, seed=seed, client_files=not no_client_files,
                 progress=terminal("export", quiet=quiet), say=(lambda m: None) if quiet else say)
    phases = export_phases(started, rep)
    for note in rep.notes:
        click.echo(f"note: {note}", err=True)
    for warning in rep.client_files.warnings if rep.client_files else []:
        click.echo(f"warning: {warning}", err=True)
    if rep.quality and rep.quality.warning:
        tighter = "try --max-kl 0.05 (more matrices kept 8-bit, a bigger file), "
        click.echo(f"warning: int4 moves this model's answers ({rep.quality.warning}); {tighter}measure it on your text "
                   f"with `llama-tools verify int4 {output} --text FILE`, or keep fp16/the fused graph", err=True)
    res = rep.result
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    data = rep.path.parent / (rep.path.name + ".data")
    rows = [("model", str(rep.path)), ("graph", rep.graph + (" + int4" if rep.quantized else "")),
            ("weights", str(data) if os.path.isfile(data) else "inside the model"), ("size", mb(rep.bytes)),
            ("parameters", f"{res.params:,}" + (" (tied: lm_head is the embedding, stored once)"
                                                 if model.cfg.tie_word_embeddings else "")),
            ("dtype", res.dtype), ("opset", res.opset),
            ("nodes", res.num_nodes), ("RoPE", ROPE_OPS[res.rope_op].display)]
    if rep.quantized:
        q = rep.quantized
        rows.append(("int4", f"{q.quantized} MatMulNBits, {q.ratio:.2f}x the bytes"))
    if rep.target:
        t = rep.target
        labels = matrix_labels(t.kept_8bit)
        kept = ", ".join(labels[:4])
        more = f", ... ({len(labels) - 4} more)" if len(labels) > 4 else ""
        bound, got = distinct(t.max_kl, t.calibration_kl)
        goal = (f"mean KL <= {bound} nats (" + (f"the lower of {t.nats:g} nats and " if t.nats else "")
                + f"{t.fraction:g}x the all-int4 graph's {distinct(t.all_int4_kl, t.all_int4_kl)[0]}"
                + (f", within {t.size_cap:g}x its int4 bytes)" if t.size_cap else ")") if t.fraction
                else f"mean KL <= {bound} nats")
        rows.append(("int4 target", f"{goal} {'met' if t.met else 'NOT met'}: "
                                    f"{got} on {t.calibration_tokens} calibration tokens"
                                    + (f" (inputs measured on {t.importance_tokens:,})" if t.importance_tokens else "")
                                    + ", "
                                    f"{len(t.rounds)} graph(s) tried"))
        rows.append(("kept 8-bit", f"{len(t.kept_8bit)} of {len(t.sensitivity)} matrices" + (f": {kept}{more}" if kept
                                                                                             else "")))
    if rep.quality:
        qq = rep.quality
        rows.append(("int4 quality", f"mean KL {qq.mean_kl:.4f} nats, top-1 {qq.top1:.1%} against the full-precision "
                                     f"model on {qq.on} ({qq.tokens} tokens)"))
    if rep.client_files:
        rows.append(("client files", ", ".join(p.name for p in rep.client_files.written)))
        # What the source does not say and a client needs: said here, so nobody takes it for the source's word.
        rows += [("invented", what) for what in rep.client_files.invented]
    waited = sum(phases.values())
    rows += [("time", f"{waited:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())),
             ("peak RSS", mb(peak_rss_bytes()))]  # the whole run's: export, int4 and its quality check
    payload = {"path": str(rep.path), "graph": rep.graph, "bytes": rep.bytes, "notes": rep.notes,
               "wall_seconds": waited, "phases": phases, "tied": model.cfg.tie_word_embeddings,
               **{k: v for k, v in dataclasses.asdict(res).items() if k not in ("path", "bytes")},
               "peak_rss_bytes": peak_rss_bytes(),  # the whole run's, as the table says
               "quantized": dataclasses.asdict(rep.quantized) if rep.quantized else None,
               "int4_quality": dataclasses.asdict(rep.quality) if rep.quality else None,
               "int4_target": dataclasses.asdict(rep.target) if rep.target else None,
               "client_files": [str(p) for p in rep.client_files.written] if rep.client_files else [],
               "client_files_invented": rep.client_files.invented if rep.client_files else [],
               "client_files_warnings": rep.client_files.warnings if rep.client_files else []}
    # The graph itself went to standard output (-o -, /dev/stdout): the summary goes to stderr, not into it.
    click.echo(render([{"field": k, "value": v} for k, v in rows], fmt, json_payload=payload),
               err=stream_fd(output) == 1)


def export_phases(started: float, rep: Any) -> dict[str, float]:
    """Where the wall time the user waited went, from the process start (python, imports, checks) to now."""
    import psutil

    now = time.time()
    phases = {"start-up": started - psutil.Process().create_time(), "graph": rep.result.seconds}
    if rep.quantized:
        phases["int4"] = rep.target.seconds if rep.target else rep.quantized.seconds
    phases["client files and checks"] = max(now - started - sum(list(phases.values())[1:]), 0.0)
    return phases


def distinct(a: float, b: float) -> tuple[str, str]:
    """Two KLs in nats, with the digits that tell them apart (a bound never prints equal to a value that misses it):
    four decimals, or three significant digits below 0.01, more while they print alike."""
    for digits in range(3, 10):
        x, y = ((f"{v:.4f}" if v >= 0.01 and digits == 3 else f"{v:.{digits}g}") for v in (a, b))
        if x != y or a == b:
            return x, y
    return repr(a), repr(b)
