"""The format's packing and held-out records: what a manifest says of how its rows were made.

An epoch or run whose rows are packed documents records a `packing` object (docs/FORMAT.md,
"Best-fit epochs"); its rows may end in padding, and each of its shards carries a `.ds.pad`.
Window (concat) epochs record none. `PackingRecord` is that object, parsed; `rows_padded` and
`has_pad` are the two format facts readers ask, never a packing's name.

`--holdout` is recorded in one of two places, by the rows' kind: a window epoch or run records it
at the top level (`holdout`, RUN/holdout/'s with `"split": "holdout"` inside it), a packed one in
its `packing` object (`packing.holdout`, RUN/holdout/'s with `packing.split`). Format 1 has
written both since --holdout came; this module owns the rule: `holdout_recorded` reads it from
either home, `record_holdout` gives the fields to write at the right one. Nothing else looks."""

from __future__ import annotations

from dataclasses import dataclass, field

HOLDOUT_SPLIT = "holdout"  # `split` of RUN/holdout/'s manifest, wherever its held-out record is


@dataclass(frozen=True)
class PackingRecord:
    """A manifest's `packing` object: `method` (the packing's name), `group_tokens` and `pad_id`
    (its settings), `holdout` (the run's --holdout, as recorded), `split` (RUN/holdout/'s), and
    the epoch's figures (`padding_tokens`, `table_xxh3_128`, ...) in `figures`."""

    method: str
    group_tokens: int | None = None
    pad_id: int | None = None
    holdout: dict | None = None
    split: bool = False
    figures: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, manifest: dict) -> PackingRecord | None:
        """The record of an epoch, run or slice manifest; None for one without (windows)."""
        pk = manifest.get("packing")
        if not isinstance(pk, dict):
            return None
        known = ("method", "group_tokens", "pad_id", "holdout", "split")
        figures = {k: v for k, v in pk.items() if k not in known}
        return cls(pk.get("method"), pk.get("group_tokens"), pk.get("pad_id"), *holdout_recorded(manifest), figures)

    def settings(self) -> dict:
        """What a rerun of the run must repeat: method, group_tokens, pad_id and holdout, those
        recorded."""
        kept = ("method", "group_tokens", "pad_id", "holdout")
        return {k: getattr(self, k) for k in kept if getattr(self, k) is not None}


def rows_padded(manifest: dict) -> bool:
    """Whether an epoch's (or a run's) samples are packed documents that may end in padding:
    it has a `packing` object (FORMAT.md, "Best-fit epochs"), so its samples are no windows and
    every epoch shard carries a `.ds.pad`. The packing that writes the object decides
    (tokpack.shuffle.packings); the format layer asks this, never a packing's name."""
    return isinstance(manifest.get("packing"), dict)


def has_pad(entry: dict) -> bool:
    """Whether a shard (or rank file) entry lists a `.ds.pad`, by its `pad_xxh3_128`."""
    return "pad_xxh3_128" in entry


def holdout_recorded(manifest: dict) -> tuple[dict | None, bool]:
    """(the `--holdout` an epoch or run manifest records, without `split`; whether it is
    RUN/holdout/'s), from its one home: `packing` for packed rows, the top level for windows."""
    if rows_padded(manifest):
        pk = manifest["packing"]
        h = pk.get("holdout")
        return (h if isinstance(h, dict) else None), pk.get("split") == HOLDOUT_SPLIT
    h = manifest.get("holdout")
    if not isinstance(h, dict):
        return None, False
    return {k: v for k, v in h.items() if k != "split"}, h.get("split") == HOLDOUT_SPLIT


def run_holdout(manifest: dict) -> dict | None:
    """The `--holdout` a run (or epoch) manifest records, of any packing: a run that records one
    has RUN/holdout/."""
    return holdout_recorded(manifest)[0]


def record_holdout(holdout: dict | None, split: bool = False, *, padded: bool) -> dict:
    """The fields that record `holdout` (and, `split`, that this is RUN/holdout/): `padded`,
    to end the `packing` object with; else to put in the manifest itself (a window epoch's or
    run's). Empty without a holdout."""
    if padded:
        return {**({} if holdout is None else {"holdout": holdout}), **({"split": HOLDOUT_SPLIT} if split else {})}
    return {} if holdout is None else {"holdout": {**holdout, **({"split": HOLDOUT_SPLIT} if split else {})}}
