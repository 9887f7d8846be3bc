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
from tokpack.shuffle.spec import DEFAULT_MEMORY
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
        "append_eos": _FLAG,
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
        "ranks_per_node": _COUNT[1],
        "micro_batch": _COUNT[1],
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
    append_eos: bool = False,
) -> PackResult:
    """Packs tokenized inputs (files, folders or URLs) into one packed source at `output`.
    URL inputs are read where they are (streamed). A URL output is written under `scratch` (a
    local or shared folder; default $TOKPACK_STAGE_DIR, else the system temp dir) and each shard
    is sent to the store once written (tokpack.packer.executors.local_paths). `link`: an input
    that already is its shard's bytes (datatrove) is hard-linked or reflinked once verified,
    not copied (docs/COMMANDS.md, "Linking instead of copying"). An input whose documents all end
    with one id that is not `eos_id` is refused (a wrong `eos_id`) unless `append_eos` is True:
    then each gets an EOS appended, as a document lacking one always does."""
    from tokpack.packer.executors import local_paths, runs_in_process
    from tokpack.packer.packing import PackOptions, pack as pack_source

    in_process = runs_in_process(executor or ExecutorConfig())
    with local_paths([], str(output), scratch and str(scratch), in_process, "pack") as (_, local_output, to):
        options = PackOptions(
            input_format=input_format,
            column=column,
            dtype=dtype,
            tokenizer=tokenizer,
            eos_id=eos_id,
            vocab_size=vocab_size,
            overwrite=overwrite,
            shard_tokens=shard_tokens,
            link=link,
            append_eos=append_eos,
        )
        return pack_source(as_paths(inputs), local_output, options, config=executor, log=log, to=to)


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
    memory: int = DEFAULT_MEMORY,
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
    to_nodes: PathLike | None = None,
    ranks_per_node: int | None = None,
    micro_batch: int | None = None,
    keep_sources: PathLike | None = None,
) -> ShuffleResult | dict:
    """Writes globally shuffled epochs of `seq_len + 1` tokens from packed sources into the run
    directory `output`. `sources`: a path or URL, a list of them, or a mapping path -> weight
    (a number, or text such as "1/3"). `epochs`: a count (epochs 0..N-1) or the epoch numbers
    [default: epoch 0; with a schedule, all its epochs]. `schedule`: a schedule YAML file
    (docs/COMMANDS.md, "Schedules") that declares the sources, seq_len, seed and stages instead
    (pass sources=None; a setting it declares may not be given too). A URL `output` is written
    under `scratch` (as for `pack`), out-of-core buckets included, and each shard is sent to the
    store once written. `packing`: a name tokpack.shuffle.packings holds (None: its default,
    windows of the concatenated documents; docs/COMMANDS.md, "Best-fit packing"), `pad_id`
    best-fit's padding token [default: EOS].
    `like`: a run directory whose own settings (sources, weights, seq_len, seed, samples,
    jitter, shard_samples, packing, pad_id, or its schedule file) write the epochs asked for,
    into `output` [default: that run]; none of those may be given too, and `epochs` must be
    (but for a scheduled run: every epoch of its schedule) (tokpack.shuffle.like). `holdout`:
    whole documents of each source set aside from every epoch, a fraction of its documents
    ("0.01", "1%") or a token count ("5M"), chosen from the seed, and written once to
    `output`/holdout/ (tokpack.shuffle.holdout; either packing).
    `to_nodes`: a node-local folder (`{node}` is replaced by n): run under MPI (one process per
    node; docs/COMMANDS.md, "Straight to the nodes"), each process writes its node's slice of
    each epoch there, as `stage(output, to_nodes, node="n/N")` would, and `output` gets only the
    manifests and row hashes; needs `ranks_per_node` and `micro_batch`; `keep_sources`: a
    node-local folder keeping the source shards the node reads, for later epochs. It returns this
    process's summary (a dict: node, nodes, ranks, dest, epochs...), not a ShuffleResult."""
    from tokpack.packer.executors import local_paths, pass_runner, runs_in_process
    from tokpack.shuffle.run import shuffle_run
    from tokpack.shuffle.packings import named

    spec = shuffle_spec(locals())
    if spec.nodes is not None:
        return _shuffle_to_nodes(spec, scratch, log)
    if ranks_per_node is not None or micro_batch is not None or keep_sources is not None:
        from tokpack.formats.errors import TokpackError

        raise TokpackError(
            "ranks_per_node, micro_batch and keep_sources go with to_nodes", where="to_nodes", hint="give to_nodes=DEST"
        )
    config = executor or ExecutorConfig()
    named(spec.packing)  # an unknown packing is refused before any source is fetched
    with local_paths(list(spec.sources), spec.output, scratch and str(scratch), runs_in_process(config)) as (
        local_sources,
        local_output,
        to,
    ):
        summary = shuffle_run(
            spec,
            local_output,
            local=local_sources,
            log=log,
            workers=config.workers,
            tasks=config.tasks,
            run_passes=pass_runner(config),
            progress=progress,
            to=to,
        )
    return ShuffleResult(**summary)


# shuffle's keywords that are the shuffle's settings (tokpack.shuffle.spec), as they are given
_SETTINGS = (
    "seq_len",
    "seed",
    "samples",
    "tokens",
    "shard_samples",
    "memory",
    "jitter",
    "packing",
    "pad_id",
    "holdout",
)


