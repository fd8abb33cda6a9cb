"""Tokenizers that do not fit their model, or do not work, are refused before any work; late failures leave nothing.

Truth from outside our code: the tokenizers library's own view of a tokenizer.json (its largest id, what it encodes),
sentencepiece's of a tokenizer.model, the config.json's vocab_size as the file says it. Each refusal is one line
naming the files and the numbers, exit 1, no traceback, nothing written (test_hostile_inputs.refused, a real
process), and `export` refuses before torch is imported (test_fast_refusals.probe). An export that fails at a late
stage (the quantizer, int4's quality check on onnxruntime, a client file, a SIGTERM) leaves no file of its own and a
previous export there byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from llama_tools.outputs import files
from llama_tools.exporters import genai, pipeline
from llama_tools.checkpoints.tokenizer import PROBE_TEXT, Tokenizer
from llama_tools.checkpoints.tokenizer_files import sentencepiece_files
from test_fast_refusals import probe
from test_hostile import TEXTS, assert_one_line, invoke, tree
from test_hostile_inputs import refused

OUT = "out/model.onnx"  # every export writes here, under the test's working directory


def sha(root: Path) -> dict[str, str]:
    """Every file under ROOT (hidden ones too) -> sha256 of its bytes."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(tiny_hf) -> Path:
    """tiny's seeded weights as an HF checkpoint (vocab_size 512) with its sentencepiece tokenizer.model."""
    return tiny_hf


@pytest.fixture(scope="module")
def tiny_json(ckpt) -> dict[str, Any]:
    """tiny's tokenizer as tokenizer.json (512 ids, 0..511), parsed."""
    return json.loads(sentencepiece_files(ckpt / "tokenizer.model")["tokenizer.json"])


def with_tokenizer(ckpt: Path, d: Path, *, json_text: str | None = None, model: bytes | None = None,
                   config: dict[str, Any] | None = None) -> Path:
    """A copy of the checkpoint at D whose tokenizer is JSON_TEXT (tokenizer.json) or MODEL (tokenizer.model)."""
    shutil.copytree(ckpt, d)
    if json_text is not None:
        (d / "tokenizer.model").unlink()
        (d / "tokenizer.json").write_text(json_text, encoding="utf-8")
    if model is not None:
        (d / "tokenizer.model").write_bytes(model)
    if config is not None:
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    return d


def library_max_id(text: str) -> int:
    """The largest id the tokenizers library gives a token of this tokenizer.json, added tokens included."""
    return max(HFTokenizer.from_str(text).get_vocab(with_added_tokens=True).values())


def added(tokenizer: dict[str, Any], *contents: str) -> str:
    """TOKENIZER (tokenizer.json, parsed) with CONTENTS added by the library: they get the next ids."""
    from tokenizers import AddedToken

    tk = HFTokenizer.from_str(json.dumps(tokenizer))
    tk.add_tokens([AddedToken(c, normalized=False) for c in contents])
    return tk.to_str()


