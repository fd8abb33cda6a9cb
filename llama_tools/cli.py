"""The `llama-tools` command line, the layer above everything: parse, resolve MODEL once, call one function, print.

Imports stay inside the commands: `count-params` from a preset never loads torch or pandas.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from . import __version__, dtypes
from .files import check_output_path, check_writes, cleanup_on_signals, guard_std_streams, stream_fd
from .formats import BENIGN_SUFFIXES, WRITABLE
from .formats import FORMATS as CHECKPOINT_FORMATS
from .output import FORMATS, render
from .exporters.parity_options import MODES, WHOLE_GRAPH_BYTES
from .exporters.preflight import SINGLE_FILE_MAX_BYTES
from .exporters.quant_options import ACCURACY_LEVEL, BLOCK_SIZE, DEFAULT_ALGORITHM, INT4_ALGORITHMS, PROMPT_IDS, QUANTIZE
from .presets import PAPER_MODELS
from .progress import peak_rss_bytes, terminal
from .tokenizer import KINDS as TOKENIZER_KINDS


_STDOUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EPIPE, errno.EIO)  # an OSError of writing stdout


# click >= 8.4 and 8.2 (older ones say the same in a plain UsageError, and print the help without raising)
_NO_SUCH_COMMAND: Any = getattr(click.exceptions, "NoSuchCommand", ())
_HELP_SHOWN: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


def closest(word: str, choices: Any) -> str | None:
    """The one of `choices` that `word` most likely misspells (difflib's ratio >= 0.6), or None."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
    return close[0] if close else None


def usage_line(e: click.UsageError) -> click.ClickException:
    """A usage error as the one line every refusal is: what is wrong, the closest right word, where help is; exit 1.

    click's own form (a usage block, a blank line, the error, possibilities on further lines) and its exit 2 are
    for nobody to parse: the contract is one line on stderr and exit 1 (tests/test_cli_contract.py).
    """
    ctx = e.ctx
    msg, near = e.format_message(), getattr(e, "did_you_mean", None)
    if isinstance(e, click.NoSuchOption) and ctx is not None:
        names = [o for p in ctx.command.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
        msg, near = e.message, closest(e.option_name, names)
    elif isinstance(e, _NO_SUCH_COMMAND) and isinstance(ctx and ctx.command, click.Group):
        msg, near = e.message, closest(e.command_name, ctx.command.list_commands(ctx))
    msg = " ".join(msg.split()).rstrip(".")  # a Choice's "Choose from:" list, one name a line, joined
    hints = ([f"did you mean {near}?"] if near else []) + ([f"see '{ctx.command_path} --help'"] if ctx else [])
    return click.ClickException(msg + (f" ({' '.join(hints)})" if hints else ""))


class Choice(click.Choice):
    """click's Choice, whose refusal carries the closest choice for usage_line's "did you mean"."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            e.did_you_mean = closest(str(value), self.choices)  # type: ignore[attr-defined]
            raise


class Group(click.Group):
    """Bad input becomes one line on stderr and exit 1, never a traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _HELP_SHOWN:
            raise  # the help itself, as asked by giving nothing
        except click.UsageError as e:  # this group's own options (`llama-tools --bogus`)
            raise usage_line(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _HELP_SHOWN:
            raise
        except click.UsageError as e:  # a subcommand's options, an unknown subcommand, a command's own refusal
            raise usage_line(e) from None
        except (ValueError, OSError) as e:
            name = getattr(e, "filename", None)
            if isinstance(e, OSError) and not name and e.errno in _STDOUT_ERRNOS:
                name = "standard output"  # click.echo's write: a full disk, a closed pipe (`| head -c1`)
            msg = f"{name}: {e.strerror}" if isinstance(e, OSError) and name and e.strerror else str(e)
            raise click.ClickException(msg.splitlines()[0] if msg else type(e).__name__) from None


class ModelArg(click.ParamType):
    """MODEL (a preset, a config.json/params.json, a checkpoint directory, a .gguf), resolved once into a ModelSource."""

    name = "MODEL"

    def __init__(self, weights_required_in_dir: bool = False):
        self.weights_required_in_dir = weights_required_in_dir

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from .source import ModelSource, resolve

        if isinstance(value, ModelSource):
            return value
        w = self.weights_required_in_dir  # the commands that run the weights: a partial file is refused here
        return resolve(value, weights_required_in_dir=w, needs_data=w)  # ValueError: one line


class CountArg(ModelArg):
    """MODEL for count-params and report shapes: also a foreign config.json (transformers' module tree) and weight
    files without a config (their headers), where ModelArg would refuse them."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from .source import resolve_countable

        return resolve_countable(value)  # ValueError: one line


class IdsArg(click.ParamType):
    """'1 450 29871' or '1,450' -> [1, 450, 29871]."""

    name = "IDS"

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        from .tokenizer import parse_ids

        try:
            ids = parse_ids(value) if isinstance(value, str) else list(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if not ids:
            self.fail("no token ids given", param, ctx)
        return ids


class Finite(click.ParamType):
    """A float that is a number (no nan, no inf)."""

    name = "NUMBER"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def output_options(formats: tuple[str, ...] = FORMATS) -> Callable:
    """The shared --format option: a human table by default, machine-readable on request."""
    def decorator(f: Callable) -> Callable:
        @click.option("--format", "fmt", type=Choice(formats), default=formats[0], show_default=True,
                      help="Output format.")
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)
        return wrapper
    return decorator


def say(msg: str) -> None:
    """A status line on a terminal's stderr; nothing when piped."""
    if sys.stderr.isatty():
        click.echo(msg, err=True)


def size_words(n: int) -> str:
    """A byte constant as help text quotes it (64 MiB, 1 GiB): read from the code, never retyped."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift:,} {unit}"
    return f"{n:,} bytes"


def _tokenizer_files() -> str:
    """The tokenizers MODEL may carry, from tokenizer.KINDS: a file name, or a glob's file's vocabulary."""
    names = [k.patterns[0] if "*" not in k.patterns[0] else f"a {k.patterns[0].lstrip('*')} file's vocabulary"
             for k in TOKENIZER_KINDS]
    return ", ".join(names[:-1]) + " or " + names[-1]


TOKENIZER_FILES = _tokenizer_files()


def quoting(**values: Any) -> Callable:
    """Fill a command's docstring (its -h) with figures and names from the code: {name} placeholders."""
    def decorator(f: Callable) -> Callable:
        f.__doc__ = (f.__doc__ or "").format(**values)
        return f
    return decorator


DTYPE_CHOICE = Choice(dtypes.MODEL_DTYPES)
# What every seeded generator takes (torch's manual_seed and numpy's default_rng both): 0 .. 2^64 - 1.
SEED = click.IntRange(min=0, max=2**64 - 1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, prog_name="llama-tools")
def cli() -> None:
    """Understand, count, export and verify LLaMA-family models.

    MODEL, wherever a command takes one, is a preset name (`llama-tools presets` lists them and their aliases),
    a config.json or params.json, a checkpoint directory or a .gguf file. Each command's -h has its defaults
    and examples.

    \b
    Examples:
      llama-tools presets
      llama-tools count-params llama-2-7b
      llama-tools generate tiny --prompt "Who is" --max-new-tokens 8
    """


# ==== count-params ====================================================================================

@cli.command("count-params", short_help="Exact parameters, memory and FLOPs beside the paper's formula.")
@click.argument("models", nargs=-1, type=CountArg())
@click.option("--context", type=click.IntRange(min=1), default=None,
              help="Tokens of KV cache and attention for the memory and FLOP figures [default: each model's max].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences held in the KV cache.")
@click.option("--per-layer", is_flag=True, help="Also list every decoder layer's count.")
@click.option("--check", is_flag=True, help="Exit 1 also when a checkpoint holds tensors its config does not explain, "
                                           "or a weight file is partial.")
@output_options()
@quoting(paper=" ".join(PAPER_MODELS))
def count_params(models: tuple[Any, ...], context: int | None, batch: int, per_layer: bool, check: bool,
                 fmt: str) -> None:
    """Exact parameters of MODELS (presets, config.json files or checkpoint directories) beside the paper's formula.

    With no MODELS: the paper's four ({paper}). A checkpoint
    directory is counted from its headers alone; no tensor data is read. A config.json of an architecture
    no family here models is counted exactly from transformers' module tree (the [hf] extra); weight files
    without a config (a model.safetensors, an index, any GGUF, a directory of them) or partial ones are
    counted from their headers: tensors, parameters and bytes by dtype, per file and per layer.

    \b
    Examples:
      llama-tools count-params llama-2-7b ./phi3/config.json --format json
      llama-tools count-params model.safetensors --per-layer
    """
    from .accounting import ParamCount, layer_rows, long_rows, summary_rows
    from .header_count import HeaderCount, header_long_rows, header_rows
    from .source import resolve_countable
    from .transformers_count import ModuleTreeCount, tree_layer_rows, tree_long_rows, tree_summary_rows

    counted = [_count(resolve_countable(m), context, batch) for m in (models or PAPER_MODELS)]
    counts = [c for c in counted if isinstance(c, ParamCount)]  # the native ones, side by side as ever
    trees = [c for c in counted if isinstance(c, ModuleTreeCount)]
    headers = [c for c in counted if isinstance(c, HeaderCount)]
    if fmt == "json":
        click.echo(render([], fmt, json_payload=[c.payload() if isinstance(c, HeaderCount) else c for c in counted]))
    elif fmt == "csv":
        click.echo(render([r for c in counted for r in (long_rows([c]) if isinstance(c, ParamCount) else
                                                        tree_long_rows(c) if isinstance(c, ModuleTreeCount) else
                                                        header_long_rows(c))], fmt))
    else:
        if counts:
            click.echo(render(summary_rows(counts), fmt))
        for c in counts:
            if per_layer:
                click.echo(f"\n{c.model}: per layer\n" + render(layer_rows(c), fmt))
            if c.checkpoint is not None:
                click.echo(f"\n{c.model}: {c.checkpoint.path} ({c.checkpoint.format}, {c.checkpoint.layout} names), "
                           f"read from headers in {c.checkpoint.seconds * 1000:.0f} ms\n"
                           + render(checkpoint_rows(c.checkpoint), fmt))
            for note in c.notes:
                click.echo(f"note ({c.model}): {note}")
        if trees:
            click.echo(("\n" if counts else "") + render(tree_summary_rows(trees), fmt))
        for t in trees:
            if per_layer:
                click.echo(f"\n{t.model}: per layer, from the module tree\n" + render(tree_layer_rows(t), fmt))
            for note in t.notes:
                click.echo(f"note ({t.model}): {note}")
        for k, h in enumerate(headers):
            what = f"{h.format}" + (f", architecture {h.architecture}" if h.architecture else "")
            click.echo(("\n" if counts or trees or k else "") + f"{h.model}: {h.source} ({what}), counted from "
                       f"headers in {h.seconds * 1000:.0f} ms ({h.reason}); no tensor data read\n"
                       + render(header_rows(h, per_layer), fmt))
            for note in h.notes:
                click.echo(f"note ({h.model}): {note}")
    for h in headers:  # a partial download: counted, and said where a script sees it
        base = Path(h.source)
        for f in h.partial:
            where = (base if base.is_dir() else base.parent) / f.file
            click.echo(f"{'error' if check else 'warning'}: {where}: partial: holds {f.present:,} of the "
                       f"{f.declared:,} bytes its header declares ({f.missing:,} missing)", err=True)
    # Missing or misshapen tensors always fail (the file cannot be the model its config says); tensors
    # the config does not explain fail only with --check.
    for c in counts:
        insp = c.checkpoint
        if insp is None:
            continue
        for m in insp.mismatched:
            click.echo(f"error: {insp.path}/{m.file}: tensor {m.name} has shape {list(m.found)}, "
                       f"its config predicts {list(m.expected)}", err=True)
        for ct in insp.missing:
            click.echo(f"error: {insp.path}: tensor {ct.name} {list(ct.shape)} that its config predicts is missing",
                       err=True)
        odd = [t for t in insp.unexplained if not t.name.endswith(BENIGN_SUFFIXES)]
        for t in odd:
            click.echo(f"{'error' if check else 'warning'}: {insp.path}/{t.file}: tensor {t.name} is no weight "
                       f"of its config", err=True)
        if insp.mismatched or insp.missing or (check and odd):
            sys.exit(1)
    if check and any(h.partial for h in headers):
        sys.exit(1)


@cli.command(short_help="List the presets a MODEL argument may name.")
@output_options(("table", "json", "csv", "markdown"))
def presets(fmt: str) -> None:
    """The presets MODEL may name, with the aliases that name them too: parameters, layers, width, heads and where
    the numbers come from.

    \b
    Example:
      llama-tools presets --format json
    """
    from .accounting import count_params
    from .presets import PRESET_SOURCES, PRESETS, aliases_of, preset_tokenizer

    rows = [{"name": name, "params": count_params(c).total, "layers": c.num_hidden_layers, "width": c.hidden_size,
             "heads q/kv": f"{c.num_attention_heads}/{c.num_key_value_heads}", "vocab": c.vocab_size,
             "tokenizer": "yes" if preset_tokenizer(name) else "", "source": PRESET_SOURCES.get(name, ""),
             "aliases": ", ".join(aliases_of(name))}
            for name, c in PRESETS.items()]
    click.echo(render(rows, fmt))


def _count(target: Any, context: int | None, batch: int) -> Any:
    """One MODEL's count: native (accounting), from transformers' module tree, or from weight files' headers."""
    from .accounting import count_source
    from .header_count import count_headers
    from .header_readers import PartialFile
    from .source import ForeignConfig, HeaderFiles

    if isinstance(target, HeaderFiles):
        return count_headers(target)
    if isinstance(target, ForeignConfig):
        from .transformers_count import count_module_tree  # imports transformers: only for such a config

        return count_module_tree(target)
    try:
        return count_source(target, context=context, batch=batch)
    except PartialFile as e:  # a checkpoint with its config but a file cut short: what its headers say
        if target.kind != "checkpoint" or target.path is None:
            raise
        return count_headers(HeaderFiles(target.spec, target.path, f"{e.path.name} is partial, so the files are not "
                                                                   f"checked against the config"))


def checkpoint_rows(insp: Any) -> list[dict[str, Any]]:
    """Flat rows for output.render: per dtype, per component, then every problem, then the total."""
    rows: list[dict[str, Any]] = []

    def row(section: str, name: str, params: int | str = "", expected: int | str = "", nbytes: int | str = "",
            note: str = "") -> None:
        rows.append({"section": section, "name": name, "params": params, "expected": expected, "bytes": nbytes,
                     "note": note})

    for t in insp.by_dtype:
        per = (f"{t.block_bytes} bytes per weight" if t.block_weights == 1 else
               f"{t.block_bytes} bytes per {t.block_weights} weights")
        row("dtype", t.dtype, t.params, "", t.bytes, f"{t.tensors} tensors, {per}")
    for c in insp.by_component:
        note = "" if c.found_params == c.expected_params else ("not in config" if not c.expected_params else "differs")
        row("component", c.component, c.found_params, c.expected_params, "", note)
    for t in insp.unexplained:
        benign = t.name.endswith(BENIGN_SUFFIXES)
        row("unexplained", t.name, t.numel, 0, t.nbytes,
            f"{t.file}: " + ("a stored buffer, skipped when loading" if benign else "no weight of the config"))
    for ct in insp.missing:
        row("missing", ct.name, 0, math.prod(ct.shape), "", f"expected shape {list(ct.shape)}")
    for m in insp.mismatched:
        row("mismatch", m.name, math.prod(m.found), math.prod(m.expected), "",
            f"{m.file}: shape {list(m.found)}, config predicts {list(m.expected)}")
    row("total", f"{len(insp.tensors)} tensors in {len(insp.files)} files", insp.total_params, insp.expected_params,
        insp.total_bytes, "matches config" if insp.ok else "DIFFERS from config")
    return rows


# ==== report ==========================================================================================

@cli.group(cls=Group, short_help="Shape reports of weights and activations, in the paper's order.")
def report() -> None:
    """Shape reports: every weight and activation of a forward pass, in the paper's order.

    \b
    Examples:
      llama-tools report shapes llama-2-7b --seq-len 512 -o shapes.csv
      llama-tools report regenerate -o reports/generated
    """


@report.command("shapes", short_help="Every weight and activation of one forward pass: shape, elements, bytes.")
@click.argument("model", type=CountArg())
@click.option("--seq-len", "seq_len", type=click.IntRange(min=1), default=128, show_default=True,
              help="n3: new tokens per sequence.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per batch.")
@click.option("--past", type=click.IntRange(min=0), default=0, show_default=True,
              help="Cached positions before this step (KV cache).")
@click.option("--dtype", type=DTYPE_CHOICE, default=None, help="Element type for bytes [default: the model's published dtype].")
@click.option("--layers", type=Choice(["all", "first"]), default="all", show_default=True,
              help="Rows of every decoder, or of decoder 0 only.")
@click.option("--only", type=Choice(["all", "weights", "activations"]), default="all", show_default=True,
              help="Keep one kind of row.")
@click.option("-o", "--output", type=click.Path(), metavar="PATH", default=None,
              help="Write here (atomically) instead of stdout [default: standard output].")
@click.option("--format", "fmt", type=Choice(["csv", "json", "markdown", "table"]), default=None,
              help="Output format [default: from -o's suffix (.csv, .json, .md), else csv].")
def report_shapes(model: Any, seq_len: int, batch: int, past: int, dtype: str | None, layers: str, only: str,
                  output: str | None, fmt: str | None) -> None:
    """Shapes, element counts and bytes of MODEL's weights and activations (preset, config.json or directory).

    A config.json of an architecture no family here models: its weights from transformers' module tree (the [hf]
    extra), its activations left out (a note on stderr says so).

    \b
    Examples:
      llama-tools report shapes tiny
      llama-tools report shapes llama-2-7b --seq-len 512 --batch 4 --layers first -o shapes.md
    """
    from .reports.shapes import infer_format, module_tree_report, render_report, shape_report, write_report
    from .source import ForeignConfig, HeaderFiles

    if isinstance(model, HeaderFiles):
        raise ValueError(f"{model.spec}: report shapes reads a config, and these weight files have none it models "
                         f"({model.reason}); count their tensors with `llama-tools count-params {model.spec}`")
    fmt = infer_format(output, fmt)
    if output is not None:
        check_output_path(output)
        check_writes([output], model.files)  # never over the config (or anything else) the report reads
    if isinstance(model, ForeignConfig):
        from .transformers_count import module_tree  # imports transformers: only for such a config

        rep = module_tree_report(module_tree(model), seq_len, batch, past, dtype, layers, only)
    else:
        rep = shape_report(model.cfg, seq_len, batch, past, dtype, layers, only)
    check_counts(rep)
    for note in rep.notes:
        click.echo(f"note: {note}", err=True)
    if output is None:
        click.echo(render_report(rep, fmt), nl=False)
        return
    write_report(rep, output, fmt)
    click.echo(f"wrote {len(rep.rows)} rows ({fmt}) to {output}", err=True)


# Every count a shape report prints (dims, elements, bytes) is an int64 to pandas and to whatever reads its CSV/JSON.
INT64_MAX = 2**63 - 1


def check_counts(rep: Any) -> None:
    """The report's largest tensor within int64 bytes, or one line naming it and the options that made it so."""
    big = max(rep.records(), key=lambda r: r["bytes"], default=None)
    if big is not None and big["bytes"] > INT64_MAX:
        raise ValueError(f"--batch {rep.batch}, --seq-len {rep.seq_len}, --past {rep.past}: {big['symbol']} "
                         f"({big['description']}) would take over 2^{big['bytes'].bit_length() - 1} bytes, past what "
                         f"a 64-bit count holds (2^63 - 1); give smaller numbers")


@report.command("regenerate", short_help="Rebuild the paper's four models' reports.")
@click.option("-o", "--output", "--out", "out", type=click.Path(file_okay=False), metavar="DIR", default=None,
              help="Directory to write [default: the current directory].")
@output_options(("table", "json"))
def report_regenerate(out: str | None, fmt: str) -> None:
    """Rebuild the reports of the paper's four models (the repository keeps them in reports/generated/).

    \b
    Example:
      llama-tools report regenerate -o reports/generated
    """
    from .reports.regenerate import regenerate

    rows = [{"file": str(p), "bytes": p.stat().st_size} for p in regenerate(out)]
    click.echo(render(rows, fmt))

# ==== checkpoints: convert, tokenize, generate =========================================================

@cli.command(short_help="Rewrite a checkpoint (or a preset's seeded weights) in another layout.")
@click.argument("src", type=ModelArg(weights_required_in_dir=True))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--to", "to", type=Choice(WRITABLE), required=True,
              help="The layout to write: " + "; ".join(f"{k}: {CHECKPOINT_FORMATS[k].description}" for k in WRITABLE)
                   + ".")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Number of files (HF shards with an index, or Meta model-parallel shards).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Random init of a preset or config.json.")
@click.option("--dtype", type=DTYPE_CHOICE, default=None,
              help="Cast the weights [default: as stored; a GGUF is dequantized to float32].")
@output_options(("table", "json"))
def convert(src: Any, dst: Path, to: str, shards: int, seed: int, dtype: str | None, fmt: str) -> None:
    """Rewrite SRC (a checkpoint, a GGUF file, or a preset/config with its seeded weights) in another layout at DST.

    DST is a new (or empty) directory, written atomically: all its files appear at once, or none. For --to gguf it
    is a new file (or a stream, device or FIFO), written atomically the same way.

    \b
    Examples:
      llama-tools convert tiny tiny-hf --to hf
      llama-tools convert ./tiny-hf tiny.gguf --to gguf --dtype float16
      llama-tools convert ./tiny-hf tiny-meta --to meta --shards 2 --dtype bfloat16
    """
    from .convert import convert as run_convert

    check_writes([dst], src.files)
    res = run_convert(src, dst, to=to, shards=shards, seed=seed, dtype=dtype)
    for warning in res.warnings:
        click.echo(f"warning: {warning}", err=True)
    rows = [{"destination": res.destination, "layout": res.layout, "files": len(res.files),
             "tensors": res.tensors, "params": res.params, "bytes": res.bytes}]
    # A GGUF sent to standard output (DST -): the summary goes to stderr, not into it.
    click.echo(render(rows, fmt, json_payload=res), err=stream_fd(dst) == 1)


@cli.command(short_help="Text to token ids and pieces, or ids back to text.")
@click.argument("model", type=ModelArg())
@click.argument("text", required=False)
@click.option("--ids", type=IdsArg(), default=None, help="Decode these ids instead of encoding TEXT.")
@click.option("--no-bos", is_flag=True, help="Do not prepend <s>.")
@output_options()
@quoting(files=TOKENIZER_FILES)
def tokenize(model: Any, text: str | None, ids: list[int] | None, no_bos: bool, fmt: str) -> None:
    """Encode TEXT (or decode --ids) with MODEL's own tokenizer: one row per token.

    The tokenizer is MODEL's {files} (the tiny preset ships one).

    \b
    Examples:
      llama-tools tokenize tiny "Hello world"
      llama-tools tokenize ./tiny-hf --ids "1 450 29871" --format json
    """
    from .source import load_tokenizer, no_tokenizer

    if (text is None) == (ids is None):
        raise ValueError("give exactly one of TEXT or --ids '1 2 3'")
    tok = load_tokenizer(model, fits=False)  # the tokenizer alone: its ids need not fit the model's vocab_size
    if tok is None:
        raise no_tokenizer(model, "decode --ids" if ids is not None else "encode TEXT")
    token_ids = ids if ids is not None else tok.encode(text or "", bos=False if no_bos else None)
    rows = [{"position": i, "id": t, "piece": p} for i, (t, p) in enumerate(zip(token_ids, tok.pieces(token_ids)))]
    click.echo(render(rows, fmt, numparse=False, json_payload={"ids": token_ids, "text": tok.decode(token_ids), "tokens": rows}))


@cli.command(short_help="Continue a prompt with a model (greedy by default).")
@click.argument("model", type=ModelArg(weights_required_in_dir=True))
@click.option("--prompt", default=None, metavar="TEXT",
              help=f"Text, encoded with MODEL's tokenizer ({TOKENIZER_FILES}; with <s> as it says); this or --ids.")
@click.option("--ids", default=None, metavar="IDS", help="Raw prompt ids instead of --prompt, e.g. '1 450 29871'.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="Tokens to add at most (fewer when </s> comes); prompt + these must fit the context.")
@click.option("--temperature", type=Finite(), default=0.0, show_default=True,
              help="Divide the scores by this before sampling (the paper's alpha2, 7.2); 0 is greedy.")
@click.option("--repetition-penalty", type=Finite(), default=1.0, show_default=True,
              help="Make tokens already seen less likely (the paper's alpha1, 7.1); 1 is off.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sample among the K likeliest tokens only; 0 keeps every token.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
              help="Sample among the likeliest tokens whose probabilities add up to P (nucleus); 1 is off.")
@click.option("--seed", type=SEED, default=None, help="Seed of the sampling draws [default: a fresh one each run].")
@click.option("--dtype", type=DTYPE_CHOICE, default=dtypes.FLOAT32.name, show_default=True,
              help="Element type the model runs in.")
@click.option("-q", "--quiet", is_flag=True, help="No progress and no timing line on stderr.")
@output_options(("table", "json"))
def generate(model: Any, prompt: str | None, ids: str | None, max_new_tokens: int, temperature: float,
             repetition_penalty: float, top_k: int, top_p: float, seed: int | None, dtype: str, quiet: bool,
             fmt: str) -> None:
    """Continue a prompt with MODEL (greedy by default) and print the text.

    MODEL: a preset, a config.json file (seeded random weights) or a checkpoint directory. Tokens go to
    stdout, the timing line to stderr. Everything cheap (ids in the vocabulary, prompt + --max-new-tokens
    within the context, the sampling options) is checked before torch is loaded.

    \b
    Examples:
      llama-tools generate tiny --prompt "Who is" --max-new-tokens 8
      llama-tools generate ./tiny-hf --ids "1 17 42" --temperature 0.8 --top-p 0.9 --seed 0
    """
    from .sampling import check_sampling
    from .source import prompt_ids

    token_ids, tok = prompt_ids(model, prompt, ids)
    check_sampling(model.cfg, token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   repetition_penalty=repetition_penalty, top_k=top_k, top_p=top_p, dtype=dtype)
    from .generation import generate as run_generate  # torch, only once every cheap check has passed
    from .loading import load_model

    llama = load_model(model, dtype=dtype, progress=terminal("loading", quiet=quiet))
    eos = tok.eos_ids if tok is not None and tok.eos_ids else llama.cfg.eos_token_id  # the checkpoint's EOS ids
    out = run_generate(llama, token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                       repetition_penalty=repetition_penalty, top_k=top_k, top_p=top_p, seed=seed,
                       eos_token_id=eos)
    text = tok.decode(out.prompt_ids + out.new_ids) if tok is not None else None  # decoded whole: spaces join right
    speed = f"{len(out.new_ids)} tokens in {out.seconds:.2f} s ({out.tokens_per_s:.1f} tokens/s, stopped by {out.stopped_by})"
    if fmt == "json":
        click.echo(json.dumps({"prompt_ids": out.prompt_ids, "new_ids": out.new_ids, "text": text,
                               "seconds": out.seconds, "tokens_per_s": out.tokens_per_s,
                               "stopped_by": out.stopped_by}, indent=2))
        return
    click.echo(text if text is not None else " ".join(map(str, out.new_ids)))
    if not quiet:
        click.echo(speed, err=True)  # statistics on stderr: stdout holds only the tokens


# ==== export / verify ==================================================================================

def _rope_op_option(help_suffix: str = "") -> Callable:
    from .exporters.rope_ops import ROPE_OPS, OURS

    lines = "; ".join(f"{op.name}: {op.display}, {op.help}" for op in ROPE_OPS.values())
    return click.option("--rope-op", type=Choice(list(ROPE_OPS)), default=OURS.name, show_default=True,
                        help=lines + help_suffix)


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
@_rope_op_option()
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
@click.option("--max-kl", type=click.FloatRange(min=0, min_open=True, max=10), default=None, metavar="NATS",
              help="With --quantize int4: a quality target. The matrices whose int4 error moves the next-token "
                   "distribution most (measured on built-in text) stay 8-bit until the mean KL to the full-precision "
                   "model is at most NATS [default: no target, every matrix int4].")
@click.option("--no-client-files", is_flag=True, help="Do not write config.json, genai_config.json and the "
                                                      "tokenizer files beside OUTPUT.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Random init of a preset or config.json.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on the terminal.")
@output_options(("table", "json"))
def export_onnx(model: Any, output: Path, dtype: str, rope_op: str, optimize: bool, static_kv: int | None,
                quantize: str | None, int4_block_size: int | None, int4_asymmetric: bool,
                int4_accuracy_level: int | None, int4_algorithm: str | None, int4_keep: tuple[str, ...],
                max_kl: float | None, no_client_files: bool, seed: int,
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
    from .exporters.preflight import check_args, check_output  # no torch: a refusal here is quick
    from .exporters.rope_ops import ROPE_OPS

    int4 = {k: v for k, v in (("block_size", int4_block_size), ("symmetric", False if int4_asymmetric else None),
                              ("accuracy_level", int4_accuracy_level), ("exclude", int4_keep or None),
                              ("algorithm", int4_algorithm), ("max_kl", max_kl))
            if v is not None}
    if int4 and quantize != "int4":
        raise click.UsageError("the --int4-* options go with --quantize int4")
    if int4_block_size is not None and int4_block_size & (int4_block_size - 1):
        raise click.BadParameter(f"{int4_block_size} is not a power of two", param_hint="--int4-block-size")
    check_args(dtype, rope_op, None)
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
    from .exporters.pipeline import export

    rep = export(model, output, dtype=dtype, rope_op=rope_op, optimize=optimize, quantize=quantize, int4=int4,
                 static_kv=static_kv, seed=seed, client_files=not no_client_files,
                 progress=terminal("export", quiet=quiet), say=(lambda m: None) if quiet else say)
    phases = export_phases(started, rep)
    for note in rep.notes:
        click.echo(f"note: {note}", err=True)
    for warning in rep.client_files.warnings if rep.client_files else []:
        click.echo(f"warning: {warning}", err=True)
    if rep.quality and rep.quality.warning:
        hqq = "" if (int4 or {}).get("algorithm") == "hqq" else "try --int4-algorithm hqq (closer, slower on the CPU), "
        click.echo(f"warning: int4 moves this model's answers ({rep.quality.warning}); {hqq}measure it on your text "
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
        kept = ", ".join(n.removesuffix("/MatMul").removeprefix("/model/") for n in t.kept_8bit[:4])
        more = f", ... ({len(t.kept_8bit) - 4} more)" if len(t.kept_8bit) > 4 else ""
        rows.append(("int4 target", f"mean KL <= {t.max_kl:g} nats {'met' if t.met else 'NOT met'}: "
                                    f"{t.calibration_kl:.4f} on {t.calibration_tokens} calibration tokens, "
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


@cli.group(cls=Group, short_help="Check an ONNX export against PyTorch (parity, or int4 quality).")
def verify() -> None:
    """Check an export against the PyTorch model.

    \b
    Examples:
      llama-tools verify parity plain/model.onnx
      llama-tools verify int4 int4/model.onnx
    """


@verify.command("parity", short_help="An ONNX graph on onnxruntime against PyTorch, layer by layer and whole.")
@click.argument("target", required=False)
@click.option("--source", default=None, help="The PyTorch side when TARGET is an .onnx file "
                                              "[default: the source in the file's metadata].")
@click.option("--prompt", "prompts", multiple=True, help=f"Text, encoded with the checkpoint's tokenizer "
                                                        f"({TOKENIZER_FILES}); repeat for a batch [default: "
                                                        f"built-in text].")
@click.option("--ids", "ids", multiple=True, type=IdsArg(),
              help="Raw ids instead of --prompt, e.g. '1 450 29871'; repeat for a batch.")
@click.option("--random-ids", "random_ids", type=click.IntRange(1, 64), default=None, metavar="N",
              help="N rows of seeded random ids instead of text: a stress test (the default only without a "
                   "tokenizer).")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Seed of --random-ids.")
@click.option("--steps", type=click.IntRange(min=0), default=8, show_default=True,
              help="Greedy decode steps through the KV cache (whole-graph check).")
@click.option("--provider", type=Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA when a session really runs on it, else the CPU.")
@click.option("--dtype", type=DTYPE_CHOICE, default=dtypes.FLOAT32.name, show_default=True,
              help="When TARGET is a model exported on the fly.")
@_rope_op_option(" (when TARGET is a model exported on the fly)")
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
@click.option("-q", "--quiet", is_flag=True, help="No progress on the terminal.")
@output_options(("table", "json"))
@quoting(whole=size_words(WHOLE_GRAPH_BYTES))
def verify_parity(target: str | None, source: str | None, prompts: tuple[str, ...], ids: tuple[list[int], ...],
                  random_ids: int | None, seed: int, steps: int, provider: str, dtype: str, rope_op: str, tf32: bool,
                  all_layers: bool, checks: str, by_layer: bool, plot: Path | None, quiet: bool, fmt: str) -> None:
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
    from .exporters.preflight import check_args
    from .exporters.verify_preflight import parity_room
    from .tokenizer import check_vocab

    from .source import prompt_ids

    check_args(dtype, rope_op, None)
    room = parity_room(target, source)  # TARGET, --source and the graph's metadata, before torch is imported
    for row in ids:
        check_vocab(row, room.cfg.vocab_size, "--ids")
    # --prompt through the tokenizer now where the PyTorch side is known without reading more (else after)
    batch = [prompt_ids(room.source, t, None)[0] for t in prompts] if room.source is not None else None
    if mode != "layers":  # the layer-local check decodes nothing
        room.check(max([len(r) for r in [*(batch or []), *ids]], default=1), steps)  # a prompt has a token at least
    if plot is not None:
        from .reports.parity_plot import check_plot_path

        check_plot_path(plot)  # last of the cheap checks: it imports matplotlib
    from .exporters.parity import resolve_target
    from .exporters.verdict import parity_inputs, verify

    tgt = resolve_target(target, source)
    if batch is None:
        batch = [prompt_ids(tgt.source, t, None)[0] for t in prompts]
    batch += [list(i) for i in ids]
    inputs = parity_inputs(tgt, batch or None, steps if mode != "layers" else 0, random_ids, seed)
    v = verify(tgt, inputs, mode=mode, provider=provider, steps=steps, dtype=dtype, rope_op=rope_op, tf32=tf32,
               progress=terminal("parity", quiet=quiet))
    if plot is not None:
        from .exporters.by_layer import whole_graph_series
        from .reports.parity_plot import plot_layers

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
    from .exporters.by_layer import by_layer_rows

    first = v.by_layer or v.whole
    click.echo(f"{first.onnx_path} ({first.graph}, {first.dtype}); reference from {first.source}")
    click.echo(f"inputs: {v.inputs}; {len(v.prompt_lengths)} rows of {v.prompt_lengths} tokens, left-padded")
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
    where = f"; first out of budget: {v.first_bad}" if v.first_bad else ""
    click.echo(f"{'PASS' if v.passed else 'FAIL'}{where}: checks ran in {v.seconds:.1f} s{took}")


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
@click.option("--prompt", default=None, metavar="TEXT",
              help=f"Start the greedy decode from this text (the source's tokenizer) [default: {PROMPT_IDS} seeded ids].")
@click.option("--ids", default=None, metavar="IDS", help="Raw prompt ids instead of --prompt, e.g. '1 450 29871'.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Score KL, perplexity and top-1 on this real text file (its first --max-tokens tokens) "
                   "[default: the prompt plus fp32's own greedy continuation].")
@click.option("--max-tokens", type=click.IntRange(min=2), default=256, show_default=True,
              help="How many tokens of --text to score.")
@output_options(("table", "json"))
def verify_int4(target: Path, source: Any, steps: int, prompt: str | None, ids: str | None, text_file: Path | None,
                max_tokens: int, fmt: str) -> None:
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
    from .exporters.verify_preflight import int4_source
    from .header_readers import open_regular
    from .source import load_tokenizer, no_tokenizer, prompt_ids

    # Everything that needs no weights, before torch is imported: the graph holds int4, its fp32 side, the prompt
    # in the vocabulary, the prompt and --steps within the context, --text.
    model, room = int4_source(target, source)
    start = prompt_ids(model, prompt, ids)[0] if prompt is not None or ids is not None else None
    room.check(len(start) if start else PROMPT_IDS, steps)
    sequence = None
    if text_file is not None:
        tok = load_tokenizer(model)
        if tok is None:
            raise no_tokenizer(model, "score --text")
        try:
            with open_regular(text_file) as f:  # a FIFO or device is refused, never read
                text = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{text_file}: not UTF-8 text (byte {e.start}); --text takes a text file") from None
        sequence = tok.encode(text)[:min(max_tokens, model.cfg.max_position_embeddings)]
        if len(sequence) < 2:
            raise click.BadParameter(f"{text_file} encodes to {len(sequence)} token(s); give some text", param_hint="--text")
    from .exporters.quantize import measure_quant_parity  # numpy, torch and onnxruntime: the work itself
    from .loading import load_model

    reference = load_model(source) if source is not None else None
    rep = measure_quant_parity(target, reference, prompt=start, sequence=sequence, steps=steps)
    t = rep.thresholds
    rows = [("top-1 agreement (teacher-forced)", f"{rep.top1_agreement:.1%}", f">= {t.min_top1:.0%}"),
            ("own greedy tokens equal fp32's", f"{rep.free_run_same}/{rep.steps} steps", ""),
            ("mean KL(fp32 || int4)", f"{rep.mean_kl:.4f} nats", f"<= {t.max_mean_kl} nats"),
            ("max KL", f"{rep.max_kl:.4f} nats", ""),
            ("perplexity fp32 -> int4", f"{rep.ppl_reference:.3f} -> {rep.ppl_int4:.3f} ({rep.ppl_change:+.1%})",
             f"within +/-{t.max_ppl_change:.0%}"),
            ("max |logit error| (scale only)", f"{rep.max_abs_logit_error:.3g}", "no fp32 bound applies")]
    if fmt == "json":
        click.echo(render([], "json", json_payload=rep.to_dict()))
    else:
        click.echo(render([{"measure": a, "value": b, "threshold": c} for a, b, c in rows], "table", numparse=False))
        click.echo("FAITHFUL" if rep.faithful else f"NOT FAITHFUL: {'; '.join(rep.failures)}")
    if not rep.faithful:
        sys.exit(1)


def main() -> None:
    guard_std_streams()  # a closed stdout (`>&-`) is an error when written, not a silent success
    code: Any = 0
    with cleanup_on_signals():  # SIGTERM / SIGINT anywhere: finally blocks run, temp files go
        try:
            cli(prog_name="llama-tools")
        except SystemExit as e:
            code = e.code
    if "torch" in sys.modules and (code is None or isinstance(code, int)):
        # Python's teardown of torch's and onnx's modules takes seconds (2.7-3 s measured after an export) that the
        # user would wait for nothing: the work is done and every file of ours closed. Run the exit hooks
        # (temp dirs, finalizers), flush, and leave; a stream that cannot be flushed takes the normal way out.
        import atexit

        atexit._run_exitfuncs()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            sys.exit(code)
        os._exit(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    main()
