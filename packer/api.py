"""tokpack's Python API (docs/API.md): `pack`, `shuffle`, `validate`, `stage`, `inspect`, `plan`.

Each takes paths or fsspec URLs and returns a dataclass holding the facts the command prints
under `--json` (`to_json()`), and no text for humans. This module imports no heavy dependency:
the stages are imported when called.
"""

from __future__ import annotations

import dataclasses
import os
import functools
import inspect as _signature
from collections.abc import Sequence
from typing import TYPE_CHECKING


# Defined in the leaf tokpack.packer.shared (the stages import it, not this module); kept importable from here.
from tokpack.packer.shared import ExecutorConfig, PathLike, Result, as_paths, optional_field, weighted_sources  # noqa: F401
from tokpack.formats.constants import DEFAULT_SHARD_TOKENS

if TYPE_CHECKING:  # the stages build their results; importing them here would import their dependencies
    from tokpack.packer.inspection import InspectResult
    from tokpack.packer.packing import PackResult
    from tokpack.packer.planning import PlanResult


def _epochs(value, name):
    """shuffle's `epochs`: a count (>= 1) or a sequence of epoch numbers (>= 0)."""
    from tokpack.formats import arguments

    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return arguments.whole(value, name, least=1)
    return [arguments.whole(e, f"{name}[{i}]", optional=False) for i, e in enumerate(value)]


def _paths(value, name):
    """A path, or a sequence of paths (str or os.PathLike), as the functions taking them accept."""
    from tokpack.formats.errors import TokpackError

    items = [value] if isinstance(value, (str, os.PathLike)) else value if isinstance(value, Sequence) else None
    if items is None or not all(isinstance(v, (str, os.PathLike)) for v in items):
        raise TokpackError("must be a path or a sequence of paths", where=name, found=repr(value)[:80])
    return value


def _executor(value, name):
    from tokpack.formats import arguments
    from tokpack.formats.errors import TokpackError

    if value is None:
        return None
    if not isinstance(value, ExecutorConfig):
        raise TokpackError(f"{name} must be an ExecutorConfig", where=name, found=repr(value))
    arguments.whole(value.workers, f"{name}.workers", least=1, optional=False)
    arguments.whole(value.tasks, f"{name}.tasks", least=1)
    return value


_REQUIRED = {"optional": False}
_COUNT = {n: ("whole", {"least": n}) for n in (0, 1)}
_TEXT, _FLAG, _MAYBE_FLAG = ("text", {}), ("flag", {}), ("flag", {"optional": True})

# Each public function's arguments, checked as the CLI's option types check the same options
# (packer/cli.py): the same ranges, unit strings through the same parsers (tokpack.formats.arguments:
# a check's name there, and its keywords). An argument not named here (paths, sources, a log
# callable) is checked by the stage that uses it.
ARGUMENTS = {
    "pack": {
        "input_format": ("text", _REQUIRED),
        "column": _TEXT,
        "dtype": _TEXT,
        "tokenizer": _TEXT,
        "eos_id": _COUNT[0],
        "vocab_size": _COUNT[1],
        "overwrite": _FLAG,
        "shard_tokens": ("tokens", {"least": 1, **_REQUIRED}),
        "executor": _executor,
        "link": _FLAG,
    },
    "shuffle": {
        "seq_len": _COUNT[1],
        "seed": ("whole", {"least": None}),
        "epochs": _epochs,
        "samples": _COUNT[1],
        "tokens": ("tokens", {}),
        "shard_samples": _COUNT[1],
        "memory": ("size", _REQUIRED),
        "jitter": _FLAG,
        "executor": _executor,
        "progress": _MAYBE_FLAG,
        "packing": _TEXT,
        "pad_id": _COUNT[0],
        "holdout": _TEXT,
    },
    "validate": {
        "dirs": _paths,
        "against": _paths,
        "quick": _FLAG,
        "workers": ("whole", {"least": 1, **_REQUIRED}),
        "show_progress": _MAYBE_FLAG,
    },
    "stage": {
        "workers": ("whole", {"least": 1, **_REQUIRED}),
        "epochs": _TEXT,
        "ranks": _TEXT,
        "micro_batch": ("whole", {"least": 1, **_REQUIRED}),
        "world_size": _COUNT[1],
        "node": _TEXT,
        "ranks_per_node": _COUNT[1],
        "start_sample": ("whole", _REQUIRED),
        "memory": ("size", {}),
    },
    "inspect": {
        "batch_size": _COUNT[1],
        "batches": ("whole", {"least": 1, **_REQUIRED}),
        "seq_len": _COUNT[1],
        "epoch": _COUNT[0],
        "memory": ("size", {}),
        "documents_per_row": _FLAG,
    },
}


