"""Client files beside an export (genai_config.json, config.json, tokenizer.json) and weight-only int4.

Truth comes from outside our code: the graph's own input names, sentencepiece and HF `tokenizers` for the
tokenizer, the quantizer's packed nibbles dequantized by hand for int4, onnxruntime-genai running the files
(skipped with a reason where it is not installed) against `llama_tools.inference.generation.generate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from llama_tools.exporters.genai import genai_config, sentencepiece_to_tokenizer_json, write_client_files
from llama_tools.exporters.graph_io import io_names
from llama_tools.exporters.onnx_export import export_onnx
from llama_tools.exporters.quantize import QuantThresholds, measure_quant_parity, quantize_int4
from llama_tools.modeling.presets import get_preset
from llama_tools.inference.generation import generate
from llama_tools.modeling.model import build_model
from helpers import train_tiny_tokenizer
from llama_tools.checkpoints.tokenizer import Tokenizer

CFG = get_preset("tiny")  # head_dim 16: GroupQueryAttention's CPU kernel needs a multiple of 16 for its rotary
PROMPT = [1, 17, 42, 99]
NEW = 20
TEXTS = ["Who is the 45th President of the United States? Donald Trump.",
         "The quick brown fox jumps over the lazy dog.", "你好，世界。我们今天学习数学。",
         "una fff able unaffable"] * 30
PROBES = ["The quick brown fox 啊 jumps", " leading  double  spaces ", "una fff able unaffable🙂", "45th\ttab\nline", "x"]
LOGIT_SCALE = 10.0  # final norm x10: fp32 perplexity of its own greedy text ~29, a decisive model


def decisive(seed: int = 0):
    """tiny with its final RMSNorm gain x LOGIT_SCALE: peaked next-token distributions, as a trained model's."""
    model = build_model(CFG, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(TEXTS, d / "tokenizer", vocab_size=320)
    return d


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plain") / "model.onnx"
    export_onnx("tiny", path)
    return path


@pytest.fixture(scope="module")
def int4(plain, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("int4") / "model.onnx"
    quantize_int4(plain, path)
    return path


# --- genai_config.json / config.json ------------------------------------------------------------------------

def test_genai_config_names_are_the_graphs(plain):
    """Every name genai_config.json promises is an input/output of the exported graph, with %d per layer."""
    client = write_client_files(plain)
    gc = json.loads((plain.parent / "genai_config.json").read_text())
    graph = onnx.load(str(plain), load_external_data=False).graph
    ins, outs = [i.name for i in graph.input], [o.name for o in graph.output]
    dec = gc["model"]["decoder"]
    for key, name in dec["inputs"].items():
        names = [name % i for i in range(CFG.num_hidden_layers)] if "%d" in name else [name]
        assert all(n in ins for n in names), (key, names, ins)
    for key, name in dec["outputs"].items():
        names = [name % i for i in range(CFG.num_hidden_layers)] if "%d" in name else [name]
        assert all(n in outs for n in names), (key, names, outs)
    assert (ins, outs) == io_names(CFG.num_hidden_layers)
    assert (dec["head_size"], dec["num_attention_heads"], dec["num_key_value_heads"]) == (16, 4, 2)
    assert dec["filename"] == "model.onnx"
    assert gc["search"]["past_present_share_buffer"] is False and client.share_buffer is False
    assert gc["model"]["context_length"] == CFG.max_position_embeddings
    hf = json.loads((plain.parent / "config.json").read_text())
    assert (hf["model_type"], hf["num_key_value_heads"], hf["head_dim"]) == ("llama", 2, 16)
    assert client.tokenizer.startswith("none")  # the tiny preset has no tokenizer


def test_share_buffer_refused_on_the_plain_graph(plain):
    with pytest.raises(ValueError, match="share_buffer=True needs the fused graph"):
        write_client_files(plain, share_buffer=True)
    with pytest.raises(ValueError, match="unknown provider"):
        genai_config(CFG, provider="rocm")


def test_missing_onnx_and_tokenizer_dir_are_one_line_errors(plain, tmp_path):
    with pytest.raises(ValueError, match="no such ONNX file"):
        write_client_files(tmp_path / "nope.onnx")
    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer.model"):
        write_client_files(plain, tokenizer_dir=tmp_path)


# --- tokenizer.model -> tokenizer.json ----------------------------------------------------------------------

def test_tokenizer_json_encodes_as_sentencepiece(tokenizer_dir, tmp_path):
    """HF `tokenizers` on our tokenizer.json gives sentencepiece's ids (BOS, byte fallback, spaces) and text back."""
    tokenizers = pytest.importorskip("tokenizers")
    tok_json, tok_cfg = sentencepiece_to_tokenizer_json(tokenizer_dir / "tokenizer.model")
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok_json))
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ref = Tokenizer(tokenizer_dir / "tokenizer.model")
    for text in PROBES + TEXTS[:4]:
        assert hf.encode(text).ids == ref.encode(text), text
        assert hf.decode(ref.encode(text), skip_special_tokens=True) == text
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<s>", "</s>", True)
    # Negative: without the merges every word falls apart into single characters.
    broken = {**tok_json, "model": {**tok_json["model"], "merges": []}}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "broken.json")).encode(TEXTS[1]).ids != ref.encode(TEXTS[1])


