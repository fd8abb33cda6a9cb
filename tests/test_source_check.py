"""The source check: our reading of a checkpoint judged against transformers' own, in verify parity and verify source.

A checkpoint read right agrees block by block within the fp32 noise; a reading made wrong on purpose (the config
reader made to ignore one key, as a reader that half-knows a layout would) turns the default `verify parity` into a
FAIL that names the source check and the first layer it touches; without transformers the header says the reading
was not checked; the real Gemma 3 270M, as transformers saves it, is read right in both config layouts.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from config_cases import CASES  # noqa: E402
from test_config_layouts import hf_checkpoint  # noqa: E402

from llama_tools.checkpoints import config_files  # noqa: E402
from llama_tools.checkpoints.source import resolve  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.exporters.prompts import random_rows  # noqa: E402
from llama_tools.exporters.verification.source_check import check_source  # noqa: E402

FIXTURES = Path(__file__).parent / "data" / "transformers5"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gemma3")
    hf_checkpoint("gemma3-linear", d)
    return d


def _rows() -> list[list[int]]:
    rows = random_rows(256, 3, 0)
    rows[0] = rows[0] * 4  # 44 positions: past the window of 16, so the sliding layers' base and mask matter
    return rows


@pytest.mark.parametrize("case", ["llama-llama3", "qwen2", "gemma2", "mixtral"])
def test_a_reading_that_agrees_passes_every_block(tmp_path, case):
    hf_checkpoint(case, tmp_path)
    rep = check_source(resolve(str(tmp_path)), _rows())
    assert rep.checked and rep.library.startswith("transformers ")
    assert [b.name for b in rep.blocks] == ["embedding", *(f"layer {j}" for j in range(4)), "head"]
    assert rep.passed, [(b.name, b.checks[0].figures()) for b in rep.blocks]
    assert all(c.ratio < 3 for b in rep.blocks for c in b.checks)  # measured 0.9-1.2x: far under the bound of 8x


def _ignore_local_base(monkeypatch) -> None:
    """Plant a misread: the config reader loses Gemma 3's sliding layers' base (what rope_parameters misread did)."""
    rope = config_files._rope
    monkeypatch.setattr(config_files, "_rope", lambda *args, **kwargs: (*rope(*args, **kwargs)[:2], None))


def test_a_planted_misread_fails_the_default_verify_naming_the_source_check(gemma3, monkeypatch):
    ok = CliRunner().invoke(cli, ["verify", "parity", str(gemma3), "--random-ids", "2", "-q", "--checks", "layers"])
    assert ok.exit_code == 0, ok.output[-2000:]
    assert "source check: our reading of" in ok.output and "agrees in all 6 blocks" in ok.output
    _ignore_local_base(monkeypatch)
    bad = CliRunner().invoke(cli, ["verify", "parity", str(gemma3), "--random-ids", "2", "-q", "--checks", "layers"])
    assert bad.exit_code == 1, bad.output[-2000:]
    last = bad.output.strip().splitlines()[-1]
    assert last.startswith("FAIL; our reading of the checkpoint differs from what transformers computes, from layer 0")
    assert "(the source check)" in last
    # the graph agrees with the (wrong) reference: the export alone would have passed
    assert "layer by layer on onnxruntime" in bad.output and "FAIL: error over budget" in bad.output
    data = json.loads(CliRunner().invoke(cli, ["verify", "parity", str(gemma3), "--random-ids", "2", "-q",
                                               "--checks", "layers", "--format", "json"]).output)
    assert data["passed"] is False and data["mode"] == "by-layer"
    assert all(b["passed"] for b in data["blocks"])  # the graph's own blocks agree with the misread reference
    assert data["source_check"]["first_bad"] == "layer 0" and data["source_check"]["checked"]


def test_verify_source_alone(gemma3, monkeypatch):
    r = CliRunner().invoke(cli, ["verify", "source", str(gemma3), "--random-ids", "3", "--format", "json"])
    assert r.exit_code == 0, r.output[-2000:]
    data = json.loads(r.output)
    assert data["passed"] and data["checked"] and len(data["blocks"]) == 6
    _ignore_local_base(monkeypatch)
    r = CliRunner().invoke(cli, ["verify", "source", str(gemma3), "--random-ids", "3"])
    assert r.exit_code == 1
    assert "FAIL: our reading of the checkpoint differs" in r.output
    assert "layer 0    layer 0 hidden Z^1" in r.output and "FAIL: error over budget" in r.output


def test_a_tensor_only_one_side_expects_is_named(tmp_path, monkeypatch):
    """A key that adds tensors, lost by our reader: transformers wants q/k/v/o biases the reading never predicted."""
    hf_checkpoint("llama-linear", tmp_path)  # no biases in the files
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "attention_bias": True}))
    from llama_tools.modeling.families import FAMILIES

    monkeypatch.delitem(FAMILIES["llama"].hf_keys, "attention_bias")  # the planted misread: the key unread
    rep = check_source(resolve(str(tmp_path)), _rows())
    assert rep.checked and not rep.passed and not rep.blocks
    assert rep.mismatch.startswith("transformers' LlamaForCausalLM has a weight 'model.layers.0.self_attn.q_proj.bias' "
                                   "that the checkpoint does not hold")


def test_without_transformers_the_header_says_not_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    r = CliRunner().invoke(cli, ["verify", "parity", "--random-ids", "2", "-q", "--checks", "layers"])
    assert r.exit_code == 0, r.output[-2000:]
    assert "source check: not run: transformers is not installed" in r.output
    r = CliRunner().invoke(cli, ["verify", "source"])
    assert r.exit_code == 1 and r.output.startswith("Error: tiny: the source check cannot run: transformers is not")
    assert len(r.output.strip().splitlines()) == 1


def test_a_layout_the_installed_transformers_does_not_read_is_not_judged_by_it(gemma3, tmp_path):
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers >= 5 reads both layouts")
    d = tmp_path / "v5"
    shutil.copytree(gemma3, d)
    shutil.copy(FIXTURES / "gemma3-linear.json", d / "config.json")
    rep = check_source(resolve(str(d)), _rows())
    assert not rep.checked and "rope_parameters" in rep.reason and "transformers >= 5" in rep.reason
    assert rep.passed  # not run is no failure: the header says it, the graph checks still decide


def _v5_layout(d: Path) -> dict:
    """D's Gemma 3 config.json (4.x layout) as transformers 5 writes it: one rope_parameters entry per layer type."""
    v5 = json.loads((d / "config.json").read_text())
    v5["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": v5.pop("rope_theta")},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": v5.pop("rope_local_base_freq")}}
    del v5["rope_scaling"]
    return v5