def checked(command: str, given: dict) -> dict:
    """`given` (keyword -> value) with each argument of `command` checked and parsed (an int
    for "3M" or "64MiB"), or one TokpackError line naming the argument."""
    from tokpack.formats import arguments

    out = dict(given)
    for name, check in ARGUMENTS[command].items():
        if name in out:
            out[name] = (
                check(out[name], name) if callable(check) else getattr(arguments, check[0])(out[name], name, **check[1])
            )
    return out


def _checks(command: str):
    """Checks the decorated function's arguments (ARGUMENTS[command]) before it runs."""

    def wrap(fn):
        sig = _signature.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # an unknown keyword stays Python's TypeError
            bound.apply_defaults()
            return fn(**checked(command, bound.arguments))

        return run

    return wrap


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
    packing: str  # the run's packing (tokpack.shuffle.packings); each epochs_detail has its figures ("packing")
    holdout: dict | None = optional_field()  # RUN/holdout/ when this command wrote it: as an epochs_detail entry


@_checks("pack")
def pack(
    inputs: PathLike | Sequence[PathLike],
    output: PathLike,
    *,
    input_format: str = "auto",
    column: str | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    overwrite: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    executor: ExecutorConfig | None = None,
    log=None,
    scratch: PathLike | None = None,
    link: bool = False,
) -> PackResult:
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
        return pack_source(
            as_paths(inputs),
            local_output,
            input_format=input_format,
            column=column,
            dtype=dtype,
            tokenizer=tokenizer,
            eos_id=eos_id,
            vocab_size=vocab_size,
            overwrite=overwrite,
            shard_tokens=shard_tokens,
            config=executor,
            log=log,
            to=to,
            link=link,
        )


