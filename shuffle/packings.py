"""The packing registry: each way an epoch's samples are cut from its sources is one Packing
entry, and every other module reaches an algorithm through it, never by testing its name.

An entry gives everything that differs between algorithms: how an epoch is planned (one stage's
epoch, and an epoch of a schedule of several stages), how its plan is rebuilt from a manifest
and replayed for `validate --against`, what it records in the run's and the epoch's manifests,
the engine's passes that write it (in memory, or a scatter pass then an order pass), and what
`tokpack plan` reports of the work it does first. Two are built in: windows of the
concatenated documents ("concat", tokpack.shuffle.plan and tokpack.shuffle.steps, the default)
and best-fit packing of whole documents ("best-fit", tokpack.shuffle.packed and
tokpack.shuffle.packed_step). Another is added with `register(Packing(...))`, from its own
module: `--packing`, a schedule's `packing:` and the API take its name from then on.

An entry is found by its `--packing` name (`named`), by the `shuffle` a manifest records
(`of_manifest`) or by a plan's `algorithm` (`of_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tokpack.formats.constants import DEFAULT_PLAN_MEMORY
from tokpack.formats.errors import TokpackError
from tokpack.formats.packing import record_holdout

from . import packed_step, plan, steps
from .packed import packed_plan, replay as packed_replay, table as packed_table


@dataclass(frozen=True)
class Packing:
    name: str  # `--packing`, a schedule's `packing:`, a padded run's `packing.method`
    shuffle: str  # the manifests' `shuffle`, and the `algorithm` of the plans it makes
    jitter: bool  # whether `--jitter` (window starts shifted per epoch) applies to it
    # The plan options the run's settings give it, from --pad-id (and a group size): {} when none apply.
    options: Callable[[int | None, int | None], dict]
    # One stage's epoch: (sources, *, seq_len, seed, epoch, weights, samples, tokens, jitter, names,
    # memory, **options) -> a tokpack.shuffle.plan.SamplePlan.
    plan: Callable
    # An epoch of a schedule of several stages, every source of the schedule listed, each chain
    # starting at its cursor: (the stage's plan of the epoch, *, members, sources, names, cursors,
    # weights, counts, memory, **options) -> SamplePlan.
    chained: Callable
    # The plan an epoch manifest was written from: (manifest, sources, memory) -> SamplePlan.
    from_manifest: Callable
    # `validate --against`: (manifest, sources, order, memory) -> (sample multiset hash, each
    # shard's order hash); a TokpackError when the epoch is not its plan's.
    replay: Callable
    # What a run made from a schedule records (and a rerun must repeat) of it, before any
    # epoch is planned: (sources, **options) -> the run's `packing` object, or None.
    settings: Callable
    # The same of a planned epoch: (plan) -> the run's `packing` object, or None.
    run_fields: Callable
    # The epoch manifest's own fields: (plan, prepared) -> dict added to the manifest.
    epoch_fields: Callable
    # The engine. (job, memory) -> (bytes of what it reads to hold, bytes the in-memory path
    # holds): the epoch runs in memory when the latter fits --memory.
    memory_path: Callable
    # (job, out_of_core) -> bytes of scratch in OUT's work folder at the epoch's peak.
    scratch_bytes: Callable
    # (job, memory) -> what its steps need built first in the epoch's work folder (a dict).
    prepare: Callable
    # (job, prepared, memory, needed, held) -> (step, its pass's name, the log's words for it).
    in_memory: Callable
    # (job, layout, prepared, budget) -> (scatter step, order step).
    out_of_core: Callable
    # (job, layout, shard) -> whether the bucket files still hold that output shard's part.
    scattered: Callable
    # `tokpack plan`: (job, sources) -> {"pieces", "table_bytes", "pack_seconds"} of a row table
    # built before the epoch's passes (its `table` pass); None: nothing is built first.
    table_estimate: Callable | None = None
    # What the summaries call its samples ("windows" of the concatenated documents, best-fit's "rows").
    unit: str = "rows"
    # `tokpack plan`: (plan, sources, memory) -> the figures the summaries show of an epoch's rows
    # (`shown`'s, less the method), counted without writing; None: a packing without padding.
    figures: Callable | None = None
    # When its plans take `holdout` (shuffle --holdout, tokpack.shuffle.holdout: whole documents left
    # out of every epoch before they are packed), the plan of RUN/holdout/: (sources, *, seq_len, seed,
    # holdout, names, memory, pad_id, group_tokens) -> a plan of the held-out documents. None: no holdout.
    holdout: Callable | None = None
    # What the run manifest records of the holdout outside `packing` (a window run's: `holdout`,
    # tokpack.shuffle.plan.holdout_recorded reads it): (plan) -> dict.
    run_holdout: Callable = lambda p: {}
    # Whether its rows may end in padding: each epoch shard has a `.ds.pad` (the loader masks it),
    # and its manifests record a `packing` object (formats/packing.py rows_padded of what it wrote).
    padded: bool = False
    # How its rows are built when they are not windows located in the sources: (plan, sources) ->
    # a context manager of its row table (tokpack.shuffle.packed_table.PackedTable: `rows(g0, g1)` gives
    # the pieces of output rows [g0, g1) and their first tokens), built in a temporary folder.
    # None: each row is a window the plan locates (plan.locate), no table.
    table_rows: Callable | None = None
    # With a table: (plan, sources, read_in=True) -> what assembles rows from its pieces (TokenPool:
    # `rows(table, g0, g1, row_tokens, pad_id, starts)`), for `inspect`, the replay and a replacement
    # node (read_in=False: it reads only its rows' pieces, not every shard whole).
    token_pool: Callable | None = None
    # With a table: (folder, expected xxh3_128) -> the table `prepare` built in the epoch's work
    # folder (its `table` entry), reopened by the exchange and the replacement node.
    open_table: Callable | None = None
    # With padding: (table, rows, row_tokens, first row) -> each row's padding tokens (`.ds.pad`).
    row_padding: Callable | None = None


_REGISTRY: dict[str, Packing] = {}
DEFAULT = "concat"  # --packing without a value, a schedule without `packing:`


def register(entry: Packing) -> Packing:
    """Adds `entry`; its name and its `shuffle` must be new."""
    if entry.name in _REGISTRY or any(e.shuffle == entry.shuffle for e in _REGISTRY.values()):
        raise TokpackError(
            "packing registered twice",
            where="packing",
            expected="a new name and shuffle name",
            found=f"{entry.name} ({entry.shuffle})",
        )
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Removes a registered packing (a test's, or a plug-in's); the built-in ones stay."""
    if name in (WINDOWS.name, BEST_FIT.name):
        raise TokpackError("a built-in packing cannot be removed", where="packing", found=name)
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The packings `--packing` and a schedule's `packing:` take, in registration order."""
    return tuple(_REGISTRY)


