"""The base of every config group."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every group: unknown keys are errors, assignments are re-validated, and a
    number given for a text key is that text (``trainer.experiment_name=20250120``, which
    YAML and Hydra read as a number)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)
