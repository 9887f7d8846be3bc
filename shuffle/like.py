"""`tokpack shuffle --like RUN` (API: `shuffle(like=RUN)`): the settings a run was made with,
read from its own run manifest, so that an epoch added later is byte for byte the epoch the
run's first command would have written, without the user repeating (or misremembering) that
command. Every hint that proposes writing an epoch proposes this command
(tokpack.formats.numbering.shuffle_command).

What is read: the sources (as the run recorded them) and their weights, seq_len, seed,
samples per epoch, jitter, shard_samples, the packing and its pad id; a run made from a
schedule file is its file again (read as when the run was made; the run's check that the same
schedule is given refuses a file edited since). What the user still chooses is how the work
runs: --memory, --workers, the executor, --scratch, and -o (default: RUN itself).
"""

from __future__ import annotations

from tokpack.formats.errors import IncompleteError, TokpackError
from pathlib import Path

from tokpack.formats.constants import LOCK_NAME, MANIFEST, RUN, WORK_DIR
from tokpack.formats.io.paths import as_path, local_path
from tokpack.formats.names import EPOCH_DIR_PREFIX
from tokpack.formats.packing import run_holdout
from tokpack.formats.reading import read_manifest

from . import packings
from .schedule import read_schedule
from .spec import ShuffleSpec, given_names

# shuffle's settings that --like reads from the run (API keyword -> CLI flag): giving one as well is refused,
# since two answers to one question would leave the user unsure which the epoch was written with.
TAKEN = {
    "sources": "SOURCE",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "samples": "--samples",
    "tokens": "--tokens",
    "shard_samples": "--shard-samples",
    "jitter": "--jitter",
    "schedule": "--schedule",
    "packing": "--packing",
    "pad_id": "--pad-id",
    "holdout": "--holdout",
}


def given_with_like(values: dict) -> list[str]:
    """The flags of the settings given among the keywords `values` (given_names), though --like
    takes them from the run. Given is not truthy: `--seed 0` and `--packing concat` are given."""
    given = given_names(values)
    return [TAKEN[k] for k in TAKEN if k in given]


def _started_run(run_dir) -> bool:
    """Whether a folder without tokpack.json holds what a shuffle writes before it (an epoch
    folder, its work folder or lock): a run that was interrupted, which its rerun finishes."""
    d = as_path(run_dir)
    try:
        return any(p.name.startswith(EPOCH_DIR_PREFIX) or p.name in (WORK_DIR, LOCK_NAME) for p in d.iterdir())
    except (OSError, AttributeError):  # unreadable, or a bucket's prefix (no listing here): assume it may be
        return True


def run_settings(run_dir) -> dict:
    """The settings of a ShuffleSpec that write epochs of the run at `run_dir` with its own
    settings: sources and weights, seq_len, seed, samples, jitter, shard_samples, packing, pad_id
    and holdout (or schedule, the file's path, for a run made from a schedule file)."""
    try:
        m = read_manifest(run_dir, kind=RUN)
    except TokpackError as e:
        if e.where == "kind" or e.message == "not a directory":
            found = e.found
        elif isinstance(e, IncompleteError) and not _started_run(run_dir):
            found = "a folder without tokpack.json or epoch folders"  # no run ever wrote there: not an unfinished one
        else:
            raise
        raise TokpackError(
            "--like takes a run directory",
            file=run_dir,
            where="kind",
            expected="run (a directory holding tokpack.json and epoch-NNNNN/)",
            found=found,
            hint="give the run directory (the one holding tokpack.json and epoch-NNNNN/)",
        ) from None
    # What the run recorded and the user never typed: one gone since is named with the run
    # manifest's field, not as a bare path the user may not recognise.
    recorded = [("schedule_file", m["schedule_file"])] if m.get("schedule_file") else []
    recorded = recorded or [(f"sources[{i}].path", s["path"]) for i, s in enumerate(m["sources"])]
    for where, path in recorded:
        local = local_path(path)
        if local is not None and not Path(local).exists():
            raise TokpackError(
                "the run's input is no longer where the run recorded it",
                file=as_path(run_dir) / MANIFEST,
                where=where,
                expected="the file or directory the run was made from",
                found=f"nothing at {path}",
                hint="put it back at that path (a symbolic link to where it is now will do), then rerun",
            )
    pk = m.get("packing") if isinstance(m.get("packing"), dict) else {}
    holdout = run_holdout(m)  # as parse_holdout recorded it, given back as its text
    holdout = None if holdout is None else holdout.get("fraction") or str(holdout.get("tokens"))
    settings = {
        "packing": packings.of_manifest(m).name,
        "pad_id": pk.get("pad_id"),
        "holdout": holdout,
        "shard_samples": int(m["shard_samples"]),
        "tokens": None,
    }
    if m.get("schedule_file"):
        return {
            **settings,
            "sources": [],
            "weights": None,
            "seq_len": None,
            "seed": None,
            "samples": None,
            "jitter": False,
            "schedule": m["schedule_file"],
        }
    return {
        **settings,
        "sources": [s["path"] for s in m["sources"]],
        "weights": m.get("weights") or [None] * len(m["sources"]),
        "seq_len": int(m["seq_len"]),
        "seed": int(m["seed"]),
        "samples": int(m["samples"]),
        "jitter": bool(m.get("jitter")),
        "schedule": None,
    }


def like_spec(spec: ShuffleSpec) -> ShuffleSpec:
    """`spec` with its `like` run's own settings, its output defaulting to the run; unchanged
    without `like` (a setting the run declares that the user gave as well is refused before:
    tokpack.packer.api.shuffle_usage)."""
    like = spec.like
    if like is None:
        return spec
    taken = run_settings(like)
    if taken["schedule"] is None and spec.epochs is None:
        raise TokpackError(
            "no epochs named to add to the run",
            where="--epoch/--epochs",
            file=like,
            expected="the epochs to write",
            hint="a run made with flags has no last epoch: name the "
            "ones to add (--epoch E, --epochs N; the API's epochs=)",
        )
    schedule = None if taken["schedule"] is None else read_schedule(taken["schedule"])
    return spec.with_settings(**{**taken, "schedule": schedule}, output=like if spec.output is None else spec.output)
