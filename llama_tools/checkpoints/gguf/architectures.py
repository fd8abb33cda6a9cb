"""The GGUF architectures read and written here: the family each is, how llama.cpp's converter stores it, and what
its sizes say of its tensors' shapes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ...modeling.config import SIZE_LIMITS
from ..formats import FORMATS, LLAMACPP_ROPE_TENSORS, CheckpointFormat
from ...modeling.rope_layouts import HALF

SUFFIX = ".gguf"
MAGIC = b"GGUF"
KIND = "gguf"  # WeightFiles.kind of a GGUF source
GGUF = FORMATS[KIND]


KEY, ALWAYS = "key", "always"  # GgufArchitecture.parallel


@dataclass(frozen=True)
class GgufArchitecture:
    """A general.architecture we read: the family it is, and how llama.cpp's converter stores it."""

    family: str
    rope_layout: str  # the q/k row order of its files
    gains_plus_one: bool = False  # norm gains stored as 1 + γ (Gemma's): γ is the stored value minus 1
    swa_pattern: int = 0  # llama.cpp's sliding-window pattern when the file names none: n - 1 local, 1 global
    swa_base: float | None = None  # the local layers' RoPE base when the file names none (llama.cpp's default)
    big_layers: int = 0  # the block count of the size that scales queries by n2 / n5, not n6 (Gemma 2/3 27B)
    caps_attention: bool = False  # llama.cpp soft-caps attention scores by {arch}.attn_logit_softcapping
    # llama.cpp's (attention, final logit) soft-caps when the file names none; None: no cap (Gemma 2 always caps)
    default_caps: tuple[float | None, float | None] = (None, None)
    no_rope_every: int = 0  # llama.cpp leaves layer j without RoPE when (j + 1) % this == 0 (no key says so)
    fused_qkv: bool = False  # q/k/v as one attn_qkv, rows cat(q, k, v) (Phi-3's; GPT-NeoX's and Falcon's regrouped)
    fused_gate_up: bool = False  # Phi-3's: gate and up as one ffn_up (gate first)
    # llama.cpp rotates the first {arch}.rope.dimension_count channels of each head (its n_rot) and passes the rest
    # through, as transformers' partial rotary does (Phi-4-mini); False: it refuses a width other than the head's
    # (llama-model.cpp: "invalid n_rot" for llama), or the family computes whole heads only.
    partial_rotary: bool = False
    # How llama.cpp runs attention and the FFN: None in sequence; KEY as {arch}.use_parallel_residual says (gptneox);
    # ALWAYS in parallel, from attn_norm alone or, where attn_norm_2 is stored, attention from that (falcon).
    parallel: str | None = None
    # The Linears' biases: None, whichever the file holds; True, llama.cpp loads every one (q/k/v, output, FFN)
    # and refuses a file without; False, it loads none (a file holding one is refused for a tensor too many).
    biases: bool | None = None
    untied_output: bool = False  # llama.cpp loads output.weight and cannot take the embedding's place (gptneox)
    moe: bool = False  # experts in every layer, expert_feed_forward_length wide (qwen3moe): no dense form
    # longrope as llama.cpp keeps it (Phi-3-mini-128K, Phi-4-mini): the factors as ROPE_FACTORS tensors,
    # {arch}.rope.scaling.original_context_length and attn_factor, no scaling type key (convert_hf_to_gguf.py)
    longrope: bool = False


