"""The fused and int4 exports stream: weights are read when written, and quantized one MatMul at a time.

Truth is independent of the streaming code: the fused graph of the same weights built in memory (the
preset), and onnxruntime's own whole-graph MatMulNBitsQuantizer on the same full-precision graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper

from llama_tools.cli import cli
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters import fused
from llama_tools.exporters.fused import export_fused
from llama_tools.exporters.quantize import quantize_int4, share_tied_embedding
from llama_tools.modeling.model import build_model
from llama_tools.modeling.presets import get_preset
from llama_tools.inference.reference import CheckpointReader


def _inits(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, base_dir=str(path.parent))
            for t in onnx.load(str(path), load_external_data=False).graph.initializer}


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_fused_from_a_checkpoint_reads_each_weight_once_when_written(tmp_path, monkeypatch, tied, bias):
    """Same initializers as the graph built from the model in memory; nothing read while the graph is built;
    every checkpoint tensor read exactly once, at most three (one packed matrix) per read."""
    cfg = get_preset("tiny").replace(tie_word_embeddings=tied, qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "ckpt"
    save_checkpoint(cfg, state, ckpt, to="hf")

    calls: list[list[str]] = []
    real_read = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read", lambda self, names, device="cpu": (calls.append(list(names)),
                                                                                       real_read(self, names, device))[1])
    slabs: list[tuple[str, list[tuple[int, int]]]] = []
    real_rows = CheckpointReader.rows
    monkeypatch.setattr(CheckpointReader, "rows", lambda self, name, ranges, device="cpu": (
        slabs.append((name, list(ranges))), real_rows(self, name, ranges, device))[1])
    built = []
    real_build = fused.build_graph
    monkeypatch.setattr(fused, "build_graph", lambda *a, **k: (built.append(len(calls)), real_build(*a, **k))[1])
    streamed = export_fused(str(ckpt), tmp_path / "streamed.onnx").path
    assert built == [0], "the checkpoint was read before the graph was built"
    names = [n for c in calls for n in c]
    expected = {n for n in state if not (tied and n == "lm_head.weight")}
    # The embedding (and an untied lm_head) come a slab of rows at a time, every row once, in order; everything
    # else whole, once.
    by_rows = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    _each_row_once(slabs, by_rows, cfg.vocab_size)
    assert sorted(names + sorted(by_rows)) == sorted(expected), "each checkpoint tensor read exactly once"
    assert max(len(c) for c in calls) <= 3, "more than one packed matrix read at a time"

    in_memory = export_fused(model, tmp_path / "memory.onnx").path
    a, b = _inits(streamed), _inits(in_memory)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _each_row_once(slabs: list[tuple[str, list[tuple[int, int]]]], names: set[str], vocab: int) -> None:
    """Each of NAMES read by rows() in slabs, every row once, in order; nothing else read by rows."""
    assert {name for name, _ in slabs} == names
    for n in names:
        got = [r for name, ranges in slabs if name == n for r in ranges]
        assert got and got[0][0] == 0 and got[-1][1] == vocab, (n, got)
        assert all(a[1] == b[0] for a, b in zip(got, got[1:])), f"{n}: rows read twice or skipped: {got}"


@pytest.mark.parametrize("tied", [True, False])
def test_plain_from_a_checkpoint_reads_the_vocabulary_weights_by_rows(tmp_path, monkeypatch, tied):
    """The plain graph from a checkpoint: the embedding and an untied lm_head (written as W^T) come from rows()
    slabs of 7 rows, never read whole; the initializers equal the graph exported from the model in memory."""
    import llama_tools.exporters.onnx_save as onnx_save
    from llama_tools.exporters.onnx_export import export_onnx

    cfg = get_preset("tiny").replace(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(cfg, state, ckpt, to="hf")
    monkeypatch.setattr(onnx_save, "SLAB_BYTES", 7 * 4 * cfg.hidden_size)
    calls: list[str] = []
    real_read = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read", lambda self, names, device="cpu": (calls.extend(names),
                                                                                       real_read(self, names, device))[1])
    slabs: list[tuple[str, list[tuple[int, int]]]] = []
    real_rows = CheckpointReader.rows
    monkeypatch.setattr(CheckpointReader, "rows", lambda self, name, ranges, device="cpu": (
        slabs.append((name, list(ranges))), real_rows(self, name, ranges, device))[1])
    streamed = export_onnx(str(ckpt), tmp_path / "streamed.onnx", external_data_threshold_bytes=0).path
    by_rows = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    _each_row_once(slabs, by_rows, cfg.vocab_size)
    assert len([s for s in slabs if s[0] == "model.embed_tokens.weight"]) > 1  # in slabs, not whole
    assert not by_rows & set(calls), "a vocabulary weight read whole"
    in_memory = export_onnx(model, tmp_path / "memory.onnx", external_data_threshold_bytes=0).path
    a, b = _inits(streamed), _inits(in_memory)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("graph", ["fused", "plain"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("chunk_bytes", [None, 3000])
def test_int4_node_by_node_equals_onnxruntimes_whole_graph_quantizer(tmp_path, monkeypatch, graph, symmetric,
                                                                     chunk_bytes):
    """Every int4 tensor equals what onnxruntime's MatMulNBitsQuantizer writes for the whole graph at once,
    also when each matrix goes through the quantizer a few columns at a time (3000 bytes: 11 columns of 64)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from llama_tools.exporters import quantize
    from llama_tools.exporters.onnx_export import export_onnx

    if chunk_bytes:
        monkeypatch.setattr(quantize, "CHUNK_BYTES", chunk_bytes)
    full = tmp_path / "full.onnx"
    (export_fused if graph == "fused" else export_onnx)("tiny", full)
    ours = quantize_int4(full, tmp_path / "ours.onnx", symmetric=symmetric, algorithm="rtn")

    # The library on the whole graph: Transpose(W) folded into W^T by hand first (its quantizer needs that).
    m = onnx.load(str(full))
    inits = {t.name: t for t in m.graph.initializer}
    for node in [n for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in inits]:
        w = numpy_helper.to_array(inits[node.input[0]])
        m.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), node.input[0] + "_t"))
        for other in m.graph.node:
            other.input[:] = [node.input[0] + "_t" if i == node.output[0] else i for i in other.input]
        m.graph.node.remove(node)
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, accuracy_level=4, bits=4)
    q = MatMulNBitsQuantizer(m, block_size=32, is_symmetric=symmetric, accuracy_level=4, algo_config=config)
    q.process()
    theirs = q.model.model
    if symmetric:
        share_tied_embedding(theirs)
    t_inits = {t.name: numpy_helper.to_array(t) for t in theirs.graph.initializer}
    o_inits = _inits(ours.path)
    quantized = [n for n in t_inits if n.endswith("_Q4")]
    assert len(quantized) == ours.quantized > 0
    for name in quantized + [n.replace("_Q4", "_scales") for n in quantized]:
        np.testing.assert_array_equal(o_inits[name], t_inits[name], err_msg=name)
    assert sorted(o_inits) == sorted(t_inits)
    o_nodes = [(n.op_type, list(n.input)) for n in onnx.load(str(ours.path)).graph.node]
    t_nodes = [(n.op_type, list(n.input)) for n in theirs.graph.node]
    assert sorted(o_nodes) == sorted(t_nodes)
    attrs = lambda m: sorted((n.name, str(n.attribute)) for n in m.graph.node if n.op_type == "MatMulNBits")  # noqa: E731
    assert attrs(onnx.load(str(ours.path))) == attrs(theirs), "K, N, bits, block_size, accuracy_level as theirs"
    if not symmetric:  # imatrix writes the asymmetric quantizer's very tensors and nodes; only the values differ
        imatrix = quantize_int4(full, tmp_path / "imatrix.onnx", algorithm="imatrix")
        i_inits = _inits(imatrix.path)
        assert {k: (v.dtype, v.shape) for k, v in i_inits.items()} == {k: (v.dtype, v.shape) for k, v in t_inits.items()}
        assert any(not np.array_equal(i_inits[n], t_inits[n]) for n in quantized)
        i_model = onnx.load(str(imatrix.path))
        assert sorted((n.op_type, list(n.input)) for n in i_model.graph.node) == sorted(t_nodes)
        assert attrs(i_model) == attrs(theirs)


