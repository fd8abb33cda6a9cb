"""Any decoder transformers knows, counted exactly from its module tree: the fallback for a foreign config.json.

A config.json of an architecture no family here models (config_files.UnknownArchitecture) is built by
transformers itself, `AutoModelForCausalLM.from_config` on the meta device with weight init off (shapes only:
nothing allocated, a 671B DeepSeek-V3 in seconds), and its parameters are counted as
`sum(p.numel() for p in model.parameters())` counts them (a tied lm_head once). Totals by component come from
the module tree: the embedding, each decoder's attention (MLA included), MLP or experts (router, routed and
shared experts), norms, the final norm and lm_head. These parts have no paper formula; the output says so.

transformers is an optional dependency (the `hf` extra) imported only here, only for such a config: counting
a family modelled natively never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..modeling import dtypes
from .accounting import Item, LayerGroup
from ..modeling.memory import gib, nbytes
from ..checkpoints.source import ForeignConfig

PIP = 'pip install "transformers>=4.45"'  # what the `hf` extra holds
NO_FORMULA = "none: these parts are counted from transformers' module tree and have no paper formula"
# Components in the order they are shown; per-layer ones first come from each decoder's direct children.
COMPONENTS = ("embedding", "attention", "mlp", "moe.router", "moe.experts", "moe.shared_experts", "norms",
              "layer other", "final_norm", "lm_head", "other embeddings", "other norms", "other")
_FFN = ("mlp", "moe.router", "moe.experts", "moe.shared_experts")

# transformers builds the tree one Python module at a time (each expert of each decoder: DeepSeek-V3's 61 x 256 take
# seconds) and some configs list a value per layer in __init__; so the numbers that multiply modules are bounded, from
# the JSON, before transformers or torch is imported. Widths and lengths build nothing per unit on the meta device.
MAX_TREE_LAYERS = 2**12  # any *layers / *layer key; Llama 3.1 405B: 126
MAX_TREE_EXPERTS = 2**12  # any *expert* count; Qwen3-Next: 512
MAX_TREE_HEADS = 2**16  # any *head* count (heads are looped over in some inits); 405B: 128
MAX_TREE_BLOCKS = 2**15  # decoders x (experts + 1), ~1 ms each; Kimi K2: 61 x 385 = 23,485
MAX_TREE_INT = 2**40  # any other integer: widths, lengths, ids (Llama 4 Scout's context: 10,485,760)
_LAYERS = re.compile(r"(?:^|_)layers?$")
_SIZE = re.compile(r"(?:size|dim|dims)$")


def _tree_limit(key: str) -> tuple[int, str]:
    """(bound, what it counts) for an integer under `key` anywhere in a foreign config."""
    k = key.lower()
    if _LAYERS.search(k):
        return MAX_TREE_LAYERS, "layers"
    if "expert" in k and not _SIZE.search(k):
        return MAX_TREE_EXPERTS, "experts"
    if "head" in k and not _SIZE.search(k):
        return MAX_TREE_HEADS, "heads"
    return MAX_TREE_INT, "a size"


def check_tree_sizes(data: dict[str, Any], path: Path | str) -> None:
    """One ValueError line naming the field when a foreign config would make transformers build without bound."""
    most = {"layers": 0, "experts": 0}
    todo: list[tuple[str, Any]] = [(k, v) for k, v in data.items()]
    while todo:  # iterative: a config nests as deep as JSON allows
        where, v = todo.pop()
        if isinstance(v, dict):
            todo += [(f"{where}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(where, x) for x in v]
        elif type(v) is int:
            limit, what = _tree_limit(where.rsplit(".", 1)[-1])
            if v < 0 and what != "a size":  # a negative count is no count (transformers builds 0 of them)
                raise ValueError(f"{path}: field {where!r} is {v:,}; a count of {what} must be >= 0; fix the config")
            if abs(v) > limit:
                raise ValueError(f"{path}: field {where!r} is {v:,}, over the {limit:,} llama-tools lets transformers "
                                 f"build ({what}: far past any published model); fix the config")
            if what in most:
                most[what] = max(most[what], v)
    blocks = most["layers"] * (most["experts"] + 1)
    if blocks > MAX_TREE_BLOCKS:
        raise ValueError(f"{path}: {most['layers']:,} layers x {most['experts']:,} experts would have transformers "
                         f"build {blocks:,} expert blocks, over the {MAX_TREE_BLOCKS:,} llama-tools allows "
                         f"(DeepSeek-V3: 61 x 256); fix the layer or expert count")


@dataclass(frozen=True)
class ModuleWeight:
    """One parameter of the module tree (a tied one once): its name, shape and component."""

    name: str
    shape: tuple[int, ...]
    component: str  # one of COMPONENTS
    layer: int | None  # decoder index; None outside the stack

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModuleTree:
    """What transformers builds for a config, as parameter shapes: the source of the count and the shape report."""

    model: str
    source: str  # the config file
    architecture: str  # the config's architectures[0], else its model_type
    model_type: str
    class_name: str  # the class AutoModelForCausalLM built, e.g. Phi3ForCausalLM
    transformers_version: str
    stack: str  # the decoder stack's module name, e.g. model.layers ("" when none was found)
    num_layers: int
    tied: bool  # lm_head's weight is the embedding's (counted once)
    torch_dtype: str  # the config's stored dtype (ours), float32 when it names none
    vocab_size: int | None
    hidden_size: int | None
    weights: tuple[ModuleWeight, ...]
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(w.numel for w in self.weights)


@dataclass(frozen=True)
class TreeLayerGroup(LayerGroup):
    """Decoders first..last of one shape: each holds `total` parameters (attention + ffn + norms + other)."""

    other: int = 0  # what no component names (ffn holds the MLP, or router + routed + shared experts)


@dataclass(frozen=True)
class WeightBytes:
    dtype: str
    bytes: int


@dataclass
class ModuleTreeCount:
    """count-params for a foreign config: exact totals from transformers' module tree, no paper formula."""

    model: str
    source: str
    architecture: str
    model_type: str
    class_name: str
    transformers_version: str
    total: int
    non_embedding: int
    tied: bool
    vocab_size: int | None
    hidden_size: int | None
    num_layers: int
    components: list[Item]
    layer_groups: list[TreeLayerGroup]
    memory: list[WeightBytes]
    counted_from: str = "transformers module tree"
    paper_formula: str = NO_FORMULA
    notes: list[str] = field(default_factory=list)

    def component(self, name: str) -> int:
        return next((c.params for c in self.components if c.name == name), 0)


