"""Issue 11 as tests: hostile input, kills and file safety through the real CLI.

Every refusal is checked the same way (`assert_one_line`): exit 1, a SystemExit (anything else would be a
traceback in a real process; CliRunner hides it), exactly one line on stderr naming the file, field or option,
no "Traceback", and nothing left in the working directory or in the inputs. Refusals must also come before
any work: every expensive entry point is a tripwire that fails the test if it runs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from click.testing import CliRunner, Result

from helpers import train_tiny_tokenizer
from llama_tools.outputs import files, paths
from llama_tools.cli import cli
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.checkpoints.convert import convert, save_checkpoint
from llama_tools.modeling.model import build_model
from llama_tools.modeling.presets import get_preset
from llama_tools.reports.regenerate import generated_names

TINY = get_preset("tiny")  # vocab 512, 2 layers, context 256
GATE = "model.layers.0.mlp.gate_proj.weight"  # [176, 64] in tiny
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Who is the 45th President of the United States?",
         "una fff able unaffable", "你好，世界。"] * 30


# --- helpers ----------------------------------------------------------------------------------------------------

def tree(root: str | Path) -> list[str]:
    """Every path under root (hidden ones, FIFOs and directories included), relative and sorted."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def invoke(argv: list[str]) -> Result:
    return CliRunner().invoke(cli, argv)


def describe(r: Result) -> str:
    tb = ""
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        tb = "".join(traceback.format_exception(*r.exc_info))
    return f"exit {r.exit_code}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}{tb}"


def assert_one_line(r: Result, *names: str, stdout_allowed: bool = False) -> str:
    """Exit 1 with one stderr line naming every `names`; no traceback (in a real process)."""
    assert isinstance(r.exception, SystemExit) and r.exit_code == 1, describe(r)
    assert "Traceback" not in r.output, describe(r)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), describe(r)
    if not stdout_allowed:
        assert r.stdout == "", describe(r)
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def assert_ok(r: Result) -> None:
    assert r.exit_code == 0 and r.exception is None, describe(r)


def read_fifo_in_background(fifo: Path) -> tuple[threading.Thread, list[bytes]]:
    """A reader for `fifo` (so the writer does not block); its bytes land in the returned list."""
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    t.start()
    return t, got


def finish_reader(t: threading.Thread, fifo: Path) -> None:
    """Join the reader; if the command never opened the FIFO, open it for writing once so the reader ends."""
    t.join(timeout=5)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader is blocked in open(): this succeeds
        t.join(timeout=5)


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    """An empty working directory for one command."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _import_everything() -> list[Any]:
    """Every llama_tools module (the CLI imports most lazily), so a patch reaches each binding of a function."""
    import importlib
    import pkgutil

    import llama_tools.exporters
    import llama_tools.reports

    for pkg in (llama_tools, llama_tools.exporters, llama_tools.reports):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    return [m for name, m in sorted(sys.modules.items()) if name.startswith("llama_tools") and m is not None]


def bindings(fn: Any) -> list[tuple[Any, str]]:
    """(module, name) for every llama_tools module that holds `fn` (its own, and each `from x import fn`)."""
    return [(m, attr) for m in _import_everything() for attr, v in list(vars(m).items()) if v is fn]


# The expensive entry points: exporting, tracing, an onnxruntime session, materializing or reading weights.
EXPENSIVE = [("llama_tools.exporters.onnx_export", "export_onnx"), ("llama_tools.exporters.onnx_export", "_trace"),
             ("llama_tools.exporters.fused", "export_fused"), ("llama_tools.exporters.runtime", "create_session"),
             ("llama_tools.modeling.model", "build_model"), ("llama_tools.checkpoints.load", "load_checkpoint")]


@pytest.fixture
def tripwires(monkeypatch):
    """Each EXPENSIVE function, wherever a module bound it, fails the test if it runs; returns allow(name)."""
    _import_everything()
    originals = {f"{mod}.{name}": getattr(sys.modules[mod], name) for mod, name in EXPENSIVE
                 if hasattr(sys.modules[mod], name)}
    where = {key: bindings(fn) for key, fn in originals.items()}  # all found before any is patched

    def trip(what: str):
        def f(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{what} ran: the refusal must come before any work")
        return f

    for key, places in where.items():
        for m, attr in places:
            monkeypatch.setattr(m, attr, trip(key))

    def allow(key: str) -> None:
        for m, attr in where[key]:
            monkeypatch.setattr(m, attr, originals[key])

    return allow


@pytest.fixture
def guard_dev_null(monkeypatch):
    """Even if the code regressed, never let a test replace this machine's /dev/null (we may run as root)."""
    real_replace, real_rename = os.replace, os.rename
    null = os.path.realpath("/dev/null")

    def refuse(real):
        def f(src, dst, *a, **k):
            if os.path.realpath(dst) == null:
                raise AssertionError(f"{src} was about to replace /dev/null")
            return real(src, dst, *a, **k)
        return f

    monkeypatch.setattr(os, "replace", refuse(real_replace))
    monkeypatch.setattr(os, "rename", refuse(real_rename))