def named(name: str | None, where: str = "--packing") -> Packing:
    """The entry of a `--packing` name (None: the default); an unknown name is one TokpackError."""
    entry = _REGISTRY.get(DEFAULT if name is None else name)
    if entry is None:
        raise TokpackError("unknown packing", where=where, expected=" or ".join(names()), found=name)
    return entry


def check_jitter(name: str, jitter: bool, where: str = "--jitter", file=None) -> None:
    """Refuses jitter with a packing that has no windows to shift, wherever the two were set
    (flags, a schedule file, or one of each)."""
    if jitter and not named(name).jitter:
        raise TokpackError(
            f"jitter shifts windows; {name} packing has none",
            file=file,
            where=where,
            expected=f"no jitter with packing {name}",
            found="jitter",
            hint=f"drop --jitter (or the schedule's jitter: true), or use --packing {DEFAULT}",
        )


def of_plan(p) -> Packing:
    """The entry whose plans `p` is one of (by its `algorithm`)."""
    for entry in _REGISTRY.values():
        if entry.shuffle == p.algorithm:
            return entry
    raise TokpackError("internal error: a plan of no registered packing", where="algorithm", found=p.algorithm)


def of_manifest(manifest: dict) -> Packing:
    """The entry of the `shuffle` an epoch manifest records. A name no entry has goes to the
    default one, whose plan refuses it in one line naming what it expected (as before packings
    were registered)."""
    return next((entry for entry in _REGISTRY.values() if entry.shuffle == manifest.get("shuffle")), _REGISTRY[DEFAULT])


