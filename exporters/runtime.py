"""Running an exported graph on onnxruntime: picking the provider that really runs, and one step of the LM.

onnxruntime-gpu lists CUDAExecutionProvider as available on any machine, GPU or not; a session asked
for it quietly falls back to the CPU and logs to stderr. So the provider that ran is read back from
`session.get_providers()` after the session exists, and the user is told when CUDA was not usable.

Three facts measured on an H100 with onnxruntime-gpu 1.31.1 shape this module:
- the CUDA provider's `use_tf32` defaults to 1: fp32 MatMuls run in TF32 (logits off by ~4e-3 on a
  1024-wide model). We pass use_tf32=0 unless asked, and record the options on the Session.
- numpy has no bfloat16, so a bf16 graph is fed OrtValues of ONNX type BFLOAT16 made over uint16 bits,
  and its outputs are read back as bits and widened to float32.
- feeding numpy to `session.run` copies the whole KV cache host <-> device every step; with IOBinding
  the presents stay where onnxruntime wrote them and are bound as the next step's past.

    step t:  ids, mask, positions (host, small) --bind_cpu_input--> +---------+ --> logits (host)
             past.i.key/value (OrtValues on the device) ----------> | session | --> present.i.* (device)
    step t+1: past := present (no copy)                              +---------+

(Over 500 lines on purpose: sessions, feeding inputs (growing, static and sliding-window KV buffers) and the
messages of onnxruntime's refusals are one runner's contract.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from llama_tools.modeling import dtypes

from .graph_io import GQA, LOGITS, past_name, present_name

PROVIDERS = ("auto", "cpu", "cuda")
IO_MODES = ("device", "numpy")
_ORT = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# ONNX element type of the graph's float inputs -> numpy dtype to feed (bf16: float32 in, bits on the wire).
BFLOAT16 = dtypes.BFLOAT16.onnx  # onnx.TensorProto.BFLOAT16


def _numpy(onnx_type: str) -> Any:
    """What a host array of the graph's element type is held in (bf16: float32, converted to bits on the wire)."""
    d = dtypes.from_onnx_type_string(onnx_type)
    return np.float32 if d is dtypes.BFLOAT16 else np.dtype(d.numpy)


def onnxruntime() -> Any:
    """The onnxruntime module, or one line saying which extra installs it."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ValueError("onnxruntime is not installed: pip install 'llama-tools[cpu]' (or [gpu] on a CUDA machine, "
                         "[genai] with onnxruntime-genai)") from None
    return ort


class DeviceOutOfMemory(ValueError):
    """onnxruntime could not allocate on the device; a ValueError so that the CLI prints one line."""


# --- bfloat16 without numpy support ---------------------------------------------------------------

def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the uint16 bits of bfloat16, rounded to nearest even (as torch rounds); NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the 16 low bits.
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN's payload into Inf: force a quiet NaN, keeping the sign
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bits of bfloat16 -> float32 (exact: bf16 is the top half of a float32)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def ortvalue_to_numpy(value: Any) -> np.ndarray:
    """An OrtValue on any device -> a host numpy array; bfloat16 comes back as float32."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()  # onnxruntime copies device -> host itself
    import torch  # numpy cannot hold bf16: borrow the buffer through DLPack, read its bits

    t = torch.from_dlpack(value._get_c_value())  # no copy; a CUDA tensor for a CUDA OrtValue
    return bf16_bits_to_float32(t.view(torch.int16).cpu().numpy().view(np.uint16))


def numpy_to_ortvalue(x: np.ndarray, onnx_type: str, device: str = "cpu", device_id: int = 0) -> Any:
    """A host array -> an OrtValue of the graph's element type (bf16 through uint16 bits) on `device`."""
    ort = onnxruntime()

    if onnx_type == "tensor(bfloat16)":
        host = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(float32_to_bf16_bits(x), BFLOAT16)  # holds the bits
        if device == "cpu":
            return host
        dev = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), BFLOAT16, device, device_id)
        dev.update_inplace(host)  # host -> device copy
        return dev
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, dtype=_numpy(onnx_type)), device, device_id)


# --- Sessions ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Session:
    """An onnxruntime session, the provider that runs it, why not CUDA when CUDA was asked for, and its options."""

    session: Any  # onnxruntime.InferenceSession
    provider: str  # "cuda" or "cpu": what get_providers() says runs first
    note: str  # one line for the user: which provider ran and why
    options: dict[str, str] = field(default_factory=dict)  # what matters for the numbers, e.g. use_tf32
    path: str = ""

    @property
    def device(self) -> str:
        """Where IOBinding keeps the cache: "cuda" or "cpu"."""
        return self.provider


