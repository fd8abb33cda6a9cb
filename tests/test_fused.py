"""The fused graph (exporters/fused.py) on onnxruntime's CPU against the PyTorch model.

The models have q/k weights scaled up (helpers.sharp) so attention is far from uniform: a leaky padding mask,
a wrong RoPE layout or a mis-packed projection moves the logits well past the fp32 tolerance, and
test_perturbed_weight_fails / the all-ones mask controls prove the comparisons bite.
The config: GQA with 4 query heads over 2 KV heads of head_dim 16, two layers (the `tiny` preset).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from llama_tools.exporters.fused import FUSED_ROPE_OPS, StaticKVSession, check_fusable, export_fused
from llama_tools.exporters.graph_io import io_names
from llama_tools.exporters.onnx_export import read_metadata
from llama_tools.exporters.verification.compare import TOLERANCES, compare
from llama_tools.exporters.verification.parity import keys_by_position, resolve_target, verify_parity
from llama_tools.exporters.prompts import left_pad, positions
from llama_tools.exporters.rope_ops import DOMAIN, OP_TYPE, rope_function
from llama_tools.exporters.runtime import OnnxLM, create_session
from helpers import sharp
from llama_tools.modeling.presets import get_preset
from llama_tools.modeling.model import rope

CFG = get_preset("tiny").replace(max_position_embeddings=64)
TOL = TOLERANCES[("float32", "cpu")]  # the plain graph's fp32 CPU tolerance: 1e-4 on logits
PROMPTS = [[5, 17, 300, 41, 9, 77, 123, 250, 3, 64, 99], [400, 12, 8, 191, 33, 7]]  # 11 and 6: padding needed
MAX_LENGTH = 24  # the static buffer's slots


@pytest.fixture(scope="module")
def model():
    return sharp(CFG)


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """One export per variant, shared by the tests: (rope_op, layout, static) -> path."""
    out = tmp_path_factory.mktemp("fused")
    made = {}

    def get(rope_op="llama_tools", layout="half", static=None):
        key = (rope_op, layout, static)
        if key not in made:
            m = model if layout == "half" else sharp(CFG.replace(rope_layout=layout))
            made[key] = export_fused(m, out / f"{rope_op}-{layout}-{static}.onnx", rope_op=rope_op,
                                     static_kv=static or False)
        return made[key]
    return get


def lm(path, io="device") -> OnnxLM:
    return OnnxLM(create_session(path, "cpu"), CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, io=io)


def reference(model, ids, mask, pos, past=None):
    with torch.no_grad():
        return model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos),
                     past_key_values=past)


def check_step(name, got_logits, got_presents, ref, valid, turn_back=lambda layer, keys: keys):
    """Shapes first, then logits and every present K/V at the valid positions, within the fp32 tolerance.

    turn_back: (layer, K) -> K rotated by position (parity.keys_by_position), for a graph that rotates by slot."""
    assert got_logits.shape == tuple(ref.logits.shape) and got_logits.dtype == np.float32
    checks = [compare(f"{name} logits", got_logits, ref.logits.numpy(), valid[:, -got_logits.shape[1]:], TOL,
                      logits=True)]
    for i, ((gk, gv), (rk, rv)) in enumerate(zip(got_presents, ref.past_key_values)):
        for what, g, r in (("key", turn_back(i, gk), rk), ("value", gv, rv)):
            g = g[:, :, :r.shape[2]]  # a static buffer's slots past the filled ones are not compared
            assert g.shape == tuple(r.shape), f"present.{i}.{what}: {g.shape} vs {tuple(r.shape)}"
            # [batch, kv_heads, seq, hd] -> [batch, seq, kv_heads, hd]: positions on axis 1 for the mask
            checks.append(compare(f"{name} present.{i}.{what}", g.transpose(0, 2, 1, 3),
                                  r.numpy().transpose(0, 2, 1, 3), valid, TOL))
    return checks


# --- The graph itself -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope_op", FUSED_ROPE_OPS)
def test_node_census(exports, rope_op):
    res = exports(rope_op)
    g = onnx.load(str(res.path)).graph
    n, n2 = CFG.num_hidden_layers, CFG.hidden_size
    by_type = {}
    for node in g.node:
        by_type.setdefault((node.domain, node.op_type), []).append(node)
    gqa = by_type[("com.microsoft", "GroupQueryAttention")]
    assert [x.name for x in gqa] == [f"/model/layers.{j}/self_attn/GroupQueryAttention" for j in range(n)]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}
    def attr(node, name):
        return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)

    if rope_op == "attention":  # GQA rotates: no RoPE node; the packed QKV straight in, the tables as its caches
        assert attrs == {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "rotary_interleaved": 0}
        assert not {OP_TYPE} & {op for _, op in by_type}
        assert [list(x.input[:3]) + list(x.input[7:10]) for x in gqa] == [
            [f"/model/layers.{j}/self_attn/qkv_proj/MatMul/output_0", "", "", "cos_cache", "sin_cache",
             "/model/attn_mask/Where_positions/output_0"]
            for j in range(n)]  # slot positions, not the caller's (test_padded_prefill_and_decode_match_torch)
    else:
        assert attrs == {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 0}  # RoPE is not GQA's
    if rope_op == "llama_tools":  # one node per layer: the q and k heads of the packed QKV, v passed through
        ropes = by_type[(DOMAIN, OP_TYPE)]
        assert [x.name for x in ropes] == [f"/model/layers.{j}/self_attn/rope_qk" for j in range(n)]
        assert [(attr(x, "num_heads"), attr(x, "rotary_heads")) for x in ropes] == [(4 + 2 * 2, 4 + 2)] * n
        assert [x.input[0] for x in ropes] == [f"/model/layers.{j}/self_attn/qkv_proj/MatMul/output_0" for j in range(n)]
        assert all(list(x.input[1:3]) == ["", ""] for x in gqa)  # GQA takes the rotated QKV packed
        assert ("", "Split") not in by_type or all("/mlp/" in x.name for x in by_type[("", "Split")])
    elif rope_op == "contrib":  # onnxruntime's op rotates every head it is given: q and k split apart
        ropes = by_type[("com.microsoft", OP_TYPE)]
        assert [x.name for x in ropes] == [f"/model/layers.{j}/self_attn/rope_{w}" for j in range(n) for w in "qk"]
        assert [attr(x, "num_heads") for x in ropes] == [4, 2] * n
    # Packed projections: one MatMul for q/k/v and one for gate/up per layer, plus o, down and lm_head.
    weights = {i.name: tuple(i.dims) for i in g.initializer}
    matmuls = by_type[("", "MatMul")]
    assert len(matmuls) == 4 * n + 1
    qkv = [x for x in matmuls if x.name.endswith("/self_attn/qkv_proj/MatMul")]
    gate_up = [x for x in matmuls if x.name.endswith("/mlp/gate_up_proj/MatMul")]
    assert len(qkv) == len(gate_up) == n
    assert weights[qkv[0].input[1]] == (n2, CFG.q_size + 2 * CFG.kv_size) == (64, 64 + 2 * 32)
    assert weights[gate_up[0].input[1]] == (n2, 2 * CFG.intermediate_size)
    # Norms: one plain RMSNorm in front, then every residual add fused with the next norm (and the final one).
    assert len(by_type[("", "SimplifiedLayerNormalization")]) == 1
    skips = [x.name for x in by_type[("com.microsoft", "SkipSimplifiedLayerNormalization")]]
    nexts = [f"/model/layers.{j + 1}/input_layernorm" for j in range(n - 1)] + ["/model/norm"]
    assert skips == [f"{p}/SkipSimplifiedLayerNormalization" for j in range(n)
                     for p in (f"/model/layers.{j}/post_attention_layernorm", nexts[j])]
    # Attention is all GQA's: no Transpose around it, no Softmax, no Concat of the cache.
    assert not {"Transpose", "Softmax"} & {op for _, op in by_type}
    assert ("", "Concat") not in by_type or all(x.name.startswith("/model/attn_mask/") for x in by_type[("", "Concat")])
    assert res.op_counts["com.microsoft.GroupQueryAttention"] == n


def test_io_names_and_metadata(exports):
    res = exports()
    sess = ort.InferenceSession(str(res.path), providers=["CPUExecutionProvider"])
    inputs, outputs = io_names(CFG.num_hidden_layers)
    assert [i.name for i in sess.get_inputs()] == inputs
    assert [o.name for o in sess.get_outputs()] == outputs
    assert sess.get_inputs()[3].shape == ["batch", 2, "past_sequence_length", 16]
    assert sess.get_outputs()[1].shape == ["batch", 2, "total_sequence_length", 16]
    meta = read_metadata(res.path)
    assert (meta.config, meta.rope_op, meta.dtype) == (CFG, "llama_tools", "float32")
    props = {p.key: p.value for p in onnx.load(str(res.path), load_external_data=False).metadata_props}
    assert props["llama_tools.graph"] == "fused" and props["llama_tools.static_kv"] == ""


def run_rope_node(x: torch.Tensor, pos: torch.Tensor, angles: torch.Tensor, **attributes) -> np.ndarray:
    """One llama_tools.RotaryEmbedding node on 3-D x [b, s, width] through its function body on onnxruntime."""
    h = onnx.helper
    width = x.shape[-1]
    node = h.make_node(OP_TYPE, ["x", "pos", "cos", "sin"], ["y"], domain=DOMAIN, **attributes)
    graph = h.make_graph([node], "rope", [
        h.make_tensor_value_info("x", 1, ["b", "s", width]), h.make_tensor_value_info("pos", 7, ["b", "s"]),
        h.make_tensor_value_info("cos", 1, ["m", angles.shape[1]]),
        h.make_tensor_value_info("sin", 1, ["m", angles.shape[1]])],
        [h.make_tensor_value_info("y", 1, ["b", "s", width])])
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid(DOMAIN, 1)],
                     functions=[rope_function(20)], ir_version=10)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.numpy(), "pos": pos.numpy(), "cos": angles.cos().numpy(),
                           "sin": angles.sin().numpy()})[0]


def test_rope_op_3d_input_is_model_rope():
    """Our op with num_heads on [b, s, h d] equals llama_tools.modeling.model.rope on the [b, h, s, d] view."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3 * 16, generator=gen)  # [b, s, heads * head_dim]
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 30, 31]])
    angles = torch.rand(32, 8, generator=gen) * 40
    for interleaved in (0, 1):
        y = run_rope_node(x, pos, angles, interleaved=interleaved, num_heads=3)
        view = x.view(2, 5, 3, 16).transpose(1, 2)  # [b, s, h d] -> [b, h, s, d]
        ref = rope(view, pos, angles.cos(), angles.sin(), bool(interleaved)).transpose(1, 2).reshape(2, 5, 48)
        assert y.shape == (2, 5, 48)
        np.testing.assert_allclose(y, ref.numpy(), rtol=1e-6, atol=1e-6)


