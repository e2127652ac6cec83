"""The public API: what user code needs, importable from async_rl itself; the docs'
examples import only from it; a module imported from a place it moved from names the
new place."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import async_rl
from async_rl.moved_modules import MOVED, moved_to

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "async_rl"


def python_sources() -> list[tuple[str, str]]:
    """(where, code) for every Python block of the docs and the README, and every example file."""
    sources = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for k, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)):
            sources.append((f"{doc.name} block {k}", textwrap.dedent(block)))
    sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "examples").rglob("*.py"))]
    return sources


def async_rl_imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each import of async_rl in `code`."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "async_rl":
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "async_rl"]
    return found


def test_the_docs_examples_import_only_from_async_rl_itself():
    imports = [(where, module, names) for where, code in python_sources() for module, names in async_rl_imports(code)]
    assert imports, "the docs have examples that import async_rl"
    for where, module, names in imports:
        assert module == "async_rl", f"{where} imports {module}: user code imports from async_rl"
        assert set(names) <= set(async_rl.__all__), f"{where}: {set(names) - set(async_rl.__all__)} not public"


def test_every_public_name_loads_and_is_what_its_module_defines():
    for name, module in async_rl.PUBLIC.items():
        assert getattr(async_rl, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="its public names: Config, ConfigError"):
        async_rl.Trainer  # noqa: B018


def test_importing_async_rl_loads_no_torch():
    code = ("import sys, async_rl; from async_rl import Turn, Prompt, StepRewards, load_config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_module_that_moved_names_its_new_place_in_one_line():
    with pytest.raises(ModuleNotFoundError) as err:
        from async_rl.envs import Turn  # noqa: F401
    assert str(err.value) == ("No module named 'async_rl.envs': it moved to async_rl.actor.environments; "
                              "what user code needs is importable from async_rl itself (docs/api.md)")
    with pytest.raises(ImportError, match=r"'async_rl.weight_transfer.broadcaster': it moved to "
                                          r"async_rl.weight_transfer.sender;"):
        importlib.import_module("async_rl.weight_transfer.broadcaster")  # its package is still there
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'async_rl.never_was'$"):
        importlib.import_module("async_rl.never_was")


def module_exists(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_the_moved_table_points_from_what_is_gone_to_what_is():
    for old, new in MOVED.items():
        assert not module_exists(old), f"{old} exists: it would never be reported as moved"
        targets = re.split(r", | and ", new)
        assert all(module_exists(t) for t in targets), f"{old} -> {new}: not a module here"
        parent = old.rpartition(".")[0]
        assert parent == "async_rl" or module_exists(parent), f"{old}: its package's line is the one users see"
    assert moved_to("async_rl.actor.environments") is None  # what exists is never reported


def test_the_moved_table_covers_the_modules_the_histories_name():
    """Each module the earlier layouts had that users imported from is in the table."""
    for old in ("async_rl.envs", "async_rl.transport", "async_rl.roles", "async_rl.prompting", "async_rl.engines",
                "async_rl.weight_sync"):
        assert moved_to(old) is not None
