"""tokpack: pack tokenized corpora, shuffle them offline per epoch, verify them, stream them.

    from tokpack import pack, shuffle, validate, stage, inspect, plan, SampleReader, TokpackDataset

Every name is imported when first used: a trainer that imports `SampleReader` pays for neither
datatrove nor the executors, and only `TokpackDataset` imports torch (docs/API.md).
"""

from __future__ import annotations

import importlib
import types
from importlib import metadata
from pathlib import Path

# The repository keeps the layout's top-level folders (packer/, shuffle/, formats/, loader/)
# beside this one; an installed wheel has them inside it. In the source tree (tests run from a checkout,
# mutation testing's copy of it) the subpackages are found beside this folder.
if not (Path(__file__).parent / "formats").is_dir():
    __path__.append(str(Path(__file__).resolve().parent.parent))  # noqa: F821 (a package's own __path__)

try:
    __version__ = metadata.version("tokpack")
except metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

_PUBLIC = {
    "pack": "tokpack.packer.api",
    "validate": "tokpack.packer.api",
    "stage": "tokpack.packer.api",
    "inspect": "tokpack.packer.api",
    "plan": "tokpack.packer.api",
    "ExecutorConfig": "tokpack.packer.api",
    "TokpackError": "tokpack.formats.errors",
    "SampleReader": "tokpack.loader.reader",
    "TokpackDataset": "tokpack.loader.torch_adapter",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


class _ShufflePackage(types.ModuleType):
    """`tokpack.shuffle` names both the subpackage (shuffle/, which the layout keeps) and the public
    function. The import system binds the subpackage to that attribute whenever it is imported,
    so the subpackage itself is made callable as the function: `from tokpack import shuffle;
    shuffle(...)` and `import tokpack.shuffle.plan` both work, whatever was imported first."""

    def __call__(self, *args, **kwargs):
        return importlib.import_module("tokpack.packer.api").shuffle(*args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(importlib.import_module("tokpack.packer.api").shuffle)

    @property
    def __doc__(self):  # help(tokpack.shuffle) and a notebook's `shuffle?`: the function's (the package has none)
        return importlib.import_module("tokpack.packer.api").shuffle.__doc__

    def __reduce__(self):
        # By name, as pickle takes a function: a module cannot be pickled, so `shuffle` could not
        # be handed to a process pool (ProcessPoolExecutor.submit, multiprocessing, submitit) as
        # `pack` can. Unpickled, the import gives this object again.
        return importlib.import_module, (self.__name__,)


importlib.import_module("tokpack.shuffle").__class__ = _ShufflePackage  # its __init__ imports nothing
__all__.append("shuffle")


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tokpack' has no attribute {name!r}")


def __dir__():
    return __all__