def export_refused_before_torch(cwd: Path, model: Path, *says: str, extra: tuple[str, ...] = ()) -> None:
    """`export onnx MODEL -o out/model.onnx` refused in a fresh process before torch, naming SAYS; nothing written."""
    before = sha(cwd)
    out = probe("export", "onnx", str(model), "-o", OUT, *extra, cwd=cwd)
    assert out["code"] == 1 and out["heavy"] == [], out
    lines = [ln for ln in out["stderr"].strip().splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and "Traceback" not in out["stderr"], out["stderr"]
    for s in says:
        assert s in lines[0], f"{s!r} not in: {lines[0]}"
    assert not (cwd / "out").exists() and sha(cwd) == before


# --- (a) ids past the model's vocab_size --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def past(ckpt, tiny_json, tmp_path_factory) -> Path:
    """The checkpoint with a tokenizer.json of 514 ids: tiny's 512 and "hi", "France" added as 512, 513."""
    text = added(tiny_json, "hi", "France")
    assert library_max_id(text) == 513  # the library's own word on the ids, not ours
    return with_tokenizer(ckpt, tmp_path_factory.mktemp("past") / "ck", json_text=text)


@pytest.mark.parametrize("argv", [
    ["generate", "{ck}", "--prompt", "hi", "--max-new-tokens", "1"],
    ["export", "onnx", "{ck}", "-o", OUT, "--quantize", "int4"],
    ["export", "onnx", "{ck}", "-o", OUT],
    ["verify", "parity", "{ck}", "--prompt", "hi", "--steps", "1"],
], ids=["generate", "export-int4", "export", "verify-parity"])
def test_a_tokenizer_with_ids_past_vocab_size_is_refused_naming_both_files(argv, past, tmp_path):
    vocab = json.loads((past / "config.json").read_text())["vocab_size"]
    assert vocab == 512
    line = refused([a.format(ck=past) for a in argv], tmp_path, str(past / "tokenizer.json"),
                   str(past / "config.json"), "go up to 513", f"vocab_size {vocab}")
    assert "--ids" not in line  # the user gave none: it used to blame them
    assert not (tmp_path / "out").exists()


def test_export_refuses_such_a_tokenizer_before_torch(past, tmp_path):
    export_refused_before_torch(tmp_path, past, "tokenizer.json", "go up to 513", "vocab_size 512",
                                extra=("--quantize", "int4"))


def test_negative_ids_that_fit_are_used_and_tokenize_shows_the_tokenizer_alone(ckpt, tiny_json, past, tmp_path):
    """The last id that fits (511) passes: the check is on the number, not on tokenizer.json; tokenize reads the
    tokenizer alone, so it shows the 514-id one as the library encodes."""
    fits = with_tokenizer(ckpt, tmp_path / "fits", json_text=json.dumps(tiny_json))
    assert library_max_id((fits / "tokenizer.json").read_text()) == 511
    r = invoke(["generate", str(fits), "--prompt", "hi", "--max-new-tokens", "1", "--format", "json", "-q"])
    assert r.exit_code == 0, r.output
    want = HFTokenizer.from_str((past / "tokenizer.json").read_text()).encode("hi", add_special_tokens=False).ids
    r = invoke(["tokenize", str(past), "hi", "--no-bos", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ids"] == want == [512], r.output


def test_a_special_id_past_the_tokenizers_own_ids_is_refused(ckpt, tiny_json, tmp_path):
    """A post-processor that adds a BOS id no token has, or a padding id past the vocabulary: named, one line."""
    post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [600], "tokens": ["<s>"]}}}
    bos = with_tokenizer(ckpt, tmp_path / "bos", json_text=json.dumps({**tiny_json, "post_processor": post}),
                         config={})
    (bos / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))  # the post-processor's BOS
    assert HFTokenizer.from_str((bos / "tokenizer.json").read_text()).encode("a").ids[0] == 600  # the library adds it
    assert_one_line(invoke(["tokenize", str(bos), "a"]), "tokenizer.json", "bos id 600", "0..511")
    padding = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 9999,
               "pad_type_id": 0, "pad_token": "<unk>"}
    pad = with_tokenizer(ckpt, tmp_path / "pad", json_text=json.dumps({**tiny_json, "padding": padding}))
    assert_one_line(invoke(["tokenize", str(pad), "a"]), "tokenizer.json", "pad id 9999")


