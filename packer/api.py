"""tokpack's Python API (docs/API.md): `pack`, `shuffle`, `validate`, `stage`, `inspect`, `plan`.

Each takes paths or fsspec URLs and returns a dataclass holding the facts the command prints
under `--json` (`to_json()`), and no text for humans. This module imports no heavy dependency:
the stages are imported when called.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the stages build their results; importing them here would import their dependencies
    from packer.inspection import InspectResult
    from packer.packing import PackResult
    from packer.planning import PlanResult
    from packer.staging import StageResult

PathLike = str | Path


@dataclasses.dataclass
class ExecutorConfig:
    """How and where tasks run: here (local) or through datatrove's Slurm or Ray executor."""

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
    """A command's result. `to_json()` is what `--json` prints: the fields, less the optional
    ones (metadata optional=True) that are None."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.metadata.get("optional") and getattr(self, f.name) is None)}


def optional_field():
    return dataclasses.field(default=None, metadata={"optional": True})


@dataclasses.dataclass
class ShuffleResult(Result):
    output: str
    epochs: list[int]  # every epoch the run holds
    written: list[int]
    skipped: list[int]  # complete already
    samples_per_epoch: int
    seq_len: int
    shard_samples: int
    path: str  # "in-memory", "out-of-core", both, or "none"
    seconds: float
    epochs_detail: list[dict]  # per epoch written: path, samples, shards, hash, per-source counts
    warnings: list[str]  # one per source an epoch repeats windows of


def as_paths(inputs: PathLike | Sequence[PathLike]) -> list[str]:
    return [str(inputs)] if isinstance(inputs, (str, Path)) else [str(p) for p in inputs]


def pack(inputs: PathLike | Sequence[PathLike], output: PathLike, *, input_format: str = "auto",
         column: str | None = None, dtype: str | None = None, tokenizer: str | None = None, eos_id: int | None = None,
         vocab_size: int | None = None, overwrite: bool = False, shard_tokens: int = 1 << 30,
         executor: ExecutorConfig | None = None, log=None, scratch: PathLike | None = None) -> PackResult:
    """Packs tokenized inputs (files, folders or URLs) into one packed source at `output`.
    URL inputs are read where they are (streamed). A URL output is written under `scratch` (a
    local or shared folder; default $TOKPACK_STAGE_DIR, else the system temp dir) and each shard
    is sent to the store once written (packer.executors.local_paths)."""
    from packer.executors import local_paths, runs_in_process
    from packer.packing import pack as pack_source

    in_process = runs_in_process(executor or ExecutorConfig())
    with local_paths([], str(output), scratch and str(scratch), in_process, "pack") as (_, local_output, outbox):
        return pack_source(as_paths(inputs), local_output, input_format=input_format, column=column, dtype=dtype,
                           tokenizer=tokenizer, eos_id=eos_id, vocab_size=vocab_size, overwrite=overwrite,
                           shard_tokens=shard_tokens, config=executor, log=log, outbox=outbox)


def weighted_sources(sources) -> tuple[list[str], list[str | None]]:
    """Paths and weights (as given, spelled as text: "0.25", "1/3") of `sources`: a path, a
    sequence of paths or of (path, weight) pairs, or a mapping path -> weight."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    items = sources.items() if isinstance(sources, Mapping) else [s if isinstance(s, tuple) else (s, None)
                                                                  for s in sources]
    paths, weights = [], []
    for path, weight in items:
        paths.append(str(path))
        weights.append(None if weight is None else str(weight) if isinstance(weight, (str, numbers.Rational))
                       else repr(float(weight)))
    return paths, weights