def test_int4_hqq_runs_and_scores(tmp_path):
    """--int4-algorithm hqq: onnxruntime's HQQ (zero points), the export's quality line measured on it."""
    out = tmp_path / "hqq" / "model.onnx"
    r = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(out), "--quantize", "int4",
                                 "--int4-algorithm", "hqq", "--format", "json", "--no-client-files", "-q"])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads(r.stdout)
    assert rep["quantized"]["algorithm"] == "hqq" and rep["quantized"]["symmetric"] is False
    nodes = onnx.load(str(out)).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 4 for n in nbits), "HQQ writes a zero point for every MatMulNBits"
    assert 0 <= rep["int4_quality"]["mean_kl"] < 1 and rep["int4_quality"]["top1"] > 0.5
    bad = CliRunner().invoke(cli, ["export", "onnx", "tiny", "-o", str(tmp_path / "x.onnx"), "--quantize", "int4",
                                   "--int4-algorithm", "gptq"])
    assert bad.exit_code != 0 and "--int4-algorithm" in bad.output and "Traceback" not in bad.output


def test_int4_written_beside_its_data_equals_the_single_file(tmp_path, monkeypatch):
    """Above the single-file size the int4 graph goes to OUT + OUT.data, the full-precision tensors (tiny's
    untied embedding, norms, RoPE tables) copied from SOURCE's file by plain reads: the same tensors."""
    from llama_tools.exporters import onnx_save

    full = tmp_path / "full.onnx"
    export_fused("tiny", full, external_data_threshold_bytes=0)  # SOURCE's weights in full.onnx.data
    one = quantize_int4(full, tmp_path / "one" / "model.onnx").path
    monkeypatch.setattr(onnx_save, "SINGLE_FILE_MAX_BYTES", 0)
    copied = []
    real_copy = onnx_save._copy_external
    monkeypatch.setattr(onnx_save, "_copy_external", lambda f, t: (copied.append(t.name), real_copy(f, t))[1])
    two = quantize_int4(full, tmp_path / "two" / "model.onnx").path
    assert "model.embed_tokens.weight" in copied, copied
    assert not (one.parent / "model.onnx.data").exists() and (two.parent / "model.onnx.data").is_file()
    a, b = _inits(one), _inits(two)
    assert a.keys() == b.keys() and "model.embed_tokens.weight" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("algorithm,keep", [("rtn", ()), ("imatrix", ("/lm_head/MatMul",)), ("hqq", ())])
