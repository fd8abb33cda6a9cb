"""The onnxruntime runner: provider options, bf16 through OrtValues, the cache kept on the device, errors.

CPU tests check everything the CPU can: the options handed to onnxruntime, bf16 bit conversions against
torch, IOBinding with 'cpu' OrtValues against plain numpy feeds, a bf16 graph made of ops the CPU has.
Tests marked `gpu` run the same on CUDA and are skipped (with the reason) where CUDA cannot start.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import llama_tools.exporters.runtime as runtime
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.modeling.presets import get_preset
from llama_tools.modeling.model import build_model

TINY = get_preset("tiny")  # 2 layers, GQA 4/2 heads, n6 = 16


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    return export_onnx("tiny", tmp_path_factory.mktemp("rt") / "tiny.onnx").path


def lm(path, provider="auto", io="device", **kw) -> runtime.OnnxLM:
    s = runtime.create_session(path, provider, **kw)
    return runtime.OnnxLM(s, TINY.num_hidden_layers, TINY.num_key_value_heads, TINY.head_dim, io=io)


def greedy(model: runtime.OnnxLM, steps: int = 4) -> tuple[list[np.ndarray], runtime.StepOutput]:
    """A left-padded batch of 2, then `steps` greedy steps through the model's own cache."""
    ids = np.array([[0, 0, 1, 17, 300], [1, 450, 29, 8, 77]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)  # [2, 5]
    out = model(ids, mask, pos, model.empty_cache(2))
    logits = [out.logits]
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)  # [2, past + 1]
        nxt = out.logits[:, -1].argmax(-1)[:, None]  # [2, 1]
        out = model(nxt, mask, mask.sum(-1, keepdims=True) - 1, out.cache)
        logits.append(out.logits)
    return logits, out


# --- bfloat16 bits ----------------------------------------------------------------------------------------

def torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    edge = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.0, 1e-40, 3.39e38, 3.4e38,
                     np.inf, -np.inf], np.float32)  # ties to even both ways, a subnormal, overflow to inf
    wide = rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)  # magnitudes 1e-30 .. 1e30
    x = np.concatenate([edge, wide.astype(np.float32)])
    bits = runtime.float32_to_bf16_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    np.testing.assert_array_equal(bits, torch_bits(x))
    back = runtime.bf16_bits_to_float32(bits)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    nan = runtime.float32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(runtime.bf16_bits_to_float32(nan)).all()
    truncated = (x.view(np.uint32) >> 16).astype(np.uint16)  # negative: chopping instead of rounding differs
    assert (truncated != torch_bits(x)).sum() > 1000


def test_every_bf16_value_round_trips():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    wide = runtime.bf16_bits_to_float32(bits)
    ok = ~np.isnan(wide)
    assert ok.sum() == 2**16 - 254  # 2 x 127 NaN payloads
    np.testing.assert_array_equal(runtime.float32_to_bf16_bits(wide[ok]), bits[ok])
    np.testing.assert_array_equal(wide[ok], torch.from_numpy(bits[ok].view(np.int16)).view(torch.bfloat16).float())


def test_ortvalue_round_trip_keeps_bf16_bits():
    x = np.array([[1.0, 1 + 2**-8, -2.5e-3], [65504.0, 1e30, -0.0]], np.float32)
    v = runtime.numpy_to_ortvalue(x, "tensor(bfloat16)")
    assert v.data_type() == "tensor(bfloat16)" and v.shape() == [2, 3]
    np.testing.assert_array_equal(runtime.ortvalue_to_numpy(v), torch.from_numpy(x).bfloat16().float().numpy())
    f = runtime.numpy_to_ortvalue(x[:, ::2], "tensor(float16)")
    assert f.data_type() == "tensor(float16)" and runtime.ortvalue_to_numpy(f).dtype == np.float16


# --- provider options -------------------------------------------------------------------------------------

