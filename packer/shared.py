"""What the API and the commands behind it share: how tasks run (`ExecutorConfig`), the base of
every command's result (`Result`), and how paths and weighted sources are given. A leaf: it
imports nothing from the project, so packer/api.py and the stages it calls import it, not each
other (tests/test_layout.py)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path

PathLike = str | Path


@dataclasses.dataclass
class ExecutorConfig:
    """How and where tasks run: here (local), through datatrove's Slurm executor, or on Ray."""

    workers: int = 1  # local: worker processes; slurm/ray: cap on concurrent tasks when > 1 (1 = no cap)
    executor: str = "local"  # local | slurm | ray
    tasks: int | None = None  # override of the natural task count
    logging_dir: str | None = None  # datatrove logging dir; default inside the output's work folder
    partition: str | None = None  # slurm partition; None = the cluster's default partition
    time_limit: str = "24:00:00"  # slurm time limit
    cpus_per_task: int = 1  # slurm and ray: CPUs reserved per task
    mem_per_cpu_gb: float = 2  # slurm and ray: memory reserved per CPU, GB
    sbatch_args: str | None = None  # slurm: extra sbatch arguments, "key=value,key=value"
    ray_address: str | None = None  # ray: existing cluster, or None for a local one
    in_process: bool = True  # local, one worker, no logging dir: run the ranks here (False: datatrove's executor)
    poll_seconds: float = 5.0  # slurm: longest pause between two looks at the markers and the queue


class Result:
    """A command's result. `to_json()` is what `--json` prints: `"ok": true` (unless the result
    has its own `ok`), then the fields, less the optional ones (metadata optional=True) that are
    None. Every command's JSON has `ok`, so a script can test `.ok` whatever it ran."""

    def to_json(self) -> dict:
        return {
            "ok": True,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if not (f.metadata.get("optional") and getattr(self, f.name) is None)
            },
        }


def optional_field():
    return dataclasses.field(default=None, metadata={"optional": True})


def as_paths(inputs: PathLike | Sequence[PathLike]) -> list[str]:
    return [str(inputs)] if isinstance(inputs, (str, Path)) else [str(p) for p in inputs]


def weighted_sources(sources) -> tuple[list[str], list[str | None]]:
    """Paths and weights (as given, spelled as text: "0.25", "1/3") of `sources`: a path, a
    sequence of paths or of (path, weight) pairs, or a mapping path -> weight."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    items = (
        sources.items() if isinstance(sources, Mapping) else [s if isinstance(s, tuple) else (s, None) for s in sources]
    )
    paths, weights = [], []
    for path, weight in items:
        if weight is not None:
            weight = str(weight) if isinstance(weight, (str, numbers.Rational)) else repr(float(weight))
        paths.append(str(path))
        weights.append(weight)
    return paths, weights
