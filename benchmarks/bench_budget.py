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

from llama_tools.exporters.compare import judge
from llama_tools.exporters.foreign import describe_graph, foreign_lm
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.parity import onnx_step, run_trace, torch_step
from llama_tools.exporters.pipeline import export
from llama_tools.exporters.prompts import left_pad
from llama_tools.exporters.runtime import OnnxLM, create_session
from llama_tools.presets import get_preset
from llama_tools.reference import reference_model
from llama_tools.source import resolve

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
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {platform.processor() or '?'}; torch {torch.__version__}; CPU provider")
    print("| model | layers | dtype | graph | tensor | RMS ratio min / median / max | max-abs ratio min / median / max |")
    print("|---|---|---|---|---|---|---|")
    tmp = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    models = []
    if "tiny" in args.only:
        from helpers import sharp
        from llama_tools.convert import save_checkpoint

        save_checkpoint(get_preset("tiny"), {k: v.detach().clone() for k, v in sharp(get_preset("tiny")).state_dict().items()},
                        tmp / "tiny", to="hf")
        models.append(("tiny seeded (sharp q/k)", str(tmp / "tiny"), None, ["float32", "float16", "bfloat16"], {}))
    if "wide" in args.only:
        from llama_tools.convert import save_checkpoint
        from llama_tools.model import build_model

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
