"""Issue 18 as tests: hostile headers, archives, indexes, special files, sizes and config types, through the CLI.

Each case runs the installed entry point in a real process (a traceback would show, a hang would time out):
exit 1, exactly one stderr line naming the file, field or option, no "Traceback", within a bounded time,
and the inputs unchanged (checked by hash). Where the safetensors library is the truth, it is asked too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.modeling.presets import get_preset

TINY = get_preset("tiny")
EXE = [sys.executable, "-c", "from llama_tools.cli import main; main()"]


def run(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(EXE + args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def refused(args: list[str], cwd: Path, *names: str, seconds: float = 30) -> str:
    """Exit 1, one stderr line naming every `names`, no traceback, in bounded time, nothing of cwd changed."""
    before = digest(cwd)
    start = time.monotonic()
    r = run(args, cwd, timeout=seconds + 30)
    took = time.monotonic() - start
    # export's "note: ... seeded random weights" line comes before the model is sized; the refusal is the Error line.
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("note: ")]
    assert r.returncode == 1, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for n in names:
        assert n in lines[0], f"{n!r} not in: {lines[0]}"
    assert took < seconds, f"took {took:.1f} s: {lines[0]}"
    assert digest(cwd) == before, "an input changed"
    return lines[0]


def write_st(path: Path, header: dict | bytes, data: bytes = b"", n: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


def library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:  # noqa: BLE001  (the library's own error types)
        return True
    return False


@pytest.fixture(scope="module")
def ckpt(tiny_hf) -> Path:
    return tiny_hf


@pytest.fixture
def case(tmp_path, ckpt) -> Path:
    """A fresh copy of the checkpoint to damage."""
    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    for extra in d.iterdir():  # only the config and the weights: the cases are about these
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    return d


# --- safetensors headers: each refused by the library too ----------------------------------------

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
HEADERS = {
    "overlap": ({"a": F32_1, "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, 8, "overlaps"),
    "reversed": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, 4, "data_offsets"),
    "negative shape": ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "shape"),
    "float shape": ({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, 4, "integer"),
    "object shape": ({"a": {"dtype": "F32", "shape": {"x": 1}, "data_offsets": [0, 4]}}, 4, "shape"),
    "bool shape": ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "shape"),
    "product disagrees": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}, 4, "needs 12"),
    "metadata not str->str": ({"__metadata__": {"format": 1}, "a": F32_1}, 4, "__metadata__"),
    "unknown dtype": ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, 4, "dtype"),
    "gap": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "gap"),
    "trailing bytes": ({"a": F32_1}, 12, "no tensor covers"),
    "overflowing product": ({"a": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, 0,
                            "overflows"),
}


@pytest.mark.parametrize("name", list(HEADERS))
def test_a_header_the_library_rejects_is_refused_naming_the_file(name, case):
    header, data, word = HEADERS[name]
    st = write_st(case / "model.safetensors", header, bytes(data))
    assert library_refuses(st), "the case must be one the safetensors library itself refuses"
    refused(["count-params", str(case)], case.parent, "model.safetensors", word)


@pytest.mark.parametrize("raw, word", [
    (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 10_000 + b'], "data_offsets": [0, 4]}}', "digits"),
    (b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', "integer"),
    (b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', "integer"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
    (b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}", "entry"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', "twice"),
    (b"\xff\xfe{}", "UTF-8"),
])
def test_json_that_is_slow_deep_or_odd_is_refused_fast(raw, word, case):
    write_st(case / "model.safetensors", raw, bytes(4))
    refused(["count-params", str(case)], case.parent, "model.safetensors", word, seconds=10)


def test_a_header_length_past_the_librarys_cap_is_refused(case):
    write_st(case / "model.safetensors", b"{}", n=100_000_001)
    refused(["count-params", str(case)], case.parent, "model.safetensors", "100000000")


def test_negative_a_valid_header_is_still_counted(case):
    """The check can pass: the untouched checkpoint counts, exit 0 (so the refusals above are about the damage)."""
    r = run(["count-params", str(case)], case.parent)
    assert r.returncode == 0 and "matches config" in r.stdout, r.stderr


# --- special files, indexes, archives --------------------------------------------------------------

def test_a_fifo_as_the_weight_file_is_refused_without_blocking(case):
    (case / "model.safetensors").unlink()
    os.mkfifo(case / "model.safetensors")
    refused(["count-params", str(case)], case.parent, "model.safetensors", "FIFO", seconds=10)


def test_a_fifo_as_the_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    refused(["count-params", str(tmp_path / "config.json")], tmp_path, "config.json", "regular file", seconds=10)


@pytest.mark.parametrize("shard, word", [("../../etc/passwd", "plain file names"), ("/etc/passwd", "plain file names"),
                                         ("escape.safetensors", "outside")])
def test_an_index_may_only_name_files_in_its_directory(shard, word, case):
    (case / "escape.safetensors").symlink_to("/etc/passwd")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (case / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(["count-params", str(case)], case.parent, "model.safetensors.index.json", word)
    assert "root:" not in line  # nothing of the named file is echoed


def test_a_pth_zip_bomb_is_refused_before_inflating(tmp_path):
    """6 GB of zeros declared by a ~6 MB deflated entry: refused from the zip directory alone, RSS stays small."""
    d = tmp_path / "meta"
    d.mkdir()
    (d / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512}))
    with zipfile.ZipFile(d / "consolidated.00.pth", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        with zf.open("archive/data/0", "w", force_zip64=True) as f:
            chunk = bytes(2**24)
            for _ in range(64):  # 1 GiB is enough to show the ratio rule (a 6 GB one takes the same path)
                f.write(chunk)
    refused(["count-params", str(d)], tmp_path, "consolidated.00.pth", "zip bomb", seconds=10)


# --- config values typed strictly --------------------------------------------------------------------

def hf_config(tmp_path: Path, **changes) -> Path:
    cfg = {**config_to_hf(TINY), **changes}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("changes, field", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"model_type": ["llama"], "architectures": None}, "model_type"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ({"sliding_window": "4096"}, "sliding_window"),
    ({"sliding_window": -5}, "sliding_window"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"head_dim": -16}, "head_dim"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_scaling": [8.0]}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "high_freq_factor"),
    ({"rope_scaling": {"rope_type": 3}}, "rope_scaling.rope_type"),
    ({"max_position_embeddings": 10**30}, "max_position_embeddings"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"torch_dtype": ["float16"]}, "torch_dtype"),
])
def test_a_config_field_of_the_wrong_type_or_range_is_one_line_naming_it(changes, field, tmp_path):
    p = hf_config(tmp_path, **changes)
    refused(["count-params", str(p)], tmp_path, "config.json", field, seconds=15)


def test_negative_the_right_types_count_and_tie_changes_the_total(tmp_path):
    """JSON false and true are read as such: the tied total is the untied one less n1 x n2 (exact, by hand)."""
    totals = {}
    for tie in (False, True):
        p = hf_config(tmp_path, tie_word_embeddings=tie)
        r = run(["count-params", str(p), "--format", "json"], tmp_path)
        assert r.returncode == 0, r.stderr
        totals[tie] = json.loads(r.stdout)[0]["total"]
    assert totals[False] - totals[True] == TINY.vocab_size * TINY.hidden_size


def test_meta_params_of_the_wrong_type_are_one_line(tmp_path):
    p = tmp_path / "params.json"
    p.write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "use_scaled_rope": "no"}))
    refused(["count-params", str(p)], tmp_path, "params.json", "use_scaled_rope")


@pytest.mark.parametrize("option", [["--seed", "99999999999999999999"], ["--seed", "-1"], ["--seed", "1.5"]])
def test_an_odd_seed_is_one_line_naming_it(option, tmp_path):
    refused(["generate", "tiny", "--ids", "1 2", "--max-new-tokens", "1", *option], tmp_path, "--seed")


# --- sizes checked before they are allocated ------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["generate", "./config.json", "--ids", "1 2", "--max-new-tokens", "1"],
    ["convert", "./config.json", "out", "--to", "hf"],
    ["export", "onnx", "./config.json", "-o", "out.onnx", "-q"],
])
@pytest.mark.parametrize("changes, word", [({"num_hidden_layers": 10**8}, "bytes"),
                                           ({"max_position_embeddings": 10**12}, "RoPE tables")])
def test_a_size_no_machine_holds_is_refused_at_once_with_the_figure(argv, changes, word, tmp_path):
    hf_config(tmp_path, **changes)
    line = refused(argv, tmp_path, "bytes", seconds=30)
    assert word in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.onnx").exists()


def test_the_issues_long_context_is_refused_against_the_memory_available(monkeypatch):
    """max_position_embeddings 10^9 (64 GB of RoPE tables): refused against 16 GiB available, before any tensor."""
    from llama_tools.modeling.memory import check_memory, generation_need, rope_table_bytes

    cfg = TINY.replace(max_position_embeddings=10**9)
    need = generation_need(cfg, 2, 1, "float32")
    assert dict(need.items)["RoPE tables"] == rope_table_bytes(cfg) == 32 * 10**9 * (TINY.head_dim // 2)
    with pytest.raises(ValueError, match="RoPE tables") as e:
        check_memory(need, cfg, available=16 * 2**30)
    assert f"{need.total:,}" in str(e.value)
    check_memory(generation_need(TINY, 2, 1, "float32"), TINY, available=16 * 2**30)  # negative: tiny fits


def test_byte_figures_are_exact_integers():
    """int4 bytes of a 10^18-wide model and Meta's n7 of a 10^18 dim, against integer arithmetic by hand."""
    from llama_tools.counting.accounting import count_params
    from llama_tools.checkpoints.config_files import ffn_hidden_size

    wide = TINY.replace(hidden_size=10**18, intermediate_size=10**18, num_attention_heads=1, num_key_value_heads=1,
                        head_dim=10**18)
    c = count_params(wide, context=1)
    int4 = next(m for m in c.memory if m.dtype == "int4").weight_bytes
    assert int4 == (c.total * 4 + 7) // 8 and isinstance(int4, int)
    assert int4 != round(c.total * 0.5)  # negative: the float route is wrong at this size
    assert ffn_hidden_size(10**18, 256, None) == -(-(8 * 10**18 // 3) // 256) * 256
