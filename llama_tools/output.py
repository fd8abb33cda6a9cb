"""Rendering rows as a terminal table, JSON, CSV or Markdown; atomic file writes."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

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


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """A temp path beside `path`, renamed onto it only if the block succeeds (nothing half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
