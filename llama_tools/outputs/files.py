"""Every file llama-tools writes goes through here: atomic, with the umask's modes, never replacing a device,
nothing of ours left behind after a failure, a SIGTERM/SIGINT, or (on the next run) a SIGKILL.

    dest = check_output_path("out/model.onnx")      # cheap, before any expensive work: one-line ValueError
    write_text(dest, text)                          # one file: temp beside it, fsync, rename
    with atomic_file(dest) as tmp: save(tmp)        # ... when a library wants a path to write
    with atomic_files([data, onnx]) as d: save(d)   # several files beside each other appear together
    with atomic_dir(dst) as d: save(d)              # a whole directory appears at once

    out/                                             temp names are ours and name their destination:
      .llama-tools-tmp.model.onnx.<pid>.<ns>.<hex>   a later write to model.onnx removes the ones whose
      model.onnx                                     <pid> no longer runs in our PID namespace <ns> (a
                                                     SIGKILLed run), and says so; another namespace's or
                                                     host's (a container on a shared volume) is kept, said

Before any work a command names what it writes and what it reads (paths.check_writes): an output that is, or lies
inside, one of its inputs is refused in one line naming both. A destination that names a stream (`-`,
/dev/stdout, /dev/fd/N, a process substitution) is written through its file descriptor; a character device or
a FIFO (`-o /dev/null`) is written through, never replaced; a symlink is never replaced: its target is
written; a socket, block device or directory is refused in one line. Temp names fit NAME_MAX for any legal
destination name. A full disk is one line naming the file and the bytes (checked up front where the size is
known: check_space). New files get 0666 & ~umask and new directories 0777 & ~umask (not mkstemp's 0600 /
0700); replacing a regular file keeps its permission bits. While a write is under way, SIGTERM and SIGINT
remove what it made and exit 128 + the signal's number. No click, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from .paths import (
    beside_stream, check_output_path, existing_parent, file_chunks, lexists, namespace_tag, resolve_output,
    stream_fd, temp_path, temp_stem, write_fd, writes_through)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)
Report = Callable[[str], None]  # where notes such as "removed stale temp ..." go


def _stderr(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


# --- stale temp paths of killed runs --------------------------------------------------------------------------

def _pid_running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours would be in _LIVE; this one is from an earlier process that had our pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def remove_stale(dest: str | Path, report: Report | None = _stderr) -> list[Path]:
    """Remove temp paths for `dest` that earlier runs left, where provably dead; report each one.

    Dead means: made in our PID namespace on this boot (the name's tag is ours) by a pid that no longer runs.
    A temp of another namespace or host (a container on a shared volume) cannot be judged from here: it is
    kept, and said once, since its writer may still be running.
    """
    dest = Path(dest)
    pattern = re.compile(re.escape(temp_stem(dest.name)) + r"\.(\d+)\.([0-9a-f]{8})\.[0-9a-f]{8}")
    try:
        entries = list(os.scandir(dest.parent))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    removed = []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        path = Path(entry.path)
        if not m or path in _LIVE:
            continue
        if m.group(2) != namespace_tag():
            if report is not None:
                report(f"kept {path}: made by process {m.group(1)} in another PID namespace or on another host "
                       f"(a container sharing this directory?), which may still be writing it; remove it "
                       f"yourself once no llama-tools run writes {dest}")
            continue
        if _pid_running(int(m.group(1))):
            continue
        try:
            size = _size(path)
            shutil.rmtree(path) if entry.is_dir(follow_symlinks=False) else path.unlink()
        except FileNotFoundError:
            continue  # another run cleaned it first
        removed.append(path)
        if report is not None:
            report(f"removed {path} ({size:,} bytes), left by process {m.group(1)} which was killed "
                   f"while writing {dest}")
    return removed


# --- cleanup on SIGTERM / SIGINT ------------------------------------------------------------------------------

class SignalExit(SystemExit):
    """Raised by the handler: finally-blocks run, and the process exits 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class _Write:
    """Paths one write made (temp file or dir, parents it created), removed on failure or a signal."""

    def __init__(self) -> None:
        self.registered: list[Path] = []  # every temp path, to forget them in _LIVE at the end
        self.temps: list[Path] = []  # those not yet renamed onto their destination
        self.made_dirs: list[Path] = []  # outermost first

    def cleanup(self) -> None:
        for p in self.temps:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for d in reversed(self.made_dirs):
            with contextlib.suppress(OSError):  # not empty (someone else wrote there): keep it
                d.rmdir()
        self.temps, self.made_dirs = [], []


_LIVE: dict[Path, _Write] = {}  # temp path -> its write, for every write under way in this process
_state = {"depth": 0, "defer": 0}
_saved: dict[int, object] = {}
_pending: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    if _state["defer"]:
        _pending.append(signum)  # a rename is under way: finish it, then exit
        return
    _exit_on(signum)


def _exit_on(signum: int) -> None:
    writes = list(dict.fromkeys(_LIVE.values()))
    for w in writes:
        w.cleanup()
    _LIVE.clear()
    removed = ": removed the partial output" if writes else ""
    print(f"\ninterrupted by {signal.Signals(signum).name}{removed}", file=sys.stderr)
    raise SignalExit(signum)


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """For the block: SIGTERM / SIGINT remove every write under way and exit 128 + sig (nests; main thread only).

    Every atomic write enters it; wrapping a whole command in it also makes a SIGTERM run the command's
    finally-blocks (TemporaryDirectory and the like) instead of killing the process outright.
    A signal the process ignores (SIG_IGN, as for a shell's background job) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread; the main thread's own guard still cleans
        return
    if _state["depth"] == 0:
        for sig in _SIGNALS:
            prev = signal.getsignal(sig)
            if prev is not signal.SIG_IGN:
                _saved[sig] = signal.signal(sig, _on_signal)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            for sig, prev in _saved.items():
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            _saved.clear()


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Defer SIGTERM / SIGINT across the renames, so the destination is either old or complete."""
    _state["defer"] += 1
    try:
        yield
    finally:
        _state["defer"] -= 1
        if not _state["defer"] and _pending:
            signum = _pending[0]
            _pending.clear()
            _exit_on(signum)


# --- the writers ----------------------------------------------------------------------------------------------

def _make_parents(directory: Path, write: _Write) -> None:
    """mkdir -p with the umask's mode, remembering what we created (removed again if the write fails)."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        write.made_dirs.append(d)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for f in path.rglob("*"):
            if f.is_file() and not f.is_symlink():
                _fsync_path(f)
    else:
        _fsync_path(path)


def _umask_modes(tmp: Path) -> None:
    """What third-party writers created in our temp (safetensors writes 0600) gets the umask's normal mode."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [tmp, *tmp.rglob("*")] if tmp.is_dir() else [tmp]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _keep_mode(tmp: Path, dest: Path) -> None:
    """Replacing a regular file keeps its permission bits (as `>` and editors do)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(dest)
        if stat.S_ISREG(st.st_mode):
            os.chmod(tmp, stat.S_IMODE(st.st_mode))


@contextlib.contextmanager
def _guarded(dests: Sequence[Path], report: Report | None) -> Iterator[_Write]:
    """Signals handled, stale temps of `dests` removed, parents made; everything undone unless the block succeeds."""
    write = _Write()
    with cleanup_on_signals():
        try:
            for dest in dests:
                remove_stale(dest, report)
            _make_parents(dests[0].parent, write)
            yield write
        except BaseException as e:
            written = _temp_bytes(write)
            write.cleanup()
            if isinstance(e, Exception) and _disk_full(e, dests[-1]):
                free = _free(dests[-1])
                raise ValueError(f"{dests[-1]}: no space left on the device: it needs more than the {written:,} "
                                 f"bytes written when the disk filled ({free:,} bytes free); free some space or "
                                 f"choose another output path") from None
            raise
        finally:
            for p in write.registered:
                _LIVE.pop(p, None)


def _through_error(dest: Path, e: OSError) -> Exception:
    """An OSError of writing through a stream, device or FIFO as one line naming it (the library's write names no
    file); one that names its file, as it is. Raise it outside the except block: _guarded then sees no disk of ours
    fill (its __context__), and passes the line on."""
    fd = stream_fd(dest)
    shown = {1: "standard output", 2: "standard error"}.get(fd, str(dest)) if fd is not None else str(dest)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ValueError(f"{shown}: no space left on the device; choose another output path")
    if e.filename is None and e.strerror:
        return ValueError(f"{shown}: {e.strerror}")
    return e


def _temp_bytes(write: _Write) -> int:
    total = 0
    for p in write.temps:
        with contextlib.suppress(OSError):
            total += _size(p)
    return total


def _free(dest: Path) -> int:
    try:
        return shutil.disk_usage(existing_parent(dest)).free
    except OSError:
        return 0


_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def _disk_full(e: BaseException, dest: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT, or a library's wording of it (safetensors says
    "os error 28"; torch.save only "unexpected pos"), then judged by what is free (under 1 MiB: full)."""
    for err in (e, e.__cause__, e.__context__):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if err is not None and any(t in str(err) for t in _FULL_TEXT):
            return True
    # torch.save says only "unexpected pos": judged by what is left (a ValueError is a message of its own)
    return not isinstance(e, ValueError) and _free(dest) < (1 << 20)


def _new_temp(dest: Path, write: _Write, *, directory: bool) -> Path:
    tmp = temp_path(dest)
    _LIVE[tmp] = write
    write.registered.append(tmp)
    write.temps.append(tmp)
    if directory:
        tmp.mkdir(0o777)  # the umask applies
    else:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
    return tmp


def _copy_into(src: Path, dest: Path) -> None:
    """Write `src`'s bytes through `dest` (a stream, device or FIFO): no rename."""
    fd = stream_fd(dest)
    if fd is not None:
        write_fd(fd, file_chunks(src))
        return
    with open(src, "rb") as f, open(dest, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, report: Report | None = _stderr, fsync: bool = True) -> Iterator[Path]:
    """A path to write `path` through: a temp beside it renamed onto it if the block succeeds.

    For a character device or FIFO the path itself is yielded (written through, never replaced); for a
    stream (`-`, /dev/stdout, /dev/fd/N) a temp of ours in the temp directory, whose bytes then go through it.
    A symlink's target is written, never the link replaced.
    """
    dest = check_output_path(resolve_output(path))
    fd = stream_fd(dest)
    failed: Exception | None = None
    if fd is not None:
        with temp_dir("stream", report=report) as d:
            yield d / "out"
            try:
                write_fd(fd, file_chunks(d / "out"))
            except OSError as e:  # the stream refused, not the temp dir's disk: named after the with
                failed = _through_error(dest, e)
        if failed is not None:
            raise failed
        return
    if writes_through(dest):
        try:
            yield dest  # nothing of ours to clean up: what went through is gone
        except OSError as e:  # the library's write names no file: the device's refusal, named here
            failed = _through_error(dest, e)
        if failed is not None:
            raise failed
        return
    with _guarded([dest], report) as write:
        tmp = _new_temp(dest, write, directory=False)
        yield tmp
        if fsync:
            _fsync_path(tmp)
        _keep_mode(tmp, dest)
        with _no_interrupt():
            os.replace(tmp, dest)
            write.temps.remove(tmp)
        if fsync:
            _fsync_path(dest.parent)


@contextlib.contextmanager
def atomic_files(paths: Sequence[str | Path], *, report: Report | None = _stderr,
                 fsync: bool = True) -> Iterator[Path]:
    """A temp dir in which to write files named like `paths` (one directory); they replace `paths` together.

    Renamed in the order given (put a data file before the file that refers to it); a name the block did
    not write is left alone; a device or FIFO gets the bytes written through it. The temp dir is named
    after the last path, and stale temps of every path are removed.
    """
    dests = [check_output_path(resolve_output(p)) for p in paths]
    if not dests:
        raise ValueError("atomic_files: no paths given")
    if len({d.parent for d in dests}) != 1 or len({d.name for d in dests}) != len(dests):
        raise ValueError(f"atomic_files: {', '.join(map(str, dests))} must be distinct names in one directory")
    # Beside a stream (/dev/fd/63) there is no directory of ours: the temp dir goes to the system's.
    staged = temp_dir("stream", report=report) if beside_stream(dests[-1]) else None
    with staged if staged is not None else contextlib.nullcontext(None) as where, \
            _guarded([where] if where is not None else dests, report) as write:
        tmp = _new_temp(where if where is not None else dests[-1], write, directory=True)  # after the main file
        yield tmp
        done = [(tmp / d.name, d) for d in dests if lexists(tmp / d.name)]
        for src, _ in done:
            _umask_modes(src)
        if fsync:
            for src, dest in done:
                if not writes_through(dest):
                    _fsync_path(src)
        for src, dest in done:
            _keep_mode(src, dest)
        failed: Exception | None = None
        for src, dest in done:  # outside _no_interrupt: a slow reader must not hold off a SIGTERM
            if writes_through(dest):
                try:
                    _copy_into(src, dest)
                except OSError as e:  # the device refused (/dev/full), not the disk of our temp: named below
                    failed = _through_error(dest, e)
                    break
        if failed is not None:
            raise failed
        with _no_interrupt():
            for src, dest in done:
                if not writes_through(dest):
                    os.replace(src, dest)
        shutil.rmtree(tmp, ignore_errors=True)
        write.temps.remove(tmp)
        if fsync and where is None:
            _fsync_path(dests[0].parent)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, report: Report | None = _stderr, fsync: bool = True) -> Iterator[Path]:
    """A temp dir beside `path` (missing or an empty directory), renamed onto it if the block succeeds."""
    dest = check_output_path(resolve_output(path), directory=True)
    with _guarded([dest], report) as write:
        tmp = _new_temp(dest, write, directory=True)
        yield tmp
        _umask_modes(tmp)
        if fsync:
            _fsync_tree(tmp)
        with _no_interrupt():
            if dest.is_dir():
                dest.rmdir()  # empty, checked above; if someone filled it meanwhile, rmdir fails and we stop
            os.replace(tmp, dest)
            write.temps.remove(tmp)
        if fsync:
            _fsync_path(dest.parent)


