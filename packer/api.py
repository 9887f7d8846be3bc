"""tokpack's Python API (docs/API.md): `pack`, `shuffle`, `validate`, `read`, `stage`, `inspect`, `plan`.

Each takes paths or fsspec URLs and returns a dataclass holding the facts the command prints
under `--json` (`to_json()`), and no text for humans. This module imports no heavy dependency:
the stages are imported when called.
"""

from __future__ import annotations

import dataclasses
import os
import functools
import inspect as _signature
import numbers
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING


from tokpack.packer.shared import ExecutorConfig, PathLike, Result, as_paths, optional_field, weighted_sources
from tokpack.shuffle.spec import DEFAULT_MEMORY
from tokpack.formats import arguments
from tokpack.formats.constants import DEFAULT_SHARD_TOKENS, INT_RANGE
from tokpack.formats.errors import TokpackError, UsageError, one_line

if TYPE_CHECKING:  # the stages build their results; importing them here would import their dependencies
    from tokpack.packer.inspection import InspectResult
    from tokpack.packer.packing import PackResult
    from tokpack.packer.plan_result import PlanResult


def _epochs(value, name):
    """shuffle's `epochs`: a count (>= 1) or a sequence of epoch numbers (>= 0), each once (a
    number given twice wrote its epoch twice, and an empty list wrote nothing and reported success)."""
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return arguments.whole(value, name, least=1)
    value = list(value)  # a range, a generator or a numpy array of epoch numbers as a list
    numbers_ = [arguments.whole(e, f"{name}[{i}]", optional=False) for i, e in enumerate(value)]
    twice = sorted(e for e, n in Counter(numbers_).items() if n > 1)  # count() of each was quadratic
    if not numbers_ or twice:
        raise TokpackError(
            f"{name} must name each epoch once" if twice else f"{name} names no epoch",
            where=name,
            expected="a count >= 1, or a list of distinct epoch numbers",
            found=f"{twice[0]} twice" if twice else "[]",
        )
    return numbers_


def _dirs(value, name):
    """validate's DIRs: one path or more (the command's usage error without any: an empty list
    validated nothing, and a CI gate fed an empty glob passed)."""
    items = arguments.paths(value, name)
    if not items:
        raise UsageError(f"give one or more DIRs to validate ({name} is empty)")
    return items


def _text_path(value, name):
    """A path argument the stage keeps as text (a tokenizer file): a str or os.PathLike, as str."""
    value = arguments.path(value, name)
    return None if value is None else os.fspath(value)


def _log(value, name):
    """A callable taking each progress line (None: none), refused before a stage calls it midway."""
    if value is not None and not callable(value):
        raise TokpackError(
            f"{name} must be a callable or None", where=name, expected="log(line: str)", found=repr(value)
        )
    return value


def _sources(value, name):
    """shuffle's SOURCEs: a path, an iterable of paths or (path, weight) pairs, or a mapping path ->
    weight (a number, or text as on the command line); what a weight's number is, the parser of
    weights checks (tokpack.formats.units)."""
    if value is None or isinstance(value, (str, os.PathLike)):
        return arguments.path(value, name)
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        pairs = [item if isinstance(item, tuple) else (item, None) for item in value]
    else:
        return arguments.paths(value, name)  # not a path: its line
    for i, pair in enumerate(pairs):
        where = f"{name}[{i}]"
        if len(pair) != 2:
            raise TokpackError(
                "a weighted source is a (path, weight) pair", where=where, expected="2 items", found=repr(pair)[:80]
            )
        arguments.path(pair[0], where, optional=False)
        weight = pair[1]
        if weight is not None and not isinstance(weight, (str, numbers.Real)):  # a bool: the weights' parser refuses
            raise TokpackError(
                "a source's weight must be a number or text",
                where=f"weight of {pair[0]}",
                expected="a number like 0.3 or 2, or text like '1/3' or '70%'",
                found=repr(weight)[:80],
            )
    return value if isinstance(value, Mapping) else pairs


