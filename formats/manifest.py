"""`check_manifest`, by the name docs/COMMANDS.md gives it (tokpack.formats.manifest.check_manifest).
Every module imports each name from its home (docs/ARCHITECTURE.md, "formats/")."""

from .checks import check_manifest  # noqa: F401 (a re-export)
