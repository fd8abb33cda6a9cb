"""Issue 21 as tests, the weight and config readers' part of the second hostile round, case by case.

- A symlink loop (or a dangling link) given as a weight file, a config or an index's shard: one line naming it.
- A torch zip whose data.pkl asks for exponential work (a tuple shared 2^80 times over, as a shape or a dict key),
  holds a number with thousands of digits, strides past int64 (torch.load raised TypeError, a traceback), a storage
  larger than its record, or an opcode torch.save never writes: one line, at once.
- A config number past its bound (config.SIZE_LIMITS: experts, layers, widths, heads, context, windows, rope
  factors, a per-layer list; for an architecture transformers builds, its layers, experts and heads): one line
  naming the file and field, before anything is allocated or imported; at the bound, read. Real giants still count,
  exactly and at once: Llama 3.1 405B and a 65,536-expert Mixtral by hand, DeepSeek-V3 through transformers.
Every CLI refusal is checked as the other hostile suites do: exit 1, one stderr line naming the file and field,
no traceback, nothing written (test_hostile.assert_one_line in-process, test_hostile_inputs.refused in a real one).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from llama_tools.counting.accounting import count_params
from llama_tools.cli import cli
from llama_tools.modeling.config import SIZE_LIMITS
from llama_tools.checkpoints.config_files import config_to_hf, load_config
from llama_tools.checkpoints.convert import meta_params
from llama_tools.checkpoints.header_readers import HeaderError
from llama_tools.checkpoints.torch_headers import read_torch_header
from llama_tools.modeling.presets import get_preset
from test_bounded import closed_form
from test_fast_refusals import probe
from test_fuzz_headers import _enc_int, with_pkl
from test_hostile import assert_one_line
from test_hostile_inputs import refused

TINY = get_preset("tiny")


def cli_refuses(argv: list[str], cwd: Path, *names: str) -> str:
    """count-params (or any command) in-process: one line naming `names`, and cwd's listing unchanged."""
    before = sorted(p.relative_to(cwd).as_posix() for p in cwd.rglob("*"))
    line = assert_one_line(CliRunner().invoke(cli, argv), *names)
    assert sorted(p.relative_to(cwd).as_posix() for p in cwd.rglob("*")) == before, "something was written"
    return line


def copy_without(src: Path, dst: Path, *drop: str) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in drop and f.suffix in (".json", ".safetensors", ".pth"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- symlink loops and dangling links as inputs ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["count-params", "report shapes", "generate", "convert"])
def test_a_weight_file_linked_to_itself_is_one_line(command, tiny_hf, tmp_path):
    d = copy_without(tiny_hf, tmp_path / "ck", "model.safetensors")
    (d / "model.safetensors").symlink_to("model.safetensors")
    argv = {"count-params": ["count-params", str(d)], "report shapes": ["report", "shapes", str(d)],
            "generate": ["generate", str(d), "--ids", "1 2"],
            "convert": ["convert", str(d), str(tmp_path / "out"), "--to", "hf"]}[command]
    cli_refuses(argv, tmp_path, "model.safetensors", "symbolic link loop")


def test_a_two_link_loop_is_one_line_in_a_real_process(tiny_hf, tmp_path):
    """x.safetensors -> y -> x.safetensors: no traceback from the installed entry point (Path.resolve raised one)."""
    d = copy_without(tiny_hf, tmp_path / "ck", "model.safetensors")
    (d / "model-00001-of-00001.safetensors").symlink_to("y")
    (d / "y").symlink_to("model-00001-of-00001.safetensors")
    refused(["count-params", str(d)], tmp_path, "model-00001-of-00001.safetensors", "symbolic link loop", seconds=20)


@pytest.mark.parametrize("what", ["config.json", "shard", "index"])
def test_a_loop_or_dangling_link_anywhere_in_a_checkpoint_is_named(what, tiny_hf, tmp_path):
    d = copy_without(tiny_hf, tmp_path / "ck", "config.json" if what == "config.json" else "")
    if what == "config.json":
        (d / "config.json").symlink_to("config.json")
        cli_refuses(["count-params", str(d)], tmp_path, "config.json", "symbolic link loop")
    elif what == "shard":
        (d / "model.safetensors").unlink()
        (d / "model.safetensors").symlink_to("gone.safetensors")
        cli_refuses(["count-params", str(d)], tmp_path, "model.safetensors")
    else:
        (d / "model.safetensors.index.json").symlink_to("model.safetensors.index.json")
        cli_refuses(["count-params", str(d)], tmp_path, "model.safetensors.index.json", "symbolic link loop")


