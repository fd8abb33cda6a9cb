"""What real clients need beside an exported .onnx: HF config.json, generation_config.json, genai_config.json, tokenizer.

- Optimum's `ORTModelForCausalLM.from_pretrained(DIR)` reads `config.json` (without it: "The library name could
  not be automatically inferred") and `generation_config.json`.
- onnxruntime-genai's `og.Model(DIR)` reads `genai_config.json`: the graph's input/output names, head counts,
  the context length, the special ids, the search defaults, and `past_present_share_buffer`. That flag must be
  false for the plain graph: genai then hands the graph a past of the current length and takes back a present
  one token longer (Concat). True makes genai preallocate present.* at max_length and alias it with past.*,
  which only a graph that writes into its past buffer in place (GroupQueryAttention) can honour: the fused graph
  gets true, static KV or not (SmolLM2 int4 decode 5.4 -> 5.1 ms a token, the same tokens).
- `og.Tokenizer(model)` (onnxruntime-extensions) opens `tokenizer_config.json` and `tokenizer.json` in the same
  directory; it never reads a sentencepiece `tokenizer.model`. So a checkpoint that ships only `tokenizer.model`
  (or a GGUF file) gets a `tokenizer.json` written from it here (llama_tools.checkpoints.tokenizer_files), and a copied
  `tokenizer_config.json` that names transformers 5's `TokenizersBackend` gets a class transformers 4 also loads.
- The source's word is kept (llama_tools.checkpoints.source_files): bos/eos/pad ids as onnxruntime-genai's model builder picks
  them (generation_config.json's, else config.json's; an eos list stays a list), generation_config.json byte for
  byte and its do_sample/temperature/top_k/top_p in `search`, the tokenizer files byte for byte, and the chat
  template in the form the source ships it. genai reads the template from tokenizer_config.json's `chat_template`
  or from chat_template.jinja beside it (`Tokenizer.apply_chat_template`); genai_config.json has no field for it
  (genai refuses the file: "model: Unknown value"), and the builder carries it in the tokenizer files too
  (save_pretrained). What the source does not say and a client needs (a pad id) is invented and listed in
  ClientFiles.invented.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_tools.outputs import files
from llama_tools.modeling.config import ModelConfig
from llama_tools.modeling.rope import context_length
from llama_tools.checkpoints.config_files import config_to_hf
from llama_tools.checkpoints.header_readers import json_object, open_regular
from llama_tools.checkpoints.source_files import (
    MAX_TOKENIZER_FILE_BYTES, SAMPLING_KEYS, TOP_K_WHEN_SAMPLING, SourceFiles, agreeing_ids,
    checked_tokenizer_config, read_bounded, read_source_files, template_of_config, tokenizer_files)
from llama_tools.checkpoints.tokenizer import JsonTokenizer, find_tokenizer, kind_of
from llama_tools.checkpoints.tokenizer_files import sentencepiece_files

GENAI_TYPE = "llama"  # genai's model type: picks its decoder-only pipeline; our I/O names are the same for every family


def switch_note(cfg: ModelConfig) -> str | None:
    """One line for a Phi-3 with longrope, whose transformers generate differs from onnxruntime-genai's at the switch."""
    s = cfg.rope_scaling
    if cfg.family != "phi3" or s is None or s.type != "longrope":
        return None
    # transformers 4.57's Phi3ForCausalLM.prepare_inputs_for_generation drops the cache when the sequence first
    # passes the original context and re-runs it whole, but with cache_position holding only the last position, so
    # that run's mask is one query row's: every token then sees every other. genai's type "phi3" re-runs it causally
    # at 4097 tokens (written into generators.cpp). Neither is the model's forward calls with a cache; "llama" keeps
    # the cache, as those do, and as `verify parity` checks.
    return (f"genai_config.json: onnxruntime-genai keeps the KV cache through longrope's switch at "
            f"{s.original_max_position_embeddings + 1} tokens (type {GENAI_TYPE}), as transformers' forward calls "
            f"with a cache do; transformers' Phi-3 generate re-runs the sequence there instead")


FILES = ("config.json", "generation_config.json", "genai_config.json")


@dataclass(frozen=True)
class ClientFiles:
    """What write_client_files wrote beside the graph."""

    directory: Path
    written: list[Path]
    tokenizer: str  # "converted from tokenizer.model", "copied tokenizer.json", or "none: ..."
    share_buffer: bool
    kept: list[Path] = field(default_factory=list)  # files there already that were not ours: left as they were
    invented: list[str] = field(default_factory=list)  # what the source does not say, and what was written instead
    warnings: list[str] = field(default_factory=list)  # source files left out (not valid), one line each


