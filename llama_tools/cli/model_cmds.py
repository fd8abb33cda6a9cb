"""The commands on a model and its files: count-params, presets, report, convert, tokenize, generate."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from ..modeling import dtypes
from ..outputs.paths import check_output_path, check_writes, stream_fd
from ..checkpoints.formats import BENIGN_SUFFIXES, WRITABLE
from ..checkpoints.formats import FORMATS as CHECKPOINT_FORMATS
from ..outputs.tables import render
from ..modeling.presets import PAPER_MODELS
from ..outputs.progress import terminal

from .app import cli
from .params import (
    Choice, CountArg, DTYPE_CHOICE, Finite, Group, IdsArg, ModelArg, SEED, TOKENIZER_FILES, Text, output_options,
    quoting)


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
    from ..counting.accounting import ParamCount, layer_rows, long_rows, summary_rows
    from ..counting.header_count import HeaderCount, header_long_rows, header_rows
    from ..checkpoints.source import resolve_countable
    from ..counting.transformers_count import ModuleTreeCount, tree_layer_rows, tree_long_rows, tree_summary_rows

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
    from ..counting.accounting import count_params
    from ..modeling.presets import PRESET_SOURCES, PRESETS, aliases_of, preset_tokenizer

    rows = [{"name": name, "params": count_params(c).total, "layers": c.num_hidden_layers, "width": c.hidden_size,
             "heads q/kv": f"{c.num_attention_heads}/{c.num_key_value_heads}", "vocab": c.vocab_size,
             "tokenizer": "yes" if preset_tokenizer(name) else "", "source": PRESET_SOURCES.get(name, ""),
             "aliases": ", ".join(aliases_of(name))}
            for name, c in PRESETS.items()]
    click.echo(render(rows, fmt))


def _count(target: Any, context: int | None, batch: int) -> Any:
    """One MODEL's count: native (accounting), from transformers' module tree, or from weight files' headers."""
    from ..counting.accounting import count_source
    from ..counting.header_count import count_headers
    from ..checkpoints.header_readers import PartialFile
    from ..checkpoints.source import ForeignConfig, HeaderFiles

    if isinstance(target, HeaderFiles):
        return count_headers(target)
    if isinstance(target, ForeignConfig):
        from ..counting.transformers_count import count_module_tree  # imports transformers: only for such a config

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
    from ..reports.shapes import infer_format, module_tree_report, render_report, shape_report, write_report
    from ..checkpoints.source import ForeignConfig, HeaderFiles

    if isinstance(model, HeaderFiles):
        raise ValueError(f"{model.spec}: report shapes reads a config, and these weight files have none it models "
                         f"({model.reason}); count their tensors with `llama-tools count-params {model.spec}`")
    fmt = infer_format(output, fmt)
    if output is not None:
        check_output_path(output)
        check_writes([output], model.files)  # never over the config (or anything else) the report reads
    if isinstance(model, ForeignConfig):
        from ..counting.transformers_count import module_tree  # imports transformers: only for such a config

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
    from ..reports.regenerate import regenerate

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
    from ..checkpoints.convert import convert as run_convert

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
@click.argument("text", required=False, type=Text())
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
    from ..checkpoints.source import load_tokenizer, no_tokenizer

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
@click.option("--prompt", type=Text(), default=None, metavar="TEXT",
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
    from ..inference.sampling import check_sampling
    from ..checkpoints.source import prompt_ids

    token_ids, tok = prompt_ids(model, prompt, ids)
    check_sampling(model.cfg, token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   repetition_penalty=repetition_penalty, top_k=top_k, top_p=top_p, dtype=dtype)
    from ..inference.generation import generate as run_generate  # torch, only once every cheap check has passed
    from ..checkpoints.loading import load_model

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

