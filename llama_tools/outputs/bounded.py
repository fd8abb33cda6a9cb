"""A function run where a checkpoint's text cannot take the process with it: a forked child, bounded in time and memory.

What a checkpoint's text makes us evaluate (a chat template's loops, powers and string doubling) can run for hours
in one C call that no Python alarm interrupts, or grow past any memory. The child gets its own address-space limit
(what the parent maps now plus `memory_bytes`) and is killed at `seconds`; its answer comes back through a pipe,
itself bounded. A POSIX fork: where there is none, the function runs in-process, unbounded.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any


class Exceeded(Exception):
    """The child ran past its time or memory, or died; the message says which, in a few words."""


def _vm_bytes() -> int:
    """The address space this process maps now (VmSize), 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bounded_call(fn: Callable[[], Any], *, seconds: float, memory_bytes: int, answer_bytes: int) -> Any:
    """fn() in a forked child: its value (JSON, at most answer_bytes encoded), else Exceeded saying why (its time, its
    memory, its answer's size, or the exception it raised, as `Type: message`)."""
    if not hasattr(os, "fork"):
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: bounded, answers once, never returns into the caller's stack
        code = 0
        try:
            os.close(read_end)
            import resource

            vm = _vm_bytes()
            if vm:
                resource.setrlimit(resource.RLIMIT_AS, (vm + memory_bytes, vm + memory_bytes))
            try:
                payload = json.dumps([True, fn()]).encode()
            except MemoryError:
                payload = json.dumps([False, f"ran out of its {memory_bytes / 2**20:,.0f} MiB"]).encode()
            except Exception as e:  # noqa: BLE001  (the parent decides what it means)
                message = (str(e).splitlines() or [""])[0][:2000]  # one line, whole (ours name a file and a fix)
                payload = json.dumps([False, f"{type(e).__name__}: {message}"]).encode()
            if len(payload) > answer_bytes:
                payload = json.dumps([False, f"its answer is over {answer_bytes:,} bytes"]).encode()
            view = memoryview(payload)
            while view:
                view = view[os.write(write_end, view):]
        except BaseException:  # noqa: BLE001  (nothing may escape into a copy of the caller)
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + seconds
    chunks, size = [], 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Exceeded(f"ran past {seconds:g} s")
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > answer_bytes + 4096:
                raise Exceeded(f"its answer is over {answer_bytes:,} bytes")
            chunks.append(chunk)
    finally:
        os.close(read_end)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    if not chunks:
        raise Exceeded(f"died (memory past {memory_bytes / 2**20:,.0f} MiB, or a signal)")
    ok, value = json.loads(b"".join(chunks))
    if not ok:
        raise Exceeded(value)
    return value
