"""Package faces that import their names on first use (PEP 562), so ``jaxmoe --help`` and ``jaxmoe
client`` do not pay for importing JAX."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """(``__getattr__``, ``__dir__``) for ``package``'s face: name -> the module that defines it."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
