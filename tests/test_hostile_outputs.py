"""Issue 18 (items 1 and 5) as tests: outputs never overwrite inputs; streams, symlinks, full disks, long names,
other PID namespaces, signals and closed stdouts, through the real CLI and real processes.

Every refusal: exit 1, one line naming both paths (or the file and the bytes), no traceback, before any work
(tripwires), the user's files unchanged by hash, nothing of ours left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from llama_tools.outputs import files, paths
from llama_tools.checkpoints.convert import save_checkpoint
from test_hostile import TINY, assert_ok, assert_one_line, cwd, invoke, tiny_state, tree, tripwires  # noqa: F401

CLI = [sys.executable, "-m", "llama_tools.cli"]


def hashes(root: str | Path) -> dict[str, str]:
    """sha256 of every file under root (symlinks as their target text): what must not change."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        key = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(CLI + argv, stderr=subprocess.PIPE, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """tiny's seed-0 weights as an HF and a Meta checkpoint, and a config file with a tokenizer beside it."""
    root = tmp_path_factory.mktemp("ckpts")
    state = tiny_state()
    save_checkpoint(TINY, state, root / "hf", to="hf")
    save_checkpoint(TINY, state, root / "meta", to="meta")
    (root / "cfg").mkdir()
    shutil.copy(root / "hf" / "config.json", root / "cfg" / "config.json")
    return {"root": root, "hf": root / "hf", "meta": root / "meta", "cfgfile": root / "cfg" / "config.json"}


# --- 1. an output that is an input: refused before any work, naming both -----------------------------------

CASES = [  # (id, argv with {hf} {meta} {cfgfile} {cwd}, the input that must be named)
    ("export-over-weights", ["export", "onnx", "{hf}", "-o", "{hf}/model.safetensors"], "{hf}/model.safetensors"),
    ("export-over-config", ["export", "onnx", "{hf}", "-o", "{hf}/config.json"], "{hf}/config.json"),
    ("export-over-meta-shard", ["export", "onnx", "{meta}", "-o", "{meta}/consolidated.00.pth"],
     "{meta}/consolidated.00.pth"),
    ("export-over-params", ["export", "onnx", "{meta}", "-o", "{meta}/params.json"], "{meta}/params.json"),
    ("export-over-config-file", ["export", "onnx", "{cfgfile}", "-o", "{cfgfile}"], "{cfgfile}"),
    ("export-through-symlink", ["export", "onnx", "{hf}", "-o", "{cwd}/link.onnx"], "{hf}/model.safetensors"),
    ("export-data-over-weights", ["export", "onnx", "{hf}", "-o", "{hf}/model"], "{hf}/model.data"),
    ("shapes-over-config", ["report", "shapes", "{hf}", "--format", "csv", "-o", "{hf}/config.json"],
     "{hf}/config.json"),
    ("shapes-over-own-config-file", ["report", "shapes", "{cfgfile}", "--format", "json", "-o", "{cfgfile}"],
     "{cfgfile}"),
    ("convert-into-a-weight-file", ["convert", "{hf}", "{hf}/model.safetensors", "--to", "meta"],
     "{hf}/model.safetensors"),
]


