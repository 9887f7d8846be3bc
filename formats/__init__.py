"""On-disk layouts of tokpack. The bottom layer: imports nothing else from the project."""

from .errors import IncompleteError, TokpackError
from .manifest import MANIFEST, read_manifest, source_manifest, write_manifest
from .shards import EpochShardWriter, PackedSource, SourceShardWriter
from . import slices  # noqa: F401 (registers the node slice's reader with SampleReader.open)

__all__ = [
    "IncompleteError",
    "TokpackError",
    "MANIFEST",
    "read_manifest",
    "write_manifest",
    "EpochShardWriter",
    "PackedSource",
    "SourceShardWriter",
    "source_manifest",
]