# --- inputs, built once -----------------------------------------------------------------------------------------

def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """tiny's seeded weights, exactly what `export onnx tiny` and `convert tiny` use (seed 0)."""
    return {k: v.detach().clone() for k, v in build_model(TINY, seed=seed).state_dict().items()}


def write_json(path: Path, data: Any) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Every hostile input and checkpoint, as absolute paths (the tests also check none is written to)."""
    root = tmp_path_factory.mktemp("inputs")
    p: dict[str, str] = {"root": str(root)}
    hf_cfg = config_to_hf(TINY)

    # A config-only directory with a sentencepiece tokenizer.model (tokenize needs no weights).
    tok = root / "tok"
    write_json(tok / "config.json", hf_cfg)
    train_tiny_tokenizer(TEXTS, tok / "tokenizer", vocab_size=320)
    p["tok"] = str(tok)
    p["noweights"] = str(Path(write_json(root / "noweights" / "config.json", hf_cfg)).parent)
    p["cfgfile"] = write_json(root / "cfg" / "config.json", hf_cfg)

    meta = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "multiple_of": 32,
            "norm_eps": 1e-5, "max_seq_len": 256}
    p["mult0"] = write_json(root / "mult0" / "params.json", {**meta, "multiple_of": 0})
    p["maxnull"] = write_json(root / "maxnull" / "params.json", {**meta, "max_seq_len": None})
    p["epslist"] = write_json(root / "epslist" / "config.json", {**hf_cfg, "rms_norm_eps": [1e-5]})
    deep = root / "deep" / "config.json"
    deep.parent.mkdir()
    deep.write_text('{"architectures": ' + "[" * 200_000 + "]" * 200_000 + "}", encoding="utf-8")
    p["deep"] = str(deep)
    latin1 = root / "latin1" / "config.json"
    latin1.parent.mkdir()
    latin1.write_bytes(json.dumps({**hf_cfg, "name": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))
    p["latin1"] = str(latin1)
    (root / "empty.onnx").write_bytes(b"")
    p["empty_onnx"] = str(root / "empty.onnx")
    (root / "adir").mkdir()
    p["adir"] = str(root / "adir")
    (root / "full").mkdir()
    (root / "full" / "keep.txt").write_text("not ours\n")
    p["full"] = str(root / "full")

    # Checkpoints of tiny's seed-0 weights: HF, and three broken ones.
    state = tiny_state()
    save_checkpoint(TINY, state, root / "hf", to="hf")
    p["hf"] = str(root / "hf")
    nan = dict(state, **{"lm_head.weight": state["lm_head.weight"].clone()})
    nan["lm_head.weight"][3, 5] = float("nan")
    save_checkpoint(TINY, nan, root / "nan", to="hf")
    p["nan"] = str(root / "nan")
    transposed = dict(state, **{GATE: state[GATE].t().contiguous()})  # same numel, [64, 176]
    save_checkpoint(TINY, transposed, root / "transposed", to="hf")
    p["transposed"] = str(root / "transposed")
    # lm_head column 0 + 0.5: every logit at a position moves by the same 0.5 * h_0, so each argmax (and the
    # softmax) is unchanged while the logits themselves are far out of tolerance.
    shifted = dict(state, **{"lm_head.weight": state["lm_head.weight"].clone()})
    shifted["lm_head.weight"][:, 0] += 0.5
    save_checkpoint(TINY, shifted, root / "shifted", to="hf")
    p["shifted"] = str(root / "shifted")
    return p


@pytest.fixture(scope="module")
def meta_copy(inputs, tmp_path_factory) -> str:
    """The HF checkpoint converted to Meta's layout (q/k rows interleaved): the same weights."""
    dst = tmp_path_factory.mktemp("meta") / "tiny-meta"
    convert(inputs["hf"], dst, to="meta")
    return str(dst)


