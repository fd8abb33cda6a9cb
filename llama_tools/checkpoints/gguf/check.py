"""A modelled GGUF architecture's metadata sizes against its tensors' shapes, before any config is built from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..header_readers import HeaderError
from .architectures import (ARCHITECTURES, EXPERT_TENSORS, FUSED_GATE_UP_SHAPES, FUSED_QKV_SHAPES, LAYER,
                            MAX_EXPERT_SLICES, MAX_EXPERTS, ROPE_FREQS, SHAPES)
from .read import field_value, meta_value


def check_metadata(reader: Any, path: Path) -> None:
    """A modelled architecture's sizes against its tensors' shapes, before any config is built from them: one line
    naming the key, the tensor and both numbers. Other architectures are counted from their headers, unchecked."""
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        return
    shapes = {t.name: [int(d) for d in t.shape.tolist()] for t in reader.tensors}

    def size(key: str, default: Any = None) -> Any:
        return meta_value(reader, path, f"{arch}.{key}", int, default)

    layers = size("block_count")
    blocks = {name: int(m.group(1)) for name in shapes if (m := LAYER.match(name))}
    held = max(blocks.values()) + 1 if blocks else 0
    if layers is not None and held != layers:
        last = f" ({max(blocks, key=blocks.__getitem__)} the last)" if blocks else ""
        raise HeaderError(f"{path}: its metadata says {layers:,} decoder layers ({arch}.block_count), the file holds "
                          f"tensors of {held:,}{last}")
    hidden, heads, ffn, vocab = size("embedding_length"), size("attention.head_count"), size("feed_forward_length"), \
        size("vocab_size")
    kv = size("attention.head_count_kv", heads)
    for key, v in (("attention.head_count", heads), ("attention.head_count_kv", kv), ("embedding_length", hidden)):
        if v == 0:
            raise HeaderError(f"{path}: GGUF metadata {arch}.{key} is 0; a model has at least one")
    width = size("attention.key_length", 0)
    width_said = f"{arch}.attention.key_length"
    if not width and hidden and heads and not hidden % heads:  # else ModelConfig says what is wrong
        width, width_said = hidden // heads, f"{arch}.embedding_length / {arch}.attention.head_count"
    experts = _experts(reader, path, arch, shapes, blocks, held)
    expert_ffn = size("expert_feed_forward_length", 0) or ffn
    said = {"hidden": (f"{arch}.embedding_length", hidden), "vocab": (f"{arch}.vocab_size", vocab),
            "ffn": (f"{arch}.feed_forward_length", ffn), "experts": (f"{arch}.expert_count", experts),
            "expert_ffn": (f"{arch}.expert_feed_forward_length" if size("expert_feed_forward_length", 0)
                           else f"{arch}.feed_forward_length", expert_ffn),
            "q": (f"{arch}.attention.head_count ({heads}) x head width ({width}, {width_said})",
                  heads * width if heads and width else None),
            "kv": (f"{arch}.attention.head_count_kv ({kv}) x head width ({width}, {width_said})",
                   kv * width if kv and width else None)}
    said["2ffn"] = (f"2 x {arch}.feed_forward_length", 2 * ffn if ffn else None)
    said["qkv"] = (f"q + 2 kv rows ({said['q'][0]}, {said['kv'][0]})",
                   said["q"][1] + 2 * said["kv"][1] if said["q"][1] and said["kv"][1] else None)
    a = ARCHITECTURES[arch]
    rules = {**SHAPES, **(FUSED_QKV_SHAPES if a.fused_qkv else {}), **(FUSED_GATE_UP_SHAPES if a.fused_gate_up else {})}
    for name, ne in shapes.items():
        axes = rules.get(name.split(".", 2)[2] if name in blocks else name)
        if axes is None:
            continue  # biases, q/k norms, what no rule here covers: GgufReader checks every shape it reads
        shape = list(reversed(ne))  # as torch has it
        if len(ne) != len(axes):
            raise HeaderError(f"{path}: tensor {name!r} has shape {shape}; {arch} stores it with {len(axes)} "
                              f"dimension{'s' if len(axes) > 1 else ''}")
        for axis, (got, what) in enumerate(zip(ne, axes)):
            key, want = said[what]
            if want is not None and got != want:
                where = "elements" if len(ne) == 1 else ("columns", "rows", "experts")[axis]
                raise HeaderError(f"{path}: metadata {key} says {want:,}, tensor {name!r} has {got:,} {where} "
                                  f"(shape {shape})")
    if ROPE_FREQS in shapes:  # one divisor per rotated pair: read (config.py) only when its shape is this
        rot = size("rope.dimension_count", width)
        if rot and shapes[ROPE_FREQS] != [rot // 2]:
            raise HeaderError(f"{path}: tensor {ROPE_FREQS!r} has shape {list(reversed(shapes[ROPE_FREQS]))}; "
                              f"{arch}.rope.dimension_count {rot} rotates {rot // 2} pairs, one divisor each")


def _experts(reader: Any, path: Path, arch: str, shapes: dict[str, list[int]], blocks: dict[str, int],
             layers: int) -> int | None:
    """{arch}.expert_count, bounded (1..MAX_EXPERTS, at least expert_used_count, and layers x experts weights to
    list) before any loop over experts; None for a dense file, which must then hold no expert tensor."""
    experts = meta_value(reader, path, f"{arch}.expert_count", int, 0)
    used = meta_value(reader, path, f"{arch}.expert_used_count", int, 0)
    if not experts:
        held = next((n for n in shapes if n in blocks and n.split(".", 2)[2] in EXPERT_TENSORS), None)
        if held:
            raise HeaderError(f"{path}: tensor {held!r} belongs to a mixture of experts, but its metadata has no "
                              f"{arch}.expert_count")
        return None
    if experts > MAX_EXPERTS:
        raise HeaderError(f"{path}: GGUF metadata {arch}.expert_count is {experts:,}, more than {MAX_EXPERTS:,}")
    if layers * experts > MAX_EXPERT_SLICES:  # every (layer, expert) is a weight the model lists, 3 matrices each
        raise HeaderError(f"{path}: {layers:,} decoder layers x {experts:,} experts ({arch}.expert_count) are more "
                          f"than {MAX_EXPERT_SLICES:,} experts to read")
    if not 0 < used <= experts:
        raise HeaderError(f"{path}: GGUF metadata {arch}.expert_used_count is {used:,}; a token is routed to 1 to "
                          f"{arch}.expert_count ({experts:,}) experts")
    return experts