def test_tokenizer_conversion_refuses_unigram_and_garbage(tmp_path):
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(TEXTS), model_writer=buf, model_type="unigram",
                                   vocab_size=60, minloglevel=2, hard_vocab_limit=False)
    (tmp_path / "uni.model").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="UNIGRAM model; only BPE"):
        sentencepiece_to_tokenizer_json(tmp_path / "uni.model")
    (tmp_path / "junk.model").write_bytes(b"\xff\x00 not a proto")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        sentencepiece_to_tokenizer_json(tmp_path / "junk.model")


def test_tokenizer_ids_must_match_the_config(plain, tokenizer_dir, tmp_path):
    (tmp_path / "model.onnx").write_bytes(plain.read_bytes())
    with pytest.raises(ValueError, match="eos_token_id = 5"):
        write_client_files(tmp_path / "model.onnx", CFG.replace(eos_token_id=5), tokenizer_dir=tokenizer_dir)


# --- int4 ----------------------------------------------------------------------------------------------------

def _dequantize(q: np.ndarray, scales: np.ndarray, k: int, block: int) -> np.ndarray:
    """MatMulNBits' symmetric layout by hand: q [N, blocks, block/2] uint8, low nibble first, value (q - 8) * s."""
    low, high = q & 0x0F, q >> 4
    nibbles = np.stack([low, high], -1).reshape(q.shape[0], -1)  # [N, blocks * block]
    w = (nibbles.astype(np.float32) - 8) * np.repeat(scales.reshape(q.shape[0], -1), block, axis=1)
    return w[:, :k].T  # [K, N], as MatMul's B


