"""Importing a user's Python file by its path (a reward function, a tool class)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(file: str | Path, prefix: str) -> ModuleType:
    """Import ``file`` as a module named after its path (``<prefix>_<stem>_<hash>``), once
    per process: two files of the same name never shadow each other. Raises ValueError for
    a file that cannot be a module, and whatever running the file raises."""
    path = Path(file)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"{prefix}_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path} as a Python module; give it a .py suffix")
    module = importlib.util.module_from_spec(spec)
    # Registered before running so pickling and dataclasses inside the file work.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
