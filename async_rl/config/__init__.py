"""The run configuration: YAML + dotted CLI overrides, validated by pydantic. Each section
is defined by the component that reads it (models/config.py, actor/config.py, ...) on
section.py's base; root.py puts them together with the rules across sections, loading.py
reads a config and says in one line what is wrong with it. Nothing here imports torch.

The names below load on first use: the sections import section.py, which runs this
file first, so it must not import root.py itself.
"""
from __future__ import annotations

import importlib

_WHERE = {"Config": "root", "ConfigError": "section", "build_config": "loading", "from_yaml": "loading",
          "load_config": "loading", "parse_overrides": "loading", "resolve_run_dir": "loading", "to_yaml": "loading",
          "reference_markdown": "reference"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
