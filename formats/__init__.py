"""On-disk layouts of tokpack. The bottom layer: imports nothing else from the project."""

from .errors import IncompleteError, TokpackError
from .manifest import MANIFEST, read_manifest, source_manifest, write_manifest
from .shards import EpochShardWriter, PackedSource, SourceShardWriter

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
