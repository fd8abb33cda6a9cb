"""`verify parity`, `verify source` and `verify int4`: an ONNX graph against PyTorch, our reading against transformers."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import click

from ..modeling import dtypes
from ..outputs.tables import render
from ..exporters.verification.parity_options import MODES, WHOLE_GRAPH_BYTES
from ..exporters.quant_options import PROMPT_IDS
from ..outputs.progress import terminal

from .app import cli
from .params import (
    Choice, DTYPE_CHOICE, Group, IdsArg, ModelArg, TOKENIZER_FILES, Text, rope_op_option, output_options, quoting,
    size_words)


# Where onnxruntime runs the graph, for both checks.
provider_option = click.option("--provider", type=Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                               help="auto: CUDA when a session really runs on it, else the CPU.")


def input_options(f: Any) -> Any:
    """The rows both sides run: --prompt, --ids, --random-ids N and its --seed (verify parity and verify source)."""
    for option in reversed([
        click.option("--prompt", "prompts", multiple=True, type=Text(),
                     help=f"Text, encoded with the checkpoint's tokenizer ({TOKENIZER_FILES}); repeat for a "
                          f"batch [default: built-in text]."),
        click.option("--ids", "ids", multiple=True, type=IdsArg(),
                     help="Raw ids instead of --prompt, e.g. '1 450 29871'; repeat for a batch."),
        click.option("--random-ids", "random_ids", type=click.IntRange(1, 64), default=None, metavar="N",
                     help="N rows of seeded random ids instead of text: a stress test (the default only without a "
                          "tokenizer)."),
        click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
                     help="Seed of --random-ids.")]):
        f = option(f)
    return f


def check_provider(provider: str) -> None:
    """--provider cuda where onnxruntime cannot run CUDA: one line, before any weight is read."""
    if provider != "cuda":
        return
    from ..exporters.runtime import cuda_unusable

    why = cuda_unusable()
    if why is not None:
        raise click.BadParameter(f"cuda: {why}; install onnxruntime-gpu or use --provider cpu", param_hint="--provider")


@cli.group(cls=Group, short_help="Check an ONNX export against PyTorch, and our reading against transformers.")
def verify() -> None:
    """Check an export against the PyTorch model, and the PyTorch model against the checkpoint's own library.

    \b
    Examples:
      llama-tools verify parity plain/model.onnx
      llama-tools verify source ./checkpoint
      llama-tools verify int4 int4/model.onnx
    """


@verify.command("parity", short_help="An ONNX graph on onnxruntime against PyTorch, layer by layer and whole.")
@click.argument("target", required=False)
@click.option("--source", default=None, help="The PyTorch side when TARGET is an .onnx file "
                                              "[default: the source in the file's metadata].")
@input_options
@click.option("--steps", type=click.IntRange(min=0), default=8, show_default=True,
              help="Greedy decode steps through the KV cache (whole-graph check).")
@provider_option
@click.option("--dtype", type=DTYPE_CHOICE, default=dtypes.FLOAT32.name, show_default=True,
              help="When TARGET is a model exported on the fly.")
@rope_op_option(" (when TARGET is a model exported on the fly)")
@click.option("--tf32", is_flag=True, help="Let CUDA run fp32 MatMuls in TF32 (faster, ~1e-3 off; judged by its own "
                                         "tolerance). Default: TF32 off, so fp32 means fp32.")
@click.option("--all-layers", is_flag=True, help="A row for every check of every layer, not only the failing ones.")
@click.option("--checks", type=Choice(MODES), default="auto", show_default=True,
              help="layers: each decoder layer fed float64's own input to it (prefill; about one layer in memory); "
                   "whole: the graph end to end (prefill and greedy decode); both; auto: layers, and whole while "
                   f"the graph's weights are <= {size_words(WHOLE_GRAPH_BYTES)}.")
@click.option("--by-layer", is_flag=True, help="The same as --checks layers.")
@click.option("--plot", "plot", type=click.Path(path_type=Path), default=None, metavar="FILE.png",
              help="Draw each layer's error and noise (K, V and the hidden state; the whole graph's K and V with "
                   "--checks whole), the bound and the first layer out of budget (needs the [plot] extra) "
                   "[default: no plot].")
@click.option("--no-source-check", "no_source_check", is_flag=True,
              help="Skip the source check (our reading of the checkpoint against transformers on the same inputs; "
                   "`verify source` runs it alone).")
@click.option("-q", "--quiet", is_flag=True, help="No progress on the terminal.")
@output_options(("table", "json"))
@quoting(whole=size_words(WHOLE_GRAPH_BYTES))
def verify_parity(target: str | None, source: str | None, prompts: tuple[str, ...], ids: tuple[list[int], ...],
                  random_ids: int | None, seed: int, steps: int, provider: str, dtype: str, rope_op: str, tf32: bool,
                  all_layers: bool, checks: str, by_layer: bool, plot: Path | None, no_source_check: bool, quiet: bool,
                  fmt: str) -> None:
    """Run TARGET on onnxruntime against PyTorch float64; exit 0 only when every check passes.

    The verdict and the first bad layer come from each decoder layer run on its own, fed float64's input to it;
    the whole graph (prefill and greedy decode) is judged beside it while its weights are <= {whole}. Inputs:
    built-in text (prose, code, a chat turn) through the model's tokenizer, or seeded random ids without one.

    TARGET: an exported .onnx (the PyTorch side is the source in its metadata, or --source), or a MODEL
    (preset, config.json, checkpoint directory) exported on the fly; default: tiny.

    \b
    Examples:
      llama-tools verify parity
      llama-tools verify parity plain/model.onnx --source ./tiny-meta --prompt "Who is" --steps 4
      llama-tools verify parity big/model.onnx --checks both --random-ids 5 --seed 3
      llama-tools verify parity big/model.onnx --by-layer --plot layers.png
    """
    if target is not None:
        check_onnx_exists(target)
    if random_ids is not None and (prompts or ids):
        raise click.UsageError("give --random-ids N, or --prompt/--ids, not both")
    if by_layer and checks not in ("auto", "layers"):
        raise click.UsageError(f"--by-layer is --checks layers; it cannot go with --checks {checks}")
    mode = "layers" if by_layer else checks
    from ..exporters.preflight import check_args
    from ..exporters.verification.verify_preflight import parity_room
    from ..checkpoints.tokenizer import check_vocab

    from ..checkpoints.source import prompt_ids

    check_args(dtype, rope_op, None)
    room = parity_room(target, source)  # TARGET, --source and the graph's metadata, before torch is imported
    for row in ids:
        check_vocab(row, room.cfg.vocab_size, "--ids")
    # --prompt through the tokenizer now where the PyTorch side is known without reading more (else after)
    batch = [prompt_ids(room.source, t, None)[0] for t in prompts] if room.source is not None else None
    if mode != "layers":  # the layer-local check decodes nothing
        room.check(max([len(r) for r in [*(batch or []), *ids]], default=1), steps)  # a prompt has a token at least
    check_provider(provider)
    if plot is not None:
        from ..reports.parity_plot import check_plot_path

        check_plot_path(plot)  # last of the cheap checks: it imports matplotlib
    from ..exporters.verification.parity import resolve_target
    from ..exporters.verification.verdict import parity_inputs, verify

    tgt = resolve_target(target, source)
    if batch is None:
        batch = [prompt_ids(tgt.source, t, None)[0] for t in prompts]
    batch += [list(i) for i in ids]
    inputs = parity_inputs(tgt, batch or None, steps if mode != "layers" else 0, random_ids, seed)
    v = verify(tgt, inputs, mode=mode, provider=provider, steps=steps, dtype=dtype, rope_op=rope_op, tf32=tf32,
               source_check=not no_source_check, progress=terminal("parity", quiet=quiet))
    if plot is not None:
        from ..exporters.verification.by_layer import whole_graph_series
        from ..reports.parity_plot import plot_layers

        plot_layers(v.by_layer.series() if v.by_layer is not None else whole_graph_series(v.whole), plot)
    if fmt == "json":
        click.echo(render([], "json", json_payload={**v.to_dict(), "plot": str(plot) if plot else None}))
    else:
        _print_verdict(v, all_layers)
        if plot is not None:
            click.echo(f"plot: {plot}")
    if not v.passed:
        sys.exit(1)


def _print_verdict(v: Any, all_layers: bool) -> None:
    """The header, the layer-local table, the whole-graph table, notes, times and the verdict line."""
    from ..exporters.verification.by_layer import by_layer_rows

    first = v.by_layer or v.whole
    click.echo(f"{first.onnx_path} ({first.graph}, {first.dtype}); reference from {first.source}")
    click.echo(f"inputs: {v.inputs}; {len(v.prompt_lengths)} rows of {v.prompt_lengths} tokens, left-padded")
    if v.source_check is not None:
        _print_source(v.source_check, brief=not all_layers)
    if v.by_layer is not None:
        r = v.by_layer
        click.echo(f"layer by layer on onnxruntime ({r.provider}), each layer fed float64's input to it:")
        click.echo(render(by_layer_rows(r, all_layers), "table", numparse=False))
        for note in r.notes:
            click.echo(f"note: {note}")
        click.echo("time: " + ", ".join(f"{k} {t:.2f} s" for k, t in r.timings.items()))
    if v.whole is not None:
        r = v.whole
        options = ", ".join(f"{k}={o}" for k, o in r.provider_options.items())
        click.echo(f"whole graph on onnxruntime, {r.provider_note} [{options}]; prefill and greedy decode:")
        click.echo(render(parity_rows(r, all_layers), "table", numparse=False))
        for note in r.notes:
            click.echo(f"note: {note}")
        click.echo("time: " + ", ".join(f"{k} {t:.2f} s" for k, t in r.timings.items()))
    for note in v.notes:
        click.echo(f"note: {note}")
    took = f" (after a {v.export_seconds:.1f} s export)" if v.export_seconds is not None else ""
    source_bad = v.source_check is not None and not v.source_check.passed
    where = f"; {v.first_bad}" if source_bad else f"; first out of budget: {v.first_bad}" if v.first_bad else ""
    click.echo(f"{'PASS' if v.passed else 'FAIL'}{where}: checks ran in {v.seconds:.1f} s{took}")


def _print_source(rep: Any, brief: bool = False) -> None:
    """The source check's header line, its table and notes (one line when it did not run, or passed and `brief`)."""
    from ..exporters.verification.source_check import source_rows

    if not rep.checked:
        click.echo(rep.headline)
        return
    if brief and rep.passed:
        click.echo(f"{rep.headline}: {rep.summary} (--all-layers: every block)")
        return
    click.echo(f"{rep.headline}, each block fed our float64 input to it:")
    if rep.mismatch:
        click.echo(f"FAIL: {rep.mismatch}")
    else:
        click.echo(render(source_rows(rep), "table", numparse=False))
    for note in rep.notes:
        click.echo(f"note: {note}")
    click.echo(f"time: source check {rep.seconds:.2f} s")


