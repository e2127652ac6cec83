"""The config reference table of docs/config.md, from the fields' one-line descriptions
(`async-rl config-doc` prints it; a test keeps the page in step with the code)."""
from __future__ import annotations

import typing

from pydantic import BaseModel

from async_rl.config.root import Config


def _variants(field) -> list[type[BaseModel]]:
    """The variants of a choice field (config/section.py), else []."""
    return list(typing.get_args(field.annotation)) if field.discriminator == "name" else []


def _section(annotation) -> type[BaseModel] | None:
    for member in (annotation, *typing.get_args(annotation)):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, str) and not value.isprintable():  # a separator: "\n\n" as YAML writes it
        value = repr(value).replace("'", '"')
    return f"`{value}`"


def reference_markdown() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def _variant_rows(variants, key: str, names: list[str]) -> None:
        """Each field of the variants once, marked with the variants that have it (none
        when all do)."""
        seen: dict[tuple, list[str]] = {}
        for variant in variants:
            for field_name, f in variant.model_fields.items():
                if field_name != "name":
                    entry = (field_name, _default(f), f.description)
                    seen.setdefault(entry, []).extend(typing.get_args(variant.model_fields["name"].annotation))
        for (field_name, default, description), tags in seen.items():
            only = "" if sorted(tags) == sorted(names) else f"({'/'.join(tags)}) "
            rows.append(f"| `{key}.{field_name}` | {default} | {only}{description} |")

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            variants = _variants(field)
            if variants:
                names = [n for v in variants for n in typing.get_args(v.model_fields["name"].annotation)]
                default = field.get_default(call_default_factory=True)
                rows.append(f"| `{key}.name` | `{default.name}` | {field.description} One of "
                            f"{', '.join(f'`{n}`' for n in names)}. |")
                _variant_rows(variants, key, names)
                continue
            section = _section(field.annotation)
            if section is not None:
                if field.get_default(call_default_factory=True) is None:  # an optional section: absent means off
                    rows.append(f"| `{key}` | `None` | {field.description} |")
                walk(section, f"{key}.")
                continue
            rows.append(f"| `{key}` | {_default(field)} | {field.description or ''} |")

    walk(Config, "")
    return "\n".join(rows)
