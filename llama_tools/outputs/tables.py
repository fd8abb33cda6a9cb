"""Rendering rows as a terminal table, JSON, CSV or Markdown (files are written by files.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Sequence

FORMATS = ("table", "json", "csv", "markdown")


def render(rows: Sequence[dict[str, Any]], fmt: str, *, json_payload: Any = None, floatfmt: str = ",.6g",
           numparse: bool = True) -> str:
    """rows -> text; JSON renders `json_payload` when given (a richer object than the flat rows)."""
    if fmt == "json":
        return json.dumps(rows if json_payload is None else json_payload, indent=2, default=_jsonable)
    if fmt == "csv":
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue().rstrip("\n")
    from tabulate import tabulate

    if fmt == "markdown":
        return tabulate(rows, headers="keys", tablefmt="github", floatfmt=floatfmt, intfmt=",",
                        disable_numparse=not numparse)
    if fmt == "table":
        return tabulate(rows, headers="keys", tablefmt="simple", floatfmt=floatfmt, intfmt=",",
                        disable_numparse=not numparse)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _jsonable(o: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
