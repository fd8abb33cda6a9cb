"""Peak host memory of the parity reference: the whole fp32 model vs the layer-streamed one, vs the weights.

    python benchmarks/bench_parity_memory.py [--layers 4] [--dtype float32] [--with-session] [--keep DIR]

A checkpoint with LLaMA-7B's width (n2 4096, n7 11008, 32 heads, vocab 32000) and `--layers` decoders is
written as HF safetensors in a temp dir (4 layers in fp32: 4.0 GiB). Each mode runs in a fresh process
what `verify parity` asks of the reference (a left-padded prefill of 2 rows, 11 and 6 tokens, then 8
greedy decode steps with the cache) and reports its high-water mark (VmHWM) minus the process's RSS
after imports, i.e. what the reference itself added:

- full: `load_model(dir)`, every weight in fp32 in RAM (what parity does today);
- streamed: `llama_tools.inference.reference.StreamedReference(dir)`, one decoder layer's fp32 weights at a time;
- session+streamed (--with-session): an fp32 ONNX export of the checkpoint on onnxruntime's CPU provider
  beside the streamed reference, the whole parity run in one process (the issue's goal: <= 1.45x weights).

--parity runs the real `verify parity` on that export instead, each in a fresh process, side by side:

- verify parity (whole graph): one session over the whole graph, the float64 truth and the graph's dtype
  streamed beside it, prefill and 8 decode steps;
- verify parity --by-layer: a session per block (cut from the export, weights read from its own .data file),
  the reference one layer at a time in float64 and fp32 (issue 16's goal: peak RSS <= 0.3x the weights at
  8 layers: python benchmarks/bench_parity_memory.py --layers 8 --parity).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
mode, ckpt, onnx_path = sys.argv[1], sys.argv[2], sys.argv[3]
from llama_tools.checkpoints.loading import load_model
from llama_tools.inference.reference import StreamedReference, reference_memory
from llama_tools.exporters import runtime

def rss(field="VmRSS:"):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

def hwm():  # this process's high-water RSS (ru_maxrss would keep a forking parent's across exec)
    return rss("VmHWM:")

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
print(json.dumps({"mode": mode, "base": base, "peak": hwm(),
                  "seconds": time.perf_counter() - t0, "session_rss": after_session - base, "model": model_bytes,
                  "last_step_max_abs": err}))
"""


PARITY_CHILD = r"""
import json, resource, sys, time
import onnxruntime, torch
from llama_tools.exporters.verification.by_layer import verify_by_layer
from llama_tools.exporters.verification.parity import resolve_target, verify_parity

def rss(field="VmRSS:"):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

def hwm():  # this process's high-water RSS (ru_maxrss would keep a forking parent's across exec)
    return rss("VmHWM:")

mode, ckpt, onnx_path = sys.argv[1], sys.argv[2], sys.argv[3]
base = rss()
t0 = time.perf_counter()
target = resolve_target(onnx_path, ckpt)
rep = verify_by_layer(target, provider="cpu") if mode == "by-layer" else verify_parity(target, provider="cpu")
worst = max(c.ratio for c in rep.checks)
print(json.dumps({"mode": mode, "base": base, "peak": hwm(),
                  "seconds": time.perf_counter() - t0, "passed": rep.passed, "worst_ratio": worst}))
"""


def parity_rows(ckpt: Path, onnx_path: Path) -> list[dict]:
    """`verify parity` whole-graph and --by-layer on the export, each in a fresh process."""
    rows = []
    for mode in ("whole graph", "by-layer"):
        out = subprocess.run([sys.executable, "-c", PARITY_CHILD, mode, str(ckpt), str(onnx_path)], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def write_checkpoint(layers: int, dtype: str, directory: Path) -> int:
    """LLaMA-7B width with `layers` decoders, seeded, as HF safetensors; returns the weights' bytes."""
    import torch

    from llama_tools.modeling.presets import get_preset
    from llama_tools.checkpoints.convert import save_checkpoint
    from llama_tools.modeling.model import build_model

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
    ap.add_argument("--parity", action="store_true", help="verify parity whole-graph vs --by-layer on the export")
    ap.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.layers, args.dtype, args.write_checkpoint)
        return
    with tempfile.TemporaryDirectory(prefix="bench-parity-mem-") as tmp:
        root = args.keep or Path(tmp)
        ckpt, onnx_path = root / f"ckpt-{args.layers}-{args.dtype}", root / f"onnx-{args.layers}-{args.dtype}/m.onnx"
        if not ckpt.exists():
            # In a child: a parent that held the model would hand its RSS to every child it forks after.
            subprocess.run([sys.executable, __file__, "--write-checkpoint", str(ckpt), "--layers", str(args.layers),
                            "--dtype", args.dtype], check=True)
            weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        else:
            weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        modes = ["full", "streamed"]
        if args.parity:
            if not onnx_path.exists():
                onnx_path.parent.mkdir(parents=True, exist_ok=True)
                export(ckpt, onnx_path)
            report_parity(parity_rows(ckpt, onnx_path), weights, args.layers, args.dtype)
            return
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
    print("added: peak RSS minus the RSS after imports; model: llama_tools.inference.reference.reference_memory's estimate "
          "(reference only)")


def report_parity(rows: list[dict], weights: int, layers: int, dtype: str) -> None:
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; LLaMA-7B width, {layers} "
          f"layers, {dtype} export + HF safetensors: weights {gib(weights)} GiB")
    print(f"{'verify parity':<14} {'peak GiB':>9} {'x weights':>9} {'added GiB':>9} {'x weights':>9} {'seconds':>8} "
          f"{'verdict':>8} {'worst ratio':>11}")
    for r in rows:
        added = r["peak"] - r["base"]
        print(f"{r['mode']:<14} {gib(r['peak']):>9} {r['peak'] / weights:>9.2f} {gib(added):>9} "
              f"{added / weights:>9.2f} {r['seconds']:>8.1f} {'PASS' if r['passed'] else 'FAIL':>8} "
              f"{r['worst_ratio']:>11.3g}")
    print("peak: the process's high-water RSS (VmHWM); added: minus its RSS after imports (torch, onnxruntime)")


if __name__ == "__main__":
    main()
