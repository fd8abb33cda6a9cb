"""The CLI's shared pieces: click types that resolve and refuse in one line, shared options, help figures."""

from __future__ import annotations

import difflib
import errno
import functools
import math
import sys
from typing import Any, Callable

import click

from ..modeling import dtypes
from ..outputs.tables import FORMATS
from ..checkpoints.tokenizer import KINDS as TOKENIZER_KINDS


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
        from ..checkpoints.source import ModelSource, resolve

        if isinstance(value, ModelSource):
            return value
        w = self.weights_required_in_dir  # the commands that run the weights: a partial file is refused here
        return resolve(value, weights_required_in_dir=w, needs_data=w)  # ValueError: one line


class CountArg(ModelArg):
    """MODEL for count-params and report shapes: also a foreign config.json (transformers' module tree) and weight
    files without a config (their headers), where ModelArg would refuse them."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from ..checkpoints.source import resolve_countable

        return resolve_countable(value)  # ValueError: one line


class IdsArg(click.ParamType):
    """'1 450 29871' or '1,450' -> [1, 450, 29871]."""

    name = "IDS"

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        from ..checkpoints.tokenizer import parse_ids

        why = not_utf8(value) if isinstance(value, str) else None
        if why:
            self.fail(f"not UTF-8 ({why}); give ids such as '1 450 29871'", param, ctx)
        try:
            ids = parse_ids(value) if isinstance(value, str) else list(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if not ids:
            self.fail("no token ids given", param, ctx)
        return ids


class Text(click.ParamType):
    """Text from the command line, refused in one line naming the option unless it is UTF-8."""

    name = "TEXT"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if not isinstance(value, str):
            return value
        why = not_utf8(value)
        if why:
            self.fail(f"not UTF-8 ({why}); give the text in UTF-8", param, ctx)
        return value


def not_utf8(text: str) -> str | None:
    """Why TEXT is not UTF-8 text, briefly (None when it is): where the bytes the locale could not decode sat."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        # Python hands bytes that are not UTF-8 in argv over as surrogateescape's U+DC80..U+DCFF: say the byte
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate U+{c:04X}"
        return f"{what} at character {e.start}"


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


def rope_op_option(help_suffix: str = "", fused: bool = False) -> Callable:
    """--rope-op from the registry; fused: the fused graph's ops offered too, and the default left to the graph."""
    from ..exporters.rope_ops import ROPE_OPS, OURS

    ops = [op for op in ROPE_OPS.values() if fused or not op.fused_only]
    lines = "; ".join(f"{op.name}: {op.display}, {op.help}" for op in ops)
    if fused:
        return click.option("--rope-op", type=Choice([op.name for op in ops]), default=None,
                            help=lines + f" [default: {OURS.name} in the plain graph; in the fused graph, attention "
                                         f"where the head size is a multiple of 16, else {OURS.name}]" + help_suffix)
    return click.option("--rope-op", type=Choice([op.name for op in ops]), default=OURS.name, show_default=True,
                        help=lines + help_suffix)



class MaxKl(click.ParamType):
    """--max-kl: NATS, Fx, auto or none, checked by quant_options.parse_max_kl; kept as text ("none" must survive)."""

    name = "NATS|Fx|auto|none"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        from ..exporters.quant_options import parse_max_kl

        try:
            parse_max_kl(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return str(value).strip().lower()