# --- The three JSON files -------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, source: SourceFiles | None = None) -> dict[str, Any]:
    """HF config.json: what Optimum (and transformers) read to build the model's I/O; ids as the source writes them."""
    return {**config_to_hf(cfg), **(agreeing_ids(source.config_ids, cfg) if source else {}), "use_cache": True}


def config_ids(cfg: ModelConfig) -> dict[str, Any]:
    """bos/eos/pad of the model config alone; pad is the eos id when it names none (LLaMA has no pad token)."""
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.eos_token_id if cfg.pad_token_id is None else cfg.pad_token_id}


def client_ids(cfg: ModelConfig, source: SourceFiles) -> tuple[dict[str, Any], list[str]]:
    """bos/eos/pad for clients, the builder's way (generation_config.json, config.json, cfg), and what was invented."""
    said = {**agreeing_ids(source.config_ids, cfg), **source.generation_ids}
    ids: dict[str, Any] = {}
    invented = []
    for key, default in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)):
        ids[key] = said.get(key, default)
        if key not in said and source.has_config:  # without a config.json, cfg (a preset, a GGUF) is the source
            invented.append(f"{key} = {default}: {source.folder}'s config.json and generation_config.json name none; "
                            f"llama-tools' default")
    pad = said.get("pad_token_id", cfg.pad_token_id)
    if pad is None:
        eos = ids["eos_token_id"]
        pad = eos[0] if isinstance(eos, list) else eos
        invented.append(f"pad_token_id = {pad}: the source names no pad id; its (first) eos id, as "
                        f"onnxruntime-genai's builder writes")
    ids["pad_token_id"] = pad
    return ids, invented


