"""llama_tools.outputs.files: atomic writes, modes from the umask, special files written through (never replaced),
one-line refusals, and cleanup after SIGTERM / SIGINT (real child processes) and after a SIGKILL (next run)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from llama_tools.outputs import files, paths

REPO = Path(__file__).resolve().parents[1]


def ours(directory: Path) -> list[str]:
    """Our temp names in `directory`."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(paths.TEMP_PREFIX))


# --- atomic writes -----------------------------------------------------------------------------------------

def test_write_text_replaces_atomically_and_leaves_only_the_destination(tmp_path):
    dest = tmp_path / "out.csv"
    dest.write_text("old\n")
    files.write_text(dest, "a,b\n1,2")
    assert dest.read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_temp_names_are_ours_and_name_the_destination(tmp_path):
    seen = []
    with files.atomic_file(tmp_path / "model.onnx") as tmp:
        seen = ours(tmp_path)
        assert tmp.parent == tmp_path
    assert seen == [tmp.name]
    prefix, rest = tmp.name[:len(paths.TEMP_PREFIX) + len("model.onnx.")], tmp.name[len(paths.TEMP_PREFIX) + 11:]
    assert prefix == ".llama-tools-tmp.model.onnx."
    pid, ns, hex_ = rest.split(".")
    assert int(pid) == os.getpid() and ns == paths.namespace_tag() and len(hex_) == 8


def test_a_failed_write_leaves_the_old_file_and_removes_directories_it_made(tmp_path):
    dest = tmp_path / "keep.txt"
    dest.write_text("old\n")
    with pytest.raises(RuntimeError):
        with files.atomic_file(dest) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert dest.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]

    def failing():
        yield b"x"
        raise RuntimeError("disk full")

    deep = tmp_path / "a" / "b" / "c" / "out.bin"
    with pytest.raises(RuntimeError):
        files.write_chunks(deep, failing())
    assert not (tmp_path / "a").exists()  # a, a/b, a/b/c were made by the write and are gone again
    # Negative: a successful write keeps the directories it made.
    files.write_bytes(deep, b"x")
    assert deep.read_bytes() == b"x"


def test_atomic_dir_appears_at_once_and_refuses_a_non_empty_destination(tmp_path):
    dst = tmp_path / "ckpt"
    with files.atomic_dir(dst) as d:
        (d / "config.json").write_text("{}")
        assert not dst.exists() and ours(tmp_path) == [d.name]
    assert sorted(p.name for p in dst.iterdir()) == ["config.json"] and ours(tmp_path) == []
    with pytest.raises(ValueError, match=r"ckpt: already exists and is not an empty directory"):
        with files.atomic_dir(dst):
            pytest.fail("must refuse before the block runs")
    empty = tmp_path / "empty"
    empty.mkdir()
    with files.atomic_dir(empty) as d:  # an empty directory is replaced
        (d / "x").write_text("1")
    assert (empty / "x").read_text() == "1"
    with pytest.raises(KeyError):
        with files.atomic_dir(tmp_path / "new" / "ckpt") as d:
            (d / "model.safetensors").write_bytes(b"\0" * 1000)
            raise KeyError("missing tensor")
    assert not (tmp_path / "new").exists() and ours(tmp_path) == []


