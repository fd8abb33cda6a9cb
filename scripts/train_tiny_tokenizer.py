"""Train the `tiny` preset's tokenizer (llama_tools/data/tiny/tokenizer.model) once, deterministically.

    python scripts/train_tiny_tokenizer.py [TEXT ...]          # writes llama_tools/data/tiny/tokenizer.model
                                                               # and tokenizer_config.json
    python scripts/train_tiny_tokenizer.py --check [TEXT ...]  # exit 1 unless a retrain gives the same bytes

TEXT: the paper's seed text this project started from (default /work/shared/seeds/*.txt, the project's
machines; elsewhere pass the files), its ASCII lines without LaTeX. LLaMA's kind of model: BPE, byte fallback (every text round-trips),
identity normalization, spaces kept, <unk> 0, <s> 1, </s> 2, vocab_size equal to the tiny preset's.
One thread and no sampling of sentences, so the same text gives the same bytes.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "llama_tools" / "data" / "tiny" / "tokenizer.model"
CONFIG = OUT.parent / "tokenizer_config.json"
DEFAULT_TEXT = "/work/shared/seeds/*.txt"


def train(texts: list[str], vocab_size: int) -> bytes:
    """The sentencepiece model's bytes."""
    import sentencepiece as spm

    # ASCII prose lines only (the English abstract, the paper's example prompt; no LaTeX formulas): 512 pieces
    # cannot hold the Chinese text's ~600 distinct characters (sentencepiece's BPE needs 98% of them), and
    # byte fallback gives every other character its UTF-8 bytes, as the paper shows for "啊".
    lines = [line.strip() for t in texts for line in t.splitlines()
             if line.strip() and line.isascii() and "\\" not in line]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
    )
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("texts", nargs="*", help=f"training text files [default: {DEFAULT_TEXT}]")
    ap.add_argument("--check", action="store_true", help="compare a retrain with the committed file")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from llama_tools.modeling.presets import get_preset

    paths = sorted(args.texts or glob.glob(DEFAULT_TEXT))
    if not paths:
        ap.error(f"no training text: {DEFAULT_TEXT} matches nothing; pass the files")
    data = train([Path(p).read_text(encoding="utf-8") for p in paths], get_preset("tiny").vocab_size)
    digest = hashlib.sha256(data).hexdigest()
    for p in paths:
        print(f"text {p} sha256 {hashlib.sha256(Path(p).read_bytes()).hexdigest()}")
    if args.check:
        same = OUT.is_file() and OUT.read_bytes() == data
        print(f"{OUT.relative_to(ROOT)}: {'same bytes' if same else 'DIFFERS from a retrain'} (retrain {digest})")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(data)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(data):,} bytes, sha256 {digest}")
    # transformers' LlamaTokenizer reads this beside tokenizer.model: the config export writes for genai.
    from llama_tools.exporters.genai import sentencepiece_to_tokenizer_json

    config = sentencepiece_to_tokenizer_json(OUT)[1]
    CONFIG.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {CONFIG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
