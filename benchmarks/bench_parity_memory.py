"""Peak host memory of the parity reference: the whole fp32 model vs the layer-streamed one, vs the weights.

    python benchmarks/bench_parity_memory.py [--layers 4] [--dtype float32] [--with-session] [--keep DIR]

A checkpoint with LLaMA-7B's width (n2 4096, n7 11008, 32 heads, vocab 32000) and `--layers` decoders is
written as HF safetensors in a temp dir (4 layers in fp32: 4.0 GiB). Each mode runs in a fresh process
what `verify parity` asks of the reference (a left-padded prefill of 2 rows, 11 and 6 tokens, then 8
greedy decode steps with the cache) and reports its high-water mark (ru_maxrss) minus the process's RSS
after imports, i.e. what the reference itself added:

- full: `load_model(dir)`, every weight in fp32 in RAM (what parity does today);
- streamed: `llama_tools.reference.StreamedReference(dir)`, one decoder layer's fp32 weights at a time;
- session+streamed (--with-session): an fp32 ONNX export of the checkpoint on onnxruntime's CPU provider
  beside the streamed reference, the whole parity run in one process (the issue's goal: <= 1.45x weights).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
mode, ckpt, onnx_path = sys.argv[1], sys.argv[2], sys.argv[3]
from llama_tools.loading import load_model
from llama_tools.reference import StreamedReference, reference_memory
from llama_tools.exporters import runtime

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

base = rss()
t0 = time.perf_counter()
ref = load_model(ckpt) if mode == "full" else StreamedReference(ckpt)
lm = None
if mode == "session+streamed":
    s = runtime.create_session(onnx_path, "cpu")
    cfg = ref.cfg
    lm = runtime.OnnxLM(s, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
after_session = rss()
rng = np.random.default_rng(0)
ids = np.zeros((2, 11), np.int64); mask = np.zeros((2, 11), np.int64)
ids[0] = rng.integers(3, 32000, 11); mask[0] = 1
ids[1, 5:] = rng.integers(3, 32000, 6); mask[1, 5:] = 1
pos = np.clip(mask.cumsum(-1) - 1, 0, None)
with torch.no_grad():
    out = ref(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos))
    got = lm(ids, mask, pos, lm.empty_cache(2)) if lm else None
    for _ in range(8):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        nxt = out.logits[:, -1].argmax(-1)[:, None].numpy()
        p = mask.sum(-1, keepdims=True) - 1
        out = ref(torch.from_numpy(nxt), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(p),
                  past_key_values=out.past_key_values)
        if lm:
            got = lm(nxt, mask, p, got.cache)
err = float(np.abs(got.logits - out.logits.numpy()).max()) if lm else None
model_bytes = reference_memory(ref.cfg, 2, 11, 8, streamed=mode != "full").total
print(json.dumps({"mode": mode, "base": base, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "seconds": time.perf_counter() - t0, "session_rss": after_session - base, "model": model_bytes,
                  "last_step_max_abs": err}))
"""


def write_checkpoint(layers: int, dtype: str, directory: Path) -> int:
    """LLaMA-7B width with `layers` decoders, seeded, as HF safetensors; returns the weights' bytes."""
    import torch

    from llama_tools.presets import get_preset
    from llama_tools.convert import save_checkpoint
    from llama_tools.model import build_model

    cfg = get_preset("llama-7b").replace(num_hidden_layers=layers, torch_dtype=dtype)
    model = build_model(cfg, dtype=getattr(torch, dtype))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    save_checkpoint(cfg, state, directory, to="hf")
    return sum(v.numel() * v.element_size() for v in state.values())


def export(ckpt: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-c", "import sys; from llama_tools.exporters.onnx_export import export_onnx; "
                    "export_onnx(sys.argv[1], sys.argv[2])", str(ckpt), str(out)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--with-session", action="store_true", help="also the whole parity run beside an ORT session")
    ap.add_argument("--keep", type=Path, help="reuse/keep the checkpoint (and export) in this directory")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-parity-mem-") as tmp:
        root = args.keep or Path(tmp)
        ckpt, onnx_path = root / f"ckpt-{args.layers}-{args.dtype}", root / f"onnx-{args.layers}-{args.dtype}/m.onnx"
        if not ckpt.exists():
            weights = write_checkpoint(args.layers, args.dtype, ckpt)
        else:
            weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        modes = ["full", "streamed"]
        if args.with_session:
            if not onnx_path.exists():
                onnx_path.parent.mkdir(parents=True, exist_ok=True)
                export(ckpt, onnx_path)
            modes.append("session+streamed")
        rows = []
        for mode in modes:
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(ckpt), str(onnx_path)], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    print(f"machine: {platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}; "
          f"LLaMA-7B width, {args.layers} layers, {args.dtype} HF safetensors: weights {gib(weights)} GiB")
    print(f"{'mode':<18} {'added GiB':>9} {'x weights':>9} {'model GiB':>9} {'peak GiB':>9} {'x weights':>9} "
          f"{'seconds':>8}")
    for r in rows:
        added = r["peak"] - r["base"]
        print(f"{r['mode']:<18} {gib(added):>9} {added / weights:>9.2f} {gib(r['model']):>9} {gib(r['peak']):>9} "
              f"{r['peak'] / weights:>9.2f} {r['seconds']:>8.1f}"
              + (f"   (session {gib(r['session_rss'])} GiB; last step max abs {r['last_step_max_abs']:.2g})"
                 if r["last_step_max_abs"] is not None else ""))
    print("added: peak RSS minus the RSS after imports; model: llama_tools.reference.reference_memory's estimate "
          "(reference only)")


if __name__ == "__main__":
    main()
