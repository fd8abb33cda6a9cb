"""Our default int4 against onnxruntime-genai's builder int4, on real trained models: size, decode speed, quality.

    python benchmarks/bench_int4.py [--only smollm2|qwen2.5-coder-0.5b|gemma3] [--rounds 11] [--threads 1]
                                    [--hqq] [--variants] [--try OPTIONS] [--no-baselines] [--keep DIR]
    python benchmarks/bench_int4.py --kernels     (MatMulNBits alone: int4 against 8-bit blocks of 32..128)

For each model (tests/realmodels.py: SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct, Gemma 3 270M), three
graphs, each made by its own command in a fresh process:

    ours, default        llama-tools export onnx HF -o OUT --quantize int4          (the default quality target)
    ours, awq all int4   llama-tools export onnx HF -o OUT --quantize int4 --max-kl none
    ours, RTN int4       llama-tools export onnx HF -o OUT --quantize int4 --max-kl none --int4-algorithm rtn
    builder int4         python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4 -e cpu   (its defaults)

and for each: the file's bytes; decode ms/token through onnxruntime-genai's own loop (64 prompt tokens, 64 greedy
steps, the median step, after an untimed warm-up; each graph in a fresh process, the graphs in alternating order,
--rounds times, the median of the rounds' ratios; every
genai_config.json gets the same intra_op_num_threads); mean KL(fp32 || int4) and top-1 over the held-out text
below (in no calibration or quality text of ours), and its perplexity, against PyTorch fp32 of the same
checkpoint; the built-in prompts' 16 greedy tokens against PyTorch fp32's; `verify int4` (its default sequence,
and on the held-out text); the export's peak RSS (its own high-water mark, the command's JSON) against
max(1 GB, 0.5x the fp32 weights). Ratios are to the builder's row. The goal column holds our default to:
every decisive answer kept (DECISIVE), KL <= 0.5x the builder's, bytes <= 1.3x, decode <= 1.1x, verify FAITHFUL.
--hqq adds `--int4-algorithm hqq` (every matrix HQQ); --variants RTN to the target, asymmetric and block-16 rows;
--try OPTIONS a row exported with those options; --no-baselines leaves out the two all-int4 rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Held out: in none of exporters/prompts.PASSAGES (calibration) nor prompts.QUALITY_TEXT (the export's check).
HELD_OUT = (
    "The Amazon is the largest rainforest on Earth, covering much of northern Brazil and parts of eight other "
    "countries. Its rivers carry about a fifth of all the fresh water that flows into the oceans, and scientists "
    "estimate that it is home to one in ten known species. Deforestation, mostly for cattle ranching and soy, has "
    "removed close to a fifth of the forest since 1970.\n\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. In plants it takes place in the "
    "chloroplasts, whose green pigment, chlorophyll, absorbs red and blue light and reflects green.\n\n"
    "import json\n\n\ndef load_settings(path):\n    with open(path, encoding=\"utf-8\") as f:\n"
    "        settings = json.load(f)\n    return {key.lower(): value for key, value in settings.items()}\n")
# Short factual prompts: fp32's greedy answer comes in the first few tokens; 16 are compared.
PROMPTS = ("The capital of France is", "Water freezes at a temperature of", "The largest planet in the solar system is",
           "William Shakespeare wrote the play", "def add(a, b):\n    return", "The chemical symbol for gold is")
STEPS = 16
# fp32's answer is decisive when each of its tokens leads the runner-up by at least DECISIVE nats (1.65x as likely).
# Every int4 graph measured moves fp32's lead on held-out positions by a median 0.4-0.8 nats (printed per row:
# "gap moves"), so a smaller lead (SmolLM2's 0.02 nats between "100°C" and "100 °C") is kept or lost by chance:
# the goal counts the decisive answers; every answer is counted beside them.
DECISIVE = 0.5
MODELS = {"smollm2": "smollm2_hf", "qwen2.5-coder-0.5b": "qwen2_hf", "gemma3": "gemma3_hf"}
VARIANTS = {"RTN to the target (--int4-algorithm rtn)": ["--int4-algorithm", "rtn"],
            "RTN asymmetric, block 32": ["--int4-algorithm", "rtn", "--int4-asymmetric", "--max-kl", "none"],
            "RTN symmetric, block 16": ["--int4-algorithm", "rtn", "--int4-block-size", "16", "--max-kl", "none"]}
GOAL = {"size": 1.3, "kl": 0.5, "decode": 1.1}


@dataclass
class Row:
    """One graph of one model, and what was measured on it."""

    name: str
    path: Path
    bytes: int = 0
    export: dict[str, Any] = field(default_factory=dict)  # the export command's JSON (ours)
    decode_ms: list[float] = field(default_factory=list)  # one median step per round
    kl: float = float("nan")
    top1: float = float("nan")
    ppl: tuple[float, float] = (float("nan"), float("nan"))
    greedy: list[list[int]] = field(default_factory=list)  # per prompt, STEPS ids
    verify: dict[str, Any] = field(default_factory=dict)  # "default" / "text" -> verify int4's JSON
    gap_moves: np.ndarray = field(default_factory=lambda: np.zeros(0))  # |change of fp32's top-2 gap| per position


def graph_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name in (path.name, path.name + ".data"))


def llama_tools(*argv: str) -> tuple[int, dict, str]:
    """The CLI in a fresh process: (exit code, its JSON, stderr)."""
    done = subprocess.run([sys.executable, "-m", "llama_tools.cli", *argv, "--format", "json"], capture_output=True,
                          text=True, cwd=ROOT)
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except json.JSONDecodeError:
        return done.returncode, {}, done.stderr


def export_ours(hf: Path, out: Path, extra: list[str]) -> Row | str:
    """`export onnx --quantize int4 EXTRA` -> its row; a string when it failed (the command's last line). A graph
    kept by an earlier run (--keep) is reused with the JSON its export wrote."""
    saved = out.parent / "export.json"
    if saved.is_file() and out.is_file():
        return Row("", out, graph_bytes(out), json.loads(saved.read_text()))
    t = time.time()
    code, rep, err = llama_tools("export", "onnx", str(hf), "-o", str(out), "--quantize", "int4", "-q", *extra)
    if code != 0:
        return (err.strip().splitlines() or ["no output"])[-1]
    rep["bench_wall_s"] = time.time() - t
    saved.write_text(json.dumps(rep))
    return Row("", out, graph_bytes(out), rep)


def export_builder(hf: Path, tmp: Path) -> Row:
    import bench_faults

    out = tmp / "builder"
    bench_faults.builder(hf, out, tmp / "builder-in", precision="int4")
    return Row("builder int4 (-p int4 -e cpu)", out / "model.onnx", graph_bytes(out / "model.onnx"))


def time_decode(rows: list[Row], rounds: int, threads: int, vocab: int, window: int = 0) -> None:
    """Each row's decode ms/token through onnxruntime-genai, the rows in alternating order each round, each run in a
    fresh process: where a graph's weights land (huge pages or not, what the shared L3 holds) is drawn anew each
    time, so no one load's luck decides a ratio (one process per graph measured 1.05x one run and 1.27x the next)."""
    for r in rows:
        config = r.path.parent / "genai_config.json"
        data = json.loads(config.read_text())
        data["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        config.write_text(json.dumps(data, indent=2))
    for k in range(rounds):
        for r in rows if k % 2 == 0 else rows[::-1]:
            done = subprocess.run([sys.executable, __file__, "--decode-one", str(r.path.parent), "--vocab", str(vocab),
                                   "--window", str(window)], capture_output=True, text=True, check=True)
            r.decode_ms.append(float(done.stdout.split()[-1]))


def decode_once(folder: Path, vocab: int, window: int) -> float:
    """The median ms of 64 greedy steps after a 64-token prompt, after one untimed warm-up generation."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    prompt = np.random.default_rng(1).integers(1000, min(vocab, 30000), size=64).tolist()
    for steps_wanted in (8, 64):
        params = og.GeneratorParams(model)
        # The builder's sliding-window attention (Gemma 3) wants a KV buffer of at least its window.
        # min_length: an end-of-text token must not end a timed run early.
        params.set_search_options(max_length=max(len(prompt) + 64, window + 1), min_length=len(prompt) + 64,
                                  do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        steps = []
        while len(steps) < steps_wanted and not gen.is_done():
            t = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - t)
        del gen
    return statistics.median(steps) * 1e3


def lm_of(path: Path, cfg: Any) -> Any:
    """The graph's one-step runner: ours by our names, the builder's by its own (exporters/foreign.py)."""
    from llama_tools.exporters.foreign import describe_graph, foreign_lm
    from llama_tools.exporters.graph_meta import has_our_metadata
    from llama_tools.exporters.runtime import OnnxLM, create_session

    session = create_session(path, "cpu")
    if has_our_metadata(path):
        return OnnxLM(session, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    return foreign_lm(session, describe_graph(path), cfg)


def onnx_greedy(lm: Any, prompt: list[int], steps: int) -> list[int]:
    from llama_tools.exporters.prompts import positions

    ids, out, total = list(prompt), None, 0
    cache, new = lm.empty_cache(1), []
    feed = ids
    for _ in range(steps):
        total += len(feed)
        arr = np.array([feed], np.int64)
        mask = np.ones((1, total), np.int64)
        out = lm(arr, mask, positions(mask, len(feed)), cache)
        cache = out.cache
        new.append(int(np.asarray(out.logits)[0, -1].argmax()))
        feed = [new[-1]]
    return new


def torch_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """fp32's greedy tokens, and at each its margin: log p(top-1) - log p(top-2), nats."""
    import torch

    new, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]))
        for _ in range(steps):
            top = out.logits[0, -1].double().topk(2).values  # a log-softmax's gaps are the logits' gaps
            margins.append(float(top[0] - top[1]))
            new.append(int(out.logits[0, -1].argmax()))
            if len(new) < steps:
                out = model(torch.tensor([[new[-1]]]), past_key_values=out.past_key_values)
    return new, margins