def test_a_meta_shard_linked_to_itself_and_a_config_file_given_as_a_loop(tiny_meta, tmp_path):
    d = copy_without(tiny_meta, tmp_path / "ck", "consolidated.00.pth")
    (d / "consolidated.00.pth").symlink_to("consolidated.00.pth")
    cli_refuses(["count-params", str(d)], tmp_path, "consolidated.00.pth", "symbolic link loop")
    (tmp_path / "loop.json").symlink_to("loop.json")
    cli_refuses(["count-params", str(tmp_path / "loop.json")], tmp_path, "loop.json")


def test_negative_a_real_link_still_counts(tiny_hf, tmp_path):
    """A weight file that is a symlink to its blob (the hub cache's layout) counts: links are followed, loops not."""
    snap, blobs = tmp_path / "models--x" / "snapshots" / "abc", tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1234").write_bytes((tiny_hf / "model.safetensors").read_bytes())
    (snap / "model.safetensors").symlink_to("../../blobs/1234")
    (snap / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    r = CliRunner().invoke(cli, ["count-params", str(snap), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["total"] == closed_form(TINY)


# --- torch zips: exponential pickles, huge numbers, strides, storages, opcodes ------------------------------------

def _u(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def tensor_pkl(shape: bytes, stride: bytes | None = None, numel: int = 6, key: bytes | None = None,
               prelude: bytes = b"") -> bytes:
    """data.pkl of {key or 'w': a FloatStorage tensor}, shape and stride given as pickle opcodes (a tuple each)."""
    stride = stride if stride is not None else b"K\x01\x85"
    return (b"\x80\x02" + prelude + b"}(" + (key or _u("w")) + b"ctorch._utils\n_rebuild_tensor_v2\n("
            + b"(" + _u("storage") + b"ctorch\nFloatStorage\n" + _u("0") + _u("cpu") + _enc_int(numel) + b"tQ"
            + b"K\x00" + shape + stride + b"\x89ccollections\nOrderedDict\n)RtRu.")


def torch_zip(path: Path, pkl: bytes, storage: int = 24) -> Path:
    """A torch zip as torch.save lays it out: data.pkl, byteorder, version and one storage record of `storage` bytes."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", bytes(storage))
        zf.writestr("archive/version", "3")
    return path


def shared_tuple(depth: int, slot: int = 200) -> bytes:
    """Opcodes leaving t_depth on the stack, t_k = (t_(k-1), t_(k-1)) through the memo: 2^depth leaves, 5*depth bytes."""
    out = b")q" + bytes([slot]) + b"0"
    for _ in range(depth):
        out += b"h" + bytes([slot]) + b"h" + bytes([slot]) + b"\x86q" + bytes([slot]) + b"0"
    return out + b"h" + bytes([slot])


def read_refused(path: Path, *words: str, seconds: float = 2.0) -> str:
    """read_torch_header refuses path in one line naming it and `words`, within seconds and 8 MB traced."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(HeaderError) as e:
            read_torch_header(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    took = time.perf_counter() - start
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg and len(msg) < 500, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg}"
    assert took < seconds and peak < 8 * 2**20, (took, peak)
    return msg


def test_the_stand_in_zip_is_a_torch_file(tmp_path):
    """The hand-written data.pkl is one torch.load reads: the cases below differ from a real file by their damage."""
    path = torch_zip(tmp_path / "ok.pth", tensor_pkl(b"K\x02K\x03\x86", b"K\x03K\x01\x86"))
    assert [(t.name, t.shape, t.dtype) for t in read_torch_header(path)] == [("w", (2, 3), "float32")]
    assert tuple(torch.load(path, weights_only=True)["w"].shape) == (2, 3)


@pytest.mark.parametrize("case, pkl, words", [
    ("shape shared 2^80 times", tensor_pkl(b"(" + shared_tuple(80) + b"K\x03t"), ["shape", "..."]),
    ("dict key shared 2^80 times", tensor_pkl(b"K\x06\x85", key=shared_tuple(80)), ["keys are strings"]),
    ("a 10^4-byte integer as a dimension",  # 9,999 bytes of 0x01 below a top byte of 0x01: 8 x 9,999 + 1 bits
     tensor_pkl(b"\x8b" + struct.pack("<i", 10**4) + b"\x01" * 10**4 + b"\x85"), ["an integer of 79993 bits"]),
    ("a dimension of 2^64", tensor_pkl(_enc_int(2**64) + b"\x85"), ["shape (18446744073709551616)"]),
    ("a stride past int64", tensor_pkl(b"K\x02K\x03\x86", _enc_int(2**63) + b"K\x01\x86"), ["strides"]),
    ("a stride past the storage", tensor_pkl(b"K\x02K\x03\x86", _enc_int(2**40) + b"K\x01\x86"),
     ["reaches element 1,099,511,627,779 of a storage of 6"]),
    ("a storage larger than its record", tensor_pkl(b"K\x06\x85", numel=2**40), ["truncated", "4398046511104"]),
    ("DUP, which torch.save never writes", tensor_pkl(b"K\x062\x86"), ["opcode DUP"]),
    ("a float", tensor_pkl(b"G" + struct.pack(">d", 6.0) + b"\x85"), ["opcode BINFLOAT"]),
    ("BUILD on a storage type", b"\x80\x02ctorch\nFloatStorage\n}b.", ["BUILD"]),
    ("OrderedDict given items to hash", b"\x80\x02ccollections\nOrderedDict\n" + shared_tuple(80)
     + b"K\x01\x86\x85\x85R.", ["OrderedDict"]),
])
def test_a_hostile_data_pkl_is_one_line_at_once(case, pkl, words, tmp_path):
    read_refused(torch_zip(tmp_path / "consolidated.00.pth", pkl), *words)


def test_negative_the_shared_tuple_is_really_exponential():
    """What the reader never does: str() of the 2^80-leaf tuple. At depth 16 it is already 65,536 leaves long."""
    t = pickle.loads(b"\x80\x02" + shared_tuple(16) + b".")
    assert str(t).count("()") == 2**16


def meta_with_tok_embeddings(tiny_meta: Path, dst: Path, offset: int | None = None, shape=None, stride=None) -> Path:
    """The Meta checkpoint with tok_embeddings.weight's offset, shape or stride (the first tensor's ints) replaced."""
    d = copy_without(tiny_meta, dst)
    blob = (tiny_meta / "consolidated.00.pth").read_bytes()
    name = next(n for n in zipfile.ZipFile(io.BytesIO(blob)).namelist() if n.endswith("data.pkl"))
    pkl = zipfile.ZipFile(io.BytesIO(blob)).read(name)
    ops = list(pickletools.genops(pkl))
    first = next(i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID")
    ints = [(pos, ops[i + 1][2]) for i, (op, _, pos) in enumerate(ops[first:], first)
            if op.name in ("BININT", "BININT1", "BININT2", "LONG1")][:5]  # offset, 2 dims, 2 strides
    new = dict(zip(range(5), [offset, *(shape or (None, None)), *(stride or (None, None))]))
    for k in sorted(new, reverse=True):
        if new[k] is not None:
            pos, end = ints[k]
            pkl = pkl[:pos] + _enc_int(new[k]) + pkl[end:]
    (d / "consolidated.00.pth").write_bytes(with_pkl(blob, pkl))
    return d


def test_strides_past_int64_are_refused_from_the_header_not_by_torch(tiny_meta, tmp_path):
    """Before: count-params said 'matches config' and convert died in torch.load with a TypeError traceback."""
    d = meta_with_tok_embeddings(tiny_meta, tmp_path / "ck", stride=(2**63, 1))
    cli_refuses(["count-params", str(d)], tmp_path, "consolidated.00.pth", "strides")
    cli_refuses(["convert", str(d), str(tmp_path / "out"), "--to", "hf"], tmp_path, "consolidated.00.pth", "strides")


def test_negative_a_stride_0_expansion_is_what_torch_reads(tiny_meta, tmp_path):
    """Strides are checked against the storage's span, not assumed contiguous: tok_embeddings as 512 copies of one
    row (stride 0) is read, and converts to the same tensor torch.load makes."""
    d = meta_with_tok_embeddings(tiny_meta, tmp_path / "ck", stride=(0, 1))
    r = CliRunner().invoke(cli, ["convert", str(d), str(tmp_path / "out"), "--to", "hf"])
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")["model.embed_tokens.weight"]
    want = torch.load(d / "consolidated.00.pth", weights_only=True)["tok_embeddings.weight"]
    assert torch.equal(got, want) and torch.equal(got[0], got[511])


def test_a_vocabulary_read_from_a_hostile_embedding_is_bounded(tiny_meta, tmp_path):
    """params.json's vocab_size -1 takes the embedding's rows: 2^62 of them (times 0 columns) is refused, naming it."""
    d = meta_with_tok_embeddings(tiny_meta, tmp_path / "ck", shape=(2**62, 0))
    params = json.loads((d / "params.json").read_text())
    (d / "params.json").write_text(json.dumps({**params, "vocab_size": -1}))
    cli_refuses(["count-params", str(d)], tmp_path, "params.json", "vocab_size", "4,611,686,018,427,387,904")


@pytest.mark.parametrize("names, words", [
    (["consolidated.00.pth", "consolidated.99999.pth"], ["missing model-parallel shard 1 of 100000"]),
    (["consolidated.00.pth", "consolidated.0000000000000000000000001.pth"], ["unexpected shard name"]),
    (["consolidated.00.pth", "consolidated.0.pth"], ["two files are model-parallel shard 0"]),
])
def test_meta_shard_numbers_are_compared_never_looped_to(names, words, tiny_meta, tmp_path):
    d = copy_without(tiny_meta, tmp_path / "ck")
    for n in names[1:]:
        (d / n).write_bytes((d / "consolidated.00.pth").read_bytes())
    start = time.perf_counter()
    cli_refuses(["count-params", str(d)], tmp_path, *words)
    assert time.perf_counter() - start < 5


# --- config numbers past their bounds -------------------------------------------------------------------------

def write_config(path: Path, cfg=TINY, **changes) -> Path:
    path.write_text(json.dumps({**config_to_hf(cfg), **changes}))
    return path


MOE = TINY.replace(family="mixtral", num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("experts", [10**6, 10**9, 2**63 - 1, 10**30])
def test_a_huge_expert_count_is_one_line_at_once_in_a_real_process(experts, tmp_path):
    """Before: 10^6 experts took 2.9 GB and no answer in 30 s (a spec per expert)."""
    write_config(tmp_path / "config.json", MOE, num_local_experts=experts)
    refused(["count-params", "config.json"], tmp_path, "config.json", "num_local_experts", seconds=15)


def test_the_bound_on_experts_counts_exactly_at_once():
    """65,536 experts (the bound): counted analytically, to the closed form, in constant memory."""
    cfg = MOE.replace(num_experts=SIZE_LIMITS["num_local_experts"])
    tracemalloc.start()
    try:
        c = count_params(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.total == closed_form(cfg) and peak < 2 * 2**20
    # by hand: 2 decoders x 65,536 experts x (3 x 64 x 176 + 64 router) on top of tiny's attention and norms
    dense = closed_form(TINY) - 2 * 3 * 64 * 176
    assert c.total == dense + 2 * 2**16 * (3 * 64 * 176 + 64)


def _limit_case(field: str, v: int) -> dict:
    """A config.json whose `field` is v and which is otherwise consistent (what the field needs beside it)."""
    cfg = config_to_hf(MOE if field in ("num_local_experts", "num_experts_per_tok") else TINY)
    if field == "num_experts_per_tok":
        cfg["num_local_experts"] = SIZE_LIMITS["num_local_experts"]
    if field == "num_key_value_heads":
        cfg["num_attention_heads"] = min(v, SIZE_LIMITS["num_attention_heads"])
    if field == "original_max_position_embeddings":
        return {**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, field: v}}
    if field == "sliding_window_pattern":
        cfg.update(config_to_hf(TINY.replace(family="gemma3", qk_norm=True, sandwich_norms=True, norm_plus_one=True,
                                             embed_scale=True, hidden_act="gelu_tanh", sliding_window=32,
                                             layer_types=None)))
    return {**cfg, field: v}


@pytest.mark.parametrize("field", sorted(set(SIZE_LIMITS) - {"token_id", "multiple_of"}))
def test_each_config_number_is_read_at_its_bound_and_refused_one_past(field, tmp_path):
    limit = SIZE_LIMITS[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_limit_case(field, limit)))
    cfg = load_config(path)  # at the bound: read
    assert count_params(cfg).total > 0
    path.write_text(json.dumps(_limit_case(field, limit + 1)))
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value).startswith(str(path)) and field in str(e.value) and f"{limit + 1:,}" in str(e.value)


@pytest.mark.parametrize("changes, words", [
    ({"bos_token_id": 2**31}, ["bos_token_id"]),
    ({"eos_token_id": [2, 2**40]}, ["eos_token_id"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 1e6}}, ["rope_scaling.factor", "1e+06"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 1e300}}, ["high_freq_factor"]),
    ({"hidden_size": 2**20, "head_dim": None}, ["hidden_size", "num_attention_heads", "262,144 wide"]),
    ({"layer_types": ["full_attention"] * 3}, ["layer_types", "each of the 2 layers, got a list of 3"]),
])
def test_other_numbers_a_config_chooses_are_bounded(changes, words, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**config_to_hf(TINY), **changes}.items() if v is not None}))
    cli_refuses(["count-params", str(path)], tmp_path, "config.json", *words)