def _executor(value, name):
    if value is None:
        return None
    if not isinstance(value, ExecutorConfig):
        raise TokpackError(f"{name} must be an ExecutorConfig", where=name, found=repr(value))
    from tokpack.packer.executors import EXECUTORS  # at the call: it imports datatrove's logger

    # an unknown executor was found once the output's epoch folder was made
    arguments.text(value.executor, f"{name}.executor", optional=False, choices=EXECUTORS)
    arguments.whole(value.workers, f"{name}.workers", least=1, optional=False)
    arguments.whole(value.tasks, f"{name}.tasks", least=1)
    return value


_REQUIRED = {"optional": False}
_COUNT = {n: ("whole", {"least": n}) for n in (0, 1)}
_TEXT, _FLAG, _MAYBE_FLAG = ("text", {}), ("flag", {}), ("flag", {"optional": True})
_PATH = ("path", {})

# Each public function's arguments, checked as the CLI's option types check the same options
# (packer/cli.py): the same ranges, unit strings through the same parsers (tokpack.formats.arguments:
# a check's name there, and its keywords); paths are a str or os.PathLike (str() made a folder
# named "None" of a None output), sources and a log callable likewise checked before a stage runs.
ARGUMENTS = {
    "pack": {
        "input_format": ("text", _REQUIRED),
        "column": _TEXT,
        "dtype": _TEXT,
        "tokenizer": _text_path,  # a local tokenizer.json, as a pathlib.Path too
        "eos_id": _COUNT[0],
        "vocab_size": _COUNT[1],
        "overwrite": _FLAG,
        "shard_tokens": ("tokens", {"least": 1, **_REQUIRED}),
        "executor": _executor,
        "link": _FLAG,
        "append_eos": _FLAG,
        "inputs": ("paths", {}),
        "output": ("path", _REQUIRED),
        "scratch": _PATH,
        "log": _log,
    },
    "shuffle": {
        "seq_len": _COUNT[1],
        "seed": ("whole", {"least": INT_RANGE[0], "most": INT_RANGE[1] - 1}),  # what a manifest records
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
        "procs_per_node": _COUNT[1],
        "stall_timeout": ("positive_number", {}),
        "sources": _sources,
        **{name: _PATH for name in ("output", "schedule", "scratch", "like", "to_nodes", "keep_sources")},
        "log": _log,
    },
    "validate": {
        "dirs": _dirs,
        "against": ("paths", {}),
        "quick": _FLAG,
        "workers": ("whole", {"least": 1, **_REQUIRED}),
        "show_progress": _MAYBE_FLAG,
    },
    "stage": {
        "workers": _COUNT[1],
        "epochs": _TEXT,
        "ranks": _TEXT,
        "micro_batch": ("whole", {"least": 1, **_REQUIRED}),
        "world_size": _COUNT[1],
        "node": _TEXT,
        "ranks_per_node": _COUNT[1],
        "start_sample": ("whole", _REQUIRED),
        "memory": ("size", {}),
        "directory": ("path", _REQUIRED),
        "dest": ("path", _REQUIRED),
        "log": _log,
    },
    "read": {
        "rank": ("whole", _REQUIRED),
        "world_size": ("whole", {"least": 1, **_REQUIRED}),
        "micro_batch": ("whole", {"least": 1, **_REQUIRED}),
        "start_sample": _COUNT[0],
        "consumed_tokens": ("tokens", {}),
        "count": ("whole", _REQUIRED),
        "verify": _FLAG,
    },
    "inspect": {
        "batch_size": _COUNT[1],
        "batches": ("whole", {"least": 1, **_REQUIRED}),
        "seq_len": _COUNT[1],
        "epoch": _COUNT[0],
        "memory": ("size", {}),
        "documents_per_row": _FLAG,
        "directory": ("path", _REQUIRED),
        "plot": _PATH,
    },
}


