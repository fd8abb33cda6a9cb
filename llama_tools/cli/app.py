"""The `llama-tools` group: every command hangs from it."""

from __future__ import annotations

import click

from .. import __version__
from .params import Group


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