def test_rope_op_passes_the_heads_after_rotary_heads_through():
    """num_heads 3, rotary_heads 2 (a packed QKV of one q, one k, one v head): q, k as model.rope; v exactly as given."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3 * 16, generator=gen)  # [b, s, (q + k + v heads) * head_dim]
    x[0, 0, 40] = 1e30  # a v channel the rotation would spoil if it touched v (1e30 * cos + partner * sin)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 30, 31]])
    angles = torch.rand(32, 8, generator=gen) * 40
    for interleaved in (0, 1):
        y = run_rope_node(x, pos, angles, interleaved=interleaved, num_heads=3, rotary_heads=2)
        qk = x[..., :32].reshape(2, 5, 2, 16).transpose(1, 2)  # [b, s, 2 h d] -> [b, 2, s, d]
        ref = rope(qk, pos, angles.cos(), angles.sin(), bool(interleaved)).transpose(1, 2).reshape(2, 5, 32)
        assert y.shape == (2, 5, 48)
        np.testing.assert_array_equal(y[..., :32], ref.numpy())  # bit for bit: the same products and add
        np.testing.assert_array_equal(y[..., 32:], x[..., 32:].numpy())  # v untouched
        assert not np.array_equal(y[..., :32], x[..., :32].numpy())  # and q, k were rotated


# --- Numbers against PyTorch ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope_op", FUSED_ROPE_OPS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_padded_prefill_and_decode_match_torch(model, exports, rope_op, layout):
    """A left-padded batch of two, prefill then 4 greedy steps through each side's cache: logits and every K/V."""
    m = model if layout == "half" else sharp(CFG.replace(rope_layout=layout))
    path = exports(rope_op, layout).path
    run = lm(path)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    turn_back = keys_by_position(read_metadata(path), mask)  # GQA's own rotary turns keys by slot, not position
    got, ref = run(ids, mask, pos, run.empty_cache(2)), reference(m, ids, mask, pos)
    checks = check_step("prefill", got.logits, got.presents, ref, mask.astype(bool), turn_back)
    if rope_op == "attention":  # the padded row's keys as the cache holds them are not the model's: turned by slot
        raw = check_step("prefill", got.logits, got.presents, ref, mask.astype(bool))
        assert [c.name for c in raw if not c.passed] == [f"prefill present.{i}.key" for i in range(2)]
        rows = check_step("row 0", got.logits[:1], [(k[:1], v[:1]) for k, v in got.presents],
                          reference(m, ids[:1], mask[:1], pos[:1]), mask[:1].astype(bool))
        assert all(c.passed for c in rows), rows  # the longest row has no padding: slot is position
    for step in range(4):
        tok = ref.logits[:, -1].argmax(-1).numpy()[:, None]  # [batch, 1]: the reference's greedy choice
        assert (got.logits[:, -1].argmax(-1) == tok[:, 0]).all(), f"step {step}: greedy choice differs"
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)  # [batch, past + 1]
        pos = positions(mask, 1)
        got, ref = run(tok, mask, pos, got.cache), reference(m, tok, mask, pos, ref.past_key_values)
        checks += check_step(f"decode {step}", got.logits, got.presents, ref, mask.astype(bool), turn_back)
    bad = [c for c in checks if not c.passed]
    assert not bad, bad[0]