def cuda_options(tf32: bool = False, device_id: int = 0) -> dict[str, str]:
    """CUDA provider options: TF32 off unless asked (fp32 means fp32), and the GPU to use."""
    return {"device_id": str(device_id), "use_tf32": "1" if tf32 else "0"}


def provider_list(provider: str, tf32: bool = False, device_id: int = 0) -> list[Any]:
    """onnxruntime's providers argument for "cpu" or "cuda" (CUDA with its options, CPU as the fallback)."""
    if provider == "cpu":
        return [_ORT["cpu"]]
    return [(_ORT["cuda"], cuda_options(tf32, device_id)), _ORT["cpu"]]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_bound(sess: Any, binding: Any, what: str) -> None:
    """sess.run_with_iobinding, with onnxruntime's refusal to run the graph as one line naming `what`."""
    try:
        sess.run_with_iobinding(binding)
    except Exception as e:  # noqa: BLE001  (onnxruntime raises its own Fail/RuntimeError types)
        oom = out_of_memory_error(e, what)
        if oom is not None:
            raise oom from None
        msg = re.sub(r"^.*?Status Message: ", "", _first_line(e))
        raise ValueError(f"{what}: onnxruntime cannot run it: {msg}") from None


def _graph_dtype(path: str) -> str:
    """The element type of past_key_values.0.key ("float16", ...), else of the first float input, read from the
    proto without its weights."""
    try:
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
        floats = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
        elem = next(i.type.tensor_type.elem_type for i in sorted(graph.input, key=lambda i: i.name != past_name(0, "key"))
                    if i.type.tensor_type.elem_type in floats)
        return dtypes.from_onnx(elem).name
    except Exception:  # noqa: BLE001  (only used to word an error)
        return "this"


def out_of_memory_error(e: BaseException, what: str) -> DeviceOutOfMemory | None:
    """onnxruntime's allocation failures -> one line naming the bytes asked for and what to try; else None."""
    text = str(e)
    if not re.search(r"Failed to allocate memory|out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED",
                     text, re.IGNORECASE):
        return None
    m = re.search(r"buffer of size (\d+)", text)
    need = f" ({int(m.group(1)) / 2**20:,.1f} MiB asked for in one allocation)" if m else ""
    return DeviceOutOfMemory(f"{what}: the GPU ran out of memory{need}; try a smaller batch or fewer --steps, "
                             f"a float16 export, or a GPU with more free memory (--provider cpu runs it on the host)")


def _new_session(path: str, providers: list[Any]) -> Any:
    ort = onnxruntime()

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # No CPU arena: it keeps the largest activations a run ever made (a 262,144-token vocabulary's logits, 33 MB per
    # 32 positions) for the session's life, on top of the weights. Measured on Gemma 3 270M int4, 6 prefills of 32
    # positions: peak 0.53 -> 0.47 GB over the session, the same time.
    opts.enable_cpu_mem_arena = False
    # A failed CUDA start logs an error and a warning through the default logger; we report it in one line.
    ort.set_default_logger_severity(4)
    try:
        try:
            return ort.InferenceSession(path, sess_options=opts, providers=providers)
        except Exception as e:  # noqa: BLE001
            if "NOT_IMPLEMENTED" in str(e) and providers == [_ORT["cpu"]] and bf16_graph(path):
                return _emulated_bf16_session(path, opts, providers)  # ops the CPU has no bf16 kernel for
            raise
    except Exception as e:  # onnxruntime raises its own Fail / NotImplemented / InvalidGraph  # noqa: BLE001
        oom = out_of_memory_error(e, f"{path}: loading the weights onto the GPU")
        if oom is not None:
            raise oom from None
        hint = ""
        if "NOT_IMPLEMENTED" in str(e):
            on = "the CPU provider" if providers == [_ORT["cpu"]] else "no provider that started here"
            hint = (f"; {on} has no kernels for some op of this {_graph_dtype(path)} graph: run it on a GPU "
                    f"with --provider cuda, or export it as float32")
        raise ValueError(f"{path}: onnxruntime could not load it ({_first_line(e)[:300]}){hint}") from None
    finally:
        ort.set_default_logger_severity(2)


EMULATED_BF16 = "bf16 emulated: fp32 arithmetic rounded to bf16 after every op (the CPU provider has no bf16 kernels)"