@pytest.mark.parametrize("single", [True, False])
def test_int4_tensors_spilled_as_made_are_the_tensors_held(tmp_path, monkeypatch, algorithm, keep, single):
    """Every quantized tensor written to the scratch file as it is made (its pieces one after another) gives the
    graph that holding them in memory gives, in one file or beside its .data; the scratch goes with the run."""
    from llama_tools.exporters import onnx_save
    from llama_tools.exporters import quantize as q

    cfg = get_preset("tiny")
    full = tmp_path / "src" / "full.onnx"
    export_fused("tiny", full, external_data_threshold_bytes=0)
    opts = dict(algorithm=algorithm, keep_8bit=keep, block_size=32)
    if not single:
        monkeypatch.setattr(onnx_save, "SINGLE_FILE_MAX_BYTES", 0)
    held = quantize_int4(full, tmp_path / "held" / "model.onnx", **opts).path
    monkeypatch.setattr(q._Spill, "MIN_BYTES", 0)  # tiny's tensors are all small: spill every one
    monkeypatch.setattr(q, "CHUNK_BYTES", 4 * cfg.hidden_size * 7)  # pieces of 7 rows: several per matrix
    spilled_names = []
    real_tensor = q._Spill.tensor
    monkeypatch.setattr(q._Spill, "tensor", lambda self, name, pieces: (spilled_names.append((name, len(pieces))),
                                                                        real_tensor(self, name, pieces))[1])
    spilled = quantize_int4(full, tmp_path / "spilled" / "model.onnx", **opts).path
    assert spilled_names and (algorithm == "hqq" or any(n > 1 for _, n in spilled_names)), spilled_names  # HQQ: whole
    a, b = _inits(held), _inits(spilled)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert sorted(p.name for p in full.parent.iterdir()) == ["full.onnx", "full.onnx.data"]  # no scratch left


def test_hqq_keeps_a_tied_embedding_shared(tmp_path):
    """HQQ's zero points are floats, which GatherBlockQuantized cannot read: a tied lm_head is quantized
    symmetric RTN instead, so the embedding is still served from its blocks (stored once)."""
    cfg = get_preset("tiny").replace(tie_word_embeddings=True)
    torch.manual_seed(0)
    full = export_fused(build_model(cfg, dtype=torch.float32), tmp_path / "full.onnx").path
    q = quantize_int4(full, tmp_path / "hqq.onnx", algorithm="hqq")
    nodes = onnx.load(str(q.path)).graph.node
    nbits = {n.name: n for n in nodes if n.op_type == "MatMulNBits"}
    assert len(nbits[next(n for n in nbits if n.startswith("/lm_head"))].input) == 3, "lm_head: no zero point"
    assert all(len(n.input) == 4 for name, n in nbits.items() if not name.startswith("/lm_head"))
    assert [n.op_type for n in nodes].count("GatherBlockQuantized") == 1
    assert "model.embed_tokens.weight" not in _inits(q.path), "the fp32 table is gone"