@verify.command("source", short_help="Our reading of a checkpoint against transformers' own, layer by layer.")
@click.argument("model", type=ModelArg(weights_required_in_dir=True), default="tiny", required=False)
@input_options
@click.option("-q", "--quiet", is_flag=True, help="No progress on the terminal.")
@output_options(("table", "json"))
def verify_source(model: Any, prompts: tuple[str, ...], ids: tuple[list[int], ...], random_ids: int | None, seed: int,
                  quiet: bool, fmt: str) -> None:
    """Run MODEL in transformers, read by transformers itself, against our float64 reference; exit 0 when they agree.

    Each of transformers' decoder layers is fed our float64 input to it and judged as `verify parity` judges a
    graph: a key our config reader misses or misreads shows at the first layer it touches. No graph is needed.

    \b
    Examples:
      llama-tools verify source ./checkpoint
      llama-tools verify source ./checkpoint --prompt "The capital of France is" --format json
    """
    from ..checkpoints.source import prompt_ids
    from ..checkpoints.tokenizer import check_vocab

    if random_ids is not None and (prompts or ids):
        raise click.UsageError("give --random-ids N, or --prompt/--ids, not both")
    for row in ids:
        check_vocab(row, model.cfg.vocab_size, "--ids")
    batch = [prompt_ids(model, t, None)[0] for t in prompts] + [list(i) for i in ids]
    from ..exporters.prompts import Inputs, default_inputs
    from ..exporters.verification.source_check import check_source

    inputs = (Inputs(batch, f"{len(batch)} row(s) given") if batch else
              default_inputs(model, model.cfg.vocab_size, model.cfg.max_position_embeddings, random_ids=random_ids,
                             seed=seed))
    rep = check_source(model, inputs.rows, progress=terminal("source", quiet=quiet), batches=inputs.batches())
    if not rep.checked:
        raise click.ClickException(f"{model.spec}: the source check cannot run: {rep.reason}")
    if fmt == "json":
        click.echo(render([], "json", json_payload={**rep.to_dict(), "inputs": inputs.what,
                                                    "prompt_lengths": [len(r) for r in inputs.rows]}))
    else:
        click.echo(f"inputs: {inputs.what}; {len(inputs.rows)} rows of {[len(r) for r in inputs.rows]} tokens, "
                   f"left-padded")
        _print_source(rep)
        library = rep.library.split()[0]
        click.echo(f"PASS: our reading agrees with {library}" if rep.passed else f"FAIL: {rep.failure}")
    if not rep.passed:
        sys.exit(1)