# --- one-line refusals, before any work -------------------------------------------------------------------------

IDS_300 = " ".join(["1"] * 300)
NOWHERE = "/nonexistent/path"

REFUSALS = [
    # generate: prompt and sampling options (issue: tracebacks after work, or accepted but wrong)
    ("gen-context", ["generate", "tiny", "--ids", "1 2 3", "--max-new-tokens", "1000"], ["--max-new-tokens", "256"]),
    ("gen-id-vocab", ["generate", "tiny", "--ids", "1 2 99999"], ["--ids", "99999"]),
    ("gen-id-negative", ["generate", "tiny", "--ids", "1 -2 3"], ["--ids", "-2"]),
    ("gen-temp-nan", ["generate", "tiny", "--ids", "1", "--temperature", "nan"], ["--temperature"]),
    ("gen-temp-inf", ["generate", "tiny", "--ids", "1", "--temperature", "inf"], ["--temperature"]),
    ("gen-top-p", ["generate", "tiny", "--ids", "1", "--top-p", "1.5"], ["--top-p"]),
    ("gen-top-k", ["generate", "tiny", "--ids", "1", "--top-k", "-5"], ["--top-k"]),
    # verify parity of a MODEL: refused before the on-the-fly export
    ("parity-steps", ["verify", "parity", "tiny", "--steps", "300"], ["--steps", "256"]),
    ("parity-300-ids", ["verify", "parity", "tiny", "--ids", IDS_300], ["300 tokens", "256"]),
    # tokenize: ids outside the tokenizer's vocabulary
    ("tok-id-vocab", ["tokenize", "{tok}", "--ids", "1 99999"], ["{tok}/tokenizer.model", "99999"]),
    ("tok-id-negative", ["tokenize", "{tok}", "--ids", "-1"], ["{tok}/tokenizer.model", "-1"]),
    # config files
    ("params-multiple-of-0", ["count-params", "{mult0}"], ["{mult0}", "multiple_of"]),
    ("params-max-seq-len-null", ["count-params", "{maxnull}"], ["{maxnull}", "max_seq_len"]),
    ("config-eps-list", ["count-params", "{epslist}"], ["{epslist}", "rms_norm_eps"]),
    ("config-nested-200k", ["count-params", "{deep}"], ["{deep}", "nested"]),
    ("config-not-utf8", ["count-params", "{latin1}"], ["{latin1}", "UTF-8"]),
    # a path that is not there is not "an unknown preset", whatever the command
    *[(f"nowhere-{argv[0]}{'-' + argv[1] if argv[0] in ('report', 'export', 'verify') else ''}", argv,
       [NOWHERE, "no such file or directory"]) for argv in [
        ["count-params", NOWHERE], ["report", "shapes", NOWHERE], ["generate", NOWHERE, "--ids", "1"],
        ["tokenize", NOWHERE, "--ids", "1"], ["convert", NOWHERE, "out", "--to", "hf"],
        ["export", "onnx", NOWHERE, "-o", "x.onnx"], ["verify", "parity", NOWHERE]]],
    # output paths refused up front: under /proc, an existing directory (never naming our temp file)
    ("out-proc-export", ["export", "onnx", "tiny", "-o", "/proc/x.onnx"], ["/proc/x.onnx"]),
    ("out-proc-shapes", ["report", "shapes", "tiny", "--format", "csv", "-o", "/proc/x.csv"], ["/proc/x.csv"]),
    ("out-proc-convert", ["convert", "tiny", "/proc/x", "--to", "hf"], ["/proc/x"]),
    ("out-dir-export", ["export", "onnx", "tiny", "-o", "{adir}"], ["{adir}", "directory"]),
    ("out-dir-shapes", ["report", "shapes", "tiny", "--format", "csv", "-o", "{adir}"], ["{adir}", "directory"]),
    ("out-dir-convert", ["convert", "tiny", "{full}", "--to", "hf"], ["{full}", "not an empty directory"]),
    ("convert-shards-100", ["convert", "tiny", "out", "--to", "hf", "--shards", "100"], ["--shards", "100"]),
    # a directory with a config but no weights is not silently random
    ("noweights-export", ["export", "onnx", "{noweights}", "-o", "x.onnx"], ["{noweights}", "no weight files"]),
    ("noweights-parity", ["verify", "parity", "{noweights}"], ["{noweights}", "no weight files"]),
    # too big to materialize: said in CLI words, never "pass device='meta'"
    ("huge-generate", ["generate", "llama-3-70b", "--ids", "1"], ["llama-3-70b", "GiB"]),
    ("huge-export", ["export", "onnx", "llama-3-70b", "-o", "x.onnx"], ["llama-3-70b", "GiB"]),
    ("huge-convert", ["convert", "llama-3-70b", "out", "--to", "hf"], ["llama-3-70b", "GiB"]),
]


