"""Every test in exactly one tier of .ci/run: the fast tier (pytest's default selection,
the README's command), the integration job, the extended job. Collects the suite once
and prints each tier's count; exits 1 when the tiers do not add up to the suite.
(The vLLM job reruns the tests marked `vllm`, which skip in the other tiers without vLLM.)"""
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
TIERS = {
    "fast": lambda m: ("integration" not in m or "smoke" in m) and "extended" not in m,
    "integration": lambda m: "integration" in m and "smoke" not in m and "extended" not in m,
    "extended": lambda m: "extended" in m,
}
FAST = "(not integration or smoke) and not extended"  # pyproject's addopts, as an expression


class Collect:
    def __init__(self):
        self.items = []

    def pytest_collection_finish(self, session):
        self.items = [{mark.name for mark in item.iter_markers()} for item in session.items]


def main() -> int:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    if f"-m '{FAST}'" not in addopts:
        print(f"count_tests: pyproject's addopts no longer selects -m '{FAST}': update this script", file=sys.stderr)
        return 1
    collect = Collect()
    if pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "", str(ROOT / "tests")],
                   plugins=[collect]) != 0:
        return 1
    counts = {tier: sum(1 for marks in collect.items if rule(marks)) for tier, rule in TIERS.items()}
    homes = [sum(rule(marks) for rule in TIERS.values()) for marks in collect.items]
    print("tests: " + ", ".join(f"{tier} {n}" for tier, n in counts.items()) + f"; {len(homes)} in all"
          + f" ({sum(1 for m in collect.items if 'vllm' in m)} marked vllm, rerun in the vLLM job)")
    if any(n != 1 for n in homes):
        print(f"count_tests: {sum(n != 1 for n in homes)} tests are in no tier or in several", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
