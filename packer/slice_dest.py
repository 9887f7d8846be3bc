"""What DEST already holds of a node slice: a slice of
the same run and ranks, whose epochs already staged are kept in place (previous_slice,
epoch_in_place), or anything else, refused with the first setting that differs.
"""

from __future__ import annotations

from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.writes import is_tmp_name
from tokpack.formats.io.gate import read_limited
from tokpack.formats.constants import MANIFEST, MAX_MANIFEST_BYTES, SLICE, SLICE_EPOCH
from tokpack.formats.reading import parse_manifest, require_valid
from tokpack.formats.shards import shard_suffixes
from tokpack.formats.slices import SLICE_EPOCH_KEYS, SLICE_SHAPE_KEYS, missing_padding, rank_file_name, stage_command
from tokpack.packer.stage_dest import UNFINISHED, Held, dest_holds, refuse_dest, small_json
from tokpack.shuffle.packings import DEFAULT as DEFAULT_PACKING


def epoch_in_place(d: Path, want: dict) -> bool:
    """The epoch's slice manifest is there, for this slice and this run epoch, with its files at their sizes."""
    try:
        have = small_json(d / MANIFEST)
    except (OSError, TokpackError):
        return False
    if not isinstance(have, dict) or any(have.get(k) != want[k] for k in SLICE_EPOCH_KEYS):
        return False
    try:
        return all(
            (d / s["path"]).stat().st_size == s["bytes"]
            and missing_padding(d, want, s) is None
            and all((d / f"{s['path']}{x}").is_file() for x in shard_suffixes(s)[1:])
            for s in have["shards"]
        )
    except (OSError, KeyError, TypeError):
        return False


def epoch_tokens(d: Path) -> int:
    return int(small_json(d / MANIFEST)["tokens"])


# A run's settings, in the order a difference is named: what the user chose before what follows from it.
_CHOSEN = ("packing", "seed", "sources", "weights", "seq_len", "jitter", "schedule", "shard_samples", "samples")


def _first_difference(want, have, where: str) -> tuple[str, str, str]:
    """The field where two run identities differ, as (where, expected, found): the field that
    differs (a setting the user chose first), not the seed when both seeds are the same."""
    if isinstance(want, dict) and isinstance(have, dict):
        keys = sorted(set(want) | set(have), key=lambda k: (_CHOSEN.index(k) if k in _CHOSEN else len(_CHOSEN), k))
        for key in keys:
            if want.get(key) != have.get(key):
                return _first_difference(want.get(key), have.get(key), f"{where}.{key}")
    shown = [_shown(v, where) for v in (want, have)]
    return where, *(t if len(t) <= 80 else t[:77] + "..." for t in shown)


def _shown(value, where: str) -> str:
    """A run identity's field in a refusal's words: a packing by its method and settings, the
    default packing (a run that records no packing object) by its name."""
    if value is None:
        return f"{DEFAULT_PACKING} (no packing recorded)" if where.endswith(".packing") else "none"
    if isinstance(value, dict):
        method = value.get("method")
        rest = ", ".join(f"{k} {v}" for k, v in sorted(value.items()) if k != "method")
        return f"{method} ({rest})" if method and rest else str(method) if method else rest or "{}"
    return str(value) if isinstance(value, (str, int, float)) else repr(value)


def previous_slice(dest: Path, root: dict, source: str) -> list[int]:
    """The epochs a slice at DEST already holds; refuses a DEST holding anything else, before
    anything is written (tokpack.packer.staging.dest_holds names what it holds): another kind
    of copy, or a slice (finished or not) of another run or other ranks."""
    path = dest / MANIFEST
    if not path.is_file():
        held = dest_holds(dest)
        if held.kind is None:
            return []
        if held.kind != UNFINISHED[SLICE]:
            raise refuse_dest(held, "nothing, or a node slice of these ranks of this run")
        # A killed stage of a slice: every epoch folder it left is this slice's (its manifest, or its rank files).
        ours = {rank_file_name(r) for r in root["ranks"]}
        for d in sorted(q for q in dest.iterdir() if q.is_dir() and q.name.startswith("epoch-")):
            if (d / MANIFEST).is_file():
                have = parse_manifest(
                    read_limited(d / MANIFEST, MAX_MANIFEST_BYTES, "manifest"),
                    d / MANIFEST,
                    kind=(SLICE_EPOCH, "source", "run", "epoch"),
                )
                if have.get("kind") != SLICE_EPOCH:
                    raise refuse_dest(dest_holds(dest, d / MANIFEST), "a node slice of these ranks of this run")
                _same_slice(have, root, source, dest, d / MANIFEST)
            stray = sorted(
                q.name
                for q in d.iterdir()
                if q.name != MANIFEST and not is_tmp_name(q.name) and q.name.partition(".ds")[0] + ".ds" not in ours
            )
            if stray:
                raise refuse_dest(
                    Held(
                        UNFINISHED[SLICE],
                        f"files of another copy or of other ranks ({d.name}/{stray[0]})",
                        d / stray[0],
                    ),
                    f"the rank files of ranks {root['ranks'][0]}-{root['ranks'][-1]}",
                )
        return []
    have = parse_manifest(
        read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path, kind=(SLICE, "source", "run", "epoch")
    )
    if have.get("kind") != SLICE:
        raise refuse_dest(dest_holds(dest), "nothing, or a node slice of these ranks of this run")
    require_valid(have, dest)  # a damaged slice manifest is one line, as for every reader
    _same_slice(have, root, source, dest, path)
    return [int(e) for e in have.get("epochs") or []]


def _same_slice(have: dict, root: dict, source: str, dest: Path, path: Path) -> None:
    """Refuses a slice manifest at DEST (its root's or an epoch's) of another run or other ranks."""
    if have.get("run") != root["run"]:
        where, want, found = _first_difference(root["run"], have.get("run"), "run")
        raise TokpackError(
            "DEST holds a slice of another run",
            file=path,
            where=where,
            expected=f"{want} (the run being staged)",
            found=found,
            hint="remove DEST or choose another destination",
        )
    for key in SLICE_SHAPE_KEYS:
        if have.get(key) != root[key]:
            ranks = have.get("ranks") or [0]
            raise TokpackError(
                "DEST holds a slice for other ranks",
                file=path,
                where=key,
                expected=root[key],
                found=have.get(key),
                hint="remove DEST or choose another destination; it was made by `"
                + stage_command(
                    source,
                    str(dest),
                    ranks[0],
                    ranks[-1],
                    have.get("world_size"),
                    have.get("micro_batch"),
                    have.get("batch_phase") or 0,
                )
                + "`",
            )
