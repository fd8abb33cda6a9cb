"""Planted faults: does `verify parity` catch them, and where does it say they are? And how small a fault it sees.

    python benchmarks/bench_faults.py [--model HF_DIR] [--graphs plain,fused,builder] [--sensitivity]

Each fault is planted in a copy of a correct export written beside it (`model.fault-NAME.onnx`: the
changed tensors inline, every other initializer still pointing into the export's own .data file, so no
weights are copied):

    scale       one weight matrix of one layer (mlp.down_proj of the middle layer) x (1 + 1e-3)
    rope        the RoPE base off by 1% (the graph's cos/sin tables recomputed with 1.01 x theta)
    kv-swap     two KV heads swapped in the middle layer (their columns of k_proj and v_proj, or of packed qkv)
    eps         the middle layer's input RMSNorm epsilon x 10 (the node's attribute, or its Add constant)
    final-norm  the final norm's gain x (1 + 1e-3), RMSNorm's γ or LayerNorm's (its β as it was): only the logits
                can see it (lm_head itself may be the embedding, tied, as in SmolLM2)

and each is checked by the whole-graph check and by --by-layer. The table: fault x graph x mode -> verdict,
the layer named, the worst ratio (error / noise). `--sensitivity` bisects the smallest scale error of one
matrix that each mode fails on. Default model: SmolLM2-135M-Instruct (tests/realmodels.py, cached).

An epsilon matters only where a token's mean square is near it: x10 (1e-5 -> 1e-4) changes rnorm's output by
about 9e-5 / (2 ms). In SmolLM2's first layer (Z^0 RMS 0.13) that is ~3e-3, in its middle layers (RMS 15-370)
1e-7 to 1e-10, below fp32 rounding: no check can see it there and it changes nothing. `--faults eps --layer 0`
plants it where it matters.

Where to expect each fault: --by-layer judges every layer's output, so it names the layer the fault is in.
The whole-graph check sees each layer's K and V only, and down_proj of layer j changes no K or V of layer
j: it names layer j+1, the first K/V the fault reaches (the logits only, when j is the last layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

FAULTS = ("scale", "rope", "kv-swap", "eps", "final-norm")
MODES = ("default", "whole", "by-layer")  # default: the verdict as `verify parity` gives it
LAYER_NODE = "/model/layers.{j}/"


# --- Planting ----------------------------------------------------------------------------------------------

class Planter:
    """An export's proto (without weights), edited tensor by tensor and saved beside it under another name."""

    def __init__(self, onnx_path: str | Path):
        import onnx

        self.path = Path(onnx_path)
        self.model = onnx.load(str(self.path), load_external_data=False)
        self.inits = {t.name: t for t in self.model.graph.initializer}

    def array(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self.inits[name], base_dir=str(self.path.parent))

    def replace(self, name: str, arr: np.ndarray) -> None:
        """The tensor stored inline from now on (the others keep their external data)."""
        from onnx import numpy_helper

        from onnx.helper import tensor_dtype_to_np_dtype

        t = self.inits[name]
        t.CopyFrom(numpy_helper.from_array(arr.astype(tensor_dtype_to_np_dtype(t.data_type), copy=False), name))

    def nodes(self, j: int | None = None, op: str | None = None, contains: str = "") -> list[Any]:
        prefix = LAYER_NODE.format(j=j) if j is not None else ""
        return [n for n in self.model.graph.node if prefix in n.name and contains in n.name
                and (op is None or n.op_type == op)]

    def weight_of(self, node: Any) -> str:
        w = [x for x in node.input if x in self.inits and len(self.inits[x].dims) == 2]
        assert len(w) == 1, f"{node.name}: expected one 2-D weight among {list(node.input)}"
        return w[0]

    def save(self, tag: str) -> Path:
        import onnx

        out = self.path.parent / f"{self.path.stem}.fault-{tag}.onnx"
        onnx.save(self.model, str(out))
        return out