def bf16_graph(path: str | Path) -> bool:
    """Whether the graph at `path` is a bf16 one (read without its weights)."""
    import onnx

    from .emulation import is_bf16_graph

    try:
        return is_bf16_graph(onnx.load(str(path), load_external_data=False))
    except Exception:  # not an ONNX file: onnxruntime says so in its own words when it loads it  # noqa: BLE001
        return False


def _emulated(sess: Any, path: str) -> str:
    """"; bf16 emulated: ..." when the session runs a bf16 graph in fp32, else ""."""
    return f"; {EMULATED_BF16}" if getattr(sess, "bf16_emulated", False) else ""


def _emulated_bf16_session(path: str, opts: Any, providers: list[Any]) -> Any:
    """A CPU session over the bf16 graph emulated in fp32 (emulation.py); the weights are loaded once to convert."""
    import tempfile

    import onnx

    from .emulation import emulate_bf16

    ort = onnxruntime()
    model = emulate_bf16(onnx.load(path))
    if model.ByteSize() < 2**31 - 2**26:  # protobuf's 2 GiB cap, with room for the graph
        sess = ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=providers)
    else:
        with tempfile.TemporaryDirectory(prefix="llama-tools-bf16-") as tmp:  # read into the session, then removed
            onnx.save_model(model, f"{tmp}/model.onnx", save_as_external_data=True, location="model.onnx.data")
            del model
            sess = ort.InferenceSession(f"{tmp}/model.onnx", sess_options=opts, providers=providers)
    sess.bf16_emulated = True  # create_session's note says so
    return sess


def _options(sess: Any, provider: str, asked: dict[str, str] | None = None) -> dict[str, str]:
    """The options that change numbers, as onnxruntime reports them (what we asked where it cannot say)."""
    read = getattr(sess, "get_provider_options", None)
    got = read().get(_ORT[provider], {}) if read else {}
    out = {"provider": _ORT[provider]}
    if provider == "cuda":
        out.update({k: str(got.get(k, (asked or {}).get(k, "?"))) for k in ("device_id", "use_tf32")})
    return out


def create_session(path: str | Path, provider: str = "auto", *, tf32: bool = False, device_id: int = 0) -> Session:
    """`auto`: CUDA when a session really runs on it, else the CPU (said so); `cuda`: CUDA or an error.

    tf32=False (the default) runs fp32 MatMuls on CUDA in fp32; True allows TF32 (faster, ~1e-3 off).
    """
    ort = onnxruntime()

    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such ONNX file")
    path = str(path)
    available = ort.get_available_providers()
    if provider == "cpu":
        sess = _new_session(path, provider_list("cpu"))
        return Session(sess, "cpu", "CPU provider (asked for)" + _emulated(sess, path), _options(sess, "cpu"), path)
    if _ORT["cuda"] not in available:
        if provider == "cuda":
            raise ValueError(f"the CUDA provider is not in this onnxruntime build ({ort.__version__}, providers "
                             f"{', '.join(available)}); install onnxruntime-gpu or use --provider cpu")
        sess = _new_session(path, provider_list("cpu"))
        return Session(sess, "cpu", f"CPU provider: this onnxruntime build ({ort.__version__}) has no CUDA provider"
                       + _emulated(sess, path), _options(sess, "cpu"), path)
    sess = _new_session(path, provider_list("cuda", tf32, device_id))
    first = sess.get_providers()[0]
    if (first[0] if isinstance(first, tuple) else first) == _ORT["cuda"]:  # (name, options) from a stand-in
        opts = _options(sess, "cuda", cuda_options(tf32, device_id))
        tf = "TF32 allowed" if opts.get("use_tf32") == "1" else "TF32 off"
        return Session(sess, "cuda", f"CUDA provider ({tf})", opts, path)
    why = "onnxruntime lists CUDA but could not start it here (no GPU, driver, CUDA or cuDNN libraries)"
    if provider == "cuda":
        raise ValueError(f"--provider cuda: {why}; use --provider cpu or auto")
    return Session(sess, "cpu", f"CPU provider: {why}{_emulated(sess, path)}", _options(sess, "cpu"), path)


# --- Sliding-window KV buffers ------------------------------------------------------------------------------

# The largest local_window_size we allocate a buffer for (positions): real models slide 512 (Gemma 3) to 32768
# (Qwen2); a file asking for more is refused before any buffer is made.
MAX_WINDOW = 1 << 18