@pytest.mark.parametrize("changes", [
    {"qkv_bias": True},  # Qwen2: the packed projection carries the three biases
    {"o_bias": True, "mlp_bias": True},
    {"tie_word_embeddings": True, "norm_head": True},  # lm_head = D, rows L2-normalized (Baichuan2)
    {"tie_word_embeddings": True},  # lm_head = D itself: one initializer, transposed in the graph
    {"head_dim": 32},  # q_size 128 != hidden 64
    {"num_key_value_heads": 4},  # plain multi-head attention
])
def test_architecture_variants_match_torch(changes, tmp_path):
    """The packing and the extras (biases, tied and normalized head, wide heads, MHA) against PyTorch."""
    cfg = CFG.replace(**changes)
    m = sharp(cfg, seed=1)
    with torch.no_grad():  # biases start at N(0, 0.02) too; make them big enough to matter
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.mul_(20)
    path = export_fused(m, tmp_path / "v.onnx").path
    run = OnnxLM(create_session(path, "cpu"), cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    got = run(ids, mask, pos, run.empty_cache(2))
    checks = check_step("prefill", got.logits, got.presents, reference(m, ids, mask, pos), mask.astype(bool),
                        keys_by_position(read_metadata(path), mask))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed][0]


def test_a_tied_embedding_is_stored_once(tmp_path):
    """Tied: the Gather and the lm_head MatMul read one initializer; the file is the untied one minus n1 x n2."""
    sizes = {}
    for tied in (True, False):
        path = export_fused(sharp(CFG.replace(tie_word_embeddings=tied)), tmp_path / f"{tied}.onnx").path
        graph = onnx.load(str(path)).graph
        big = [i.name for i in graph.initializer if list(i.dims) in ([CFG.vocab_size, CFG.hidden_size],
                                                                      [CFG.hidden_size, CFG.vocab_size])]
        assert big == (["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.MatMul.weight"])
        sizes[tied] = path.stat().st_size
    assert sizes[False] - sizes[True] >= 4 * CFG.vocab_size * CFG.hidden_size - 1024  # one fp32 matrix, +- a node