@pytest.mark.parametrize("argv, names", [pytest.param(a, n, id=i) for i, a, n in REFUSALS])
def test_refused_in_one_line_before_any_work(argv, names, inputs, cwd, tripwires):
    if argv[:3] == ["export", "onnx", "llama-3-70b"]:  # refused inside export_onnx, before tracing
        tripwires("llama_tools.exporters.onnx_export.export_onnx")
    argv = [a.format(**inputs) for a in argv]
    names = [n.format(**inputs) for n in names]
    before, shared = tree(cwd), tree(inputs["root"])
    line = assert_one_line(invoke(argv), *names)
    assert paths.TEMP_PREFIX not in line and "device=" not in line, line
    assert tree(cwd) == before and tree(inputs["root"]) == shared


@pytest.mark.parametrize("argv, names", [
    (["count-params", NOWHERE], [NOWHERE, "no such file or directory"]),
    (["report", "shapes", "tiny", "--format", "csv", "-o", "/proc/x.csv"], ["/proc/x.csv"]),
], ids=["nowhere", "proc"])
def test_the_installed_entry_point_says_one_line(argv, names, cwd):
    """The real `llama-tools` process: stderr is one line, exit 1."""
    exe = Path(sys.executable).with_name("llama-tools")
    p = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=120)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and len(lines) == 1 and p.stdout == "", p.stderr
    assert "Traceback" not in p.stderr and all(n in lines[0] for n in names), lines
    assert tree(cwd) == []


def test_nan_weights_fail_generate_in_one_line(inputs, cwd):
    before = tree(inputs["root"])
    line = assert_one_line(invoke(["generate", inputs["nan"], "--ids", "1 2 3", "--max-new-tokens", "4"]),
                           "NaN", inputs["nan"])
    assert tree(cwd) == [] and tree(inputs["root"]) == before, line
    # Negative: the same weights without the NaN generate (exit 0, 4 ids).
    r = invoke(["generate", inputs["hf"], "--ids", "1 2 3", "--max-new-tokens", "4", "--format", "json"])
    assert_ok(r)
    assert len(json.loads(r.stdout)["new_ids"]) == 4


def test_count_params_names_a_transposed_tensor_and_both_shapes(inputs, cwd, tripwires):
    r = invoke(["count-params", inputs["transposed"]])
    line = assert_one_line(r, GATE, "[64, 176]", "[176, 64]", stdout_allowed=True)
    assert line.index("[64, 176]") < line.index("[176, 64]"), "found shape first, then the config's"
    assert tree(cwd) == []
    # Negative: the untouched checkpoint counts clean.
    r = invoke(["count-params", inputs["hf"]])
    assert_ok(r)
    assert r.stderr == "" and "matches config" in r.stdout