def plant(onnx_path: str | Path, fault: str, cfg: Any, layer: int, eps: float = 1e-3, tag: str | None = None) -> Path:
    """Write `fault` planted in a copy of the export beside it; returns the copy's path."""
    p = Planter(onnx_path)
    if fault == "scale":
        name = p.weight_of(_one(p.nodes(layer, "MatMul", "/mlp/down_proj/"), "down_proj"))
        p.replace(name, p.array(name).astype(np.float64) * (1 + eps))
    elif fault == "final-norm":  # ours name it /model/norm/..., the builder /model/layers.{n8}/final_norm_layernorm/
        norm = [n for n in p.model.graph.node if "/model/norm/" in n.name or "final_norm" in n.name]
        gains = {x for n in norm for x in n.input if x in p.inits and list(p.inits[x].dims) == [cfg.hidden_size]}
        if len(gains) > 1:  # a LayerNorm (GPT-NeoX, Falcon) reads γ and β, both [n2]: β is named .bias everywhere
            gains = {x for x in gains if not x.endswith("bias")}
        name = _one(sorted(gains), "final norm gain")
        p.replace(name, p.array(name).astype(np.float64) * (1 + eps))
    elif fault == "rope":
        from llama_tools.modeling.rope import rope_inv_freq

        inv = np.array(rope_inv_freq(cfg.replace(rope_theta=cfg.rope_theta * 1.01)), np.float64)  # [n6/2]
        for name, fn in (("cos_cache", np.cos), ("sin_cache", np.sin)):
            rows = p.array(name).shape[0]
            p.replace(name, fn(np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]))  # [positions, n6/2]
    elif fault == "kv-swap":
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        # One KV head (MQA) has nothing to swap it with: two query heads are swapped instead, the same class of
        # fault (heads out of order) in the only projection that has two.
        projections = ("k_proj", "v_proj") if nkv >= 2 else ("q_proj",)
        split = [(p.weight_of(_one(p.nodes(layer, "MatMul", f"/{w}/"), w)), 0) for w in projections
                 if p.nodes(layer, "MatMul", f"/{w}/")]
        if not split:  # packed q|k|v columns: [n2, (nq + 2 nkv) d]
            qkv = p.weight_of(_one(p.nodes(layer, "MatMul", "qkv_proj"), "qkv_proj"))
            split = [(qkv, nq * d), (qkv, (nq + nkv) * d)] if nkv >= 2 else [(qkv, 0)]
        for name, base in split:
            w = p.array(name).copy()  # [n2, out]: an output channel per column
            h0, h1 = slice(base, base + d), slice(base + d, base + 2 * d)
            w[:, h0], w[:, h1] = w[:, h1].copy(), w[:, h0].copy()
            p.replace(name, w)
    elif fault == "eps":
        norm = [n for n in p.nodes(layer, contains="/input_layernorm/") if "LayerNormalization" in n.op_type]
        if norm:
            for a in norm[0].attribute:
                if a.name == "epsilon":
                    a.f *= 10
        else:  # the decomposed RMSNorm: Pow, ReduceMean, Add(eps), Sqrt, Div
            add = _one(p.nodes(layer, "Add", "/input_layernorm/"), "input_layernorm Add")
            const = next(x for x in add.input if x in p.inits)
            new = f"fault_eps_{layer}"
            from onnx import numpy_helper

            p.model.graph.initializer.append(numpy_helper.from_array(p.array(const) * np.float32(10), new))
            add.input[list(add.input).index(const)] = new
    else:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    return p.save(tag or fault)


def _one(nodes: list[Any], what: str) -> Any:
    assert len(nodes) == 1, f"expected one {what}, found {[getattr(n, 'name', n) for n in nodes]}"
    return nodes[0]


def expected(fault: str, mode: str, layer: int, n8: int, cfg: Any = None) -> str:
    """Where each mode should place the fault (see the module docstring)."""
    if fault == "rope":  # the global table: a model with a local RoPE base (Gemma 3) reads it first at a global layer
        local = cfg is not None and cfg.rope_local_theta is not None
        return f"layer {next(j for j in range(n8) if not cfg.slides(j)) if local else 0}"
    if fault == "final-norm":
        return "logits only"
    if fault == "scale" and mode == "whole":
        return f"layer {layer + 1}" if layer + 1 < n8 else "logits only"
    return f"layer {layer}"


# --- Checking -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    passed: bool
    located: str  # "layer 3", "logits only", "the embedding", "-" when it passed
    ratio: float  # the worst error / noise of any check
    seconds: float


def check(onnx_path: str | Path, mode: str, source: str | None = None, steps: int = 8) -> Verdict:
    """One `verify parity` run (whole graph or --by-layer) as the CLI would make it."""
    from llama_tools.exporters.verification.by_layer import verify_by_layer
    from llama_tools.exporters.verification.parity import resolve_target, verify_parity

    t0 = time.perf_counter()
    target = resolve_target(str(onnx_path), source)
    if mode == "default":
        from llama_tools.exporters.verification.verdict import parity_inputs, verify

        v = verify(target, parity_inputs(target, None, steps), provider="cpu", steps=steps)
        checks = [c for r in (v.by_layer, v.whole) if r is not None for c in r.checks]
        ratio = max((c.ratio for c in checks if math.isfinite(c.ratio)), default=math.inf)
        return Verdict(v.passed, v.first_bad or "-", ratio, time.perf_counter() - t0)
    if mode == "by-layer":
        rep: Any = verify_by_layer(target, provider="cpu")
        located = rep.first_bad or "-"
    else:
        rep = verify_parity(target, provider="cpu", steps=steps)
        if rep.passed:
            located = "-"
        elif rep.first_bad_layer is not None:
            located = f"layer {rep.first_bad_layer}"
        else:
            located = "logits only"
    ratio = max((c.ratio for c in rep.checks if math.isfinite(c.ratio)), default=math.inf)
    return Verdict(rep.passed, located, ratio, time.perf_counter() - t0)