def checked(command: str, sig: _signature.Signature, args, kwargs) -> dict:
    """The arguments of a call (`args`, `kwargs`) to `sig`, by keyword, defaults applied, each
    argument of `command` checked and parsed (an int for "3M" or "64MiB"), or one TokpackError
    line naming the argument."""
    bound = sig.bind(*args, **kwargs)  # an unknown keyword stays Python's TypeError
    bound.apply_defaults()
    out = bound.arguments
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
        @one_line
        def run(*args, **kwargs):
            return fn(**checked(command, sig, args, kwargs))

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
    from tokpack.packer.executors import local_paths
    from tokpack.packer.pack_setup import PackOptions
    from tokpack.packer.packing import pack as pack_source

    options = PackOptions.of(locals())
    with local_paths([], str(output), scratch, executor, "pack") as (_, local_output, to):
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
    procs_per_node: int | None = None,
    stall_timeout: float | None = None,
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
    `to_nodes`: a node-local folder (`{node}` is replaced by n): run under MPI (`procs_per_node`
    processes a node; docs/COMMANDS.md, "Straight to the nodes"), a node's processes write its
    slice of each epoch there, as `stage(output, to_nodes, node="n/N")` would, and `output` gets only the
    manifests and row hashes; needs `ranks_per_node` and `micro_batch`; `keep_sources`: a
    node-local folder keeping the source shards the node reads, for later epochs;
    `procs_per_node`: P MPI processes a node, sharing its DEST and `memory` (`mpirun --map-by
    ppr:P:node`; None: as the launcher placed them, tokpack.packer.node_procs); `stall_timeout`:
    the seconds a process waits without a heartbeat from a peer before the job stops, naming
    the stalled node [default: 300] (tokpack.packer.stall). It returns this process's summary (a
    dict: node, process, nodes, ranks, dest, epochs...), not a ShuffleResult."""
    from tokpack.packer.executors import local_paths, pass_runner
    from tokpack.shuffle.run import shuffle_run
    from tokpack.shuffle.packings import named

    values = locals()
    shuffle_usage(values)
    spec = shuffle_spec(values)
    if spec.nodes is not None:
        from tokpack.packer.exchange import shuffle_to_nodes

        return shuffle_to_nodes(spec, log=log)
    config = executor or ExecutorConfig()
    named(spec.packing)  # an unknown packing is refused before any source is fetched
    with local_paths(list(spec.sources), spec.output, scratch, config) as (local_sources, local_output, to):
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


def shuffle_spec(values: dict):
    """The ShuffleSpec of `shuffle`'s (or `plan("shuffle")`'s) keywords `values`, checked already
    (shuffle_usage): --like's run read (tokpack.shuffle.like), the schedule file read. The one
    place the API's and the CLI's keywords become a spec."""
    from tokpack.shuffle.like import like_spec
    from tokpack.shuffle.schedule import epoch_numbers, read_schedule
    from tokpack.shuffle.spec import NodesSpec, ShuffleSpec

    def text(key):
        return None if values.get(key) is None else str(values[key])

    sources, schedule = values.get("sources"), values.get("schedule")
    nodes = None
    if values.get("to_nodes") is not None:  # NodesSpec's fields are shuffle's keywords, its dest --to-nodes
        given = {f.name: values.get(f.name) for f in dataclasses.fields(NodesSpec)}
        nodes = NodesSpec(**{**given, "dest": text("to_nodes"), "keep_sources": text("keep_sources")})
    # the spec's settings that shuffle's keywords give as they are; the others are built here
    built = {"sources", "weights", "output", "epochs", "schedule", "like", "nodes", "given"}
    spec = ShuffleSpec.given_as(
        **{f.name: values[f.name] for f in dataclasses.fields(ShuffleSpec) if f.name in values.keys() - built},
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
    scheduled = read_schedule(schedule) if schedule is not None else None
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    return spec.with_settings(sources=paths, weights=weights, schedule=scheduled)


def shuffle_usage(values: dict, plan: bool = False) -> list[int] | int | None:
    """The usage checks of `shuffle`'s keywords `values` (`plan("shuffle")`'s with `plan`), before
    any file is read but --like's run: one UsageError, the command line's usage error. The command
    line gives its --epoch E as `values["epoch"]`, beside --epochs N. Returns the epochs asked."""
    from tokpack.shuffle.like import given_with_like

    epochs, epoch, like, schedule = (values.get(k) for k in ("epochs", "epoch", "like", "schedule"))
    if like is not None:
        twice = given_with_like(values)
        if twice:
            raise UsageError(  # what --like reads from the run
                "--like takes the sources and --seq-len, --seed, --samples/--tokens, --shard-samples, --jitter, "
                f"--schedule, --packing, --pad-id, --holdout from the run; drop {' '.join(twice)}"
            )
    elif values.get("output") is None:
        raise UsageError("give -o OUT (or --like RUN to add epochs to RUN with its own settings)")
    elif schedule is not None:
        given = [_option(k) for k in ("seq_len", "seed", "samples", "tokens") if values.get(k) is not None]
        given += ["--jitter"] * bool(values.get("jitter"))
        if values.get("sources") or given:
            raise UsageError(
                "--schedule declares the sources, --seq-len, --seed, --samples/--tokens and "
                f"--jitter; drop {' '.join(given) or 'the SOURCEs'}"
            )
    elif not values.get("sources") or values.get("seq_len") is None or values.get("seed") is None:
        raise UsageError("give SOURCE[=WEIGHT]..., --seq-len and --seed (or --schedule FILE)")
    elif "epoch" in values and epochs is None and epoch is None:  # the API's default is epoch 0
        raise UsageError("give exactly one of --epochs N or --epoch E")
    if epochs is not None and epoch is not None:
        given = "at most one of --epochs N and" if like or schedule else "exactly one of --epochs N or"
        raise UsageError(f"give {given} --epoch E")
    if values.get("samples") is not None and values.get("tokens") is not None:
        raise UsageError("give at most one of --samples and --tokens")
    _nodes_usage(values, plan)
    return [epoch] if epoch is not None else epochs


def _option(keyword: str) -> str:
    """The command line's option of a keyword: --seq-len for seq_len."""
    return f"--{keyword.replace('_', '-')}"


