"""ONNX export: the graph's shape and RoPE nodes, and onnxruntime's numbers against the PyTorch model.

Every model here has q/k weights scaled up: with init_std 0.02 attention is nearly uniform, and a
wrong RoPE or a leaky mask could still pass. test_wrong_rope_layout_is_caught proves the comparison bites.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper
import onnxruntime as ort
import pytest
import torch

import helpers
from helpers import sharp
from llama_tools.exporters.graph_io import io_names
from llama_tools.exporters.onnx_export import ExportResult, export_onnx, read_metadata
from llama_tools.exporters.rope_ops import DOMAIN, OP_TYPE, rope_function
from llama_tools.modeling.presets import get_preset
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.checkpoints.loading import load_model
from llama_tools.modeling.model import Llama, build_model, rope

TINY = get_preset("tiny").replace(max_position_embeddings=64)  # GQA: 4 query heads over 2 KV heads
ATOL = 1e-4  # fp32 logits, onnxruntime vs PyTorch


def token_ids(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return helpers.token_ids(batch, n, TINY, seed)


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run(sess, cfg, ids, mask=None, pos=None, past=None, dtype=np.float32):
    """One step on onnxruntime: (logits, [(K, V) per layer]); past None means past length 0."""
    b, n = ids.shape
    if past is None:
        empty = np.zeros((b, cfg.num_key_value_heads, 0, cfg.head_dim), dtype)  # [batch, kv, 0, head_dim]
        past = [(empty, empty)] * cfg.num_hidden_layers
    p = past[0][0].shape[2]
    mask = np.ones((b, p + n), np.int64) if mask is None else np.asarray(mask, np.int64)
    if pos is None:
        pos = np.clip(mask.cumsum(-1) - 1, 0, None)[:, p:]  # left padding: count real tokens only
    inputs, outputs = io_names(cfg.num_hidden_layers)
    feed = dict(zip(inputs[:3], (np.asarray(ids, np.int64), mask, np.asarray(pos, np.int64))))
    feed.update(zip(inputs[3:], (t for kv in past for t in kv)))
    out = dict(zip(outputs, sess.run(None, feed)))
    return out["logits"], [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(cfg.num_hidden_layers)]


def torch_run(model, ids):
    """The PyTorch reference: (logits, cache), no padding."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids))
    return out.logits.numpy(), out.past_key_values


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def cached_decode_vs_torch(sess, model, ids, prefill: int) -> tuple[np.ndarray, float]:
    """Prefill `prefill` tokens on onnxruntime, decode the rest through its cache: (logits, error vs PyTorch)."""
    cfg = model.cfg
    _, past = run(sess, cfg, ids[:, :prefill])
    logits, presents = run(sess, cfg, ids[:, prefill:], past=past)
    full, _ = torch_run(model, ids)
    b, n = ids.shape
    assert logits.shape == (b, n - prefill, cfg.vocab_size) and logits.dtype == np.float32
    assert presents[0][0].shape == (b, cfg.num_key_value_heads, n, cfg.head_dim)
    return logits, max_abs(logits, full[:, prefill:])


# --- Exports shared by several tests (one trace each: tracing is the slow part) -------------------------

@pytest.fixture(scope="module")
def half_model():
    return sharp(TINY)


@pytest.fixture(scope="module")
def half_export(half_model, tmp_path_factory) -> ExportResult:
    return export_onnx(half_model, tmp_path_factory.mktemp("half") / "tiny.onnx")


@pytest.fixture(scope="module")
def half_session(half_export):
    return session(half_export.path)


# --- The op alone ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float16, 2e-3)])  # fp16: one ulp
def test_function_body_is_model_rope(interleaved, dtype, tol):
    """One llama_tools.RotaryEmbedding node, run through its FunctionProto, against llama_tools.modeling.model.rope."""
    h, f32, i64 = onnx.helper, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    elem = h.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = h.make_node(OP_TYPE, ["x", "pos", "cos", "sin"], ["y"], domain=DOMAIN, interleaved=interleaved,
                       )
    inputs = [h.make_tensor_value_info("x", elem, ["b", "h", "s", 16]),
              h.make_tensor_value_info("pos", i64, ["b", "s"]),
              h.make_tensor_value_info("cos", f32, ["m", 8]),
              h.make_tensor_value_info("sin", f32, ["m", 8])]
    graph = h.make_graph([node], "rope", inputs, [h.make_tensor_value_info("y", elem, ["b", "h", "s", 16])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid(DOMAIN, 1)],
                         functions=[rope_function(20)], ir_version=10)  # ir 10: what torch.onnx writes
    onnx.checker.check_model(model, full_check=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=gen).to(torch.float16 if dtype == np.float16 else torch.float32)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 30, 31]])
    angles = torch.rand(32, 8, generator=gen) * 40  # any table: the op only looks rows up
    cos, sin = angles.cos(), angles.sin()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x.numpy(), "pos": pos.numpy(), "cos": cos.numpy(), "sin": sin.numpy()})[0]
    ref = rope(x, pos, cos, sin, bool(interleaved))
    assert y.shape == tuple(ref.shape) and y.dtype == dtype
    np.testing.assert_allclose(y.astype(np.float32), ref.float().numpy(), rtol=tol, atol=tol)