def test_a_sliding_pattern_is_listed_per_layer_only_up_to_its_bound(tmp_path):
    gemma2 = TINY.replace(family="gemma2", sandwich_norms=True, norm_plus_one=True, embed_scale=True,
                          hidden_act="gelu_tanh", sliding_window=32, tie_word_embeddings=True, layer_types=None)
    path = tmp_path / "config.json"
    write_config(path, gemma2, num_hidden_layers=2**20 + 1)
    cli_refuses(["count-params", str(path)], tmp_path, "config.json", "num_hidden_layers", "1,048,576")
    write_config(path, gemma2, num_hidden_layers=2**20)  # negative: at the bound, read and counted by hand
    cfg = load_config(path)
    assert cfg.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert not cfg.uniform_layers
    assert count_params(cfg).total == closed_form(cfg)  # its sandwich norms included


@pytest.mark.parametrize("changes, words", [
    ({"n_layers": 2**31}, ["n_layers", "2,147,483,648"]),
    ({"dim": 2**21}, ["dim", "2,097,152"]),
    ({"ffn_dim_multiplier": 1e300}, ["ffn_dim_multiplier", "FFN width"]),
    ({"multiple_of": 2**40}, ["multiple_of"]),
    ({"max_seq_len": 2**41}, ["max_seq_len"]),
])
def test_meta_params_numbers_are_bounded(changes, words, tmp_path):
    path = tmp_path / "params.json"
    path.write_text(json.dumps({**meta_params(TINY), **changes}))
    cli_refuses(["count-params", str(path)], tmp_path, "params.json", *words)


