"""Data schedules: a run declared as an ordered list of stages, each a mixture of packed sources
and a size (docs/COMMANDS.md, "Schedules"). A run made with flags is a schedule of one
open-ended stage, and is planned exactly as it was before schedules existed.

Epochs are numbered through the whole schedule. Each source keeps one chain over the run: an
epoch starts each source's chain where the epochs before it left it (its cursor: the samples
taken from it so far), so no window repeats before its source is exhausted.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tokpack.formats.checks import raise_first
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_read
from tokpack.formats.constants import MAX_EPOCHS, DEFAULT_PLAN_MEMORY
from tokpack.formats.shards import PackedSource
from tokpack.formats.units import at_most, parse_weight, token_count, typed, weight_text

from . import packings
from tokpack.formats.constants import INT_RANGE
from .plan import SamplePlan

SCHEDULE_KEYS = ("seq_len", "seed", "jitter", "shard_samples", "stages", "packing")
MAX_SCHEDULE_BYTES = 1 << 20  # a schedule is a few dozen lines; a larger file is not one
STAGE_KEYS = ("name", "sources", "tokens", "epochs")


@dataclass(frozen=True)
class Stage:
    name: str
    paths: tuple[str, ...]  # its sources (a file's relative paths resolved against the file's directory)
    weights: tuple[str | None, ...]  # one per source, as given; None without weights
    epochs: int | None = 1  # None: open-ended (a run made with flags)
    samples: int | None = None  # per epoch; with neither samples nor tokens, one pass over its windows
    tokens: int | None = None  # per epoch: samples = tokens // seq_len


@dataclass(frozen=True)
class Schedule:
    seq_len: int
    seed: int
    stages: tuple[Stage, ...]
    jitter: bool = False
    shard_samples: int | None = None
    file: str | None = None  # the YAML file it was read from; None for a run made with flags
    file_hash: str | None = None  # xxh3_128 of that file's bytes
    packing: str = packings.DEFAULT  # a registered packing's name (tokpack.shuffle.packings), for the whole run
    # the optional keys the file sets (packing, shard_samples): a setting the user also gives is
    # applied where the file is silent, refused where it speaks (tokpack.shuffle.spec)
    declared: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def of_flags(
        cls,
        paths,
        weights,
        *,
        seq_len: int,
        seed: int,
        samples=None,
        tokens=None,
        jitter=False,
        packing: str = packings.DEFAULT,
    ) -> "Schedule":
        stage = Stage("", tuple(paths), tuple(weights), None, samples, tokens)
        return cls(int(seq_len), int(seed), (stage,), bool(jitter), packing=packing)

    @property
    def paths(self) -> list[str]:
        """Every source of the schedule, once, in order of first appearance: its key in the plan."""
        seen: dict = {}
        for stage in self.stages:
            for p in stage.paths:
                seen.setdefault(Path(p).resolve(), p)
        return list(seen.values())

    @property
    def epochs(self) -> int | None:
        """Epochs in the schedule; None when it is open-ended."""
        return None if any(st.epochs is None for st in self.stages) else sum(st.epochs for st in self.stages)


def epoch_numbers(epochs) -> list[int] | None:
    """shuffle's `epochs` as numbers: a count N is 0..N-1; each number is checked against
    MAX_EPOCHS before the list is made."""
    if epochs is None:
        return None
    hint = f"epochs are numbered 0 to {MAX_EPOCHS - 1}"
    if isinstance(epochs, int):
        return list(range(at_most(epochs, MAX_EPOCHS, "epoch count", where="--epochs", hint=hint)))
    epochs = [int(e) for e in epochs]
    at_most(max(epochs, default=0), MAX_EPOCHS - 1, "epoch number", where="--epoch", hint=hint)
    return epochs


def same_source_twice(path, key: str, first) -> TokpackError:
    """The one line for a source given twice (`key`: what is the same, its path or its fingerprint)."""
    return TokpackError(
        "the same source is given twice",
        file=path,
        where="SOURCE",
        expected="each source once",
        found=f"the same {key} as {first}",
        hint="give each source once; to draw more from it, raise its weight",
    )


def _fail(message: str, file, where: str, expected=None, found=None, hint=None):
    raise_first(
        file, where, expected, found, message, hint=hint or 'see docs/COMMANDS.md, "Schedules", for the file\'s shape'
    )


def _field(where: str, key: str) -> str:
    """The path of `key` inside the entry at `where` ("" for the file's top level)."""
    return f"{where}.{key}" if where else key


def _check_keys(obj, allowed: tuple[str, ...], file, where: str) -> None:
    if not isinstance(obj, dict):
        _fail("schedule entry is not a mapping", file, where, "key: value pairs", type(obj).__name__)
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        _fail(
            "unknown key in the schedule",
            file,
            _field(where, unknown[0]),
            f"one of {', '.join(allowed)}",
            repr(unknown[0]),
        )


def _int(obj: dict, key: str, file, where: str, minimum: int | None = None, required: bool = True):
    """An integer of the file: at least `minimum`, and one a manifest can record (INT_RANGE: a
    seed past it wrote the epoch, then refused the manifest it had written)."""
    if key not in obj:
        if required:
            _fail("schedule key missing", file, _field(where, key), f"{key}: an integer", "no such key")
        return None
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        _fail(
            "schedule value is not a valid integer",
            file,
            _field(where, key),
            "an integer" + ("" if minimum is None else f" >= {minimum}"),
            repr(value),
        )
    if not INT_RANGE[0] <= value < INT_RANGE[1]:
        _fail(
            "schedule value is out of range",
            file,
            _field(where, key),
            f"an integer in [-2**63, 2**64){'' if minimum is None else f' and >= {minimum}'}",
            typed(value),
        )
    return value


def _weight(value, file, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        _fail("weight is not a number", file, where, "a number like 0.3, 2 or 1/3", repr(value))
    text = str(value) if isinstance(value, (str, numbers.Rational)) else repr(float(value))
    try:
        weight = parse_weight(text, where)
    except TokpackError as e:
        _fail(e.message, file, where, e.expected, e.found)
    if weight == 0:
        _fail("weight is 0", file, where, "a weight > 0", text, hint="leave the source out of the stage instead")
    return weight_text(text)  # 70% recorded as 0.7 is: the same run


def _stages(entries: list, path: Path, seq_len: int) -> list[Stage]:
    """A schedule file's `stages`, each checked (read_schedule)."""
    stages, names, named = [], {}, []
    for i, st in enumerate(entries):
        where = f"stages[{i}]"
        _check_keys(st, STAGE_KEYS, path, where)
        name = st.get("name")
        if not isinstance(name, str) or not name:
            _fail("stage has no name", path, f"{where}.name", "a non-empty name", repr(name))
        if name in names:
            _fail(
                "two stages have the same name",
                path,
                f"{where}.name",
                "a name no other stage has",
                f"{name!r}, the name of stages[{names[name]}]",
            )
        names[name] = i
        sources = st.get("sources")
        if not sources:
            _fail("stage has no sources", path, f"{where}.sources", "{SOURCE: WEIGHT, ...}", repr(sources))
        if not isinstance(sources, dict):
            _fail("stage sources need weights", path, f"{where}.sources", "{SOURCE: WEIGHT, ...}", repr(sources)[:60])
        paths = [str(p if Path(str(p)).is_absolute() else path.parent / str(p)) for p in sources]
        resolved: dict = {}
        for k, p in enumerate(paths):  # `web` and `./web` (or a symlink to it) are one source, as for the CLI
            first = resolved.setdefault(Path(p).resolve(), k)
            if first != k:
                raise same_source_twice(p, "path", paths[first])
        named += [(f"{where}.sources.{key}", p) for key, p in zip(sources, paths)]
        weights = [_weight(w, path, f"{where}.sources.{p}") for p, w in sources.items()]
        if ("tokens" in st) == ("epochs" in st):
            _fail(
                "stage needs exactly one of tokens and epochs",
                path,
                where,
                "tokens: 8T or epochs: 3",
                "both" if "tokens" in st else "neither",
            )
        tokens = epochs = None
        if "tokens" in st:
            try:
                tokens = token_count(st["tokens"] if isinstance(st["tokens"], (int, str)) else repr(st["tokens"]))
            except TokpackError as e:
                _fail(e.message, path, f"{where}.tokens", "a token count like 8T or 1.5B", repr(st["tokens"]))
            if tokens < seq_len:
                _fail(
                    "stage is smaller than one sample",
                    path,
                    f"{where}.tokens",
                    f">= seq_len ({seq_len}) tokens",
                    tokens,
                    hint="raise the stage's tokens or lower seq_len",
                )
        else:
            epochs = _int(st, "epochs", path, where, 1)
        stages.append(Stage(name, tuple(paths), tuple(weights), 1 if tokens is not None else epochs, tokens=tokens))
        at_most(
            sum(st.epochs for st in stages),
            MAX_EPOCHS,
            "schedule's epoch count",
            file=path,
            where=f"{where}.epochs",
            hint=f"epochs are numbered 0 to {MAX_EPOCHS - 1} through all stages",
        )
    # Once the file's shape is right, and here, not where the sources are opened: that line would
    # name only the joined path, not this file and stage (with --like, a file the user never named).
    for where, p in named:
        if not Path(p).exists():
            _fail(
                "a stage names a source that is not there",
                path,
                where,
                "a packed source directory",
                f"nothing at {p}",
                hint="correct the path in the schedule (a relative one is relative to the file's directory), "
                "or put the source there",
            )
    return stages


def read_schedule(path: str | Path) -> Schedule:
    """The schedule in a YAML file; any shape the file may not have is one TokpackError."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        """A key given twice (say a source under two weights) would silently keep the last."""

        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
            if twice is not None:
                _fail(
                    "schedule key given twice",
                    path,
                    f"line {node.start_mark.line + 1}",
                    "each key once",
                    repr(twice),
                    hint="merge the two entries into one",
                )
            return super().construct_mapping(node, deep=deep)

        def compose_node(self, parent, index):
            # An alias repeats a node without its text: a few lines can stand for gigabytes.
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                _fail(
                    "schedule uses a YAML alias (*name)",
                    path,
                    f"line {mark.line + 1}",
                    "plain values",
                    "an alias",
                    hint="write the value out where it is used; schedules take no anchors or aliases",
                )
            return super().compose_node(parent, index)

    path = Path(path)
    # a user's file: the regular-file rule only (a FIFO never blocks)
    with open_read(path, ahead=False, user=True) as f:
        raw = f.read(MAX_SCHEDULE_BYTES + 1)
    at_most(
        len(raw),
        MAX_SCHEDULE_BYTES,
        "schedule file size in bytes",
        file=path,
        hint="a schedule is a short YAML file of stages; check that this is the right file",
    )
    try:
        doc = yaml.load(raw, Loader=UniqueKeys)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        _fail(
            "schedule is not valid YAML",
            path,
            f"line {mark.line + 1}" if mark else "",
            "YAML",
            getattr(e, "problem", None) or type(e).__name__,
        )
    except RecursionError:
        _fail("schedule is nested too deeply", path, "", "a few levels of stages and sources", "thousands")
    _check_keys(doc, SCHEDULE_KEYS, path, "")
    seq_len = _int(doc, "seq_len", path, "", 1)
    seed = _int(doc, "seed", path, "")
    shard_samples = _int(doc, "shard_samples", path, "", 1, required=False)
    jitter = doc.get("jitter", False)
    if not isinstance(jitter, bool):
        _fail("schedule value is not true or false", path, "jitter", "true or false", repr(jitter))
    packing = doc.get("packing", packings.DEFAULT)
    if packing not in packings.names():
        _fail("unknown packing in the schedule", path, "packing", " or ".join(packings.names()), repr(packing))
    packings.check_jitter(packing, jitter, "jitter", path)
    if not isinstance(doc.get("stages"), list) or not doc["stages"]:
        _fail("schedule has no stages", path, "stages", "a list of stages", repr(doc.get("stages")))
    stages = _stages(doc["stages"], path, seq_len)
    return Schedule(
        seq_len,
        seed,
        tuple(stages),
        jitter,
        shard_samples,
        str(path.resolve()),
        xxhash.xxh3_128_hexdigest(raw),
        packing,
        frozenset(k for k in ("packing", "shard_samples") if k in doc),
    )


class RunPlan:
    """A schedule against its opened sources (`sources`, in `Schedule.paths` order): what each
    epoch takes from each source, and where in the source's chain."""

    def __init__(
        self,
        schedule: Schedule,
        sources: list[PackedSource],
        names: list[str],
        pad_id: int | None = None,
        group_tokens: int | None = None,
        memory: int = DEFAULT_PLAN_MEMORY,
        holdout: dict | None = None,
    ):
        self.schedule, self.sources, self.names = schedule, sources, names
        self.packing = packings.named(schedule.packing)
        # the plans' options (best-fit: its pad id; its held-out documents, tokpack.shuffle.holdout)
        self.options = {
            **self.packing.options(pad_id, group_tokens),
            **({} if holdout is None else {"holdout": holdout}),
        }
        self.memory = memory  # each plan's budget (shuffle's --memory)
        key = {Path(p).resolve(): u for u, p in enumerate(schedule.paths)}
        self.members = [[key[Path(p).resolve()] for p in st.paths] for st in schedule.stages]
        self.counts = []  # per stage: samples per epoch of each source (0: not in the stage)
        for k in range(len(schedule.stages)):
            counts = [0] * len(sources)
            try:
                stage_plan = self._stage_plan(k, 0)
            except TokpackError as e:
                if schedule.file is None or "--samples/--tokens" not in (e.where or ""):
                    raise
                # a stage's size or weights, not flags the command was not given: name the file's field
                size = "tokens" if schedule.stages[k].tokens is not None else "epochs"
                raise TokpackError(
                    f"{e.message} (source {e.file})",
                    file=schedule.file,
                    where=f"stages[{k}].{size}",
                    expected=e.expected,
                    found=e.found,
                    hint=f"lower the stage's {size} or that source's weight in the schedule, or add data",
                ) from None
            for u, sp in zip(self.members[k], stage_plan.sources):
                counts[u] = sp.samples
            self.counts.append(counts)

    def _stage_plan(self, k: int, epoch: int) -> SamplePlan:
        st, sc, members = self.schedule.stages[k], self.schedule, self.members[k]
        return self.packing.plan(
            [self.sources[u] for u in members],
            seq_len=sc.seq_len,
            seed=sc.seed,
            epoch=epoch,
            weights=list(st.weights),
            samples=st.samples,
            tokens=st.tokens,
            jitter=sc.jitter,
            names=[self.names[u] for u in members],
            memory=self.memory,
            **self.options,
        )

    def stage_of(self, epoch: int) -> tuple[int, int]:
        """(stage, the stage's first epoch) of an epoch of the schedule."""
        first = 0
        for k, st in enumerate(self.schedule.stages):
            if st.epochs is None or epoch < first + st.epochs:
                return k, first
            first += st.epochs
        raise TokpackError(
            "epoch is not in the schedule",
            file=self.schedule.file,
            where="--epoch/--epochs",
            expected=f"0..{first - 1} ({len(self.schedule.stages)} stages)",
            found=epoch,
            hint="the schedule's epochs are numbered through all its stages",
        )

    def stage_name(self, epoch: int) -> str | None:
        """The name of the stage an epoch belongs to; None for a run made with flags (one unnamed stage)."""
        return self.schedule.stages[self.stage_of(epoch)[0]].name or None

    def epoch_plan(self, epoch: int) -> SamplePlan:
        k, first = self.stage_of(epoch)
        plan = self._stage_plan(k, epoch)
        if len(self.schedule.stages) == 1:
            return plan  # one mixture for the run: every chain is at epoch * c_s
        # Several stages: the epoch lists every source of the schedule (its position is its key),
        # and each source's chain starts where the epochs before this one left it.
        cursors = [
            sum(self.counts[j][u] * self.schedule.stages[j].epochs for j in range(k))
            + (epoch - first) * self.counts[k][u]
            for u in range(len(self.sources))
        ]
        weights = [None] * len(self.sources)
        for u, w in zip(self.members[k], self.schedule.stages[k].weights):
            weights[u] = w
        return self.packing.chained(
            plan,
            members=self.members[k],
            sources=self.sources,
            names=self.names,
            cursors=cursors,
            weights=weights,
            counts=self.counts[k],
            memory=self.memory,
            **self.options,
        )

    def manifest_fields(self) -> dict:
        """What a run made from a schedule file records: per epoch its stage, sources (indices
        into the run's `sources`), weights and per-source samples; the epoch sizes (which number
        the run's samples); the file and its checksum."""
        entries, sizes = [], []
        for k, st in enumerate(self.schedule.stages):
            counts = [self.counts[k][u] for u in self.members[k]]
            for _ in range(st.epochs):
                entries.append(
                    {"stage": st.name, "sources": self.members[k], "weights": list(st.weights), "samples": counts}
                )
                sizes.append(sum(counts))
        return {
            "epoch_samples": sizes,
            "schedule": entries,
            "schedule_file": self.schedule.file,
            "schedule_xxh3_128": self.schedule.file_hash,
        }