@_checks("shuffle")
def shuffle(
    sources=None,
    output: PathLike | None = None,
    *,
    seq_len: int | None = None,
    seed: int | None = None,
    epochs: int | Sequence[int] | None = None,
    samples: int | None = None,
    tokens: int | None = None,
    shard_samples: int | None = None,
    memory: int = 4 << 30,
    jitter: bool = False,
    executor: ExecutorConfig | None = None,
    log=None,
    progress: bool | None = None,
    schedule: PathLike | None = None,
    scratch: PathLike | None = None,
    packing: str | None = None,
    pad_id: int | None = None,
    like: PathLike | None = None,
    holdout: str | None = None,
) -> ShuffleResult:
    """Writes globally shuffled epochs of `seq_len + 1` tokens from packed sources into the run
    directory `output`. `sources`: a path or URL, a list of them, or a mapping path -> weight
    (a number, or text such as "1/3"). `epochs`: a count (epochs 0..N-1) or the epoch numbers
    [default: epoch 0; with a schedule, all its epochs]. `schedule`: a schedule YAML file
    (docs/COMMANDS.md, "Schedules") that declares the sources, seq_len, seed and stages instead
    (pass sources=None). A URL `output` is written under `scratch` (as for `pack`), out-of-core
    buckets included, and each shard is sent to the store once written. `packing`: a name
    tokpack.shuffle.packings holds (None: its default, windows of the concatenated documents;
    docs/COMMANDS.md, "Best-fit packing"), `pad_id` best-fit's padding token [default: EOS].
    `like`: a run directory whose own settings (sources, weights, seq_len, seed, samples,
    jitter, shard_samples, packing, pad_id, or its schedule file) write the epochs asked for,
    into `output` [default: that run]; none of those may be given too, and `epochs` must be
    (but for a scheduled run: every epoch of its schedule) (tokpack.shuffle.like). `holdout`:
    whole documents of each source set aside from every epoch, a fraction of its documents
    ("0.01", "1%") or a token count ("5M"), chosen from the seed, and written once to
    `output`/holdout/ (tokpack.shuffle.holdout; either packing)."""
    from tokpack.packer.executors import local_paths, pass_runner, runs_in_process
    from tokpack.shuffle.run import shuffle_run
    from tokpack.formats.errors import TokpackError
    from tokpack.shuffle.packings import named
    from tokpack.shuffle.schedule import epoch_numbers, read_schedule

    if like is not None:
        from tokpack.shuffle.like import apply_like

        settings = apply_like(
            {
                "like": like,
                "output": output,
                "epochs": epochs,
                "sources": sources,
                "seq_len": seq_len,
                "seed": seed,
                "samples": samples,
                "tokens": tokens,
                "shard_samples": shard_samples,
                "jitter": jitter,
                "schedule": schedule,
                "packing": packing,
                "pad_id": pad_id,
                "holdout": holdout,
            }
        )
        sources, output, seq_len, seed = settings["sources"], settings["output"], settings["seq_len"], settings["seed"]
        samples, tokens, shard_samples, jitter = (settings[k] for k in ("samples", "tokens", "shard_samples", "jitter"))
        schedule, packing, pad_id, holdout = (settings[k] for k in ("schedule", "packing", "pad_id", "holdout"))
    if output is None:
        raise TokpackError("no output given", where="output", hint="give the run directory to write (or like=RUN)")
    config = executor or ExecutorConfig()
    scheduled = read_schedule(schedule) if schedule is not None else None
    if scheduled is None and not sources:
        raise TokpackError("no sources given", hint="give the packed sources, or schedule=FILE")
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    if epochs is None and scheduled is None:
        epochs = 1
    named(packing)  # an unknown packing is refused before any source is fetched
    with local_paths(paths, str(output), scratch and str(scratch), runs_in_process(config)) as (
        local_sources,
        local_output,
        to,
    ):
        summary = shuffle_run(
            local_sources,
            local_output,
            weights=weights,
            seq_len=seq_len,
            seed=seed,
            epochs=epoch_numbers(epochs),
            samples=samples,
            tokens=tokens,
            shard_samples=shard_samples,
            memory=memory,
            jitter=jitter,
            log=log,
            workers=config.workers,
            tasks=config.tasks,
            run_passes=pass_runner(config),
            progress=progress,
            schedule=scheduled,
            given=paths,
            to=to,
            packing=packing,
            pad_id=pad_id,
            holdout=holdout,
        )
    return ShuffleResult(**summary)


@_checks("validate")
def validate(
    dirs: PathLike | Sequence[PathLike],
    *,
    quick: bool = False,
    against: PathLike | Sequence[PathLike] = (),
    workers: int = 1,
    show_progress: bool | None = None,
):
    """Checks tokpack directories (sources, runs, epochs); `against`: the packed sources an
    epoch was shuffled from, to recompute its content and prove its order. Returns a
    tokpack.packer.validation.ValidateResult."""
    from tokpack.packer.validation import validate_all
    from tokpack.shuffle.packings import replay as replay_hashes

    def source_rows(epoch_dir, manifest, work):  # a slice of a --to-nodes RUN, proven from the sources
        from tokpack.packer.replacement import DEFAULT_MEMORY, SourceRows

        return SourceRows(epoch_dir, manifest, DEFAULT_MEMORY, work)

    return validate_all(
        as_paths(dirs),
        quick=quick,
        against=as_paths(against),
        workers=workers,
        show_progress=show_progress,
        replay=replay_hashes,
        source_rows=source_rows,
    )


