"""Every script the docs name is where they say: the user's tools in analysis/, the
project's benchmarks in benchmarks/."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launch" / "README.md"]


def named_scripts() -> dict[str, set[str]]:
    named: dict[str, set[str]] = {}
    for doc in DOCS:
        for path in re.findall(r"(?<![\w/])((?:analysis|benchmarks)/\w+\.py)", doc.read_text()):
            named.setdefault(path, set()).add(doc.name)
    return named


def test_every_script_the_docs_name_exists():
    named = named_scripts()
    assert len(named) > 20
    missing = {path: docs for path, docs in named.items() if not (ROOT / path).is_file()}
    assert not missing, missing


def test_the_user_tools_and_the_benchmarks_are_apart():
    users = {p.stem for p in (ROOT / "analysis").glob("*.py")}
    assert {"summarize", "staleness", "throughput", "show_sample"} <= users
    assert not users & {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert not any(name.startswith(("bench_", "peer_", "chaos")) for name in users)
