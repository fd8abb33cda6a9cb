"""Model configs from files: HF `config.json` and Meta `params.json` in, HF `config.json` out.

Every field read is type-checked here, so a bad file is one line naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..modeling import dtypes
from ..modeling.config import INT64_MAX, LAYER_LIST_LIMIT, ROPE_FACTOR_LIMIT, SIZE_LIMITS, ModelConfig, RopeScaling
from ..modeling.families import FAMILIES, FULL, HF_NAMES, ROPE_KEYS, ROPE_TYPE_KEYS, SLIDING, UNMODELLED_KEYS
from ..modeling.rope import (PARTIAL_ROTARY_KEYS, SUPPORTED_SCALING, check_partial_rotary, longrope_attention_factor,
                             partial_rotary_factor, yarn_attention_factor)
from .formats import FORMATS
from .header_readers import MAX_HEADER_BYTES, json_object, open_regular, real_path
from ..modeling.presets import get_preset

# HF `architectures` entry (or `model_type`) -> our family.
# config.json `architectures` / `model_type` -> family (families.py is the one registry).
_HF_ARCHITECTURES = HF_NAMES
# HF's `hidden_act` / `hidden_activation` names -> ours (Gemma 1's legacy "gelu" runs as tanh-GELU in HF too).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class UnknownArchitecture(ValueError):
    """A config.json of an architecture no family here models (count-params may still count it elsewhere)."""

    def __init__(self, message: str, data: dict[str, Any], path: Path):
        super().__init__(message)
        self.data, self.path = data, path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file of bounded size, or one ValueError line naming the file and what is wrong."""
    with open_regular(path) as f:  # a FIFO or device named config.json never blocks
        # Sized by the file (read(n) allocates n up front): a 2 kB config takes 2 kB, a growing one is still cut off.
        raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_HEADER_BYTES) + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: over {MAX_HEADER_BYTES} bytes: not a config or index file")
    return json_object(raw, path)


def is_config_file(path: Path) -> bool:
    """Whether a config file is there: a symlink loop or a dangling link by that name is one error line, not absence."""
    if os.path.islink(path):
        real_path(path)
    return path.is_file()


