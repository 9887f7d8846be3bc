"""One shuffle's settings (issue 40): the CLI, the Python API, `--like` (tokpack.shuffle.like), a
schedule file (tokpack.shuffle.schedule) and `tokpack plan shuffle` build a `ShuffleSpec`; the
engine (tokpack.shuffle.run), the planner and the exchange take one. Each setting's default is
declared here, once.

A spec also knows which settings the user gave (`given`): a value equal to its default (say
`--packing concat`) is still an answer the user gave, so a schedule file or a run read by
`--like` that declares the same setting refuses it instead of silently keeping its own. How the
work runs (workers, tasks, executor, scratch, progress, log) is not a setting of the shuffle: the
executor's configuration holds it, and no byte written depends on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schedule module imports the planners; a spec is built without them
    from .schedule import Schedule

DEFAULT_MEMORY = 4 << 30  # --memory: the whole run's budget, in bytes


@dataclass(frozen=True)
class NodesSpec:
    """shuffle --to-nodes (tokpack.packer.exchange): each node's MPI processes write its slice
    into its local `dest` (`{node}` replaced by the node's number)."""

    dest: str
    ranks_per_node: int | None = None
    micro_batch: int | None = None
    keep_sources: str | None = None  # a node-local folder keeping the source shards the node reads
    # MPI processes a node (None: the launcher's, tokpack.packer.node_procs); --memory is the node's
    procs_per_node: int | None = None
    stall_timeout: float | None = None  # seconds without a peer's heartbeat that stop the job (None: the default)


@dataclass(frozen=True)
class ShuffleSpec:
    """Every setting of one shuffle. `sources`: the packed sources as the user named them (the
    names the manifests record; a URL's local copy is the run's business, not the spec's);
    `weights`: one per source as given ("0.25", "1/3"), or None. `epochs`: the epoch numbers
    asked for (None: epoch 0, or every epoch of the schedule: `asked_epochs`). `packing`: a name in
    tokpack.shuffle.packings (None: its default). `schedule`: a schedule read from its file, which
    declares the sources, weights, seq_len, seed, sizes, jitter and packing instead."""

    sources: tuple[str, ...] = ()
    weights: tuple[str | None, ...] | None = None
    output: str | None = None  # the run directory, as given (a local path or a URL)
    seq_len: int | None = None
    seed: int | None = None
    epochs: tuple[int, ...] | None = None
    samples: int | None = None
    tokens: int | None = None
    shard_samples: int | None = None  # None: the run's, else about 1 GiB of samples a shard
    memory: int = DEFAULT_MEMORY
    jitter: bool = False
    packing: str | None = None
    pad_id: int | None = None  # a padded packing's padding token (None: the EOS id)
    holdout: str | None = None  # documents set aside: a fraction ("0.01", "1%") or a token count ("5M")
    schedule: Schedule | None = None
    like: str | None = None  # the run whose own settings these are (tokpack.shuffle.like)
    nodes: NodesSpec | None = None
    given: frozenset[str] = field(default=frozenset(), compare=False)  # the settings the user gave

    @classmethod
    def given_as(cls, **values) -> ShuffleSpec:
        """The spec of `values` as a user gave them (given_names); lists become tuples."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return cls(**values, given=given_names(values))

    def with_settings(self, **values) -> ShuffleSpec:
        """This spec with `values` set by a builder (the run --like reads, a schedule file): the
        user's `given` stays as it was."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return dataclasses.replace(self, **values)

    def asked_epochs(self) -> list[int] | None:
        """The epochs to write: those asked for; else epoch 0 of a run made with flags, and None
        (every epoch) of a schedule."""
        if self.epochs is not None:
            return list(self.epochs)
        return None if self.schedule is not None else [0]

    def checked_schedule(self) -> Schedule | None:
        """The schedule to run: the file's, with a given --packing applied when the file declares
        none. A --packing the file declares as well is refused (one TokpackError line), never
        silently dropped: `--packing concat` beside a best-fit schedule is an answer (the other
        settings a file declares are refused before: tokpack.packer.api.shuffle_usage)."""
        from tokpack.formats.errors import TokpackError  # formats/ imports numpy: `import tokpack` stays light

        sc = self.schedule
        if sc is None:
            return None
        # --shard-samples beside a file that declares shard_samples was silently taken over the file's
        if "shard_samples" in self.given and "shard_samples" in sc.declared and self.shard_samples != sc.shard_samples:
            raise TokpackError(
                "--shard-samples differs from the schedule's shard_samples",
                file=sc.file,
                where="--shard-samples",
                expected=sc.shard_samples,
                found=self.shard_samples,
                hint="drop --shard-samples, or change shard_samples in the schedule",
            )
        if self.packing is None or self.packing == sc.packing:
            return sc
        if "packing" in sc.declared:
            raise TokpackError(
                "--packing differs from the schedule's packing",
                where="--packing",
                expected=sc.packing,
                found=self.packing,
                hint="drop --packing",
            )
        return dataclasses.replace(sc, packing=self.packing)


def given_names(values: dict) -> frozenset[str]:
    """The settings among `values` (a spec's field -> value as passed; other keys are not
    settings) that were given: a value that is not the setting's default. Given is not truthy:
    `packing="concat"`, `seed=0` and `pad_id=0` are given, `packing=None` and `jitter=False` are not."""
    defaults = {f.name: f.default for f in dataclasses.fields(ShuffleSpec) if f.name != "given"}
    return frozenset(k for k, v in values.items() if k in defaults and v is not None and v != defaults[k] and v != ())