def test_int4_weights_are_block32_symmetric(plain, tmp_path):
    """Round to nearest (--int4-algorithm rtn): each quantized weight, dequantized by hand, is within half a step of
    the fp32 weight it replaced."""
    src = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(plain)).graph.initializer}
    model = onnx.load(str(quantize_int4(plain, tmp_path / "rtn.onnx", algorithm="rtn").path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 7 * CFG.num_hidden_layers + 1  # q k v o gate up down per layer, and lm_head
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert sum(n.op_type == "RotaryEmbedding" and n.domain == "llama_tools" for n in model.graph.node) == 4
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"]) == (4, 32) and len(node.input) == 3  # no zero points
        weight = node.input[1].removesuffix("_Q4")  # the export's `<module>.MatMul.weight`, stored [in, out]
        w = src[weight[:-2]].T if weight.endswith("_t") else src[weight]  # [K, N] ("_t": folded by quantize)
        deq = _dequantize(inits[node.input[1]], inits[node.input[2]], attrs["K"], 32)
        step = np.abs(np.repeat(inits[node.input[2]].reshape(attrs["N"], -1), 32, axis=1)[:, :attrs["K"]].T)  # scales carry the sign
        assert deq.shape == w.shape == (attrs["K"], attrs["N"])
        err = np.abs(deq - w)
        # Round to nearest in [-8, 7] with the block's largest |w| at -8: half a step, except a weight that
        # rounds to +8 on the other side, clipped to +7 (a full step at most).
        clipped = np.isclose(deq, 7 * np.sign(deq) * step) & (np.abs(w) > 6.5 * step)
        assert (err <= np.where(clipped, step, step / 2) + 1e-7).all(), weight
        assert np.abs(deq - w).max() > 0  # really quantized (and the check above could fail)


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_a_tied_int4_embedding_is_the_lm_heads_blocks(graph, tmp_path):
    """Tied: the Gather becomes GatherBlockQuantized over lm_head's own int4 blocks (no fp32 table left).

    Truth: each gathered row equals MatMulNBits' blocks dequantized by hand (_dequantize), column for column.
    Asymmetric int4 shares too (its zero points unpacked for the Gather: test_streamed_export checks its rows
    against MatMulNBits' own), at the cost of its zero points only.
    """
    import onnxruntime as ort
    from onnx import helper

    from llama_tools.exporters.fused import export_fused

    cfg = CFG.replace(tie_word_embeddings=True)
    model = build_model(cfg, seed=3)
    full = tmp_path / "full.onnx"
    (export_fused if graph == "fused" else export_onnx)(model, full)
    sizes = {}
    for algorithm, symmetric in (("rtn", True), ("rtn", False), ("imatrix", False)):
        out = tmp_path / f"int4-{algorithm}-{symmetric}.onnx"
        quantize_int4(full, out, symmetric=symmetric, algorithm=algorithm)
        sizes[algorithm, symmetric] = out.stat().st_size
        m = onnx.load(str(out))
        ops = [n.op_type for n in m.graph.node]
        tables = [t.name for t in m.graph.initializer if list(t.dims) == [cfg.vocab_size, cfg.hidden_size]]
        assert "GatherBlockQuantized" in ops and tables == [], tables
        if algorithm == "rtn" and not symmetric:
            continue
        head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")
        inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        if symmetric:
            w = _dequantize(inits[head.input[1]], inits[head.input[2]], cfg.hidden_size, 32)  # [n2, n1]
        else:  # imatrix: zero points, unpacked by the module's own reader (tested against onnxruntime's kernel)
            from llama_tools.exporters.int4_blocks import unpack

            w = unpack(inits[head.input[1]], inits[head.input[2]], inits[head.input[3]], bits=4, k=cfg.hidden_size).T
        gathered = next(n for n in m.graph.node if n.op_type == "Reshape" and n.name.endswith("Reshape_rows")).output[0]
        m.graph.output.append(helper.make_tensor_value_info(gathered, onnx.TensorProto.FLOAT, None))
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        ids = np.array([[1, 7, 300, cfg.vocab_size - 1]], np.int64)
        feeds = {i.name: (ids if i.name == "input_ids" else np.ones_like(ids) if i.name == "attention_mask"
                          else np.arange(4)[None] if i.name == "position_ids"
                          else np.zeros([1, cfg.num_key_value_heads, 0, cfg.head_dim], np.float32))
                 for i in sess.get_inputs()}
        rows = sess.run([gathered], feeds)[0]  # [1, 4, n2]
        np.testing.assert_allclose(rows[0], w.T[ids[0]], rtol=0, atol=1e-6)
    # Zero points add 1/64 byte per weight (and the Gather's unpacked copy 1/32 per head weight): never a table.
    assert sizes["rtn", True] < sizes["rtn", False] < sizes["rtn", True] + cfg.vocab_size * cfg.hidden_size
    assert sizes["imatrix", False] == sizes["rtn", False]  # the same tensors, other values


def test_int4_bytes_and_refusals(plain, int4, tmp_path):
    before, after = plain.stat().st_size, int4.stat().st_size
    assert after < 0.42 * before  # tiny's fp32 embedding (32 K of its 158 K weights) stays unquantized
    with pytest.raises(ValueError, match="no MatMul with a constant 2-D weight"):
        quantize_int4(int4, tmp_path / "again.onnx")
    with pytest.raises(ValueError, match="is the source graph"):
        quantize_int4(plain, plain)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        quantize_int4(plain, tmp_path / "b.onnx", block_size=24)
    assert not (tmp_path / "again.onnx").exists() and not list(tmp_path.glob(".*"))


@pytest.mark.slow
def test_int4_parity_verdict_and_its_negative(tmp_path):
    """int4 of a decisive tiny model is faithful by the stated thresholds; a scrambled layer is not."""
    from llama_tools.exporters.fused import export_fused  # builds from the weights without tracing: seconds faster

    good = decisive()
    export_fused(good, tmp_path / "good.onnx")
    quantize_int4(tmp_path / "good.onnx", tmp_path / "good4.onnx")
    p = measure_quant_parity(tmp_path / "good4.onnx", good, steps=48)
    assert p.thresholds == QuantThresholds()
    assert p.faithful, p.failures
    assert 0 < p.mean_kl < 0.05 and abs(p.ppl_change) < 0.05 and p.top1_agreement >= 0.7
    assert 0 < p.ppl_change_se < 0.05  # the change's spread over its tokens, reported beside it
    assert p.max_abs_logit_error > 1e-2  # int4 is far outside the fp32 bound of 1e-4: judged on its own terms
    bad = decisive()
    with torch.no_grad():
        w = bad.model.layers[1].mlp.down_proj.weight
        w.copy_(w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))])
    export_fused(bad, tmp_path / "bad.onnx")
    quantize_int4(tmp_path / "bad.onnx", tmp_path / "bad4.onnx")
    q = measure_quant_parity(tmp_path / "bad4.onnx", good, steps=48)
    assert not q.faithful and q.mean_kl > p.mean_kl * 3 and q.ppl_change > 0.1, q.failures
    assert any("perplexity change" in f and "standard error" in f for f in q.failures), q.failures