@contextlib.contextmanager
def scratch_dir(beside: str | Path, *, report: Report | None = _stderr) -> Iterator[Path]:
    """A temp dir of ours beside `beside` for intermediate files, removed when the block ends (or on a signal);
    parents it had to make are removed again if the block fails. Stale ones of killed runs go as usual."""
    dest = check_output_path(beside)
    with _guarded([dest], report) as write:
        tmp = _new_temp(dest, write, directory=True)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if tmp in write.temps:  # a signal's cleanup may have removed it (and emptied the list) already
                write.temps.remove(tmp)


def temp_dir(purpose: str, *, report: Report | None = _stderr) -> contextlib.AbstractContextManager[Path]:
    """scratch_dir in the system's temp directory ($TMPDIR, /tmp): .llama-tools-tmp.llama-tools-<purpose>.<pid>...

    Removed at the end and on SIGTERM/SIGINT; after a SIGKILL the next run of the same purpose removes it
    (and says so) when its process is provably dead, as for every temp of ours.
    """
    import tempfile

    return scratch_dir(Path(tempfile.gettempdir()) / f"llama-tools-{purpose}", report=report)


def move_onto(src: str | Path, dest: str | Path, *, fsync: bool = True) -> Path:
    """Rename a finished file of ours (in a scratch dir beside `dest`) onto `dest`, as atomic_file would."""
    src, dest = Path(src), check_output_path(resolve_output(dest))
    _umask_modes(src)
    if fsync:
        _fsync_path(src)
    _keep_mode(src, dest)
    with _no_interrupt():
        os.replace(src, dest)
    if fsync:
        _fsync_path(dest.parent)
    return dest


