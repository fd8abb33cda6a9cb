"""The plain export traces two decoders and stamps the others from decoder 1: the same graph as tracing every one.

Each case exports one model both ways (export_onnx, and export_onnx(_stamp=False), which traces all layers as
before) and holds them to: the same op sequence, node names, attributes and wiring, the same initializer names,
shapes and bytes, the same graph inputs/outputs and metadata, byte-identical files, and onnxruntime outputs
equal to the last bit. A rewired copy (a decoder fed the wrong layer's output, names untouched) proves the
comparison bites. Three or four layers, so decoders 2 and 3 are stamped, one from the other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import helpers
from helpers import sharp
from llama_tools.checkpoints.convert import save_checkpoint
from llama_tools.exporters.graph_io import io_names
from llama_tools.exporters import trace
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.trace import STAMP_FROM, TRACE_CACHE_ENV
from llama_tools.modeling.presets import get_preset

TINY = get_preset("tiny").replace(max_position_embeddings=64)


@pytest.fixture(autouse=True)
def no_trace_cache(monkeypatch):
    """Every export here traces (a cached trace is tested on its own, last)."""
    monkeypatch.setenv(TRACE_CACHE_ENV, "off")


def graph_summary(m: onnx.ModelProto) -> dict:
    """What "the same graph" means, each part comparable on its own (for a readable failure)."""
    g = m.graph
    return {
        "ops": [(n.domain, n.op_type) for n in g.node],
        "node names": [n.name for n in g.node],
        "wiring": [(n.name, list(n.input), list(n.output)) for n in g.node],
        "attributes": [(n.name, [a.SerializeToString() for a in n.attribute]) for n in g.node],
        "initializers": [(t.name, list(t.dims), t.data_type) for t in g.initializer],
        "inputs": [i.SerializeToString() for i in g.input],
        "outputs": [o.SerializeToString() for o in g.output],
        "metadata": {p.key: p.value for p in m.metadata_props},
        "functions": [f.SerializeToString() for f in m.functions],
        "opsets": sorted((o.domain, o.version) for o in m.opset_import),
    }


def differences(a: onnx.ModelProto, b: onnx.ModelProto) -> list[str]:
    """The parts of graph_summary where a and b differ."""
    sa, sb = graph_summary(a), graph_summary(b)
    return [k for k in sa if sa[k] != sb[k]]


def outputs(path: Path, cfg, seed: int) -> list[np.ndarray]:
    """onnxruntime's logits and presents for a prefill over a past of 3 (all layers' caches random)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = helpers.token_ids(2, 5, cfg, seed).numpy()
    rng = np.random.default_rng(seed)
    dtype = np.float16 if sess.get_inputs()[3].type == "tensor(float16)" else np.float32
    past = [rng.standard_normal((2, cfg.num_key_value_heads, 3, cfg.head_dim)).astype(dtype)
            for _ in range(2 * cfg.num_hidden_layers)]
    mask = np.ones((2, 8), np.int64)
    mask[1, :2] = 0  # left padding in row 1
    inputs, _ = io_names(cfg.num_hidden_layers)
    feed = dict(zip(inputs, [ids, mask, np.clip(mask.cumsum(-1) - 1, 0, None)[:, 3:], *past]))
    return sess.run(None, feed)


def export_both(source, tmp: Path, **kwargs) -> tuple[Path, Path]:
    """(stamped, traced whole) exports of one source."""
    new = export_onnx(source, tmp / "stamped" / "model.onnx", **kwargs)
    old = export_onnx(source, tmp / "traced" / "model.onnx", _stamp=False, **kwargs)
    assert new.num_nodes == old.num_nodes and new.rope_nodes == old.rope_nodes
    return new.path, old.path


def assert_same_export(new: Path, old: Path, cfg, seed: int = 0) -> None:
    a, b = onnx.load(str(new), load_external_data=False), onnx.load(str(old), load_external_data=False)
    assert differences(a, b) == []
    assert new.read_bytes() == old.read_bytes()
    for data in (new.parent / (new.name + ".data"),):
        if data.exists():
            assert data.read_bytes() == (old.parent / data.name).read_bytes()
    for x, y in zip(outputs(new, cfg, seed), outputs(old, cfg, seed), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)  # bit-identical: the same graph, the same kernels


