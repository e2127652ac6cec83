"""A config from YAML and dotted overrides, validated; every failure one line naming the
key (ConfigError), which the CLI turns into exit status 2."""
from __future__ import annotations

import time
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from async_rl.config.moved import VARIANT_INSTEAD, refuse_moved_keys
from async_rl.config.root import Config
from async_rl.config.section import ConfigError


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if isinstance(child, str):  # a variant named in short (`train.loss=opmd`), now given a knob
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    if isinstance(value, str) and isinstance(node.get(leaf), dict):  # a variant chosen after its knobs
        node[leaf]["name"] = value
    else:
        node[leaf] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key.sub=value` strings -> nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item}: overrides must look like key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)

    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, str):  # a variant named in short, then given knobs
            old = {"name": old}
        if isinstance(value, str) and isinstance(old, dict) and old.get("name") == value:
            continue  # the variant the file chose, named again: its knobs stay
        if isinstance(value, dict) and isinstance(old, dict):
            if "name" in value and value["name"] != old.get("name"):
                old = {}  # another variant: the old one's knobs do not apply
            out[key] = _merge(old, value)
        else:
            out[key] = value
    return out


def _variants(field: Any) -> dict[str, type[BaseModel]]:
    """{name: variant} when `field` is a choice among sections (config/section.py)."""
    if field.discriminator != "name":
        return {}
    return {name: member for member in typing.get_args(field.annotation)
            for name in typing.get_args(member.model_fields["name"].annotation)}


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field (also an optional one)."""
    for member in (annotation, *typing.get_args(annotation)):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _key(loc: tuple) -> tuple[str, str | None, dict[str, type[BaseModel]]]:
    """(the dotted key a pydantic error location names, the variant on the way as
    `key.name=value`, if any, and that choice's variants): a choice's location holds its
    tag, which is no key."""
    model: type[BaseModel] | None = Config
    parts: list[str] = []
    variant, variants = None, {}
    items = list(loc)
    while items:
        part = items.pop(0)
        if not isinstance(part, str) or not part.isidentifier() or model is None:
            break  # a list index, or a union member's tag ("constrained-int", "literal['auto']")
        parts.append(part)
        field = model.model_fields.get(part)
        if field is None:
            break
        choices = _variants(field)
        if choices and items and items[0] in choices:
            variant, variants = f"{'.'.join(parts)}.name={items[0]}", choices
            model = choices[items.pop(0)]
        else:
            model = _section(field.annotation)
    return ".".join(parts), variant, variants


def _unknown(key: str, variant: str | None, variants: dict[str, type[BaseModel]]) -> str:
    """An unknown key, and where it is known: another variant of the same choice, with
    what this variant has in its place."""
    line = f"{key}: unknown key" + (f" for {variant}" if variant else "")
    field, chosen = key.rpartition(".")[2], variant.rpartition("=")[2] if variant else None
    owners = [name for name, member in variants.items() if field in member.model_fields]
    if owners:
        line += f" (a key of {variant.rpartition('=')[0]}={'/'.join(owners)})"
    if (instead := VARIANT_INSTEAD.get(key, {}).get(chosen)) is not None:
        line += f"; with {chosen}: {instead}"
    return line


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    key, variant, variants = _key(tuple(first["loc"]))
    msg = first["msg"].removeprefix("Value error, ")
    kind = first["type"]
    if kind == "extra_forbidden":
        return _unknown(key, variant, variants)
    if kind == "union_tag_invalid":
        expected = first["ctx"]["expected_tags"].replace("'", "")
        return f"{key}.name: {first['ctx']['tag']!r} is not one of {expected}"
    if kind == "missing":
        return f"{key}: required" + (f" when {variant}" if variant else "")
    if kind == "value_error" and key and msg.startswith(key):  # a section's own rule names its key
        return msg
    if "input" in first and kind != "value_error" and not isinstance(first["input"], dict):
        return f"{key}: {msg} (got {first['input']!r})"
    return msg if (not key and ":" in msg) else f"{key}: {msg}" if key else msg


def build_config(data: dict[str, Any]) -> Config:
    refuse_moved_keys(data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: invalid YAML ({str(err).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    return build_config(_merge(data, parse_overrides(list(overrides))))


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir is None:
        cfg.run_dir = f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.run_dir)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def from_yaml(text: str) -> Config:
    return build_config(yaml.safe_load(text))
