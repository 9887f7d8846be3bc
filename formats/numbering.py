"""A run's epochs by consumed-sample number: which epoch and sample a run's G names
(`EpochNumbering`, from the run manifest's `samples` and `epoch_samples`), and the
`tokpack shuffle` command that writes an epoch of the run (the hint of every "epoch not
written" error). The reader, validate and stage all number a run's samples this way.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import TokpackError
from .constants import MANIFEST, RUN
from .checks import epoch_sizes_problem


class EpochNumbering:
    """Consumed-sample number G -> (epoch, sample), from the run's parameters only: epoch e
    holds G in [first(e), first(e) + size(e)). Every epoch has the run's `samples` N, so G is
    sample G mod N of epoch G div N; a run that lists `epoch_samples` (sizes planned when it
    was created) numbers its first epochs by those sizes instead; a scheduled run lists every
    epoch there and has `samples` 0: no epoch past them."""

    def __init__(self, samples: int | None, planned: Sequence[int] = ()):
        self.samples = samples  # N for every epoch past `planned` (None: no epochs past it)
        self.planned = tuple(int(n) for n in planned)  # sizes of epochs 0..len-1
        self._firsts = np.concatenate([[0], np.cumsum(self.planned, dtype=np.int64)]).astype(np.int64)

    @classmethod
    def of_run(cls, manifest: dict, run_dir: str | Path) -> "EpochNumbering":
        samples, planned = manifest.get("samples"), manifest.get("epoch_samples")
        if epoch_sizes_problem(samples, planned) is not None:
            raise TokpackError(
                "run manifest does not say how many samples an epoch holds",
                file=Path(run_dir) / MANIFEST,
                where="samples",
                expected="a positive integer (or an epoch_samples list)",
                found=samples if samples is not None else planned or None,
                hint="rerun the run's `tokpack shuffle` command to rewrite its manifest",
            )
        return cls(None if samples == 0 else samples, planned or ())

    def has(self, epoch: int) -> bool:
        return 0 <= epoch and (epoch < len(self.planned) or self.samples is not None)

    def size(self, epoch: int) -> int:
        self._check(epoch)
        return self.planned[epoch] if epoch < len(self.planned) else int(self.samples)

    def first(self, epoch: int) -> int:
        k = len(self.planned)
        if epoch != k:  # the end of the planned epochs is a position too
            self._check(epoch)
        return int(self._firsts[epoch]) if epoch <= k else int(self._firsts[-1]) + (epoch - k) * int(self.samples)

    def _check(self, epoch: int) -> None:
        if not self.has(epoch):
            raise TokpackError(
                "epoch is not in the run's plan",
                where="epoch",
                expected=f"0..{len(self.planned) - 1} (epoch_samples)",
                found=epoch,
            )

    def locate(self, g: int) -> tuple[int, int] | None:
        """(epoch, sample) of G, or None when G lies past every epoch the run can hold."""
        if g < self._firsts[-1]:
            e = int(np.searchsorted(self._firsts, g, side="right")) - 1
            return e, int(g - self._firsts[e])
        if self.samples is None:
            return None
        k = g - int(self._firsts[-1])
        return len(self.planned) + k // self.samples, k % self.samples


def shuffle_command(run: dict, run_dir: str | Path, epoch: int) -> str:
    """The `tokpack shuffle` command that writes epoch `epoch` of the run at `run_dir` (whose
    manifest is `run`): `--like`, which reads every setting from the run's own manifests
    (tokpack.shuffle.like), so that the command cannot leave out one the run was made with (its
    packing, its schedule...). Without a run manifest (`run` empty), RUN stands for the run."""
    where = shlex.quote(str(run_dir)) if run.get("kind") == RUN else "RUN"
    return f"tokpack shuffle --like {where} --epoch {epoch}"
