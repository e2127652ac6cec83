"""Score a model directory on a run config's held-out prompts: `async-rl eval`, kept
under its earlier name.

    python analysis/eval_model.py CONFIG MODEL_DIR [overrides ...] [--show N] [--threads 2]
"""
from __future__ import annotations

import sys

from async_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