def test_atomic_files_commit_in_order_and_leave_unwritten_names_alone(tmp_path):
    data, onnx = tmp_path / "m.onnx.data", tmp_path / "m.onnx"
    data.write_text("old data")
    order = []
    real = os.replace

    def spy(src, dst):
        order.append(Path(dst).name)
        real(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", spy)
        with files.atomic_files([data, onnx]) as d:
            (d / "m.onnx.data").write_text("new data")
            (d / "m.onnx").write_text("graph")
    assert order == ["m.onnx.data", "m.onnx"]
    assert data.read_text() == "new data" and onnx.read_text() == "graph"
    with files.atomic_files([data, onnx]) as d:
        (d / "m.onnx").write_text("small graph")  # no data file this time
    assert data.read_text() == "new data" and onnx.read_text() == "small graph"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


# --- modes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o002, 0o664, 0o775)])
def test_modes_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    f = files.write_text(tmp_path / "made" / "report.csv", "x")
    with files.atomic_dir(tmp_path / "ckpt") as d:
        (d / "config.json").write_text("{}")
    with files.atomic_files([tmp_path / "m.onnx"]) as d:
        (d / "m.onnx").write_bytes(b"graph")
    assert stat.S_IMODE(f.stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "m.onnx").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == dir_mode
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == dir_mode
    assert stat.S_IMODE((tmp_path / "ckpt" / "config.json").stat().st_mode) == file_mode
    # Negative: what mkstemp / mkdtemp (the old way) give under the same umask.
    fd, p = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    if mask != 0o077:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 != file_mode
        assert stat.S_IMODE(os.stat(tempfile.mkdtemp(dir=tmp_path)).st_mode) == 0o700 != dir_mode


def test_replacing_a_file_keeps_its_permission_bits(tmp_path, umask):
    umask(0o022)
    dest = tmp_path / "tracked.csv"
    dest.write_text("old")
    dest.chmod(0o640)
    files.write_text(dest, "new")
    assert stat.S_IMODE(dest.stat().st_mode) == 0o640 and dest.read_text() == "new\n"


# --- special files and refusals -----------------------------------------------------------------------------

def test_dev_null_is_written_through_never_replaced():
    before = os.stat("/dev/null")
    files.write_text("/dev/null", "nothing")
    with files.atomic_file("/dev/null") as p:
        assert p == Path("/dev/null")  # the device itself, not a temp beside it
        p.write_bytes(b"x" * 10)
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


@pytest.mark.parametrize("how", ["write_text", "atomic_files"])
def test_a_fifo_is_written_through_and_stays_a_fifo(tmp_path, how):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    if how == "write_text":
        files.write_text(fifo, "through the pipe")
    else:
        with files.atomic_files([fifo]) as d:
            (d / "pipe").write_text("through the pipe\n")
    reader.join(timeout=10)
    assert got == [b"through the pipe\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_refusals_are_one_line_naming_the_path_before_any_work(tmp_path):
    sock_path = tmp_path / "s"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    (tmp_path / "afile").write_text("x")
    try:
        cases = [
            (tmp_path, {}, f"{tmp_path}: is a directory"),
            (sock_path, {}, f"{sock_path}: is a socket; refusing"),
            ("/proc/self/out.csv", {}, "/proc/self/out.csv: is under /proc"),
            ("/sys/out.csv", {}, "/sys/out.csv: is under /sys"),
            (tmp_path / "afile" / "x.csv", {}, "a parent of this path is a file"),
            (tmp_path / "afile", {"directory": True}, "afile: is a file, not a directory"),
            ("/dev/null", {"directory": True}, "/dev/null: is a character device, not a directory"),
        ]
        for path, kw, message in cases:
            with pytest.raises(ValueError) as e:
                paths.check_output_path(path, **kw)
            assert message in str(e.value) and "\n" not in str(e.value), (path, str(e.value))
        called = []
        with pytest.raises(ValueError, match="is a directory"):
            with files.atomic_file(tmp_path):
                called.append(1)
        assert not called  # refused before the caller's work
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)  # and the socket is still a socket
    finally:
        sock.close()
    # Negative: fine paths pass, a missing parent chain included, and nothing is created.
    for ok in (tmp_path / "new" / "deeper" / "out.csv", tmp_path / "afile", "/dev/null"):
        assert paths.check_output_path(ok) == Path(ok)
    assert paths.check_output_path(tmp_path / "newdir", directory=True)
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=f"{ro}: directory .* is not writable|directory {ro} is not writable"):
        paths.check_output_path(ro / "x" / "out.csv")


# --- signals in this process ---------------------------------------------------------------------------------

def test_sigterm_during_a_write_removes_everything_and_exits_143(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    dest = tmp_path / "made" / "out.bin"

    def chunks():
        yield b"x" * 1000
        assert ours(tmp_path / "made")  # the temp exists when the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        yield b"never written"

    with pytest.raises(SystemExit) as e:
        files.write_chunks(dest, chunks())
    assert e.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is ours only for the write


def test_a_signal_during_the_rename_lets_the_rename_finish(tmp_path, monkeypatch):
    dest = tmp_path / "out.txt"
    dest.write_text("old\n")
    real = os.replace

    def replace_then_signal(src, dst):
        os.kill(os.getpid(), signal.SIGINT)  # arrives "during" the rename: deferred
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_signal)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground shell, not a `cmd &` runner
    try:
        with pytest.raises(SystemExit) as e:
            files.write_text(dest, "new")
    finally:
        signal.signal(signal.SIGINT, old)
    assert e.value.code == 128 + signal.SIGINT
    assert dest.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_an_ignored_signal_stays_ignored(tmp_path):
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with files.atomic_file(tmp_path / "x") as tmp:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # negative: SIGTERM is handled
            tmp.write_text("1")
    finally:
        signal.signal(signal.SIGINT, old)