# llama.cpp writes Mistral as "llama" and permutes its q/k rows to Meta's interleaved order (its rope type NORM);
# the others keep HF's rows (rope type NEOX: the two halves); biases and q/k norms are found by tensor names.
# Gemma's converter adds 1 to every norm gain, and llama.cpp fixes what the files leave out (the window pattern,
# the local base, the query scale, Gemma 2's caps) by architecture and size: so do we (src/models/gemma*.cpp).
ARCHITECTURES = {"llama": GgufArchitecture("llama", GGUF.rope_layout),
                 "qwen2": GgufArchitecture("qwen2", HALF),
                 "qwen3": GgufArchitecture("qwen3", HALF),
                 "gemma": GgufArchitecture("gemma", HALF, gains_plus_one=True),
                 "gemma2": GgufArchitecture("gemma2", HALF, gains_plus_one=True, swa_pattern=2, big_layers=46,
                                            caps_attention=True, default_caps=(50.0, 30.0)),
                 "gemma3": GgufArchitecture("gemma3", HALF, gains_plus_one=True, swa_pattern=6, swa_base=10000.0,
                                            big_layers=62),
                 # Llama's block and rows (llama.cpp's converters derive both from its LlamaModel); Granite's four
                 # multipliers as granite.* keys; SmolLM3's layers without RoPE fixed by llama.cpp at every 4th.
                 "granite": GgufArchitecture("granite", GGUF.rope_layout),
                 "smollm3": GgufArchitecture("smollm3", GGUF.rope_layout, no_rope_every=4),
                 # HF's rows (rope type NEOX); its norms after attention and the FFN as Gemma 2/3's are named
                 "olmo2": GgufArchitecture("olmo2", HALF),
                 # HF's rows; gate_up_proj kept whole as ffn_up (llama.cpp's SwiGLU splits it: gate, then up)
                 # partial rotary: convert_hf_to_gguf writes int(partial_rotary_factor x n2) // n5 as
                 # phi3.rope.dimension_count, and llama.cpp's phi3 turns that many channels (NEOX pairs within them)
                 "phi3": GgufArchitecture("phi3", HALF, fused_qkv=True, fused_gate_up=True, partial_rotary=True,
                                          longrope=True),
                 # LayerNorms with β, a GELU FFN without gate, HF's rows (rope type NEOX). The converters regroup
                 # query_key_value as cat(q, k, v): GPT-NeoX's rows per head [q_h, k_h, v_h], Falcon's per KV group
                 # [its q heads, k, v]. gptneox: rope.dimension_count (Pythia's rotary_pct) and use_parallel_residual
                 # read, every bias required; falcon: no biases, whole-head RoPE, always parallel.
                 "gptneox": GgufArchitecture("gpt_neox", HALF, fused_qkv=True, partial_rotary=True, parallel=KEY,
                                             biases=True, untied_output=True),
                 "falcon": GgufArchitecture("falcon", HALF, fused_qkv=True, parallel=ALWAYS, biases=False),
                 # Qwen3's attention, routed experts (router ffn_gate_inp, stacked ffn_*_exps) in every layer
                 "qwen3moe": GgufArchitecture("qwen3_moe", HALF, moe=True)}
# Granite's multipliers: ModelConfig field -> the <arch>.* key llama.cpp reads it from (llama.cpp's names).
GRANITE_KEYS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
LAYER = re.compile(r"^blk\.(\d+)\.")

# What a modelled architecture's sizes say of its tensors' shapes, in GGML order (ne[0]: a row's width, torch's last
# axis): tensor name (blk.N. taken off) -> the size key of each axis.
SHAPES = {"token_embd.weight": ("hidden", "vocab"), "output.weight": ("hidden", "vocab"),
          "output_norm.weight": ("hidden",), "attn_norm.weight": ("hidden",), "ffn_norm.weight": ("hidden",),
          "attn_q.weight": ("hidden", "q"), "attn_k.weight": ("hidden", "kv"), "attn_v.weight": ("hidden", "kv"),
          "attn_output.weight": ("q", "hidden"), "ffn_gate.weight": ("hidden", "ffn"),
          "ffn_up.weight": ("hidden", "ffn"), "ffn_down.weight": ("ffn", "hidden"),
          # Mixtral (written as llama): the router, and each projection's experts stacked on the last GGML axis
          "ffn_gate_inp.weight": ("hidden", "experts"), "ffn_gate_exps.weight": ("hidden", "expert_ffn", "experts"),
          "ffn_up_exps.weight": ("hidden", "expert_ffn", "experts"),
          "ffn_down_exps.weight": ("expert_ffn", "hidden", "experts")}
