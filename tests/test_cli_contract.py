"""The command line's one contract for help and usage errors, and numbers bounded by what they mean.

-h: every command and group has its purpose, its defaults and an example whose options exist; figures in help are
the code's constants, never retyped. A usage error is one stderr line and exit 1, with "did you mean" where a
close option, choice, preset or subcommand exists. MODEL that names a missing path, a FIFO or a misspelt preset
says which. Numbers: temperatures as float32 can hold them, report shapes within int64, --steps within the
context. Every file a command writes is named in its output. (Timing of refusals: test_fast_refusals.py.)
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from llama_tools.cli import cli
from llama_tools.cli.params import size_words, usage_line
from llama_tools.exporters.graph_meta import has_our_metadata, is_int4, names
from llama_tools.exporters.verification.parity_options import WHOLE_GRAPH_BYTES
from llama_tools.exporters.preflight import SINGLE_FILE_MAX_BYTES
from llama_tools.exporters.quant_options import ACCURACY_LEVEL, BLOCK_SIZE, DEFAULT_ALGORITHM, PROMPT_IDS
from llama_tools.exporters.verification.verify_preflight import Room
from llama_tools.checkpoints.formats import WRITABLE
from llama_tools.inference.generation import next_token
from llama_tools.modeling.presets import ALIASES, PRESETS, get_preset
from llama_tools.inference.sampling import FLOAT32_MAX, FLOAT32_TINY, check_sampling
from llama_tools.checkpoints.source import resolve
from llama_tools.checkpoints.tokenizer import KINDS
from test_fast_refusals import write_graph
from test_hostile import assert_one_line, invoke

TINY = get_preset("tiny")


def commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    """(path, command) for the root, every group and every command, depth first."""
    yield path, group
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def help_of(path: tuple[str, ...]) -> str:
    r = CliRunner().invoke(cli, [*path, "-h"])
    assert r.exit_code == 0, r.output
    return r.output


def flat(text: str) -> str:
    """Help with click's line wrapping undone."""
    return " ".join(text.split())


def contract_problems(path: tuple[str, ...], cmd: click.Command, text: str) -> list[str]:
    """What -h of `cmd` lacks: a purpose, an example (of this command, with options it has), shown defaults."""
    problems = []
    if not (cmd.help or "").strip():
        problems.append("no purpose")
    prog = " ".join(("llama-tools",) + path)
    examples = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("llama-tools")]
    if not any(e == prog or e.startswith(prog + " ") for e in examples):
        problems.append(f"no example of `{prog}`")
    for e in examples:
        words = shlex.split(e)[1:]
        target: click.Command = cli
        while isinstance(target, click.Group) and words and words[0] in target.commands:
            target = target.commands[words.pop(0)]
        known = {o for p in target.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}
        problems += [f"example `{e}`: no option {w}" for w in words if w.startswith("-") and w.split("=")[0]
                     not in known and not w.lstrip("-").replace(".", "").isdigit()]
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.is_flag and not p.required and p.name not in ("help", "version"):
            h = flat(p.help or "")
            if not (p.show_default or "[default:" in h or "instead of" in h or "this or --" in h):
                problems.append(f"{p.opts[-1]}: no default shown")
    return problems