# --- real giants still count, exactly and at once -------------------------------------------------------------

def test_llama_3_1_405b_counts_exactly_at_once(tmp_path):
    """126 x (q, o 16384^2; k, v 1024 x 16384; 3 x 16384 x 53248; 2 norms) + 2 x 128256 x 16384 + 16384, by hand."""
    path = write_config(tmp_path / "config.json", get_preset("llama-3.1-405b"))
    start = time.perf_counter()
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0 and time.perf_counter() - start < 5, r.output
    per_layer = 2 * 16384**2 + 2 * 1024 * 16384 + 3 * 16384 * 53248 + 2 * 16384
    assert json.loads(r.stdout)[0]["total"] == 126 * per_layer + 2 * 128256 * 16384 + 16384 == 405_853_388_800


DEEPSEEK_V3 = {  # the published config.json's sizes (deepseek-ai/DeepSeek-V3)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_deepseek_v3_is_built_by_transformers_within_the_bounds_and_counts_by_hand(tmp_path):
    """61 decoders x 256 experts pass the module-tree bounds and count to the total written out by hand (MLA
    attention, 3 dense decoders, 58 of 256 routed + 1 shared experts and a router): 671,026,404,352, the quoted
    671,026,419,200 less the routers' e_score_correction_bias (58 x 256), a buffer in transformers, no parameter."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    attention = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 + 512 * 128 * (128 + 128)
                 + 128 * 128 * 7168)
    moe = 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 256 * 7168
    total = 61 * (attention + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * moe + 2 * 129280 * 7168 + 7168
    r = CliRunner().invoke(cli, ["count-params", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["total"] == total == 671_026_419_200 - 58 * 256


@pytest.mark.parametrize("changes, words", [
    ({"num_experts": 10**6}, ["'num_experts'", "1,000,000"]),
    ({"num_hidden_layers": 10**7}, ["'num_hidden_layers'", "10,000,000"]),
    ({"num_hidden_layers": 64, "num_experts": 1024}, ["64 layers x 1,024 experts"]),
    ({"num_attention_heads": 2**20}, ["'num_attention_heads'"]),
    ({"text_config": {"num_hidden_layers": 10**6}}, ["'text_config.num_hidden_layers'"]),
])
def test_a_foreign_config_is_refused_before_transformers_or_torch_is_imported(changes, words, tmp_path):
    """qwen2_moe goes to transformers' module tree: 10^6 experts took 30 s and 1 GB there; now one line, no import."""
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
           "num_experts_per_tok": 2, **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = probe("count-params", str(tmp_path / "config.json"))
    lines = out["stderr"].strip().splitlines()
    assert out["code"] == 1 and len(lines) == 1 and "Traceback" not in out["stderr"], out
    assert out["heavy"] == [] and "config.json" in lines[0], out
    for w in words:
        assert w in lines[0], lines[0]


def test_negative_the_probe_sees_an_import_when_one_happens(tmp_path):
    """The probe is a real check: a config within the bounds is built, and torch is imported for it."""
    # (count-params builds transformers' tree in a forked child: the command's own process imports no torch for it)
    out = probe("generate", "tiny", "--ids", "1 2", "--max-new-tokens", "1")
    assert out["code"] in (0, None) and "torch" in out["heavy"], out


def test_a_safetensors_dimension_past_int64_is_refused(tmp_path):
    """The library's usize takes [0, 2^63]; torch cannot make it (TypeError on reshape): we refuse it, naming it."""
    raw = json.dumps({"e": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    cli_refuses(["count-params", str(path)], tmp_path, "model.safetensors", "2^63")
    assert os.path.getsize(path) == 8 + len(raw)


def test_a_checkpoint_config_predicting_far_more_tensors_than_its_files_is_one_line(tiny_hf, tmp_path):
    """60,000 experts per decoder over files holding 21 tensors: refused from the analytic count, before 360,017
    expected names are built and listed as missing."""
    d = copy_without(tiny_hf, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=60_000,
               num_experts_per_tok=2)
    (d / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    cli_refuses(["count-params", str(d)], tmp_path, "config.json", "predicts 360,017 tensors", "num_local_experts")
    assert time.perf_counter() - start < 5


def test_whether_layers_are_alike_is_answered_without_a_loop_over_them():
    """uniform_layers for 2^30 decoders (the bound) at once, and still right where layer types alternate."""
    deep = TINY.replace(num_hidden_layers=SIZE_LIMITS["num_hidden_layers"], sliding_window=16)
    start = time.perf_counter()
    assert deep.uniform_layers and time.perf_counter() - start < 0.1
    mixed = TINY.replace(sliding_window=16, layer_types=("sliding_attention", "full_attention"))
    assert not mixed.uniform_layers  # negative: a local/global mix is not uniform
    assert TINY.replace(sliding_window=16, layer_types=("full_attention",) * 2).uniform_layers
