"""Model configs from files: HF `config.json` and Meta `params.json` in, HF `config.json` out.

Every field read is type-checked here, so a bad file is one line naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from . import dtypes
from .config import ModelConfig, RopeScaling
from .formats import FORMATS
from .presets import get_preset

# HF `architectures` entry (or `model_type`) -> our family.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "MistralForCausalLM": "mistral", "mistral": "mistral",
    "MixtralForCausalLM": "mixtral", "mixtral": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "BaichuanForCausalLM": "baichuan", "BaiChuanForCausalLM": "baichuan", "baichuan": "baichuan",
    "InternLM2ForCausalLM": "internlm2", "internlm2": "internlm2",
}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or one ValueError line naming the file and what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); a config must be a JSON file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def _require(d: dict[str, Any], path: Path, *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ValueError(f"{path}: missing required field {keys[0]!r}")


def _as_int(v: Any, path: Path, field_name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{path}: field {field_name!r} must be an integer, got {v!r}")
    return int(v)


def _as_float(v: Any, path: Path, field_name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{path}: field {field_name!r} must be a finite number, got {v!r}")
    return float(v)


def _get(data: dict[str, Any], key: str, default: Any) -> Any:
    """data[key], with `default` when absent or null (HF writes null for "the default")."""
    v = data.get(key)
    return default if v is None else v


def _rope_scaling(raw: Any, path: Path) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: field 'rope_scaling' must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    return RopeScaling(
        type=str(kind), factor=_as_float(_get(raw, "factor", 1.0), path, "rope_scaling.factor"),
        low_freq_factor=_as_float(_get(raw, "low_freq_factor", 1.0), path, "rope_scaling.low_freq_factor"),
        high_freq_factor=_as_float(_get(raw, "high_freq_factor", 4.0), path, "rope_scaling.high_freq_factor"),
        original_max_position_embeddings=_as_int(_get(raw, "original_max_position_embeddings", 8192), path,
                                                 "rope_scaling.original_max_position_embeddings"),
    )


def config_from_hf(data: dict[str, Any], path: Path | str = "config.json") -> ModelConfig:
    """Read an HF `config.json` of a LLaMA-family model into a ModelConfig."""
    path = Path(path)
    archs = data.get("architectures") or []
    keys = list(archs) + [data.get("model_type")]
    family = next((_HF_ARCHITECTURES[k] for k in keys if k in _HF_ARCHITECTURES), None)
    if family is None:
        raise ValueError(f"{path}: unknown architecture {(archs or [data.get('model_type')])!r}; "
                         f"supported: {', '.join(sorted(k for k in _HF_ARCHITECTURES if k[0].isupper()))}")
    get = lambda *ks: _require(data, path, *ks)  # noqa: E731
    hidden = _as_int(get("hidden_size"), path, "hidden_size")
    heads = _as_int(get("num_attention_heads"), path, "num_attention_heads")
    kv = _as_int(data.get("num_key_value_heads") or heads, path, "num_key_value_heads")
    head_dim = data.get("head_dim")
    # Baichuan-13B and Baichuan2-13B use ALiBi; their config.json has no flag for it, so the 13B width
    # decides unless our own `position_embedding` key says otherwise.
    pe = str(data.get("position_embedding", "")).upper()
    alibi = pe == "ALIBI" or (family == "baichuan" and not pe and hidden == 5120)
    max_pos = data.get("max_position_embeddings") or data.get("model_max_length") or 2048
    kw: dict[str, Any] = dict(
        name=path.parent.name or path.stem, source=str(path), family=family,
        vocab_size=_as_int(get("vocab_size"), path, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_as_int(get("intermediate_size"), path, "intermediate_size"),
        num_hidden_layers=_as_int(get("num_hidden_layers"), path, "num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=_as_int(head_dim, path, "head_dim") if head_dim else 0,
        rms_norm_eps=_as_float(_get(data, "rms_norm_eps", 1e-6), path, "rms_norm_eps"),
        position_encoding="alibi" if alibi else "rope",
        # transformers >= 5 writes both under `rope_parameters` instead of top-level keys.
        rope_theta=_as_float(data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
                             path, "rope_theta"),
        rope_scaling=_rope_scaling(data.get("rope_scaling") or data.get("rope_parameters"), path),
        max_position_embeddings=_as_int(max_pos, path, "max_position_embeddings"),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(data.get("attention_bias", data.get("bias", False))),
        o_bias=bool(data.get("attention_bias", False)),
        mlp_bias=bool(data.get("mlp_bias", False)),
        # Baichuan2 (vocab 125696) normalizes lm_head rows; our own `norm_head` key overrides.
        norm_head=bool(data.get("norm_head", family == "baichuan" and data.get("vocab_size") == 125696)),
        sliding_window=data.get("sliding_window") if data.get("use_sliding_window", True) else None,
        bos_token_id=data.get("bos_token_id") if isinstance(data.get("bos_token_id"), int) else 1,
        eos_token_id=data.get("eos_token_id") if isinstance(data.get("eos_token_id"), int) else 2,
        torch_dtype=_stored_dtype(data.get("torch_dtype") or data.get("dtype")),
    )
    if family == "qwen2" and kw["sliding_window"] is not None and not data.get("use_sliding_window", False):
        kw["sliding_window"] = None
    if family == "mixtral" or data.get("num_local_experts"):
        kw["num_experts"] = _as_int(get("num_local_experts"), path, "num_local_experts")
        kw["num_experts_per_tok"] = _as_int(get("num_experts_per_tok"), path, "num_experts_per_tok")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if kw[k] <= 0:
            raise ValueError(f"{path}: field {k!r} must be positive, got {kw[k]}")
    if hidden % heads and not head_dim:
        raise ValueError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv:
        raise ValueError(f"{path}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv}")
    return ModelConfig(**kw)


def _stored_dtype(value: Any) -> str:
    """HF's torch_dtype ("bfloat16", "auto", absent) -> one of ours; unknown or absent means float32."""
    try:
        return dtypes.get(value).name
    except ValueError:
        return dtypes.FLOAT32.name


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's rule for n7: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_from_meta(data: dict[str, Any], path: Path | str = "params.json", vocab_size: int | None = None) -> ModelConfig:
    """Read Meta's `params.json` (dim, n_layers, n_heads, n_kv_heads, multiple_of, ...)."""
    path = Path(path)
    dim = _as_int(_require(data, path, "dim"), path, "dim")
    heads = _as_int(_require(data, path, "n_heads"), path, "n_heads")
    vocab = data.get("vocab_size", -1)
    if not isinstance(vocab, int) or vocab <= 0:
        if vocab_size is None:
            raise ValueError(f"{path}: field 'vocab_size' is {vocab!r}; pass the tokenizer's size or fix params.json")
        vocab = vocab_size
    scaling = RopeScaling("llama3", factor=8.0) if data.get("use_scaled_rope") else None
    multiple_of = _as_int(_get(data, "multiple_of", 256), path, "multiple_of")
    if multiple_of <= 0:
        raise ValueError(f"{path}: field 'multiple_of' must be a positive integer, got {multiple_of}")
    multiplier = data.get("ffn_dim_multiplier")
    if multiplier is not None and not _as_float(multiplier, path, "ffn_dim_multiplier") > 0:
        raise ValueError(f"{path}: field 'ffn_dim_multiplier' must be positive, got {multiplier!r}")
    return ModelConfig(
        name=path.parent.name or "meta", source=str(path), family="llama",
        vocab_size=vocab, hidden_size=dim,
        intermediate_size=ffn_hidden_size(dim, multiple_of, multiplier),
        num_hidden_layers=_as_int(_require(data, path, "n_layers"), path, "n_layers"),
        num_attention_heads=heads, num_key_value_heads=_as_int(_get(data, "n_kv_heads", heads), path, "n_kv_heads"),
        rms_norm_eps=_as_float(_get(data, "norm_eps", 1e-5), path, "norm_eps"),
        rope_theta=_as_float(_get(data, "rope_theta", 10000.0), path, "rope_theta"),
        rope_scaling=scaling, rope_layout=FORMATS["meta"].rope_layout,
        max_position_embeddings=_as_int(data.get("max_seq_len", 4096), path, "max_seq_len"),  # null: refused
    )


