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

Before any work a command names what it writes and what it reads (check_writes): an output that is, or lies
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
import functools
import hashlib
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

TEMP_PREFIX = ".llama-tools-tmp."
_FORBIDDEN_ROOTS = ("/proc", "/sys")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NAME_MAX = 255  # bytes of one path component on Linux's filesystems (ext4, xfs, btrfs, tmpfs, NFS)
# What a temp name adds after its stem: ".<pid>.<ns>.<hex>", with room for the largest pid (pid_max <= 2^22).
_TEMP_TAIL = len(".4194304.") + 8 + 1 + 8
# Streams by name: what /dev/stdout and a process substitution (/dev/fd/63) are; "-" is standard output.
_STREAM = re.compile(r"/dev/(?:fd/(\d+)|(stdin|stdout|stderr))|/proc/(?:self|thread-self|(\d+))/fd/(\d+)")
_STD_FDS = {"stdin": 0, "stdout": 1, "stderr": 2}

Report = Callable[[str], None]  # where notes such as "removed stale temp ..." go


def _stderr(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


# --- names and checks -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def namespace_tag() -> str:
    """8 hex naming this kernel boot and PID namespace: a pid means the same process only where the tag matches.

    Containers on one host share the boot id but not the PID namespace; other hosts differ in the boot id.
    """
    parts = []
    for path, how in (("/proc/sys/kernel/random/boot_id", "read"), ("/proc/self/ns/pid", "inode")):
        try:
            parts.append(Path(path).read_text().strip() if how == "read" else str(os.stat(path).st_ino))
        except OSError:
            parts.append(os.uname().nodename)  # no /proc: the host name is the best we have
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:8]


def _temp_stem(name: str) -> str:
    """TEMP_PREFIX + `name`, shortened (a prefix of it and a hash of the whole) so a temp name fits NAME_MAX."""
    stem = TEMP_PREFIX + name
    if len(stem.encode()) + _TEMP_TAIL <= NAME_MAX:
        return stem
    digest = "~" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    room = NAME_MAX - _TEMP_TAIL - len(TEMP_PREFIX.encode()) - len(digest)
    cut = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")  # whole characters only
    return TEMP_PREFIX + cut + digest


def temp_path(dest: str | Path) -> Path:
    """A fresh temp path beside `dest`: .llama-tools-tmp.<dest name>.<pid>.<namespace tag>.<8 hex>."""
    dest = Path(dest)
    return dest.parent / f"{_temp_stem(dest.name)}.{os.getpid()}.{namespace_tag()}.{secrets.token_hex(4)}"


def stream_fd(path: str | Path) -> int | None:
    """The file descriptor a path names as a stream (`-`, /dev/stdout, /dev/fd/N, /proc/self/fd/N), else None.

    Followed through symlinks (a link to /dev/stdout is a stream too). Such a path is written through the
    descriptor: opening it again would truncate a `>>` file, and replacing it would replace /dev/stdout itself.
    """
    text = str(path)
    if text == "-":
        return 1
    p = os.path.abspath(text)
    for _ in range(40):  # the kernel's own limit on symlinks in one lookup
        m = _STREAM.fullmatch(p)
        if m:
            fd_dev, std, pid, fd_proc = m.groups()
            if pid is not None and int(pid) != os.getpid():
                return None  # another process's descriptors: under /proc, refused by check_output_path
            return int(fd_dev) if fd_dev else _STD_FDS[std] if std else int(fd_proc)
        if not os.path.islink(p):
            return None
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def resolve_output(path: str | Path) -> Path:
    """Where writing `path` lands: a symlink's final target (a link is never replaced by a file); a stream as is."""
    path = Path(path)
    if stream_fd(path) is not None or not os.path.islink(path):
        return path
    return Path(os.path.realpath(path))


def _beside_stream(path: Path) -> bool:
    """A path in /dev/fd (or /proc/self/fd): a stream, or a name beside one that can never be created."""
    return re.fullmatch(r"/proc/(?:self|thread-self|\d+)/fd", os.path.realpath(Path(path).parent)) is not None


def _lexists(path: Path) -> bool:
    """os.path.lexists, and False for a name too long to exist (Path.exists raises ENAMETOOLONG)."""
    return os.path.lexists(path)


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_writes(writes: Iterable[str | Path], reads: Iterable[str | Path]) -> None:
    """ValueError in one line, naming both, if a path this run writes is, or lies inside, a path it reads.

    Called before any work by every writing command with all it would write (the output, a .data beside it)
    and all it reads (ModelSource.files): symlinks are followed and hard links compared by inode.
    """
    reads = [(str(r), os.path.realpath(r)) for r in reads]
    for w in writes:
        if stream_fd(w) is not None:
            continue  # a stream is written through, nothing is replaced
        real = os.path.realpath(w)
        for shown, r in reads:
            if real == r or _same(real, r):
                raise ValueError(f"{w}: is {shown}, which this run reads; writing it would destroy the input. "
                                 "Choose another output path")
            if real.startswith(r.rstrip("/") + "/"):
                raise ValueError(f"{w}: lies inside {shown}, which this run reads; choose another output path")