def score(row: Row, cfg: Any, held: list[int], want: np.ndarray, prompts: list[list[int]]) -> None:
    """KL, top-1 and perplexity on the held-out ids, and the prompts' greedy tokens, through onnxruntime."""
    from llama_tools.exporters.prompts import positions
    from llama_tools.exporters.quantize import kl_and_ppl

    lm = lm_of(row.path, cfg)
    arr = np.array([held], np.int64)
    mask = np.ones_like(arr)
    got = np.asarray(lm(arr, mask, positions(mask, arr.shape[1]), lm.empty_cache(1)).logits, np.float64)[0]
    kl, ppl_ref, ppl_got = kl_and_ppl(want, got, arr[0])
    row.kl, row.top1, row.ppl = float(kl.mean()), float((want.argmax(-1) == got.argmax(-1)).mean()), (ppl_ref, ppl_got)
    two = np.argsort(want, -1)[:, -2:]  # [n, 2]: fp32's runner-up and top-1 at each held-out position
    gap = lambda z: np.take_along_axis(z, two[:, 1:], -1) - np.take_along_axis(z, two[:, :1], -1)  # noqa: E731
    row.gap_moves = np.abs(gap(got) - gap(want))[:, 0]  # how far the graph moves fp32's lead, nats
    row.greedy = [onnx_greedy(lm, p, STEPS) for p in prompts]
    del lm


