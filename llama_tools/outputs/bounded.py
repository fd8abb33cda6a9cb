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
import threading
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


# --- A worker: a forked child that keeps what it built and serves calls on it, each bounded -------------------------

class Raised(Exceeded):
    """What the worker ran raised (the child lives on): its type's name and its message's first line."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


_HEADER = 8  # each message: its length (8 bytes, big-endian), then that much JSON
_PARENT_FDS: set[int] = set()  # every live worker's pipe ends in this process: a later child closes them (EOF works)


def _write_message(fd: int, value: Any) -> None:
    data = json.dumps(value).encode()
    view = memoryview(len(data).to_bytes(_HEADER, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes | None:
    """N bytes from FD, None at EOF; Exceeded past DEADLINE (monotonic; None: wait for ever)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                if time.monotonic() >= deadline:
                    raise Exceeded("ran past")
                continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _silence_and_limit(memory_bytes: int, keep: tuple[int, ...]) -> None:
    """In a fresh child: stdout and stderr to /dev/null (a library's panic text or warning never reaches the
    terminal), other workers' pipes closed, SIGINT left to the parent, killed with it, its address space bounded."""
    import resource

    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    for fd in _PARENT_FDS - set(keep):
        try:
            os.close(fd)
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # Linux: the worker dies with its parent even mid-call (a SIGKILL'd parent closes no pipe first)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001  (elsewhere the pipe's EOF ends it, after the call in hand)
        pass
    vm = _vm_bytes()
    if vm:
        resource.setrlimit(resource.RLIMIT_AS, (vm + memory_bytes, vm + memory_bytes))


def _answer(fn: Callable[[], Any], memory_bytes: int) -> list[Any]:
    """[True, fn()] or [False, kind, message]: kind "" for memory, else the type of what fn raised."""
    try:
        return [True, fn()]
    except MemoryError:
        return [False, "", f"ran out of its {memory_bytes / 2**20:,.0f} MiB"]
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001  (a library's own types, a Rust panic (pyo3's PanicException) included)
        return [False, type(e).__name__, (str(e).strip().splitlines() or [""])[0][:2000]]


class Worker:
    """A forked child that runs `setup()` once and then serves `call(op, arg)` on what it built, each bounded in time.

    What a checkpoint's file makes a library do (a vocabulary of 10^7 entries, a regex that backtracks for minutes, a
    Rust panic) happens there: the child's address space is bounded for its life (what the parent maps when it starts
    plus memory_bytes), a call past its seconds kills it, its stdout and stderr go to /dev/null. setup() returns
    (serve, hello): serve(op, arg) answers each call, hello (JSON) is what start() returns. A child that was killed
    or died is started again by the next call (setup() once more). Answers are JSON, each at most answer_bytes.
    """

    def __init__(self, setup: Callable[[], tuple[Callable[[str, Any], Any], Any]], *, memory_bytes: int,
                 answer_bytes: int, setup_seconds: float):
        self.setup, self.memory_bytes, self.answer_bytes = setup, memory_bytes, answer_bytes
        self.setup_seconds = setup_seconds
        self.pid: int | None = None
        self._fds: tuple[int, int] = (-1, -1)  # (the answers' read end, the requests' write end)
        self._finalizer: Any = None
        self._lock = threading.RLock()

    def start(self) -> Any:
        """Fork the child and run setup() there: its hello, else Exceeded (time, memory, death) or Raised."""
        import ctypes  # noqa: F401  (imported here, not in the child)
        import resource  # noqa: F401
        import weakref

        self.close()
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's stack
            code = 0
            try:
                os.close(req_w)
                os.close(ans_r)
                _silence_and_limit(self.memory_bytes, (req_r, ans_w))
                serve: Any = None

                def setup() -> Any:
                    nonlocal serve
                    serve, hello = self.setup()
                    return hello

                answer = _answer(setup, self.memory_bytes)
                _write_message(ans_w, answer)
                while answer[0]:
                    head = _read_exactly(req_r, _HEADER, None)
                    if head is None:
                        break
                    body = _read_exactly(req_r, int.from_bytes(head, "big"), None)
                    if body is None:
                        break
                    op, arg = json.loads(body)
                    _write_message(ans_w, _answer(lambda: serve(op, arg), self.memory_bytes))
            except BaseException:  # noqa: BLE001  (nothing may escape into a copy of the caller)
                code = 1
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(ans_w)
        self.pid, self._fds = pid, (ans_r, req_w)
        _PARENT_FDS.update(self._fds)
        self._finalizer = weakref.finalize(self, _stop, pid, self._fds)
        return self._receive(self.setup_seconds)

    def call(self, op: str, arg: Any, *, seconds: float) -> Any:
        """serve(op, arg) in the child: its answer, else Exceeded (past SECONDS, memory, death) or Raised."""
        with self._lock:  # one request and its answer at a time on the pipes
            if self.pid is None:
                self.start()
            try:
                _write_message(self._fds[1], [op, arg])
            except OSError:  # the child is gone (BrokenPipeError)
                self.close()
                raise Exceeded(f"died (memory past {self.memory_bytes / 2**20:,.0f} MiB, or a signal)") from None
            return self._receive(seconds)

    def _receive(self, seconds: float) -> Any:
        deadline = time.monotonic() + seconds
        try:
            head = _read_exactly(self._fds[0], _HEADER, deadline)
            size = int.from_bytes(head, "big") if head is not None else 0
            if size > self.answer_bytes + 4096:
                raise Exceeded(f"its answer is over {self.answer_bytes:,} bytes")
            body = _read_exactly(self._fds[0], size, deadline) if head is not None else None
        except Exceeded as e:
            self.close()
            raise Exceeded(f"ran past {seconds:.3g} s") if str(e) == "ran past" else e from None
        if body is None:
            self.close()
            raise Exceeded(f"died (memory past {self.memory_bytes / 2**20:,.0f} MiB, or a signal)")
        answer = json.loads(body)
        if answer[0]:
            return answer[1]
        if not answer[1]:
            raise Exceeded(answer[2])
        raise Raised(answer[1], answer[2])

    def close(self) -> None:
        """Stop the child (if any) and close its pipes; the next call starts it again."""
        if self._finalizer is not None:
            self._finalizer()
        self.pid, self._fds, self._finalizer = None, (-1, -1), None


def _stop(pid: int, fds: tuple[int, int]) -> None:
    """Kill and reap a worker, close its pipes (weakref.finalize: never holds the Worker itself)."""
    for fd in fds:
        _PARENT_FDS.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
