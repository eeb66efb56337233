"""A module imported at its first attribute's use, not at the test module's import.

Every pytest-xdist worker imports every test module to collect it: a module-level
``import vllm`` (with torch and transformers, 4.5 s of CPU) cost each worker that much,
whatever tests it was given. The connector's tests reach vLLM and torch through these.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class Lazy:
    """Stands for the module ``name``; importing it on the first attribute asked."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            # What pytest and its plugins look for on a module's names as they collect
            # (``__test__``, their markers): none of it is the module's.
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