@pytest.mark.slow
def test_the_real_gemma3_is_read_as_transformers_reads_it(tmp_path):
    """Gemma 3 270M as transformers saves it (18 layers, 5 local : 1 global at bases 1e4 / 1e6): read right in the
    installed layout and in transformers 5's (rope_parameters per layer type), and a lost base is seen."""
    import realmodels

    try:
        d = realmodels.gemma3_hf()
    except realmodels.Unavailable as e:
        pytest.skip(str(e))
    src = resolve(str(d))
    assert (src.cfg.rope_theta, src.cfg.rope_local_theta) == (1e6, 1e4)
    rows = [list(range(2, 60))]
    rep = check_source(src, rows)
    assert rep.passed, [(b.name, b.checks[0].figures()) for b in rep.blocks]
    (tmp_path / "config.json").write_text(json.dumps(_v5_layout(d)))
    assert config_files.load_config(tmp_path / "config.json").replace(source="", name="") == \
        src.cfg.replace(source="", name="")


@pytest.mark.slow
def test_the_real_gemma3_in_transformers_5_layout_is_exported_and_verified(tmp_path):
    """The same checkpoint with transformers 5's config (rope_parameters per layer type): the fused export and the
    default verify pass, and the graph's two RoPE table pairs hold the two bases (a lost local base would put the
    global one there: the export and its own verdict would agree on the wrong model)."""
    import numpy as np
    import onnx
    import realmodels

    try:
        d = realmodels.gemma3_hf()
    except realmodels.Unavailable as e:
        pytest.skip(str(e))
    src = tmp_path / "v5"
    src.mkdir()
    for f in d.iterdir():
        if f.name != "config.json":
            try:
                (src / f.name).hardlink_to(f)  # the 1 GB of weights, not copied
            except OSError:
                shutil.copy(f, src / f.name)
    v5 = _v5_layout(d)
    (src / "config.json").write_text(json.dumps(v5))
    graph = tmp_path / "fused" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", str(src), "-o", str(graph), "--optimize", "-q"])
    assert r.exit_code == 0, r.output[-1500:]
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    tables = {}
    for t in onnx.load(str(graph), load_external_data=False).graph.initializer:
        if t.name in ("cos_cache", "cos_cache_local"):
            if uses_external_data(t):
                load_external_data_for_tensor(t, str(graph.parent))
            tables[t.name] = onnx.numpy_helper.to_array(t)  # [positions, n6 / 2]
    head_half = v5["head_dim"] // 2
    for name, base in (("cos_cache", 1e6), ("cos_cache_local", 1e4)):  # angle of position 1, frequency 1
        assert np.isclose(tables[name][1, 1], np.cos(base ** (-1 / head_half)), atol=1e-6), name
    r = CliRunner().invoke(cli, ["verify", "parity", str(graph), "-q", "--format", "json"])
    assert r.exit_code == 0, r.output[-2500:]
    assert json.loads(r.output)["passed"]