def test_a_config_file_exports_seeded_random_weights_and_says_so(inputs, cwd, monkeypatch):
    """A config.json FILE is the explicit way to random weights: a note on stderr first; a preset needs none."""
    from llama_tools.exporters import onnx_export

    class Stop(Exception):
        """The export was reached: stop there (the note must already be out)."""

    seen = []

    def stub(source, output, **kw):
        seen.append((source, kw.get("seed")))
        raise Stop

    for m, attr in bindings(onnx_export.export_onnx):
        monkeypatch.setattr(m, attr, stub)
    r = invoke(["export", "onnx", inputs["cfgfile"], "-o", "x.onnx", "--seed", "7"])
    assert isinstance(r.exception, Stop), describe(r)
    notes = r.stderr.splitlines()
    assert len(notes) == 1 and inputs["cfgfile"] in notes[0] and "seeded random weights" in notes[0], r.stderr
    assert "seed 7" in notes[0]
    source, seed = seen[-1]
    assert source.kind == "config" and source.seeded and seed == 7
    # Negative: a preset is random by name; no note.
    r = invoke(["export", "onnx", "tiny", "-o", "x.onnx"])
    assert isinstance(r.exception, Stop), describe(r)
    assert r.stderr == "" and seen[-1][0].kind == "preset"
    assert tree(cwd) == []


def test_the_tour_converts_a_preset(cwd):
    """`convert tiny ./tiny-hf --to hf` (then Meta, then counting both) works as the README's tour runs it."""
    from safetensors.torch import load_file

    assert_ok(invoke(["convert", "tiny", "./tiny-hf", "--to", "hf"]))
    assert tree(cwd) == ["tiny-hf", "tiny-hf/config.json", "tiny-hf/model.safetensors", "tiny-hf/tokenizer.model",
                         "tiny-hf/tokenizer_config.json"]  # tiny's tokenizer travels with it
    got, want = load_file("tiny-hf/model.safetensors"), tiny_state()
    assert sorted(got) == sorted(want)
    for k in want:  # tiny's rows are already in HF's RoPE layout: bit-identical
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert_ok(invoke(["convert", "./tiny-hf", "./tiny-meta", "--to", "meta"]))
    for d in ("./tiny-hf", "./tiny-meta"):
        r = invoke(["count-params", d])
        assert_ok(r)
        assert "matches config" in r.stdout and r.stderr == ""


# --- .onnx targets (one real export, through a FIFO) ------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """`export onnx tiny -o FIFO`, read from a thread; the bytes that came through are kept as tiny.onnx."""
    d = tmp_path_factory.mktemp("fifo-export")
    fifo = d / "out.onnx"
    os.mkfifo(fifo)
    before = os.stat(fifo)
    reader, got = read_fifo_in_background(fifo)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(d)
        result = invoke(["export", "onnx", "tiny", "-o", "out.onnx"])
    finish_reader(reader, fifo)
    models = tmp_path_factory.mktemp("models")
    onnx_path = models / "tiny.onnx"
    onnx_path.write_bytes(got[0] if got else b"")
    return {"result": result, "before": before, "after": os.stat(fifo), "tree": tree(d), "bytes": got,
            "onnx": str(onnx_path)}


def test_export_writes_through_a_fifo(exported):
    assert_ok(exported["result"])
    before, after = exported["before"], exported["after"]
    assert stat.S_ISFIFO(after.st_mode) and after.st_ino == before.st_ino
    assert exported["tree"] == ["out.onnx"]  # no temp, no .data, no client files beside a FIFO
    from llama_tools.exporters.onnx_export import read_metadata

    meta = read_metadata(exported["onnx"])  # what came through the FIFO is the whole model
    assert meta.source == "tiny" and meta.seed == 0 and meta.config.num_hidden_layers == TINY.num_hidden_layers
    assert len(onnx.load(exported["onnx"]).graph.node) > 0


@pytest.mark.parametrize("extra, names", [
    (["--steps", "300"], ["--steps", "256"]),
    (["--ids", IDS_300], ["300 tokens", "256"]),
    (["--ids", "1 99999"], ["99999"]),
], ids=["steps-300", "300-ids", "id-vocab"])
def test_an_onnx_target_refuses_bad_inputs_before_running(exported, extra, names, cwd, tripwires):
    assert_one_line(invoke(["verify", "parity", exported["onnx"], *extra]), *names)
    assert tree(cwd) == []


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory) -> Path:
    """`export onnx tiny --optimize --static-kv 16` (module scope: made before the tripwires are set)."""
    path = tmp_path_factory.mktemp("static") / "static.onnx"
    assert_ok(invoke(["export", "onnx", "tiny", "-o", str(path), "--optimize", "--static-kv", "16",
                      "--no-client-files"]))
    return path


