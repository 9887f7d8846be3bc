"""tokpack's Python API: `from tokpack import pack, shuffle, validate, stage, inspect, plan` (docs/API.md)."""

from tokpack.packer.shared import ExecutorConfig
from tokpack.packer.api import inspect, pack, plan, shuffle, stage, validate

__all__ = ["ExecutorConfig", "inspect", "pack", "plan", "shuffle", "stage", "validate"]