@pytest.mark.slow
def test_four_layers_stamped_equal_four_traced_and_progress_covers_tracing(tmp_path):
    cfg = TINY.replace(num_hidden_layers=4)
    calls: list[tuple[int, int, str]] = []
    model = sharp(cfg)
    new = export_onnx(model, tmp_path / "stamped" / "model.onnx",
                      progress=lambda done, total, what: calls.append((done, total, what)))
    old = export_onnx(model, tmp_path / "traced" / "model.onnx", _stamp=False).path
    assert_same_export(new.path, old, cfg)
    steps = [(d, t) for d, t, w in calls if "weights" not in w]
    assert steps[0] == (0, 4) and "tracing 2 decoder layers" in calls[0][2]
    assert steps[-1] == (4, 4) and [d for d, _ in steps if d] == [STAMP_FROM, 3, 4]  # then one per stamped layer
    assert sum(n.name.startswith("/model/layers.3/") for n in onnx.load(str(new.path)).graph.node) == \
        sum(n.name.startswith("/model/layers.1/") for n in onnx.load(str(new.path)).graph.node)


@pytest.mark.slow
def test_a_checkpoint_streamed_to_external_data_tied_biases_window(tmp_path):
    # Weights read from the checkpoint one at a time into OUT.data (threshold 0), folded transposes per layer.
    cfg = TINY.replace(family="qwen2", num_hidden_layers=3, tie_word_embeddings=True, qkv_bias=True,
                       sliding_window=4)
    save_checkpoint(cfg, {k: v.clone() for k, v in sharp(cfg, seed=3).state_dict().items()}, tmp_path / "ckpt")
    new, old = export_both(str(tmp_path / "ckpt"), tmp_path, external_data_threshold_bytes=0)
    assert (new.parent / "model.onnx.data").stat().st_size > 0
    assert_same_export(new, old, cfg, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe-fp16-contrib", "alibi"])
def test_moe_fp16_contrib_rope_and_alibi(case, tmp_path):
    if case == "alibi":
        cfg, kwargs = TINY.replace(family="baichuan", position_encoding="alibi", num_key_value_heads=4,
                                   num_hidden_layers=3), {}
    else:
        cfg = TINY.replace(family="mixtral", num_experts=4, num_experts_per_tok=2, intermediate_size=64,
                           num_hidden_layers=3)
        kwargs = {"dtype": "float16", "rope_op": "contrib"}
    new, old = export_both(sharp(cfg, seed=4), tmp_path, **kwargs)
    assert_same_export(new, old, cfg, seed=2)


@pytest.mark.slow
def test_the_comparison_catches_a_decoder_fed_the_wrong_layer(tmp_path):
    cfg = TINY.replace(num_hidden_layers=3)
    new, old = export_both(sharp(cfg, seed=5), tmp_path)
    m = onnx.load(str(new))
    # Decoder 2's first norm reads decoder 0's output instead of decoder 1's: names, ops and shapes unchanged.
    feeds = {n.name: n for n in m.graph.node}
    pow2 = feeds["/model/layers.2/input_layernorm/Pow"]
    pow1 = feeds["/model/layers.1/input_layernorm/Pow"]
    assert pow2.input[0] != pow1.input[0]
    for n in m.graph.node:
        if n.name.startswith("/model/layers.2/"):
            n.input[:] = [pow1.input[0] if i == pow2.input[0] else i for i in n.input]
    bad = tmp_path / "rewired.onnx"
    onnx.save(m, str(bad))
    assert differences(m, onnx.load(str(old))) == ["wiring"]
    assert not all(np.array_equal(x, y) for x, y in zip(outputs(bad, cfg, 0), outputs(old, cfg, 0)))
    with pytest.raises(AssertionError):
        assert_same_export(bad, old, cfg)


@pytest.mark.slow
def test_a_cached_trace_gives_the_same_file_without_tracing(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_CACHE_ENV, str(tmp_path / "traces"))
    cfg = TINY.replace(num_hidden_layers=3)
    model = sharp(cfg, seed=6)
    first = export_onnx(model, tmp_path / "a" / "model.onnx").path
    [entry] = (tmp_path / "traces").iterdir()
    traced = trace._trace

    def refuse(*args, **kwargs):
        raise AssertionError("traced again")
    monkeypatch.setattr(trace, "_trace", refuse)
    calls: list[str] = []
    second = export_onnx(model, tmp_path / "b" / "model.onnx", progress=lambda d, t, w: calls.append(w)).path
    assert second.read_bytes() == first.read_bytes() and "2 layers traced (cached)" in calls
    with pytest.raises(AssertionError, match="traced again"):  # another dtype: another trace
        export_onnx(model, tmp_path / "c" / "model.onnx", dtype="float16")
    entry.write_bytes(entry.read_bytes()[:100])  # a half-written entry: traced afresh, not an error
    monkeypatch.setattr(trace, "_trace", traced)
    assert export_onnx(model, tmp_path / "d" / "model.onnx").path.read_bytes() == first.read_bytes()