class FakeSession:
    def __init__(self, providers, reported=None):
        self._providers = [p[0] if isinstance(p, tuple) else p for p in providers]
        self.asked = providers
        self.reported = reported

    def get_providers(self):
        return self._providers

    def get_provider_options(self):
        return self.reported or {}


def test_cuda_gets_tf32_off_unless_asked(monkeypatch, tiny_onnx):
    import onnxruntime as ort

    made = []

    def fake(path, providers):
        made.append(FakeSession(providers, {"CUDAExecutionProvider": {"use_tf32": providers[0][1]["use_tf32"],
                                                                      "device_id": "0"}}))
        return made[-1]

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "_new_session", fake)
    s = runtime.create_session(tiny_onnx, "cuda")
    assert made[-1].asked[0] == ("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "0"})
    assert s.options == {"provider": "CUDAExecutionProvider", "device_id": "0", "use_tf32": "0"}
    assert "TF32 off" in s.note
    s = runtime.create_session(tiny_onnx, "auto", tf32=True)
    assert made[-1].asked[0][1]["use_tf32"] == "1" and s.options["use_tf32"] == "1" and "TF32 allowed" in s.note
    # What onnxruntime reports wins over what we asked: a session that ignored use_tf32=0 is named so.
    monkeypatch.setattr(runtime, "_new_session", lambda path, providers: FakeSession(
        providers, {"CUDAExecutionProvider": {"use_tf32": "1", "device_id": "0"}}))
    assert runtime.create_session(tiny_onnx, "cuda").options["use_tf32"] == "1"


def test_cpu_session_records_its_provider(tiny_onnx):
    s = runtime.create_session(tiny_onnx, "cpu")
    assert s.provider == "cpu" and s.options == {"provider": "CPUExecutionProvider"}
    assert s.session.get_providers() == ["CPUExecutionProvider"]


# --- the cache on the device -------------------------------------------------------------------------------

def test_device_cache_gives_the_numpy_path_bit_for_bit(tiny_onnx):
    bound, plain = lm(tiny_onnx, "cpu", io="device"), lm(tiny_onnx, "cpu", io="numpy")
    got, last = greedy(bound)
    want, want_last = greedy(plain)
    assert [g.shape for g in got] == [(2, 5, TINY.vocab_size)] + [(2, 1, TINY.vocab_size)] * 4
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert isinstance(last.cache, runtime.DeviceCache) and isinstance(want_last.cache, list)
    k = last.cache.values[0][0]
    assert k.device_name().lower() == "cpu" and k.shape() == [2, TINY.num_key_value_heads, 9, TINY.head_dim]
    for (gk, gv), (wk, wv) in zip(last.presents, want_last.presents):
        np.testing.assert_array_equal(gk, wk)
        np.testing.assert_array_equal(gv, wv)


def test_device_cache_matches_pytorch_and_a_wrong_cache_does_not(tiny_onnx):
    model = build_model(TINY)  # export_onnx("tiny") used seed 0 as well
    bound = lm(tiny_onnx, "cpu")
    ids = np.array([[1, 17, 300, 5]], np.int64)
    mask = np.ones_like(ids)
    out = bound(ids, mask, np.arange(4)[None], bound.empty_cache(1))
    with torch.no_grad():
        ref = model(torch.from_numpy(ids))
    step = np.array([[42]], np.int64)
    mask2 = np.ones((1, 5), np.int64)
    with torch.no_grad():
        ref2 = model(torch.from_numpy(step), past_key_values=ref.past_key_values).logits.numpy()
    got2 = bound(step, mask2, np.array([[4]]), out.cache).logits
    np.testing.assert_allclose(got2, ref2, atol=1e-4, rtol=0)
    stale = bound(ids[:, :3], mask[:, :3], np.arange(3)[None], bound.empty_cache(1)).cache  # one token short
    wrong = bound(step, np.ones((1, 4), np.int64), np.array([[4]]), stale).logits
    assert np.abs(wrong - ref2).max() > 1e-2


def test_numpy_past_is_uploaded_once(tiny_onnx):
    bound = lm(tiny_onnx, "cpu")
    first = bound(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None], bound.empty_cache(1))
    a = bound(np.array([[7]]), np.ones((1, 4), np.int64), np.array([[3]]), first.presents)  # numpy in
    b = bound(np.array([[7]]), np.ones((1, 4), np.int64), np.array([[3]]), first.cache)  # OrtValues in
    np.testing.assert_array_equal(a.logits, b.logits)


