"""A node's DEST beside the RUN of a `shuffle --to-nodes` run: where it is (`{node}` in DEST),
what it may already hold (its slice of this run, scratch, a lock), and RUN's manifests as the
node reads them back. Shared by the exchange (tokpack.packer.exchange), the replacement node
(tokpack.packer.replacement) and `plan shuffle --to-nodes` (tokpack.packer.planning)."""

from __future__ import annotations

from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import LOCK_NAME, MANIFEST, MAX_MANIFEST_BYTES, RUN, SLICE_EPOCH, WORK_DIR
from tokpack.formats.io.gate import open_read, read_limited
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import parse_manifest
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.slices import RankRows, slice_epoch_manifest, slice_manifest
from tokpack.packer.stage_dest import epoch_in_place, previous_slice

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
        if p.name not in (LOCK_NAME, MANIFEST, WORK_DIR) and not (p.name.startswith("epoch-") and p.is_dir())
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