def _existing_parent(path: Path) -> Path:
    p = Path(os.path.abspath(path)).parent
    while not p.exists():
        p = p.parent
    return p


def check_space(path: str | Path, need: int) -> None:
    """ValueError naming `path` and the bytes when the filesystem it would go to has fewer than `need` free."""
    if stream_fd(path) is not None or need <= 0:
        return
    free = shutil.disk_usage(_existing_parent(Path(path))).free
    if free < need:
        raise ValueError(f"{path}: needs {need:,} bytes, but only {free:,} are free there; free some space or "
                         "choose another output path")


def _kind(mode: int) -> str | None:
    """What a non-regular, non-directory file is, in words (None for a regular file or directory)."""
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "special file"


def written_through(dest: str | Path) -> bool:
    """Whether writing `dest` goes through it (a stream, character device or FIFO) rather than replacing it."""
    return _write_through(Path(dest))


def _write_through(dest: Path) -> bool:
    """True for a destination we write into rather than replace (a stream, a character device or FIFO)."""
    if stream_fd(dest) is not None:
        return True
    try:
        mode = os.stat(dest).st_mode  # follows a symlink: a link to /dev/null is /dev/null
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def check_output_path(path: str | Path, *, directory: bool = False) -> Path:
    """Cheap checks before any work: ValueError naming `path` unless we could write it (nothing is created).

    A file destination may be missing, a regular file, a character device or a FIFO; a directory
    destination (`directory=True`) may be missing or an empty directory. The nearest existing parent
    must be a writable directory, and nothing goes under /proc or /sys.
    """
    path = Path(path)
    fd = stream_fd(path)
    if fd is not None:
        if directory:
            raise ValueError(f"{path}: names a stream, not a directory; choose a new destination")
        what = "standard output" if fd == 1 else "standard error" if fd == 2 else f"file descriptor {fd}"
        try:
            os.fstat(fd)
        except OSError:
            raise ValueError(f"{path}: {what} is closed; nothing could be written there") from None
        if fd in (1, 2) and isinstance(_std_stream(fd), ClosedStream):
            raise ValueError(f"{path}: {what} is closed; nothing could be written there")
        return path
    if str(path) == "" or path.name in ("", ".", ".."):
        raise ValueError(f"{str(path)!r}: not a file name; give a path such as out/model.onnx")
    if _beside_stream(path) and not directory:
        return path  # OUT.data beside /dev/fd/63: never written (a stream has no .data), so nothing to check
    real = os.path.realpath(path)
    for root in _FORBIDDEN_ROOTS:
        if real == root or real.startswith(root + "/"):
            raise ValueError(f"{path}: is under {root}, the kernel's interface, not a place for files; "
                             "choose another output path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise ValueError(f"{path}: a parent of this path is a file, not a directory") from None
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise ValueError(f"{path}: cannot be checked ({e.strerror})") from None
        st = None  # cannot exist, so there is nothing to replace; check_name says whether it could be written
    if st is not None:
        kind = _kind(st.st_mode)
        if directory:
            if kind or stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path}: is a {kind or 'file'}, not a directory; choose a new destination")
            if any(os.scandir(path)):
                raise ValueError(f"{path}: already exists and is not an empty directory; choose a new destination")
        elif stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{path}: is a directory; give a file path inside it, such as {path / 'out'}")
        elif kind and kind not in ("character device", "FIFO"):
            raise ValueError(f"{path}: is a {kind}; refusing to write to it")
        elif kind:  # written through, so it must be writable itself
            if not os.access(path, os.W_OK):
                raise ValueError(f"{path}: {kind} is not writable")
            return path
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():
            raise ValueError(f"{path}: parent {parent} is a dangling symlink")
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: directory {parent} is not writable")
    return path


def check_name(path: str | Path) -> Path:
    """check_output_path, and a ValueError unless every component of `path` fits NAME_MAX (a stream always does)."""
    path = check_output_path(path)
    if stream_fd(path) is None:
        for part in Path(os.path.abspath(path)).parts:
            n = len(part.encode("utf-8", "surrogateescape"))
            if n > NAME_MAX:
                raise ValueError(f"{path}: a name of {n} bytes; the filesystem allows at most {NAME_MAX}")
    return path


