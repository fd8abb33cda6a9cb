"""The error budget's measurements: graph error / PyTorch's own noise, both against float64, per model, dtype, graph.

    python benchmarks/bench_budget.py [--only tiny,wide,smollm2,glublm] [--dtypes float32,float16,bfloat16] [--steps 4]
                                      [--builder-dir D --optimum-dir D]

For each model and dtype, PyTorch float64 (the truth) and PyTorch in the dtype (the noise) run once on a batch
whose rows are several seeds of random ids (and real text for SmolLM2); each graph runs the same batch. Every
row is then judged alone (its own mask), so each (graph, row) gives one ratio per tensor: the logits, the worst
layer's K/V, the decode logits. Printed: min / median / max over the rows of the RMS ratio (what `verify parity`
decides by) and of the max-abs ratio (max |graph - f64| / max |PyTorch - f64|), to show which one is stable.
bf16 graphs run on the CPU provider emulated (fp32 arithmetic rounded to bf16 after every op, emulation.py),
against PyTorch's own bf16 on the CPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from llama_tools.exporters.verification.compare import judge
from llama_tools.exporters.foreign import describe_graph, foreign_lm
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.verification.parity import onnx_step, run_trace, torch_step
from llama_tools.exporters.pipeline import export
from llama_tools.exporters.prompts import left_pad
from llama_tools.exporters.runtime import OnnxLM, create_session
from llama_tools.modeling.presets import get_preset
from llama_tools.inference.reference import reference_model
from llama_tools.checkpoints.source import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and fine food."


def rows_for(cfg, seeds: int, text_ids: list[int] | None) -> list[list[int]]:
    rows = [np.random.default_rng(s).integers(3, cfg.vocab_size, size=9 + 2 * s).tolist() for s in range(seeds)]
    return rows + ([text_ids] if text_ids else [])


def figures(got, ref, truth, mask, dtype: str) -> dict[str, tuple[float, float]]:
    """Per row: (RMS ratio, max-abs ratio) for logits, the worst K/V layer, decode logits."""
    out: dict[str, list[tuple[float, float]]] = {"logits": [], "worst K/V": [], "decode": []}
    for r in range(mask.shape[0]):
        valid = np.zeros(mask.shape, bool)
        valid[r] = mask[r].astype(bool)
        c = judge("logits", got.logits, ref.logits, truth.logits, valid, dtype, logits=True)
        out["logits"].append((c.ratio, c.max_error / c.max_noise))
        kv = []
        for (gk, gv), (rk, rv), (tk, tv) in zip(got.presents, ref.presents, truth.presents):
            for g, rr, t in ((gk, rk, tk), (gv, rv, tv)):
                c = judge("kv", *(a.transpose(0, 2, 1, 3) for a in (g, rr, t)), valid, dtype)
                kv.append((c.ratio, c.max_error / c.max_noise if c.max_noise else np.inf))
        out["worst K/V"].append((max(k[0] for k in kv), max(k[1] for k in kv)))
        if got.decode.shape[1]:
            dv = np.zeros(got.decode.shape[:2], bool)
            dv[r] = True
            c = judge("decode", got.decode, ref.decode, truth.decode, dv, dtype, logits=True)
            out["decode"].append((c.ratio, c.max_error / c.max_noise))
    return out


def fp16_over_fp32(path: str, steps: int = 4) -> dict[str, dict[str, list[float]]]:
    """PyTorch fp16's noise / PyTorch fp32's noise (both RMS to float64, the larger of plain and reassociated), per
    layer and tensor, on the model's built-in text: layer by layer (each fed float64's input, as --checks layers
    does) and through the whole graph (prefill K/V, logits, decode logits). What the fp16 fallback (compare.py
    FP16_PER_FP32) scales fp32's noise by where PyTorch fp16 overflows."""
    from llama_tools.exporters.verification.by_layer import LayerReference, per_channel
    from llama_tools.exporters.prompts import default_inputs

    src = resolve(path)
    cfg = src.cfg
    rows = default_inputs(src, cfg.vocab_size, 256).rows
    ids, mask = left_pad(rows)
    valid = mask.astype(bool)
    ref = reference_model(src, batch=len(rows), seq=ids.shape[1], steps=steps, float64_pass=True)
    dts = {"float32": torch.float32, "float16": torch.float16}
    f64 = lambda t: t.to(torch.float64).numpy()  # noqa: E731
    kv = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731

    def noise(dt: str, refs, truth, v=valid) -> float:
        return judge("n", refs[0], refs, truth, v, dt).noise

    out: dict[str, dict[str, list[float]]] = {"by layer": {"hidden": [], "key": [], "value": []},
                                              "whole graph": {"key": [], "value": [], "logits": [], "decode": []}}
    truth_side = LayerReference(ref.reader, torch.float64)
    sides = {d: (LayerReference(ref.reader, t), LayerReference(ref.reader, t, reassociated=True))
             for d, t in dts.items()}
    z = truth_side.embed(ids)
    for j in range(cfg.num_hidden_layers):
        t = [f64(x) for x in truth_side.layer(j, z, mask)]
        got = {d: [[f64(x) for x in side.layer(j, z.to(dts[d]), mask)] for side in sides[d]] for d in dts}
        ratio = {}
        for i, what in enumerate(("hidden", "key", "value")):
            n = {}
            for d in dts:
                if what == "hidden":
                    scaled = per_channel(got[d][0][0], t[0], valid, got[d][1][0])
                    n[d] = noise(d, scaled[:2], scaled[2])
                else:
                    n[d] = noise(d, [kv(g[i]) for g in got[d]], kv(t[i]))
            ratio[what] = n["float16"] / n["float32"]
            out["by layer"][what].append(ratio[what])
        z = truth_side.layer(j, z, mask)[0]
        print(f"  layer {j}: fp16/fp32 noise hidden {ratio['hidden']:.0f}, K {ratio['key']:.0f}, "
              f"V {ratio['value']:.0f}", flush=True)
    truth = run_trace(torch_step(ref.with_dtype(torch.float64)), ids, mask, steps, None)
    traces = {d: [run_trace(torch_step(ref.with_dtype(t, reassociated=r)), ids, mask, steps, None, truth.tokens)
                  for r in (False, True)] for d, t in dts.items()}
    for layer in range(cfg.num_hidden_layers):
        for i, what in enumerate(("key", "value")):
            n = {d: noise(d, [kv(tr.presents[layer][i]) for tr in traces[d]], kv(truth.presents[layer][i]))
                 for d in dts}
            out["whole graph"][what].append(n["float16"] / n["float32"])
    n = {d: noise(d, [tr.logits for tr in traces[d]], truth.logits) for d in dts}
    out["whole graph"]["logits"].append(n["float16"] / n["float32"])
    if steps:
        dv = np.ones(truth.decode.shape[:2], bool)
        n = {d: noise(d, [tr.decode for tr in traces[d]], truth.decode, dv) for d in dts}
        out["whole graph"]["decode"].append(n["float16"] / n["float32"])
    return out