# --- Building the tree --------------------------------------------------------------------------------------------

def module_tree(foreign: ForeignConfig) -> ModuleTree:
    """transformers' model of `foreign`, built on the meta device, as parameter shapes; one ValueError line if not."""
    check_tree_sizes(foreign.data, foreign.path)  # before transformers is imported or anything built
    return _tree(str(foreign.path), foreign.name, json.dumps(foreign.data, sort_keys=True))


# transformers builds in a forked child bounded in time and memory: whatever key or list of a config multiplies the
# modules it builds (a block count under any name, a per-layer list), the build stops at these and says so.
TREE_SECONDS = 60.0
TREE_MEMORY_BYTES = 2**30
TREE_ANSWER_BYTES = 64 * 2**20  # the shapes, as JSON: DeepSeek-V3's 61 x 256 experts take ~5 MB


@functools.lru_cache(maxsize=4)  # count-params then report shapes in one process (the tests) build it once
def _tree(path: str, name: str, text: str) -> ModuleTree:
    from ..outputs.bounded import Exceeded, bounded_call

    try:
        d = bounded_call(lambda: dataclasses.asdict(_build(path, name, text)), seconds=TREE_SECONDS,
                         memory_bytes=TREE_MEMORY_BYTES, answer_bytes=TREE_ANSWER_BYTES)
    except Exceeded as e:
        message = str(e)
        if message.startswith("ValueError: "):  # the build's own one-line refusal, which names the file
            raise ValueError(message.removeprefix("ValueError: ")) from None
        raise ValueError(f"{path}: transformers' module tree of it {message} (the bound is {TREE_SECONDS:g} s and "
                         f"{TREE_MEMORY_BYTES / 2**30:g} GiB); some size or list in the config is far past any "
                         f"published model: fix it") from None
    weights = tuple(ModuleWeight(w["name"], tuple(w["shape"]), w["component"], w["layer"]) for w in d.pop("weights"))
    return ModuleTree(**{**d, "weights": weights, "notes": tuple(d["notes"])})