@pytest.mark.parametrize("argv, named", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_an_output_that_is_an_input_is_refused_before_any_work(argv, named, ckpts, cwd, tripwires):
    where = {k: str(v) for k, v in ckpts.items()} | {"cwd": str(cwd)}
    (cwd / "link.onnx").symlink_to(ckpts["hf"] / "model.safetensors")
    data = ckpts["hf"] / "model.data"
    if "model.data" in named:  # a .data name that is one of the inputs (a hard link to the weights)
        os.link(ckpts["hf"] / "model.safetensors", data)
    try:
        before = hashes(ckpts["root"]), tree(cwd)
        r = invoke([a.format(**where) for a in argv])
        line = assert_one_line(r, named.format(**where).replace("/model.data", "/model.safetensors")
                               if "model.data" in named else named.format(**where))
        assert "reads" in line, line
        assert (hashes(ckpts["root"]), tree(cwd)) == before  # nothing of the user's changed, nothing of ours left
    finally:
        data.unlink(missing_ok=True)


def test_the_check_can_fail_and_exporting_beside_the_checkpoint_is_allowed(ckpts, tmp_path):
    """Negative: check_writes passes a new name in the checkpoint's directory (only inputs are refused)."""
    reads = [ckpts["hf"] / "model.safetensors", ckpts["hf"] / "config.json"]
    paths.check_writes([ckpts["hf"] / "model.onnx", ckpts["hf"] / "model.onnx.data"], reads)
    with pytest.raises(ValueError, match="lies inside"):
        paths.check_writes([ckpts["hf"] / "x"], [ckpts["hf"]])
    from llama_tools.checkpoints.source import resolve

    assert set(resolve(str(ckpts["hf"])).files) == {ckpts["hf"] / "model.safetensors", ckpts["hf"] / "config.json"}
    assert set(resolve(str(ckpts["meta"])).files) == {ckpts["meta"] / "consolidated.00.pth",
                                                     ckpts["meta"] / "params.json"}
    assert resolve("tiny").files == ()


def test_a_data_file_that_is_not_ours_is_refused_and_kept(cwd, tripwires):
    """`export onnx tiny -o DIR/results` used to delete DIR/results.data silently."""
    (cwd / "results.data").write_bytes(b"the user's own data\n")
    before = hashes(cwd)
    assert_one_line(invoke(["export", "onnx", "tiny", "-o", "results"]), "results.data", "not ours")
    assert hashes(cwd) == before and tree(cwd) == ["results.data"]


def test_a_data_file_our_graph_refers_to_is_ours(tmp_path):
    """Negative: beside a graph of ours that names it, OUTPUT.data passes the check (it is replaced as stale)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from llama_tools.exporters.pipeline import check_output
    from llama_tools.checkpoints.source import resolve

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])], [w])
    onnx.save_model(helper.make_model(graph), str(tmp_path / "results"), save_as_external_data=True,
                    location="results.data", size_threshold=0)
    assert (tmp_path / "results.data").is_file()
    assert check_output(resolve("tiny"), tmp_path / "results") == tmp_path / "results"
    (tmp_path / "other").write_bytes(b"not a graph")  # the same .data beside a file that refers to nothing
    shutil.copy(tmp_path / "results.data", tmp_path / "other.data")
    with pytest.raises(ValueError, match="not ours"):
        check_output(resolve("tiny"), tmp_path / "other")


# --- 2. streams and symlinks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_csv() -> str:
    r = invoke(["report", "shapes", "tiny", "--format", "csv"])
    assert_ok(r)
    return r.stdout


@pytest.mark.parametrize("name", ["/dev/stdout", "/dev/fd/1", "-"])
def test_report_shapes_to_standard_output_goes_through_it(name, tiny_csv, tmp_path):
    """stdout redirected (`>>`) to a file: the report lands after what was there; /dev/stdout stays a symlink."""
    before = os.lstat("/dev/stdout")
    out = tmp_path / "out.csv"
    out.write_text("kept line\n")
    with open(out, "a") as f:
        r = run(["report", "shapes", "tiny", "--format", "csv", "-o", name], stdout=f)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "kept line\n" + tiny_csv
    after = os.lstat("/dev/stdout")
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode) and os.path.islink("/dev/stdout")
    assert r.stderr.splitlines() == [f"wrote 82 rows (csv) to {name}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_report_shapes_to_a_process_substitution(tiny_csv, tmp_path):
    """-o >(gzip > x) is -o /dev/fd/N on a pipe: written through it (it used to be refused as under /proc)."""
    rfd, wfd = os.pipe()
    try:
        p = subprocess.Popen(CLI + ["report", "shapes", "tiny", "--format", "csv", "-o", f"/dev/fd/{wfd}"],
                             pass_fds=[wfd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        os.close(wfd)
        wfd = -1
        with os.fdopen(rfd, "rb") as reader:
            rfd = -1
            got = reader.read()
        _, err = p.communicate(timeout=60)
    finally:
        for fd in (rfd, wfd):
            if fd >= 0:
                os.close(fd)
    assert p.returncode == 0, err
    assert got.decode() == tiny_csv and list(tmp_path.iterdir()) == []


def test_a_closed_descriptor_is_one_line(cwd):
    r = run(["report", "shapes", "tiny", "--format", "csv", "-o", "/dev/fd/9"], cwd=cwd)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "/dev/fd/9" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and tree(cwd) == []


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_symlinked_output_writes_its_target_and_stays_a_link(dangling, tiny_csv, cwd):
    (cwd / "real").mkdir()
    target = cwd / "real" / "shapes.csv"
    if not dangling:
        target.write_text("old\n")
    (cwd / "link.csv").symlink_to("real/shapes.csv")
    assert_ok(invoke(["report", "shapes", "tiny", "--format", "csv", "-o", "link.csv"]))
    assert (cwd / "link.csv").is_symlink() and os.readlink(cwd / "link.csv") == "real/shapes.csv"
    assert target.read_text() == tiny_csv
    assert tree(cwd) == ["link.csv", "real", "real/shapes.csv"]


# --- 3. full disks ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` at `where` (root with mount rights), else skip."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        import gc

        gc.collect()  # torch.save's failed writer keeps its (deleted) file open until collected
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.parametrize("argv, size, says", [
    (["report", "shapes", "llama-7b", "--format", "csv", "-o", "{mnt}/out.csv"], "64k", "no space left"),
    # convert knows its size: refused before any weight is read (what the write itself would say is tested
    # with a simulated ENOSPC below)
    (["convert", "tiny", "{mnt}/ckpt", "--to", "hf"], "256k", "are free there"),
    (["convert", "tiny", "{mnt}/ckpt", "--to", "meta"], "256k", "are free there"),
], ids=["shapes", "convert-hf", "convert-meta"])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(argv, size, says, cwd):
    with small_tmpfs(cwd / "mnt", size) as mnt:
        r = invoke([a.format(mnt=mnt) for a in argv])
        line = assert_one_line(r, str(mnt), "bytes")
        assert says in line, line
        assert tree(mnt) == []  # no partial output, no temp, no directory of ours


def test_an_export_bigger_than_the_free_space_is_refused_up_front(cwd, tripwires):
    with small_tmpfs(cwd / "mnt", "256k") as mnt:
        line = assert_one_line(invoke(["export", "onnx", "tiny", "-o", str(mnt / "m.onnx")]), str(mnt / "m.onnx"))
        need = TINY.vocab_size * TINY.hidden_size  # at least the embedding's bytes at float32 are needed
        assert "needs" in line and "free" in line and int(line.split("needs ")[1].split()[0].replace(",", "")) > need
        assert tree(mnt) == []


def test_enospc_at_the_write_call_is_one_line(cwd, monkeypatch):
    """Simulated ENOSPC at the write itself (where no tmpfs can be mounted), and its negative: other errors pass."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(files, "open", lambda p, m="r", *a, **k: Full(real_open(p, m, *a, **k)) if "w" in m
                        else real_open(p, m, *a, **k), raising=False)
    line = assert_one_line(invoke(["report", "shapes", "tiny", "--format", "csv", "-o", "r.csv"]), "r.csv", "bytes")
    assert "no space left" in line and tree(cwd) == []
    monkeypatch.setattr(files, "open", real_open, raising=False)
    with pytest.raises(RuntimeError, match="boom"), files.atomic_file(cwd / "x") as tmp:  # not a full disk
        tmp.write_text("x")
        raise RuntimeError("boom")
    assert tree(cwd) == []