# The figures an epoch's packing object may record besides its padding, as `shown` gives them.
ROW_FIGURES = ("documents_cut", "max_documents_per_row")


def shown(manifest: dict) -> dict:
    """What shuffle's summary and `inspect` show of an epoch's packing, from its manifest: the
    method, what its samples are called (`unit`), the padding (tokens and % of the epoch's
    tokens), and what the packing recorded of its rows (best-fit: documents cut, the most
    documents a row holds, its padding counted as one)."""
    entry = of_manifest(manifest)
    pk = manifest.get("packing") if isinstance(manifest.get("packing"), dict) else {}
    return figures_shown(
        entry,
        int(manifest.get("tokens") or 0),
        int(pk.get("padding_tokens") or 0),
        {k: pk[k] for k in ROW_FIGURES if k in pk},
    )


def figures_shown(entry: Packing, tokens: int, padding: int, recorded: dict) -> dict:
    """`shown` of an epoch of `tokens` tokens (padding included) of which `padding` pad."""
    return {
        "method": entry.name,
        "unit": entry.unit,
        "padding_tokens": padding,
        "padding_percent": round(100 * padding / tokens, 3) if tokens else 0.0,
        **recorded,
    }


def shown_of_epochs(manifests: list[dict]) -> dict:
    """`shown` over several epochs of one run (`inspect RUN`): their padding summed, documents
    cut summed and the most documents of a row over all, when every epoch records them."""
    figs = [shown(m) for m in manifests]
    combined = zip(ROW_FIGURES, (sum, max))  # documents cut sum over the epochs; the most documents a row, max
    recorded = {k: over(f[k] for f in figs) for k, over in combined if figs and all(k in f for f in figs)}
    return figures_shown(
        of_manifest(manifests[0]),
        sum(int(m.get("tokens") or 0) for m in manifests),
        sum(f["padding_tokens"] for f in figs),
        recorded,
    )


def shown_line(fig: dict) -> str:
    """`shown`'s figures in words, for the summaries' human lines."""
    words = f"{fig['method']} {fig['unit']}"
    if not fig["padding_tokens"] and not any(k in fig for k in ROW_FIGURES):
        return words  # windows: nothing padded, nothing recorded of the rows
    words += f", padding {fig['padding_tokens']:,} tokens ({fig['padding_percent']:g}%)"
    if "documents_cut" in fig:
        words += f", {fig['documents_cut']:,} document{'s' * (fig['documents_cut'] != 1)} cut"
    if "max_documents_per_row" in fig:
        words += f", at most {fig['max_documents_per_row']:,} documents per row (padding counted as one)"
    return words


def replay(manifest: dict, sources, order: bool = True, memory: int = DEFAULT_PLAN_MEMORY):
    """`validate --against`'s replay of an epoch of any registered packing: (sample multiset
    hash, per-shard order hashes), by its entry's replay."""
    return of_manifest(manifest).replay(manifest, sources, order, memory)


# -------------------------------------------------------------------- windows ("concat")


def _windows_plan(sources, *, memory, holdout=None, split=False, pad_id=None, **kw):
    return plan.epoch_plan(sources, holdout=plan.HoldoutChoice(holdout, split, packed_plan.held_out), **kw)


def _windows_in_memory(job, prepared, memory, needed, held):
    return steps.InMemoryStep(job, budget=memory), "inmemory", f"in memory ({needed / 2**20:.1f} MiB of windows)"


