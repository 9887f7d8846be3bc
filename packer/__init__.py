"""tokpack's Python API: `from packer import pack, shuffle, validate, stage, inspect` (docs/API.md)."""

import sys as _sys
import types as _types

from packer.api import ExecutorConfig, inspect, pack, shuffle, stage, validate

__all__ = ["ExecutorConfig", "inspect", "pack", "shuffle", "stage", "validate"]


class _Package(_types.ModuleType):
    """`packer.pack`, `packer.stage` and `packer.inspect` name the API functions, not the modules
    of the same name: importing such a module (sys.modules["packer.pack"]) leaves the name alone."""

    def __setattr__(self, name, value):
        if not (name in __all__ and isinstance(value, _types.ModuleType)):
            super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