def windowed_pasts(nodes: Any, where: str = "the graph") -> dict[str, int]:
    """Past K/V inputs a GroupQueryAttention reads as a sliding-window cache -> its local_window_size.

    onnxruntime-genai's builder marks a sliding layer's GQA `sliding_window_cache=1` with `local_window_size` W:
    onnxruntime (1.32) then refuses a past buffer of fewer than W slots ("KV cache capacity (0) must be at least
    local_window_size"). genai feeds it a static buffer (past_present_share_buffer) and seqlens_k /
    total_sequence_length say how many slots hold keys; OnnxLM and by_layer feed such pasts the same way.
    """
    out: dict[str, int] = {}
    for n in nodes:
        if n.op_type != GQA:
            continue
        attrs = {a.name: a.i for a in n.attribute if a.name in ("local_window_size", "sliding_window_cache")}
        window = attrs.get("local_window_size", -1)
        if window <= 0 or not attrs.get("sliding_window_cache", 0) or len(n.input) < 5:
            continue
        if window > MAX_WINDOW:
            raise ValueError(f"{where}: {n.name or 'a GroupQueryAttention node'} has local_window_size {window}, "
                             f"over the {MAX_WINDOW} positions verify parity allocates a window for; is the file "
                             f"damaged?")
        out.update({x: window for x in n.input[3:5] if x})
    return out


def window_slots(window: int, total: int) -> int:
    """Slots of a sliding-window buffer for `total` positions: the window (onnxruntime's minimum), or all of
    them, so that no key is evicted and every slot i holds position i, as the reference's cache does."""
    return max(window, total)


def _graph_windows(path: str) -> dict[str, int]:
    """windowed_pasts of the graph at `path`, read without its weights; {} for a session not made from a file."""
    if not path or not Path(path).is_file():
        return {}
    import onnx

    return windowed_pasts(onnx.load(path, load_external_data=False).graph.node, path)


# --- The LM step -------------------------------------------------------------------------------------------

HostCache = list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V): [batch, kv_heads, past, n6]


@dataclass
class DeviceCache:
    """The KV cache as OrtValues where the session wrote them; numpy only when asked."""

    values: list[tuple[Any, Any]]  # per layer (K, V) OrtValues: [batch, kv_heads, past, n6]

    @property
    def length(self) -> int:
        return self.values[0][0].shape()[2] if self.values else 0

    def to_numpy(self) -> HostCache:
        """Copy every K/V to the host (bf16 widened to float32)."""
        return [(ortvalue_to_numpy(k), ortvalue_to_numpy(v)) for k, v in self.values]


Cache = Union[HostCache, DeviceCache]


@dataclass
class StepOutput:
    """Logits on the host; the cache as the step left it (feed `cache` back as the next `past`)."""

    logits: np.ndarray  # [batch, seq, vocab]: float32 for fp32 and bf16 graphs, float16 for fp16
    cache: Cache
    filled: int | None = None  # a static KV buffer's slots written so far (past + seq); None: the whole cache
    _host: HostCache | None = field(default=None, repr=False)

    @property
    def presents(self) -> HostCache:
        """Per layer (K, V) as numpy: [batch, kv_heads, past + seq, n6]; a device cache is copied once.

        A static buffer is cut to its written slots: the rest is whatever the buffer held, not a key.
        """
        if self._host is None:
            host = self.cache.to_numpy() if isinstance(self.cache, DeviceCache) else self.cache
            if self.filled is not None:
                host = [(k[:, :, :self.filled], v[:, :, :self.filled]) for k, v in host]
            self._host = host
        return self._host


