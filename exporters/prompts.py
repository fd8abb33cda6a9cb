"""The ids both sides run: left-padded batches, the positions padding implies, reproducible default prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths -> input_ids and attention_mask [batch, longest], padding on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    n = max(len(p) for p in prompts)
    ids = np.full((len(prompts), n), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), n), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = p
        mask[row, n - len(p):] = 1
    return ids, mask


def positions(mask: np.ndarray, new: int) -> np.ndarray:
    """Position of each of the last `new` tokens: real tokens before it (padding does not count)."""
    return np.clip(mask.cumsum(-1) - 1, 0, None)[:, -new:]


def default_prompts(vocab_size: int, seed: int | None) -> list[list[int]]:
    """Two seeded rows of 11 and 6 ids (>= 3, past <unk>, <s>, </s>): a batch that needs padding.

    The same rows every run, also for checkpoint exports (no seed: 0).
    """
    rng = np.random.default_rng(seed or 0)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (11, 6)]


# --- The default inputs: real text through the model's own tokenizer -----------------------------------------------
# Built-in passages (written for this tool): prose in three languages, code, and a chat turn rendered in the model's
# own template when it has one. Real text is what a model is trained on; random ids drive its activations where no
# text goes (one such row made onnxruntime's fp32 kernels 8x less exact than PyTorch's on a correct export).
PASSAGES = (
    ("English prose",
     "The river had been rising for three days, and by the fourth morning the old bridge was gone. People from the "
     "village gathered on the bank to watch the brown water carry branches, fence posts and a lost boat downstream."),
    ("French prose",
     "Le train du soir quittait la gare à sept heures. Dans le dernier wagon, une femme lisait une lettre qu'elle "
     "avait déjà lue cent fois, tandis que la campagne défilait sous une lumière dorée."),
    ("German prose",
     "Im Winter war der kleine Laden an der Ecke der einzige Ort, an dem noch Licht brannte. Der alte Uhrmacher "
     "arbeitete bis spät in die Nacht, weil jede Uhr in der Stadt irgendwann zu ihm kam."),
    ("Python code",
     "def moving_average(values, window):\n    \"\"\"Mean of each run of `window` consecutive values.\"\"\"\n"
     "    total = sum(values[:window])\n    out = [total / window]\n    for i in range(window, len(values)):\n"
     "        total += values[i] - values[i - window]\n        out.append(total / window)\n    return out\n"),
)
CHAT_TURN = "In two sentences, why does ice float on water?"
ROW_TOKENS = (40, 32, 24, 16, 28)  # a row's length at most: different lengths, so the batch needs left padding


@dataclass(frozen=True)
class Inputs:
    """The rows both sides run, and what they are, in words (the report's header says it)."""

    rows: list[list[int]]
    what: str
    # The rows' indices as padded batches of their own (default: one batch). A row far longer than the rest runs
    # apart: padded to it, every short row would cost its length in every layer.
    groups: tuple[tuple[int, ...], ...] = ()

    def batches(self) -> list[list[list[int]]]:
        """The rows, one list per padded batch."""
        return [[self.rows[i] for i in g] for g in (self.groups or (tuple(range(len(self.rows))),))]

    def whole_graph(self, vocab_size: int) -> tuple[list[list[int]], str | None]:
        """The rows the whole-graph check runs as one padded batch (it holds the float64 logits whole), and why a
        batch of its own is left out (None: none is)."""
        length = max(len(r) for r in self.rows)
        need = len(self.rows) * length * vocab_size * 8
        if len(self.batches()) == 1 or need <= WINDOW_ROW_BYTES:
            return self.rows, None
        first = self.batches()[0]
        return first, (f"the {len(self.rows) - len(first)} row(s) run apart are left out of the whole-graph check "
                       f"(padded with the rest, the float64 logits would take {need / 2**30:.1f} GiB); the "
                       f"layer-local and source checks run them")


def random_rows(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """`count` seeded rows of random ids (>= 3, past <unk>, <s>, </s>), lengths 11, 6, 16, 3, 8, ... (padding)."""
    rng = np.random.default_rng(seed)
    lengths = (11, 6, 16, 3, 8)
    return [rng.integers(3, vocab_size, size=lengths[i % len(lengths)]).tolist() for i in range(count)]


# A chat template is a program the checkpoint ships: rendered in a child bounded in time, memory and output.
RENDER_SECONDS = 5.0
RENDER_MEMORY_BYTES = 256 * 2**20
RENDER_CHARS = 64 * 2**10  # far past any real turn (SmolLM2's: 100 characters)


def render_chat(template: str, user: str, bos: str | None, eos: str | None) -> str:
    """One user turn and the generation prompt through the model's Jinja chat template (sandboxed, as transformers),
    in a child process bounded by RENDER_SECONDS, RENDER_MEMORY_BYTES and RENDER_CHARS; ValueError saying why not."""
    from llama_tools.outputs.bounded import Exceeded, bounded_call

    def render() -> str:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        out, size = [], 0
        for piece in env.from_string(template).generate(messages=[{"role": "user", "content": user}],
                                                        add_generation_prompt=True, bos_token=bos or "",
                                                        eos_token=eos or ""):
            size += len(piece)
            if size > RENDER_CHARS:
                raise ValueError(f"renders past {RENDER_CHARS:,} characters")
            out.append(piece)
        text = "".join(out)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("renders text that is not UTF-8 (a lone surrogate)") from None
        return text

    try:
        return bounded_call(render, seconds=RENDER_SECONDS, memory_bytes=RENDER_MEMORY_BYTES,
                            answer_bytes=8 * RENDER_CHARS)
    except Exceeded as e:
        raise ValueError(str(e)) from None


def text_inputs(tok: Any, vocab_size: int, longest: int) -> Inputs:
    """The built-in passages (and a chat turn) through `tok`, each row cut to ROW_TOKENS and to `longest` tokens."""
    from llama_tools.checkpoints.tokenizer import check_vocab

    texts = list(PASSAGES)
    rendered, why = None, ""
    template = getattr(tok, "chat_template", None)
    if template:
        try:
            rendered = render_chat(template, CHAT_TURN, tok.piece_of(tok.special.bos_id),
                                   tok.piece_of(tok.special.eos_ids[0] if tok.special.eos_ids else None))
        except Exception as e:  # noqa: BLE001  a template we cannot render: the turn goes in as plain text, said below
            rendered, why = None, f" as plain text: the model's chat template {e}"
    elif str(getattr(tok, "path", "")).lower().endswith(".gguf"):  # a template that is not UTF-8 reads as none
        from llama_tools.checkpoints.gguf.read import template_problem

        problem = template_problem(tok.path)
        why = f" as plain text: {problem}" if problem else ""
    rows, names = [], []
    for (name, text), cap in zip(texts + [("chat turn", rendered or CHAT_TURN)], ROW_TOKENS):
        ids = tok.encode(text, bos=None if rendered is None or name != "chat turn" else False)[:min(cap, longest)]
        if not ids:
            continue
        try:
            check_vocab(ids, vocab_size, "text")
        except ValueError:
            raise ValueError(f"{tok.path}: encodes the built-in text to id {max(ids)}, outside the model's "
                             f"vocabulary of {vocab_size}; the tokenizer does not fit the model (pass --random-ids N "
                             f"to check the graph without it)") from None
        rows.append(ids)
        names.append(name + ((" in the model's chat template" if rendered else why) if name == "chat turn" else ""))
    if not rows:
        raise ValueError(f"{tok.path}: encodes every built-in text to no tokens at all; the tokenizer does not read "
                         f"text as the model's does (pass --random-ids N or --ids to check the graph without it)")
    return Inputs(rows, f"built-in text through {tok.path.name} ({', '.join(names)})")


def default_inputs(source: Any, vocab_size: int, context: int, *, random_ids: int | None = None,
                   seed: int = 0) -> Inputs:
    """Real text through MODEL's tokenizer when it has one; seeded random ids with --random-ids N or without one."""
    from llama_tools.checkpoints.source import load_tokenizer

    tok = load_tokenizer(source) if random_ids is None else None
    if tok is not None:
        inputs = text_inputs(tok, vocab_size, max(1, context))
    else:
        count = random_ids if random_ids is not None else 2
        why = "--random-ids" if random_ids is not None else "the model has no tokenizer"
        inputs = Inputs(random_rows(vocab_size, count, seed), f"{count} rows of seeded random ids (seed {seed}; {why})")
    window = getattr(getattr(source, "cfg", None), "sliding_window", None)
    longest = max(len(r) for r in inputs.rows)
    if window is not None and longest <= window < context:
        inputs = past_the_window(inputs, tok, vocab_size, min(window + WINDOW_EXTRA, context), seed)
    return inputs


WINDOW_EXTRA = 8  # tokens the longest default row runs past a sliding window, so that the window masks keys
# The whole-graph check's padded batch's float64 logits, at most, with the row past the window in it (it holds them
# whole); past this the row runs in the layer-local and source checks only, which judge logits a slab at a time.
WINDOW_ROW_BYTES = 1 << 30


def past_the_window(inputs: Inputs, tok: Any, vocab_size: int, length: int, seed: int) -> Inputs:
    """`inputs` and one more row of `length` tokens: the passages over and over through `tok`, or seeded ids."""
    if tok is not None:
        text = " ".join(t for _, t in PASSAGES)
        ids = tok.encode(text, bos=None)
        while len(ids) < length:
            ids = ids + tok.encode(text, bos=False)
        row = ids[:length]
    else:
        row = np.random.default_rng(seed + 1).integers(3, vocab_size, size=length).tolist()
    # A batch of its own: Gemma 3 270M's 520-token row padded with the 5 others peaked at 1.62 GB (1.5x its fp32
    # weights) and ran 138 s of checks on 2 cores, every layer's passes over 6 x 520 positions, mostly padding.
    n = len(inputs.rows)
    return Inputs(inputs.rows + [row], inputs.what + f", and a row of {length} tokens past the sliding window (a "
                                                     f"batch of its own)", (tuple(range(n)), (n,)))


# What `export --quantize int4` scores on the spot and `verify int4` by default (real English and code, ~250 tokens
# for a BPE vocabulary): a trained model's int4 error shows on real text, where random ids hide it (SmolLM2: KL 0.39
# nats on text). Its length is what the perplexity change's standard error asks: on SmolLM2-135M's int4, one token
# moved 2.6 nats, and the change read +10.8% +/- 5.5% on the first 78 tokens, +4.1% +/- 2.7% on all 252.
QUALITY_TEXT = ("Paris is the capital and largest city of France. The river Seine flows through the city, and its "
                "banks are lined with bridges, museums and bookstalls. Water boils at one hundred degrees Celsius at "
                "sea level. In 1969, two astronauts walked on the Moon while a third orbited above them. def add(a, "
                "b):\n    return a + b\n"
                "\nThe human heart beats about one hundred thousand times a day. Its four chambers work in pairs: the "
                "right side sends blood to the lungs, and the left side sends it to the rest of the body.\n\n"
                "In the winter of 1776, George Washington led his army across the icy Delaware River and surprised the "
                "troops camped at Trenton. The victory was small, but it restored the hopes of the revolution.\n\n"
                "A prime number has exactly two divisors, one and itself. The first few are 2, 3, 5, 7, 11 and 13, and "
                "Euclid proved that there is no largest one.\n\n"
                "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
                "        self.items.append(item)\n")
# `verify int4`'s start when none is given: QUALITY_TEXT's first sentence, the text itself scored.
QUALITY_PROMPT = QUALITY_TEXT.split(". ")[0] + "."


def default_int4_inputs(tokenizer: Any, context: int) -> tuple[list[int], list[int]]:
    """(prompt, sequence) of `verify int4` with neither given, for a model with a tokenizer: QUALITY_PROMPT, and
    QUALITY_TEXT (what the export's quality line scores, in no calibration passage) within `context` positions."""
    return tokenizer.encode(QUALITY_PROMPT), tokenizer.encode(QUALITY_TEXT)[:context]
