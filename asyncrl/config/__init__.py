"""Typed run configuration (docs/DESIGN.md section 3)."""

from asyncrl.config.load import (
    ConfigError,
    load_config,
    parse_override,
    run_dir,
    validate,
    write_resolved,
)
from asyncrl.config.reference import field_reference
from asyncrl.config.schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "field_reference",
    "load_config",
    "parse_override",
    "run_dir",
    "validate",
    "write_resolved",
]
