"""What every config section is built from.

A section is a pydantic model that refuses unknown keys. A choice among variants with
knobs of their own (the policy loss, the advantage estimator, the generation engine,
the task, the learning-rate schedule) is a discriminated union on `name`, so a config
holds only the chosen variant's fields; `loss: opmd` is short for `loss: {name: opmd}`,
and a variant's knob given without a name belongs to the default variant.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class ConfigError(ValueError):
    """A bad config: the message is one line that names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def choice(*variants: type[Section], default: type[Section]) -> Any:
    """The annotation of a field that holds one of `variants`, told apart by their `name`."""
    default_name = default.model_fields["name"].default

    def named(value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, dict) and "name" not in value:
            return {"name": default_name, **value}
        return value

    return Annotated[Union[variants], Field(discriminator="name"), BeforeValidator(named)]  # noqa: UP007


def variant_names(variant: type[Section]) -> tuple[str, ...]:
    """The `name` values that select `variant`."""
    from typing import get_args

    return get_args(variant.model_fields["name"].annotation)