def test_as_stored_holds_each_weight_as_the_checkpoint_does(tmp_path):
    """as_stored (the int4 quantizer's source graph): every MatMul's weight, the untied lm_head's included, is an
    [out, in] initializer behind a Transpose (the default graph's are [in, out], read directly), and the two graphs
    compute the same logits."""
    from llama_tools.exporters.quantize import _weights_of

    cfg = CFG.replace(tie_word_embeddings=False)
    m = sharp(cfg, seed=2)
    plain = export_fused(m, tmp_path / "a.onnx").path
    stored = export_fused(m, tmp_path / "b.onnx", as_stored=True).path
    wa, wb = _weights_of(onnx.load(str(plain))), _weights_of(onnx.load(str(stored)))
    assert set(wa) == set(wb) and "/lm_head/MatMul" in wb and len(wb) == 4 * cfg.num_hidden_layers + 1
    assert not any(through for _, through in wa.values()) and all(through for _, through in wb.values())
    inits = {t.name: list(t.dims) for t in onnx.load(str(stored), load_external_data=False).graph.initializer}
    assert inits[wb["/lm_head/MatMul"][0]] == [cfg.vocab_size, cfg.hidden_size]  # [n1, n2], as the checkpoint's
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    out = [lm(p)(ids, mask, pos, lm(p).empty_cache(2)).logits for p in (plain, stored)]
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_padded_rows_equal_rows_alone(exports):
    """Each row of the left-padded batch, prefill and 3 decode steps, equals that row run alone (no padding)."""
    run = lm(exports().path)
    ids, mask = left_pad(PROMPTS)
    batch = run(ids, mask, positions(mask, ids.shape[1]), run.empty_cache(2))
    alone = []
    for p in PROMPTS:
        a_ids, a_mask = left_pad([p])
        alone.append(run(a_ids, a_mask, positions(a_mask, len(p)), run.empty_cache(1)))
    for step in range(4):
        for row, (p, a) in enumerate(zip(PROMPTS, alone)):
            n = len(p) if step == 0 else 1
            np.testing.assert_allclose(batch.logits[row, -n:], a.logits[0, -n:], rtol=0, atol=TOL.atol)
        if step == 3:
            break
        tok = batch.logits[:, -1].argmax(-1)[:, None]  # [batch, 1]
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        batch = run(tok, mask, positions(mask, 1), batch.presents)
        for row, a in enumerate(alone):
            a_mask = np.ones((1, a.presents[0][0].shape[2] + 1), np.int64)
            alone[row] = run(tok[row:row + 1], a_mask, positions(a_mask, 1), a.presents)
    # Negative control: the same batch with its padding unmasked no longer matches the short row alone.
    ids, mask = left_pad(PROMPTS)
    leaky = run(ids, np.ones_like(mask), positions(mask, ids.shape[1]), run.empty_cache(2))
    short = left_pad([PROMPTS[1]])
    alone_short = run(short[0], short[1], positions(short[1], len(PROMPTS[1])), run.empty_cache(1))
    assert np.abs(leaky.logits[1, -1] - alone_short.logits[0, -1]).max() > 100 * TOL.atol