def generation_config(cfg: ModelConfig, ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy by default, as `llama-tools generate`: written only when the source has no generation_config.json."""
    return {**(ids or config_ids(cfg)), "do_sample": False, "max_length": cfg.max_position_embeddings}


def genai_config(cfg: ModelConfig, *, filename: str = "model.onnx", share_buffer: bool = False,
                 provider: str = "cpu", ids: dict[str, Any] | None = None,
                 sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """onnxruntime-genai's genai_config.json for a llama-tools graph (names from onnx_export.io_names)."""
    # ids: bos/eos/pad (eos may be a list), None: the config's. sampling: a generation_config.json, whose
    # do_sample/temperature/top_k/top_p go into `search` as onnxruntime-genai's builder puts them.
    if provider not in ("cpu", "cuda"):
        raise ValueError(f"unknown provider {provider!r} for genai_config.json; choose cpu or cuda")
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": [] if provider == "cpu" else [{"cuda": {}}]},
        "filename": filename,
        "head_size": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
    }
    # Fixed RoPE tables have max_position_embeddings rows: no position beyond them exists. dynamic NTK's are computed
    # from each pass's length, past it up to max_position_embeddings x factor (rope.context_length).
    context = context_length(cfg)
    search = {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
              "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
              "num_return_sequences": 1, "past_present_share_buffer": share_buffer,
              "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    sampling = sampling or {}
    search.update({k: sampling[k] for k in SAMPLING_KEYS if sampling.get(k) is not None})
    if search["do_sample"] and sampling.get("top_k") is None:  # top_k 1 would make "sampling" greedy
        search["top_k"] = TOP_K_WHEN_SAMPLING
    return {
        "model": {**(ids or config_ids(cfg)), "context_length": context, "decoder": decoder,
                  "type": GENAI_TYPE, "vocab_size": cfg.vocab_size},
        "search": search,
    }


# --- Tokenizer: sentencepiece tokenizer.model -> HF tokenizer.json ---------------------------------------

def sentencepiece_to_tokenizer_json(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) that encode exactly as the LLaMA sentencepiece model does."""
    made = sentencepiece_files(path)
    return json.loads(made["tokenizer.json"]), json.loads(made["tokenizer_config.json"])


# --- Writing ---------------------------------------------------------------------------------------------

MANIFEST = ".llama-tools-client-files.json"  # name -> sha256 of what we wrote: those files are ours to replace
MAX_MANIFEST_BYTES = 1 << 20  # a real one names a dozen files


@dataclass(frozen=True)
class ClientPlan:
    """The client files for a graph, planned and not yet written: what they will be, and each one's bytes."""

    files: ClientFiles
    data: dict[str, bytes]  # file name -> bytes, in the order they are renamed into place (the manifest last)


def _digest(path: Path) -> str | None:
    """sha256 of a regular file's bytes (a symlink's target's), read a block at a time; None for anything else."""
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open_regular(path) as f:  # a FIFO swapped in after the check never blocks
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _OwnedPlan:
    """Plans client files for a directory, never replacing a file that is not ours; nothing is written here.

    A file is ours when the manifest records its current bytes (we wrote it, nobody changed it since); a
    foreign file is kept and reported, unless it already holds exactly what we would write. A symlink, and the
    graph's own names, are never ours.
    """

    def __init__(self, out: Path, reserved: tuple[str, ...] = ()):
        self.out, self.reserved = out, reserved
        self.written: list[Path] = []
        self.kept: list[Path] = []
        self.data: dict[str, bytes] = {}
        try:
            manifest = json_object(read_bounded(out / MANIFEST, MAX_MANIFEST_BYTES), out / MANIFEST)
        except (OSError, ValueError):  # none yet, or not one of ours: nothing there is ours then
            manifest = {}
        self.manifest = {k: v for k, v in manifest.items() if isinstance(v, str)}

    def bytes(self, name: str, data: bytes) -> Path | None:
        path, digest = self.out / name, hashlib.sha256(data).hexdigest()
        if name in self.reserved or path.is_symlink():  # a link is the user's, even to a file holding DATA
            if name not in self.reserved and _digest(path) == digest:
                return None
            self.kept.append(path)
            return None
        if path.exists():
            current = _digest(path)
            if current != digest and (current is None or self.manifest.get(name) != current):
                self.kept.append(path)
                return None
        self.data[name] = data
        self.manifest[name] = digest
        self.written.append(path)
        return path

    def once(self, name: str, data: bytes) -> Path | None:
        """bytes(), unless the file there already holds DATA: never rewrite a file we read (same directory)."""
        if _digest(self.out / name) == hashlib.sha256(data).hexdigest():
            return None
        return self.bytes(name, data)

    def json(self, name: str, data: dict[str, Any]) -> Path | None:
        return self.bytes(name, (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))

    def close(self) -> None:
        self.data[MANIFEST] = (json.dumps(self.manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _static_kv(onnx_path: Path) -> int | None:
    """The graph's static KV buffer length (llama_tools.static_kv, written by exporters.fused), or None."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
    value = props.get("llama_tools.static_kv", "")
    return int(value) if value else None


def _writes_in_place(onnx_path: Path, layers: int) -> bool:
    """Whether every layer's cache goes through GroupQueryAttention, which writes the new slots into its past buffer
    when present is that very buffer (the fused graph, static or not); the plain graph's present is a Concat."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return sum(n.op_type == "GroupQueryAttention" for n in graph.node) == layers


def _tokenizer_of(path: Path) -> Path | None:
    """The tokenizer in a checkpoint directory, or PATH itself when it is one (a GGUF file); None otherwise."""
    found = find_tokenizer(path)
    return found if found is not None and (path.is_dir() or found == path) else None


def tokenizer_client_files(found: Path, cfg: ModelConfig) -> tuple[dict[str, bytes], str, list[str]]:
    """FOUND's files for clients (its kind makes them: tokenizer.KINDS), the source's other tokenizer files byte for
    byte, how they were made, and what was left out (warnings); a made tokenizer's special ids checked against CFG.

    Cheap to call twice (the made files are cached per file): `export` calls it in its checks, before any work.
    """
    kind = kind_of(found)
    warnings: list[str] = []
    made = kind.client_files(found)
    gguf = found.suffix.lower() == ".gguf"  # its folder's other files are not the model's
    if kind.cls is not JsonTokenizer:  # made here: its special ids must be the config's (a copy is the user's)
        tokenizer, config = json.loads(made["tokenizer.json"]), json.loads(made["tokenizer_config.json"])
        ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
        for key, piece in (("bos_token_id", config["bos_token"]), ("eos_token_id", config["eos_token"])):
            if piece is not None and ids.get(piece) != getattr(cfg, key):
                raise ValueError(f"{found}: {piece} is id {ids.get(piece)} but the model's config says "
                                 f"{key} = {getattr(cfg, key)}; fix config.json or the tokenizer")
        own, why = (None, None) if gguf else template_of_config(found.parent / "tokenizer_config.json")
        warnings += [why] if why else []
        if own is not None and config.get("chat_template") is None:  # the made config replaces one that had it
            made["tokenizer_config.json"] = (json.dumps({**config, "chat_template": own}, indent=2,
                                                        ensure_ascii=False) + "\n").encode("utf-8")
    if "tokenizer_config.json" in made:  # a template that does not parse is left out of it, with a warning
        made["tokenizer_config.json"], why = checked_tokenizer_config(
            made["tokenizer_config.json"], found if gguf else found.parent / "tokenizer_config.json")
        warnings += [why] if why else []
    if not gguf:
        beside, why = tokenizer_files(found.parent)
        warnings += why
        made.update({name: read_bounded(path, MAX_TOKENIZER_FILE_BYTES) for name, path in beside.items()
                     if name not in made})
    return made, kind.how, warnings


def _source_folder(source: str) -> Path | None:
    """The source's checkpoint directory or config file's folder; None for a preset or a GGUF file."""
    path = Path(source) if source else None
    if path is None or not path.is_absolute():  # export metadata records a path source absolutely
        return None
    if path.is_dir():
        return path
    return path.parent if path.suffix.lower() == ".json" and path.is_file() else None


def plan_client_files(onnx_path: str | Path, cfg: ModelConfig | None = None, *,
                      tokenizer_dir: str | Path | None = None, share_buffer: bool | None = None,
                      provider: str = "cpu", dest: str | Path | None = None) -> ClientPlan:
    """What write_client_files writes beside the graph at ONNX_PATH, planned; nothing is written.

    dest: where the graph will be (its directory gets the files, its name goes into genai_config.json) when it is
    still elsewhere (an export's scratch dir); None: ONNX_PATH itself.
    """
    onnx_path = Path(onnx_path)
    dest = onnx_path if dest is None else Path(dest)
    if not onnx_path.is_file():
        raise ValueError(f"{onnx_path}: no such ONNX file; export it first (llama-tools export onnx)")
    from .graph_meta import read_metadata

    meta = read_metadata(onnx_path)
    cfg = cfg or meta.config
    static = _static_kv(onnx_path)
    in_place = _writes_in_place(onnx_path, cfg.num_hidden_layers)
    if share_buffer is None:
        share_buffer = in_place
    if share_buffer and not in_place:
        raise ValueError(f"{onnx_path}: share_buffer=True needs the fused graph (export --optimize), whose "
                         f"GroupQueryAttention writes into its past buffer; this graph's present grows by "
                         f"concatenation, so onnxruntime-genai would reject present.0.key's shape. Leave share_buffer off")
    source = meta.source
    side = _source_folder(source)
    said = read_source_files(side, cfg.vocab_size)
    warnings = list(said.warnings)
    warnings += [note for note in [switch_note(cfg)] if note]
    ids, invented = client_ids(cfg, said)
    gconfig = genai_config(cfg, filename=dest.name, share_buffer=share_buffer, provider=provider, ids=ids,
                           sampling=said.generation)
    if static is not None:  # genai allocates past/present at max_length: the graph's buffer length
        # context_length too: genai then refuses a longer max_length in one line ("cannot be greater than model
        # context_length") instead of failing inside GroupQueryAttention on a present one slot too long.
        gconfig["search"]["max_length"] = gconfig["model"]["context_length"] = static
    if tokenizer_dir is not None:
        found = _tokenizer_of(Path(tokenizer_dir))
        if found is None:
            raise ValueError(f"{tokenizer_dir}: no tokenizer.json or tokenizer.model there; pass the checkpoint "
                             f"directory that holds the tokenizer (or its GGUF file), or leave tokenizer_dir out")
    else:
        found = _tokenizer_of(Path(source)) if source else None
    made, how = {}, "none: the source has no tokenizer (genai runs on ids)"
    if found is not None:  # made first: a tokenizer that cannot be made refuses before anything is planned
        made, how, why = tokenizer_client_files(found, cfg)
        warnings += why
    w = _OwnedPlan(dest.parent, reserved=(dest.name, dest.name + ".data"))
    w.json("config.json", hf_config(cfg, said))
    if said.generation_raw is not None:  # the source's own, byte for byte
        w.once("generation_config.json", said.generation_raw)
    else:
        w.json("generation_config.json", generation_config(cfg, ids))
        invented.append(f"generation_config.json: the source has none; written with the bos/eos/pad of "
                        f"genai_config.json, greedy (do_sample false), max_length {cfg.max_position_embeddings}")
    w.json("genai_config.json", gconfig)
    for name, data in made.items():
        w.once(name, data)
    w.close()
    clients = ClientFiles(w.out, w.written, how, share_buffer, kept=w.kept, invented=invented, warnings=warnings)
    return ClientPlan(clients, w.data)


def write_client_files(onnx_path: str | Path, cfg: ModelConfig | None = None, *,
                       tokenizer_dir: str | Path | None = None, share_buffer: bool | None = None,
                       provider: str = "cpu") -> ClientFiles:
    """Write config.json, generation_config.json, genai_config.json (+ tokenizer files) beside ONNX_PATH, all
    together or (on any failure, or a signal) none of them.

    cfg: None reads it from the graph's llama_tools.config metadata. tokenizer_dir: None looks in the graph's
    source when that is a directory (a checkpoint). share_buffer: None follows the graph (True for the fused graph:
    genai preallocates one buffer per layer as past and present, and decode copies no cache, as it does for the
    builder's graph); True on the plain graph is refused.
    """
    plan = plan_client_files(onnx_path, cfg, tokenizer_dir=tokenizer_dir, share_buffer=share_buffer,
                             provider=provider)
    with files.atomic_files([plan.files.directory / name for name in plan.data]) as tmp:
        for name, data in plan.data.items():
            (tmp / name).write_bytes(data)
    return plan.files