def _build(path: str, name: str, text: str) -> ModuleTree:
    data = json.loads(text)
    arch = ForeignConfig(path, Path(path), data).architecture
    model_type = data.get("model_type")
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ValueError(f"{path}: architecture {arch!r} (model_type {model_type!r}) is not one llama-tools models "
                         f"natively; to count it from transformers' module tree, install transformers: {PIP} "
                         f"(the llama-tools [hf] extra)") from None
    version = transformers.__version__
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{path}: model_type {model_type!r} ({arch}) is not one transformers {version} knows; "
                         f"llama-tools runs no remote code (auto_map): a newer transformers may know it")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{path}: model_type {model_type!r} ({arch}) has no causal-LM class in transformers "
                         f"{version} (AutoModelForCausalLM): not a decoder llama-tools can count")
    try:
        with _quiet(transformers):
            config = CONFIG_MAPPING[model_type].from_dict(dict(data))
            with torch.device("meta"):
                with _no_init():  # shapes only: no weight allocated, no init run (4x faster for DeepSeek-V3)
                    # eager attention: a config asking for flash-attn is counted where flash-attn is not installed
                    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
                model.tie_weights()  # skipping init skips the tying too (from_pretrained ties afterwards, as here)
    except Exception as e:  # noqa: BLE001  (a config transformers refuses raises anything: its words, one line)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path}: transformers {version} cannot build {arch} from it ({type(e).__name__}: "
                         f"{first[:200]})") from None
    notes = []
    if "auto_map" in data:
        notes.append(f"auto_map (remote code) not run: transformers' own {type(model).__name__} is counted")
    if data.get("quantization_config"):
        notes.append("quantization_config not applied: the unquantized module tree is counted")
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    stack_name, stack = _stack(model, torch)
    weights = tuple(_weights(model, stack_name, stack, torch))
    emb, head = _io_modules(model)
    tied = emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    return ModuleTree(
        model=name, source=path, architecture=arch, model_type=str(model_type), class_name=type(model).__name__,
        transformers_version=version, stack=stack_name, num_layers=len(stack) if stack is not None else 0, tied=tied,
        torch_dtype=_stored_dtype(data), vocab_size=_int_attr(text_cfg, "vocab_size"),
        hidden_size=_int_attr(text_cfg, "hidden_size"), weights=weights, notes=tuple(notes))


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' warnings (deprecated keys, attention backends) are not ours to print."""
    log = transformers.utils.logging
    level = log.get_verbosity()
    log.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.set_verbosity(level)


def _no_init() -> Any:
    """transformers' own switch that skips weight init (what from_pretrained uses); a no-op where it is missing."""
    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _stack(model: Any, torch: Any) -> tuple[str, Any]:
    """The decoder stack: the outermost ModuleList holding the most parameters (model.layers, transformer.h, ...).

    Lists are not descended into, so the experts' own lists (61 x 256 of them in DeepSeek-V3) are never visited.
    """
    best, best_n = ("", None), 0
    todo = [("", model)]
    while todo:
        prefix, module = todo.pop()
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.ModuleList):
                n = sum(p.numel() for p in child.parameters()) if len(child) else 0
                if n > best_n:
                    best, best_n = (full, child), n
            else:
                todo.append((full, child))
    return best


def _io_modules(model: Any) -> tuple[Any, Any]:
    def get(f: str) -> Any:
        try:
            return getattr(model, f)()
        except (AttributeError, NotImplementedError):
            return None
    return get("get_input_embeddings"), get("get_output_embeddings")