@pytest.mark.parametrize("redirect", [False, True], ids=["-o-dev-full", "stdout-dev-full"])
def test_a_device_that_is_full_is_one_line_naming_it(redirect, tmp_path):
    """/dev/full (ENOSPC at every write): written through, so the error names the path or standard output."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    argv = ["report", "shapes", "tiny", "--format", "csv"] + ([] if redirect else ["-o", "/dev/full"])
    with open("/dev/full", "w") as full:
        r = run(argv, stdout=full, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert ("standard output" if redirect else "/dev/full") in r.stderr and "space" in r.stderr.lower(), r.stderr
    assert list(tmp_path.iterdir()) == []


# --- 4. names: NAME_MAX -------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [200, 243, 254, 255])
def test_temp_names_fit_name_max_and_are_still_swept(length, tmp_path):
    dest = tmp_path / ("é" * ((length - 4) // 2) + "x" * ((length - 4) % 2) + ".csv")
    assert len(dest.name.encode()) == length
    t = paths.temp_path(dest)
    assert len(t.name.encode()) <= paths.NAME_MAX and t.name.startswith(paths.TEMP_PREFIX)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = t.parent / t.name.replace(f".{os.getpid()}.", f".{int(dead.stdout)}.", 1)
    stale.write_text("half")
    files.write_text(dest, "x", report=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]


def test_a_254_byte_report_name_works_and_256_is_one_line(tiny_csv, cwd):
    name = "r" * 250 + ".csv"
    assert_ok(invoke(["report", "shapes", "tiny", "--format", "csv", "-o", name]))
    assert (cwd / name).read_text() == tiny_csv and tree(cwd) == [name]
    long = "r" * 252 + ".csv"
    assert_one_line(invoke(["export", "onnx", "tiny", "-o", long]), "256 bytes")
    assert tree(cwd) == [name]


# --- 5. other PID namespaces: the stale sweep removes only the provably dead -----------------------------------

def test_a_temp_of_another_namespace_is_kept_and_said_ours_removed(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    dest = tmp_path / "model.onnx"
    stem = f"{paths.TEMP_PREFIX}model.onnx.{dead}"
    foreign = tmp_path / f"{stem}.{'0' * 8 if paths.namespace_tag() != '0' * 8 else '1' * 8}.0123abcd"
    ours = tmp_path / f"{stem}.{paths.namespace_tag()}.89abcdef"
    foreign.mkdir()
    (foreign / "model.onnx").write_text("another container's live export")
    ours.mkdir()
    notes: list[str] = []
    files.write_text(dest, "graph", report=notes.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.name, "model.onnx"])
    assert (foreign / "model.onnx").read_text() == "another container's live export"
    kept, removed = sorted(notes)  # "kept ..." < "removed ..."
    assert kept.startswith("kept ") and foreign.name in kept and "namespace" in kept, notes
    assert removed.startswith("removed ") and ours.name in removed, notes


def test_the_namespace_tag_differs_in_a_real_other_pid_namespace():
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root")
    r = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                        "from llama_tools.outputs import paths; import os; print(paths.namespace_tag(), os.getpid())"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode and r.stderr.startswith("unshare:"):  # the namespace itself was refused, not our code
        pytest.skip(f"cannot make a PID namespace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    tag, pid = r.stdout.split()
    assert int(pid) == 1 and tag != paths.namespace_tag()  # pid 1 there is not our pid 1: the tag says so
    same = subprocess.run([sys.executable, "-c", "from llama_tools.outputs import paths; print(paths.namespace_tag())"],
                          capture_output=True, text=True).stdout.strip()
    assert same == paths.namespace_tag()  # negative: another process of our namespace has our tag


# --- 6. signals and stdout ------------------------------------------------------------------------------------

def signal_when(argv: list[str], cwd: Path, appears: Path, prefix: str, sig: int,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run argv; send `sig` as soon as an entry named prefix* appears in `appears`."""
    # SIGINT as in a foreground shell: a runner started in the background (`cmd &`) ignores it, and children inherit that
    p = subprocess.Popen(CLI + argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline:
        seen = [n for n in os.listdir(appears) if n.startswith(prefix)]
        if seen:
            p.send_signal(sig)
            break
        time.sleep(0.005)
    if p.poll() is None and not seen:
        p.kill()
    out, err = p.communicate(timeout=120)
    return {"rc": p.returncode, "stdout": out, "stderr": err, "seen": seen, "pid": p.pid}


@pytest.mark.slow
def test_sigterm_and_sigint_during_an_int4_export_exit_128_plus_n_and_leave_nothing(tmp_path):
    """It used to end in `Error: list.remove(x): x not in list`, exit 1."""
    dirs = {sig: tmp_path / sig.name for sig in (signal.SIGTERM, signal.SIGINT)}
    for d in dirs.values():
        d.mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {sig: pool.submit(signal_when, ["export", "onnx", "tiny", "--quantize", "int4", "-o", "m.onnx"],
                                    d, d, paths.TEMP_PREFIX, sig) for sig, d in dirs.items()}
        res = {sig: f.result() for sig, f in futures.items()}
    for sig, r in res.items():
        assert r["seen"], r["stderr"]
        assert r["rc"] == 128 + sig, r["stderr"]
        assert "list.remove" not in r["stderr"] and "Traceback" not in r["stderr"], r["stderr"]
        assert r["stderr"].strip().splitlines()[-1].startswith(f"interrupted by {sig.name}")
        assert tree(dirs[sig]) == []


@pytest.mark.slow
def test_a_sigkilled_verify_parity_temp_dir_is_removed_and_said_by_the_next_run(tmp_path, monkeypatch):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    r = signal_when(["verify", "parity", "tiny", "--steps", "1"], tmp_path, tmpdir, paths.TEMP_PREFIX,
                    signal.SIGKILL, env)
    assert r["seen"] and r["rc"] == -signal.SIGKILL, r["stderr"]
    ours = lambda: sorted(n for n in os.listdir(tmpdir) if n.startswith(paths.TEMP_PREFIX))  # noqa: E731
    left = ours()
    assert left == r["seen"] and f".{r['pid']}." in left[0]  # SIGKILL cannot be caught: debris of ours
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # where the next run's files.temp_dir looks
    notes: list[str] = []
    with files.temp_dir("parity", report=notes.append) as d:  # what verify parity enters before exporting
        assert d.parent == tmpdir
    assert ours() == []
    assert len(notes) == 1 and left[0] in notes[0] and f"process {r['pid']} " in notes[0], notes


def test_verify_parity_makes_its_temp_dir_through_files(monkeypatch):
    """The export on the fly goes to files.temp_dir("parity") (swept as above), not tempfile's own."""
    import inspect

    from llama_tools.exporters.verification import parity

    assert 'files.temp_dir("parity")' in inspect.getsource(parity.verify_parity)


def test_a_closed_stdout_is_exit_1_with_one_line(tmp_path):
    r = subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", *CLI, "count-params", "tiny"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "standard output is closed" in r.stderr, r.stderr
    ok = subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", *CLI, "report", "shapes", "tiny", "--format", "csv",
                         "-o", "r.csv"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr  # negative: a command that writes no stdout still works
    assert (tmp_path / "r.csv").read_text().startswith("order,kind")


def test_a_broken_pipe_is_not_a_silent_success(tmp_path):
    rfd, wfd = os.pipe()
    os.close(rfd)  # the reader is gone before the first byte (`| head -c0`)
    try:
        r = subprocess.run(CLI + ["report", "shapes", "llama-7b", "--format", "csv"], stdout=wfd,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(wfd)
    assert r.returncode in (1, 128 + signal.SIGPIPE, -signal.SIGPIPE), r.stderr
    assert r.returncode != 1 or (r.stderr.count("\n") == 1 and "Broken pipe" in r.stderr), r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


# --- export-based (one real export each) ----------------------------------------------------------------------

@pytest.mark.slow
def test_export_to_stdout_and_to_a_254_byte_name(tmp_path):
    """The graph through a redirected stdout (the summary to stderr), and under a 254-byte name (the temp,
    and OUT.data that cannot exist, used to exceed NAME_MAX after the whole export)."""
    import onnx

    from llama_tools.exporters.onnx_export import read_metadata

    with open(tmp_path / "piped.onnx", "wb") as f:
        r = run(["export", "onnx", "tiny", "-o", "/dev/stdout", "-q", "--format", "json"], stdout=f, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert read_metadata(tmp_path / "piped.onnx").source == "tiny" and os.path.islink("/dev/stdout")
    assert json.loads(r.stderr[r.stderr.index("{"):])["path"] == "/dev/stdout"
    name = "m" * 249 + ".onnx"
    d = tmp_path / "long"
    d.mkdir()
    r = run(["export", "onnx", "tiny", "-o", name, "-q", "--no-client-files"], cwd=d)
    assert r.returncode == 0, r.stderr
    assert tree(d) == [name], tree(d)
    assert len(onnx.load(str(d / name)).graph.node) == len(onnx.load(str(tmp_path / "piped.onnx")).graph.node)