def stats(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {float(np.median(xs)):.2f} / {max(xs):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="tiny,wide,smollm2,glublm")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16", help="of those each model is measured in")
    ap.add_argument("--builder-dir", type=Path, help="onnxruntime-genai builder output for SmolLM2 (fp32)")
    ap.add_argument("--optimum-dir", type=Path, help="optimum-cli export onnx output for SmolLM2")
    ap.add_argument("--fp16-ratio", action="store_true",
                    help="only PyTorch fp16's noise / fp32's per layer (smollm2, qwen2, glublm in --only)")
    args = ap.parse_args()
    if args.fp16_ratio:
        import realmodels

        for name in args.only.split(","):
            make = {"smollm2": realmodels.smollm2_hf, "qwen2": realmodels.qwen2_hf, "glublm": realmodels.glublm_hf,
                    "gemma3": realmodels.gemma3_hf}.get(name)
            if make is None:
                continue
            print(f"{name}: PyTorch fp16 noise / PyTorch fp32 noise (2^13 = 8192 is the unit roundoffs' ratio)")
            for mode, tensors in fp16_over_fp32(str(make()), args.steps).items():
                for what, xs in tensors.items():
                    fin = [x for x in xs if np.isfinite(x)]
                    print(f"  {mode:<12} {what:<7} min / median / max {stats(fin) if fin else '-'}"
                          f"{f'; {len(xs) - len(fin)} not finite' if len(fin) < len(xs) else ''}", flush=True)
        return
    print(f"machine: {platform.machine()}, {platform.processor() or '?'}; torch {torch.__version__}; CPU provider")
    print("| model | layers | dtype | graph | tensor | RMS ratio min / median / max | max-abs ratio min / median / max |")
    print("|---|---|---|---|---|---|---|")
    tmp = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    models = []
    if "tiny" in args.only:
        from helpers import sharp
        from llama_tools.checkpoints.convert import save_checkpoint

        save_checkpoint(get_preset("tiny"), {k: v.detach().clone() for k, v in sharp(get_preset("tiny")).state_dict().items()},
                        tmp / "tiny", to="hf")
        models.append(("tiny seeded (sharp q/k)", str(tmp / "tiny"), None, ["float32", "float16", "bfloat16"], {}))
    if "wide" in args.only:
        from llama_tools.checkpoints.convert import save_checkpoint
        from llama_tools.modeling.model import build_model

        cfg = get_preset("tiny").replace(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                        num_key_value_heads=32, head_dim=128, num_hidden_layers=2, vocab_size=32000)
        save_checkpoint(cfg, build_model(cfg, seed=0).state_dict(), tmp / "wide", to="hf")
        models.append(("7B width seeded", str(tmp / "wide"), None, ["float32"], {}))
    if "smollm2" in args.only:
        import realmodels
        from tokenizers import Tokenizer

        hf = realmodels.smollm2_hf()
        text = Tokenizer.from_file(str(Path(hf) / "tokenizer.json")).encode(TEXT).ids
        extra = {}
        if args.builder_dir:
            extra["builder fp32"] = args.builder_dir / "model.onnx"
        if args.optimum_dir:
            extra["Optimum fp32"] = args.optimum_dir / "model.onnx"
        models.append(("SmolLM2-135M (trained)", str(hf), text, ["float32", "float16", "bfloat16"], extra))

    if "glublm" in args.only:
        import realmodels
        from tokenizers import Tokenizer

        g = realmodels.glublm_hf()
        text = [1] + Tokenizer.from_file(str(Path(g) / "tokenizer.json")).encode(
            "hello little fish. what is the ocean like?", add_special_tokens=False).ids
        models.append(("GlubLM 0.3.1 (trained)", str(g), text, ["float32", "float16", "bfloat16"], {}))

    for name, path, text, dts, extra in models:
        src = resolve(path)
        cfg = src.cfg
        prompts = rows_for(cfg, args.seeds, text)
        ids, mask = left_pad(prompts)
        ref32 = reference_model(src, batch=len(prompts), seq=ids.shape[1], steps=args.steps, float64_pass=True)
        truth = run_trace(torch_step(ref32.with_dtype(torch.float64)), ids, mask, args.steps, None)
        for dt in (d for d in dts if d in args.dtypes.split(",")):
            ref = run_trace(torch_step(ref32.with_dtype(getattr(torch, dt))), ids, mask, args.steps, None, truth.tokens)
            graphs = {}
            for kind in ("plain", "fused"):
                out = tmp / f"{Path(path).name}-{kind}-{dt}" / "model.onnx"
                if kind == "plain":
                    export_onnx(src, out, dtype=dt)
                else:
                    export(src, out, dtype=dt, optimize=True, client_files=False)
                graphs[kind] = out
            if dt == "float32":
                graphs.update(extra)
            for gname, gpath in graphs.items():
                run = create_session(gpath, "cpu")
                if gname in extra:
                    lm = foreign_lm(run, describe_graph(gpath), cfg)
                else:
                    lm = OnnxLM(run, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
                got = run_trace(onnx_step(lm), ids, mask, args.steps, lm.empty_cache(len(prompts)), truth.tokens)
                for tensor, vals in figures(got, ref, truth, mask, dt).items():
                    if vals:
                        print(f"| {name} | {cfg.num_hidden_layers} | {dt} | {gname} | {tensor} | "
                              f"{stats([v[0] for v in vals])} | {stats([v[1] for v in vals])} |", flush=True)
                del run, lm


if __name__ == "__main__":
    main()