def test_a_static_graph_refuses_more_than_its_buffer_before_running(static_graph, cwd, tripwires):
    """11 prompt tokens + 8 steps do not fit 16 slots: said before any session, naming the option (the default
    text is cut to fit the buffer instead)."""
    path = static_graph
    line = assert_one_line(invoke(["verify", "parity", str(path), "--steps", "8", "--ids", " ".join(["5"] * 11)]),
                           str(path), "static KV buffer of 16")
    assert "--static-kv" in line and tree(cwd) == []


def test_an_empty_onnx_says_empty_file(inputs, cwd, tripwires):
    assert_one_line(invoke(["verify", "parity", inputs["empty_onnx"]]), inputs["empty_onnx"], "empty file")
    assert tree(cwd) == []


def test_an_onnx_whose_source_moved_hints_at_source(exported, inputs, cwd, tmp_path_factory, tripwires):
    from llama_tools.exporters.onnx_export import META
    from llama_tools.exporters.verification.parity import resolve_target

    d = tmp_path_factory.mktemp("moved")
    src = d / "ckpt"
    shutil.copytree(inputs["hf"], src)
    m = onnx.load(exported["onnx"])
    props = {p.key: p for p in m.metadata_props}
    props[META + "source"].value = str(src)  # what an export of the directory records: its absolute path ...
    props[META + "seed"].value = ""  # ... and no seed (checkpoint weights)
    graph = d / "from-dir.onnx"
    onnx.save(m, str(graph))
    assert resolve_target(str(graph), None).source.path == src  # the source is found while it is there
    src.rename(d / "elsewhere")
    before = tree(d)
    assert_one_line(invoke(["verify", "parity", str(graph)]), str(graph), str(src), "--source")
    assert tree(d) == before and tree(cwd) == []
    # The hint works: --source with the moved checkpoint resolves.
    assert resolve_target(str(graph), str(d / "elsewhere")).source.path == d / "elsewhere"


# --- false verdicts ---------------------------------------------------------------------------------------------

def parity_lines(r: Result) -> dict[str, str]:
    """The table's rows by their first word(s): logits, present.*, decode logits, greedy decode."""
    rows = {}
    for line in r.stdout.splitlines():
        for key in ("logits", "present.*", "decode logits", "greedy decode"):
            if line.startswith(key + " ") or line.startswith(key + "  "):
                rows[key] = line
    return rows


def test_an_hf_export_passes_against_its_meta_copy(exported, meta_copy, cwd, monkeypatch):
    """Same weights, other RoPE row order: K caches compared after the layout's permutation -> PASS."""
    r = invoke(["verify", "parity", exported["onnx"], "--source", meta_copy])
    assert_ok(r)
    rows = parity_lines(r)
    assert rows["present.*"].rstrip().endswith("pass") and "8/8 steps agree" in rows["greedy decode"], r.stdout
    assert r.stdout.splitlines()[-1].startswith("PASS")
    # Negative: without the permutation the same K caches differ from layer 0 (the check can fail).
    from llama_tools.exporters.verification import parity

    monkeypatch.setattr(parity, "_channel_order", lambda g, ref, n: __import__("numpy").arange(n))
    r = invoke(["verify", "parity", exported["onnx"], "--source", meta_copy])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), describe(r)
    assert "FAIL from layer 0" in parity_lines(r)["present.*"]
    assert tree(cwd) == []


