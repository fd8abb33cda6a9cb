"""Progress of long work as a callback: the library reports (done, total, what), the caller decides how to show it.

`terminal(label)` draws one line on stderr when it is a terminal and stays silent when piped.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

Progress = Callable[[int, int, str], None]  # (steps done, steps in all, what was just done)


def silent(done: int, total: int, what: str) -> None:
    """The default: nothing shown."""


def terminal(label: str, *, quiet: bool = False, stream=None) -> Progress:
    """A one-line bar on a terminal (stderr), erased when the work ends; `silent` when piped or quiet."""
    stream = stream or sys.stderr
    if quiet or not stream.isatty():
        return silent
    start = time.perf_counter()

    def show(done: int, total: int, what: str) -> None:
        width = 24
        filled = width * done // max(total, 1)
        line = f"{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what} ({time.perf_counter() - start:.1f} s)"
        end = "\n" if done >= total else ""
        stream.write("\r\033[K" + line[:160] + end)
        stream.flush()
    return show


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark: VmHWM (reset by exec) where Linux has it.

    ru_maxrss is not used first: it survives exec, so a command started by a large parent (a test runner, a
    notebook) would report the parent's peak as its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def release_freed_memory() -> None:
    """Hand memory that Python has freed back to the system between phases (glibc keeps it otherwise).

    Objects that die leave their pages in malloc's free lists, still resident: a phase that follows (the int4
    quality check after the quantizer) would stack its own peak on them. A no-op where libc has no malloc_trim.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Allocations of at least this many bytes get pages of their own, handed back when freed. glibc's default moves
# its threshold up to 32 MiB after the first large free, so a phase's many-MB temporaries then come from the heap
# and stay resident, fragmented: the default verify of Gemma 3 270M (the row past its window included) peaked at
# 0.63 GB with 4 MiB, its layer-local check alone at 0.69 GB, against 0.78-0.89 GB with glibc's default. 1 MiB
# held 0.60 GB but made the reassociated products (1.25 MB chunks, each faulted in afresh) 1.8x slower.
MMAP_THRESHOLD = 4 << 20


def bound_heap() -> None:
    """Make malloc give large blocks their own pages from here on (mallopt M_MMAP_THRESHOLD); a no-op without it."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