def write_chunks(path: str | Path, chunks: Iterable[bytes | str], *, report: Report | None = _stderr,
                 fsync: bool = True) -> Path:
    """Write an iterable of bytes (or UTF-8 text) to `path` atomically, one chunk in memory at a time."""
    path = Path(path)
    sent = [0]

    def as_bytes() -> Iterator[bytes]:
        for chunk in chunks:
            b = chunk.encode("utf-8") if isinstance(chunk, str) else chunk
            yield b
            sent[0] += len(b)

    fd = stream_fd(path)
    failed: Exception | None = None
    try:
        if fd is not None:  # a stream: straight through its descriptor, nothing to stage
            check_output_path(path)
            write_fd(fd, as_bytes())
            return path
        with atomic_file(path, report=report, fsync=fsync) as tmp, open(tmp, "wb") as f:
            for chunk in as_bytes():
                f.write(chunk)
    except OSError as e:  # written through a device, FIFO or stream (a temp of ours is handled in _guarded)
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and sent[0]:
            raise ValueError(f"{path}: no space left on the device: it needs more than the {sent[0]:,} bytes "
                             f"written when it filled") from None
        failed = _through_error(path, e)
    if failed is not None:
        raise failed
    return path


def write_text(path: str | Path, text: str, *, report: Report | None = _stderr, fsync: bool = True) -> Path:
    """Write `text` (UTF-8, newline-terminated) to `path` atomically."""
    return write_chunks(path, [text if text.endswith("\n") else text + "\n"], report=report, fsync=fsync)


def write_bytes(path: str | Path, data: bytes, *, report: Report | None = _stderr, fsync: bool = True) -> Path:
    """Write `data` to `path` atomically."""
    return write_chunks(path, [data], report=report, fsync=fsync)