def _weights(model: Any, stack_name: str, stack: Any, torch: Any) -> Iterator[ModuleWeight]:
    """Every parameter once (named_parameters drops a tied lm_head's second name), with its component."""
    emb, head = _io_modules(model)
    emb_ids = {id(p) for p in emb.parameters()} if emb is not None else set()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    prefix = stack_name + "." if stack_name else None
    after_stack = False  # parameters come in registration order: a norm after the stack is the final one
    for name, p in model.named_parameters():
        shape = tuple(int(d) for d in p.shape)
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if prefix and name.startswith(prefix):
            after_stack = True
            rest = name[len(prefix):].split(".")
            j = int(rest[0])
            yield ModuleWeight(name, shape, _layer_component(stack[j], rest[1:]), j)
        elif id(p) in emb_ids:  # a tied lm_head shares this one: named_parameters gave it once, here
            yield ModuleWeight(name, shape, "embedding", None)
        elif id(p) in head_ids:
            yield ModuleWeight(name, shape, "lm_head", None)
        else:
            module = model.get_submodule(owner) if owner else model
            leaf = owner.rsplit(".", 1)[-1].lower()
            # The final norm: registered after the stack, or named so (OPT registers final_layer_norm first);
            # BLOOM's word_embeddings_layernorm, before the stack, is another norm.
            final = "embed" not in leaf and (after_stack or "final" in leaf or leaf in ("norm", "ln_f", "norm_f"))
            kind = ("other embeddings" if isinstance(module, torch.nn.Embedding) else
                    ("final_norm" if final else "other norms") if _is_norm(leaf, module) else "other")
            yield ModuleWeight(name, shape, kind, None)


def _is_norm(name: str, module: Any) -> bool:
    n = name.lower()
    return "Norm" in type(module).__name__ or "norm" in n or n.startswith("ln")


def _layer_component(layer: Any, parts: list[str]) -> str:
    """A decoder's parameter by the direct child it lives in: attention, MLP or experts, norms, or other."""
    if len(parts) == 1:  # a parameter of the decoder itself (a scale, a gain)
        return "norms" if "norm" in parts[0].lower() else "layer other"
    child_name, sub = parts[0], parts[1:-1]
    child = getattr(layer, child_name, None)
    cls, lname = type(child).__name__, child_name.lower()
    if _is_norm(child_name, child):  # first: post_attention_layernorm is a norm, Qwen2MoeRMSNorm no MoE
        return "norms"
    if "attn" in lname or "attention" in lname or "Attention" in cls:
        return "attention"
    if any(k in lname for k in ("mlp", "moe", "ffn", "feed_forward", "expert")) or lname.startswith("fc") or any(
            k in cls for k in ("MLP", "MoE", "Moe", "Expert", "FeedForward", "Sparse")):
        # A sparse block: experts as a list (Mixtral, DeepSeek), or as stacked tensors (GraniteMoE's input_linear).
        # Qwen2MoeMLP is a dense MLP (a shared expert, or a dense decoder's FFN) despite its name.
        sparse = hasattr(child, "experts") or "Sparse" in cls or cls.endswith(("MoE", "Moe", "MoeBlock"))
        if any(s.startswith("shared_expert") for s in sub):
            return "moe.shared_experts"
        if sparse and sub and sub[0] in ("gate", "router"):
            return "moe.router"
        return "moe.experts" if sparse or "experts" in sub else "mlp"
    return "layer other"


