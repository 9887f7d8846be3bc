"""The format's names the node engine (packer/exchange.py, node_*.py, replacement.py...: being
rewritten on another branch) imports from here, from before formats/ was split one module an
idea (and `check_manifest`, which docs/COMMANDS.md names from here). Every other module imports
each name from its home (docs/ARCHITECTURE.md, "formats/")."""

# ruff: noqa: F401 (every import here is a re-export)

from .builders import nodes_sidecar
from .checks import check_manifest
from .constants import MANIFEST, MAX_MANIFEST_BYTES, NODES_SIDECAR
from .hashes import row_hashes
from .names import epoch_dir_name
from .reading import canonical_bytes, parse_manifest, read_manifest
