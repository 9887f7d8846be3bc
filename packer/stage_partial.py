"""A `tokpack stage --shards-of r/W`'s partial copy: the sidecar at DEST's root that lists the shards
left out, and the note when the ranks' shards are (nearly) the whole run anyway."""

from __future__ import annotations

from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import read_limited
from tokpack.formats.constants import MAX_MANIFEST_BYTES, STAGE_SIDECAR
from tokpack.formats.builders import stage_sidecar
from tokpack.formats.reading import strict_json
from tokpack.formats.outputs import Output
from tokpack.formats.slices import stage_command
from tokpack.packer.stage_plan import DirPlan


def whole_copy_note(plans: list[DirPlan], ranks, micro_batch: int, source: str, dest: str) -> str | None:
    """One line when a `--shards-of r/W` stage copies (nearly) the whole run anyway: how much, why,
    and the node-slice command that copies only the ranks' rows."""
    if ranks is None:
        return None
    total = sum(int(s.get("bytes") or 0) for p in plans for s in p.manifest.get("shards") or [])
    left = sum(
        int(s.get("bytes") or 0)
        for p in plans
        for s in p.manifest.get("shards") or []
        if s.get("path") in p.skipped_shards
    )
    if not total or left > total / 2:
        return None
    (rs, world), per = ranks, max([int(p.manifest.get("shard_samples") or 0) for p in plans] or [0])
    return (
        f"stage: whole-run copy ({100 * (total - left) / total:.0f}% of the run's shard bytes): --shards-of "
        f"{','.join(map(str, rs))}/{world} copies whole shards, and a shard ({per:,} samples) holds rows of these "
        f"ranks in any global batch it spans ({world * micro_batch:,} samples each); "
        f"`{stage_command(source, dest, rs[0], rs[-1], world, micro_batch)}` copies only their rows"
    )


def partial_sidecar(dest: Path, plans: list[DirPlan], ranks, micro_batch: int, output: Output) -> dict:
    """Records at DEST's root which shards a --ranks stage left out (those not present at
    DEST, counting earlier stages), or removes the record once nothing is missing."""
    path = dest / STAGE_SIDECAR
    try:
        previous = (
            strict_json(read_limited(path, MAX_MANIFEST_BYTES, STAGE_SIDECAR), path, STAGE_SIDECAR)
            if path.is_file()
            else {}
        )
    except (OSError, TokpackError):
        previous = {}
    missing = {}
    for p in plans:
        absent = [s for s in p.skipped_shards if not (dest / p.rel / s).is_file()]
        if absent:
            missing[p.rel or "."] = absent
    if not missing:
        output.unfinish(dest, STAGE_SIDECAR)
        return {}
    stages = list(previous.get("stages", []))
    if ranks is not None:
        stages.append({"ranks": ranks[0], "world_size": ranks[1], "micro_batch": micro_batch})
    output.finish(dest, stage_sidecar(stages, missing), STAGE_SIDECAR)
    return missing