def _int_attr(cfg: Any, name: str) -> int | None:
    v = getattr(cfg, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _stored_dtype(data: dict[str, Any]) -> str:
    """The config's torch_dtype (or dtype) as ours; float32 when absent or not a float type we know."""
    value = data.get("torch_dtype") or data.get("dtype")
    try:
        dt = dtypes.get(str(value)) if isinstance(value, str) else None
    except ValueError:
        dt = None
    return dt.name if dt is not None and dt.float else dtypes.FLOAT32.name


# --- Counting -----------------------------------------------------------------------------------------------------

def count_module_tree(foreign: ForeignConfig) -> ModuleTreeCount:
    """Exact parameters of `foreign` as transformers builds it, by component and decoder."""
    tree = module_tree(foreign)
    by_component = {c: 0 for c in COMPONENTS}
    per_layer: dict[int, list[int]] = {}
    for w in tree.weights:
        by_component[w.component] += w.numel
        if w.layer is not None:
            acc = per_layer.setdefault(w.layer, [0, 0, 0, 0])
            k = (0 if w.component == "attention" else 1 if w.component in _FFN else
                 2 if w.component == "norms" else 3)
            acc[k] += w.numel
    groups: list[TreeLayerGroup] = []
    for j in sorted(per_layer):
        a, f, n, o = per_layer[j]
        g = groups[-1] if groups else None
        if g and g.last + 1 == j and (g.attention, g.ffn, g.norms, g.other) == (a, f, n, o):
            groups[-1] = TreeLayerGroup(g.first, j, a, f, n, g.total, other=o)
        else:
            groups.append(TreeLayerGroup(j, j, a, f, n, a + f + n + o, other=o))
    total = tree.total
    notes = [f"counted from transformers {tree.transformers_version}'s module tree ({tree.class_name}, built on the "
             f"meta device: nothing allocated); these parts have no paper formula", *tree.notes]
    return ModuleTreeCount(
        model=tree.model, source=tree.source, architecture=tree.architecture, model_type=tree.model_type,
        class_name=tree.class_name, transformers_version=tree.transformers_version, total=total,
        non_embedding=total - by_component["embedding"], tied=tree.tied, vocab_size=tree.vocab_size,
        hidden_size=tree.hidden_size, num_layers=tree.num_layers,
        components=[Item(c, p) for c, p in by_component.items() if p or (c == "lm_head" and tree.tied)],
        layer_groups=groups, memory=[WeightBytes(d, nbytes(total, d)) for d in dtypes.MEMORY_DTYPES], notes=notes)


# --- Rows for output.render ---------------------------------------------------------------------------------------

def _human(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def tree_summary_rows(counts: list[ModuleTreeCount]) -> list[dict[str, object]]:
    """Quantities down, models across, as accounting.summary_rows lays out the native counts."""
    def line(section: str, what: str, values: list[object]) -> dict[str, object]:
        return {"section": section, "quantity": what, **{c.model: v for c, v in zip(counts, values)}}

    each = lambda f: [f(c) for c in counts]  # noqa: E731
    opt = lambda v: "?" if v is None else f"{v:,}"  # noqa: E731
    rows = [
        line("counted", "from", each(lambda c: f"transformers {c.transformers_version} module tree")),
        line("config", "architecture (model_type)", each(lambda c: f"{c.class_name} ({c.model_type})")),
        line("config", "vocab / width / layers", each(lambda c: f"{opt(c.vocab_size)} / {opt(c.hidden_size)} / "
                                                                f"{c.num_layers}")),
        line("params", "exact total", each(lambda c: f"{c.total:,} ({_human(c.total)})")),
        line("params", "non-embedding", each(lambda c: f"{c.non_embedding:,}")),
    ]
    names = [n for n in COMPONENTS if any(c.component(n) or (n == "lm_head" and c.tied) for c in counts)]
    rows += [line("component", n, each(lambda c, n=n: "tied: the embedding (0 more)" if n == "lm_head" and c.tied
                                       else f"{c.component(n):,}")) for n in names]
    rows.append(line("paper", "formula", each(lambda c: NO_FORMULA)))
    for m in range(len(counts[0].memory)):
        rows.append(line("weights", counts[0].memory[m].dtype, each(lambda c, m=m: gib(c.memory[m].bytes))))
    return rows


def tree_layer_rows(c: ModuleTreeCount) -> list[dict[str, object]]:
    """Per decoder from the module tree, runs of identical decoders folded into one row ("0-2", "3-60")."""
    return [{"model": c.model, "layers": g.label, "attention": g.attention, "ffn": g.ffn, "norms": g.norms,
             "other": g.other, "each": g.total} for g in c.layer_groups]


def tree_long_rows(c: ModuleTreeCount) -> list[dict[str, object]]:
    """count-params' CSV rows (model, section, item, value) for a module-tree count."""
    rows: list[dict[str, object]] = []
    add = lambda section, item, value: rows.append(  # noqa: E731
        {"model": c.model, "section": section, "item": item, "value": value})
    add("counted_from", "transformers module tree", c.transformers_version)
    add("params", "total", c.total)
    add("params", "non_embedding", c.non_embedding)
    for item in c.components:
        add("component", item.name, item.params)
    for m in c.memory:
        add("weight_bytes", m.dtype, m.bytes)
    for g in c.layer_groups:
        add("layer", g.label, g.total)
    return rows
