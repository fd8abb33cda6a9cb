"""What an .onnx file says about itself (our metadata, whether it holds int4), read without torch or its weights.

The verify commands' refusals come from here before torch is imported. `names` answers "no" without onnx at
all: protobuf stores every string (a node's op_type, a metadata key) as its own UTF-8 bytes, so a file that
lacks the bytes has no such node or key. A "yes" is only a maybe, and is confirmed with onnx.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

from llama_tools.modeling.config import ModelConfig
from llama_tools.checkpoints.header_readers import open_regular

META = "llama_tools."  # prefix of our metadata_props keys
INT4_OP = "MatMulNBits"  # onnxruntime's weight-only int4 MatMul (export --quantize int4 writes it)


@dataclass
class ExportMetadata:
    """The llama_tools.* metadata of an exported model."""

    config: ModelConfig
    rope_layout: str
    rope_op: str
    dtype: str
    version: str
    source: str
    seed: int | None  # None: the weights came from a checkpoint or a given module
    graph: str = "plain"  # "plain" (onnx_export.py) or "fused" (fused.py)
    static_kv: int | None = None  # a fused graph's preallocated KV length, if it has one


def names(onnx_path: str | Path, word: str) -> bool:
    """False when the file cannot hold a node or key named `word` (its bytes are nowhere in it); True: maybe.

    A FIFO or device is refused (one line), never read: it could block, or never end.
    """
    with open_regular(onnx_path) as f:
        if f.seek(0, 2) == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:  # the OS pages it in; nothing copied
            return m.find(word.encode()) >= 0


def _graph(onnx_path: str | Path):  # noqa: ANN202  (onnx.ModelProto, onnx imported here only)
    import onnx

    return onnx.load(str(onnx_path), load_external_data=False)


def is_int4(onnx_path: str | Path) -> bool:
    """Whether a graph holds onnxruntime's weight-only int4 MatMulNBits (read without its weights)."""
    return names(onnx_path, INT4_OP) and any(n.op_type == INT4_OP for n in _graph(onnx_path).graph.node)


def has_our_metadata(onnx_path: str | Path) -> bool:
    """Whether llama-tools wrote this graph (its metadata names the config), read without the weights."""
    if Path(onnx_path).stat().st_size == 0:
        return True  # read_metadata says "empty file"
    if not names(onnx_path, META + "config"):
        return False
    try:
        props = _graph(onnx_path).metadata_props
    except Exception:  # noqa: BLE001  read_metadata words the error
        return True
    return any(p.key == META + "config" for p in props)


def check_int4_graph(onnx_path: str | Path) -> None:
    """`verify int4`'s TARGET must hold int4 weights: a full-precision graph has nothing for its measures to judge."""
    if not is_int4(onnx_path):
        raise ValueError(f"{onnx_path}: has no {INT4_OP} node, so nothing in it is int4; check a full-precision "
                         f"graph with `llama-tools verify parity {onnx_path}`, or write an int4 one with "
                         f"`llama-tools export onnx MODEL -o OUT.onnx --quantize int4`")


def read_metadata(path: str | Path) -> ExportMetadata:
    """The llama_tools.* metadata of an exported file, without reading its external weights."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; pass the .onnx file that `llama-tools export onnx` wrote")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file; export it again with `llama-tools export onnx`")
    try:
        props = {p.key: p.value for p in _graph(path).metadata_props}
    except Exception as e:  # protobuf's DecodeError and friends  # noqa: BLE001
        raise ValueError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    if META + "config" not in props:
        raise ValueError(f"{path}: has no {META}config metadata; export it with llama-tools first")
    seed = props.get(META + "seed", "")
    return ExportMetadata(
        config=ModelConfig.from_dict(json.loads(props[META + "config"])),
        rope_layout=props.get(META + "rope_layout", ""), rope_op=props.get(META + "rope_op", ""),
        dtype=props.get(META + "dtype", ""), version=props.get(META + "version", ""),
        source=props.get(META + "source", ""), seed=int(seed) if seed else None,
        graph=props.get(META + "graph", "plain"),
        static_kv=int(props[META + "static_kv"]) if props.get(META + "static_kv") else None)
