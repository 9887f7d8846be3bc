"""tokpack's Python API: `from packer import pack, shuffle, validate, stage, inspect, plan` (docs/API.md)."""

from packer.api import ExecutorConfig, inspect, pack, plan, shuffle, stage, validate

__all__ = ["ExecutorConfig", "inspect", "pack", "plan", "shuffle", "stage", "validate"]