class OnnxLM:
    """One forward step of an exported llama-tools graph: ids, mask, positions and the cache in, logits out.

    io="device" (default): IOBinding, the presents stay on the session's device and are bound as the next
    past; io="numpy": `session.run` with numpy in and out (the cache crosses to the host every step).
    A static-KV graph (past/present [batch, kv_heads, max_length, n6], `export onnx --static-kv`) gets
    buffers of max_length from `empty_cache`; bound, each layer's buffer is both past and present, so
    GroupQueryAttention writes the new slots in place (as onnxruntime-genai's past_present_share_buffer).
    """

    def __init__(self, session: Session, num_layers: int, num_kv_heads: int, head_dim: int, io: str = "device",
                 past: Any = past_name, present: Any = present_name):
        """past/present: (layer, "key" | "value") -> the graph's name (another exporter's, see foreign.py)."""
        if io not in IO_MODES:
            raise ValueError(f"unknown io mode {io!r}; choose one of {', '.join(IO_MODES)}")
        self.session = session
        self.sess = session.session
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.past_name, self.present_name = past, present
        inputs = {i.name: i for i in self.sess.get_inputs()}
        types = {name: i.type for name, i in inputs.items()}
        assert past(0, "key") in types, f"not a llama-tools decoder graph: inputs {sorted(types)}"
        self.onnx_type = types[past(0, "key")]
        self.input_types = types
        slots = inputs[past(0, "key")].shape[2]  # "past_sequence_length", or max_length for a static buffer
        self.static_length: int | None = slots if isinstance(slots, int) else None
        self.dtype = dtypes.from_onnx_type_string(self.onnx_type).name
        self.cache_dtype = _numpy(self.onnx_type)  # what numpy caches hold (float32 for bf16)
        self.input_names = set(types)
        self.output_names = [o.name for o in self.sess.get_outputs()]
        # numpy cannot carry bf16 through session.run: a bf16 graph always goes through IOBinding.
        self.io = "device" if self.onnx_type == "tensor(bfloat16)" else io
        self.device = getattr(session, "device", "cpu") if self.io == "device" else "cpu"
        self.device_id = int(getattr(session, "options", {}).get("device_id", 0))
        # Layers whose GQA reads a sliding-window buffer: layer -> window (fed max(window, positions) slots).
        windows = _graph_windows(getattr(session, "path", ""))
        self.windows = {i: windows[past(i, "key")] for i in range(num_layers) if past(i, "key") in windows}

    def empty_cache(self, batch: int) -> Cache:
        """Past length 0, for the prefill: numpy arrays, or OrtValues on the device (zero-filled static buffers)."""
        shape = (batch, self.num_kv_heads, self.static_length or 0, self.head_dim)  # [batch, kv_heads, 0 or max, n6]
        if self.io == "numpy":
            return [(np.zeros(shape, self.cache_dtype), np.zeros(shape, self.cache_dtype))
                    for _ in range(self.num_layers)]
        ort = onnxruntime()

        def empty() -> Any:
            # Memory onnxruntime owns (not a numpy array's, which outputs that alias it would not keep alive).
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtypes.from_onnx_type_string(self.onnx_type).onnx,
                                                              self.device, self.device_id)
            if self.static_length:  # the unwritten slots are read (and masked): zeros, not stale memory
                bits = self.onnx_type == "tensor(bfloat16)"  # zero bits are bf16 zeros
                value.update_inplace(np.zeros(shape, np.uint16 if bits else self.cache_dtype))
            return value
        return DeviceCache([(empty(), empty()) for _ in range(self.num_layers)])

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                 past: Cache) -> StepOutput:
        if self.static_length is not None and attention_mask.shape[1] > self.static_length:
            raise ValueError(f"{self.session.path or 'the ONNX model'}: {attention_mask.shape[1]} positions do not fit "
                             f"its static KV buffer of {self.static_length}; export with a larger --static-kv")
        small = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 # GroupQueryAttention graphs that take the lengths as inputs (right-aligned rows, no padding):
                 "seqlens_k": attention_mask.sum(-1) - 1, "total_sequence_length": np.array(attention_mask.shape[1])}
        small = {k: np.ascontiguousarray(v, dtype=_numpy(self.input_types[k]))
                 for k, v in small.items() if k in self.input_names}
        try:
            if self.windows:
                past = self._with_room(past, attention_mask.shape[1], attention_mask.shape[1] - input_ids.shape[1])
            out = self._run_numpy(small, past) if self.io == "numpy" else self._run_bound(small, past)
            if self.static_length is not None or self.windows:  # cut the buffers to the slots written
                out.filled = attention_mask.shape[1]
            return out
        except DeviceOutOfMemory:
            raise
        except Exception as e:  # noqa: BLE001  onnxruntime's own exception types
            oom = out_of_memory_error(e, f"{self.session.path or 'the ONNX model'}: batch {input_ids.shape[0]}, "
                                         f"{attention_mask.shape[1]} tokens")
            if oom is not None:
                raise oom from None
            if "Non-zero status code" in str(e):  # a kernel that refuses to run this graph: one line, named
                raise ValueError(f"{self.session.path or 'the ONNX model'}: onnxruntime cannot run it: "
                                 f"{re.sub(r'^.*?Status Message: ', '', _first_line(e))}") from None
            raise

    def _with_room(self, past: Cache, total: int, filled: int) -> Cache:
        """`past` with each sliding-window layer's buffer at least window_slots(window, total) long: a zero buffer
        holding the `filled` slots written so far where it is shorter (the empty cache, or a decode past the end)."""
        device = isinstance(past, DeviceCache)
        pairs = list(past.values if device else past)
        for i, window in self.windows.items():
            slots = window_slots(window, total)
            grown = []
            for t in pairs[i]:
                have = t.shape()[2] if device else t.shape[2]
                if have >= slots:
                    grown.append(t)
                    continue
                host = ortvalue_to_numpy(t) if device else t  # [batch, kv_heads, have, n6]
                buf = np.zeros((*host.shape[:2], slots, host.shape[3]), self.cache_dtype)
                buf[:, :, :filled] = host[:, :, :filled]  # zeros after: unwritten slots are read (and masked)
                grown.append(numpy_to_ortvalue(buf, self.onnx_type, self.device, self.device_id) if device else buf)
            pairs[i] = (grown[0], grown[1])
        return DeviceCache(pairs) if device else pairs

    def _run_numpy(self, feed: dict[str, np.ndarray], past: Cache) -> StepOutput:
        host = past.to_numpy() if isinstance(past, DeviceCache) else past
        feed = dict(feed)
        for i, (k, v) in enumerate(host):
            feed[self.past_name(i, "key")] = k.astype(self.cache_dtype, copy=False)
            feed[self.past_name(i, "value")] = v.astype(self.cache_dtype, copy=False)
        out = dict(zip(self.output_names, self.sess.run(None, feed)))
        presents = [(out[self.present_name(i, "key")], out[self.present_name(i, "value")])
                    for i in range(self.num_layers)]
        return StepOutput(out[LOGITS], presents)

    def _run_bound(self, feed: dict[str, np.ndarray], past: Cache) -> StepOutput:
        binding = self.sess.io_binding()
        for name, arr in feed.items():
            binding.bind_cpu_input(name, arr)  # a few int64s: onnxruntime copies them where needed
        bound_past = {}
        for i, (k, v) in enumerate(past.values if isinstance(past, DeviceCache) else past):
            for what, t in (("key", k), ("value", v)):
                if isinstance(t, np.ndarray):
                    t = numpy_to_ortvalue(t, self.onnx_type, self.device, self.device_id)  # uploaded once
                binding.bind_ortvalue_input(self.past_name(i, what), t)
                bound_past[i, what] = t
        binding.bind_output(LOGITS, "cpu")  # the logits come back to the host every step
        bound = [LOGITS]  # get_outputs() answers in the order outputs were bound, not the graph's order
        for i in range(self.num_layers):
            for what in ("key", "value"):
                bound.append(self.present_name(i, what))
                if self.static_length is not None:  # the past's own buffer: GQA sees one pointer, writes in place
                    binding.bind_ortvalue_output(self.present_name(i, what), bound_past[i, what])
                else:
                    binding.bind_output(self.present_name(i, what), self.device, self.device_id)  # stays where written
        self.sess.run_with_iobinding(binding)  # onnxruntime's errors are worded by __call__ (batch and tokens)
        outs = dict(zip(bound, binding.get_outputs()))
        # A static buffer is handed back as the value that was bound (it keeps a numpy-backed buffer alive;
        # get_outputs' view of the same memory would not).
        take = bound_past if self.static_length is not None else {
            (i, w): outs[self.present_name(i, w)] for i in range(self.num_layers) for w in ("key", "value")}
        cache = DeviceCache([(take[i, "key"], take[i, "value"]) for i in range(self.num_layers)])
        return StepOutput(ortvalue_to_numpy(outs[LOGITS]), cache)


def cuda_unusable() -> str | None:
    """None when a session really runs on CUDA here (a one-node graph tried), else why not, in one line."""
    import onnx
    ort = onnxruntime()

    if _ORT["cuda"] not in ort.get_available_providers():
        return f"this onnxruntime build ({ort.__version__}) has no CUDA provider"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    ort.set_default_logger_severity(4)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=provider_list("cuda"))
    except Exception as e:  # noqa: BLE001
        return f"CUDA session failed ({_first_line(e)[:200]})"
    finally:
        ort.set_default_logger_severity(2)
    if sess.get_providers()[0] != _ORT["cuda"]:
        return "onnxruntime lists CUDA but could not start it (no GPU, driver, CUDA or cuDNN libraries)"
    return None