def test_a_gguf_is_judged_by_llama_cpp_and_a_misread_is_seen(tmp_path, monkeypatch):
    """tiny (with its tokenizer) to GGUF in F32, then llama.cpp reads the file itself: our reading of it agrees; with
    the RoPE base misread from the GGUF, llama.cpp's logits are far past the F32 bound."""
    pytest.importorskip("llama_cpp")
    from llama_tools.checkpoints.gguf import tensors
    from llama_tools.exporters.verification.source_check import LLAMACPP_TOLERANCE

    path = tmp_path / "m.gguf"
    r = CliRunner().invoke(cli, ["convert", "tiny", str(path), "--to", "gguf"])
    assert r.exit_code == 0, r.output[-1500:]
    rows = [list(range(3, 200)), list(range(300, 340))]  # positions far enough that the base matters
    rep = check_source(resolve(str(path)), rows)
    assert rep.checked and rep.library.startswith("llama.cpp") and rep.passed, rep.blocks[0].checks[0].figures()
    check = rep.blocks[0].checks[0]
    assert check.kind == "F32" and check.error < LLAMACPP_TOLERANCE["F32"] / 4 and check.top1 > 0.95
    read = tensors.gguf_config
    monkeypatch.setattr(tensors, "gguf_config", lambda reader, p: read(reader, p).replace(rope_theta=1000.0))
    bad = check_source(resolve(str(path)), rows)
    assert not bad.passed and bad.blocks[0].checks[0].error > 5 * LLAMACPP_TOLERANCE["F32"]  # tiny: 9x
    assert "differs from what llama.cpp computes (the source check)" in bad.failure


def test_a_gguf_llama_cpp_cannot_load_is_said_not_judged(gemma3, tmp_path):
    pytest.importorskip("llama_cpp")
    path = tmp_path / "m.gguf"
    r = CliRunner().invoke(cli, ["convert", str(gemma3), str(path), "--to", "gguf"])  # no tokenizer: no vocabulary
    assert r.exit_code == 0, r.output[-1500:]
    rep = check_source(resolve(str(path)), _rows())
    assert not rep.checked and rep.reason.startswith(f"llama.cpp cannot load {path}")


def test_llama_cpp_dying_is_a_line_not_the_end_of_the_run(tmp_path, monkeypatch):
    """llama.cpp runs in a child process: one killed by SIGILL (a build using instructions this CPU does not run)
    is 'not checked', naming the signal and the rebuild, with nothing of ours left in the temp directory; the parent
    lives on, and `verify source` says it in one line."""
    pytest.importorskip("llama_cpp")
    import tempfile

    from llama_tools.exporters.verification import llamacpp_child

    path = tmp_path / "m.gguf"
    r = CliRunner().invoke(cli, ["convert", "tiny", str(path), "--to", "gguf"])
    assert r.exit_code == 0, r.output[-1500:]
    dies = tmp_path / "dies.sh"  # stands in for the child's interpreter: it kills itself as llama_decode did
    dies.write_text("#!/bin/sh\nkill -ILL $$\n")
    dies.chmod(0o755)
    before = set(Path(tempfile.gettempdir()).glob("*gguf-check*"))
    monkeypatch.setattr(llamacpp_child.sys, "executable", str(dies))
    rep = check_source(resolve(str(path)), [list(range(3, 40))])
    assert not rep.checked and rep.reason.startswith(f"llama.cpp died with SIGILL running {path}"), rep.reason
    assert "CMAKE_ARGS=-DGGML_NATIVE=OFF" in rep.reason
    assert set(Path(tempfile.gettempdir()).glob("*gguf-check*")) == before
    r = CliRunner().invoke(cli, ["verify", "source", str(path)])
    assert r.exit_code == 1 and "died with SIGILL" in r.output and "Traceback" not in r.output, r.output
    monkeypatch.undo()
    ok = check_source(resolve(str(path)), [list(range(3, 40))])  # the real child: llama.cpp runs and agrees
    assert ok.checked and ok.passed, ok.reason