def load_config(source: str | Path) -> ModelConfig:
    """A preset name, a config.json / params.json path, or a directory holding one of them."""
    p = Path(source)
    if p.is_dir():
        for fname, reader in (("config.json", config_from_hf), ("params.json", config_from_meta)):
            if (p / fname).is_file():
                return reader(read_json(p / fname), p / fname)
        raise ValueError(f"{p}: directory has neither config.json nor params.json")
    if looks_like_path(str(source)):
        if not p.exists():
            raise ValueError(f"{p}: no such file or directory")
        if not p.is_file():
            raise ValueError(f"{p}: not a regular file; give a config.json, params.json or checkpoint directory")
        data = read_json(p)
        return config_from_meta(data, p) if "dim" in data and "hidden_size" not in data else config_from_hf(data, p)
    return get_preset(str(source))


def looks_like_path(arg: str) -> bool:
    """A MODEL argument meant as a file or directory (a separator, a leading dot, a .json), not a preset name."""
    return "/" in arg or arg.startswith(".") or arg.endswith(".json")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json that describes cfg (used by `convert` and the tests)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "baichuan": "BaichuanForCausalLM",
            "internlm2": "InternLM2ForCausalLM"}[cfg.family]
    d: dict[str, Any] = {
        "architectures": [arch], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": cfg.torch_dtype,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = {"rope_type": cfg.rope_scaling.type, **{
            k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if k != "type"}}
    if cfg.family == "llama":
        d["attention_bias"] = cfg.o_bias
        d["mlp_bias"] = cfg.mlp_bias
    if cfg.family == "mistral":
        d["sliding_window"] = cfg.sliding_window
    if cfg.family == "mixtral":
        d["num_local_experts"] = cfg.num_experts
        d["num_experts_per_tok"] = cfg.num_experts_per_tok
    if cfg.family == "baichuan":
        d["position_embedding"] = cfg.position_encoding.upper()
        d["norm_head"] = cfg.norm_head
    return d