def _require(d: dict[str, Any], path: Path, *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ValueError(f"{path}: missing required field {keys[0]!r}")


def _got(v: Any) -> str:
    """A value as the error shows it: its JSON text and type, bounded."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    text = json.dumps(v) if isinstance(v, (bool, int, float, str, list, dict, type(None))) else repr(v)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


# Meta's params.json keys (and HF's aliases) -> the SIZE_LIMITS entry that bounds them.
_LIMIT_OF = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
             "n_kv_heads": "num_key_value_heads", "max_seq_len": "max_position_embeddings",
             "model_max_length": "max_position_embeddings", "_sliding_window_pattern": "sliding_window_pattern",
             "bos_token_id": "token_id", "eos_token_id": "token_id", "pad_token_id": "token_id",
             "num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"}


def size_limit(field_name: str) -> int:
    """The SIZE_LIMITS bound of a field as a file or an error names it ("n_layers", "rope_scaling.factor[0]")."""
    key = field_name.rsplit(".", 1)[-1].split("[")[0]
    return SIZE_LIMITS.get(_LIMIT_OF.get(key, key), INT64_MAX)


# Integers must be JSON integers: HF writes them so, and transformers' own modules fail on 4096.0; a float
# accepted here would also be rounded past 2^53 on the way, which no count may be.
def _as_int(v: Any, path: Path, field_name: str, minimum: int | None = 1) -> int:
    if type(v) is not int:
        raise ValueError(f"{path}: field {field_name!r} must be an integer, got {_got(v)}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{path}: field {field_name!r} must be an integer >= {minimum}, got {v}")
    if v > INT64_MAX:
        raise ValueError(f"{path}: field {field_name!r} is {len(str(v))} digits; a size must fit in 64 bits "
                         f"(<= {INT64_MAX})")
    limit = size_limit(field_name)
    if v > limit:
        raise ValueError(f"{path}: field {field_name!r} is {v:,}, over the {limit:,} llama-tools reads (far past "
                         f"any published model); fix the config")
    return v


def _as_float(v: Any, path: Path, field_name: str, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{path}: field {field_name!r} must be a finite number, got {_got(v)}")
    if positive and not v > 0:
        raise ValueError(f"{path}: field {field_name!r} must be a number > 0, got {v!r}")
    return float(v)


def _as_bool(v: Any, path: Path, field_name: str) -> bool:
    """A JSON boolean: "false" (a string) is an error, not a truthy value."""
    if not isinstance(v, bool):
        raise ValueError(f"{path}: field {field_name!r} must be true or false (a JSON boolean), got {_got(v)}")
    return v


def _as_str(v: Any, path: Path, field_name: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{path}: field {field_name!r} must be a string, got {_got(v)}")
    return v


def _get(data: dict[str, Any], key: str, default: Any) -> Any:
    """data[key], with `default` when absent or null (HF writes null for "the default")."""
    v = data.get(key)
    return default if v is None else v


def _token_id(data: dict[str, Any], path: Path, key: str, default: int) -> int:
    """bos/eos: an id, null (the default), or a list of ids (Llama 3's eos) whose first is taken."""
    v = data.get(key)
    if v is None:
        return default
    if isinstance(v, list) and v:  # every id typed and bounded, though only the first is used
        return [_as_int(x, path, f"{key}[{i}]", minimum=0) for i, x in enumerate(v)][0]
    return _as_int(v, path, key, minimum=0)


def _factor(v: Any, path: Path, field_name: str) -> float:
    """A rope_scaling factor: a finite number in (0, ROPE_FACTOR_LIMIT]."""
    x = _as_float(v, path, field_name)
    if x > ROPE_FACTOR_LIMIT:
        raise ValueError(f"{path}: field {field_name!r} is {x:g}, over the {ROPE_FACTOR_LIMIT:g} llama-tools reads "
                         f"(published scalings use at most 40); fix the config")
    return x


def _rope_scaling(raw: Any, path: Path, where: str = "rope_scaling", max_pos: int = 2048,
                  top_original: int | None = None) -> RopeScaling | None:
    """One RoPE scaling, transformers' defaults resolved into it (yarn's and longrope's attention factor and
    original context, yarn's betas), so that the model reads every number it computes with from RopeScaling.

    max_pos: the config's max_position_embeddings; top_original: its top-level original_max_position_embeddings
    (where transformers 4.57's longrope reads it, Phi-3's layout)."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: field {where!r} must be an object or null, got {_got(raw)}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind is None or kind == "default":
        _no_unread_rope_keys(raw, path, where, "default")
        return None
    kind = _as_str(kind, path, f"{where}.rope_type")
    if kind in SUPPORTED_SCALING:  # a variant the model does not compute is refused where a model is built
        _no_unread_rope_keys(raw, path, where, kind)
    f = lambda key, default: _factor(_get(raw, key, default), path, f"{where}.{key}")  # noqa: E731
    inner = None if raw.get("original_max_position_embeddings") is None else _as_int(
        raw["original_max_position_embeddings"], path, f"{where}.original_max_position_embeddings")
    extra: dict[str, Any] = {}
    original = inner if inner is not None else 8192
    factor = f("factor", 1.0)
    if kind == "yarn":
        original = inner if inner is not None else max_pos  # transformers: the config's context when unsaid
        number = lambda key, default: default if raw.get(key) is None else _as_float(  # noqa: E731
            raw[key], path, f"{where}.{key}")
        mscale, mscale_all_dim = number("mscale", None), number("mscale_all_dim", None)
        attention = number("attention_factor", None)
        extra = dict(attention_factor=yarn_attention_factor(factor, mscale, mscale_all_dim) if attention is None
                     else attention, beta_fast=number("beta_fast", 0.0) or 32.0,
                     beta_slow=number("beta_slow", 0.0) or 1.0,
                     truncate=_as_bool(_get(raw, "truncate", True), path, f"{where}.truncate"))
    elif kind == "dynamic":
        # transformers 4.57 grows the base past config.max_position_embeddings and reads no other length
        if inner is not None and inner != max_pos:
            raise ValueError(f"{path}: field '{where}.original_max_position_embeddings' ({inner}) differs from "
                             f"max_position_embeddings ({max_pos}); transformers 4.57's dynamic scaling reads the "
                             f"latter, later versions may read the former: make them agree")
        original = max_pos
    elif kind == "longrope":
        if top_original is not None and inner is not None and top_original != inner:
            raise ValueError(f"{path}: fields 'original_max_position_embeddings' ({top_original}) and "
                             f"'{where}.original_max_position_embeddings' ({inner}) disagree; keep one")
        given = top_original if top_original is not None else inner
        original = given if given is not None else max_pos
        if given is not None:  # transformers: the factor is the ratio of the two contexts then
            factor = max_pos / given
        lists = {}
        for key in ("short_factor", "long_factor"):
            v = raw.get(key)
            if not isinstance(v, list) or not v:
                raise ValueError(f"{path}: field '{where}.{key}' must be a list of numbers for longrope scaling, "
                                 f"got {_got(v)}")
            lists[key] = tuple(_factor(x, path, f"{where}.{key}[{i}]") for i, x in enumerate(v))
        attention = raw.get("attention_factor")
        extra = dict(lists, attention_factor=longrope_attention_factor(factor, original) if attention is None
                     else _as_float(attention, path, f"{where}.attention_factor"))
    scaling = RopeScaling(
        type=kind, factor=factor, low_freq_factor=f("low_freq_factor", 1.0),
        high_freq_factor=f("high_freq_factor", 4.0), original_max_position_embeddings=original, **extra)
    if kind == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor:
        raise ValueError(f"{path}: field '{where}.high_freq_factor' ({scaling.high_freq_factor}) must be greater "
                         f"than low_freq_factor ({scaling.low_freq_factor}) for llama3 scaling")
    return scaling


def _no_unread_rope_keys(raw: dict[str, Any], path: Path, where: str, kind: str) -> None:
    """Refuse a RoPE parameter the model would not read (yarn's betas on a linear scaling, a partial rotary, ...)."""
    known = ROPE_KEYS | ROPE_TYPE_KEYS.get(kind, frozenset())
    for key, value in raw.items():
        if key not in known and value is not None and not UNMODELLED_KEYS.get(key, lambda v: False)(value):
            raise ValueError(f"{path}: field '{where}.{key}' ({_got(value)}) changes RoPE and llama-tools does not "
                             f"read it; it would compute another model, so it refuses the config")


def _rope_entry(raw: Any, path: Path, where: str, theta: float, max_pos: int = 2048,
                top_original: int | None = None) -> tuple[float, RopeScaling | None]:
    """One set of RoPE parameters (5.x `rope_parameters`, or one layer type's entry): its base and scaling."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: field {where!r} must be an object, got {_got(raw)}")
    base = _as_float(_get(raw, "rope_theta", theta), path, f"{where}.rope_theta")
    return base, _rope_scaling(raw, path, where, max_pos, top_original)


def _rope(data: dict[str, Any], path: Path, family: str,
          max_pos: int = 2048) -> tuple[float, RopeScaling | None, float | None]:
    """RoPE's base, scaling and sliding layers' base, from either layout transformers has written.

    4.x: top-level rope_theta, rope_scaling and (Gemma 3) rope_local_base_freq. 5.x: `rope_parameters`, flat
    or one entry per layer type ({"full_attention": {...}, "sliding_attention": {...}}). Both at once must agree.
    """
    keys = FAMILIES[family].hf_keys
    default_theta = keys.get("rope_theta", 10000.0)
    theta = _as_float(_get(data, "rope_theta", default_theta), path, "rope_theta")
    top = None if data.get("original_max_position_embeddings") is None else _as_int(
        data["original_max_position_embeddings"], path, "original_max_position_embeddings")
    scaling = _rope_scaling(data.get("rope_scaling"), path, "rope_scaling", max_pos, top)
    local = None
    if "rope_local_base_freq" in keys:
        local = _as_float(_get(data, "rope_local_base_freq", keys["rope_local_base_freq"]), path,
                          "rope_local_base_freq")
    params = data.get("rope_parameters")
    if params is None:
        return theta, scaling, local
    if not isinstance(params, dict):
        raise ValueError(f"{path}: field 'rope_parameters' must be an object, got {_got(params)}")
    if _partial_rotary_key(family):  # 5.x keeps partial_rotary_factor here: read by _rotary_dim, not a scaling's
        params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    if params and set(params) <= {FULL, SLIDING}:  # one entry per layer type
        if "layer_types" not in keys:
            raise ValueError(f"{path}: field 'rope_parameters' gives RoPE per layer type, and a {family} model's "
                             f"layers are all of one type; give one set of parameters")
        if FULL in params:
            new_theta, new_scaling = _rope_entry(params[FULL], path, f"rope_parameters.{FULL}", default_theta,
                                                 max_pos, top)
        else:  # every layer slides: the sliding entry is the only RoPE there is
            new_theta, new_scaling = _rope_entry(params[SLIDING], path, f"rope_parameters.{SLIDING}", default_theta,
                                                 max_pos, top)
        if SLIDING in params:
            local, local_scaling = _rope_entry(params[SLIDING], path, f"rope_parameters.{SLIDING}",
                                               keys.get("rope_local_base_freq", default_theta))
            if local_scaling is not None:
                raise ValueError(f"{path}: field 'rope_parameters.{SLIDING}.rope_type' is {local_scaling.type!r}; "
                                 f"llama-tools scales the RoPE of full-attention layers only")
    else:
        new_theta, new_scaling = _rope_entry(params, path, "rope_parameters", default_theta, max_pos, top)
    for key, old, new in (("rope_theta", theta, new_theta), ("rope_scaling", scaling, new_scaling)):
        if data.get(key) is not None and old != new:
            raise ValueError(f"{path}: fields {key!r} and 'rope_parameters' disagree ({old!r} against {new!r}); "
                             f"keep the one the model was trained with")
    return new_theta, new_scaling, local


def hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
    """cfg's rope_scaling as transformers reads it: each type's own keys, defaults written out."""
    s = cfg.rope_scaling
    assert s is not None
    keys = {"linear": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "dynamic": ("factor",),
            "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                     "truncate"),
            "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor",
                         "long_factor")}.get(s.type, ("factor", "low_freq_factor", "high_freq_factor",
                                                      "original_max_position_embeddings"))
    out: dict[str, Any] = {"rope_type": s.type}
    for k in keys:
        v = getattr(s, k)
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _activation(data: dict[str, Any], path: Path, family: str) -> str:
    """The FFN gate's activation, from `hidden_activation` (Gemma) or `hidden_act`."""
    keys = FAMILIES[family].hf_keys
    key = "hidden_activation" if "hidden_activation" in keys and _get(
        data, "hidden_activation", keys["hidden_activation"]) is not None else "activation" if "activation" in keys \
        else "hidden_act"  # Falcon's key: activation
    name = _as_str(_get(data, key, keys.get(key, "silu")), path, key)
    if name == "gelu" and family.startswith("gemma"):
        return "gelu_tanh"
    if name == "gelu" and FAMILIES[family].defaults.get("gated_mlp") is False:
        return "gelu"  # GPT-NeoX, Falcon: exact GELU (transformers' GELUActivation) in a plain MLP
    if name not in _ACTIVATIONS:
        raise ValueError(f"{path}: field {key!r} is {name!r}; the model computes {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def _listed_layer_types(data: dict[str, Any], path: Path, layers: int) -> tuple[str, ...] | None:
    """The file's `layer_types`, checked whether or not a window uses it (its length first, before any element)."""
    raw = data.get("layer_types")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != layers or any(t not in (SLIDING, FULL) for t in raw):
        got = f"a list of {len(raw):,}" if isinstance(raw, list) else _got(raw)
        raise ValueError(f"{path}: field 'layer_types' must list {SLIDING!r} or {FULL!r} for each of the "
                         f"{layers:,} layers, got {got}")
    return tuple(raw)


def _layer_types(data: dict[str, Any], path: Path, family: str, layers: int) -> tuple[str, ...] | None:
    """Which layers slide: the file's `layer_types`, else Qwen's max_window_layers (the first that many full),
    else Gemma's pattern (2: alternate, 3: 5 of 6), else None (every layer)."""
    keys = FAMILIES[family].hf_keys
    listed = _listed_layer_types(data, path, layers) if "layer_types" in keys else None
    if listed is not None:
        return listed
    if "max_window_layers" in keys:
        first = _as_int(_get(data, "max_window_layers", keys["max_window_layers"]), path, "max_window_layers", 0)
        if layers > LAYER_LIST_LIMIT:
            raise ValueError(f"{path}: field 'num_hidden_layers' is {layers:,}; a {family} config's sliding and "
                             f"full layers are listed one by one, at most {LAYER_LIST_LIMIT:,}")
        return tuple(SLIDING if j >= first else FULL for j in range(layers))
    if "no_rope_layers" in keys:  # SmolLM3's config: the layers without RoPE are the sliding ones
        rotates = _rope_layers(data, path, layers)
        return tuple(FULL if r else SLIDING for r in rotates)
    pattern = {"gemma2": 2, "gemma3": None}.get(family, 0)
    if pattern is None:  # Gemma 3's configs name it with or without a leading underscore
        key = "sliding_window_pattern" if data.get("sliding_window_pattern") is not None else "_sliding_window_pattern"
        pattern = _as_int(_get(data, key, 6), path, key)
    if pattern and layers > LAYER_LIST_LIMIT:  # the pattern is listed per layer: bounded before it is built
        raise ValueError(f"{path}: field 'num_hidden_layers' is {layers:,}; a {family} config's sliding and full "
                         f"layers are listed one by one, at most {LAYER_LIST_LIMIT:,} (published: 62)")
    return tuple(SLIDING if (j + 1) % pattern else FULL for j in range(layers)) if pattern else None


def _rope_layers(data: dict[str, Any], path: Path, layers: int) -> tuple[bool, ...]:
    """SmolLM3's `no_rope_layers` (1: the layer rotates, 0: it does not), or every no_rope_layer_interval-th layer
    without (transformers' default); listed per layer, so bounded first."""
    if layers > LAYER_LIST_LIMIT:
        raise ValueError(f"{path}: field 'num_hidden_layers' is {layers:,}; a smollm3 config's layers with and "
                         f"without RoPE are listed one by one, at most {LAYER_LIST_LIMIT:,} (published: 36)")
    raw = data.get("no_rope_layers")
    if raw is None:
        every = _as_int(_get(data, "no_rope_layer_interval", 4), path, "no_rope_layer_interval")
        return tuple((j + 1) % every != 0 for j in range(layers))
    if not isinstance(raw, list) or len(raw) != layers or any(type(x) is not int or x not in (0, 1) for x in raw):
        got = f"a list of {len(raw):,}" if isinstance(raw, list) else _got(raw)
        raise ValueError(f"{path}: field 'no_rope_layers' must list 1 (RoPE) or 0 (none) for each of the {layers:,} "
                         f"layers, got {got}")
    return tuple(bool(x) for x in raw)


def _partial_rotary_key(family: str) -> str | None:
    """The config.json key that says the rotary width, when the family's transformers code reads one (Phi-3's
    partial_rotary_factor); None: whole heads rotate, and a factor below 1 is refused (UNMODELLED_KEYS)."""
    return next((k for k in PARTIAL_ROTARY_KEYS if k in FAMILIES[family].hf_keys), None)


def _rotary_dim(data: dict[str, Any], path: Path, family: str, head_dim: int) -> int:
    """The rotary width int(n6 x factor) of a family that reads partial rotary (0 for the others: all of n6), the
    factor from its top-level key (4.x) or rope_parameters.partial_rotary_factor (5.x); they must agree."""
    key = _partial_rotary_key(family)
    if key is None:
        return 0
    factor = data[key] if key in data else FAMILIES[family].hf_keys[key]
    params = data.get("rope_parameters")
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if inner is not None:
        if data.get(key) is not None and data[key] != inner:
            raise ValueError(f"{path}: fields {key!r} ({_got(data[key])}) and 'rope_parameters.partial_rotary_factor' "
                             f"({_got(inner)}) disagree; keep the one the model was trained with")
        factor, key = inner, "rope_parameters.partial_rotary_factor"
    return check_partial_rotary(factor, head_dim, str(path), key)


def _check_head_width(hidden: int, heads: int, path: Path, keys: tuple[str, str]) -> None:
    """n6 = n2 / n5 when the file gives no head_dim: held to head_dim's bound too, naming the fields it comes from."""
    limit = SIZE_LIMITS["head_dim"]
    if hidden // heads > limit:
        raise ValueError(f"{path}: fields {keys[0]!r} {hidden:,} / {keys[1]!r} {heads:,} give heads {hidden // heads:,} "
                         f"wide, over the {limit:,} llama-tools reads; fix the config or give head_dim")


def _optional_float(data: dict[str, Any], path: Path, key: str) -> float | None:
    return None if data.get(key) is None else _as_float(data[key], path, key)


def _family(data: dict[str, Any], path: Path) -> str:
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{path}: field 'architectures' must be a list of strings, got {_got(archs)}")
    model_type = data.get("model_type")
    if model_type is not None:
        _as_str(model_type, path, "model_type")
    keys = list(archs or []) + [model_type]
    family = next((_HF_ARCHITECTURES[k] for k in keys if k in _HF_ARCHITECTURES), None)
    if family is None:
        raise UnknownArchitecture(f"{path}: unknown architecture {(archs or [model_type])!r}; "
                                  f"supported: {', '.join(sorted(k for k in _HF_ARCHITECTURES if k[0].isupper()))}",
                                  data, path)
    return family


def _unmodelled(data: dict[str, Any], path: Path, family: str) -> None:
    """Refuse a key that changes the math in a model no family here computes, unless it holds its neutral value or
    the family reads it."""
    for key, neutral in UNMODELLED_KEYS.items():
        if key in data and key not in FAMILIES[family].hf_keys and not neutral(data[key]):
            raise ValueError(f"{path}: field {key!r} is {_got(data[key])}; it changes the math and llama-tools does "
                             f"not model it, so it refuses the config rather than compute another model")


def config_from_hf(data: dict[str, Any], path: Path | str = "config.json") -> ModelConfig:
    """Read an HF `config.json` of a LLaMA-family model into a ModelConfig; every field typed and ranged.

    Each family reads the keys its own code reads (families.py: hf_keys, with that code's defaults for a key the
    file leaves out) and ignores the rest as that code does; a key of a model no family computes is refused.
    """
    path = Path(path)
    family = _family(data, path)
    fam = FAMILIES[family]
    keys = fam.hf_keys
    _unmodelled(data, path, family)
    if family == "gpt_neox":  # its config class sets rope_theta from rotary_emb_base, whatever the file says
        data = {**data, "rope_theta": _get(data, "rotary_emb_base", keys["rotary_emb_base"])}
    integer = lambda key, minimum=1: _as_int(_require(data, path, key), path, key, minimum)  # noqa: E731
    flag = lambda key: _as_bool(_get(data, key, keys.get(key, False)), path, key)  # noqa: E731
    optional = lambda key: None if data.get(key) is None else _as_int(data[key], path, key)  # noqa: E731
    read = lambda key: data[key] if key in data else keys.get(key)  # noqa: E731  (null kept: "none")
    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    kv = optional("num_key_value_heads") if "num_key_value_heads" in data else keys.get("num_key_value_heads")
    kv = kv or heads
    head_dim = (optional("head_dim") if "head_dim" in data else keys.get("head_dim")) or 0
    block: dict[str, Any] = {}
    if "layer_norm_eps" in keys or "layer_norm_epsilon" in keys:  # GPT-NeoX, Falcon: n6 = n2 / n5, always
        kv, head_dim, block = _neox_block(data, path, family, heads)
    if not head_dim:
        _check_head_width(hidden, heads, path, ("hidden_size", "num_attention_heads"))
    # Baichuan-13B and Baichuan2-13B use ALiBi; their config.json has no flag for it, so the 13B width
    # decides unless our own `position_embedding` key says otherwise.
    pe = _as_str(_get(data, "position_embedding", ""), path, "position_embedding").upper()
    alibi = pe == "ALIBI" or (family == "baichuan" and not pe and hidden == 5120)
    max_pos = optional("max_position_embeddings") or optional("model_max_length") or keys.get(
        "max_position_embeddings") or 2048
    theta, scaling, local_theta = _rope(data, path, family, max_pos)
    sliding = None
    if data.get("sliding_window") is not None:  # typed and bounded even where the family's code ignores it
        _as_int(data["sliding_window"], path, "sliding_window")
    if "sliding_window" in keys:
        raw = read("sliding_window")
        sliding = None if raw is None else _as_int(raw, path, "sliding_window")
        if fam.window_flag and not flag("use_sliding_window"):
            sliding = None  # Qwen ships a window it does not use
    vocab = integer("vocab_size")
    layers = integer("num_hidden_layers")
    _listed_layer_types(data, path, layers)  # checked even where no window (or no family code) uses the list
    softcap = lambda key: (None if key not in keys or read(key) is None  # noqa: E731
                           else _as_float(read(key), path, key))
    if "attention_bias" in keys:  # q, k, v and o together (Llama, Qwen3, Gemma)
        qkv_bias = o_bias = flag("attention_bias")
    elif "bias" in keys:  # InternLM2's wqkv and wo
        qkv_bias = o_bias = flag("bias")
    else:
        qkv_bias, o_bias = False, False
    kw: dict[str, Any] = dict(
        name=path.parent.name or path.stem, source=str(path), family=family,
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=block.pop("intermediate_size") if "intermediate_size" in block
        else integer("intermediate_size"), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=block.pop("eps") if "eps" in block else
        _as_float(_get(data, "rms_norm_eps", keys.get("rms_norm_eps", 1e-6)), path, "rms_norm_eps"),
        position_encoding="alibi" if alibi else "rope",
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=flag("tie_word_embeddings"),
        qkv_bias=bool(fam.defaults.get("qkv_bias")) or qkv_bias,
        o_bias=o_bias,
        mlp_bias=flag("mlp_bias") if "mlp_bias" in keys else bool(fam.defaults.get("mlp_bias")) or (
            family == "falcon" and qkv_bias),  # Falcon's `bias`: every Linear
        # Baichuan2 (vocab 125696) normalizes lm_head rows; our own `norm_head` key overrides.
        norm_head=_as_bool(_get(data, "norm_head", family == "baichuan" and vocab == 125696), path, "norm_head"),
        sliding_window=sliding,
        layer_types=_layer_types(data, path, family, layers) if sliding else None,
        qk_norm=bool(fam.defaults.get("qk_norm")),
        norm_plus_one=bool(fam.defaults.get("norm_plus_one")),
        embed_scale=bool(fam.defaults.get("embed_scale")),
        sandwich_norms=bool(fam.defaults.get("sandwich_norms")),
        post_norms=bool(fam.defaults.get("post_norms")),
        qk_norm_whole=bool(fam.defaults.get("qk_norm_whole")),
        hidden_act=_activation(data, path, family),
        query_pre_attn_scalar=softcap("query_pre_attn_scalar"),
        attn_logit_softcap=softcap("attn_logit_softcapping"),
        final_logit_softcap=softcap("final_logit_softcapping"),
        rope_local_theta=local_theta,
        bos_token_id=_token_id(data, path, "bos_token_id", keys.get("bos_token_id", 1)),
        eos_token_id=_token_id(data, path, "eos_token_id", keys.get("eos_token_id", 2)),
        pad_token_id=None if data.get("pad_token_id") is None else _token_id(data, path, "pad_token_id", 0),
        torch_dtype=_stored_dtype(data, path),
    )
    if not alibi:
        kw["rotary_dim"] = _rotary_dim(data, path, family, head_dim or hidden // heads)
    kw.update(block)
    if "no_rope_layers" in keys:
        rotates = _rope_layers(data, path, layers)
        kw["rope_layers"] = None if all(rotates) else rotates
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        if key in keys:  # Granite's (transformers' defaults 1, attention_multiplier's too)
            kw[key] = _as_float(read(key), path, key)
    moe = fam.moe  # the family's names for its experts (Mixtral's num_local_experts, Qwen3-MoE's num_experts)
    experts = read(moe.experts_key)
    if experts is not None and _as_int(experts, path, moe.experts_key, 0):
        kw["num_experts"] = _as_int(experts, path, moe.experts_key)
        kw["num_experts_per_tok"] = _as_int(read("num_experts_per_tok"), path, "num_experts_per_tok")
        if kw["num_experts_per_tok"] > kw["num_experts"]:
            raise ValueError(f"{path}: field 'num_experts_per_tok' ({kw['num_experts_per_tok']}) must be at most "
                             f"{moe.experts_key} ({kw['num_experts']})")
        if moe.width_key is not None:
            kw["moe_intermediate_size"] = _as_int(read(moe.width_key), path, moe.width_key)
        if "norm_topk_prob" in keys:
            kw["norm_topk_prob"] = flag("norm_topk_prob")
        if "decoder_sparse_step" in keys:
            _every_layer_sparse(data, path, keys)
    elif family == "mixtral":
        raise ValueError(f"{path}: field 'num_local_experts' must be an integer >= 1 for a Mixtral, got {_got(experts)}")
    if hidden % heads and not head_dim:
        raise ValueError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv:
        raise ValueError(f"{path}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv}")
    return ModelConfig(**kw)


def _neox_block(data: dict[str, Any], path: Path, family: str, heads: int) -> tuple[int, int, dict[str, Any]]:
    """GPT-NeoX's and Falcon's block keys: (kv heads, n6 = 0 for n2 / n5, the ModelConfig fields they set).

    GPT-NeoX: use_parallel_residual, layer_norm_eps (rotary_pct is read as every partial rotary is). Falcon: new_decoder_architecture (grouped KV heads,
    ln_attn and ln_mlp unless num_ln_in_parallel_attn is 1), multi_query (one KV head), parallel_attn,
    layer_norm_epsilon, ffn_hidden_size (4 n2 unless said); its `bias` is read with the other biases.
    """
    fam = FAMILIES[family]
    keys = fam.hf_keys
    flag = lambda key: _as_bool(_get(data, key, keys[key]), path, key)  # noqa: E731
    out: dict[str, Any] = {k: fam.defaults[k] for k in ("norm_kind", "gated_mlp")}
    if family == "gpt_neox":
        out["eps"] = _as_float(_get(data, "layer_norm_eps", keys["layer_norm_eps"]), path, "layer_norm_eps")
        out["parallel_residual"] = flag("use_parallel_residual")
        return heads, 0, out
    hidden = _as_int(_require(data, path, "hidden_size"), path, "hidden_size")
    out["eps"] = _as_float(_get(data, "layer_norm_epsilon", keys["layer_norm_epsilon"]), path, "layer_norm_epsilon")
    n7 = data.get("ffn_hidden_size")
    out["intermediate_size"] = 4 * hidden if n7 is None else _as_int(n7, path, "ffn_hidden_size")
    new, parallel = flag("new_decoder_architecture"), flag("parallel_attn")
    listed = None if data.get("num_kv_heads") is None else _as_int(data["num_kv_heads"], path, "num_kv_heads")
    if new:
        if not parallel:  # transformers 4.57's layer then reads ln_attn it never made
            raise ValueError(f"{path}: fields 'new_decoder_architecture' true and 'parallel_attn' false: "
                             f"transformers' Falcon cannot run this layout; llama-tools refuses it too")
        norms = data.get("num_ln_in_parallel_attn")
        norms = 2 if norms is None else _as_int(norms, path, "num_ln_in_parallel_attn")
        if norms not in (1, 2):
            raise ValueError(f"{path}: field 'num_ln_in_parallel_attn' must be 1 or 2, got {norms}")
        kv, shared = listed or heads, norms == 1
    else:
        kv = 1 if flag("multi_query") else heads
        if not flag("multi_query") and listed not in (None, heads):
            raise ValueError(f"{path}: field 'num_kv_heads' is {listed}; without new_decoder_architecture or "
                             f"multi_query Falcon's q/k/v are one per head ({heads}), so transformers cannot run it")
        shared = parallel
    out.update(parallel_residual=parallel, shared_norm=shared)
    return kv, 0, out


def _every_layer_sparse(data: dict[str, Any], path: Path, keys: dict[str, Any]) -> None:
    """Qwen3-MoE's decoder_sparse_step and mlp_only_layers: llama-tools models experts in every layer (step 1, no
    dense layers listed); a config mixing dense and sparse layers is refused in one line naming the key."""
    step = _as_int(_get(data, "decoder_sparse_step", keys["decoder_sparse_step"]), path, "decoder_sparse_step")
    if step != 1:
        raise ValueError(f"{path}: field 'decoder_sparse_step' is {step}; llama-tools models a mixture of experts "
                         f"in every layer (decoder_sparse_step 1, mlp_only_layers []), not dense layers between")
    dense = _get(data, "mlp_only_layers", keys["mlp_only_layers"])
    if dense is not None and not isinstance(dense, list):
        raise ValueError(f"{path}: field 'mlp_only_layers' must be a list of layer indices, got {_got(dense)}")
    if dense:
        raise ValueError(f"{path}: field 'mlp_only_layers' is {_got(dense)}; llama-tools models a mixture of "
                         f"experts in every layer (decoder_sparse_step 1, mlp_only_layers []), not dense layers "
                         f"among them")


def _stored_dtype(data: dict[str, Any], path: Path) -> str:
    """HF's torch_dtype ("bfloat16", "auto", absent) -> one of ours; unknown or absent means float32."""
    key = "torch_dtype" if data.get("torch_dtype") is not None else "dtype"
    value = data.get(key)
    if value is None:
        return dtypes.FLOAT32.name
    try:
        return dtypes.get(_as_str(value, path, key)).name
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        return dtypes.FLOAT32.name


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's rule for n7: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of; in exact integers.

    Meta computes int(2 * (4 * dim) / 3) and int(multiplier * hidden) in floats; the same floors on exact
    rationals (the multiplier's float value, taken exactly) agree with it at every real size and stay exact
    for any dim (floats would round a 10^18-wide model).
    """
    hidden = 8 * dim // 3
    if ffn_dim_multiplier is not None:
        hidden = math.floor(Fraction(ffn_dim_multiplier) * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_from_meta(data: dict[str, Any], path: Path | str = "params.json", vocab_size: int | None = None) -> ModelConfig:
    """Read Meta's `params.json` (dim, n_layers, n_heads, n_kv_heads, multiple_of, ...); every field typed."""
    path = Path(path)
    integer = lambda key: _as_int(_require(data, path, key), path, key)  # noqa: E731
    dim, heads = integer("dim"), integer("n_heads")
    _check_head_width(dim, heads, path, ("dim", "n_heads"))
    vocab = data.get("vocab_size", -1)
    if vocab is not None and type(vocab) is not int:
        raise ValueError(f"{path}: field 'vocab_size' must be an integer (-1: from the weights), got {_got(vocab)}")
    if vocab is None or vocab <= 0:
        if vocab_size is None:
            raise ValueError(f"{path}: field 'vocab_size' is {vocab!r}; pass the tokenizer's size or fix params.json")
        if not 0 < vocab_size <= SIZE_LIMITS["vocab_size"]:  # the rows of tok_embeddings.weight, as a file says
            raise ValueError(f"{path}: field 'vocab_size' is {vocab!r}, and the weights' {vocab_size:,} embedding rows "
                             f"are not a vocabulary of 1 to {SIZE_LIMITS['vocab_size']:,}; fix params.json")
        vocab = vocab_size
    vocab = _as_int(vocab, path, "vocab_size")
    scaling = RopeScaling("llama3", factor=8.0) if _as_bool(_get(data, "use_scaled_rope", False), path,
                                                            "use_scaled_rope") else None
    multiple_of = _as_int(_get(data, "multiple_of", 256), path, "multiple_of")
    multiplier = data.get("ffn_dim_multiplier")
    if multiplier is not None:
        _as_float(multiplier, path, "ffn_dim_multiplier")
    n7 = ffn_hidden_size(dim, multiple_of, multiplier)
    if n7 > SIZE_LIMITS["intermediate_size"]:
        raise ValueError(f"{path}: fields 'dim' {dim:,}, 'multiple_of' {multiple_of:,} and 'ffn_dim_multiplier' "
                         f"{multiplier!r} give an FFN width of {n7:,}, over the {SIZE_LIMITS['intermediate_size']:,} "
                         f"llama-tools reads; fix params.json")
    kv = data.get("n_kv_heads")
    return ModelConfig(
        name=path.parent.name or "meta", source=str(path), family="llama",
        vocab_size=vocab, hidden_size=dim,
        intermediate_size=n7,
        num_hidden_layers=integer("n_layers"),
        num_attention_heads=heads, num_key_value_heads=heads if kv is None else _as_int(kv, path, "n_kv_heads"),
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
            if is_config_file(p / fname):
                return reader(read_json(p / fname), p / fname)
        raise ValueError(f"{p}: directory has neither config.json nor params.json")
    if looks_like_path(str(source)):
        if os.path.islink(p):
            real_path(p)  # a symlink loop or a dangling link says so
        if not p.exists():
            raise ValueError(f"{p}: no such file or directory")
        if not p.is_file():
            raise ValueError(f"{p}: not a regular file; give a config.json, params.json or checkpoint directory")
        try:
            data = read_json(p)
        except ValueError as e:
            if p.suffix == ".json":
                raise
            raise ValueError(f"{e}; a MODEL file is a config.json, params.json or .gguf (an ONNX graph is known by "
                             f"its .onnx name)") from None
        return config_from_meta(data, p) if "dim" in data and "hidden_size" not in data else config_from_hf(data, p)
    return get_preset(str(source))


def looks_like_path(arg: str) -> bool:
    """A MODEL argument meant as a file or directory (a separator, a leading dot, a .json), not a preset name."""
    return "/" in arg or arg.startswith(".") or arg.endswith(".json")


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json that describes cfg (used by `convert` and the tests)."""
    fam = FAMILIES[cfg.family]
    arch = fam.hf_classes[0]
    d: dict[str, Any] = {
        "architectures": [arch], "model_type": fam.model_types[0],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.hidden_act],
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": cfg.torch_dtype,
    }
    if cfg.pad_token_id is not None:  # only the source's own: HF reads an absent pad as "none", not as eos
        d["pad_token_id"] = cfg.pad_token_id
    if cfg.rope_scaling:
        d["rope_scaling"] = hf_rope_scaling(cfg)
        if cfg.rope_scaling.type == "longrope":  # where transformers 4.57's longrope reads the original context
            d["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    keys = fam.hf_keys  # what the family's own code reads, and so what it must be told
    if "attention_bias" in keys:
        d["attention_bias"] = cfg.o_bias
    if "bias" in keys:
        d["bias"] = cfg.qkv_bias
    if "mlp_bias" in keys:
        d["mlp_bias"] = cfg.mlp_bias
    if "sliding_window" in keys:  # null, not absent: an absent window is the family's default, not none
        d["sliding_window"] = cfg.sliding_window
    if fam.moe.experts_key in keys:  # Mixtral's num_local_experts, Qwen3-MoE's num_experts (0: every layer dense)
        d[fam.moe.experts_key] = cfg.num_experts
        d["num_experts_per_tok"] = cfg.num_experts_per_tok
        if fam.moe.width_key is not None and cfg.is_moe:
            d[fam.moe.width_key] = cfg.moe_intermediate_size
    if "norm_topk_prob" in keys:
        d["norm_topk_prob"] = cfg.norm_topk_prob
    if cfg.family == "baichuan":
        d["position_embedding"] = cfg.position_encoding.upper()
        d["norm_head"] = cfg.norm_head
    if cfg.family.startswith("gemma"):  # Gemma's keys; the (1 + γ), GELU and sqrt(n2) are the family's own
        d["hidden_activation"] = d["hidden_act"]
        d.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None
                 else cfg.head_dim)
    for key, value in (("attn_logit_softcapping", cfg.attn_logit_softcap),
                       ("final_logit_softcapping", cfg.final_logit_softcap)):
        if key in keys:
            d[key] = value
    if "rope_local_base_freq" in keys:
        d["rope_local_base_freq"] = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    if cfg.layer_types is not None:
        d["layer_types"] = list(cfg.layer_types)
    if fam.window_flag:
        d["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.sliding_window is not None and cfg.layer_types is None:
            if "max_window_layers" in keys:
                d["max_window_layers"] = 0  # every layer slides (the family's default keeps the first 28 full)
            else:  # SmolLM3 would slide only its layers without RoPE
                d["layer_types"] = [SLIDING] * cfg.num_hidden_layers
    if "no_rope_layers" in keys:  # SmolLM3: listed, so the file says what our reading holds
        d["no_rope_layers"] = [int(cfg.rotates(j)) for j in range(cfg.num_hidden_layers)]
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if key in keys:
            d[key] = getattr(cfg, key)
    if "attention_multiplier" in keys:  # Granite's code multiplies by it, its default 1: never left out
        d["attention_multiplier"] = cfg.score_scale
    for key in PARTIAL_ROTARY_KEYS:  # written even at 1: a family's default may be another (GPT-NeoX's 0.25)
        if key in keys and cfg.position_encoding == "rope":
            d[key] = partial_rotary_factor(cfg)
    if cfg.family in ("gpt_neox", "falcon"):
        _neox_block_to_hf(cfg, d)
    return d


def _neox_block_to_hf(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """GPT-NeoX's and Falcon's own keys for cfg's block (the inverse of _neox_block); a block neither can say is
    refused in one line."""
    for key in ("rms_norm_eps", "num_key_value_heads", "head_dim"):  # their code reads n6 = n2 / n5 and its own keys
        d.pop(key, None)
    kv, n5, parallel = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.parallel_residual
    if cfg.head_dim * n5 != cfg.hidden_size:
        raise ValueError(f"config {cfg.name!r}: {cfg.family} computes head_dim as hidden_size / num_attention_heads; "
                         f"{cfg.head_dim} x {n5} != {cfg.hidden_size}")
    if cfg.family == "gpt_neox":
        if kv != n5 or not cfg.mlp_bias or cfg.shared_norm or cfg.qkv_bias != cfg.o_bias:
            raise ValueError(f"config {cfg.name!r}: GPT-NeoX has one K/V head per query head, MLP biases, two norms "
                             f"a layer and attention biases on all or none; this config cannot be written as gpt_neox")
        d.update(layer_norm_eps=cfg.rms_norm_eps, rotary_emb_base=cfg.rope_theta,
                 use_parallel_residual=parallel)
        return
    if not cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias:
        raise ValueError(f"config {cfg.name!r}: Falcon's `bias` puts biases on every Linear or on none")
    del d["intermediate_size"], d["hidden_act"]  # Falcon's are ffn_hidden_size and activation
    d.update(ffn_hidden_size=cfg.intermediate_size, layer_norm_epsilon=cfg.rms_norm_eps, activation=cfg.hidden_act,
             bias=cfg.qkv_bias, parallel_attn=parallel, alibi=False)
    if kv in (1, n5) and (cfg.shared_norm or not parallel):  # the old layout: multi_query, or q, k, v per head
        d.update(new_decoder_architecture=False, multi_query=kv == 1, num_kv_heads=n5)
    elif parallel:  # new_decoder_architecture: grouped KV heads, one norm or two
        d.update(new_decoder_architecture=True, multi_query=False, num_kv_heads=kv,
                 num_ln_in_parallel_attn=1 if cfg.shared_norm else 2)
    else:
        raise ValueError(f"config {cfg.name!r}: Falcon runs {kv} KV heads of {n5} only in parallel "
                         f"(new_decoder_architecture); this sequential config cannot be written as falcon")