def check_onnx_exists(target: str) -> None:
    """A TARGET meant as an .onnx file that is not there: one line naming the command that writes it."""
    if target.endswith(".onnx") and not os.path.exists(target):
        raise ValueError(f"{target}: no such file; write it first with `llama-tools export onnx MODEL -o {target}`")


def parity_rows(rep: Any, all_layers: bool = False) -> list[dict[str, Any]]:
    """The table: logits, the K/V (one summary row, plus each failing or every layer), decode, greedy."""
    def row(c: Any, name: str | None = None, result: str | None = None) -> dict[str, Any]:
        return {"check": name or c.name, "RMS error to float64 (ratio; bound)": c.figures(),
                "max abs": f"{c.max_error:.3g}", "cosine": f"{c.cosine:.7f}",
                "top-1": "" if c.top1 is None else f"{c.top1:.1%}", "result": result or c.verdict}

    by_name = {c.name: c for c in rep.checks}
    kv = [c for c in rep.checks if c.name.startswith("present.")]
    rows = [row(by_name["logits"])]
    if kv:
        worst = max(kv, key=lambda c: c.ratio if math.isfinite(c.ratio) else math.inf)
        ok = all(c.passed for c in kv)
        rows.append(row(worst, f"present.* (worst of {len(kv)} K/V)",
                        "pass" if ok else f"FAIL from layer {rep.first_bad_layer}"))
        rows += [row(c) for c in kv if all_layers or not c.passed]
    if "decode logits" in by_name:
        rows.append(row(by_name["decode logits"]))
    d = rep.decode
    rows.append({"check": f"greedy decode ({d.steps} steps x {len(rep.prompt_lengths)} rows)",
                 "RMS error to float64 (ratio; bound)": "", "max abs": "", "cosine": "",
                 "top-1": f"{d.agreed}/{d.steps} steps agree", "result": "pass" if d.passed else f"FAIL: {d.divergence}"})
    return rows