def test_a_failing_decode_row_says_why_even_when_every_step_agrees(exported, inputs, cwd):
    """lm_head shifted by a constant column: every argmax agrees, the decode logits do not -> the row says so."""
    r = invoke(["verify", "parity", exported["onnx"], "--source", inputs["shifted"]])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), describe(r)
    rows = parity_lines(r)
    greedy = rows["greedy decode"]
    assert "8/8 steps agree" in greedy, greedy  # the construction: argmax unchanged at every step
    assert "FAIL" in rows["logits"] and rows["present.*"].rstrip().endswith("pass"), r.stdout  # K/V untouched
    # The failing row is the decode logits' own, saying which bound; the greedy row reports the steps, which
    # agree, so it passes: no row contradicts itself, and the run fails.
    verdict = rows["decode logits"][rows["decode logits"].index("FAIL"):].rstrip()
    assert "bound" in verdict or "budget" in verdict, verdict
    assert greedy.rstrip().endswith("pass"), greedy
    assert r.stdout.splitlines()[-1].startswith("FAIL") and tree(cwd) == []


# --- file safety ------------------------------------------------------------------------------------------------

def test_export_to_dev_null_writes_through_and_leaves_it_a_device(cwd, guard_dev_null):
    before, dev = os.stat("/dev/null"), set(os.listdir("/dev"))
    try:
        r = invoke(["export", "onnx", "tiny", "-o", "/dev/null"])
        after = os.stat("/dev/null")
        made = set(os.listdir("/dev")) - dev
    finally:  # what a wrong export could have written beside /dev/null: remove it again
        for name in set(os.listdir("/dev")) - dev:
            if name in ("null.data", "config.json", "generation_config.json", "genai_config.json", "tokenizer.json",
                        "tokenizer_config.json", "tokenizer.model"):
                os.unlink(os.path.join("/dev", name))
    assert not made, f"written beside /dev/null: {sorted(made)}"
    assert_ok(r)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not os.path.exists("/dev/null.data")
    assert not [n for n in os.listdir("/dev") if n.startswith(f"{paths.TEMP_PREFIX}null.{os.getpid()}.")]
    assert tree(cwd) == []


