"""Streaming save: the same file contents and onnxruntime outputs as `ir.save`, one tensor in memory at a time.

The model to save is caught where export_onnx hands it to its own saver, which writes the reference file
first; the streamed copies are then compared with it tensor by tensor and run side by side.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import llama_tools.exporters.onnx_export as ox
from llama_tools.exporters.onnx_save import save_model
from llama_tools.modeling.presets import get_preset
from llama_tools.modeling.model import build_model, rope_cache

TINY = get_preset("tiny").replace(num_hidden_layers=1)  # one layer: quicker to trace


def export_and_catch(directory, dtype="float32"):
    """export_onnx's file (the old path) and the ir.Model it saved, for saving again."""
    caught = {}
    real = ox.save_model

    def catch(model, output, *args, **kwargs):
        out = real(model, output, *args, **kwargs)
        caught["model"] = model
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ox, "save_model", catch)
        res = ox.export_onnx(build_model(TINY), directory / "old.onnx", dtype=dtype)
    return res.path, caught["model"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return export_and_catch(tmp_path_factory.mktemp("fp32"))


@pytest.fixture(scope="module")
def small(fp32):
    """The old path's file, to load back with ir.load (onnx_ir tensors, not torch ones)."""
    return fp32[0]


def tensors(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def run(path) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 17, 300, 5], [2, 450, 29, 8]], np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(4), (2, 1))}
    for i in range(TINY.num_hidden_layers):
        for k in ("key", "value"):
            feed[f"past_key_values.{i}.{k}"] = np.zeros((2, TINY.num_key_value_heads, 0, TINY.head_dim), np.float32)
    return sess.run(None, feed)


def test_same_weights_and_outputs_bit_for_bit(tmp_path, fp32):
    old, model = fp32
    want, want_out = tensors(old), run(old)
    for external in (False, True):  # single file first: it leaves the model as it was
        saved = save_model(model, tmp_path / str(external), "model.onnx", external=external)
        assert (saved.external_data is not None) == external
        if external:
            assert saved.external_data.stat().st_size == saved.data_bytes == sum(
                a.nbytes for a in want.values() if a.nbytes >= 1024)  # small ones stay inline
            assert saved.path.stat().st_size < saved.weight_bytes / 10  # the graph alone
        else:
            assert saved.path.stat().st_size > saved.weight_bytes
        got = tensors(saved.path)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
            assert got[name].tobytes() == want[name].tobytes(), name
        for a, b in zip(want_out, run(saved.path)):
            np.testing.assert_array_equal(a, b)
        meta = {p.key: p.value for p in onnx.load(str(saved.path), load_external_data=False).metadata_props}
        assert meta["llama_tools.dtype"] == "float32"  # metadata and functions travel with the graph
    assert any(np.abs(a).max() > 0 for a in want_out)


def test_auto_picks_external_data_above_the_threshold(tmp_path, small):
    model = ir.load(str(small))
    assert save_model(model, tmp_path / "a", single_file_max_bytes=10**9).external_data is None
    model = ir.load(str(tmp_path / "a" / "model.onnx"))
    assert save_model(model, tmp_path / "b", single_file_max_bytes=10**5).external_data is not None


def test_a_source_streams_weights_cast_per_tensor(tmp_path):
    """fp32 weights handed over one at a time into an fp16 graph: the bytes of the old fp16 export."""
    old, model = export_and_catch(tmp_path, dtype="float16")
    state = build_model(TINY).state_dict()  # fp32, the same seeded weights
    cos, sin = rope_cache(TINY)
    state.update(cos_cache=cos, sin_cache=sin)
    for v in model.graph.initializers.values():
        if v.name in state:
            v.const_value = None  # as if never loaded: only the source has the data
    handed: list[weakref.ref] = []
    alive_at_fetch = []

    def source(name):
        gc.collect()
        alive_at_fetch.append(sum(r() is not None for r in handed))
        if name not in state:
            return None
        t = state[name].clone()  # a fresh copy per tensor, as a memory-mapped read would be
        if t.nbytes >= 1024:  # smaller ones stay inline in the graph
            handed.append(weakref.ref(t))
        return t

    saved = save_model(model, tmp_path / "new", "model.onnx", source=source, external=True)
    assert max(alive_at_fetch) == 0  # each handed tensor was freed before the next was asked for
    want, got = tensors(old), tensors(saved.path)
    assert got["model.layers.0.mlp.up_proj.MatMul.weight"].dtype == np.float16 and got["cos_cache"].dtype == np.float32
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_missing_data_is_named(tmp_path, small):
    model = ir.load(str(small))
    model.graph.initializers["model.norm.weight"].const_value = None
    with pytest.raises(ValueError, match="'model.norm.weight' has no data"):
        save_model(model, tmp_path / "new", external=True)


