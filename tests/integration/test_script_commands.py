"""Every script with a command line, in analysis/ and benchmarks/, starts and answers
--help from the repository root as the docs run it."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for folder in ("analysis", "benchmarks")
                 for p in (ROOT / folder).glob("*.py") if "argparse" in p.read_text())


# Scripts that import a peer's package at the top, run in a venv of their own (their docstrings say how).
PEERS = {"benchmarks/peer_corrections.py": "verl"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_answers_help(script):
    if script in PEERS and importlib.util.find_spec(PEERS[script]) is None:
        pytest.skip(f"{script} runs beside {PEERS[script]}, not installed here (its docstring says how)")
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert proc.returncode == 0 and proc.stdout.lower().startswith("usage:"), proc.stderr[-2000:]
