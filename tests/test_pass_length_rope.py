"""dynamic NTK and longrope in ONNX graphs: cos/sin computed in the graph from the pass's length (rope_tables.py).

Truth is transformers 4.57 itself on tiny seeded checkpoints it saved: a Phi-3 with longrope (original context 32,
short and long factors off 1, partial rotary 0.75 of 64-wide heads, Phi-4-mini's) and a Llama with dynamic NTK
(max_position_embeddings 32, factor 4). transformers picks each forward call's tables from L = max(position_ids) + 1
(modeling_rope_utils.dynamic_rope_update); with use_cache its cache keeps each key as it was rotated when stored, so a
decode that crosses the switch mixes keys of both tables, and the graphs must do the same:

- plain and fused graphs (our RoPE node; onnxruntime's and opset 23's in the plain graph; GroupQueryAttention's own
  rotary on one unpadded row) give transformers' logits past the switch (prefill of 48) and below it (20), and through
  decode steps with the KV cache crossing it (prefill 20, one token a step to 44);
- `verify parity` (its source check against transformers included) passes on both graphs by default and on a
  left-padded batch that crosses the switch in prefill and decode; onnxruntime-genai keeps its cache through the
  switch and gives the greedy tokens of transformers' forward calls with a cache (dynamic: also its generate's;
  transformers' Phi-3 generate re-runs the sequence at the switch instead, with a one-row mask no graph follows);
- negative cases: the longrope graph with its long factors replaced by the short ones, and the dynamic graph with its
  factor set to 1, differ from transformers past the switch and fail verify parity; GroupQueryAttention's rotary on
  a left-padded batch whose tables change between passes differs (why the fused default is our node for these).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from config_cases import saved_model  # noqa: E402
from helpers import genai_greedy  # noqa: E402
from llama_tools.cli import cli  # noqa: E402
from llama_tools.exporters import rope_tables  # noqa: E402

SIZES = dict(vocab_size=256, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2, pad_token_id=0, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
SWITCH = 32  # longrope's original_max_position_embeddings, dynamic's max_position_embeddings
HALF = 24  # longrope: rotary width 0.75 x 64 = 48, so 24 factors each
SHORT = [1.0 + 0.05 * i for i in range(HALF)]
LONG = [1.0 + 0.5 * i for i in range(HALF)]
IDS = torch.tensor([[(7 * i + 3) % 250 + 3 for i in range(56)]])
ROW_B = [(5 * i + 9) % 250 + 3 for i in range(20)]
TOL = 2e-5  # of the largest logit: fp32 against fp32, the same arithmetic in another order


def perturb(model) -> None:
    """Off their initial values: q/k scaled so RoPE's angles decide the scores, the head so the logits vary."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.3)
        elif any(k in name for k in ("qkv_proj", "q_proj", "k_proj")):
            p.mul_(10.0)
        elif "embed_tokens" in name or "lm_head" in name:
            p.mul_(20.0)