# --- signals to a real child process -------------------------------------------------------------------------

CHILD = r"""
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground shell, even under a background runner
from llama_tools.outputs import files

dest, how = Path(sys.argv[1]), sys.argv[2]

def chunks():
    yield b"x" * (1 << 20)
    print("writing", flush=True)
    while True:  # a large file, written slowly: only a signal ends it
        time.sleep(0.02)
        yield b"x" * (1 << 16)

if how == "file":
    files.write_chunks(dest, chunks())
elif how == "dir":
    with files.atomic_dir(dest) as d:
        (d / "config.json").write_text("{}")
        with open(d / "model.safetensors", "wb") as f:
            for c in chunks():
                f.write(c)
elif how == "files":
    with files.atomic_files([dest.with_name(dest.name + ".data"), dest]) as d:
        with open(d / (dest.name + ".data"), "wb") as f:
            for c in chunks():
                f.write(c)
"""


def start_child(dest: Path, how: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(dest), how], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = p.stdout.readline()
    if line.strip() != "writing":
        p.kill()
        pytest.fail(f"child did not start writing: {line!r} {p.stderr.read()}")
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("how", ["file", "dir", "files"])
def test_a_signalled_child_removes_everything_it_made(tmp_path, sig, how):
    (tmp_path / "old.onnx").write_text("someone's old export\n")
    dest = tmp_path / "old.onnx" if how != "dir" else tmp_path / "made" / "ckpt"
    p = start_child(dest, how)
    temp_dir = dest.parent
    assert ours(temp_dir), "the temp must exist while writing (else this test proves nothing)"
    p.send_signal(sig)
    p.wait(timeout=30)
    err = p.stderr.read()
    assert p.returncode == 128 + sig, err
    assert f"interrupted by {signal.Signals(sig).name}" in err and "Traceback" not in err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["old.onnx"]  # no temp, no "made/", no .data
    assert (tmp_path / "old.onnx").read_text() == "someone's old export\n"


def test_after_a_sigkill_the_next_write_removes_the_stale_temp_and_says_so(tmp_path):
    dest = tmp_path / "model.onnx"
    p = start_child(dest, "files")
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    stale = ours(tmp_path)
    assert len(stale) == 1 and f".{p.pid}." in stale[0]  # SIGKILL cannot be caught: debris, as expected
    # Another process's temp for a different destination, and one of a live process, must survive.
    other = tmp_path / f"{paths.TEMP_PREFIX}other.onnx.{p.pid}.{paths.namespace_tag()}.0123abcd"
    other.mkdir()
    live = tmp_path / f"{paths.TEMP_PREFIX}model.onnx.{os.getppid()}.{paths.namespace_tag()}.89abcdef"
    live.mkdir()
    notes: list[str] = []
    files.write_text(dest, "graph", report=notes.append)
    assert dest.read_text() == "graph\n"
    assert ours(tmp_path) == sorted([other.name, live.name])
    assert len(notes) == 1 and stale[0] in notes[0] and f"process {p.pid}" in notes[0] and "bytes" in notes[0]


def test_the_stale_note_goes_to_stderr_by_default(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f"{paths.TEMP_PREFIX}r.csv.{pid}.{paths.namespace_tag()}.00000000").write_text("half")
    files.write_text(tmp_path / "r.csv", "x")
    err = capsys.readouterr().err
    assert f"{paths.TEMP_PREFIX}r.csv.{pid}.{paths.namespace_tag()}.00000000" in err and err.startswith("note: removed")
    assert ours(tmp_path) == []


# --- the CLI paths already written through files.py (report shapes -o) ---------------------------------------

def test_report_shapes_writes_through_dev_null_and_a_fifo_and_refuses_a_directory(tmp_path):
    from click.testing import CliRunner

    from llama_tools.cli import cli

    run = lambda *a: CliRunner().invoke(cli, ["report", "shapes", "tiny", "--format", "csv", *a])  # noqa: E731
    before = os.stat("/dev/null")
    r = run("-o", "/dev/null")
    assert r.exit_code == 0, r.output
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and os.stat("/dev/null").st_ino == before.st_ino

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert run("-o", str(fifo)).exit_code == 0
    reader.join(timeout=10)
    assert got[0].startswith("order,kind,section,layer") and stat.S_ISFIFO(os.stat(fifo).st_mode)

    r = run("-o", str(tmp_path))
    assert r.exit_code == 1 and f"{tmp_path}: is a directory" in r.output and len(r.output.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