# --- streams ------------------------------------------------------------------------------------------------

class ClosedStream:
    """Stands for sys.stdout / sys.stderr when the process started with that descriptor closed (`>&-`).

    Writing to it is an error (one line, exit 1) rather than Python's silent None: output is never lost quietly.
    """

    def __init__(self, what: str):
        self.what = what

    def write(self, s: str) -> int:
        raise ValueError(f"{self.what} is closed (started with >&-?); the output could not be written")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def guard_std_streams() -> None:
    """At start-up: a closed descriptor 0, 1 or 2 gets /dev/null, so no file we open later takes its number
    (and receives prints or a library's log lines); writing to a closed stdout/stderr raises (ClosedStream)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            if got != fd:
                os.dup2(got, fd)
                os.close(got)
            if fd == 1:
                sys.stdout = ClosedStream("standard output")  # type: ignore[assignment]
            elif fd == 2:
                sys.stderr = ClosedStream("standard error")  # type: ignore[assignment]


def _std_stream(fd: int) -> object:
    return sys.stdout if fd == 1 else sys.stderr


def _write_fd(fd: int, chunks: Iterable[bytes]) -> None:
    """Write bytes through a stream's descriptor (stdout and stderr through Python's own objects, in order)."""
    if fd in (1, 2):
        stream = _std_stream(fd)
        if stream is None or isinstance(stream, ClosedStream):
            raise ValueError(f"{'standard output' if fd == 1 else 'standard error'} is closed; the output "
                             "could not be written")
        stream.flush()  # type: ignore[union-attr]
        out = getattr(stream, "buffer", None)
        if out is not None:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            return
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


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
    pattern = re.compile(re.escape(_temp_stem(dest.name)) + r"\.(\d+)\.([0-9a-f]{8})\.[0-9a-f]{8}")
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


def _temp_bytes(write: _Write) -> int:
    total = 0
    for p in write.temps:
        with contextlib.suppress(OSError):
            total += _size(p)
    return total


def _free(dest: Path) -> int:
    try:
        return shutil.disk_usage(_existing_parent(dest)).free
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
        _write_fd(fd, _file_chunks(src))
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
    if fd is not None:
        with temp_dir("stream", report=report) as d:
            yield d / "out"
            _write_fd(fd, _file_chunks(d / "out"))
        return
    if _write_through(dest):
        yield dest  # nothing of ours to clean up: what went through is gone
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
    staged = temp_dir("stream", report=report) if _beside_stream(dests[-1]) else None
    with staged if staged is not None else contextlib.nullcontext(None) as where, \
            _guarded([where] if where is not None else dests, report) as write:
        tmp = _new_temp(where if where is not None else dests[-1], write, directory=True)  # after the main file
        yield tmp
        done = [(tmp / d.name, d) for d in dests if _lexists(tmp / d.name)]
        for src, _ in done:
            _umask_modes(src)
        if fsync:
            for src, dest in done:
                if not _write_through(dest):
                    _fsync_path(src)
        for src, dest in done:
            _keep_mode(src, dest)
        for src, dest in done:  # outside _no_interrupt: a slow reader must not hold off a SIGTERM
            if _write_through(dest):
                _copy_into(src, dest)
        with _no_interrupt():
            for src, dest in done:
                if not _write_through(dest):
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
    try:
        if fd is not None:  # a stream: straight through its descriptor, nothing to stage
            check_output_path(path)
            _write_fd(fd, as_bytes())
            return path
        with atomic_file(path, report=report, fsync=fsync) as tmp, open(tmp, "wb") as f:
            for chunk in as_bytes():
                f.write(chunk)
    except OSError as e:  # written through a device, FIFO or stream (a temp of ours is handled in _guarded)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(f"{path}: no space left on the device: it needs more than the {sent[0]:,} bytes "
                             f"written when it filled") from None
        if e.filename is None and e.strerror:
            raise ValueError(f"{path}: {e.strerror}") from None
        raise
    return path


def write_text(path: str | Path, text: str, *, report: Report | None = _stderr, fsync: bool = True) -> Path:
    """Write `text` (UTF-8, newline-terminated) to `path` atomically."""
    return write_chunks(path, [text if text.endswith("\n") else text + "\n"], report=report, fsync=fsync)


def write_bytes(path: str | Path, data: bytes, *, report: Report | None = _stderr, fsync: bool = True) -> Path:
    """Write `data` to `path` atomically."""
    return write_chunks(path, [data], report=report, fsync=fsync)
