"""tokpack's Python API (docs/API.md): `pack`, `shuffle`, `validate`, `stage`, `inspect`, `plan`.

Each takes paths or fsspec URLs and returns a dataclass holding the facts the command prints
under `--json` (`to_json()`), and no text for humans. This module imports no heavy dependency:
the stages are imported when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

# Defined in the leaf tokpack.packer.shared (the stages import it, not this module); kept importable from here.
from tokpack.packer.shared import ExecutorConfig, PathLike, Result, as_paths, optional_field, weighted_sources  # noqa: F401

if TYPE_CHECKING:  # the stages build their results; importing them here would import their dependencies
    from tokpack.packer.inspection import InspectResult
    from tokpack.packer.packing import PackResult
    from tokpack.packer.planning import PlanResult
    from tokpack.packer.staging import StageResult


@dataclasses.dataclass
class ShuffleResult(Result):
    output: str
    epochs: list[int]  # every epoch the run holds
    written: list[int]
    skipped: list[int]  # complete already: reused as they were
    reused_shards: int  # shards of the epochs written that an earlier, interrupted command had written
    samples_per_epoch: int | None  # None when the epochs differ in size (a schedule's stages): see epoch_samples
    epoch_samples: list[int]  # per epoch of `epochs`
    seq_len: int
    shard_samples: int
    path: str  # "in-memory", "out-of-core", both, or "none"
    bytes_written: int  # the sample bytes of the shards this command wrote (not their small index files)
    seconds: float
    mb_per_s: float | None  # bytes_written / seconds; None when nothing was written
    epochs_detail: list[dict]  # per epoch written: path, stage, samples, shards, shards_reused, bytes_written,
    # hash, per-source counts
    warnings: list[str]  # one per source an epoch repeats windows of


def pack(inputs: PathLike | Sequence[PathLike], output: PathLike, *, input_format: str = "auto",
         column: str | None = None, dtype: str | None = None, tokenizer: str | None = None, eos_id: int | None = None,
         vocab_size: int | None = None, overwrite: bool = False, shard_tokens: int = 1 << 30,
         executor: ExecutorConfig | None = None, log=None, scratch: PathLike | None = None,
         link: bool = False) -> PackResult:
    """Packs tokenized inputs (files, folders or URLs) into one packed source at `output`.
    URL inputs are read where they are (streamed). A URL output is written under `scratch` (a
    local or shared folder; default $TOKPACK_STAGE_DIR, else the system temp dir) and each shard
    is sent to the store once written (tokpack.packer.executors.local_paths). `link`: an input
    that already is its shard's bytes (datatrove) is hard-linked or reflinked once verified,
    not copied (docs/COMMANDS.md, "Linking instead of copying")."""
    from tokpack.packer.executors import local_paths, runs_in_process
    from tokpack.packer.packing import pack as pack_source

    in_process = runs_in_process(executor or ExecutorConfig())
    with local_paths([], str(output), scratch and str(scratch), in_process, "pack") as (_, local_output, to):
        return pack_source(as_paths(inputs), local_output, input_format=input_format, column=column, dtype=dtype,
                           tokenizer=tokenizer, eos_id=eos_id, vocab_size=vocab_size, overwrite=overwrite,
                           shard_tokens=shard_tokens, config=executor, log=log, to=to, link=link)


def shuffle(sources, output: PathLike, *, seq_len: int | None = None, seed: int | None = None,
            epochs: int | Sequence[int] | None = None, samples: int | None = None, tokens: int | None = None,
            shard_samples: int | None = None, memory: int = 4 << 30, jitter: bool = False,
            executor: ExecutorConfig | None = None, log=None, progress: bool | None = None,
            schedule: PathLike | None = None, scratch: PathLike | None = None, packing: str | None = None,
            pad_id: int | None = None) -> ShuffleResult:
    """Writes globally shuffled epochs of `seq_len + 1` tokens from packed sources into the run
    directory `output`. `sources`: a path or URL, a list of them, or a mapping path -> weight
    (a number, or text such as "1/3"). `epochs`: a count (epochs 0..N-1) or the epoch numbers
    [default: epoch 0; with a schedule, all its epochs]. `schedule`: a schedule YAML file
    (docs/COMMANDS.md, "Schedules") that declares the sources, seq_len, seed and stages instead
    (pass sources=None). A URL `output` is written under `scratch` (as for `pack`), out-of-core
    buckets included, and each shard is sent to the store once written. `packing`: a name
    tokpack.shuffle.packings holds (None: its default, windows of the concatenated documents;
    docs/COMMANDS.md, "Best-fit packing"), `pad_id` best-fit's padding token [default: EOS]."""
    from tokpack.packer.executors import local_paths, pass_runner, runs_in_process
    from tokpack.shuffle.run import shuffle_run
    from tokpack.formats.errors import TokpackError
    from tokpack.shuffle.packings import named
    from tokpack.shuffle.schedule import epoch_numbers, read_schedule

    config = executor or ExecutorConfig()
    scheduled = read_schedule(schedule) if schedule is not None else None
    if scheduled is None and not sources:
        raise TokpackError("no sources given", hint="give the packed sources, or schedule=FILE")
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    if epochs is None and scheduled is None:
        epochs = 1
    named(packing)  # an unknown packing is refused before any source is fetched
    with local_paths(paths, str(output), scratch and str(scratch), runs_in_process(config)) as (
            local_sources, local_output, to):
        summary = shuffle_run(local_sources, local_output, weights=weights, seq_len=seq_len, seed=seed,
                              epochs=epoch_numbers(epochs),
                              samples=samples, tokens=tokens, shard_samples=shard_samples, memory=memory,
                              jitter=jitter, log=log, workers=config.workers, tasks=config.tasks,
                              run_passes=pass_runner(config), progress=progress, schedule=scheduled,
                              given=paths, to=to, packing=packing, pad_id=pad_id)
    return ShuffleResult(**summary)