def test_numbers_the_file_chooses_for_padding_and_truncation_are_never_applied(ckpt, tiny_json, tmp_path):
    """Fixed padding to 10**6 and truncation to 1 token: encoding is the library's with neither (as transformers
    encodes one text); the padding is never allocated."""
    padding = {"strategy": {"Fixed": 10**6}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
               "pad_type_id": 0, "pad_token": "<unk>"}
    truncation = {"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0}
    text = json.dumps({**tiny_json, "padding": padding, "truncation": truncation})
    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=text)
    lib = HFTokenizer.from_str(text)
    asked = lib.encode("The quick brown fox").ids  # what the file asks for, applied by the library
    assert len(asked) == 10**6 and asked[2:] == [0] * (10**6 - 2)  # BOS, one token, then the padding
    lib.no_padding()
    lib.no_truncation()
    want = lib.encode("The quick brown fox", add_special_tokens=False).ids
    assert len(want) > 1
    r = invoke(["tokenize", str(d), "The quick brown fox", "--no-bos", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ids"] == want, r.output


# --- (b) a tokenizer.model sentencepiece cannot load, or one no client can be given ---------------------------

def _unigram(tmp_path: Path) -> bytes:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(TEXTS), model_writer=buf, model_type="unigram",
                                   vocab_size=60, minloglevel=2, hard_vocab_limit=False)
    return buf.getvalue()


def _spm_refuses(data: bytes) -> bool:
    import sentencepiece as spm

    try:
        spm.SentencePieceProcessor().LoadFromSerializedProto(data)
    except Exception:  # noqa: BLE001  (the library's own word)
        return True
    return False


@pytest.mark.parametrize("damage, says", [
    ("truncated", "not a sentencepiece model"),
    ("zeros", "not a sentencepiece model"),
    ("empty", "not a sentencepiece model"),
], ids=lambda v: v if v in ("truncated", "zeros", "empty") else "")
def test_a_corrupt_tokenizer_model_is_refused_before_the_export_and_by_tokenize(damage, says, ckpt, tmp_path):
    good = (ckpt / "tokenizer.model").read_bytes()
    data = {"truncated": good[:300], "zeros": bytes(64), "empty": b""}[damage]
    assert _spm_refuses(data) and not _spm_refuses(good)  # sentencepiece's own verdict
    bad = with_tokenizer(ckpt, tmp_path / "in" / "ck", model=data)
    work = tmp_path / "work"
    work.mkdir()
    export_refused_before_torch(work, bad, str(bad / "tokenizer.model"), says, extra=("--quantize", "int4"))
    export_refused_before_torch(work, bad, str(bad / "tokenizer.model"), says)
    assert_one_line(invoke(["tokenize", str(bad), "hi"]), str(bad / "tokenizer.model"), says)


def test_a_tokenizer_model_clients_cannot_get_is_refused_before_the_export(ckpt, tmp_path):
    """A unigram model (sentencepiece reads it; it has no tokenizer.json form here), and a BPE model whose <s> is not
    config.json's bos_token_id: refused before any work, not after the graph is written."""
    uni = with_tokenizer(ckpt, tmp_path / "uni", model=_unigram(tmp_path))
    assert not _spm_refuses((uni / "tokenizer.model").read_bytes())
    work = tmp_path / "work"
    work.mkdir()
    export_refused_before_torch(work, uni, "tokenizer.model", "UNIGRAM model; only BPE")
    other = with_tokenizer(ckpt, tmp_path / "bos", config={"bos_token_id": 7})
    export_refused_before_torch(work, other, "tokenizer.model", "<s> is id 1", "bos_token_id = 7")
    r = invoke(["export", "onnx", str(uni), "-o", str(work / OUT), "--no-client-files", "--optimize"])
    assert r.exit_code == 0, r.output  # negative: without client files the tokenizer is not the export's input
    assert sorted(p.name for p in (work / "out").iterdir()) == ["model.onnx"]


# --- (c) tokenizer.json files the library reads but that cannot encode text ----------------------------------

def _bpe(vocab: dict[str, int], merges: list[str], **model: Any) -> dict[str, Any]:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": merges, **model}}


UNUSABLE = {
    "empty BPE vocabulary": (_bpe({}, []), "to no tokens"),
    "no piece matches text": (_bpe({"x": 0, "y": 1, "xy": 2}, ["x y"]), "to no tokens"),
    "empty unigram": ({**_bpe({}, []), "model": {"type": "Unigram", "unk_id": None, "vocab": []}},
                      "cannot encode text"),
}


@pytest.mark.parametrize("name", list(UNUSABLE))
def test_a_tokenizer_json_that_cannot_encode_text_is_refused(name, ckpt, tmp_path):
    tokenizer, says = UNUSABLE[name]
    text = json.dumps(tokenizer)
    try:  # the library loads it, and encodes ordinary text to nothing (or fails to)
        ids = HFTokenizer.from_str(text).encode(PROBE_TEXT).ids
    except Exception:  # noqa: BLE001
        ids = None
    assert not ids
    d = with_tokenizer(ckpt, tmp_path / "in" / "ck", json_text=text)
    assert_one_line(invoke(["tokenize", str(d), "hi"]), str(d / "tokenizer.json"), says)
    work = tmp_path / "work"
    work.mkdir()
    export_refused_before_torch(work, d, str(d / "tokenizer.json"), says)


def test_a_tokenizer_json_the_library_cannot_read_is_named(ckpt, tiny_json, tmp_path):
    """Cut short, a merge of an unknown piece, and bytes that are not UTF-8: each one line naming the file."""
    full = json.dumps(tiny_json)
    broken = {**tiny_json, "model": {**tiny_json["model"], "merges": [["▁t", "zzz"]] + tiny_json["model"]["merges"]}}
    for i, (text, says) in enumerate([(full[: len(full) // 2], "not a tokenizer.json that the tokenizers library"),
                                      (json.dumps(broken), "zzz"), (None, "not UTF-8 text")]):
        d = with_tokenizer(ckpt, tmp_path / f"ck{i}", json_text=text or full)
        if text is None:
            (d / "tokenizer.json").write_bytes(b'{"a": "\xff"}')
        assert_one_line(invoke(["tokenize", str(d), "hi"]), str(d / "tokenizer.json"), says)
    with pytest.raises(ValueError, match="zzz"):  # the library's own refusal, which ours names
        Tokenizer(tmp_path / "ck1" / "tokenizer.json")
    with pytest.raises(Exception, match="zzz"):
        HFTokenizer.from_str(json.dumps(broken))


# --- Late failures leave nothing: the graph, client files and a previous export as they were ----------------------

@pytest.fixture(scope="module")
def previous(ckpt, tmp_path_factory) -> Path:
    """A finished export of the checkpoint (fused, with client files): what a failing re-export must leave as is."""
    d = tmp_path_factory.mktemp("previous")
    r = invoke(["export", "onnx", str(ckpt), "-o", str(d / OUT), "--optimize"])
    assert r.exit_code == 0, r.output
    assert {"model.onnx", "config.json", "genai_config.json", "tokenizer.json"} <= set(os.listdir(d / "out"))
    return d / "out"


def _fail_quantizer(monkeypatch: pytest.MonkeyPatch, ck: Path) -> None:
    real = pipeline.quantize_int4

    def quantize_then_fail(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # its graph is written
        raise RuntimeError("simulated quantizer failure")

    monkeypatch.setattr(pipeline, "quantize_int4", quantize_then_fail)


def _onnxruntime_fails(monkeypatch: pytest.MonkeyPatch, ck: Path) -> None:
    """int4's quality check fed an id past the vocabulary: onnxruntime's own Gather error, as issue (a) saw."""
    real = pipeline.quick_quality
    monkeypatch.setattr(pipeline, "quick_quality", lambda full, int4, cfg, ids, on: real(full, int4, cfg, [1, 600], on))


def _tokenizer_vanishes(monkeypatch: pytest.MonkeyPatch, ck: Path) -> None:
    """The source's tokenizer.model removed while the graph is written: the client files fail after it."""
    real = pipeline.export_fused

    def export_then_remove(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        (ck / "tokenizer.model").unlink()
        return result

    monkeypatch.setattr(pipeline, "export_fused", export_then_remove)


def _sigterm_in_quality(monkeypatch: pytest.MonkeyPatch, ck: Path) -> None:
    """SIGTERM while int4's quality check runs, after the graph and int4 are written."""
    def kill(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the SIGTERM handler did not run")

    monkeypatch.setattr(pipeline, "quick_quality", kill)


LATE = {"quantizer": (_fail_quantizer, True, 1), "onnxruntime": (_onnxruntime_fails, True, 1),
        "client files": (_tokenizer_vanishes, False, 1), "SIGTERM": (_sigterm_in_quality, True, 128 + signal.SIGTERM)}


@pytest.mark.parametrize("over_previous", [False, True], ids=["fresh", "over-a-previous-export"])
@pytest.mark.parametrize("stage", list(LATE))
def test_an_export_failing_at_a_late_stage_leaves_nothing(stage, over_previous, ckpt, previous, tmp_path,
                                                           monkeypatch):
    fail, int4, code = LATE[stage]
    ck = tmp_path / "ck"
    shutil.copytree(ckpt, ck)
    out = tmp_path / "out"
    if over_previous:
        shutil.copytree(previous, out)
    before = sha(tmp_path / "out") if over_previous else None
    fail(monkeypatch, ck)
    with files.cleanup_on_signals():  # as main() runs every command: a SIGTERM is handled, never kills pytest
        r = invoke(["export", "onnx", str(ck), "-o", str(out / "model.onnx"),
                    *(["--quantize", "int4"] if int4 else ["--optimize"])])
    assert r.exit_code == code, r.output
    if stage == "client files":  # a real refusal: one line naming the file that went
        assert_one_line(r, "tokenizer.model")
    if over_previous:
        assert sha(out) == before  # the previous export byte for byte, nothing of this run's beside it
    else:
        assert not out.exists(), tree(tmp_path)  # not even the directory the export made


def test_negative_the_same_export_without_a_failure_writes_its_files(ckpt, tmp_path):
    r = invoke(["export", "onnx", str(ckpt), "-o", str(tmp_path / OUT), "--quantize", "int4"])
    assert r.exit_code == 0, r.output
    assert {"model.onnx", "config.json", "genai_config.json", "tokenizer.json"} <= set(os.listdir(tmp_path / "out"))


def test_write_client_files_writes_all_of_them_or_none(ckpt, previous, tmp_path):
    """Beside a graph, a tokenizer that cannot be made for clients (unigram) fails before any client file is written:
    it used to leave config.json, generation_config.json and genai_config.json behind."""
    d = tmp_path / "onnx"
    d.mkdir()
    shutil.copyfile(previous / "model.onnx", d / "model.onnx")
    uni = tmp_path / "uni"
    uni.mkdir()
    (uni / "tokenizer.model").write_bytes(_unigram(tmp_path))
    with pytest.raises(ValueError, match="UNIGRAM model; only BPE"):
        genai.write_client_files(d / "model.onnx", tokenizer_dir=uni)
    assert os.listdir(d) == ["model.onnx"]
    written = genai.write_client_files(d / "model.onnx", tokenizer_dir=ckpt)  # negative: a usable one writes them
    assert {p.name for p in written.written} <= set(os.listdir(d)) and len(os.listdir(d)) > 5


def test_a_convert_failing_at_its_last_step_leaves_nothing(ckpt, tmp_path, monkeypatch):
    """The tokenizer files are copied last, inside the atomic directory: an I/O error there leaves no DST, nor the
    parents convert made for it."""
    from llama_tools.checkpoints import convert

    def broken_copy(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error", str(src))

    monkeypatch.setattr(convert.shutil, "copyfile", broken_copy)
    r = invoke(["convert", str(ckpt), str(tmp_path / "a" / "b" / "dst"), "--to", "hf"])
    assert_one_line(r, "Input/output error")
    assert tree(tmp_path) == []
    monkeypatch.undo()
    assert invoke(["convert", str(ckpt), str(tmp_path / "a" / "b" / "dst"), "--to", "hf"]).exit_code == 0
    assert (tmp_path / "a" / "b" / "dst" / "tokenizer.model").is_file()  # negative: the copy is a step it takes


# --- (d) What a tokenizer.json makes the library run: bounded in time and memory, its panic text never shown -------
# The tokenizers library runs a tokenizer.json in a worker process (outputs.bounded.Worker): each case is one line
# naming the file and the key, exit 1, in a real process (a Rust panic writes to fd 2 itself), its peak memory (the
# worker's included: wait4) under 1 GiB whatever the file holds within the 512 MB file limit.

SLOW = r"(?:.*){3}\d"  # on a line without a digit: O(n^4) steps, each search under onig's retry limit (2 s a line)
GIVES_UP = r"(?:.*){5}\d"  # past onig's retry limit on the first line: the library panics
LINE = ("The river had been rising for three days, and by the fourth morning the old bridge was gone. People from the "
        "village gathered on the bank to watch the brown water carry branches, fence posts and a lost boat downstream.")
GIB = 1 << 30


def with_split(tiny_json: dict[str, Any], pattern: str) -> str:
    """tiny's tokenizer.json whose pre-tokenizer is a Sequence holding one Split on PATTERN."""
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return json.dumps({**tiny_json, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split]}})


# Forks the CLI from a fresh, small interpreter and writes its peak RSS (kB) to the pipe whose fd LLAMA_TOOLS_PEAK_FD
# names. Linux records the peak of the memory a process had before exec as its own: the CLI forked straight from a
# test worker that has grown to gigabytes would report the worker's size, not its own.
LAUNCH = """
import os, sys
fd = int(os.environ["LLAMA_TOOLS_PEAK_FD"])
pid = os.fork()
if pid == 0:
    os.close(fd)
    os.execv(sys.executable, [sys.executable, "-c", "from llama_tools.cli import main; main()", *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
os.write(fd, str(usage.ru_maxrss).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measured(args: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str, float, int]:
    """The CLI in a real process: exit code, stderr, wall seconds, and peak RSS in bytes of it or any child it waited
    for (os.wait4's ru_maxrss, taken by LAUNCH)."""
    import signal
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    read, write = os.pipe()
    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", LAUNCH, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                             stdin=subprocess.DEVNULL, pass_fds=(write,), start_new_session=True,
                             env={**os.environ, "LLAMA_TOOLS_PEAK_FD": str(write)})
        os.close(write)
        timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
        timer.start()
        try:
            code = p.wait()
        finally:
            timer.cancel()
        with os.fdopen(read, "rb") as f:
            peak = f.read()
        err.seek(0)
        return code, err.read().decode(errors="replace"), time.monotonic() - start, int(peak or 0) * 1024


def one_line(code: int, stderr: str, *says: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr and "panicked" not in stderr, (code, stderr)
    for s in says:
        assert s in lines[0], f"{s!r} not in: {lines[0]}"
    return lines[0]


def test_a_pattern_that_backtracks_is_refused_in_bounded_time_naming_its_key(ckpt, tiny_json, tmp_path):
    """Eight lines of prose through SLOW take the library about 20 s here in-process (each search under onig's retry
    limit, so nothing stops it); the worker's encode is stopped at its bound and the pattern's key is named."""
    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=with_split(tiny_json, SLOW))
    code, err, took, peak = measured(["tokenize", str(d), "\n".join([LINE] * 8)], tmp_path)
    one_line(code, err, str(d / "tokenizer.json"), "pre_tokenizer.pretokenizers[0].pattern", "ran past")
    assert took < 15, took
    tok = Tokenizer(d / "tokenizer.json")  # the Python API: the same refusal, and the tokenizer still works after it
    with pytest.raises(ValueError, match=r"pre_tokenizer\.pretokenizers\[0\]\.pattern .* ran past"):
        tok.encode("\n".join([LINE] * 8))
    assert tok.encode("abc") == HFTokenizer.from_str(with_split(tiny_json, SLOW)).encode("abc").ids  # BOS both


def test_a_pattern_the_regex_engine_gives_up_on_is_refused_without_its_panic_text(ckpt, tiny_json, tmp_path):
    """Past onig's retry limit the library panics, and Rust writes three lines to fd 2 before our refusal: kept off."""
    text = with_split(tiny_json, GIVES_UP)
    with pytest.raises(BaseException, match="retry-limit"):  # the library's own word: a panic (pyo3's PanicException)
        HFTokenizer.from_str(text).encode(LINE)
    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=text)
    code, err, took, peak = measured(["tokenize", str(d), LINE], tmp_path)
    one_line(code, err, str(d / "tokenizer.json"), "pre_tokenizer.pretokenizers[0].pattern", "gave up")
    assert took < 30, took


def test_a_huge_special_token_is_refused_in_bounded_time_and_memory(ckpt, tiny_json, tmp_path):
    """One added token of 10^6 characters: the library's time to read one grows with its length squared (10^4: 1 s,
    10^5: 67 s here; 3 * 10^7 took 1.7 GB and had not finished after 15 minutes)."""
    def with_token(content: str) -> str:  # written here: the library's own add_tokens takes as long as reading it
        token = {"id": 512, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": False}
        return json.dumps({**tiny_json, "added_tokens": tiny_json["added_tokens"] + [token]})

    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=with_token("x" * 10**6))
    code, err, took, peak = measured(["tokenize", str(d), "hi"], tmp_path, timeout=60)
    at = len(tiny_json["added_tokens"])  # its key, as the file has it
    one_line(code, err, str(d / "tokenizer.json"), f"added_tokens[{at}].content is 1,000,000 characters")
    assert took < 30 and peak < GIB, (took, peak)
    ok = with_tokenizer(ckpt, tmp_path / "ok", json_text=with_token("x" * 4096))  # negative: at the bound
    assert Tokenizer(ok / "tokenizer.json").encode("x" * 4096, bos=False) == [512]


def test_a_vocabulary_of_millions_is_refused_within_the_memory_bound(ckpt, tmp_path):
    """A WordLevel vocabulary of 5 * 10^6 entries (100 MB, within the file limit): about 250 bytes an entry in the
    library (2.5 GB for 10^7)."""
    n = 5_000_000
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": {"[UNK]": 0}}}
    head, tail = json.dumps(doc).rsplit('"[UNK]": 0', 1)
    text = head + '"[UNK]": 0, ' + ", ".join(f'"w{i:08d}": {i + 1}' for i in range(n)) + tail
    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=text)
    code, err, took, peak = measured(["tokenize", str(d), "hi"], tmp_path)
    one_line(code, err, str(d / "tokenizer.json"), "MiB")
    assert peak < GIB, peak


def test_negative_a_linear_pattern_encodes_as_the_library_does(ckpt, tiny_json, tmp_path):
    """Llama 3's own split (a Split in a Sequence, as its tokenizer.json has it) is used, ids as the library's."""
    from llama_tools.checkpoints.tokenizer_files import LLAMA3_SPLIT

    text = with_split(tiny_json, LLAMA3_SPLIT)
    d = with_tokenizer(ckpt, tmp_path / "ck", json_text=text)
    long = "\n".join([LINE] * 200)  # 44 k characters
    theirs = HFTokenizer.from_str(text).encode(long, add_special_tokens=False).ids
    assert Tokenizer(d / "tokenizer.json").encode(long, bos=False) == theirs
    r = invoke(["tokenize", str(d), LINE, "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["text"] == LINE


def test_a_tokenizer_json_past_what_the_worker_holds_is_refused_by_its_size(ckpt, tmp_path):
    """129 MB (a sparse file): within source_files' 512 MB, past MAX_TOKENIZER_JSON_BYTES; refused before any read
    of it by the library (the worker would hold its text twice beside the library's own memory)."""
    from llama_tools.checkpoints.tokenizer import MAX_TOKENIZER_JSON_BYTES

    d = with_tokenizer(ckpt, tmp_path / "ck", json_text="")
    with open(d / "tokenizer.json", "wb") as f:
        f.truncate(MAX_TOKENIZER_JSON_BYTES + (1 << 20))
    code, err, took, peak = measured(["tokenize", str(d), "hi"], tmp_path)
    one_line(code, err, str(d / "tokenizer.json"), f"over {MAX_TOKENIZER_JSON_BYTES:,} bytes")
    assert peak < GIB, peak