def test_an_asymmetric_tied_head_serves_the_embedding_as_matmulnbits_reads_it(tmp_path):
    """Asymmetric RTN: the Gather reads the lm_head's blocks with the zero points unpacked; its rows equal the
    rows of W that onnxruntime's MatMulNBits itself computes from the same blocks (fed the identity)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    cfg = get_preset("tiny").replace(tie_word_embeddings=True)
    torch.manual_seed(0)
    full = export_fused(build_model(cfg, dtype=torch.float32), tmp_path / "full.onnx").path
    q = quantize_int4(full, tmp_path / "asym.onnx", symmetric=False)
    m = onnx.load(str(q.path))
    inits = {t.name: t for t in m.graph.initializer}
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head"))
    assert len(gbq.input) == 4 and len(head.input) == 4 and "model.embed_tokens.weight" not in inits
    n1, n2 = cfg.vocab_size, cfg.hidden_size
    scales3 = numpy_helper.to_array(inits[head.input[2]]).reshape(n1, -1, 1)
    rows_graph = helper.make_graph(
        [helper.make_node("GatherBlockQuantized", [gbq.input[0], "ids", "s3", gbq.input[3]], ["rows"],
                          domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=32, bits=4)],
        "rows", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
        initializer=[inits[gbq.input[0]], numpy_helper.from_array(scales3, "s3"), inits[gbq.input[3]]])
    head_graph = helper.make_graph(
        [helper.make_node("MatMulNBits", ["x", *head.input[1:]], ["y"], domain="com.microsoft",
                          K=n2, N=n1, bits=4, block_size=32)],
        "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n2, n2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[inits[i] for i in head.input[1:]])
    run = lambda g, feeds: ort.InferenceSession(helper.make_model(g, opset_imports=[  # noqa: E731
        helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]).SerializeToString(),
        providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    rows = run(rows_graph, {"ids": np.arange(n1)}).reshape(n1, n2)
    w = run(head_graph, {"x": np.eye(n2, dtype=np.float32)[None]})[0].T  # [n1, n2]: W as MatMulNBits sees it
    assert rows.shape == w.shape == (n1, n2)
    np.testing.assert_allclose(rows, w, rtol=0, atol=1e-6)
    assert not np.allclose(rows, np.round(rows)), "real dequantized values, not a degenerate table"


def test_a_tied_head_kept_8bit_serves_the_embedding_in_its_own_blocks(tmp_path):
    """A tied lm_head kept 8-bit takes the largest block up to 128 that tiles K (64 for tiny's 64): the embedding's
    GatherBlockQuantized reads those very blocks, rows equal to W as MatMulNBits computes it (fed the identity)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from llama_tools.exporters.quantize import eight_bit_block

    assert [eight_bit_block(k, False, 32) for k in (896, 4864, 576, 640, 64, 100)] == [128, 128, 64, 128, 64, 128]
    assert eight_bit_block(100, True, 32) == 32  # nothing tiles 100: a tied head keeps the int4 block
    cfg = get_preset("tiny").replace(tie_word_embeddings=True)
    torch.manual_seed(0)
    full = export_fused(build_model(cfg, dtype=torch.float32), tmp_path / "full.onnx").path
    q = quantize_int4(full, tmp_path / "q.onnx", keep_8bit=("/lm_head/MatMul",))
    m = onnx.load(str(q.path))
    inits = {t.name: t for t in m.graph.initializer}
    attrs = lambda n: {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}  # noqa: E731
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head"))
    assert attrs(head)["bits"] == attrs(gbq)["bits"] == 8 and attrs(head)["block_size"] == attrs(gbq)["block_size"] == 64
    n1, n2 = cfg.vocab_size, cfg.hidden_size
    scales3 = numpy_helper.to_array(inits[head.input[2]]).reshape(n1, -1, 1)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    run = lambda g, feeds: ort.InferenceSession(helper.make_model(g, opset_imports=opsets).SerializeToString(),  # noqa: E731
                                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    rows = run(helper.make_graph(
        [helper.make_node("GatherBlockQuantized", [gbq.input[0], "ids", "s3"], ["rows"], domain="com.microsoft",
                          gather_axis=0, quantize_axis=2, block_size=64, bits=8)],
        "rows", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)],
        initializer=[inits[gbq.input[0]], numpy_helper.from_array(scales3, "s3")]), {"ids": np.arange(n1)})
    w = run(helper.make_graph(
        [helper.make_node("MatMulNBits", ["x", *head.input[1:]], ["y"], domain="com.microsoft", K=n2, N=n1, bits=8,
                          block_size=64)],
        "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n2, n2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[inits[i] for i in head.input[1:]]), {"x": np.eye(n2, dtype=np.float32)[None]})[0].T
    assert rows.reshape(n1, n2).shape == w.shape == (n1, n2)
    np.testing.assert_allclose(rows.reshape(n1, n2), w, rtol=0, atol=1e-6)
    table = numpy_helper.to_array(next(t for t in onnx.load(str(full)).graph.initializer
                                       if t.name == "model.embed_tokens.weight"))  # [n1, n2] fp32
    peak = np.abs(table.reshape(n1, -1, 64)).max(-1, keepdims=True)  # each 64-block's largest magnitude
    assert (np.abs(w - table).reshape(n1, -1, 64) <= peak / 127).all(), "within an 8-bit step of its block"
    assert not np.allclose(w, table, rtol=0, atol=1e-7), "quantized, not the table itself"
