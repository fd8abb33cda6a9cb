"""Where output goes, checked before any work: temp names, streams, devices, symlinks, space, inputs never overwritten.

check_output_path refuses in one line what can never be written (a socket, a directory, /proc, a name over
NAME_MAX, a missing parent that cannot be made); check_writes refuses an output that is, or lies inside, an
input; stream_fd names the descriptor of `-`, /dev/stdout, /dev/fd/N, written through, never replaced. Temp
names are ours (TEMP_PREFIX) and carry the pid and namespace tag that let a later run tell a SIGKILLed run's
leftovers from a live one's (files.remove_stale). No click, no torch.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

TEMP_PREFIX = ".llama-tools-tmp."
_FORBIDDEN_ROOTS = ("/proc", "/sys")
NAME_MAX = 255  # bytes of one path component on Linux's filesystems (ext4, xfs, btrfs, tmpfs, NFS)
# What a temp name adds after its stem: ".<pid>.<ns>.<hex>", with room for the largest pid (pid_max <= 2^22).
_TEMP_TAIL = len(".4194304.") + 8 + 1 + 8
# Streams by name: what /dev/stdout and a process substitution (/dev/fd/63) are; "-" is standard output.
_STREAM = re.compile(r"/dev/(?:fd/(\d+)|(stdin|stdout|stderr))|/proc/(?:self|thread-self|(\d+))/fd/(\d+)")
_STD_FDS = {"stdin": 0, "stdout": 1, "stderr": 2}

Report = Callable[[str], None]  # where notes such as "removed stale temp ..." go


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


def temp_stem(name: str) -> str:
    """TEMP_PREFIX + `name`, shortened (a prefix of it and a hash of the whole) so a temp name fits NAME_MAX."""
    stem = TEMP_PREFIX + name
    if len(stem.encode("utf-8", "surrogateescape")) + _TEMP_TAIL <= NAME_MAX:
        return stem
    digest = "~" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    room = NAME_MAX - _TEMP_TAIL - len(TEMP_PREFIX) - len(digest)
    cut = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")  # whole characters only
    return TEMP_PREFIX + cut + digest


def temp_path(dest: str | Path) -> Path:
    """A fresh temp path beside `dest`: .llama-tools-tmp.<dest name>.<pid>.<namespace tag>.<8 hex>."""
    dest = Path(dest)
    return dest.parent / f"{temp_stem(dest.name)}.{os.getpid()}.{namespace_tag()}.{secrets.token_hex(4)}"


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


def beside_stream(path: Path) -> bool:
    """A path in /dev/fd (or /proc/self/fd): a stream, or a name beside one that can never be created."""
    return re.fullmatch(r"/proc/(?:self|thread-self|\d+)/fd", os.path.realpath(Path(path).parent)) is not None


def lexists(path: Path) -> bool:
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


def existing_parent(path: Path) -> Path:
    p = Path(os.path.abspath(path)).parent
    while not p.exists():
        p = p.parent
    return p


def check_space(path: str | Path, need: int) -> None:
    """ValueError naming `path` and the bytes when the filesystem it would go to has fewer than `need` free."""
    if stream_fd(path) is not None or need <= 0:
        return
    free = shutil.disk_usage(existing_parent(Path(path))).free
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
    return writes_through(Path(dest))


def writes_through(dest: Path) -> bool:
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
    if beside_stream(path) and not directory:
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


def write_fd(fd: int, chunks: Iterable[bytes]) -> None:
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


def file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk

