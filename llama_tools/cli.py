"""The `llama-tools` command line: parse, call one library function, print.

Imports stay inside the commands: `count-params` from a preset never loads torch or pandas.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import click

from . import __version__
from .output import FORMATS, render


class Group(click.Group):
    """Bad input becomes one line on stderr and exit 1, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError, KeyError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise click.ClickException(str(msg)) from None


def output_options(formats: tuple[str, ...] = FORMATS) -> Callable:
    """The shared --format option: a human table by default, machine-readable on request."""
    def decorator(f: Callable) -> Callable:
        @click.option("--format", "fmt", type=click.Choice(formats), default=formats[0], show_default=True,
                      help="Output format.")
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)
        return wrapper
    return decorator


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llama-tools")
def cli() -> None:
    """Understand, count, export and verify LLaMA-family models."""


# ==== count-params ====================================================================================
# (wired by the accounting work)

# ==== report ==========================================================================================
# (wired by the reports work)

# ==== checkpoints: convert, generate ===================================================================
# (wired by the checkpoint work)

# ==== export / verify ==================================================================================
# (wired by the ONNX work)


def main() -> None:
    cli(prog_name="llama-tools")


if __name__ == "__main__":
    main()