def shuffle(sources, output: PathLike, *, seq_len: int | None = None, seed: int | None = None,
            epochs: int | Sequence[int] | None = None, samples: int | None = None, tokens: int | None = None,
            shard_samples: int | None = None, memory: int = 4 << 30, jitter: bool = False,
            executor: ExecutorConfig | None = None, log=None, progress: bool | None = None,
            schedule: PathLike | None = None, scratch: PathLike | None = None) -> ShuffleResult:
    """Writes globally shuffled epochs of `seq_len + 1` tokens from packed sources into the run
    directory `output`. `sources`: a path or URL, a list of them, or a mapping path -> weight
    (a number, or text such as "1/3"). `epochs`: a count (epochs 0..N-1) or the epoch numbers
    [default: epoch 0; with a schedule, all its epochs]. `schedule`: a schedule YAML file
    (docs/COMMANDS.md, "Schedules") that declares the sources, seq_len, seed and stages instead
    (pass sources=None). A URL `output` is written under `scratch` (as for `pack`), out-of-core
    buckets included, and each shard is sent to the store once written."""
    from packer.executors import local_paths, pass_runner, runs_in_process
    from shuffle.run import shuffle_run
    from formats.errors import TokpackError
    from shuffle.schedule import read_schedule

    config = executor or ExecutorConfig()
    scheduled = read_schedule(schedule) if schedule is not None else None
    if scheduled is None and not sources:
        raise TokpackError("no sources given", hint="give the packed sources, or schedule=FILE")
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    if epochs is None and scheduled is None:
        epochs = 1
    with local_paths(paths, str(output), scratch and str(scratch), runs_in_process(config)) as (
            local_sources, local_output, outbox):
        summary = shuffle_run(local_sources, local_output, weights=weights, seq_len=seq_len, seed=seed,
                              epochs=list(range(epochs)) if isinstance(epochs, int) else epochs and list(epochs),
                              samples=samples, tokens=tokens, shard_samples=shard_samples, memory=memory,
                              jitter=jitter, log=log, workers=config.workers, tasks=config.tasks,
                              run_passes=pass_runner(config), progress=progress, schedule=scheduled,
                              given=paths, outbox=outbox)
    return ShuffleResult(**summary)


def validate(dirs: PathLike | Sequence[PathLike], *, quick: bool = False,
             against: PathLike | Sequence[PathLike] = (), workers: int = 1, show_progress: bool | None = None):
    """Checks tokpack directories (sources, runs, epochs); `against`: the packed sources an
    epoch was shuffled from, to recompute its content. Returns a formats.dir_checks.ValidateResult."""
    from formats.dir_checks import validate_all
    from shuffle.plan import expected_multiset_hash

    return validate_all(as_paths(dirs), quick=quick, against=as_paths(against), workers=workers,
                        show_progress=show_progress, expected_multiset_hash=expected_multiset_hash)


def stage(directory: PathLike, dest: PathLike, *, workers: int = 4, epochs: str | None = None,
          ranks: str | None = None, micro_batch: int = 1, world_size: int | None = None, node: str | None = None,
          ranks_per_node: int | None = None, start_sample: int = 0, log=None):
    """Copies a tokpack directory (any fsspec URL) to the local `dest`, verifying every file. With
    `world_size` or `node`: the node slice of ranks A..B of a run (packer.slicing), a SliceResult."""
    if world_size is not None or node is not None:
        from packer.slicing import stage_slice

        return stage_slice(str(directory), dest, ranks=ranks, world_size=world_size, micro_batch=micro_batch,
                           node=node, ranks_per_node=ranks_per_node, start_sample=start_sample, epochs=epochs,
                           workers=workers, log=log)
    from packer.staging import stage as stage_copy

    return stage_copy(str(directory), dest, workers=workers, epochs=epochs, ranks=ranks, micro_batch=micro_batch,
                      log=log)


def inspect(directory: PathLike, *, batch_size: int | None = None, batches: int = 64, plot: PathLike | None = None,
            seq_len: int | None = None, epoch: int | None = None) -> InspectResult:
    """What a source, run or epoch holds and the batch diversity before and after the shuffle."""
    from packer.inspection import inspect as inspect_dir

    return inspect_dir(directory, batch_size=batch_size, batches=batches, plot=plot, seq_len=seq_len, epoch=epoch)


def plan(command: str, *args, **kwargs) -> PlanResult:
    """What `pack`, `shuffle` or `stage` (`command`) would do with these arguments (that function's,
    plus `disk_mbps`), writing nothing: tasks, files, bytes per pass, space, manifest sizes and a
    predicted wall time (packer.planning)."""
    from formats.errors import TokpackError
    from packer import planning

    planner = {"pack": planning.plan_pack, "shuffle": planning.plan_shuffle, "stage": planning.plan_stage}.get(command)
    if planner is None:
        raise TokpackError("no such command to plan", where="command", expected="pack, shuffle or stage", found=command)
    return planner(*args, **kwargs)