def test_prompt_continuing_a_cache_batch_one(model, exports):
    """GQA takes a multi-token step over a non-empty cache for batch 1 (a chunked prompt); the numbers hold."""
    run = lm(exports().path)
    ids = np.array([PROMPTS[0]], np.int64)  # [1, 11]
    first = run(ids[:, :7], np.ones((1, 7), np.int64), np.arange(7)[None], run.empty_cache(1))
    got = run(ids[:, 7:], np.ones((1, 11), np.int64), np.arange(7, 11)[None], first.presents)
    ref = reference(model, ids, np.ones((1, 11), np.int64), np.arange(11)[None])
    assert got.logits.shape == (1, 4, CFG.vocab_size)
    check = compare("chunk logits", got.logits, ref.logits[:, 7:].numpy(), np.ones((1, 4), bool), TOL, logits=True)
    assert check.passed, check


def test_verify_parity_runs_the_fused_graph(tmp_path):
    """`verify parity` reads the fused file's metadata, reloads the seeded preset, and passes it unchanged."""
    res = export_fused("tiny", tmp_path / "model.onnx")
    rep = verify_parity(resolve_target(str(res.path), None), provider="cpu", steps=4)
    assert rep.passed, [c for c in rep.checks if not c.passed]
    assert rep.graph.startswith("llama-tools") and rep.decode.agreed == 4


def test_perturbed_weight_fails(model, tmp_path):
    """Negative control: one o_proj weight nudged by 0.05 in the exported model fails the fp32 comparison."""
    bad = sharp(CFG)
    with torch.no_grad():
        bad.model.layers[1].self_attn.o_proj.weight[3, 5] += 0.05
    run = lm(export_fused(bad, tmp_path / "bad.onnx").path)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    got = run(ids, mask, pos, run.empty_cache(2))
    check = compare("logits", got.logits, reference(model, ids, mask, pos).logits.numpy(), mask.astype(bool), TOL,
                    logits=True)
    assert not check.passed and check.max_abs > TOL.atol


def test_float16_graph_within_fp16_tolerance(model, tmp_path):
    """fp16 weights and activations on the CPU: GQA and the Skip norms run, within the fp16 tolerance."""
    res = export_fused(model, tmp_path / "fp16.onnx", dtype="float16")
    run = lm(res.path)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    got = run(ids, mask, pos, run.empty_cache(2))
    assert got.logits.dtype == np.float16 and got.presents[0][0].dtype == np.float16
    check = compare("logits", got.logits, reference(model, ids, mask, pos).logits.numpy(), mask.astype(bool),
                    TOLERANCES[("float16", "cpu")], logits=True)
    assert check.passed, check


