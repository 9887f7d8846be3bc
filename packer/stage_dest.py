"""What DEST holds, before `tokpack stage` writes there: the bytes a stage copies and writes (its space
check), the copy DEST holds (dest_holds) and the line refusing one that is not this copy's; of a
node slice, a slice of the same run and ranks, whose epochs already staged are kept in place
(previous_slice, epoch_in_place), or anything else, refused with the first setting that differs.
And a node's DEST beside the RUN of `shuffle --to-nodes` (its exchange, the replacement node, its
plan): where it is (`{node}` in DEST), what it may hold (its slice of this run, scratch, a lock),
and RUN's manifests as the node reads them back."""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_read, read_limited
from tokpack.formats.io.paths import local_path
from tokpack.formats.io.writes import is_tmp_name
from tokpack.formats.constants import (
    EPOCH,
    HOLDOUT_DIR,
    LOCK_NAME,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    RUN,
    SLICE,
    SLICE_EPOCH,
    SOURCE,
    STAGE_SIDECAR,
    WORK_DIR,
)
from tokpack.formats.names import EPOCH_DIR_PREFIX, epoch_dir_name
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.reading import canonical_bytes, parse_manifest, read_manifest, require_valid, strict_json
from tokpack.formats.shards import is_own_file, shard_suffixes
from tokpack.formats.slices import RUN_SELECTION_KEYS, SLICE_EPOCH_KEYS, SLICE_SHAPE_KEYS, RankRows, missing_padding
from tokpack.formats.slices import rank_file_name, slice_epoch_manifest, slice_manifest, stage_command
from tokpack.packer.stage_plan import DirPlan, join_rel, shard_jobs


def local_dest(dest) -> Path:
    """DEST as a local path (a `file://` URL is one): a stage reads from any fsspec URL but
    writes to local disk."""
    local = local_path(dest)
    if local is None:
        raise TokpackError(
            "DEST must be a local path",
            file=dest,
            expected="a local directory (e.g. on NVMe)",
            found="a URL",
            hint="stage reads from any fsspec URL but writes to local disk",
        )
    return Path(local)


def in_place(path: Path, size: int | None) -> bool:
    """A file a rerun will verify in place, not copy again (or so its size says)."""
    return size is not None and path.is_file() and path.stat().st_size == size


def bytes_to_copy(dest: Path, plans: list[DirPlan]) -> int:
    """Bytes of the files a stage into `dest` copies: those not in place already."""
    return sum(j.size or 0 for p in plans for j in p.jobs if not in_place(dest / j.rel, j.size))


# A filesystem allocates whole blocks (4 KiB on ext4, xfs and tmpfs): a run's many small sidecars
# and manifests each take one at least, which a sum of their bytes does not see.
FS_BLOCK = 4096