# Fused tensors: attn_qkv holds q, k and v (fused_qkv), Phi-3's ffn_up gate and up (fused_gate_up).
FUSED_QKV_SHAPES = {"attn_qkv.weight": ("hidden", "qkv")}
FUSED_GATE_UP_SHAPES = {"ffn_up.weight": ("hidden", "2ffn")}
# Tensors that exist only in a mixture-of-experts layer: a file holding one must say {arch}.expert_count.
EXPERT_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
MAX_EXPERTS = SIZE_LIMITS["num_local_experts"]  # as a config.json may say: every expert is listed by name
# (layer, expert) pairs a file may hold, each three matrices listed by name: DeepSeek-V3 has 58 x 256 = 14,848,
# Qwen3-Next 48 x 512 = 24,576; Mixtral 8x22B 56 x 8.
MAX_EXPERT_SLICES = 2**17
# Families whose mixture-of-experts form a GGUF architecture holds: llama.cpp writes Mixtral as 'llama'.
MOE_FAMILY = {"llama": "mixtral"}
# Families llama.cpp's converter writes under another family's architecture, read back as that family: Mistral is
# Llama's block (its window, if any, kept as llama.attention.sliding_window, which llama.cpp does not apply).
WRITTEN_AS = {"mistral": "llama"}
ROPE_FREQS = LLAMACPP_ROPE_TENSORS["freqs"]  # llama.cpp's per-dimension RoPE divisors (Llama 3's 'llama3' scaling)
# longrope's factors, one per rotated pair (F32): llama.cpp divides each pair's frequency by the long ones when its
# context (n_ctx per sequence) is over rope.scaling.original_context_length, else by the short ones
ROPE_FACTORS = {key: LLAMACPP_ROPE_TENSORS[key] for key in ("long_factor", "short_factor")}
ROPE_TENSORS = (ROPE_FREQS, *ROPE_FACTORS.values())  # read into the config's RoPE scaling, never as weights
LLAMA3_ARCHITECTURES = ("llama",)  # those whose rope_freqs.weight llama.cpp applies (and its converter writes)

# Before llama.cpp stacked them (2024), its converter wrote each of Mixtral's experts as tensors of their own:
# blk.N.ffn_gate.E.weight, ffn_up.E, ffn_down.E (llama.cpp still reads them). Each is named by a rename of its own
# (experts x tensors string replacements), so at most this many experts are read in that form: Mixtral has 8.
MAX_PER_EXPERT = 64
_PROJECTIONS = (("w1", "gate"), ("w3", "up"), ("w2", "down"))


# Falcon's two norms (new_decoder_architecture) as its converter names them: ln_attn (our input_layernorm, read by
# attention) is attn_norm_2, ln_mlp (our post_attention_layernorm, read by the FFN) is attn_norm, as one norm is.
_FALCON_NORMS = (("input_layernorm.", "attn_norm_2."), ("post_attention_layernorm.", "attn_norm."))
# Qwen3-MoE's file names (families.QWEN3_MOE): the router mlp.gate, each projection's experts stacked
_QWEN3_MOE_NAMES = (("mlp.gate.", "ffn_gate_inp."), ("mlp.experts.0.gate_proj.", "ffn_gate_exps."),
                    ("mlp.experts.0.up_proj.", "ffn_up_exps."), ("mlp.experts.0.down_proj.", "ffn_down_exps."))


def _format(a: GgufArchitecture) -> CheckpointFormat:
    """GGUF's names and fusions for one architecture."""
    fmt = GGUF
    if a.fused_qkv:
        fmt = dataclasses.replace(fmt, fused_qkv="concat", fused_name="attn_qkv.weight")
    if a.fused_gate_up:
        fmt = dataclasses.replace(fmt, fused_gate_up=("ffn_gate.", "ffn_up."))
    if a.parallel == ALWAYS:
        fmt = dataclasses.replace(fmt, parallel_renames=_FALCON_NORMS)
    if a.moe:
        fmt = dataclasses.replace(fmt, renames=_QWEN3_MOE_NAMES + fmt.renames)
    return fmt


_FORMATS = {name: _format(a) for name, a in ARCHITECTURES.items()}


def gguf_format(arch: str) -> CheckpointFormat:
    """The GGUF format of a file of this architecture (its fused q/k/v and gate/up, its norms' and experts' names)."""
    return _FORMATS[arch]


def per_expert_format(experts: int) -> CheckpointFormat:
    """GGUF's format for a file of per-expert tensors (blk.N.ffn_gate.E.weight), EXPERTS at most MAX_PER_EXPERT."""
    assert experts <= MAX_PER_EXPERT, "bounded by the caller"
    stacked = tuple(f"ffn_{proj}_exps." for _, proj in _PROJECTIONS)
    return dataclasses.replace(GGUF, stacked_experts=False, renames=tuple(
        r for r in GGUF.renames if r[1] not in stacked) + tuple(
        (f"block_sparse_moe.experts.{e}.{w}.", f"ffn_{proj}.{e}.") for e in range(experts) for w, proj in _PROJECTIONS))
