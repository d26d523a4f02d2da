"""Lazy public names for the package ``__init__`` files: ``name -> defining module``.

A name is imported from its module on first use, so that ``import distllm`` stays cheap and
no part needs another part (or a compiled extension) until it is used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, mapping: dict[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``package`` serving the names of ``mapping``.

    A name that is itself a submodule (``distllm.parallel.pipeline``) resolves to the module.
    Importing ``package.<op>`` binds the submodule as an attribute of the package; the public
    name is rebound to the function, so ``from package import <op>`` gives the function.
    """

    def __getattr__(name: str):
        target = mapping.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = importlib.import_module(target)
        value = getattr(mod, name) if hasattr(mod, name) else mod
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
