"""tokpack's Python API: `from packer import pack, shuffle, validate, stage, inspect` (docs/API.md)."""

from packer.api import ExecutorConfig, inspect, pack, shuffle, stage, validate

__all__ = ["ExecutorConfig", "inspect", "pack", "shuffle", "stage", "validate"]