def test_int4_of_a_static_graph_measures_the_same(tmp_path):
    """verify int4 through a static KV buffer gives the figures of the same int4 weights with a growing cache."""
    from llama_tools.exporters.fused import export_fused

    good = decisive()
    for name, static in (("grow", False), ("static", 64)):
        export_fused(good, tmp_path / f"{name}.onnx", static_kv=static)
        quantize_int4(tmp_path / f"{name}.onnx", tmp_path / f"{name}4.onnx")
    grow, static = (measure_quant_parity(tmp_path / f"{n}4.onnx", good, steps=40) for n in ("grow", "static"))
    assert static.top1_agreement == grow.top1_agreement and static.free_run_same == grow.free_run_same
    assert static.mean_kl == pytest.approx(grow.mean_kl, abs=1e-6)
    with pytest.raises(ValueError, match="static KV buffer holds 64 positions, but the prompt and 60 steps need 68"):
        measure_quant_parity(tmp_path / "static4.onnx", good, steps=60)


# --- onnxruntime-genai runs the files ------------------------------------------------------------------------

def _genai_greedy(og, directory: Path, prompt: list[int], new: int) -> list[int]:
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def _onnx_greedy(path: Path, prompt: list[int], new: int) -> list[int]:
    """The graph's own greedy tokens through onnxruntime, our runner."""
    from llama_tools.exporters.verification.parity import positions
    from llama_tools.exporters.runtime import OnnxLM, create_session

    lm = OnnxLM(create_session(path, "cpu"), CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim)
    ids, past, out = list(prompt), lm.empty_cache(1), []
    step = ids
    for _ in range(new):
        mask = np.ones((1, len(ids)), np.int64)
        res = lm(np.array([step]), mask, positions(mask, len(step)), past)
        past, tok = res.cache, int(res.logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        step = [tok]
    return out


@pytest.mark.slow
def test_genai_runs_plain_fused_static_and_int4(plain, int4, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    want = generate(build_model(CFG, seed=0), PROMPT, max_new_tokens=NEW).new_ids
    assert len(want) == NEW
    write_client_files(plain)
    assert _genai_greedy(og, plain.parent, PROMPT, NEW) == want
    try:
        from llama_tools.exporters.fused import export_fused
    except ImportError:
        export_fused = None
    if export_fused is not None:
        for name, static in (("fused", False), ("static", 64)):
            path = tmp_path / name / "model.onnx"
            export_fused("tiny", path, static_kv=static)
            client = write_client_files(path)
            assert client.share_buffer is True  # GQA writes into the one buffer, static or growing
            assert _genai_greedy(og, path.parent, PROMPT, NEW) == want, name
            if not static:  # the same graph with genai growing the cache: the same tokens
                config = path.parent / "genai_config.json"
                gc = json.loads(config.read_text())
                gc["search"]["past_present_share_buffer"] = False
                config.write_text(json.dumps(gc))
                assert _genai_greedy(og, path.parent, PROMPT, NEW) == want, name
            if static:  # past the buffer: genai's own one-line refusal, not a failure inside the graph
                with pytest.raises(Exception, match=r"max_length \(65\) cannot be greater than model context_length \(64\)"):
                    _genai_greedy(og, path.parent, PROMPT, 65 - len(PROMPT))
    # int4 is not fp32: genai must reproduce the int4 graph's own greedy tokens (onnxruntime, our runner).
    # genai stops at an end-of-text token, our runner does not: the same tokens up to it.
    write_client_files(int4)
    got, ours = _genai_greedy(og, int4.parent, PROMPT, NEW), _onnx_greedy(int4, PROMPT, NEW)
    eos = json.loads((int4.parent / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    assert got and got == ours[:len(got)] and (len(got) == NEW or got[-1] in eos), (got, ours)


def test_genai_rejects_a_shared_buffer_on_the_plain_graph(plain, tmp_path):
    """Negative control for the flag: share_buffer=true on the concatenating graph fails in genai, as the issue saw."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    d = tmp_path / "shared"
    d.mkdir()
    (d / "model.onnx").write_bytes(plain.read_bytes())
    (d / "genai_config.json").write_text(json.dumps(genai_config(CFG, share_buffer=True)))
    with pytest.raises(Exception, match="present.0.key"):
        _genai_greedy(og, d, PROMPT, 4)


def test_genai_tokenizer_from_converted_files(plain, tokenizer_dir, tmp_path):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    d = tmp_path / "with_tok"
    d.mkdir()
    (d / "model.onnx").write_bytes(plain.read_bytes())
    files = write_client_files(d / "model.onnx", tokenizer_dir=tokenizer_dir)
    assert files.tokenizer == "converted from tokenizer.model"
    assert {p.name for p in files.written} >= {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}
    tok = og.Tokenizer(og.Model(str(d)))
    tok.update_options(add_special_tokens="true")  # genai 0.18 adds no BOS unless asked
    ref = Tokenizer(tokenizer_dir / "tokenizer.model")
    for text in PROBES + TEXTS[:4]:
        ids = ref.encode(text)
        assert [int(i) for i in tok.encode(text)] == ids, text
        assert tok.decode(ids) == text


# --- Optimum's ORTModelForCausalLM runs the files ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_optimum_runs_the_export_as_the_readme_shows(graph, plain, tmp_path):
    """README's Optimum snippet on our files: greedy tokens equal `generate`'s; a left-padded row equals it alone."""
    pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx not installed (pip install optimum-onnx)")
    from optimum.onnxruntime import ORTModelForCausalLM

    if graph == "plain":
        path = plain
    else:
        from llama_tools.exporters.fused import export_fused

        path = export_fused("tiny", tmp_path / "fused" / "model.onnx").path
    write_client_files(path)  # config.json: without it Optimum cannot tell which library the model is for
    model = ORTModelForCausalLM.from_pretrained(str(path.parent), provider="CPUExecutionProvider")
    reference = build_model(CFG, seed=0)
    want = generate(reference, PROMPT, max_new_tokens=NEW).new_ids
    out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.shape == (1, len(PROMPT) + NEW)
    assert out[0, len(PROMPT):].tolist() == want
    other = [1, 5, 6, 7, 8, 9]  # a longer row: PROMPT is left-padded by two
    ids = torch.tensor([[0, 0, *PROMPT], other])
    mask = torch.tensor([[0, 0] + [1] * len(PROMPT), [1] * len(other)])
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert batch[0, len(other):].tolist() == want[:10]
    assert batch[1, len(other):].tolist() == generate(reference, other, max_new_tokens=10).new_ids


def _genai_batch(og, directory: Path, prompts: list[str], max_length: int) -> list[list[int]]:
    """Greedy new tokens of each prompt, the prompts run as one batch by onnxruntime-genai (it pads them)."""
    model = og.Model(str(directory))
    tok = og.Tokenizer(model)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(tok.encode_batch(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    while not gen.is_done():
        gen.generate_next_token()
        for row, t in zip(out, gen.get_next_tokens()):
            row.append(int(t))
    return out


@pytest.mark.slow
def test_genai_batch_of_unequal_prompts_gives_each_its_own_tokens(tokenizer_dir, tmp_path, monkeypatch):
    """onnxruntime-genai pads a batch's shorter prompt at the end and appends each new token after the padding:
    GQA's rotary then needs the token's position, not its slot (the fused default, RoPE inside GQA). Each row equals
    the prompt run alone, up to the new tokens its padding leaves; without the positions fed, the short row drifts."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install '.[genai]')")
    from llama_tools.exporters import fused

    prompts = ["The quick brown fox jumps over the lazy dog and runs", "Hello"]

    def export(name: str) -> Path:
        path = tmp_path / name / "model.onnx"
        fused.export_fused("tiny", path)
        write_client_files(path, tokenizer_dir=tokenizer_dir)
        return path.parent

    d = export("positions")
    longest = max(len(og.Tokenizer(og.Model(str(d))).encode(p)) for p in prompts)
    alone = [_genai_batch(og, d, [p], longest + 12)[0] for p in prompts]
    both = _genai_batch(og, d, prompts, longest + 12)
    assert len(both[1]) >= 8 and all(len(a) >= 8 for a in alone)  # the short row has tokens to compare
    for a, b in zip(alone, both):
        assert b == a[:len(b)], (a, b)
    monkeypatch.setattr(fused, "_slot_positions", lambda *a: None)  # negative: GQA rotates by slot alone
    old = export("slots")
    got = _genai_batch(og, old, prompts, longest + 12)
    assert got[0] == both[0] and got[1] != both[1]  # the unpadded row is unchanged, the padded one is not
