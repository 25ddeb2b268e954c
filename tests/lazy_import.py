"""Heavy optional modules (torch, transformers) imported at their first use in a test, not at
collection: every pytest-xdist worker, and every pytest that a unit test starts over tests/,
collects each file, and these take seconds to import."""

from __future__ import annotations

import importlib
import importlib.util


class _Lazy:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):     # what collection asks of every object in a test module
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}>"


def lazy(name: str):
    """A stand-in for module `name` that imports it at its first attribute; None where it is
    not installed (a `.[dev]` venv)."""
    return _Lazy(name) if importlib.util.find_spec(name) is not None else None