def sensitivity(onnx_path: str | Path, mode: str, cfg: Any, layer: int, source: str | None = None,
                lo: float = 1e-8, hi: float = 1e-2, steps: int = 8) -> tuple[float, float]:
    """Bisect (in log scale) the smallest down_proj scale error that `mode` fails on: (last passed, first failed)."""
    assert not check(plant(onnx_path, "scale", cfg, layer, hi, "sens"), mode, source).passed, f"{mode} misses {hi}"
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if check(plant(onnx_path, "scale", cfg, layer, mid, "sens"), mode, source).passed:
            lo = mid
        else:
            hi = mid
    return lo, hi


# --- The benchmark ------------------------------------------------------------------------------------------

def export_graphs(hf_dir: Path, root: Path, graphs: list[str]) -> dict[str, Path]:
    """Our plain and fused fp32 exports (and onnxruntime-genai's builder graph) of the checkpoint, under root."""
    from llama_tools.exporters.fused import export_fused
    from llama_tools.exporters.onnx_export import export_onnx

    out = {}
    for g in graphs:
        path = root / g / "model.onnx"
        if not path.exists():
            if g == "plain":
                export_onnx(str(hf_dir), path)
            elif g == "fused":
                export_fused(str(hf_dir), path)
            elif g == "builder":
                builder(hf_dir, root / g, root / "builder-input")
        out[g] = path
    return out


def builder(hf_dir: Path, out: Path, work: Path, precision: str = "fp32") -> None:
    """onnxruntime-genai's model builder (cpu, `precision`: fp32 or int4) on the checkpoint, run as
    tests/test_foreign_graphs.py runs it.

    The builder of onnxruntime-genai 0.18 wants `rope_scaling` as a dict: it reads a directory of links to
    the checkpoint's files with that one field of config.json filled in.
    """
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_foreign_graphs import BUILDER

    work.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "config.json" and not (work / f.name).exists():
            (work / f.name).symlink_to(f.resolve())
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_scaling"] = cfg.get("rope_scaling") or {"rope_type": "default"}
    (work / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-c", BUILDER, "-i", str(work), "-o", str(out), "-p", precision, "-e", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an HF checkpoint directory [default: SmolLM2-135M-Instruct]")
    ap.add_argument("--graphs", default="plain,fused", help="comma-separated: plain, fused, builder")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--layer", type=int, help="the layer faults go in [default: the middle one]")
    ap.add_argument("--sensitivity", action="store_true", help="also bisect the smallest scale error each mode sees")
    ap.add_argument("--keep", type=Path, help="keep the exports in this directory (and reuse them)")
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import realmodels

        args.model = Path(realmodels.smollm2_hf())
    from llama_tools.checkpoints.source import resolve

    cfg = resolve(str(args.model)).cfg
    layer = cfg.num_hidden_layers // 2 if args.layer is None else args.layer
    graphs = args.graphs.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        root = args.keep or Path(tmp)
        paths = export_graphs(args.model, root, graphs)
        source = str(args.model)
        print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; model {args.model.name}: "
              f"{cfg.num_hidden_layers} layers, width {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
              f"{cfg.num_key_value_heads}; faults in layer {layer}")
        print(f"{'fault':<10} {'graph':<8} {'mode':<9} {'verdict':<7} {'located':<12} {'expected':<12} "
              f"{'worst ratio':>11} {'seconds':>8}")
        for g, path in paths.items():
            for mode in MODES:
                v = check(path, mode, source)
                print(f"{'none':<10} {g:<8} {mode:<9} {'PASS' if v.passed else 'FAIL':<7} {v.located:<12} {'-':<12} "
                      f"{v.ratio:>11.3g} {v.seconds:>8.1f}", flush=True)
            for fault in args.faults.split(","):
                faulted = plant(path, fault, cfg, layer)
                for mode in MODES:
                    v = check(faulted, mode, source)
                    want = expected(fault, mode, layer, cfg.num_hidden_layers, cfg)
                    print(f"{fault:<10} {g:<8} {mode:<9} {'PASS' if v.passed else 'FAIL':<7} {v.located:<12} "
                          f"{want:<12} {v.ratio:>11.3g} {v.seconds:>8.1f}", flush=True)
                faulted.unlink()
        if args.sensitivity:
            path = paths[graphs[0]]
            for mode in MODES:
                lo, hi = sensitivity(path, mode, cfg, layer, source)
                print(f"sensitivity ({graphs[0]}, {mode}): one matrix (layer {layer} down_proj) scaled by 1 + eps "
                      f"fails from eps = {hi:.2g} (passes at {lo:.2g})", flush=True)
        for p in root.glob("*/*.fault-*.onnx"):
            p.unlink()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