def shuffle_spec(values: dict):
    """The ShuffleSpec of `shuffle`'s (or `plan("shuffle")`'s) keywords `values`, checked already:
    --like's run read (tokpack.shuffle.like), the schedule file read. The one place the API's and
    the CLI's keywords become a spec."""
    from tokpack.formats.errors import TokpackError
    from tokpack.shuffle.like import like_spec
    from tokpack.shuffle.schedule import epoch_numbers, read_schedule
    from tokpack.shuffle.spec import NodesSpec, ShuffleSpec

    def text(key):
        return None if values.get(key) is None else str(values[key])

    sources, schedule = values.get("sources"), values.get("schedule")
    nodes = None
    if values.get("to_nodes") is not None:
        nodes = NodesSpec(
            text("to_nodes"), values.get("ranks_per_node"), values.get("micro_batch"), text("keep_sources")
        )
    spec = ShuffleSpec.given_as(
        **{k: values[k] for k in _SETTINGS if k in values},
        output=text("output"),
        like=text("like"),
        epochs=epoch_numbers(values.get("epochs")),
        nodes=nodes,
    )
    # the sources and the schedule file count as given before either is read (--like refuses both)
    spec = dataclasses.replace(
        spec, given=spec.given | {k for k, v in (("sources", sources), ("schedule", schedule)) if v}
    )
    spec = like_spec(spec)
    if spec.like is not None:
        return spec
    if spec.output is None:
        raise TokpackError("no output given", where="output", hint="give the run directory to write (or like=RUN)")
    scheduled = read_schedule(schedule) if schedule is not None else None
    if scheduled is None and not sources:
        raise TokpackError("no sources given", hint="give the packed sources, or schedule=FILE")
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    return spec.with_settings(sources=paths, weights=weights, schedule=scheduled)


def _shuffle_to_nodes(spec, scratch, log) -> dict:
    """shuffle(to_nodes=DEST) (tokpack.packer.exchange): this process's node slice."""
    from tokpack.formats.errors import TokpackError
    from tokpack.packer.exchange import shuffle_to_nodes

    if spec.nodes.ranks_per_node is None or spec.nodes.micro_batch is None:
        raise TokpackError(
            "to_nodes needs ranks_per_node and micro_batch",
            where="--ranks-per-node/--micro-batch",
            hint="give both: K ranks a node, m samples a rank a step",
        )
    if scratch is not None:
        raise TokpackError("to_nodes writes no scratch to the shared filesystem", where="--scratch", hint="drop it")
    if spec.holdout is not None:  # given, or the run's (like=RUN)
        raise TokpackError(
            "to_nodes does not write a held-out split (--holdout) yet",
            where="--holdout",
            hint="shuffle the run without to_nodes, then `tokpack stage` it to the nodes",
        )
    return shuffle_to_nodes(spec, log=log)


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

    if not isinstance(command, str) or command not in _PLANNED:
        raise TokpackError("no such command to plan", where="command", expected="pack, shuffle or stage", found=command)
    bound = _PLANNED[command].bind(*args, **kwargs)  # an unknown keyword stays Python's TypeError
    bound.apply_defaults()
    given = checked(command, bound.arguments)
    given["disk_mbps"] = arguments.positive_number(given["disk_mbps"], "disk_mbps")
    if command == "pack":
        from tokpack.packer.packing import PackOptions

        paths, output, executor, disk_mbps = (given.pop(k) for k in ("inputs", "output", "executor", "disk_mbps"))
        given.pop("scratch")  # a plan's output is local: the scratch a URL output writes to is unused
        return planning.plan_pack(paths, output, PackOptions(**given), executor=executor, disk_mbps=disk_mbps)
    if command == "stage":
        directory, dest, disk_mbps = (given.pop(k) for k in ("directory", "dest", "disk_mbps"))
        return planning.plan_stage(directory, dest, given, disk_mbps=disk_mbps)
    machine = {k: given.pop(k) for k in ("executor", "disk_mbps", "nodes", "shared_mbps", "nic_mbps")}
    machine["nodes"], machine["shared_mbps"], machine["nic_mbps"] = planning.check_nodes(
        given, *(machine.get(k) for k in ("nodes", "shared_mbps", "nic_mbps", "executor"))
    )
    return planning.plan_shuffle(shuffle_spec(given), **machine)


def _planned(command, extra: tuple[str, ...]) -> _signature.Signature:
    """plan(`command`, ...)'s arguments: the command's own, less how it reports (log, progress),
    plus the machine's figures a plan predicts from (disk_mbps; shuffle's to_nodes: the nodes and
    their links), each None unless given."""
    sig = _signature.signature(command)
    return sig.replace(
        parameters=[p for p in sig.parameters.values() if p.name not in ("log", "progress")]
        + [_signature.Parameter(name, _signature.Parameter.KEYWORD_ONLY, default=None) for name in extra]
    )


_PLANNED = {
    "pack": _planned(pack, ("disk_mbps",)),
    "shuffle": _planned(shuffle, ("disk_mbps", "nodes", "shared_mbps", "nic_mbps")),
    "stage": _planned(stage, ("disk_mbps",)),
}
