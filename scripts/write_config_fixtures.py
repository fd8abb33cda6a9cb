"""Write tests/data/transformers5/<case>.json: each case of tests/config_cases.py as transformers 5 saves it.

Run with transformers >= 5 installed (the test extra pins an older one): `python scripts/write_config_fixtures.py`.
`--check` compares instead of writing (exit 1 on a difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import transformers  # noqa: E402

from config_cases import CASES, v5_kwargs  # noqa: E402

OUT = ROOT / "tests" / "data" / "transformers5"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if int(transformers.__version__.split(".")[0]) < 5:
        sys.exit(f"transformers {transformers.__version__}: these fixtures are transformers 5's layout; install >= 5")
    differ = 0
    for case, (config_cls, model_cls, _, _) in CASES.items():
        cfg = getattr(transformers, config_cls)(**v5_kwargs(case))
        cfg.architectures = [model_cls]
        text = cfg.to_json_string(use_diff=False)
        path = OUT / f"{case}.json"
        if args.check:
            same = path.is_file() and json.loads(path.read_text()) == json.loads(text)
            differ += not same
            print(f"{case}: {'same' if same else 'DIFFERS'}")
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
