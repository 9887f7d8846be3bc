"""The `tokpack` command line's option types and shared options: quantities in their units, choices
read from the module that lists them, where a command's tasks run (executor_options), --log-interval,
--scratch, and SOURCE[=WEIGHT] arguments."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import fields

import click

from tokpack.formats import units
from tokpack.formats.constants import INT_RANGE
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.progress_log import OLD_INTERVAL_ENV, PROGRESS_ENV, progress_mode
from tokpack.formats.units import MAX_COUNT, byte_size, token_count
from tokpack.packer.shared import ExecutorConfig


def _usage_line(e: TokpackError) -> str:
    """A parser's refusal as click's "Invalid value for '--x': ..." line: the option is named there."""
    return str(TokpackError(e.message, expected=e.expected, found=e.found, hint=e.hint))


class Quantity(click.ParamType):
    """A command-line quantity parsed by one function of tokpack.formats.units, so each quantity has its
    own type and its own units: TOKENS (1000000, 100B, 1.5M: K/M/B/T are 10^3..10^12) or BYTES
    (16GiB, 2GB, 4G: a bare K/M/G/T is binary). `as_typed`: the text, checked by its parser when the
    command line is read, is kept as typed (the manifests record `--holdout` as given;
    tokpack.shuffle.holdout reads it again)."""

    def __init__(self, name: str, parse, as_typed: bool = False):
        self.name, self.parse, self.as_typed = name, parse, as_typed

    def convert(self, value, param, ctx):
        try:
            parsed = self.parse(value)
        except TokpackError as e:
            self.fail(_usage_line(e), param, ctx)
        return value if self.as_typed else parsed


TOKENS = Quantity("TOKENS", functools.partial(token_count, most=MAX_COUNT))
BYTES = Quantity("BYTES", functools.partial(byte_size, most=MAX_COUNT))
HOLDOUT = Quantity("F", units.holdout_amount, as_typed=True)


class _Bounded:
    """A number option read by tokpack.formats.units.number, the parser of every number: within
    [min, most] (min excluded when min_open: `above`, by default for a real only), finite, and a refusal
    names the option and the text as typed. click's range types for the help (`[x>=1]`); the upper bound
    is the parser's."""

    real = False

    def __init__(self, least=None, most=MAX_COUNT, above: bool | None = None, floor=None):
        super().__init__(min=least, min_open=self.real if above is None else above)
        self.most, self.floor = most, floor
        if least is None:  # no range to show: the plain type's name
            self.name = "integer"

    def convert(self, value, param, ctx):
        least = (-self.most if self.floor is None else self.floor) if self.min is None else self.min
        name = (param.opts[0] if param.opts else param.human_readable_name) if param is not None else "value"
        try:
            return units.number(value, name, least=least, most=self.most, real=self.real, above=self.min_open)
        except TokpackError as e:
            self.fail(_usage_line(e), param, ctx)

    def _describe_range(self) -> str:
        return "" if self.min is None else super()._describe_range()


class Int(_Bounded, click.IntRange):
    """An integer option in [least, most] (no least: a signed one, within floor..most, floor
    -most by default; the help then shows no range)."""


class Real(_Bounded, click.FloatRange):
    """A finite real option: > least (>= with above=False), <= most."""

    real = True


MAX_WORKERS = 100_000  # processes, tasks in flight: no machine or queue runs more
MAX_RANKS = 2**31 - 1  # nodes planned: a torch.distributed world's int32
MAX_SEQ_LEN = 2**31 - 1  # tokens a sample: far past any context a trainer takes
MAX_TOKEN_ID = 2**32 - 1  # a token id, a vocabulary: uint32 tokens at most
SEED_RANGE = INT_RANGE[0], INT_RANGE[1] - 1  # a seed: any integer a manifest records (64 unsigned bits too)
# Epochs, ranks, world sizes and micro-batches are bounded at an int64 here: the commands check
# each against what the run and the format allow (docs/COMMANDS.md, "Counts are bounded"), in a
# line that gives the limit and what to do.


class ListedChoice(click.Choice):
    """A choice among the names a module lists, read when the command line is parsed (or its
    help shown): the module's list is the one list, and a name registered after this module
    was imported (a packing) is a choice. `extra`: choices the CLI adds before them."""

    def __init__(self, module: str, name: str, extra: tuple[str, ...] = ()):
        self._list, self._extra = (module, name), extra
        super().__init__((), case_sensitive=True)

    @property
    def choices(self):
        listed = getattr(importlib.import_module(self._list[0]), self._list[1])
        return (*self._extra, *(listed() if callable(listed) else listed))

    @choices.setter
    def choices(self, value):  # click.Choice.__init__ sets it
        pass


_LOG_INTERVAL = "tokpack.log_interval"  # ctx.meta key: --log-interval as given (None: not given)

LOG_INTERVAL = click.option(
    "--log-interval",
    type=Real(0, units.MAX_SECONDS, above=False),
    metavar="SECONDS",
    expose_value=False,
    callback=lambda ctx, param, value: ctx.meta.__setitem__(_LOG_INTERVAL, value),
    help="When stderr is not a terminal (a Slurm log, nohup): one progress line every SECONDS, saying what it "
    "does, done/total, MB/s and an ETA; 0: no progress [default: $TOKPACK_PROGRESS, else 30; under --json, 0].",
)


