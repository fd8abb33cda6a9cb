"""The `llama-tools` command line, the layer above everything: parse, resolve MODEL once, call one function, print.

Imports stay inside the commands: `count-params` from a preset never loads torch or pandas. One module per
group of commands; each registers itself on the group in app.py when imported here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..outputs.files import cleanup_on_signals
from ..outputs.paths import guard_std_streams
from . import export_cmd, model_cmds, verify_cmds  # noqa: F401  (each registers its commands)
from .app import cli

__all__ = ["cli", "main"]


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