# --- bf16 through OrtValues (a graph of ops the CPU has for bf16) -----------------------------------------

SCALE = 1 + 3 * 2**-9  # position * SCALE needs rounding to reach bf16


def bf16_toy(path) -> None:
    """The decoder I/O contract in bf16, one layer, 1 KV head of width 2: present = past ++ bf16(pos * SCALE)."""
    bf = TensorProto.BFLOAT16
    kv = lambda name, n: helper.make_tensor_value_info(name, bf, ["batch", 1, n, 2])  # noqa: E731
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
              kv("past_key_values.0.key", "past"), kv("past_key_values.0.value", "past")]
    outputs = [helper.make_tensor_value_info("logits", bf, ["batch", "seq", 1]),
               kv("present.0.key", "total"), kv("present.0.value", "total")]
    n = helper.make_node
    nodes = [
        n("Cast", ["position_ids"], ["pos_f"], to=TensorProto.FLOAT),
        n("Mul", ["pos_f", "scale"], ["scaled"]),
        n("Cast", ["scaled"], ["new"], to=bf),  # [batch, seq], rounded by onnxruntime
        n("Unsqueeze", ["new", "ax2"], ["logits"]),  # [batch, seq, 1]
        n("Unsqueeze", ["new", "ax13"], ["new4"]),  # [batch, 1, seq, 1]
        n("Concat", ["new4", "new4"], ["new_kv"], axis=3),  # [batch, 1, seq, 2]
        n("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        n("Concat", ["past_key_values.0.value", "new_kv"], ["present.0.value"], axis=2),
    ]
    inits = [helper.make_tensor("scale", TensorProto.FLOAT, [], [SCALE]),
             helper.make_tensor("ax2", TensorProto.INT64, [1], [2]),
             helper.make_tensor("ax13", TensorProto.INT64, [2], [1, 3])]
    model = helper.make_model(helper.make_graph(nodes, "bf16_toy", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)


def test_bf16_cache_feeds_and_reads_back(tmp_path):
    bf16_toy(tmp_path / "toy.onnx")
    s = runtime.create_session(tmp_path / "toy.onnx", "cpu")
    toy = runtime.OnnxLM(s, num_layers=1, num_kv_heads=1, head_dim=2, io="numpy")
    assert toy.io == "device" and toy.dtype == "bfloat16"  # numpy cannot carry bf16: bound anyway
    rng = np.random.default_rng(1)
    past = rng.standard_normal((2, 1, 3, 2)).astype(np.float32)  # [batch, kv, past, n6], not bf16 values
    pos = np.array([[3, 4], [100, 201]], np.int64)
    out = toy(np.zeros((2, 2), np.int64), np.ones((2, 5), np.int64), pos, [(past, -past)])
    want_new = torch.from_numpy(pos.astype(np.float32) * np.float32(SCALE)).bfloat16().float().numpy()  # [2, 2]
    assert out.logits.dtype == np.float32 and out.logits.shape == (2, 2, 1)
    np.testing.assert_array_equal(out.logits[..., 0], want_new)
    assert not np.array_equal(want_new, pos * np.float32(SCALE))  # the rounding is really exercised
    k, v = out.presents[0]
    assert k.shape == (2, 1, 5, 2) and k.dtype == np.float32
    np.testing.assert_array_equal(k[:, :, :3], torch.from_numpy(past).bfloat16().float().numpy())
    np.testing.assert_array_equal(v[:, :, :3], torch.from_numpy(-past).bfloat16().float().numpy())
    np.testing.assert_array_equal(k[:, 0, 3:, 0], want_new)
    # Two more steps through the device cache: it grows, and what went in comes back.
    for t in (5, 6):
        out = toy(np.zeros((2, 1), np.int64), np.ones((2, t + 1), np.int64), np.full((2, 1), t), out.cache)
    k, _ = out.presents[0]
    assert out.cache.length == 7 and k.shape == (2, 1, 7, 2)
    np.testing.assert_array_equal(k[0, 0, 5:, 1], torch.tensor([5 * SCALE, 6 * SCALE]).bfloat16().float().numpy())


def test_a_graph_the_cpu_cannot_run_is_refused_in_one_line(tmp_path):
    """An op with no CPU kernel for its type (a double Atan: onnxruntime's CPU has it in float only), not bf16."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Atan", ["x"], ["y"], name="atan")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "f64.onnx")
    with pytest.raises(ValueError) as e:
        runtime.create_session(tmp_path / "f64.onnx", "cpu")
    msg = str(e.value)
    assert "\n" not in msg and "float64 graph" in msg and "--provider cuda" in msg and "CPU provider" in msg


# --- out of memory ----------------------------------------------------------------------------------------

ORT_OOM = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running MatMul node. "
           "Name:'/model/layers.3/mlp/MatMul' Status Message: /onnxruntime_src/onnxruntime/core/framework/"
           "bfc_arena.cc:376 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, "
           "bool, onnxruntime::WaitNotificationFn) Failed to allocate memory for requested buffer of size 939524096")


def test_out_of_memory_names_the_bytes_and_what_to_try(tiny_onnx, monkeypatch):
    e = runtime.out_of_memory_error(RuntimeError(ORT_OOM), "m.onnx")
    assert isinstance(e, ValueError) and "896.0 MiB" in str(e) and "smaller batch" in str(e) and "float16" in str(e)
    assert runtime.out_of_memory_error(RuntimeError("CUDA failure 2: out of memory ; GPU=0"), "m") is not None
    assert runtime.out_of_memory_error(RuntimeError("Invalid rank for input: input_ids"), "m") is None
    bound = lm(tiny_onnx, "cpu")
    real = bound.sess

    class Exploding:
        def __getattr__(self, name):
            return getattr(real, name)

        def run_with_iobinding(self, binding):
            raise RuntimeError(ORT_OOM)

    bound.sess = Exploding()
    with pytest.raises(runtime.DeviceOutOfMemory) as err:
        bound(np.array([[1, 2]]), np.ones((1, 2), np.int64), np.arange(2)[None], bound.empty_cache(1))
    assert "\n" not in str(err.value) and "batch 1, 2 tokens" in str(err.value)


# --- on a GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fp32_runs_without_tf32_and_keeps_the_cache_there(tiny_onnx):
    bound = lm(tiny_onnx, "cuda")
    assert bound.session.options["use_tf32"] == "0" and bound.session.provider == "cuda"
    got, last = greedy(bound)
    assert "cuda" in last.cache.values[0][0].device_name().lower()
    want, _ = greedy(lm(tiny_onnx, "cpu", io="numpy"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)  # fp32 kernels, different summation order
    assert lm(tiny_onnx, "cuda", tf32=True).session.options["use_tf32"] == "1"


@pytest.mark.gpu
def test_gpu_bf16_graph_against_the_fp32_model(tmp_path):
    path = export_onnx("tiny", tmp_path / "bf16.onnx", dtype="bfloat16").path
    bound = lm(path, "cuda")
    assert bound.dtype == "bfloat16"
    ids = np.array([[1, 17, 300, 5, 99]], np.int64)
    out = bound(ids, np.ones_like(ids), np.arange(5)[None], bound.empty_cache(1))
    with torch.no_grad():
        ref = build_model(TINY)(torch.from_numpy(ids)).logits.numpy()
    scale = np.abs(ref).max()
    assert out.logits.dtype == np.float32 and np.isfinite(out.logits).all()
    assert np.abs(out.logits - ref).max() <= 6e-2 * scale  # the bf16 row of parity's tolerance table
    k, _ = out.presents[0]
    assert k.shape == (1, TINY.num_key_value_heads, 5, TINY.head_dim) and k.dtype == np.float32


def test_onnxruntime_refusing_to_run_is_one_line():
    """A kernel's refusal (the builder's sliding-window GQA without its static KV buffer) is one line naming the graph;
    an out-of-memory failure keeps its own wording."""
    from llama_tools.exporters.runtime import DeviceOutOfMemory, run_bound

    class Refuses:
        def __init__(self, msg):
            self.msg = msg

        def run_with_iobinding(self, binding):
            raise RuntimeError(self.msg)
    msg = ("Error in execution: Non-zero status code returned while running GroupQueryAttention node. Name:'/x' "
           "Status Message: sliding_window_cache: KV cache capacity (0) must be at least local_window_size (512).\nmore")
    with pytest.raises(ValueError) as e:
        run_bound(Refuses(msg), None, "g/model.onnx")
    assert str(e.value) == ("g/model.onnx: onnxruntime cannot run it: sliding_window_cache: KV cache capacity (0) "
                            "must be at least local_window_size (512).")
    with pytest.raises(DeviceOutOfMemory):
        run_bound(Refuses("Failed to allocate memory for requested buffer of size 1048576"), None, "g")


# --- Sliding-window KV buffers (onnxruntime-genai's builder, Gemma 3) --------------------------------------

SW = dict(vocab=40, width=24, heads=2, kv_heads=1, n6=16)  # a one-layer GQA toy


def sliding_toy(path, window: int, sliding_cache: int = 1) -> dict[str, np.ndarray]:
    """input_ids -> embedding -> Q, K, V -> GroupQueryAttention(local_window_size=window, sliding_window_cache)
    -> logits, with the builder's I/O; returns its weights for the numpy truth."""
    rng = np.random.default_rng(3)
    w = {"emb": rng.standard_normal((SW["vocab"], SW["width"])), "wq": rng.standard_normal((SW["width"], 32)) * 0.4,
         "wk": rng.standard_normal((SW["width"], 16)) * 0.4, "wv": rng.standard_normal((SW["width"], 16)),
         "wo": rng.standard_normal((32, SW["vocab"]))}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", i64, ["b", "t"]),
              *(helper.make_tensor_value_info(f"past_key_values.0.{kv}", f, ["b", 1, "past_sliding_length", 16])
                for kv in ("key", "value"))]
    outputs = [helper.make_tensor_value_info("logits", f, ["b", "s", SW["vocab"]]),
               *(helper.make_tensor_value_info(f"present.0.{kv}", f, ["b", 1, "total_sliding_length", 16])
                 for kv in ("key", "value"))]
    n = helper.make_node
    nodes = [n("Gather", ["emb", "input_ids"], ["x"]), n("MatMul", ["x", "wq"], ["q"]),
             n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
             # the lengths from the mask, as the builder computes them
             n("ReduceSum", ["attention_mask", "one"], ["len"], keepdims=0), n("Sub", ["len", "one"], ["len1"]),
             n("Cast", ["len1"], ["seqlens_k"], to=i32), n("Shape", ["attention_mask"], ["shape"]),
             n("Gather", ["shape", "one_s"], ["total"]), n("Cast", ["total"], ["total_sequence_length"], to=i32),
             n("GroupQueryAttention", ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
                                       "total_sequence_length"], ["attn", "present.0.key", "present.0.value"],
               domain="com.microsoft", num_heads=2, kv_num_heads=1, local_window_size=window,
               sliding_window_cache=sliding_cache),
             n("MatMul", ["attn", "wo"], ["logits"])]
    inits = [helper.make_tensor(k, f, v.shape, v.flatten()) for k, v in w.items()]
    inits += [helper.make_tensor("one", i64, [1], [1]), helper.make_tensor("one_s", i64, [], [1])]
    model = helper.make_model(helper.make_graph(nodes, "sliding_toy", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, path)
    return w


def sliding_truth(w: dict[str, np.ndarray], ids: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 logits [batch, seq, vocab] and K [batch, 1, seq, 16]: position p attends to keys p - window < j <= p."""
    x = w["emb"].astype(np.float64)[ids]  # [b, s, width]
    q = (x @ w["wq"]).reshape(*ids.shape, 2, 16)
    k, v = x @ w["wk"], x @ w["wv"]  # [b, s, 16]: one KV head for both query heads
    s = ids.shape[1]
    pos = np.arange(s)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [query, key]
    scores = np.einsum("bqhd,bkd->bhqk", q, k) / 4.0  # 1 / sqrt(16)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkd->bqhd", p, v).reshape(*ids.shape, 32)
    return out @ w["wo"], k[:, None]


@pytest.mark.parametrize("io", ["numpy", "device"])
@pytest.mark.parametrize("prompt", [3, 7])  # within the window of 5, and past it (a buffer of 7 slots, not 5)
def test_sliding_window_cache_graph_runs_and_matches_the_truth(tmp_path, io, prompt):
    """A GQA node that reads its past as a sliding-window buffer gets max(window, positions) zero slots, and the
    buffer grows (its written slots kept) as decode passes it: prefill and every step match the float64 truth."""
    window = 5
    w = sliding_toy(tmp_path / "toy.onnx", window)
    toy = runtime.OnnxLM(runtime.create_session(tmp_path / "toy.onnx", "cpu"), 1, 1, 16, io=io)
    assert toy.windows == {0: window}
    ids = np.random.default_rng(0).integers(0, SW["vocab"], size=(2, prompt + 4))  # [2, prompt + 4 steps]
    want, k = sliding_truth(w, ids, window)
    out = toy(ids[:, :prompt], np.ones((2, prompt), np.int64), np.tile(np.arange(prompt), (2, 1)), toy.empty_cache(2))
    got = [out.logits]
    for t in range(prompt, ids.shape[1]):
        out = toy(ids[:, t:t + 1], np.ones((2, t + 1), np.int64), np.full((2, 1), t), out.cache)
        got.append(out.logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-4, atol=1e-4)
    assert out.presents[0][0].shape == (2, 1, ids.shape[1], 16)  # cut to the slots written
    np.testing.assert_allclose(out.presents[0][0], k, rtol=1e-5, atol=1e-5)
    full = np.concatenate(got, axis=1)
    causal, _ = sliding_truth(w, ids, 10 ** 6)  # the same toy with no window: the window really masks keys
    assert prompt + 4 <= window or not np.allclose(full, causal, rtol=1e-3, atol=1e-3)


def test_sliding_window_cache_refusals(tmp_path):
    """Fed as before (a past of 0 slots) onnxruntime refuses the node; a file asking for a window over MAX_WINDOW
    is refused before any buffer is made; a GQA without sliding_window_cache keeps its growing past."""
    sliding_toy(tmp_path / "toy.onnx", 5)
    sess = runtime.create_session(tmp_path / "toy.onnx", "cpu").session
    empty = np.zeros((1, 1, 0, 16), np.float32)
    with pytest.raises(Exception, match="capacity"):
        sess.run(None, {"input_ids": np.zeros((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64),
                        "past_key_values.0.key": empty, "past_key_values.0.value": empty})
    sliding_toy(tmp_path / "huge.onnx", runtime.MAX_WINDOW + 1)
    with pytest.raises(ValueError, match=r"huge.onnx: .*local_window_size 262145, over the 262144 positions"):
        runtime.OnnxLM(runtime.create_session(tmp_path / "huge.onnx", "cpu"), 1, 1, 16)
    sliding_toy(tmp_path / "plain.onnx", 5, sliding_cache=0)
    assert runtime.OnnxLM(runtime.create_session(tmp_path / "plain.onnx", "cpu"), 1, 1, 16).windows == {}