def given_log_interval(ctx, as_json: bool) -> float | None:
    """The progress-line interval a command runs with (None: as $TOKPACK_PROGRESS says, read by
    tokpack.formats.io.progress_mode, which is checked here, before the command does anything):
    --log-interval, else none under --json (stderr holds a failure only) unless $TOKPACK_PROGRESS
    asks for progress."""
    given = ctx.meta.get(_LOG_INTERVAL) if ctx is not None else None
    if given is None:
        progress_mode()  # a bad $TOKPACK_PROGRESS is one line now, not after an hour of work
        if as_json and PROGRESS_ENV not in os.environ and OLD_INTERVAL_ENV not in os.environ:
            return 0.0
    return given


def executor_options(
    fn=None, *, tasks_help: str = "Number of tasks to split the work into (default: one per input file / output shard)."
):
    """Where the tasks run (an ExecutorConfig). Local is the default; slurm and ray go through
    datatrove's executors."""
    if fn is None:
        return functools.partial(executor_options, tasks_help=tasks_help)
    options = [
        click.option(
            "--workers",
            type=Int(1, MAX_WORKERS),
            default=1,
            show_default=True,
            help="Local worker processes; on slurm/ray a cap on concurrent tasks (1: no cap).",
        ),
        click.option(
            "--executor",
            type=ListedChoice("tokpack.packer.executors", "EXECUTORS"),
            default="local",
            show_default=True,
            help="datatrove executor that runs the tasks.",
        ),
        click.option("--tasks", type=Int(1, MAX_WORKERS * 100), help=tasks_help),
        click.option("--logging-dir", help="datatrove logging dir (default: inside OUT's work folder)."),
        click.option("--partition", help="slurm: partition."),
        click.option("--time", "time_limit", default="24:00:00", show_default=True, help="slurm: time limit."),
        click.option(
            "--cpus-per-task", type=Int(1, MAX_WORKERS), default=1, show_default=True, help="slurm/ray: CPUs per task."
        ),
        click.option(
            "--mem-per-cpu-gb",
            type=Real(0, 1e6),
            default=2,
            show_default=True,
            help="slurm/ray: memory reserved per CPU of a task, in GB (sbatch --mem-per-cpu); "
            "not a budget tokpack keeps (that is shuffle's --memory).",
        ),
        click.option(
            "--mem",
            "deprecated_mem",
            type=Real(0, 1e6),
            hidden=True,
            help="Deprecated spelling of --mem-per-cpu-gb.",
        ),
        click.option("--sbatch-args", help="slurm: extra sbatch arguments as 'key=value,key=value'."),
        click.option("--ray-address", help="ray: cluster address (default: start a local cluster)."),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def executor_config(kw: dict):
    """The ExecutorConfig of the options `executor_options` added (each named as its field)."""
    deprecated = kw.pop("deprecated_mem", None)
    if deprecated is not None:  # --mem, GB per CPU, read next to --memory, bytes, as one option: renamed
        ctx = click.get_current_context()
        if ctx.get_parameter_source("mem_per_cpu_gb") is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError("give --mem-per-cpu-gb only (--mem is its deprecated spelling)")
        click.echo(
            "tokpack: warning: --mem is deprecated (it is easily taken for --memory); "
            "use --mem-per-cpu-gb, GB of memory per CPU of a slurm/ray task",
            err=True,
        )
        kw["mem_per_cpu_gb"] = deprecated
    return ExecutorConfig(**{f.name: kw.pop(f.name) for f in fields(ExecutorConfig) if f.name in kw})


def command_log(as_json: bool):
    """Where a command's progress lines go: stderr, and nowhere under --json."""
    return None if as_json else lambda msg: click.echo(msg, err=True)


def weighted_sources(args) -> list[tuple[str, str | None]]:
    """SOURCE[=WEIGHT] -> (SOURCE, WEIGHT or None). An argument naming an existing path is a path
    even if it holds '='; in a URL, a '=' is a weight's only when a number follows it."""
    pairs = []
    for arg in args:
        path, _, weight = arg.rpartition("=")
        if (
            not path
            or os.path.exists(arg)
            or "://" in arg
            and not _is_number(weight)
            or (arg.startswith("virtual:") and arg.rsplit(",", 1)[-1].count("=") < 2)
        ):  # its last key=value, no weight
            path, weight = arg, None
        pairs.append((path, weight))
    return pairs


def _is_number(text: str) -> bool:
    """A number as shuffle takes a weight: 0.3, 2, 1/3, 70% (tokpack.formats.units.weight_fraction;
    1/0 is one, if not a valid one)."""
    try:
        units.weight_fraction(text)
    except (ZeroDivisionError, OverflowError):  # a number, if not a valid weight: parse_weight says why
        return True
    except ValueError:
        return False
    return True


SCRATCH = click.option(
    "--scratch",
    type=click.Path(file_okay=False),
    help="With an -o URL (s3://...): the local or shared folder where shards are written before each is sent, "
    "and out-of-core buckets [default: $TOKPACK_STAGE_DIR, else the system temp dir].",
)