def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path, small):
    model = ir.load(str(small))
    with pytest.raises(AssertionError, match="model.norm.weight: tensor \\[3\\]"):
        save_model(model, tmp_path / "new", external=True,
                   source=lambda name: torch.ones(3) if name == "model.norm.weight" else None)


def test_transposed_and_cast_views_are_written_a_slab_at_a_time(tmp_path, monkeypatch):
    """W^T handed over as a view of fp32 W into an fp16 graph, 1 KiB slabs: the bytes of W.T cast whole."""
    import llama_tools.exporters.onnx_save as onnx_save

    monkeypatch.setattr(onnx_save, "SLAB_BYTES", 1024)
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))  # [out, in]
    value = ir.Value(name="w_t", shape=ir.Shape([80, 48]), type=ir.TensorType(ir.DataType.FLOAT16))  # [in, out]
    y = ir.Value(name="y", shape=ir.Shape([2, 48]), type=ir.TensorType(ir.DataType.FLOAT16))
    x = ir.Value(name="x", shape=ir.Shape([2, 80]), type=ir.TensorType(ir.DataType.FLOAT16))
    graph = ir.Graph([x], [y], nodes=[ir.Node("", "MatMul", [x, value], outputs=[y])], initializers=[value],
                     opset_imports={"": 20}, name="slabs")
    seen = []

    def source(name):
        seen.append(name)
        return w.T  # a non-contiguous fp32 view, never made contiguous whole
    saved = save_model(ir.Model(graph, ir_version=10), tmp_path, source=source, external=True)
    assert seen == ["w_t"] and saved.data_bytes == 80 * 48 * 2
    got = numpy_helper.to_array(onnx.load(str(saved.path)).graph.initializer[0], base_dir=str(tmp_path))
    assert got.shape == (80, 48) and got.dtype == np.float16
    np.testing.assert_array_equal(got, w.T.contiguous().half().numpy())
    with pytest.raises(AssertionError):  # the check can fail: W itself is not what was stored
        np.testing.assert_array_equal(got, w.half().numpy().reshape(80, 48))


@pytest.mark.parametrize("external", [True, False])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.BFLOAT16])
def test_a_transposed_row_source_is_written_from_row_slabs(tmp_path, monkeypatch, external, dtype):
    """Rows(transposed=True): W^T [80, 48] from W's row slabs (1 KiB: several) in positioned writes, between two
    other tensors, so its offset and the file's end are checked too; the same bytes as W.T cast whole."""
    import llama_tools.exporters.onnx_save as onnx_save
    from llama_tools.exporters.onnx_save import Rows

    monkeypatch.setattr(onnx_save, "SLAB_BYTES", 1024)
    monkeypatch.setattr(onnx_save, "INLINE_MAX_BYTES", 16)
    gen = torch.Generator().manual_seed(0)
    w, before, after = torch.randn(48, 80, generator=gen), torch.randn(8, 48, generator=gen), torch.randn(48, generator=gen)
    t = ir.TensorType(dtype)
    vals = [ir.Value(name="before", shape=ir.Shape([8, 48]), type=t), ir.Value(name="w_t", shape=ir.Shape([80, 48]), type=t),
            ir.Value(name="after", shape=ir.Shape([48]), type=t)]
    x = ir.Value(name="x", shape=ir.Shape([2, 80]), type=t)
    y, z = (ir.Value(name=n, shape=ir.Shape([2, 48]), type=t) for n in "yz")
    graph = ir.Graph([x], [z], nodes=[ir.Node("", "MatMul", [x, vals[1]], outputs=[y]),
                                      ir.Node("", "Add", [y, vals[2]], outputs=[z])],
                     initializers=vals, opset_imports={"": 20}, name="rows")
    reads = []

    def rows(a, b):
        reads.append((a, b))
        return w[a:b]  # [b - a, 80]
    source = {"before": before, "w_t": Rows((80, 48), rows, transposed=True), "after": after}
    saved = save_model(ir.Model(graph, ir_version=10), tmp_path, source=source.get, external=external)
    want = {"before": before, "w_t": w.T, "after": after}
    torch_dtype = torch.float32 if dtype == ir.DataType.FLOAT else torch.bfloat16
    for init in onnx.load(str(saved.path)).graph.initializer:
        got = torch.from_numpy(numpy_helper.to_array(init, base_dir=str(tmp_path)).astype(np.float32))
        assert tuple(got.shape) == tuple(want[init.name].shape)
        torch.testing.assert_close(got, want[init.name].to(torch_dtype).float(), rtol=0, atol=0)
    if external:
        assert len(reads) > 1 and all(b - a <= 1024 // (80 * torch_dtype.itemsize) for a, b in reads)  # slabs
        assert saved.data_bytes == (8 * 48 + 80 * 48 + 48) * torch_dtype.itemsize
    with pytest.raises(AssertionError):  # the check can fail: W itself is not what was stored
        torch.testing.assert_close(w.reshape(80, 48), w.T.contiguous(), rtol=0, atol=0)