@pytest.mark.parametrize("path, cmd", list(commands()), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_help_has_purpose_defaults_and_an_example(path, cmd):
    assert contract_problems(path, cmd, help_of(path)) == []


def test_the_contract_check_can_fail():
    """Negative: a command without an example, with a default left unsaid and an example naming no real option."""
    @click.command(help="Do a thing.\n\n\b\nExample:\n  llama-tools presets --colour red")
    @click.option("--size", default=None, help="How big.")
    def bad(size):  # noqa: ARG001
        pass

    text = CliRunner().invoke(bad, ["--help"], prog_name="llama-tools presets").output
    problems = contract_problems(("presets",), bad, text)
    assert "example `llama-tools presets --colour red`: no option --colour" in problems
    assert "--size: no default shown" in problems
    assert contract_problems(("nothing",), bad, text)[0] == "no example of `llama-tools nothing`"


def byte_figures(text: str) -> set[str]:
    """Every "N KiB/MiB/GiB" a help text quotes."""
    words = flat(text).split()
    return {f"{a} {b.rstrip('.,;)')}" for a, b in zip(words, words[1:]) if b.rstrip(".,;)") in ("KiB", "MiB", "GiB")
            and a.replace(",", "").isdigit()}


def test_size_words_by_hand():
    assert size_words(64 * 2**20) == "64 MiB" and size_words(1 << 30) == "1 GiB" and size_words(3 << 10) == "3 KiB"
    assert size_words(3 * 2**20 + 1) == "3,145,729 bytes" and size_words(1536 << 20) == "1,536 MiB"


def test_help_quotes_the_code_s_figures():
    """export onnx's .data threshold, verify parity's whole-graph limit, int4's defaults: each from its constant."""
    export = help_of(("export", "onnx"))
    assert byte_figures(export) == {size_words(SINGLE_FILE_MAX_BYTES)}, byte_figures(export)
    assert f"block {BLOCK_SIZE})" in flat(export) and f"power of two >= 16 [default: {BLOCK_SIZE}]" in flat(export)
    assert f"[default: {ACCURACY_LEVEL}]" in flat(export) and f"[default: {DEFAULT_ALGORITHM}]" in flat(export)
    parity = flat(help_of(("verify", "parity")))
    assert byte_figures(parity) == {size_words(WHOLE_GRAPH_BYTES)} and parity.count(size_words(WHOLE_GRAPH_BYTES)) == 2
    assert f"{PROMPT_IDS} seeded ids for a model with no tokenizer]" in flat(help_of(("verify", "int4")))
    # The constants are the ones the code runs with.
    from llama_tools.exporters.quantize import measure_quant_parity, quantize_int4

    assert inspect.signature(quantize_int4).parameters["algorithm"].default == DEFAULT_ALGORITHM
    assert "size=PROMPT_IDS" in inspect.getsource(measure_quant_parity)
    # Negative: the figure the help once retyped is caught.
    assert byte_figures("weights over 256 MiB stream to OUTPUT.data") != {size_words(SINGLE_FILE_MAX_BYTES)}


@pytest.mark.parametrize("path", [("tokenize",), ("generate",), ("verify", "parity")])
def test_help_names_every_tokenizer_kind(path):
    text = flat(help_of(path))
    for kind in KINDS:
        assert kind.patterns[0].lstrip("*") in text, (kind.patterns[0], text)


def test_convert_names_every_writable_layout():
    text = flat(help_of(("convert",)))
    assert all(f"{k}:" in text for k in WRITABLE), text
    line = assert_one_line(invoke(["convert", "tiny", "out"]), "--to")
    assert line.split("Choose from: ")[1].split(" (")[0] == ", ".join(WRITABLE)


# --- usage errors: one line, exit 1, the closest right word -------------------------------------------------

@pytest.mark.parametrize("argv, near", [
    (["generate", "tiny", "--promt", "hi"], "--prompt"),
    (["verify", "parity", "--stpes", "3"], "--steps"),
    (["count-params", "--per-layr"], "--per-layer"),
    (["presets", "--format", "jsn"], "json"),
    (["report", "shapes", "tiny", "--only", "weight"], "weights"),
    (["export", "onnx", "tiny", "-o", "x.onnx", "--dtype", "flaot16"], "float16"),
    (["export", "onx"], "onnx"),
    (["verify", "pairty"], "parity"),
    (["count-parms"], "count-params"),
    (["generate", "tinny", "--ids", "1"], "tiny"),
    (["count-params", "llama2-7"], "llama2-7b"),
    (["tokenize", "--hlep"], "--help"),
])
def test_usage_error_is_one_line_with_the_closest_word(argv, near):
    line = assert_one_line(invoke(argv))
    assert f"did you mean {near}?" in line and line.startswith("Error: "), line


@pytest.mark.parametrize("argv", [["generate", "tiny", "--zzzzzz"], ["export", "qqqq"], ["generate", "qqqq", "--ids", "1"],
                                  ["presets", "--format", "xyzzy"]])
def test_nothing_close_is_no_guess(argv):
    """Negative: with no close word there is no "did you mean", and still one line."""
    assert "did you mean" not in assert_one_line(invoke(argv))


def test_the_real_process_says_one_line():
    """The entry point itself: stderr is exactly one line, exit 1 (click's usage block and exit 2 are gone)."""
    exe = Path(sys.executable).with_name("llama-tools")
    p = subprocess.run([str(exe), "generate", "tiny", "--promt", "hi"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "", p
    assert p.stderr.splitlines() == ["Error: No such option '--promt' (did you mean --prompt? see 'llama-tools "
                                     "generate --help')"]


def test_usage_line_joins_click_s_lines():
    """click's own multi-line message (a Choice's list, one name a line) becomes one line."""
    cmd = click.Command("c", params=[click.Option(["--to"], type=click.Choice(["hf", "meta"]), required=True)])
    e = click.MissingParameter(ctx=click.Context(cmd, info_name="c"), param=cmd.params[0])
    assert "\n" in e.format_message()  # what click says
    assert usage_line(e).message == "Missing option '--to'. Choose from: hf, meta (see 'c --help')"


# --- MODEL: a path that is not there, a FIFO, a misspelt preset, the aliases -----------------------------------

def test_model_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("x.gguf")
    os.symlink("gone", "dangling")
    with pytest.raises(ValueError, match=r"^\./tiny-hf: no such file or directory"):
        resolve("./tiny-hf")
    with pytest.raises(ValueError, match=r"^y\.gguf: no such file or directory"):
        resolve("y.gguf")
    with pytest.raises(ValueError, match=r"^x\.gguf: is a FIFO, not a regular file"):
        resolve("x.gguf")
    with pytest.raises(ValueError, match=r"^\./dangling: a broken symbolic link"):
        resolve("./dangling")
    with pytest.raises(ValueError, match=r"unknown model 'tinny'.*\(did you mean tiny\?\)"):
        resolve("tinny")
    # Negative: a name that is no path and no preset stays an unknown preset, and a preset still resolves.
    with pytest.raises(ValueError, match=r"unknown model 'zzzq': not a preset.*Known presets") as e:
        resolve("zzzq")
    assert "did you mean" not in str(e.value) and resolve("tiny").kind == "preset"


def test_presets_lists_every_alias():
    """Each alias is listed beside its preset, names the same config, and is no preset's own name."""
    rows = json.loads(CliRunner().invoke(cli, ["presets", "--format", "json"]).output)
    listed = {a: r["name"] for r in rows for a in r["aliases"].split(", ") if a}
    assert listed == ALIASES
    assert all(get_preset(a) == PRESETS[t] for a, t in ALIASES.items()) and not set(ALIASES) & set(PRESETS)
    out = CliRunner().invoke(cli, ["count-params", "llama2-7b", "--format", "json"]).output
    assert json.loads(out)[0]["total"] == json.loads(
        CliRunner().invoke(cli, ["count-params", "llama-2-7b", "--format", "json"]).output)[0]["total"]


# --- numbers bounded by what they mean ----------------------------------------------------------------------

def test_float32_limits_by_hand():
    assert FLOAT32_TINY == 2.0**-126 and FLOAT32_MAX == (2 - 2.0**-23) * 2.0**127
    assert torch.finfo(torch.float32).tiny == FLOAT32_TINY and torch.finfo(torch.float32).max == FLOAT32_MAX


@pytest.mark.parametrize("temperature, ok", [(0.0, True), (FLOAT32_TINY, True), (FLOAT32_TINY / 2, False),
                                             (1e-40, False), (FLOAT32_MAX, True), (FLOAT32_MAX * 2, False),
                                             (-1.0, False), (math.nan, False)])
def test_temperature_bounds(temperature, ok):
    def check():
        check_sampling(TINY, [1], max_new_tokens=1, temperature=temperature, repetition_penalty=1.0, top_k=0,
                       top_p=1.0)
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match="--temperature"):
            check()


def test_sampling_at_the_smallest_temperature_is_greedy():
    """At float32's smallest temperature the draw is the argmax (and a penalty past float32 is no NaN either);
    the old computation, softmax(phi / T), gives NaN there (the negative case)."""
    phi = torch.tensor([1.0, 30.0, 25.0, -4.0])
    assert torch.isnan(torch.softmax(phi / FLOAT32_TINY, -1)).any()
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert next_token(phi, torch.tensor([0]), temperature=FLOAT32_TINY, repetition_penalty=1.0, top_k=0,
                          top_p=1.0, generator=g) == 1
        assert next_token(phi, torch.tensor([1, 2]), temperature=1.0, repetition_penalty=FLOAT32_TINY, top_k=0,
                          top_p=0.9, generator=g) in (1, 2)  # 30 and 25 divided by 2^-126: both inf, clamped


def test_report_shapes_within_int64(tmp_path):
    """tiny at 128 tokens: its largest activations (the scores, b x 4 heads x 128 x 128, and the logits,
    b x 128 x 512, fp32) take 2^18 bytes a sequence, so --batch 2^45 - 1 fits int64 and 2^45 does not."""
    from llama_tools.reports.shapes import shape_report

    rows = shape_report(TINY, 128, batch=1).records()
    assert max(r["bytes"] for r in rows if r["kind"] == "activation") == 4 * 128 * 128 * 4 == 128 * 512 * 4 == 2**18
    ok = CliRunner().invoke(cli, ["report", "shapes", "tiny", "--batch", str(2**45 - 1), "-o", str(tmp_path / "s.csv")])
    assert ok.exit_code == 0, ok.output
    import pandas as pd

    assert pd.read_csv(tmp_path / "s.csv")["bytes"].max() == (2**45 - 1) * 2**18 <= 2**63 - 1
    line = assert_one_line(invoke(["report", "shapes", "tiny", "--batch", str(2**45)]), "--batch", "64-bit")
    assert "2^63" in line


def test_room_by_hand():
    """verify's prompt + --steps against the context (tiny: 256) or a static KV buffer, with what would fit."""
    Room(TINY, None, "m.onnx").check(PROMPT_IDS, 256 - PROMPT_IDS)
    with pytest.raises(ValueError, match=f"give --steps <= {256 - PROMPT_IDS}$"):
        Room(TINY, None, "m.onnx").check(PROMPT_IDS, 257 - PROMPT_IDS)
    Room(TINY, 16, "m.onnx").check(8, 8)
    with pytest.raises(ValueError, match="m.onnx's static KV buffer of 16 positions; give --steps <= 8, or export with a larger --static-kv$"):
        Room(TINY, 16, "m.onnx").check(8, 9)
    with pytest.raises(ValueError, match="give a shorter prompt"):
        Room(TINY, None, "m.onnx").check(300, 1)


# --- verify int4 judges int4 graphs only ------------------------------------------------------------------------

def test_graph_facts_agree_with_onnx(tmp_path):
    """is_int4 / has_our_metadata against onnx's own reading; a weight whose bytes spell the op's name is a "maybe"
    for the byte scan that onnx then answers (the scan alone would be wrong: the negative case)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    fp = write_graph(tmp_path / "fp.onnx", config=TINY.to_dict())
    q = write_graph(tmp_path / "q.onnx", "MatMulNBits")
    decoy = onnx.load(fp)
    decoy.graph.initializer.append(numpy_helper.from_array(np.frombuffer(b"MatMulNBits!", dtype=np.uint8), "w"))
    onnx.save(decoy, tmp_path / "decoy.onnx")
    for p in (fp, q, tmp_path / "decoy.onnx"):
        model = onnx.load(p)
        assert is_int4(p) == any(n.op_type == "MatMulNBits" for n in model.graph.node)
        assert has_our_metadata(p) == any(m.key == "llama_tools.config" for m in model.metadata_props)
    assert names(tmp_path / "decoy.onnx", "MatMulNBits") and not is_int4(tmp_path / "decoy.onnx")


# --- every file a command writes is named in its output ------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["convert", "tiny", "ck", "--to", "hf"],
    ["report", "shapes", "tiny", "-o", "shapes.csv"],
    ["report", "regenerate", "-o", "gen"],
    ["verify", "parity", "tiny", "--checks", "layers", "--plot", "layers.png"],
    ["verify", "parity", "tiny", "--checks", "layers", "--plot", "layers.png", "--format", "json"],
], ids=["convert", "shapes", "regenerate", "plot", "plot-json"])
def test_every_file_written_is_named(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written, "nothing written"
    for name in written:
        assert name in r.output, f"{name} is not named in:\n{r.output}"
    if "--plot" in argv:
        assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if "json" in argv:
            assert json.loads(r.stdout)["plot"] == "layers.png"
        else:
            assert "plot: layers.png" in r.output.splitlines()