def verify(row: Row, hf: Path, held_file: Path) -> None:
    for key, extra in (("default", []), ("text", ["--text", str(held_file), "--prompt", PROMPTS[0], "--steps", "16"])):
        _, rep, err = llama_tools("verify", "int4", str(row.path), "--source", str(hf), *extra)
        row.verify[key] = rep or {"faithful": False, "failures": [(err.strip().splitlines() or ["?"])[-1]]}


def answer_len(ids: list[int], tok: Any) -> int:
    """fp32's answer: its greedy tokens before the first that opens with a comma, full stop or the like, or holds a
    newline (" Paris" of " Paris.", " Au" of " Au.\n\n", " a + b" of " a + b\n"), at least one token."""
    for i in range(1, len(ids)):
        piece = tok.decode([ids[i]])
        if "\n" in piece or piece.lstrip(" ")[:1] in tuple(".,;:!?"):
            return i
    return len(ids)


def bench_model(key: str, args: argparse.Namespace, out: list[str]) -> None:
    import realmodels
    import torch

    from llama_tools.checkpoints.loading import load_model
    from llama_tools.checkpoints.source import load_tokenizer, resolve

    hf = Path(getattr(realmodels, MODELS[key])())
    src = resolve(str(hf))
    cfg = src.cfg
    weights = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    bound = max(1e9, 0.5 * weights)
    tmp = Path(args.keep) / key if args.keep else Path(tempfile.mkdtemp(prefix=f"bench-int4-{key}-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        rows: list[Row] = []
        plan = [("ours, default", [])]
        if not args.no_baselines:
            plan += [("ours, awq all int4 (--max-kl none)", ["--max-kl", "none"]),
                     ("ours, RTN all int4 (--int4-algorithm rtn --max-kl none)",
                      ["--int4-algorithm", "rtn", "--max-kl", "none"])]
        plan += [(f"ours, {extra}", extra.split()) for extra in args.try_ or []]
        if args.hqq:
            plan.append(("ours, HQQ all int4", ["--int4-algorithm", "hqq"]))
        if args.variants:
            plan += list(VARIANTS.items())
        for name, extra in plan:
            made = export_ours(hf, tmp / re.sub(r"[^\w.]+", "_", name.split(" (")[0]).strip("_") / "model.onnx", extra)
            if isinstance(made, str):
                print(f"{key}: {name} failed: {made}", flush=True)
                continue
            made.name = name
            rows.append(made)
            print(f"{key}: {name}: {made.bytes / 1e6:.1f} MB, export {made.export['bench_wall_s']:.0f} s, peak RSS "
                  f"{made.export['peak_rss_bytes'] / 1e6:.0f} MB", flush=True)
        rows.append(export_builder(hf, tmp))
        builder = rows[-1]
        time_decode(rows, args.rounds, args.threads, cfg.vocab_size, cfg.sliding_window or 0)
        tok = load_tokenizer(src)
        held = tok.encode(HELD_OUT)[:256]
        model = load_model(src, dtype="float32").eval()
        with torch.no_grad():
            want = model(torch.tensor([held])).logits[0].double().numpy()
        prompts = [tok.encode(p) for p in PROMPTS]
        ref, margins = map(list, zip(*(torch_greedy(model, p, STEPS) for p in prompts)))
        del model
        held_file = tmp / "held-out.txt"
        held_file.write_text(HELD_OUT, encoding="utf-8")
        for r in rows:
            score(r, cfg, held, want, prompts)
            verify(r, hf, held_file)
        spans = [answer_len(ids, tok) for ids in ref]
        # A decisive answer: fp32 prefers each of its tokens by at least DECISIVE nats; the others are near-ties
        # that fp32's own rounding could tip, and no quantizer is judged on them.
        decisive = [min(m[:n]) >= DECISIVE for m, n in zip(margins, spans)]
        for i, p in enumerate(PROMPTS):
            print(f"{key}: {p!r} -> fp32 {tok.decode(ref[i])!r} (answer: {spans[i]} tokens, margins "
                  f"{[round(x, 2) for x in margins[i][:spans[i]]]} nats: {'decisive' if decisive[i] else 'near-tie'})",
                  flush=True)
            for r in rows:
                if r.greedy[i] != ref[i]:
                    print(f"    {r.name}: {tok.decode(r.greedy[i])!r}", flush=True)
        for r in rows:
            ms = statistics.median(r.decode_ms)
            # x builder: the median of the rounds' own ratios (each round ran both within seconds: drift cancels)
            x_ms = statistics.median(a / b for a, b in zip(r.decode_ms, builder.decode_ms))
            kept = sum(g[:n] == w[:n] for g, w, n in zip(r.greedy, ref, spans))
            firm = sum(g[:n] == w[:n] for g, w, n, d in zip(r.greedy, ref, spans, decisive) if d)
            equal = sum(g == w for g, w in zip(r.greedy, ref))
            same = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), STEPS) for g, w in zip(r.greedy, ref)]
            ver = "/".join("FAITHFUL" if r.verify[k].get("faithful") else "NOT" for k in ("default", "text"))
            t = (r.export.get("int4_target") or {})
            kept8 = f"{len(t['kept_8bit'])}/{len(t['sensitivity'])}" if t else ""
            peak = r.export.get("peak_rss_bytes")
            mem = f"{peak / 1e9:.2f} GB ({'ok' if peak <= bound else 'OVER'})" if peak else ""
            checks = {"decisive answers": firm == sum(decisive), "KL": r.kl <= GOAL["kl"] * builder.kl,
                      "size": r.bytes <= GOAL["size"] * builder.bytes, "decode": x_ms <= GOAL["decode"],
                      "verify": ver == "FAITHFUL/FAITHFUL"}
            goal = "" if r is builder else ("met" if all(checks.values()) else
                                            "missed: " + ", ".join(k for k, v in checks.items() if not v))
            out.append(f"| {key} | {r.name} | {kept8} | {r.bytes / 1e6:.1f} | {r.bytes / builder.bytes:.2f}x | "
                       f"{ms:.2f} | {x_ms:.2f}x | {r.kl:.3f} | {r.kl / builder.kl:.2f} | {r.top1:.1%} | "
                       f"{r.ppl[0]:.2f} -> {r.ppl[1]:.2f} | {firm}/{sum(decisive)} | {kept}/{len(PROMPTS)} | "
                       f"{equal}/{len(PROMPTS)} "
                       f"(mean {statistics.mean(same):.1f}) | {ver} | {mem} | {goal} |")
            print(out[-1], f"gap moves: median {np.median(r.gap_moves):.2f} nats, {np.mean(r.gap_moves > DECISIVE):.0%} "
                  f"> {DECISIVE}", f"decode rounds {[round(x, 2) for x in r.decode_ms]}",
                  f"verify {[r.verify[k].get('failures') for k in ('default', 'text')]}", flush=True)
        print(f"{key}: fp32 weights {weights / 1e9:.2f} GB, export memory bound {bound / 1e9:.2f} GB; "
              f"held-out text {len(held)} tokens", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def kernels() -> None:
    """One MatMulNBits per (bits, block), one token, one thread: what keeping a matrix 8-bit costs at decode.

    Decode reads every weight once per token from memory, so each kind is timed twice: one matrix run again and
    again (its bytes stay in cache: the kernel's arithmetic) and copies of it whose bytes together exceed the
    caches (each read from memory, as in a decode step)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    # int4 as the default export writes it (uint4 zero points); 8-bit symmetric, as matrices kept 8-bit are
    kinds = {"int4 b32": (4, 32), "int4 b64": (4, 64), "int4 b128": (4, 128), "int8 b32": (8, 32), "int8 b128": (8, 128)}
    cold_bytes = 256 * 2**20  # past any CPU's last-level cache
    print("| K x N | " + " | ".join(f"{k} us (cached / from memory)" for k in kinds) +
          " | int8 b128 / int4, cached | from memory |")
    print("|---" * (len(kinds) + 3) + "|")
    for k, n in ((576, 960), (576, 3072), (1536, 576), (896, 4864), (4864, 896), (640, 2048)):
        us: dict[str, tuple[float, float]] = {}
        for kind, (bits, block) in kinds.items():
            nb = -(-k // block)
            one = n * nb * (block * bits // 8 + 4)
            times = []
            for copies in (1, max(2, -(-cold_bytes // one))):
                inits, nodes = [], []
                for c in range(copies):
                    ins = ["x", f"B{c}", f"S{c}"]
                    inits += [numpy_helper.from_array(rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8),
                                                      ins[1]),
                              numpy_helper.from_array(rng.random((n, nb), dtype=np.float32), ins[2])]
                    if bits == 4:
                        ins.append(f"Z{c}")
                        inits.append(numpy_helper.from_array(rng.integers(0, 256, n * -(-nb // 2), dtype=np.uint8),
                                                             ins[3]))
                    nodes.append(helper.make_node("MatMulNBits", ins, [f"y{c}"], domain="com.microsoft", K=k, N=n,
                                                  bits=bits, block_size=block, accuracy_level=4))
                g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                                      [helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [1, 1, n])
                                       for c in range(copies)], inits)
                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                sess = ort.InferenceSession(helper.make_model(g, opset_imports=[
                    helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]).SerializeToString(), so,
                    providers=["CPUExecutionProvider"])
                x = {"x": rng.random((1, 1, k), dtype=np.float32)}
                reps = max(3, 200 // copies)
                for _ in range(reps):
                    sess.run(None, x)
                best = math.inf
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(reps):
                        sess.run(None, x)
                    best = min(best, (time.perf_counter() - t) / reps / copies * 1e6)
                times.append(best)
                del sess
            us[kind] = (times[0], times[1])
        four = us["int4 b32"]
        print(f"| {k} x {n} | " + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in us.values()) +
              f" | {us['int8 b128'][0] / four[0]:.2f}x | {us['int8 b128'][1] / four[1]:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(MODELS), action="append", help="this model only (repeatable)")
    ap.add_argument("--rounds", type=int, default=11, help="alternating decode rounds [11]: five left SmolLM2 between 1.06x and 1.13x")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime-genai's intra_op_num_threads, every graph [1]")
    ap.add_argument("--hqq", action="store_true", help="add an --int4-algorithm hqq row")
    ap.add_argument("--variants", action="store_true", help="add the asymmetric and block 16/64 rows")
    ap.add_argument("--try", dest="try_", action="append", metavar="OPTIONS",
                    help="add a row exported with these options, e.g. '--int4-algorithm awq' (repeatable)")
    ap.add_argument("--no-baselines", action="store_true", help="leave out the all-int4 imatrix and RTN rows")
    ap.add_argument("--keep", type=Path, help="keep the graphs in this directory")
    ap.add_argument("--kernels", action="store_true", help="only time MatMulNBits per bits and block size")
    ap.add_argument("--decode-one", type=Path, help=argparse.SUPPRESS)  # time_decode's child: one graph's ms/token
    ap.add_argument("--vocab", type=int, default=30000, help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode_one:
        print(f"{decode_once(args.decode_one, args.vocab, args.window):.4f}")
        return
    import onnxruntime
    import onnxruntime_genai

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs (load "
          f"{os.getloadavg()[0]:.1f} at start), {platform.platform()}; onnxruntime {onnxruntime.__version__}, "
          f"onnxruntime-genai {onnxruntime_genai.__version__}; decode on {args.threads} thread(s), {args.rounds} "
          f"alternating rounds", flush=True)
    if args.kernels:
        kernels()
        return
    out: list[str] = []
    for key in args.only or list(MODELS):
        bench_model(key, args, out)
    print("| model | graph | 8-bit | MB | size x builder | decode ms/token | x builder | KL held-out | / builder KL "
          "| top-1 | perplexity fp32 -> int4 | decisive answers kept | all answers kept "
          "| 16 tokens equal (mean equal prefix) "
          "| verify int4 (default/text) | export peak RSS | goal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(out))


if __name__ == "__main__":
    main()