def test_external_data(model, tmp_path):
    res = export_fused(model, tmp_path / "ext.onnx", external_data_threshold_bytes=0)
    assert res.external_data == tmp_path / "ext.onnx.data" and res.external_data.stat().st_size > 600_000
    ids, mask = left_pad(PROMPTS[:1])
    run = lm(res.path)
    assert np.isfinite(run(ids, mask, positions(mask, ids.shape[1]), run.empty_cache(1)).logits).all()


# --- The static KV buffer -----------------------------------------------------------------------------------------

def test_static_buffer_is_written_in_place(model, exports):
    """IOBinding binds one buffer per layer as past and present: GQA writes into it; prefill + 4 decode steps."""
    res = exports(static=MAX_LENGTH)
    assert res.static_kv == MAX_LENGTH and read_metadata(res.path).config == CFG
    sess = ort.InferenceSession(str(res.path), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[3].shape == ["batch", 2, MAX_LENGTH, 16]
    assert sess.get_outputs()[1].shape == ["batch", 2, MAX_LENGTH, 16]
    static = StaticKVSession(sess, CFG, batch=2, max_length=MAX_LENGTH)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    logits, ref = static.step(ids, mask, pos), reference(model, ids, mask, pos)
    checks = []
    for step in range(5):
        filled = mask.shape[1]
        outputs = static.binding.get_outputs()
        assert all(outputs[1 + i].data_ptr() == buf.data_ptr() for i, buf in enumerate(static.buffers))
        caches = [static.cache(i) for i in range(CFG.num_hidden_layers)]
        assert all(np.abs(k[:, :, filled:]).max() == 0 for k, _ in caches)  # slots past the filled ones untouched
        checks += check_step(f"step {step}", logits, caches, ref, mask.astype(bool))
        tok = ref.logits[:, -1].argmax(-1).numpy()[:, None]
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        pos = positions(mask, 1)
        logits, ref = static.step(tok, mask, pos), reference(model, tok, mask, pos, ref.past_key_values)
    bad = [c for c in checks if not c.passed]
    assert not bad, bad[0]
    with pytest.raises(ValueError, match=f"holds {MAX_LENGTH}"):
        static.step(tok, np.ones((2, MAX_LENGTH + 1), np.int64), pos)


def test_static_buffer_with_plain_feeds(model, exports):
    """The same graph fed numpy arrays: present is the whole buffer (a copy), the numbers are the same."""
    run = lm(exports(static=MAX_LENGTH).path, io="numpy")
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    empty = run.empty_cache(2)
    assert empty[0][0].shape == (2, 2, MAX_LENGTH, 16) and not empty[0][0].any()
    got = run(ids, mask, pos, empty)
    assert got.cache[0][0].shape == (2, 2, MAX_LENGTH, 16)  # the whole buffer comes back...
    assert got.presents[0][0].shape == (2, 2, mask.shape[1], 16)  # ...and is compared over its written slots
    tok = got.logits[:, -1].argmax(-1)[:, None]
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    nxt = run(tok, mask2, positions(mask2, 1), got.cache)
    ref = reference(model, ids, mask, pos)
    ref2 = reference(model, tok, mask2, positions(mask2, 1), ref.past_key_values)
    checks = check_step("prefill", got.logits, got.presents, ref, mask.astype(bool))
    checks += check_step("decode", nxt.logits, nxt.presents, ref2, mask2.astype(bool))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed][0]


def test_onnx_lm_binds_the_static_buffer_as_past_and_present(model, exports):
    """OnnxLM (what `verify parity` runs) on a static graph: prefill + decode write one buffer per layer in place."""
    run = lm(exports(static=MAX_LENGTH).path)
    assert run.static_length == MAX_LENGTH
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    cache = run.empty_cache(2)
    buffers = [t.data_ptr() for kv in cache.values for t in kv]
    got, ref = run(ids, mask, pos, cache), reference(model, ids, mask, pos)
    tok = ref.logits[:, -1].argmax(-1).numpy()[:, None]
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    nxt = run(tok, mask2, positions(mask2, 1), got.cache)
    ref2 = reference(model, tok, mask2, positions(mask2, 1), ref.past_key_values)
    assert [t.data_ptr() for kv in nxt.cache.values for t in kv] == buffers  # no new cache was allocated
    assert nxt.presents[0][0].shape == (2, 2, mask2.shape[1], 16)
    checks = check_step("prefill", got.logits, got.presents, ref, mask.astype(bool))
    checks += check_step("decode", nxt.logits, nxt.presents, ref2, mask2.astype(bool))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed][0]
    with pytest.raises(ValueError, match=f"do not fit its static KV buffer of {MAX_LENGTH}"):
        run(tok, np.ones((2, MAX_LENGTH + 1), np.int64), positions(mask2, 1), nxt.cache)


