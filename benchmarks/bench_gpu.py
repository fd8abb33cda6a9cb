"""Prefill and decode on one GPU: the plain, fused and static-KV graphs on onnxruntime CUDA against eager PyTorch.

    python benchmarks/bench_gpu.py [--layers 2] [--dtype float16] [--prompt 512] [--steps 64] [--batch 1]
                                   [--provider cuda|cpu]

LLaMA-7B width (n2 4096, n7 11008, 32 heads, vocab 32000) with `--layers` decoders, seeded weights,
exported once to a temp dir four ways: the plain graph (`export onnx`), the fused graph (`--optimize`:
GroupQueryAttention, packed QKV, the RoPE inside it), the same with our RoPE node (`--rope-op llama_tools`)
and the fused graph with a static KV buffer (`--static-kv`, past and present one buffer per layer, written
in place). Decode runs `--steps` greedy steps after a
128-token prefill, the cache fed back each step: as OrtValues on the device (IOBinding,
`exporters.runtime.OnnxLM(io="device")`), for the plain graph also as numpy (`io="numpy"`: the cache crosses
to the host and back every step), and through PyTorch's own cache.
Roofline for decode: a step must read every weight and the whole KV cache once, so
bytes/step / seconds/step against the device-to-device copy bandwidth measured here.
On a machine where onnxruntime cannot run CUDA it says why and exits 0; `--provider cpu` runs the same
code on the host (a smoke run: no roofline).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def copy_bandwidth(torch) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted): the practical roofline."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() (fn synchronizes itself)."""
    fn()  # warm-up: kernels, allocator
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=512, help="prefill length")
    ap.add_argument("--steps", type=int, default=64, help="decode steps after a 128-token prefill")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run on the host")
    args = ap.parse_args()

    from llama_tools.exporters.runtime import OnnxLM, create_session, cuda_unusable

    import torch

    gpu = args.provider == "cuda"
    why = cuda_unusable() if gpu else None
    if why is None and gpu and not torch.cuda.is_available():
        why = "PyTorch has no CUDA here"
    if why is not None:
        print(f"bench_gpu: skipped: {why}")
        return 0

    import onnxruntime as ort

    from llama_tools.exporters import rope_ops
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.onnx_export import export_onnx
    from llama_tools.modeling.presets import get_preset
    from llama_tools.modeling.model import build_model

    cfg = get_preset("llama-7b").replace(num_hidden_layers=args.layers)
    tdtype = getattr(torch, args.dtype)
    device = "cuda" if gpu else "cpu"
    model = build_model(cfg, dtype=tdtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    b, n = args.batch, args.prompt
    rng = np.random.default_rng(0)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def ort_prefill(lm, n):
        ids = rng.integers(3, cfg.vocab_size, (b, n))
        mask = np.ones((b, n), np.int64)
        return lm(ids, mask, np.tile(np.arange(n), (b, 1)), lm.empty_cache(b)), mask

    def ort_decode(lm):
        out, mask = ort_prefill(lm, 128)
        t = time.perf_counter()
        for _ in range(args.steps):
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)  # [b, past + 1]
            nxt = out.logits[:, -1].argmax(-1)[:, None]
            out = lm(nxt, mask, mask.sum(-1, keepdims=True) - 1, out.cache)
        return (time.perf_counter() - t) / args.steps

    rows: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        graphs = {"plain": export_onnx(model, Path(tmp) / "plain.onnx", dtype=args.dtype).path,
                  "fused": export_fused(model, Path(tmp) / "fused.onnx", dtype=args.dtype).path,
                  "fused, RoPE node": export_fused(model, Path(tmp) / "node.onnx", dtype=args.dtype,
                                                   rope_op=rope_ops.OURS.name).path,
                  "fused, static KV": export_fused(model, Path(tmp) / "static.onnx", dtype=args.dtype,
                                                   static_kv=max(n, 128 + args.steps)).path}
        for name, path in graphs.items():
            session = create_session(path, args.provider)
            ios = ("device", "numpy") if name == "plain" else ("device",)
            for io in ios:
                lm = OnnxLM(session, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, io=io)
                label = f"{name}, {'IOBinding' if io == 'device' else 'numpy feeds'}"
                rows[label] = (timed(lambda: ort_prefill(lm, n), 5), float(np.median([ort_decode(lm) for _ in range(3)])))
                print(f"  timed {label}", file=sys.stderr)
            provider_options = session.options
            del session
        model = model.to(device)

        @torch.no_grad()
        def torch_prefill(n):
            ids = torch.randint(3, cfg.vocab_size, (b, n), device=device)
            out = model(ids)
            sync()
            return out

        @torch.no_grad()
        def torch_decode():
            out = torch_prefill(128)
            t = time.perf_counter()
            for _ in range(args.steps):
                nxt = out.logits[:, -1].argmax(-1)[:, None]
                out = model(nxt, past_key_values=out.past_key_values)
            sync()
            return (time.perf_counter() - t) / args.steps

        rows["PyTorch eager"] = (timed(lambda: torch_prefill(n), 5), float(np.median([torch_decode() for _ in range(3)])))
        bw = copy_bandwidth(torch) if gpu else None
    item = torch.finfo(tdtype).bits // 8
    kv_bytes = 2 * cfg.num_hidden_layers * b * cfg.num_key_value_heads * (128 + args.steps // 2) * cfg.head_dim * item
    step_bytes = weight_bytes + kv_bytes  # every weight and (on average) half-grown cache, read once per step
    where = torch.cuda.get_device_name(0) if gpu else f"host CPU ({platform_name()})"
    print(f"device: {where}; onnxruntime {ort.__version__}, torch {torch.__version__}; "
          f"provider options {provider_options}")
    print(f"LLaMA-7B width, {args.layers} layers, {args.dtype}, weights {weight_bytes / 2**30:.2f} GiB; "
          f"batch {b}; prefill {n} tokens; decode {args.steps} steps after 128"
          + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    eager_p, eager_d = rows["PyTorch eager"]
    plain_d = rows["plain, IOBinding"][1]
    print(f"{'path':<28} {'prefill ms':>10} {'tok/s':>9} {'vs eager':>8} {'decode ms':>10} {'vs eager':>8} "
          f"{'vs plain':>8} {'% roofline':>10}")
    for name, (p, d) in rows.items():
        roof = f"{100 * step_bytes / d / bw:>9.1f}%" if bw else f"{'-':>10}"
        print(f"{name:<28} {p * 1e3:>10.2f} {b * n / p:>9.0f} {eager_p / p:>7.2f}x {d * 1e3:>10.3f} "
              f"{eager_d / d:>7.2f}x {plain_d / d:>7.2f}x {roof}")
    return 0


def platform_name() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