@_checks("stage")
def stage(
    directory: PathLike,
    dest: PathLike,
    *,
    workers: int = 4,
    epochs: str | None = None,
    ranks: str | None = None,
    micro_batch: int = 1,
    world_size: int | None = None,
    node: str | None = None,
    ranks_per_node: int | None = None,
    start_sample: int = 0,
    log=None,
    shards_of: str | None = None,
    memory: int | None = None,
):
    """Copies a tokpack directory (any fsspec URL) to the local `dest`, verifying every file, a
    StageResult. `shards_of` ('r/W'): only the whole epoch shards ranks r of W read. With
    `world_size` or `node`: the node slice of `ranks` A..B of a run (tokpack.packer.slicing), a
    SliceResult. `ranks='r/W'` without them is the old spelling of `shards_of` (docs/COMMANDS.md, "Words").
    `memory`: a replacement node's budget (`node` on a RUN of shuffle --to-nodes), refused elsewhere."""
    from tokpack.packer.staging import whole_shard_ranks

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node)
    if node is not None and world_size is None and ranks is None and not start_sample:
        from tokpack.packer.replacement import exchanged_run, stage_replacement

        if exchanged_run(directory):  # a RUN of shuffle --to-nodes: no token file, rows rebuilt from the sources
            return stage_replacement(
                directory,
                dest,
                node=node,
                ranks_per_node=ranks_per_node,
                micro_batch=micro_batch,
                epochs=epochs,
                log=log,
                memory=memory,
            )
    if memory is not None:  # a copy or a slice of a materialised run streams its files: no budget to keep
        from tokpack.formats.errors import TokpackError

        raise TokpackError(
            "--memory applies only to a replacement node",
            where="--memory",
            hint="give it with --node on a RUN of `tokpack shuffle --to-nodes`, or leave it out",
        )
    if world_size is not None or node is not None:
        from tokpack.packer.slicing import stage_slice

        return stage_slice(
            str(directory),
            dest,
            ranks=ranks,
            world_size=world_size,
            micro_batch=micro_batch,
            node=node,
            ranks_per_node=ranks_per_node,
            start_sample=start_sample,
            epochs=epochs,
            workers=workers,
            log=log,
        )
    from tokpack.packer.staging import stage as stage_copy

    return stage_copy(
        str(directory), dest, workers=workers, epochs=epochs, ranks=ranks, micro_batch=micro_batch, log=log
    )


@_checks("inspect")
def inspect(
    directory: PathLike,
    *,
    batch_size: int | None = None,
    batches: int = 64,
    plot: PathLike | None = None,
    seq_len: int | None = None,
    epoch: int | None = None,
    memory: int | None = None,
    documents_per_row: bool = False,
) -> InspectResult:
    """What a source, run or epoch holds and the batch diversity before and after the shuffle.
    `memory`: the budget (bytes) of a best-fit epoch's plan and row table [default: 256 MiB].
    `documents_per_row`: also the largest document count of a row of the epoch (the
    `max_documents` it takes), from one pass over its tokens."""
    from tokpack.packer.inspection import inspect as inspect_dir

    return inspect_dir(
        directory,
        batch_size=batch_size,
        batches=batches,
        plot=plot,
        seq_len=seq_len,
        epoch=epoch,
        memory=memory,
        documents_per_row=documents_per_row,
    )


def plan(command: str, *args, **kwargs) -> PlanResult:
    """What `pack`, `shuffle` or `stage` (`command`) would do with these arguments (that function's,
    plus `disk_mbps`), writing nothing: tasks, files, bytes per pass, space, manifest sizes and a
    predicted wall time (tokpack.packer.planning)."""
    from tokpack.formats import arguments
    from tokpack.formats.errors import TokpackError
    from tokpack.packer import planning

    planner = (
        {"pack": planning.plan_pack, "shuffle": planning.plan_shuffle, "stage": planning.plan_stage}.get(command)
        if isinstance(command, str)
        else None
    )
    if planner is None:
        raise TokpackError("no such command to plan", where="command", expected="pack, shuffle or stage", found=command)
    bound = _signature.signature(planner).bind(*args, **kwargs)
    given = checked(command, bound.arguments)
    if "disk_mbps" in given:
        given["disk_mbps"] = arguments.positive_number(given["disk_mbps"], "disk_mbps")
    return planner(**given)