def validate(dirs: PathLike | Sequence[PathLike], *, quick: bool = False,
             against: PathLike | Sequence[PathLike] = (), workers: int = 1, show_progress: bool | None = None):
    """Checks tokpack directories (sources, runs, epochs); `against`: the packed sources an
    epoch was shuffled from, to recompute its content and prove its order. Returns a
    tokpack.packer.validation.ValidateResult."""
    from tokpack.packer.validation import validate_all
    from tokpack.shuffle.packings import replay as replay_hashes

    return validate_all(as_paths(dirs), quick=quick, against=as_paths(against), workers=workers,
                        show_progress=show_progress, replay=replay_hashes)


def stage(directory: PathLike, dest: PathLike, *, workers: int = 4, epochs: str | None = None,
          ranks: str | None = None, micro_batch: int = 1, world_size: int | None = None, node: str | None = None,
          ranks_per_node: int | None = None, start_sample: int = 0, log=None, shards_of: str | None = None):
    """Copies a tokpack directory (any fsspec URL) to the local `dest`, verifying every file, a
    StageResult. `shards_of` ('r/W'): only the whole epoch shards ranks r of W read. With
    `world_size` or `node`: the node slice of `ranks` A..B of a run (tokpack.packer.slicing), a
    SliceResult. `ranks='r/W'` without them is the old spelling of `shards_of` (docs/COMMANDS.md, "Words")."""
    from tokpack.packer.staging import whole_shard_ranks

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node)
    if world_size is not None or node is not None:
        from tokpack.packer.slicing import stage_slice

        return stage_slice(str(directory), dest, ranks=ranks, world_size=world_size, micro_batch=micro_batch,
                           node=node, ranks_per_node=ranks_per_node, start_sample=start_sample, epochs=epochs,
                           workers=workers, log=log)
    from tokpack.packer.staging import stage as stage_copy

    return stage_copy(str(directory), dest, workers=workers, epochs=epochs, ranks=ranks, micro_batch=micro_batch,
                      log=log)


def inspect(directory: PathLike, *, batch_size: int | None = None, batches: int = 64, plot: PathLike | None = None,
            seq_len: int | None = None, epoch: int | None = None, memory: int | None = None) -> InspectResult:
    """What a source, run or epoch holds and the batch diversity before and after the shuffle.
    `memory`: the budget (bytes) of a best-fit epoch's plan and row table [default: 256 MiB]."""
    from tokpack.packer.inspection import inspect as inspect_dir

    return inspect_dir(directory, batch_size=batch_size, batches=batches, plot=plot, seq_len=seq_len, epoch=epoch,
                       memory=memory)


def plan(command: str, *args, **kwargs) -> PlanResult:
    """What `pack`, `shuffle` or `stage` (`command`) would do with these arguments (that function's,
    plus `disk_mbps`), writing nothing: tasks, files, bytes per pass, space, manifest sizes and a
    predicted wall time (tokpack.packer.planning)."""
    from tokpack.formats.errors import TokpackError
    from tokpack.packer import planning

    planner = {"pack": planning.plan_pack, "shuffle": planning.plan_shuffle, "stage": planning.plan_stage}.get(command)
    if planner is None:
        raise TokpackError("no such command to plan", where="command", expected="pack, shuffle or stage", found=command)
    return planner(*args, **kwargs)