# --- The graph ----------------------------------------------------------------------------------------------

def test_graph_has_one_custom_rope_node_per_q_and_k(half_export):
    m = onnx.load(str(half_export.path))
    ropes = [n for n in m.graph.node if n.op_type == OP_TYPE]
    assert len(ropes) == 2 * TINY.num_hidden_layers == half_export.rope_nodes
    assert {n.domain for n in ropes} == {DOMAIN}
    # Named by module path (the model's q_rope / k_rope modules), not by the order of the calls.
    assert [n.name for n in ropes] == [f"/model/layers.{j}/self_attn/{w}_rope/RotaryEmbedding"
                                       for j in range(TINY.num_hidden_layers) for w in "qk"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ropes[0].attribute}
    assert attrs == {"interleaved": 0}
    assert [(f.domain, f.name) for f in m.functions] == [(DOMAIN, OP_TYPE)]  # its body travels with the model
    opsets = {o.domain: o.version for o in m.opset_import}
    assert opsets[DOMAIN] == 1 and opsets[""] == half_export.opset == {i.domain: i.version for i in
                                                                        m.functions[0].opset_import}[""]
    onnx.checker.check_model(str(half_export.path), full_check=True)


def test_linear_weights_are_stored_transposed_for_their_matmul(half_model, half_export):
    """No Transpose(W) left for onnxruntime to fold: each Linear's weight is W^T [in, out] under its module's name."""
    m = onnx.load(str(half_export.path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    assert not [n.name for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
    state = half_model.state_dict()
    linears = [k for k, v in state.items() if v.ndim == 2 and k != "model.embed_tokens.weight"]
    assert len(linears) == 7 * TINY.num_hidden_layers + 1  # q k v o gate up down, and lm_head
    for name in linears:
        stored = inits.pop(name.removesuffix(".weight") + ".MatMul.weight")
        np.testing.assert_array_equal(stored, state[name].numpy().T)  # [in, out], the same numbers
        assert name not in inits  # not kept beside it
    by_input = {i for n in m.graph.node if n.op_type == "MatMul" for i in n.input}
    assert all(name.removesuffix(".weight") + ".MatMul.weight" in by_input for name in linears)


def test_inputs_outputs_names_and_dtypes(half_export, half_session):
    inputs, outputs = io_names(TINY.num_hidden_layers)
    got_in = {i.name: (i.type, i.shape) for i in half_session.get_inputs()}
    got_out = {o.name: (o.type, o.shape) for o in half_session.get_outputs()}
    assert list(got_in) == inputs and list(got_out) == outputs
    kv, d = TINY.num_key_value_heads, TINY.head_dim
    assert got_in["input_ids"] == ("tensor(int64)", ["batch", "sequence_length"])
    assert got_in["attention_mask"] == ("tensor(int64)", ["batch", "total_sequence_length"])
    assert got_in["position_ids"] == ("tensor(int64)", ["batch", "sequence_length"])
    assert got_in["past_key_values.1.value"] == ("tensor(float)", ["batch", kv, "past_sequence_length", d])
    assert got_out["logits"] == ("tensor(float)", ["batch", "sequence_length", TINY.vocab_size])
    assert got_out["present.0.key"] == ("tensor(float)", ["batch", kv, "total_sequence_length", d])
    assert half_export.external_data is None and half_export.params == sum(
        p.numel() for p in build_model(TINY, device="meta").parameters())


# --- Numbers against PyTorch ----------------------------------------------------------------------------------

def test_prefill_logits_match_torch(half_model, half_session):
    ids = token_ids(2, 9)
    logits, presents = run(half_session, TINY, ids)
    ref, ref_past = torch_run(half_model, ids)
    assert logits.shape == (2, 9, TINY.vocab_size) and logits.dtype == np.float32
    assert presents[1][0].shape == (2, TINY.num_key_value_heads, 9, TINY.head_dim)
    assert max_abs(logits, ref) < ATOL
    assert max_abs(presents[1][0], ref_past[1][0]) < ATOL  # the cache holds rotated keys, as PyTorch's


def test_decode_with_the_kv_cache_matches_torch(half_model, half_session):
    _, err = cached_decode_vs_torch(half_session, half_model, token_ids(2, 8, seed=1), prefill=6)  # two steps
    assert err < ATOL


def test_past_length_zero_batch_one_sequence_one(half_model, half_session):
    # Traced with batch 2, seq 3, past 5: sizes 0 and 1 must not have been baked in.
    ids = token_ids(1, 1, seed=2)
    logits, presents = run(half_session, TINY, ids)
    ref, _ = torch_run(half_model, ids)
    assert logits.shape == (1, 1, TINY.vocab_size) and presents[0][0].shape[2] == 1
    assert max_abs(logits, ref) < ATOL


def test_left_padded_batch_gives_each_row_its_own_logits(half_session):
    long, short = token_ids(1, 7, seed=3)[0], token_ids(1, 4, seed=4)[0]
    ids = np.stack([long.numpy(), np.concatenate([np.zeros(3, np.int64), short.numpy()])])
    mask = np.array([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    logits, past = run(half_session, TINY, ids, mask)
    alone_long, past_long = run(half_session, TINY, long[None])
    alone_short, past_short = run(half_session, TINY, short[None])
    assert max_abs(logits[0], alone_long[0]) < ATOL
    assert max_abs(logits[1, 3:], alone_short[0]) < ATOL
    # One decode step with the padded cache, against each row's own cache.
    nxt = np.array([[5], [6]])
    step, _ = run(half_session, TINY, nxt, np.concatenate([mask, [[1], [1]]], axis=1), past=past)
    one, _ = run(half_session, TINY, nxt[:1], past=past_long)
    two, _ = run(half_session, TINY, nxt[1:], past=past_short)
    assert max_abs(step[0], one[0]) < ATOL and max_abs(step[1], two[0]) < ATOL


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    """The half-layout model's weights read as Meta's interleaved layout: a different, equally valid model."""
    model = sharp(TINY.replace(rope_layout="interleaved"))
    return model, export_onnx(model, tmp_path_factory.mktemp("inter") / "inter.onnx")


def test_interleaved_layout_matches_torch(interleaved):
    model, res = interleaved
    node = next(n for n in onnx.load(str(res.path)).graph.node if n.op_type == OP_TYPE)
    assert {a.name: a.i for a in node.attribute}["interleaved"] == 1
    ids = token_ids(2, 9)
    logits, _ = run(session(res.path), TINY, ids)
    assert max_abs(logits, torch_run(model, ids)[0]) < ATOL


def test_wrong_rope_layout_is_caught(interleaved, half_model):
    # Same weights, layout flipped: the comparison used above must fail, and by far.
    _, res = interleaved
    ids = token_ids(2, 9)
    logits, _ = run(session(res.path), TINY, ids)
    ref, _ = torch_run(half_model, ids)
    assert max_abs(logits, ref) > 100 * ATOL


@pytest.mark.parametrize("rope_op, domain", [("contrib", "com.microsoft"), ("onnx", "")])
def test_the_three_rope_ops_agree(half_model, half_session, rope_op, domain, tmp_path):
    res = export_onnx(half_model, tmp_path / f"{rope_op}.onnx", rope_op=rope_op)
    m = onnx.load(str(res.path))
    ropes = [n for n in m.graph.node if n.op_type == OP_TYPE]
    assert len(ropes) == 2 * TINY.num_hidden_layers and {n.domain for n in ropes} == {domain}
    assert not m.functions  # onnxruntime implements these itself
    assert res.opset == (23 if rope_op == "onnx" else 20)
    ids, mask = token_ids(2, 9, seed=5), np.array([[1] * 9, [0, 0] + [1] * 7])
    logits, _ = run(session(res.path), TINY, ids, mask)
    ours, _ = run(half_session, TINY, ids, mask)
    assert logits.shape == ours.shape and logits.dtype == ours.dtype
    assert max_abs(logits, ours) < ATOL


def test_alibi_has_no_rope_node_and_matches_torch(tmp_path):
    cfg = TINY.replace(family="baichuan", position_encoding="alibi", num_key_value_heads=4)
    model = sharp(cfg)
    res = export_onnx(model, tmp_path / "alibi.onnx")
    m = onnx.load(str(res.path))
    assert res.rope_nodes == 0 and not any(n.op_type == OP_TYPE for n in m.graph.node) and not m.functions
    _, err = cached_decode_vs_torch(session(res.path), model, token_ids(2, 8, seed=6), prefill=5)
    assert err < ATOL


def test_tied_embeddings_biases_and_sliding_window(tmp_path):
    # Qwen2's tied embeddings and q/k/v biases, Mistral's window (4 < 9 tokens, so it masks something).
    cfg = TINY.replace(family="qwen2", tie_word_embeddings=True, qkv_bias=True, sliding_window=4)
    model = sharp(cfg)
    res = export_onnx(model, tmp_path / "qwen.onnx")
    names = {t.name for t in onnx.load(str(res.path)).graph.initializer}
    assert len(names & {"lm_head.weight", "model.embed_tokens.weight"}) == 1  # one matrix, stored once
    assert "lm_head.MatMul.weight" not in names  # its Transpose is kept: folding would store it twice
    _, err = cached_decode_vs_torch(session(res.path), model, token_ids(2, 9, seed=12), prefill=6)
    assert err < ATOL


def test_fp16_export_runs_close_to_fp32_torch(half_model, tmp_path):
    res = export_onnx(half_model, tmp_path / "fp16.onnx", dtype="float16")
    sess = session(res.path)
    types = {i.name: i.type for i in [*sess.get_inputs(), *sess.get_outputs()]}
    assert types["past_key_values.0.key"] == types["present.1.value"] == types["logits"] == "tensor(float16)"
    ids = token_ids(2, 9, seed=7)
    logits, _ = run(sess, TINY, ids, dtype=np.float16)
    ref, _ = torch_run(half_model, ids)
    assert logits.shape == ref.shape and logits.dtype == np.float16
    assert np.isfinite(logits).all()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert max_abs(logits, ref) < 1e-2  # fp16 rounding, with RMSNorm and softmax still in fp32
    assert read_metadata(res.path).dtype == "float16"


def test_metadata_round_trips_the_config(half_export):
    meta = read_metadata(half_export.path)
    assert meta.config == TINY
    assert (meta.rope_layout, meta.rope_op, meta.dtype, meta.source) == ("half", "llama_tools", "float32", "tiny")
    assert meta.seed is None  # weights from a module: no seed reproduces them
    props = {p.key for p in onnx.load(str(half_export.path)).metadata_props}
    assert {f"llama_tools.{k}" for k in ("config", "rope_layout", "rope_op", "dtype", "version", "source",
                                         "seed")} <= props


def test_preset_export_records_its_seed(tmp_path):
    (tmp_path / "preset.onnx.data").write_bytes(b"a previous export's weights")
    res = export_onnx("tiny", tmp_path / "preset.onnx", seed=3)
    assert res.external_data is None and os.listdir(tmp_path) == ["preset.onnx"]  # the stale .data went
    meta = read_metadata(res.path)
    assert meta.seed == 3 and meta.source == "tiny"
    ids = token_ids(1, 6, seed=8)
    logits, _ = run(session(res.path), meta.config, ids)
    assert max_abs(logits, torch_run(load_model("tiny", seed=3), ids)[0]) < ATOL


# --- Files: external data and atomic writes -----------------------------------------------------------------

def test_external_data_beside_the_model(half_model, half_session, tmp_path):
    out = tmp_path / "ext.onnx"
    res = export_onnx(half_model, out, external_data_threshold_bytes=0)
    assert res.external_data == tmp_path / "ext.onnx.data" and res.external_data.stat().st_size > 0
    assert sorted(os.listdir(tmp_path)) == ["ext.onnx", "ext.onnx.data"]  # no temp dir left behind
    m = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"ext.onnx.data"}
    onnx.checker.check_model(str(out), full_check=True)
    assert read_metadata(out).config == TINY
    ids = token_ids(2, 5, seed=9)
    assert max_abs(run(session(out), TINY, ids)[0], run(half_session, TINY, ids)[0]) == 0.0


def test_a_failing_export_leaves_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(onnx.checker, "check_model", broken)  # fails after both files are written
    with pytest.raises(RuntimeError, match="disk full"):
        export_onnx(TINY, tmp_path / "out.onnx", external_data_threshold_bytes=0)  # a ModelConfig
    assert os.listdir(tmp_path) == []


# --- Sources: checkpoints, MoE, bad input ---------------------------------------------------------------------

@pytest.mark.slow
def test_baichuan_w_pack_checkpoint(tmp_path):
    cfg = TINY.replace(family="baichuan", num_key_value_heads=4)
    state = {k: v.clone() for k, v in sharp(cfg).state_dict().items()}
    save_checkpoint(cfg, state, tmp_path / "ckpt")
    res = export_onnx(str(tmp_path / "ckpt"), tmp_path / "baichuan.onnx")
    meta = read_metadata(res.path)
    assert meta.config.family == "baichuan" and meta.seed is None and meta.source == str(tmp_path / "ckpt")
    ids = token_ids(2, 7, seed=10)
    logits, _ = run(session(res.path), cfg, ids)
    assert max_abs(logits, torch_run(load_model(tmp_path / "ckpt"), ids)[0]) < ATOL


@pytest.mark.slow
def test_mixture_of_experts_exports_and_matches_torch(tmp_path):
    cfg = TINY.replace(family="mixtral", num_experts=4, num_experts_per_tok=2, intermediate_size=64)
    model = sharp(cfg)
    res = export_onnx(model, tmp_path / "moe.onnx")
    ids = token_ids(2, 7, seed=11)
    logits, _ = run(session(res.path), cfg, ids)
    assert max_abs(logits, torch_run(model, ids)[0]) < ATOL


def test_bf16_exports_and_the_cpu_provider_runs_it_emulated(tmp_path):
    from llama_tools.exporters.runtime import EMULATED_BF16, create_session

    res = export_onnx("tiny", tmp_path / "bf16.onnx", dtype="bfloat16")  # checked with full_check
    model = onnx.load(str(res.path))
    weight = next(i for i in model.graph.initializer if i.name == "model.layers.0.self_attn.q_proj.MatMul.weight")
    assert weight.data_type == onnx.TensorProto.BFLOAT16
    cos = next(i for i in model.graph.initializer if i.name == "cos_cache")
    assert cos.data_type == onnx.TensorProto.FLOAT  # our op keeps the tables in fp32
    s = create_session(res.path, "cpu")  # no bf16 kernels on the CPU: fp32 rounded to bf16 (test_bf16_emulation)
    assert s.provider == "cpu" and s.note.endswith(EMULATED_BF16)


@pytest.mark.parametrize("kwargs, match", [
    ({"rope_op": "fused"}, "unknown rope_op 'fused'"),
    ({"dtype": "int8"}, "dtype 'int8' is not one a model runs in"),
    ({"opset": 17}, "opset 17 is too old"),
    ({"rope_op": "onnx", "opset": 20}, "pass opset >= 23"),
])
def test_bad_arguments_raise_one_line(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match) as e:
        export_onnx("tiny", tmp_path / "x.onnx", **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x.onnx").exists()


def test_output_directory_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        export_onnx("tiny", tmp_path)
    plain = tmp_path / "plain.onnx"
    graph = onnx.helper.make_graph([], "g", [], [])
    onnx.save(onnx.helper.make_model(graph), str(plain))
    with pytest.raises(ValueError, match="no llama_tools.config metadata"):
        read_metadata(plain)
    with pytest.raises(ValueError, match="no such file"):
        read_metadata(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not an ONNX model"):
        read_metadata(tmp_path / "junk.onnx")


# --- CLI ---------------------------------------------------------------------------------------------------

def test_cli_export_table_json_and_errors(tmp_path):
    import json

    from click.testing import CliRunner

    from llama_tools.cli import cli

    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "t.onnx"), "--dtype", "float16",
                                 "--format", "json", "-q"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["dtype"] == "float16" and data["rope_nodes"] == 2 * TINY.num_hidden_layers
    assert read_metadata(tmp_path / "t.onnx").dtype == "float16"
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "u.onnx"), "--rope-op", "contrib"])
    assert r.exit_code == 0 and "com.microsoft.RotaryEmbedding" in r.output
    r = CliRunner().invoke(cli, ["export", "onnx", str(tmp_path / "nowhere"), "-o", str(tmp_path / "v.onnx")])
    assert r.exit_code == 1 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "v.onnx").exists()