@pytest.mark.parametrize("kind", ["fifo", "dev-null"])
def test_report_shapes_writes_through_a_special_file(kind, cwd, guard_dev_null):
    want = invoke(["report", "shapes", "tiny", "--format", "csv"])
    assert_ok(want)
    if kind == "fifo":
        target = cwd / "shapes.csv"
        os.mkfifo(target)
        reader, got = read_fifo_in_background(target)
    else:
        target = Path("/dev/null")
    before = os.stat(target)
    r = invoke(["report", "shapes", "tiny", "--format", "csv", "-o", str(target)])
    if kind == "fifo":
        finish_reader(reader, target)
        assert got and got[0].decode() == want.stdout  # the whole report went through the FIFO
    assert_ok(r)
    after = os.stat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert stat.S_ISFIFO(after.st_mode) if kind == "fifo" else stat.S_ISCHR(after.st_mode)
    assert tree(cwd) == (["shapes.csv"] if kind == "fifo" else [])
    assert len(r.stderr.splitlines()) == 1 and str(target) in r.stderr


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["022", "077"])
def test_modes_follow_the_umask(mask, cwd, umask):
    umask(mask)
    assert_ok(invoke(["report", "shapes", "tiny", "--format", "csv", "-o", "made/shapes.csv"]))
    assert_ok(invoke(["convert", "tiny", "ckpt", "--to", "hf"]))
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    mode = lambda p: stat.S_IMODE((cwd / p).stat().st_mode)  # noqa: E731
    assert tree(cwd) == ["ckpt", "ckpt/config.json", "ckpt/model.safetensors", "ckpt/tokenizer.model",
                         "ckpt/tokenizer_config.json", "made", "made/shapes.csv"]
    assert mode("made/shapes.csv") == file_mode and mode("made") == dir_mode
    assert mode("ckpt") == dir_mode
    assert all(mode(f"ckpt/{n}") == file_mode  # copied files too, not the package data's own mode
               for n in ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"))


def test_report_regenerate_writes_into_the_current_directory(cwd, umask):
    umask(0o022)
    r = invoke(["report", "regenerate", "--format", "json"])
    assert_ok(r)
    assert tree(cwd) == sorted(generated_names())
    assert {Path(row["file"]).resolve().parent for row in json.loads(r.stdout)} == {cwd.resolve()}
    assert all(stat.S_IMODE((cwd / n).stat().st_mode) == 0o644 for n in generated_names())


# --- kills: a real process, a real signal -----------------------------------------------------------------------

# One wide layer (tracing costs per layer, writing per byte) and a 32k vocabulary: ~140 MB of float32
# weights, so the write lasts long enough to signal the process while its temp sits beside OUT.
BIG = {**config_to_hf(TINY), "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
       "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}


def export_and_signal(workdir: Path, sig: int) -> dict[str, Any]:
    """`python -m llama_tools.cli export onnx config.json -o model.onnx`; `sig` once its temp appears."""
    proc = subprocess.Popen([sys.executable, "-m", "llama_tools.cli", "export", "onnx", "config.json", "-o",
                             "model.onnx"], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        seen = [n for n in os.listdir(workdir) if n.startswith(paths.TEMP_PREFIX + "model.onnx.")]
        if seen:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    if proc.poll() is None and not seen:
        proc.kill()
    out, err = proc.communicate(timeout=120)
    return {"rc": proc.returncode, "stdout": out, "stderr": err, "seen": seen, "pid": proc.pid,
            "tree": tree(workdir)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[int, tuple[Path, dict[str, Any]]]:
    """The SIGTERM and the SIGKILL export, run side by side (one per core)."""
    dirs = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        d = tmp_path_factory.mktemp(f"kill-{sig.name}")
        write_json(d / "config.json", BIG)
        dirs[sig] = d
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {sig: pool.submit(export_and_signal, d, sig) for sig, d in dirs.items()}
        return {sig: (dirs[sig], f.result()) for sig, f in futures.items()}


def test_sigterm_during_the_write_removes_everything_and_exits_143(killed):
    d, res = killed[signal.SIGTERM]
    assert res["seen"], f"the export finished before its temp was seen:\n{res['stderr']}"
    assert res["rc"] == 143, res["stderr"]
    assert "Traceback" not in res["stderr"]
    assert res["stderr"].strip().splitlines()[-1] == "interrupted by SIGTERM: removed the partial output"
    assert res["tree"] == ["config.json"]  # no temp dir, no model.onnx, no model.onnx.data


@pytest.fixture(scope="module")
def after_sigkill(killed) -> dict[str, Any]:
    """The next export to the SIGKILLed export's OUT (umask 027), in its directory."""
    d, res = killed[signal.SIGKILL]
    config = (d / "config.json").read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(d)
        old = os.umask(0o027)
        try:
            r = invoke(["export", "onnx", "tiny", "-o", "model.onnx"])
        finally:
            os.umask(old)
    return {"dir": d, "killed": res, "result": r, "config_before": config, "tree": tree(d)}


def test_after_a_sigkill_the_next_export_removes_the_stale_temp_and_says_so(after_sigkill):
    d, res, r = after_sigkill["dir"], after_sigkill["killed"], after_sigkill["result"]
    assert res["seen"], f"the export finished before its temp was seen:\n{res['stderr']}"
    assert res["rc"] == -signal.SIGKILL
    stale = [n for n in res["tree"] if "/" not in n and n.startswith(paths.TEMP_PREFIX)]
    assert stale == res["seen"] and f".{res['pid']}." in stale[0], res["tree"]  # ours, named after OUT and the pid
    assert_ok(r)
    notes = r.stderr.splitlines()  # one note for the stale temp (others, such as a kept file, may follow)
    removal = [n for n in notes if n.startswith("note: removed ")]
    assert len(removal) == 1 and stale[0] in removal[0] and f"process {res['pid']} " in removal[0], notes
    assert all(n.startswith("note: ") for n in notes) and "Traceback" not in r.stderr, notes
    assert not [n for n in after_sigkill["tree"] if paths.TEMP_PREFIX in n], after_sigkill["tree"]
    assert "model.onnx" in after_sigkill["tree"]
    assert stat.S_IMODE((d / "model.onnx").stat().st_mode) == 0o640  # 0666 & ~umask, not mkstemp's 0600


def test_an_export_never_replaces_a_config_json_that_is_not_its_own(after_sigkill):
    """The directory's config.json is the user's (the first export's source): files written beside OUT leave it."""
    assert_ok(after_sigkill["result"])
    assert (after_sigkill["dir"] / "config.json").read_bytes() == after_sigkill["config_before"]