def on_disk(n: int | None) -> int:
    """The bytes a file of `n` bytes takes on disk; a small file of unrecorded size (a shard's
    .metadata) takes one block."""
    return FS_BLOCK if n is None else -(-int(n) // FS_BLOCK) * FS_BLOCK


def bytes_to_write(dest: Path, plans: list[DirPlan]) -> int:
    """What a stage into `dest` writes, as the space check counts it: every file not in place
    already (shards and all their sidecars: .index, .metadata, .rows, .loss, .pad), every
    manifest and the partial-copy record, each rounded up to whole blocks. (bytes_to_copy is
    the bytes copied, which plan's timing uses.)"""
    files = sum(
        on_disk(j.size)
        for p in plans
        for j in p.jobs  # a file of unrecorded size replaces itself
        if not (in_place(dest / j.rel, j.size) or j.size is None and (dest / j.rel).is_file())
    )
    manifests = sum(on_disk(len(canonical_bytes(p.manifest))) for p in plans)
    return files + manifests + (FS_BLOCK if any(p.skipped_shards for p in plans) else 0)


def check_dest(dest: Path, kind: str, plans: list[DirPlan]) -> None:
    """Refuse to mix two datasets in one DEST, before anything is written: DEST holds nothing
    tokpack wrote, or a copy (finished or not) of this same directory, whose files alone a stage
    replaces. An existing manifest must describe the same data."""
    held = dest_holds(dest)
    if held.kind not in (None, "damaged", "other", kind, UNFINISHED[kind]):
        raise refuse_dest(held, f"nothing, or a copy of this {kind}")
    damaged = []
    for p in plans:
        path = dest / p.rel / MANIFEST
        if not path.is_file():
            continue
        try:
            have = small_json(path)
        except (OSError, TokpackError):
            damaged.append(path)  # an unreadable manifest at DEST vouches for nothing; rewritten at the end
            continue
        want = p.manifest
        if kind == RUN and p.rel == "":  # the same run staged with another --epochs selection
            have = {k: v for k, v in have.items() if k not in RUN_SELECTION_KEYS}
            want = {k: v for k, v in want.items() if k not in RUN_SELECTION_KEYS}
        if have != want:
            # DEST's root manifest says what it holds; without one, the epoch's says what was left there
            # (an epoch of this run is written the same every time: one that differs is another run's)
            raise refuse_dest(
                held if held.path == dest / MANIFEST else dest_holds(dest, path, other_run=True),
                f"a copy of this {kind}",
            )
    for p in plans:  # a folder no manifest vouches for yet: its shard files must be this copy's
        _check_unvouched(dest, p)
    if kind == RUN and held.kind == UNFINISHED[RUN]:
        # Epochs of an unfinished copy that this stage does not write: no run manifest vouches
        # for them yet, so each must come from this run (another --epochs selection of it).
        run, planned = plans[-1].manifest, {p.rel for p in plans}
        for d in sorted(dest.glob(f"{EPOCH_DIR_PREFIX}*/{MANIFEST}")):
            if d.parent.name not in planned and not _same_run(small_manifest(d), run):
                raise refuse_dest(dest_holds(dest, d, other_run=True), "a copy of this run")
    for path in damaged:  # removed once DEST is known to be this copy: nothing is written before
        path.unlink()


def _check_unvouched(dest: Path, p: DirPlan) -> None:
    """Refuses the shard files of a DEST folder without a manifest (a killed stage's) that are
    not this copy's: a name its manifest does not list (another source's or epoch's shards), or
    sizes other than the recorded ones for more of its files than match. A killed stage of this
    copy leaves the files it verified, at their sizes (and temporaries, removed), and at most a
    few of the copy's own files damaged before a repair began: those a rerun replaces."""
    folder = dest / p.rel if p.rel else dest
    if (folder / MANIFEST).is_file() or not folder.is_dir():
        return
    sizes = {j.rel: j.size for j in shard_jobs(p.manifest, "")[0]}  # every shard's files, --shards-of's left out too
    matched, other = 0, []
    for f in sorted(folder.iterdir()):
        if f.name == MANIFEST or is_tmp_name(f.name) or not is_own_file(f):
            continue
        want = sizes.get(f.name, -1)
        if want == -1:
            other = [(f, "not a file of this copy")]
            break
        if want is not None:
            if f.stat().st_size == want:
                matched += 1
            else:
                other.append((f, f"{f.stat().st_size} bytes, this copy's is {want}"))
    if other and (other[0][1] == "not a file of this copy" or len(other) > matched):
        f, found = other[0]
        raise refuse_dest(
            Held(
                UNFINISHED.get(p.manifest.get("kind"), "other"),
                f"an unfinished copy of another directory ({join_rel(p.rel, f.name)}: {found})",
                f,
            ),
            f"nothing, or a copy of this {p.manifest.get('kind')}",
        )


# ------------------------------------------------------------------------ what DEST holds

# What a stage of each kind may resume: its own copy that a killed stage left without a root manifest.
UNFINISHED = {
    "source": "unfinished copy",
    "epoch": "unfinished copy",
    "run": "unfinished run copy",
    "slice": "unfinished slice",
}
# An epoch manifest's fields that say which run it belongs to (besides its sources' fingerprints).
_EPOCH_RUN_KEYS = ("dtype", "seed", "seq_len", "shard_samples", "shuffle", "jitter", "packing", "tokenizer")
_RANK_FILE = re.compile(r"rank-(\d+)[.]ds([.].*)?")


@dataclass
class Held:
    """What DEST holds, for the line that refuses it."""

    kind: str | None  # a root manifest's kind, an UNFINISHED value, "damaged", "other", "foreign" or None (nothing)
    words: str  # e.g. "a node slice of ranks 0-1 of 4 (micro-batch 3) of the run with seed 0"
    path: Path  # the file or folder that says so
    manifest: dict | None = None  # DEST's root manifest, when it has one


def small_json(path: Path):
    """A manifest a stage wrote, read bounded and strictly as every manifest is."""
    return strict_json(read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path)


def small_manifest(path: Path) -> dict | None:
    """A JSON object a stage wrote (a manifest, the partial-copy record), or None for any it cannot read as one."""
    try:
        m = small_json(path)
    except (OSError, TokpackError):
        return None
    return m if isinstance(m, dict) else None


def _same_run(epoch: dict | None, run: dict) -> bool:
    """Whether an epoch manifest comes from `run` (its settings and its sources' fingerprints)."""
    if epoch is None or epoch.get("kind") != EPOCH:
        return False
    prints = [[s.get("fingerprint") for s in m.get("sources") or [] if isinstance(s, dict)] for m in (epoch, run)]
    return prints[0] == prints[1] and all(epoch.get(k) == run.get(k) for k in _EPOCH_RUN_KEYS if k in run)


def _describe(m: dict) -> str:
    """A manifest's copy in words: its kind and what tells it from another copy of that kind."""
    kind, run = m.get("kind"), m.get("run") if isinstance(m.get("run"), dict) else m
    of_run = f"the run with seed {run.get('seed')}, seq_len {run.get('seq_len')}"
    if kind == SOURCE:
        return f"a copy of a packed source ({len(m.get('shards') or [])} shards, {m.get('tokens')} tokens)"
    if kind == RUN:
        return f"a whole-run copy of {of_run} (epochs {m.get('epochs')})"
    if kind == EPOCH:
        return f"a copy of epoch {m.get('epoch')} of {of_run}"
    if kind in (SLICE, SLICE_EPOCH):
        ranks = m.get("ranks") if isinstance(m.get("ranks"), list) and m.get("ranks") else ["?"]
        return (
            f"a node slice of ranks {ranks[0]}-{ranks[-1]} of {m.get('world_size')} "
            f"(micro-batch {m.get('micro_batch')}) of {of_run}"
        )
    return f"a tokpack.json of kind {kind!r}"


def dest_holds(dest: Path, path: Path | None = None, other_run: bool = False) -> Held:
    """What DEST holds: its root manifest's copy; without one (a stage killed before its end),
    the unfinished copy its epoch folders and shard or rank files are; `path`: the manifest to
    name (one that differs from the stage's)."""
    dest = Path(dest)
    root = dest / MANIFEST
    if path is not None and path != root:
        m = small_manifest(path)
        words = _describe(m) if m else "an unreadable tokpack.json"
        if m and m.get("kind") == EPOCH:  # no root manifest: a whole-run copy a stage left unfinished
            words = f"an unfinished whole-run copy{' of another run' if other_run else ''} ({path.parent.name}: {words[2:]})"
        return Held(m.get("kind") if m else "damaged", words, path, m)
    if root.is_file():
        m = small_manifest(root)
        if m is None:
            return Held("damaged", "an unreadable tokpack.json", root)
        kind = m.get("kind")
        words = _describe(m)
        if kind == RUN and (dest / STAGE_SIDECAR).is_file():
            words += f", staged for some ranks only ({STAGE_SIDECAR})"
        return Held(kind if kind in UNFINISHED else "other", words, root, m)
    if not dest.is_dir():
        return Held(None, "nothing", dest)
    foreign = _foreign_entries(dest)
    if foreign:
        return Held("foreign", foreign, dest)
    held = Held(None, "nothing", dest)
    for p in sorted(dest.iterdir()):
        if p.name in ("tokpack.lock", STAGE_SIDECAR) or is_tmp_name(p.name):
            if p.name == STAGE_SIDECAR:
                held = Held(UNFINISHED["run"], f"an unfinished whole-run copy for some ranks ({p.name})", p)
            continue
        if p.is_dir() and p.name.startswith(EPOCH_DIR_PREFIX):
            m = small_manifest(p / MANIFEST) if (p / MANIFEST).is_file() else None
            if m is not None and m.get("kind") == SLICE_EPOCH:
                return Held(
                    UNFINISHED["slice"],
                    f"an unfinished {_describe(m)[2:]} ({p.name} and no slice manifest yet)",
                    p / MANIFEST,
                    m,
                )
            if m is not None and m.get("kind") == EPOCH:
                held = Held(
                    UNFINISHED["run"],
                    f"an unfinished whole-run copy ({p.name} and no run manifest yet)",
                    p / MANIFEST,
                    m,
                )
                continue
            names = sorted(q.name for q in p.iterdir())
            rank = next((n for n in names if _RANK_FILE.fullmatch(n)), None)
            if rank is not None:
                return Held(
                    UNFINISHED["slice"], f"an unfinished node slice ({p.name}/{rank}, no manifest yet)", p / rank
                )
            shard = next((n for n in names if is_own_file(p / n) and n != MANIFEST and not is_tmp_name(n)), None)
            if shard is not None and held.kind is None:
                held = Held(
                    UNFINISHED["run"], f"an unfinished whole-run copy ({p.name}/{shard}, no manifest yet)", p / shard
                )
            continue
        if is_own_file(p):
            if held.kind is None:
                held = Held(
                    UNFINISHED["source"], f"an unfinished copy of a source or epoch ({p.name}, no manifest yet)", p
                )
            continue
        if held.kind is None:
            held = Held("other", f"files tokpack did not write ({p.name})", p)
    return held


def _foreign_entries(dest: Path) -> str:
    """DEST's entries that no stage writes, in a few words ("" for none): their count and the
    first three names (a home folder may hold thousands: counted as listed, never all held)."""
    count, first = 0, []
    for p in dest.iterdir():
        ours = p.name in (LOCK_NAME, STAGE_SIDECAR) or is_tmp_name(p.name) or is_own_file(p)
        if ours or p.is_dir() and (p.name.startswith(EPOCH_DIR_PREFIX) or p.name in (HOLDOUT_DIR, WORK_DIR)):
            continue
        count += 1
        first = heapq.nsmallest(3, [*first, p.name])
    if not count:
        return ""
    return f"{count:,} entr{'ies' if count != 1 else 'y'} a stage did not write ({', '.join(first)}{', ...' * (count > 3)})"


def refuse_dest(held: Held, expected: str) -> TokpackError:
    """The one line refusing a DEST: what it holds, and that a stage writes over its own copy only."""
    if held.kind == "foreign":  # a user's folder: never "remove DEST", which would delete their files
        return TokpackError(
            "DEST is a folder of other files, not a stage destination",
            file=held.path,
            expected="an empty folder, or a previous stage destination",
            found=held.words,
            hint="give a new or empty DEST, or the folder a previous stage wrote; a stage writes no copy among "
            "other files (nor removes them), as shuffle -o and pack -o do not",
        )
    return TokpackError(
        "DEST already holds a different tokpack directory",
        file=held.path,
        expected=expected,
        found=held.words,
        hint="remove DEST or choose another destination: a stage replaces only the files it wrote for this same copy",
    )


# ------------------------------------------------------------------------ a node slice at DEST


def epoch_in_place(d: Path, want: dict) -> bool:
    """The epoch's slice manifest is there, for this slice and this run epoch, with its files at their sizes."""
    have = small_manifest(d / MANIFEST)
    if have is None or any(have.get(k) != want[k] for k in SLICE_EPOCH_KEYS):
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
    from tokpack.shuffle.packings import DEFAULT as DEFAULT_PACKING  # here: a whole-shard stage needs no shuffle/

    if value is None:
        return f"{DEFAULT_PACKING} (no packing recorded)" if where.endswith(".packing") else "none"
    if isinstance(value, dict):
        method = value.get("method")
        rest = ", ".join(f"{k} {v}" for k, v in sorted(value.items()) if k != "method")
        return f"{method} ({rest})" if method and rest else str(method) if method else rest or "{}"
    return str(value) if isinstance(value, (str, int, float)) else repr(value)


def previous_slice(dest: Path, root: dict, source: str) -> list[int]:
    """The epochs a slice at DEST already holds; refuses a DEST holding anything else, before
    anything is written (dest_holds names what it holds): another kind
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
        for d in sorted(q for q in dest.iterdir() if q.is_dir() and q.name.startswith(EPOCH_DIR_PREFIX)):
            if (d / MANIFEST).is_file():
                have = read_manifest(d, (SLICE_EPOCH, SOURCE, RUN, EPOCH), checked=False)
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
    have = read_manifest(dest, (SLICE, SOURCE, RUN, EPOCH), checked=False)
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


# ------------------------------------------------------------------------ a node's DEST beside RUN (shuffle --to-nodes)

NODE = "{node}"  # in DEST: replaced by the process's node number


def node_dest(dest, node: int) -> Path:
    return Path(str(dest).replace(NODE, str(node)))


def local_dirs(where: str, *paths) -> None:
    """Refuses a URL among `paths` (those given): RUN and DEST are folders, on the shared
    filesystem and the node's own disk."""
    if any(p is not None and "://" in str(p) for p in paths):
        raise TokpackError(
            "--to-nodes writes local directories",
            where=where,
            hint="RUN is a shared-filesystem path, DEST a node-local one",
        )


def dest_template(dest) -> str:
    """Every node's DEST as RUN's sidecar names it: absolute, {node} kept."""
    return str(Path(str(dest)).absolute())


def read_raw(path: Path) -> bytes:
    """A manifest of RUN, its bytes as written (a node slice's manifests quote them), checked."""
    with open_read(path, ahead=False) as f:  # RUN's manifest, through the gate
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    parse_manifest(raw, path)
    return raw


def slice_root_of_run(out: Path, ranks, w: int, micro_batch: int) -> tuple[dict, dict]:
    """(RUN's run manifest, the root manifest of the slice of `ranks` it gives: from its first
    batch, as --to-nodes has no --start-sample)."""
    run = parse_manifest(read_raw(out / MANIFEST), out / MANIFEST, RUN)
    return run, slice_manifest(run, str(out.absolute()), RankRows(w, micro_batch, 0), *ranks)


def finish_slice_root(output, dest: Path, root: dict, epochs) -> dict:
    """The slice's root manifest `root` committed at DEST, listing `epochs` (its complete ones)
    and their tokens, as their manifests record them."""
    root["epochs"] = sorted(epochs)
    root["tokens"] = sum(
        int(
            parse_manifest(
                read_limited(dest / epoch_dir_name(e) / MANIFEST, MAX_MANIFEST_BYTES, "manifest"), dest, SLICE_EPOCH
            )["tokens"]
        )
        for e in root["epochs"]
    )
    output.finish(dest, root)
    return root


def own_dest(dest: Path, out: Path, ranks, w: int, micro_batch: int) -> list[int]:
    """DEST is new, or holds what a --to-nodes run (or stage --node) of this run and these ranks
    left: its slice epochs (the complete ones listed), scratch, a lock. Returns the epochs its root lists."""
    if not dest.is_dir():
        return []
    foreign = [
        p.name
        for p in dest.iterdir()
        if p.name not in (LOCK_NAME, MANIFEST, WORK_DIR) and not (p.name.startswith(EPOCH_DIR_PREFIX) and p.is_dir())
    ]
    if foreign:
        raise TokpackError(
            "DEST holds files that are not a node slice's",
            file=dest,
            found=", ".join(sorted(foreign)[:5]),
            hint="give an empty or new DEST, or this node's slice of this run",
        )
    if not (dest / MANIFEST).exists():
        return []
    if not (out / MANIFEST).exists():
        raise TokpackError(
            "DEST holds a node slice, and RUN no run",
            file=dest / MANIFEST,
            hint="give an empty or new DEST, or the RUN the slice came from",
        )
    return previous_slice(dest, slice_root_of_run(out, ranks, w, micro_batch)[1], str(out))


def slice_epoch_here(
    out: Path, dest: Path, epoch: int, first: int, samples: int, ranks, w: int, micro_batch: int
) -> bool:
    """This node's slice of `epoch` is complete at DEST, for RUN's epoch manifest as it is."""
    if not (dest / epoch_dir_name(epoch) / MANIFEST).exists():
        return False
    root = slice_root_of_run(out, ranks, w, micro_batch)[1]
    raw = read_raw(out / epoch_dir_name(epoch) / MANIFEST)
    return epoch_in_place(dest / epoch_dir_name(epoch), slice_epoch_manifest(root, epoch, samples, first, raw))


def run_numbering(setup, out: Path) -> EpochNumbering:
    """The epochs' numbering of the run `setup` (tokpack.shuffle.run.setup_run) writes at RUN `out`."""
    return EpochNumbering.of_run(setup.written_run_manifest(out, setup.todo[0][1], []), out)