def test_verify_parity_runs_a_static_graph(tmp_path):
    """`verify parity` on an `--static-kv` export: the buffer's written slots are compared, and decode passes."""
    res = export_fused("tiny", tmp_path / "static.onnx", static_kv=MAX_LENGTH)
    target = resolve_target(str(res.path), None)
    rep = verify_parity(target, provider="cpu", steps=6)
    assert rep.passed, [c for c in rep.checks if not c.passed]
    assert rep.decode.agreed == 6
    assert {c.name for c in rep.checks} >= {"logits", "present.0.key", f"present.{CFG.num_hidden_layers - 1}.value"}
    with pytest.raises(ValueError, match=f"static KV buffer of {MAX_LENGTH} positions; use fewer steps"):
        verify_parity(target, provider="cpu", steps=MAX_LENGTH)  # 11 prompt tokens + 24 steps > 24 slots


# --- What the fused graph refuses ---------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"position_encoding": "alibi"}, "does not support alibi position encoding"),
    ({"hidden_size": 48, "head_dim": 12}, "does not support head_dim 12 .*multiple of 8"),
    ({"num_experts": 4, "num_experts_per_tok": 2}, "does not support mixture of experts"),
])
def test_unsupported_models_are_refused(changes, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        export_fused(CFG.replace(**changes), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
    check_fusable(CFG)  # the tiny config itself is fine


def test_a_sliding_window_is_grouped_query_attentions_local_window(tmp_path):
    """Mistral's window in the fused graph: GQA's local_window_size; prompts and decode run past the window, and
    the verdict fails the same graph with the window one key wider (the attribute is not a no-op)."""
    import onnx_ir as ir

    from llama_tools.exporters.verification.verdict import parity_inputs, verify

    import json

    from safetensors.torch import save_model

    from llama_tools.checkpoints.config_files import config_to_hf

    cfg = CFG.replace(family="mistral", sliding_window=4)
    ck = tmp_path / "ck"
    ck.mkdir()
    save_model(sharp(cfg), str(ck / "model.safetensors"))
    (ck / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    path = tmp_path / "w.onnx"
    export_fused(str(ck), path)
    target = resolve_target(str(path), str(ck))
    assert verify(target, parity_inputs(target, None, 2, None, 0), provider="cpu", steps=6).passed
    graph = ir.load(str(path))
    for node in graph.graph:
        if node.op_type == "GroupQueryAttention":
            assert node.attributes["local_window_size"].value == 4
            node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", 5)
    ir.save(graph, str(tmp_path / "wider.onnx"))
    wider = resolve_target(str(tmp_path / "wider.onnx"), str(ck))
    assert not verify(wider, parity_inputs(wider, None, 2, None, 0), provider="cpu", steps=6).passed


@pytest.mark.parametrize("kwargs, message", [
    ({"rope_op": "onnx"}, "rope_op 'onnx' is not available in the fused graph"),
    ({"static_kv": 65}, r"static_kv \(max_length\) must be an int in 1..64"),
    ({"dtype": "int8"}, "int8"),
])
def test_bad_options_are_refused(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        export_fused(CFG, tmp_path / "x.onnx", **kwargs)


def test_group_query_attention_itself_refuses_head_dim_12():
    """Why the head_dim rule: onnxruntime's GQA kernel rejects a head size that is not a multiple of 8."""
    h, f32 = onnx.helper, onnx.TensorProto.FLOAT

    def session(head_dim):
        node = h.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], ["o"],
                           domain="com.microsoft", num_heads=2, kv_num_heads=1)
        graph = h.make_graph([node], "gqa", [
            h.make_tensor_value_info("q", f32, [1, 3, 2 * head_dim]),
            h.make_tensor_value_info("k", f32, [1, 3, head_dim]),
            h.make_tensor_value_info("v", f32, [1, 3, head_dim]),
            h.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, [1]),
            h.make_tensor_value_info("total", onnx.TensorProto.INT32, [])], [h.make_tensor_value_info("o", f32, None)])
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("com.microsoft", 1)],
                             ir_version=10)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        return sess.run(None, {"q": rng.standard_normal((1, 3, 2 * head_dim), np.float32),
                               "k": rng.standard_normal((1, 3, head_dim), np.float32),
                               "v": rng.standard_normal((1, 3, head_dim), np.float32),
                               "seqlens_k": np.array([2], np.int32), "total": np.array(3, np.int32)})

    assert session(8)[0].shape == (1, 3, 16)
    with pytest.raises(Exception, match="multiple of 8"):
        session(12)


