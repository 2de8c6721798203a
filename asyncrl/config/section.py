"""The base of every config group."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """Base for every group: unknown keys are errors, assignments are re-validated, a number
    given for a text key is that text (``trainer.experiment_name=20250120``, which YAML and
    Hydra read as a number), and a boolean given for a number key is refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic reads ``true`` given for a number as 1, so ``rollout.n=true`` (a slip:
        a switch meant, or a value pasted into the wrong key) would run with n=1; OmegaConf,
        so veRL, refuses it, and so is it here."""
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if kinds & {int, float} and bool not in kinds:
                raise PydanticCustomError(
                    "bool_for_number", "true or false is not a number; give a number"
                )
        return value


def _kinds(annotation: Any) -> set[Any]:
    """The types a field's annotation admits: each member of a union, else the one type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}
