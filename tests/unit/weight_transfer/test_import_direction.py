"""async_rl/actor/engines may import from async_rl/weight_transfer, never the other way round, and
the modules of the two packages import without a cycle: read from every import
statement (those inside functions too), and by importing each module afresh."""
import ast
import importlib.util
import json
import subprocess
import sys

from conftest import ROOT, subprocess_env

PACKAGE = ROOT / "async_rl"
SCOPE = ("async_rl.actor.engines", "async_rl.weight_transfer")


def module_names() -> dict[str, bool]:
    """Every module of the async_rl package: its dotted name -> whether it is a package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        names[".".join(parts[:-1] if is_package else parts)] = is_package
    return names


def imports_of(name: str, is_package: bool, known: dict[str, bool]) -> set[str]:
    """The async_rl modules that importing `name` runs: what it imports by name, and the
    packages above those it does not already belong to."""
    path = ROOT / (name.replace(".", "/") + ("/__init__.py" if is_package else ".py"))
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(known)
            found |= submodules or {base}
    deps = set()
    for dep in found & set(known):
        parts = dep.split(".")
        for i in range(2, len(parts) + 1):  # `import a.b.c` runs a.b first
            parent = ".".join(parts[:i])
            if parent == dep or not (name == parent or name.startswith(parent + ".")):
                deps.add(parent)
    deps.discard(name)
    return deps


def in_scope(name: str) -> bool:
    return any(name == pkg or name.startswith(pkg + ".") for pkg in SCOPE)


def test_weight_transfer_imports_nothing_from_engines():
    known = module_names()
    offending = {name: sorted(d for d in imports_of(name, pkg, known) if d.startswith("async_rl.actor.engines"))
                 for name, pkg in known.items() if name.startswith("async_rl.weight_transfer")}
    assert not {k: v for k, v in offending.items() if v}


def test_no_import_cycle_among_engines_and_weight_transfer():
    known = module_names()
    graph = {name: {d for d in imports_of(name, pkg, known) if in_scope(d)}
             for name, pkg in known.items() if in_scope(name)}
    assert any(d.startswith("async_rl.weight_transfer") for d in graph["async_rl.actor.engines.vllm_engine"])
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_each_module_imports_on_its_own():
    """In one fresh interpreter: every module of the two packages imported with no
    async_rl module loaded before it; importing weight_transfer loads no engine module. A
    module that runs inside an optional library (vllm/gloo_plugin.py and vllm/nccl_plugin.py,
    inside vLLM) only where that library is installed."""
    optional = {f"async_rl.weight_transfer.vllm.{name}": "vllm" for name in ("gloo_plugin", "nccl_plugin")}
    modules = sorted(name for name in module_names()
                     if in_scope(name) and (name not in optional or importlib.util.find_spec(optional[name])))
    script = f"""
import importlib, json, sys
loaded = {{}}
for name in {modules!r}:
    for old in [m for m in sys.modules if m == "async_rl" or m.startswith("async_rl.")]:
        del sys.modules[old]
    importlib.import_module(name)
    loaded[name] = sorted(m for m in sys.modules if m.startswith("async_rl."))
print(json.dumps(loaded))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert set(loaded) == set(modules)
    for name, modules_loaded in loaded.items():
        if name.startswith("async_rl.weight_transfer"):
            assert not [m for m in modules_loaded if m.startswith("async_rl.actor.engines")], name