# --- On a GPU (skipped with the reason elsewhere; written for the first session that has one) -----------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("rope_op", FUSED_ROPE_OPS)
def test_gpu_fused_passes_verify_parity(tmp_path, rope_op, dtype):
    """The fused graph on the CUDA provider, each RoPE op (GQA's own rotary included), within its dtype's tolerance."""
    res = export_fused("tiny", tmp_path / f"{rope_op}-{dtype}.onnx", dtype=dtype, rope_op=rope_op)
    rep = verify_parity(resolve_target(str(res.path), None), provider="cuda", steps=8)
    assert rep.provider == "cuda" and rep.dtype == dtype and rep.budget.multiple > 0
    assert rep.passed, [c for c in rep.checks if not c.passed]


@pytest.mark.gpu
def test_gpu_static_buffer_is_written_in_place_on_the_device(model, tmp_path):
    """--static-kv on CUDA: one device buffer per layer stays bound as past and present through a decode."""
    path = export_fused(model, tmp_path / "static.onnx", static_kv=MAX_LENGTH).path
    run = OnnxLM(create_session(path, "cuda"), CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim)
    ids, mask = left_pad(PROMPTS)
    pos = positions(mask, ids.shape[1])
    cache = run.empty_cache(2)
    assert "cuda" in cache.values[0][0].device_name().lower()
    buffers = [t.data_ptr() for kv in cache.values for t in kv]
    turn_back = keys_by_position(read_metadata(path), mask)  # the default RoPE op here may be GQA's, by slot
    got, ref = run(ids, mask, pos, cache), reference(model, ids, mask, pos)
    checks = check_step("prefill", got.logits, got.presents, ref, mask.astype(bool), turn_back)
    for step in range(4):
        tok = ref.logits[:, -1].argmax(-1).numpy()[:, None]
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        pos = positions(mask, 1)
        got, ref = run(tok, mask, pos, got.cache), reference(model, tok, mask, pos, ref.past_key_values)
        checks += check_step(f"decode {step}", got.logits, got.presents, ref, mask.astype(bool), turn_back)
    assert [t.data_ptr() for kv in got.cache.values for t in kv] == buffers
    assert all(c.passed for c in checks), [c for c in checks if not c.passed][0]


def test_keys_turned_by_slot_come_back_by_position():
    """rope_ops.unrotate_slots: keys model.rope turned by pad + i, turned back by pad, are model.rope's at i."""
    from llama_tools.exporters.rope_ops import unrotate_slots

    gen = torch.Generator().manual_seed(2)
    k = torch.randn(3, 2, 7, 16, dtype=torch.float64, generator=gen)  # [b, kv_heads, slots, n6]
    pads = np.array([0, 3, 5])
    # A RoPE table is linear in the position (i θ_t): that is what lets R(pad + i) = R(pad) R(i).
    angles = torch.outer(torch.arange(16, dtype=torch.float64), torch.rand(8, dtype=torch.float64, generator=gen) * 3)
    pos = torch.arange(7).repeat(3, 1)  # [b, s]
    for interleaved in (False, True):
        by_slot = rope(k, pos + torch.from_numpy(pads)[:, None], angles.cos(), angles.sin(), interleaved)
        want = rope(k, pos, angles.cos(), angles.sin(), interleaved)
        got = unrotate_slots(by_slot.numpy(), pads, angles.cos().numpy(), angles.sin().numpy(), interleaved)
        assert got.shape == want.shape and got.dtype == np.float64
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-12)
        assert not np.allclose(by_slot[1:].numpy(), want[1:].numpy(), atol=1e-3)  # the padded rows were turned
        other = unrotate_slots(by_slot.numpy(), pads, angles.cos().numpy(), angles.sin().numpy(), not interleaved)
        assert not np.allclose(other[1:], want[1:].numpy(), atol=1e-3)  # the wrong pairing does not undo it