WINDOWS = register(
    Packing(
        name="concat",
        shuffle=plan.PLAN_ALGORITHM,
        jitter=True,
        options=lambda pad_id, group_tokens: {},
        plan=_windows_plan,
        chained=lambda p, *, members, sources, names, cursors, weights, counts, memory, **options: plan.chained_plan(
            p, members, sources, names, cursors, packed_plan.held_out
        ),
        from_manifest=lambda m, sources, memory: plan.EpochPlan.from_manifest(m, sources, packed_plan.held_out),
        replay=lambda m, sources, order, memory: plan.replay_hashes(m, sources, order, held_out=packed_plan.held_out),
        settings=lambda sources, **options: None,
        run_fields=lambda p: None,
        epoch_fields=lambda p, prepared: record_holdout(p.holdout, p.split, padded=False),
        memory_path=steps.window_memory,
        # out of core, the buckets hold every output row and its 8-byte position
        scratch_bytes=lambda job, out_of_core: job.plan.samples * (job.row_bytes + 8) if out_of_core else 0,
        prepare=lambda job, memory: {},
        in_memory=_windows_in_memory,
        out_of_core=lambda job, layout, prepared, budget: (
            steps.ScatterStep(job, layout),
            steps.OrderStep(job, layout, budget),
        ),
        scattered=lambda job, layout, i: layout.holds_rows_of(i, job.row_bytes),
        unit="windows",
        # RUN/holdout/: one pass over the windows of each source's held-out documents' stream, ordered as an
        # epoch is (epoch 0's keys), all of them (no weights, no --samples, no jitter)
        holdout=lambda sources, **kw: _windows_plan(sources, epoch=0, split=True, **kw),
        run_holdout=lambda p: record_holdout(p.holdout, padded=False),
    )
)


# -------------------------------------------------------------------- best-fit


def _best_fit_plan(sources, *, memory, jitter=False, **kw):
    """packed_epoch_plan, with the keywords that are PackedOptions' (pad_id, holdout, a schedule's
    cursors and counts...) as its options."""
    options = packed_plan.PackedOptions(**{k: kw.pop(k) for k in packed_plan.PackedOptions._fields if k in kw})
    return packed_plan.packed_epoch_plan(sources, memory=memory, options=options, **kw)


def _best_fit_in_memory(job, prepared, memory, needed, held):
    return (
        packed_step.PackedInMemoryStep(job, budget=memory, prepared=prepared),
        "bestfit",
        f"best-fit in memory ({held / 2**20:.1f} MiB)",
    )


BEST_FIT = register(
    Packing(
        name=packed_plan.BEST_FIT,
        shuffle=packed_plan.PACKED_ALGORITHM,
        jitter=False,
        options=packed_plan.plan_options,
        plan=_best_fit_plan,
        chained=lambda p, *, members, **kw: _best_fit_plan(seq_len=p.seq_len, seed=p.seed, epoch=p.epoch, **kw),
        from_manifest=packed_plan.packed_plan_from_manifest,
        replay=packed_replay.replay_packed,
        settings=packed_plan.packing_settings,
        run_fields=lambda p: packed_plan.packing_settings([], p.pad_id, p.group_tokens, p.holdout),
        epoch_fields=lambda p, prepared: {
            "packing": p.packing_entry(prepared["table_xxh3_128"], prepared["padding"], prepared.get("figures"))
        },
        memory_path=lambda job, memory: (packed_step.packed_memory(job, job.open_sources()),) * 2,
        scratch_bytes=lambda job, out_of_core: packed_step.packed_scratch_bytes(job, job.open_sources(), out_of_core),
        prepare=packed_step.prepare_table,
        in_memory=_best_fit_in_memory,
        out_of_core=lambda job, layout, prepared, budget: (
            packed_step.PackedScatterStep(job, layout, budget, prepared),
            packed_step.PackedOrderStep(job, layout, budget),
        ),
        scattered=lambda job, layout, i: packed_step.holds_pieces_of(layout, i),
        table_estimate=packed_step.table_estimate,
        figures=packed_table.row_figures,
        # RUN/holdout/: one pass over each source's held-out documents, best-fit packed and ordered as an
        # epoch is (epoch 0's keys), all of them (no weights, no --samples)
        holdout=lambda sources, **kw: _best_fit_plan(sources, epoch=0, split=True, **kw),
        padded=True,
        table_rows=packed_table.table_rows,
        token_pool=packed_replay.TokenPool,
        open_table=packed_table.PackedTable.open,
        row_padding=packed_table.row_padding,
    )
)
