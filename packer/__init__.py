"""tokpack's Python API: `from tokpack import pack, shuffle, validate, stage, inspect, plan` (docs/API.md)."""

from tokpack.packer.api import ExecutorConfig, inspect, pack, plan, shuffle, stage, validate

__all__ = ["ExecutorConfig", "inspect", "pack", "plan", "shuffle", "stage", "validate"]