def _nodes_usage(values: dict, plan: bool) -> None:
    """shuffle's (or plan shuffle's) --to-nodes usage checks (tokpack.packer.exchange)."""
    from tokpack.shuffle.like import run_settings

    if values.get("to_nodes") is None:
        keys = ("ranks_per_node", "micro_batch", "keep_sources", "procs_per_node", "stall_timeout")
        keys += ("nodes", "shared_mbps", "nic_mbps") * plan
        if any(values.get(k) is not None for k in keys):
            *most, last = (_option(k) for k in keys)
            raise UsageError(f"{', '.join(most)} and {last} go with --to-nodes DEST")
        return
    if plan and None in (values.get("ranks_per_node"), values.get("micro_batch"), values.get("nodes")):
        raise UsageError("plan shuffle --to-nodes needs --nodes N, --ranks-per-node K and --micro-batch M")
    if not plan and (values.get("ranks_per_node") is None or values.get("micro_batch") is None):
        raise UsageError("--to-nodes needs --ranks-per-node K and --micro-batch M")
    if values.get("scratch") is not None:
        raise UsageError("--to-nodes writes no scratch to the shared filesystem; drop --scratch")
    if plan and (values.get("like") is not None or values.get("holdout") is not None):
        raise UsageError("--to-nodes takes its SOURCEs (or --schedule) and settings; drop --like/--holdout")
    like = values.get("like")
    if values.get("holdout") is not None or (like is not None and run_settings(str(like)).get("holdout")):
        raise UsageError(
            "--to-nodes does not write a held-out split (--holdout) yet; shuffle the run without "
            "--to-nodes, then `tokpack stage` it to the nodes"
        )


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
    workers: int | None = None,
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
    `memory`: a replacement node's budget (`node` on a RUN of shuffle --to-nodes), refused elsewhere.
    `workers`: files copied at once (default 4); a replacement node's processes (default 1), each
    rebuilding the rank files of a share of its ranks within `memory // workers`."""
    from tokpack.packer.stage_plan import whole_shard_ranks

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node, start_sample, ranks_per_node)
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
                workers=workers or 1,
            )
    # what a copy and a slice of a materialised run both take; workers: files copied at once
    given = {"ranks": ranks, "micro_batch": micro_batch, "epochs": epochs, "workers": workers or 4, "log": log}
    if memory is not None:  # a copy or a slice of a materialised run streams its files: no budget to keep
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
            world_size=world_size,
            node=node,
            ranks_per_node=ranks_per_node,
            start_sample=start_sample,
            **given,
        )
    from tokpack.packer.staging import stage as stage_copy

    return stage_copy(str(directory), dest, **given)


@_checks("read")
def read(
    directory: PathLike,
    *,
    rank: int = 0,
    world_size: int = 1,
    micro_batch: int = 1,
    start_sample: int | None = None,
    consumed_tokens: int | None = None,
    count: int = 10,
    verify: bool = False,
):
    """What rank `rank` of `world_size` is fed from `directory` (a run or an epoch), `micro_batch`
    samples a step, from `start_sample` (or `consumed_tokens`) on: its SampleReader
    (tokpack.loader.reader) and an iterator over its next `count` samples (`tokpack read`)."""
    from tokpack.loader.reader import SampleReader

    if start_sample is not None and consumed_tokens is not None:
        raise UsageError("give at most one of --start-sample and --consumed-tokens")
    if rank >= world_size:
        raise UsageError(f"--rank {rank} must be below --world-size {world_size}")
    reader = SampleReader.open(directory, verify=verify)
    start = reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)
    reader.require_batch(world_size, micro_batch, start)  # else a command would print nothing and exit 0
    return reader, reader.rank_samples(rank, world_size, micro_batch, start=start, count=count)


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
    arguments = dict(locals())  # tokpack.packer.inspection.inspect's, named as here
    from tokpack.packer.inspection import inspect as inspect_dir

    return inspect_dir(**arguments)


@one_line
def plan(command: str, *args, **kwargs) -> PlanResult:
    """What `pack`, `shuffle` or `stage` (`command`) would do with these arguments (that function's,
    plus `disk_mbps`), writing nothing: tasks, files, bytes per pass, space, manifest sizes and a
    predicted wall time (tokpack.packer.planning)."""
    from tokpack.packer import planning

    if not isinstance(command, str) or command not in _PLANNED:
        raise TokpackError("no such command to plan", where="command", expected="pack, shuffle or stage", found=command)
    given = checked(command, _PLANNED[command], args, kwargs)
    given["disk_mbps"] = arguments.positive_number(given["disk_mbps"], "disk_mbps")
    if command == "pack":
        from tokpack.packer.pack_setup import PackOptions

        # a plan's output is local: the scratch a URL output writes to is unused
        options = PackOptions.of(given)
        return planning.plan_pack(
            given["inputs"], given["output"], options, executor=given["executor"], disk_mbps=given["disk_mbps"]
        )
    if command == "stage":
        directory, dest, disk_mbps = (given.pop(k) for k in ("directory", "dest", "disk_mbps"))
        return planning.plan_stage(directory, dest, given, disk_mbps=disk_mbps)
    shuffle_usage(given, plan=True)
    machine = {k: given.pop(k) for k in ("executor", "disk_mbps", "nodes", "shared_mbps", "nic_mbps")}
    executor = machine["executor"]
    if given.get("to_nodes") is not None and executor is not None and executor.executor != "local":
        raise TokpackError(
            "shuffle --to-nodes takes its sources and settings, not --like, --holdout or an --executor",
            where="--like/--holdout/--executor",
        )
    # plan shuffle --to-nodes' machine figures, checked as the CLI's option types check them
    machine["nodes"] = arguments.whole(machine["nodes"], "nodes", least=1)
    for name in ("shared_mbps", "nic_mbps"):
        machine[name] = arguments.positive_number(machine[name], name)
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