def hf_checkpoint(kind: str, directory: Path):
    if kind == "longrope":
        config = transformers.Phi3Config(**SIZES, hidden_size=256, max_position_embeddings=256,
                                         original_max_position_embeddings=SWITCH, partial_rotary_factor=0.75,
                                         rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
        return saved_model(transformers.Phi3ForCausalLM, config, directory, perturb)
    config = transformers.LlamaConfig(**SIZES, hidden_size=128, max_position_embeddings=SWITCH,
                                      rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    return saved_model(transformers.LlamaForCausalLM, config, directory, perturb)


@pytest.fixture(scope="module", params=["longrope", "dynamic"])
def case(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf_checkpoint(request.param, d)
    return request.param, d


def export(d: Path, out: Path, *extra: str) -> Path:
    r = CliRunner().invoke(cli, ["export", "onnx", str(d), "-o", str(out), "-q", *extra])
    assert r.exit_code == 0, r.output[-1500:]
    return out


@pytest.fixture(scope="module")
def graphs(case, tmp_path_factory):
    kind, d = case
    out = tmp_path_factory.mktemp(kind + "-onnx")
    return {"plain": export(d, out / "plain" / "model.onnx"),
            "fused": export(d, out / "fused" / "model.onnx", "--optimize")}


def transformers_decode(d: Path, ids: torch.Tensor, prefill: int, total: int) -> list[np.ndarray]:
    """transformers' logits: a prefill, then one token a step with its KV cache (a fresh model: dynamic keeps state)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    with torch.no_grad():
        o = model(ids[:, :prefill], use_cache=True)
        out, past = [o.logits.numpy()], o.past_key_values
        for i in range(prefill, total):
            o = model(ids[:, i:i + 1], past_key_values=past, use_cache=True)
            out.append(o.logits.numpy())
            past = o.past_key_values
    return out


def graph_decode(path: Path, ids: torch.Tensor, prefill: int, total: int) -> list[np.ndarray]:
    """The graph's logits the same way: one row, positions 0.., the present K/V fed back as the past."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    out = []
    for start, end in [(0, prefill)] + [(i, i + 1) for i in range(prefill, total)]:
        feeds = {"input_ids": ids[:, start:end].numpy(), "attention_mask": np.ones((1, end), np.int64),
                 "position_ids": np.arange(start, end, dtype=np.int64)[None], **cache}
        logits, *presents = sess.run(None, feeds)
        cache = {p.name: v for p, v in zip(pasts, presents)}
        out.append(logits)
    return out


def max_diff(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float]:
    """max |graph - transformers| over the prefill's logits, and over the decode steps'."""
    pre = float(np.abs(got[0] - want[0]).max())
    dec = max((float(np.abs(g - w).max()) for g, w in zip(got[1:], want[1:])), default=0.0)
    return pre, dec


def assert_matches(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    scale = max(1.0, max(float(np.abs(w).max()) for w in want))
    assert min(float(w.std()) for w in want) > 0.1, "logits that vary: the comparison means something"
    pre, dec = max_diff(got, want)
    print(f"{what}: max |d| prefill {pre:.2e}, decode {dec:.2e} (largest logit {scale:.1f})")
    assert pre < TOL * scale and dec < TOL * scale, (what, pre, dec, scale)


# (prefill, total): past the switch at once, below it, and a decode through it
RUNS = [(48, 52), (20, 20), (20, 44)]


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_graph_gives_transformers_logits_through_the_switch(case, graphs, graph):
    kind, d = case
    for prefill, total in RUNS:
        assert_matches(graph_decode(graphs[graph], IDS, prefill, total), transformers_decode(d, IDS, prefill, total),
                       f"{kind} {graph} prefill {prefill} to {total}")


def test_the_tables_are_nodes_not_initializers(case, graphs):
    """No fixed table: cos_cache and sin_cache are made by /model/rotary_emb's nodes, longrope's from both factor
    sets, dynamic's from its base, factor and max_position_embeddings."""
    kind, _ = case
    for path in graphs.values():
        m = onnx.load(str(path))
        inits = {i.name for i in m.graph.initializer}
        assert not inits & set(rope_tables.TABLES)
        made = {o for n in m.graph.node if n.name.startswith(rope_tables.PATH + "/") for o in n.output}
        assert set(rope_tables.TABLES) <= made
        want = {"long_inv_freq", "short_inv_freq"} if kind == "longrope" else {"factor", "max_position_embeddings"}
        assert {rope_tables.PATH + "/" + w for w in want} <= inits


@pytest.mark.parametrize("rope_op", ["contrib", "onnx"])
def test_onnxruntime_and_opset23_rope_nodes_read_the_computed_tables(case, rope_op, tmp_path):
    """The plain graph with onnxruntime's RotaryEmbedding or opset 23's (tables in the activations' type)."""
    kind, d = case
    path = export(d, tmp_path / "model.onnx", "--rope-op", rope_op)
    for prefill, total in RUNS[::2]:
        assert_matches(graph_decode(path, IDS, prefill, total), transformers_decode(d, IDS, prefill, total),
                       f"{kind} plain {rope_op} prefill {prefill} to {total}")


def test_group_query_attention_rotary_on_one_row(case, tmp_path):
    """GroupQueryAttention's own rotary fed the computed cos_cache/sin_cache (--rope-op attention): exact on a row
    without left padding, the rows onnxruntime-genai feeds (its cache slot is its position)."""
    kind, d = case
    path = export(d, tmp_path / "model.onnx", "--optimize", "--rope-op", "attention")
    assert any(n.op_type == "GroupQueryAttention" and any(a.name == "do_rotary" and a.i == 1 for a in n.attribute)
               for n in onnx.load(str(path)).graph.node)
    for prefill, total in RUNS:
        assert_matches(graph_decode(path, IDS, prefill, total), transformers_decode(d, IDS, prefill, total),
                       f"{kind} fused attention prefill {prefill} to {total}")


def verify(path: Path, d: Path, *extra: str) -> dict:
    r = CliRunner().invoke(cli, ["verify", "parity", str(path), "--source", str(d), "-q", "--format", "json", *extra])
    data = json.loads(r.output[r.output.index("{"):]) if "{" in r.output else {}
    assert data, r.output[-2500:]
    return data


CROSSING = ["--ids", " ".join(map(str, IDS[0, :40].tolist())), "--ids", " ".join(map(str, ROW_B)), "--steps", "6"]


@pytest.mark.parametrize("graph", ["plain", "fused"])
@pytest.mark.parametrize("inputs", ["default", "crossing"])
def test_verify_parity_passes_with_the_source_check(case, graphs, graph, inputs):
    """Default inputs, and a left-padded batch of 40 and 20 tokens (past the switch in prefill, the short row's
    positions below it) decoding 6 steps."""
    kind, d = case
    data = verify(graphs[graph], d, *(CROSSING if inputs == "crossing" else []))
    assert data["passed"], json.dumps(data)[-2500:]
    assert data["source_check"]["checked"] and data["source_check"]["passed"]


def transformers_greedy_forward(d: Path, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from transformers' forward calls with its KV cache (each cached key as it was stored)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    ids, out, past = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(steps):
            o = model(ids, past_key_values=past, use_cache=True)
            past, ids = o.past_key_values, o.logits[:, -1:].argmax(-1)
            out.append(int(ids[0, 0]))
    return out


def transformers_generate(d: Path, prompt: list[int], steps: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    return model.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids))[
        0, len(prompt):].tolist()


def test_onnxruntime_genai_gives_transformers_tokens_through_the_switch(case, graphs):
    """onnxruntime-genai keeps the cache through the switch (type llama), as transformers' forward calls with a cache
    do: their greedy tokens. dynamic (a Llama): transformers' generate does the same. longrope on a Phi-3:
    transformers' Phi-3 generate drops the cache at original + 1 tokens and re-runs the sequence, with a mask built
    for one query row (cache_position holds only the last position): no causal graph gives those tokens, and the
    client files say genai keeps the cache."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    from llama_tools.exporters.genai import plan_client_files

    kind, d = case
    prompt, steps = IDS[0, :26].tolist(), 14
    generated = transformers_generate(d, prompt, steps)
    forward = transformers_greedy_forward(d, prompt, steps)
    for graph, path in graphs.items():
        config = json.loads((path.parent / "genai_config.json").read_text())
        assert config["model"]["context_length"] == (SWITCH * 4 if kind == "dynamic" else 256)
        assert config["model"]["type"] == "llama"
        got = genai_greedy(path.parent, prompt, steps)
        assert got == forward, graph
        assert (got == generated) == (kind == "dynamic"), graph  # longrope: transformers' generate re-runs
        notes = plan_client_files(path).files.warnings
        assert any("keeps the KV cache through longrope's switch at 33 tokens" in n for n in notes) == (
            kind == "longrope")


# --- Negative cases: the check sees wrong tables past the switch --------------------------------------------------

def spoiled(path: Path, out: Path, kind: str) -> Path:
    """The graph with longrope's long factors replaced by its short ones, or dynamic's factor set to 1."""
    m = onnx.load(str(path))
    for init in m.graph.initializer:
        if kind == "longrope" and init.name == rope_tables.PATH + "/long_inv_freq":
            short = next(i for i in m.graph.initializer if i.name == rope_tables.PATH + "/short_inv_freq")
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(short), init.name))
        if kind == "dynamic" and init.name in (rope_tables.PATH + "/factor", rope_tables.PATH + "/factor_minus_one"):
            value = 1.0 if init.name.endswith("/factor") else 0.0
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(value, np.float64), init.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    for f in path.parent.iterdir():
        if f.name != path.name and f.is_file():
            (out.parent / f.name).write_bytes(f.read_bytes())
    onnx.save(m, str(out))
    return out


def test_wrong_tables_past_the_switch_fail(case, graphs, tmp_path):
    kind, d = case
    bad = spoiled(graphs["plain"], tmp_path / "bad" / "model.onnx", kind)
    below = max_diff(graph_decode(bad, IDS, 20, 20), transformers_decode(d, IDS, 20, 20))
    past = max_diff(graph_decode(bad, IDS, 48, 48), transformers_decode(d, IDS, 48, 48))
    print(f"{kind} spoiled: max |d| below the switch {below[0]:.2e}, past it {past[0]:.2e}")
    assert below[0] < TOL * 10 and past[0] > 1e-2  # the same graph below the switch; far off past it
    data = verify(bad, d, *CROSSING)
    assert not data["passed"]


def test_gqa_rotary_on_a_left_padded_batch_whose_tables_change_differs(tmp_path):
    """Why the fused default is our node for these variants: GroupQueryAttention turns a key by its cache slot, so
    a left-padded row's keys carry the padding's turn at the tables of the pass that stored them, which no longer
    cancels once the tables change (dynamic past its context changes them every step)."""
    d = tmp_path / "src"
    hf_checkpoint("dynamic", d)
    path = export(d, tmp_path / "attention" / "model.onnx", "--optimize", "--rope-op", "attention")
    data = verify(path, d, *CROSSING)
    assert not data["passed"]
