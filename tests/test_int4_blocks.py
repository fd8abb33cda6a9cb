"""imatrix int4 blocks (exporters/int4_blocks.py): onnxruntime's MatMulNBits kernel reads them as we mean them,
the search is never worse than round to nearest, and the importance decides which weights it fits best."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from llama_tools.exporters import int4_blocks as ib


def kernel(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, x: np.ndarray, *, k: int, n: int,
           bits: int) -> np.ndarray:
    """onnxruntime's MatMulNBits on x [m, k] (accuracy level 0: fp32 arithmetic, no int8 activations)."""
    inputs, inits = ["X", "B", "S"], [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
    if zero_points is not None:
        inputs.append("Z")
        inits.append(numpy_helper.from_array(zero_points, "Z"))
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=32,
                            accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [x.shape[0], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]


@pytest.mark.parametrize("k, n, bits", [(96, 40, 4), (80, 8, 4), (64, 24, 8)])  # 80: 3 blocks, the last zero point alone
def test_the_kernel_reads_our_blocks_as_we_mean_them(k, n, bits):
    rng = np.random.default_rng(k + n + bits)
    w = rng.standard_normal((n, k)).astype(np.float32)
    blocks = ib.search(w, rng.random(k).astype(np.float32), bits=bits)
    assert blocks.codes.shape == (n, -(-k // 32), 32) and blocks.codes.dtype == np.uint8
    assert blocks.scales.shape == blocks.zeros.shape == (n, -(-k // 32)) and blocks.scales.dtype == np.float32
    assert blocks.codes.max() < 2**bits and blocks.zeros.max() < 2**bits
    t = ib.pack(blocks)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ blocks.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(kernel(t["B"], t["scales"], t["zero_points"], x, k=k, n=n, bits=bits), want,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ib.unpack(t["B"], t["scales"], t["zero_points"], bits=bits, k=k), blocks.dequantize())
    if bits == 4:  # negative: the nibbles the other way round is another matrix
        swapped = ((t["B"] >> 4) | (t["B"] << 4)).astype(np.uint8)
        assert not np.allclose(kernel(swapped, t["scales"], t["zero_points"], x, k=k, n=n, bits=bits), want, atol=1e-3)


def ort_rtn(w: np.ndarray, symmetric: bool) -> tuple[dict[str, np.ndarray], int]:
    """onnxruntime's own RTN quantizer (the builder's) on W [n, k] -> its MatMulNBits tensors by role."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    q = mnq.DefaultWeightOnlyQuantizer(mnq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric,
                                                                        accuracy_level=0))
    graph = helper.make_graph([], "g", [], [], initializer=[numpy_helper.from_array(np.ascontiguousarray(w.T), "W")])
    made = q.quantize(helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm"), [graph])
    node = next(m for m in made if m.op_type == "MatMulNBits")
    by_name = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    roles = dict(zip(("B", "scales", "zero_points"), node.input[1:]))
    return {r: by_name[name] for r, name in roles.items() if name}, w.shape[1]


def test_unpack_reads_onnxruntimes_own_tensors():
    """An independent writer: onnxruntime's quantizer's tensors, unpacked by us, are what its kernel computes."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    for symmetric in (True, False):
        t, k = ort_rtn(w, symmetric)
        ours = ib.unpack(t["B"], t["scales"], t.get("zero_points"), bits=4, k=k)
        np.testing.assert_allclose(x @ ours.T, kernel(t["B"], t["scales"], t.get("zero_points"), x, k=k, n=24, bits=4),
                                   rtol=1e-5, atol=1e-5)
        assert np.abs(ours - w).max() < np.abs(w).max() / 7  # within a step of a block's range


def block_errors(w: np.ndarray, wq: np.ndarray, a: np.ndarray) -> np.ndarray:
    """The importance-weighted squared error of each block of 32: [n, k / 32]."""
    return ((w - wq) ** 2 * a).reshape(w.shape[0], -1, 32).sum(-1)


def test_never_worse_than_round_to_nearest_in_any_block():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 128)) * rng.gamma(1.0, 1.0, (64, 1))).astype(np.float32)
    w[:, 5] *= 8  # an outlier column, as trained weights have
    a = rng.gamma(0.5, 1.0, 128).astype(np.float32)
    ours = block_errors(w, ib.search(w, a).dequantize(), a)
    for symmetric in (True, False):
        t, k = ort_rtn(w, symmetric)
        theirs = block_errors(w, ib.unpack(t["B"], t["scales"], t.get("zero_points"), bits=4, k=k), a)
        assert (ours <= theirs * (1 + 1e-5) + 1e-12).all()
        assert ours.sum() < 0.9 * theirs.sum()  # and better overall: the search finds something


def test_the_light_search_sits_between_round_to_nearest_and_the_full_search():
    """LIGHT keeps round to nearest's two starts, so it is never worse than either in any block; the full search
    tries what it tries and more, so it is never worse than LIGHT on the whole; and LIGHT does cost something."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 128)) * rng.gamma(1.0, 1.0, (64, 1))).astype(np.float32)
    w[:, 5] *= 8
    a = rng.gamma(0.5, 1.0, 128).astype(np.float32)
    light = block_errors(w, ib.search(w, a, **ib.LIGHT).dequantize(), a)
    full = block_errors(w, ib.search(w, a).dequantize(), a)
    for symmetric in (True, False):
        t, k = ort_rtn(w, symmetric)
        theirs = block_errors(w, ib.unpack(t["B"], t["scales"], t.get("zero_points"), bits=4, k=k), a)
        assert (light <= theirs * (1 + 1e-5) + 1e-12).all()
    assert full.sum() <= light.sum() * (1 + 1e-6)
    assert (full < light * (1 - 1e-3)).any()  # some block where the full search's extra refit pays


def test_a_block_on_an_integer_grid_is_held_exactly():
    """Weights that are s (q - z) for integer codes: the search finds s and z; symmetric RTN cannot."""
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 16, (4, 64))
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every block spans the whole grid
    z = rng.integers(1, 15, (4, 2)).repeat(32, axis=1)
    w = (0.013 * (codes - z)).astype(np.float32)
    np.testing.assert_allclose(ib.search(w).dequantize(), w, atol=1e-6)
    t, k = ort_rtn(w, True)
    assert np.abs(ib.unpack(t["B"], t["scales"], None, bits=4, k=k) - w).max() > 1e-3


def test_the_importance_decides_which_weights_fit_best():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    a = np.ones(64, np.float32)
    a[3], a[40] = 1000.0, 1000.0  # two inputs that are always large
    weighted, uniform = ib.search(w, a).dequantize(), ib.search(w).dequantize()
    err = lambda wq: np.abs(wq - w)[:, [3, 40]].mean()  # noqa: E731
    assert err(weighted) < 0.5 * err(uniform)
    assert block_errors(w, weighted, a).sum() < block_errors(w, uniform, a).sum()


def test_fake_quant_is_the_search_and_keeps_the_dtype():
    w = torch.randn(16, 64, dtype=torch.float64)
    got = ib.fake_quant(w, torch.rand(64))
    assert got.dtype == torch.float64 and got.shape == w.shape and not torch.equal(got, w)
    a = torch.rand(64)
    np.testing.assert_array_equal(ib.fake_quant(w.float(), a).numpy(), ib.search(w.float(), a).dequantize())


def test_a_few_rows_at_a_time_changes_nothing(monkeypatch):
    w = torch.randn(300, 64)
    a = torch.rand(64)
    whole = ib.search(w, a)
    monkeypatch.setattr(ib, "ROWS_BYTES", 64 * 4 * 7)  # 7 rows per step
    part = ib.search(w, a)
    for f in ("codes", "scales", "zeros"):
        np.testing.assert_array_equal(getattr(part, f), getattr(whole, f))


def test_the_export_measures_importance_and_the_graph_holds_the_emulation(tmp_path):
    """importance(): each projection's a_k is the mean square of its input on the ids, as forward hooks on the
    in-memory model see it (an independent run); quantize_int4 with it writes what fake_quant emulates."""
    import onnx

    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import HEAD, importance, quantize_nodes
    from llama_tools.exporters.quantize import _weights_of, quantize_int4
    from llama_tools.inference.reference import reference_model
    from llama_tools.modeling.model import build_model

    src = resolve("tiny")
    full = tmp_path / "full.onnx"
    export_fused("tiny", full)
    nodes = quantize_nodes(full, {})
    ids = list(range(5, 45))
    got = importance(reference_model(src), ids, nodes, bf16=False)  # fp32 products: the exact measurement
    model = build_model(src.cfg, seed=0).eval()
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, inp[0].double()[0] ** 2))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    hooks.append(model.model.norm.register_forward_hook(lambda mod, inp, out: seen.__setitem__("head", out.double()[0] ** 2)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    want = {"/model/layers.1/self_attn/qkv_proj/MatMul": "model.layers.1.self_attn.q_proj",
            "/model/layers.0/self_attn/o_proj/MatMul": "model.layers.0.self_attn.o_proj",
            "/model/layers.1/mlp/gate_up_proj/MatMul": "model.layers.1.mlp.gate_proj",
            "/model/layers.0/mlp/down_proj/MatMul": "model.layers.0.mlp.down_proj", HEAD: "head"}
    assert set(want) <= set(got) and len(got) == len(nodes)
    for node, module in want.items():
        assert got[node].shape == (seen[module].shape[-1],) and got[node].dtype == torch.float32
        np.testing.assert_allclose(got[node].numpy(), seen[module].mean(0).numpy(), rtol=2e-4, atol=1e-7)
    # negative: another layer's input is another measurement (the check can tell them apart)
    assert not np.allclose(got["/model/layers.0/self_attn/qkv_proj/MatMul"].numpy(), seen[want[
        "/model/layers.1/self_attn/qkv_proj/MatMul"]].mean(0).numpy(), rtol=2e-4, atol=1e-7)
    out = quantize_int4(full, tmp_path / "int4.onnx", algorithm="imatrix", importance=got)
    m = onnx.load(str(out.path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    weights = _weights_of(onnx.load(str(full)))
    fp = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(full)).graph.initializer}
    node = "/model/layers.0/mlp/down_proj/MatMul"
    nb = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.startswith(node))
    name, transposed = weights[node]
    w = fp[name] if transposed else fp[name].T  # [out, in]
    held = ib.unpack(inits[nb.input[1]], inits[nb.input[2]], inits[nb.input[3]], bits=4, k=w.shape[1])
    np.testing.assert_array_equal(held, ib.fake_quant(torch.from_numpy(w.copy()), got[node]).numpy())
    assert not np.array_equal(held, ib.fake_quant(torch.from_numpy(w.copy()), None).numpy())  # the importance counted


def test_importance_over_windows_is_the_mean_over_every_position(tmp_path, monkeypatch):
    """Windows (each from position 0) batched, a few at a time: a_k is the mean of x_k^2 over every position of every
    window, as the in-memory model sees each window run alone; the batch size changes nothing."""
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters import int4_target
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import HEAD, importance, quantize_nodes
    from llama_tools.inference.reference import reference_model
    from llama_tools.modeling.model import build_model

    src = resolve("tiny")
    full = tmp_path / "full.onnx"
    export_fused("tiny", full)
    nodes = quantize_nodes(full, {})
    rng = np.random.default_rng(3)
    windows = [rng.integers(3, src.cfg.vocab_size, 24).tolist() for _ in range(5)]
    got = importance(reference_model(src), windows, nodes, bf16=False)
    model = build_model(src.cfg, seed=0).eval()
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        sums[name] = sums.get(name, 0) + (x.double()[0] ** 2).sum(0)
    hooks = [model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: add("down", i[0])),
             model.model.norm.register_forward_hook(lambda m, i, o: add("head", o))]
    with torch.no_grad():
        for w in windows:  # each alone, from position 0
            model(torch.tensor([w]))
    for h in hooks:
        h.remove()
    n = sum(map(len, windows))
    for node, name in (("/model/layers.1/mlp/down_proj/MatMul", "down"), (HEAD, "head")):
        np.testing.assert_allclose(got[node].numpy(), (sums[name] / n).numpy(), rtol=2e-4, atol=1e-7)
    monkeypatch.setattr(int4_target, "STREAM_BATCH_BYTES", 1)  # one window at a time
    one = importance(reference_model(src), windows, nodes, bf16=False)
    for node in got:
        np.testing.assert_allclose(one[node].numpy(), got[node].numpy(), rtol=1e-5, atol=1e-9)
    # negative: the first window alone is another measurement
    first = importance(reference_model(src), windows[0], nodes, bf16=False)
    assert not np.allclose(first[HEAD].numpy(), got[HEAD].numpy(), rtol=2e-4, atol=1e-7)


def test_importance_and_probes_in_bf16_are_the_fp32_measurements_to_bf16s_precision(tmp_path):
    """bf16 products (the default where the CPU has AMX): every matrix's importance within 3% of the fp32 pass's
    (norm of the difference), and the sensitivity pass's probes carried back in bf16 rank the matrices as fp32's
    do, each KL_m within 5%; not equal (bf16 really ran), and every Linear computes in fp32 again after."""
    from llama_tools.checkpoints.source import resolve
    from llama_tools.exporters import int4_target
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.int4_target import importance, matrices, quantize_nodes, sensitivities
    from llama_tools.inference.reference import reference_model

    src = resolve("tiny")
    full = tmp_path / "full.onnx"
    export_fused("tiny", full)
    nodes = quantize_nodes(full, {})
    ids = np.random.default_rng(5).integers(3, src.cfg.vocab_size, 48).tolist()
    ref = reference_model(src)
    exact, fast = importance(ref, ids, nodes, bf16=False), importance(ref, ids, nodes, bf16=True)
    for node in nodes:
        assert fast[node].dtype == exact[node].dtype == torch.float32
        assert float((fast[node] - exact[node]).norm() / exact[node].norm()) < 0.03, node
    assert any(not torch.equal(fast[n], exact[n]) for n in nodes)
    mats = matrices(nodes)
    a, b = (sensitivities(ref, ids, mats, 32, bf16=flag) for flag in (False, True))
    layers = [m.node for m in mats if m.layer is not None]
    assert sorted(layers, key=a.get) == sorted(layers, key=b.get) and a != b
    assert all(abs(b[n] / a[n] - 1) < 0.05 for n in layers)
    x = torch.randn(2, src.cfg.hidden_size)
    half = ref._half(0, True)
    with torch.no_grad(), int4_target._bf16_products(half):
        inside = half.self_attn.o_proj(x)
    after = half.self_attn.o_proj(x)
    assert not torch.equal(inside, after) and "forward" not in vars(half.self_attn.o_proj)
    torch.testing.assert_close(after, x @ half.self_attn.o_proj.weight.T, rtol=1e-5, atol=1e-6)


def test_the_calibration_corpus_in_windows():
    """Every built-in file is in the corpus; windows of WINDOW tokens from position 0, the last ending at its end."""
    from importlib import resources

    from llama_tools.checkpoints.source import load_tokenizer, resolve
    from llama_tools.exporters.int4_target import MAX_WINDOWS, WINDOW, calibration_ids, calibration_windows
    from llama_tools.exporters.prompts import PASSAGES

    src = resolve("tiny")
    tok = load_tokenizer(src)
    windows, said = calibration_windows(tok, src.cfg.vocab_size)
    folder = resources.files("llama_tools") / "data" / "calibration"
    files = sorted(f for f in folder.iterdir() if f.name.endswith(".txt"))
    assert len(files) >= 8
    texts = [t for _, t in PASSAGES] + [f.read_text(encoding="utf-8") for f in files]
    ids = tok.encode("\n\n".join(texts))
    bos = src.cfg.bos_token_id
    assert tok.encode("") == [bos] and ids[0] == bos  # tiny's sentencepiece tokenizer leads with <s>
    assert len(ids) > 8 * WINDOW  # far more than the sensitivity pass's 192 tokens
    assert 1 < len(windows) <= MAX_WINDOWS and all(len(w) == WINDOW for w in windows)
    assert all(w[0] == bos and bos not in w[1:] for w in windows)  # every window starts as a prompt does
    body = WINDOW - 1
    assert windows[0] == ids[:WINDOW] and windows[1] == [bos] + ids[1 + body:1 + 2 * body]
    assert windows[-1] == [bos] + ids[-body:] or len(ids) > MAX_WINDOWS * body
    assert f"{len(windows)} windows" in said
    # the sensitivity pass's text is the corpus' start (the passages)
    assert calibration_ids(tok, src.cfg.vocab_size)[0] == ids[:192]


def reference_search(w: np.ndarray, a: np.ndarray, trims=ib.TRIMS, refits=ib.REFITS, qmax: int = 15) -> np.ndarray:
    """A second implementation of the block search, in float64 numpy over every block at once: each candidate's
    weighted error summed as written in the module docstring -> the least error per block [n, k / 32]."""
    x = w.astype(np.float64).reshape(w.shape[0], -1, 32)
    aa = a.astype(np.float64).reshape(1, -1, 32)
    aa = aa + 1e-6 * aa.mean()
    lo, hi = np.minimum(x.min(-1, keepdims=True), 0), np.maximum(x.max(-1, keepdims=True), 0)
    starts = [(np.maximum((hi - lo) * (1 - cl - ch) / qmax, 1e-30), None, cl) for cl, ch in trims]
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    half = (qmax + 1) // 2
    starts.append((np.where(peak == 0, 1e-30, peak / -half), np.full_like(peak, half), None))
    best = np.full(x.shape[:2] + (1,), np.inf)
    for s, z, cut in starts:
        z = np.clip(np.rint(-(lo + cut * (hi - lo)) / s), 0, qmax) if z is None else z
        for refit in range(refits + 1):
            c = np.clip(np.rint(x / s + z), 0, qmax) - z
            best = np.minimum(best, (aa * (x - s * c) ** 2).sum(-1, keepdims=True))
            den = (aa * c * c).sum(-1, keepdims=True)
            fit = (aa * x * c).sum(-1, keepdims=True) / np.maximum(den, 1e-300)
            s = np.where((den > 0) & (np.abs(fit) > 1e-30), fit, s)
    return best[..., 0]


@pytest.mark.parametrize("options", [{}, ib.LIGHT], ids=["full", "light"])
def test_the_compiled_search_finds_what_a_float64_search_finds(options):
    """The kernel against reference_search: every block's weighted error equal to fp32 rounding (its sums run in
    fp32), none worse by more; negative: one refit fewer is measurably worse somewhere."""
    rng = np.random.default_rng(13)
    w = (rng.standard_normal((96, 160)) * rng.gamma(1.0, 1.0, (96, 1))).astype(np.float32)
    w[:, 7] *= 6
    a = rng.gamma(0.5, 1.0, 160).astype(np.float32)
    ours = block_errors(w.astype(np.float64), ib.search(w, a, **options).dequantize().astype(np.float64),
                        a.astype(np.float64) + 1e-6 * a.mean())
    want = reference_search(w, a, **options)
    assert ours.shape == want.shape == (96, 5)
    assert (ours <= want * (1 + 1e-4) + 1e-12).all()
    np.testing.assert_allclose(ours.sum(), want.sum(), rtol=1e-5)
    fewer = {**{"trims": ib.TRIMS, "refits": ib.REFITS}, **options}
    weaker = reference_search(w, a, fewer["trims"], fewer["refits"] - 1)
    assert (ours < weaker * (1 - 1e-3)).any()


def test_a_transposed_view_gives_the_blocks_of_its_copy():
    """The kernel's sums follow the memory layout, so W is searched in C order whatever it arrives in: a graph's
    W^T read back transposed (Fortran order) holds the very blocks the emulation searched."""
    rng = np.random.default_rng(17)
    wt = rng.standard_normal((160, 48)).astype(np.float32)  # [k, n] as a graph stores it
    a = rng.random(160).astype(np.float32)
    view, copy = ib.search(wt.T, a), ib.search(np.ascontiguousarray(wt.T), a)
    for f in ("codes", "scales", "zeros"):
        np.testing.assert_array_equal(getattr(view, f), getattr(copy, f))


def test_rtn_options_are_onnxruntimes_asymmetric_round_to_nearest():
    """int4_blocks.RTN (the search's first start alone, what int4_scales ranks alphas by) holds exactly what
    onnxruntime's own asymmetric RTN quantizer holds; the default search does not (it finds better)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    t, k = ort_rtn(w, False)
    theirs = ib.unpack(t["B"], t["scales"], t["zero_points"], bits=4, k=k)
    np.testing.assert_array_equal(ib.search(w, **ib.RTN).dequantize(), theirs)
    assert not np.array_equal(ib.search(w).dequantize(), theirs)


def test_each_blocks_error_is_the_weighted_error_of_what_it_holds():
    rng = np.random.default_rng(19)
    w = (rng.standard_normal((24, 96)) * 0.05).astype(np.float32)
    a = rng.gamma(0.5, 1.0, 96).astype(np.float32)
    for options in ({}, ib.LIGHT, ib.RTN):
        b = ib.search(w, a, **options)
        want = block_errors(w.astype(np.float64), b.dequantize().astype(np.float64), a + 1e-6 * a.mean())
        assert b.errors.shape == (24, 3) and b.errors.dtype == np.float32
        np.testing.assert_allclose(b.errors, want, rtol=1e-5)
