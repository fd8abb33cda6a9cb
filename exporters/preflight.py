"""`export onnx`'s checks of its arguments, OUTPUT and the tokenizer, before any work: no torch, onnxruntime or weights.

A refusal (a bad --rope-op/--opset pair, OUTPUT that is an input, a .data file not ours, a terminal, a full
disk, a tokenizer that cannot be read, encodes no text or has ids past the model's vocab_size) comes in the time
`count-params` takes, not after torch's import (issue 19), nor after the export's work. The exporters call these
same functions again, so the library refuses the same things.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llama_tools.modeling import dtypes
from llama_tools.outputs import paths
from llama_tools.outputs.progress import release_freed_memory
from llama_tools.checkpoints.source import MAX_RANDOM_INIT_BYTES, ModelSource

from . import rope_ops

DEFAULT_OPSET = 20  # torch.onnx's own default; a RoPE op may need more (rope_ops.ROPE_OPS)
# Below this many bytes of weights one self-contained file is fine: serializing it holds the weights about
# twice more (protobuf's buffer, then the bytes), and onnxruntime parses the proto before copying them out.
# Above it, OUT.data beside OUT (as onnxruntime-genai's builder always writes): a 135M model's int4 graph
# (86 MB) written this way peaks ~170 MB lower, and its session ~90 MB lower.
SINGLE_FILE_MAX_BYTES = 64 * 2**20
EXTERNAL_DATA_THRESHOLD_BYTES = SINGLE_FILE_MAX_BYTES


def check_args(dtype: Any, rope_op: str, opset: int | None) -> tuple[dtypes.DType, int]:
    """Bad user input -> one-line ValueError, before anything is loaded; returns (dtype, opset)."""
    dt = dtypes.model_dtype(dtype)
    op = rope_ops.get_rope_op(rope_op)
    opset = max(DEFAULT_OPSET, op.min_opset) if opset is None else opset
    if opset < op.min_opset:
        raise ValueError(f"opset {opset} is too old for {op.display}; pass opset >= {op.min_opset}")
    return dt, opset


def check_output(source: ModelSource, output: str | Path, *, dtype: str = "float32",
                 quantize: str | None = None, client_files: bool = True) -> Path:
    """OUTPUT resolved (a symlink's target) and checked before any work, with what goes beside it; one-line ValueErrors.

    Refused: an OUTPUT or OUTPUT.data that is one of the files the export reads; an OUTPUT.data there that
    no graph of ours refers to (someone else's file: never replaced or deleted); a terminal; a stream when
    the weights need a .data file beside the graph; less free space than the weights take; a tokenizer the
    export would use that is not usable (check_tokenizer).
    """
    given = Path(output)
    # "-" is standard output; the exporters want a path that stats (/dev/stdout, written through fd 1)
    output = Path("/dev/stdout") if str(given) == "-" else paths.resolve_output(given)
    paths.check_name(output)
    data = output.parent / (output.name + ".data")
    if not paths.written_through(output):  # a stream, device or FIFO has no .data beside it
        paths.check_output_path(data)
    paths.check_writes([given, data], source.files)  # named as typed; symlinks followed there
    nbytes = _weight_bytes(source, dtype)
    fd = paths.stream_fd(output)
    if fd is not None and os.isatty(fd):
        raise ValueError(f"{output}: a terminal; an ONNX graph is binary: redirect it (> model.onnx) or give a "
                         f"file path")
    if paths.written_through(output):
        if nbytes > EXTERNAL_DATA_THRESHOLD_BYTES and quantize is None:
            raise ValueError(f"{output}: not a regular file, and the weights (~{nbytes:,} bytes) need an "
                             f"external-data file beside the graph; give a file path")
    else:
        _check_data_is_ours(output, data)
        too_long = len(data.name.encode("utf-8", "surrogateescape")) > paths.NAME_MAX
        if too_long and nbytes > EXTERNAL_DATA_THRESHOLD_BYTES and quantize is None:
            raise ValueError(f"{output}: the weights (~{nbytes:,} bytes) need {output.name}.data beside it, a name "
                             f"longer than {paths.NAME_MAX} bytes; choose a shorter output name")
        # int4: the full-precision graph in a scratch dir beside OUTPUT, then the int4 one (~1/6 of it). Random
        # weights too big to materialize are refused by load_model in their own words: not a disk's matter.
        if not (source.seeded and nbytes > MAX_RANDOM_INIT_BYTES):
            paths.check_space(output, nbytes + (nbytes // 4 if quantize else 0))
    check_tokenizer(source, client_files=client_files and not paths.written_through(output), quantize=quantize)
    return output


def check_tokenizer(source: ModelSource, *, client_files: bool = True, quantize: str | None = None) -> None:
    """The tokenizer an export reads (int4's quality check encodes text with it) and writes beside the graph, checked
    before any work: its library reads it, it encodes text, its ids fit the model's vocab_size, and its client files
    can be made (ids as the config says); one-line ValueErrors naming the files. Nothing when none is used."""
    if not client_files and quantize is None:
        return
    from llama_tools.checkpoints.source import load_tokenizer

    tok = load_tokenizer(source)
    if tok is not None and client_files:
        from .genai import tokenizer_client_files

        tokenizer_client_files(tok.path, source.cfg)  # what write_client_files makes again (cached) at the end
    del tok
    release_freed_memory()  # a 262,144-token vocabulary's tokenizer holds 0.3 GB: not under the export's peak


def _weight_bytes(source: ModelSource, dtype: str) -> int:
    """The graph's weights at `dtype`, exactly from the config (constant time in the number of layers)."""
    from llama_tools.counting.accounting import count_params

    return count_params(source.cfg).total * int(dtypes.get(dtypes.model_dtype(dtype).name).bytes)


def _refers_to(graph: Path, data_name: str) -> bool:
    """Whether `graph` is an ONNX file whose initializers live in `data_name` (a .data file we wrote for it)."""
    import onnx

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception:  # not an ONNX file (protobuf's DecodeError, ...): it refers to nothing  # noqa: BLE001
        return False
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if any(e.key == "location" and e.value == data_name for e in t.external_data):
                return True
    return False


def _check_data_is_ours(output: Path, data: Path) -> None:
    """OUTPUT.data may be replaced (or removed as stale) only when the graph at OUTPUT refers to it."""
    try:
        present = os.path.lexists(data)
    except OSError:
        return
    if present and not (output.is_file() and _refers_to(output, data.name)):
        raise ValueError(f"{data}: is there beside {output}, and no graph of ours refers to it: it is not ours to "
                         f"replace or delete; move it, or choose another output path")