@verify.command("int4", short_help="An int4 graph against the fp32 model: top-1, KL, perplexity.")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--source", type=ModelArg(weights_required_in_dir=True), default=None,
              help="The fp32 PyTorch side [default: the source in the file's metadata].")
@click.option("--steps", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy decode steps for the top-1 agreement; the prompt and these must fit the model's context.")
@click.option("--prompt", type=Text(), default=None, metavar="TEXT",
              help="Start the greedy decode from this text (the source's tokenizer) [default: the first sentence of the "
                   f"built-in English text; {PROMPT_IDS} seeded ids for a model with no tokenizer].")
@click.option("--ids", default=None, metavar="IDS", help="Raw prompt ids instead of --prompt, e.g. '1 450 29871'.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Score KL and perplexity on this real text file (its first --max-tokens tokens) [default: the "
                   "built-in English text the export's quality line scores; for a model with no tokenizer, the "
                   "prompt plus fp32's own greedy continuation].")
@click.option("--max-tokens", type=click.IntRange(min=2), default=256, show_default=True,
              help="How many tokens of --text to score.")
@provider_option
@output_options(("table", "json"))
def verify_int4(target: Path, source: Any, steps: int, prompt: str | None, ids: str | None, text_file: Path | None,
                max_tokens: int, provider: str, fmt: str) -> None:
    """An int4 graph (export --quantize int4) against the fp32 model: top-1, KL and perplexity, never fp32 bounds.

    Exit 0 when it meets its own stated thresholds (faithful), 1 otherwise.

    \b
    Example:
      llama-tools export onnx tiny -o int4/model.onnx --quantize int4
      llama-tools verify int4 int4/model.onnx
      llama-tools verify int4 int4/model.onnx --prompt "The capital of France is" --text wiki.txt
    """
    check_onnx_exists(str(target))
    if prompt is not None and ids is not None:
        raise click.UsageError("give at most one of --prompt TEXT or --ids '1 2 3'")
    from ..exporters.verification.verify_preflight import int4_source
    from ..checkpoints.header_readers import open_regular
    from ..checkpoints.source import load_tokenizer, no_tokenizer, prompt_ids

    # Everything that needs no weights, before torch is imported: the graph holds int4, its fp32 side, the prompt
    # in the vocabulary, the prompt and --steps within the context, --text.
    model, room = int4_source(target, source)
    start = prompt_ids(model, prompt, ids)[0] if prompt is not None or ids is not None else None
    context = min(max_tokens, room.positions)  # a static KV buffer holds the scored text too
    tok = load_tokenizer(model)
    sequence, on = None, None
    if text_file is not None:
        if tok is None:
            raise no_tokenizer(model, "score --text")
        try:
            with open_regular(text_file) as f:  # a FIFO or device is refused, never read
                text = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{text_file}: not UTF-8 text (byte {e.start}); --text takes a text file") from None
        sequence, on = tok.encode(text)[:context], text_file.name
        if len(sequence) < 2:
            raise click.BadParameter(f"{text_file} encodes to {len(sequence)} token(s); give some text", param_hint="--text")
    if tok is not None:  # real text by default: random ids drive a trained model where no text goes
        from ..exporters.prompts import default_int4_inputs

        first, text_ids = default_int4_inputs(tok, context)
        start = first if start is None else start
        if sequence is None:
            sequence, on = text_ids, "a built-in English text"
    room.check(len(start) if start else PROMPT_IDS, steps)
    check_provider(provider)
    from ..exporters.quantize import measure_quant_parity  # numpy, torch and onnxruntime: the work itself
    from ..checkpoints.loading import load_model

    reference = load_model(source) if source is not None else None
    rep = measure_quant_parity(target, reference, prompt=start, sequence=sequence, steps=steps, on=on,
                               provider=provider)
    t = rep.thresholds
    rows = [("top-1 agreement (teacher-forced)", f"{rep.top1_agreement:.1%}", f">= {t.min_top1:.0%}"),
            ("own greedy tokens equal fp32's", f"{rep.free_run_same}/{rep.steps} steps", ""),
            ("mean KL(fp32 || int4)", f"{rep.mean_kl:.4f} nats", f"<= {t.max_mean_kl} nats"),
            ("max KL", f"{rep.max_kl:.4f} nats", ""),
            ("perplexity fp32 -> int4", f"{rep.ppl_reference:.3f} -> {rep.ppl_int4:.3f} ({rep.ppl_change:+.1%} "
                                         f"+/- {rep.ppl_change_se:.1%})",
             f"within +/-{t.max_ppl_change:.0%}"),
            ("max |logit error| (scale only)", f"{rep.max_abs_logit_error:.3g}", "no fp32 bound applies"),
            ("KL and perplexity on", f"{rep.on} ({rep.sequence_length} tokens)", "")]
    if fmt == "json":
        click.echo(render([], "json", json_payload=rep.to_dict()))
    else:
        click.echo(render([{"measure": a, "value": b, "threshold": c} for a, b, c in rows], "table", numparse=False))
        click.echo(f"int4 graph on onnxruntime, {rep.provider_note}")
        click.echo("FAITHFUL" if rep.faithful else f"NOT FAITHFUL: {'; '.join(rep.failures)}")
    if not rep.faithful:
        sys.exit(1)

