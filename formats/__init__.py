"""On-disk layouts of tokpack. The bottom layer: imports nothing else from the project.

Each name below is imported when first used: importing one of formats' light modules
(`tokpack.formats.constants`, `errors`) imports this package first, and must not import numpy
(`import packer` stays light, tests/test_api.py)."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ imports, for type checkers and tests/test_layout.py's import graph
    from .constants import MANIFEST
    from .errors import IncompleteError, TokpackError
    from .manifest import read_manifest, source_manifest, write_manifest
    from .shards import EpochShardWriter, PackedSource, SourceShardWriter

_PUBLIC = {
    "IncompleteError": "errors",
    "TokpackError": "errors",
    "MANIFEST": "constants",
    "read_manifest": "manifest",
    "write_manifest": "manifest",
    "source_manifest": "manifest",
    "EpochShardWriter": "shards",
    "PackedSource": "shards",
    "SourceShardWriter": "shards",
}

__all__ = [
    "IncompleteError",
    "TokpackError",
    "MANIFEST",
    "read_manifest",
    "write_manifest",
    "source_manifest",
    "EpochShardWriter",
    "PackedSource",
    "SourceShardWriter",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value
