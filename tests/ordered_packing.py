"""A toy third packing, "ordered": an epoch is its sources' windows in source order (each
source's chain from its start, one source after another), no permutation. It plugs in by this
module and one registry line (`packings.register(ORDERED)`, tests/test_packing_registry.py):
its entry is the window packing's with its own names, its plan and its replay. Nothing else in
the project names it; `shuffle`, `validate --against` and `stage --node` reach it through the
registry (tokpack.shuffle.packings) and the manifests it writes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from tokpack.shuffle import packings
from tokpack.formats.constants import PLAN_ALGORITHM
from tokpack.shuffle.plan import EpochPlan, replay_hashes

NAME, SHUFFLE = "ordered", "test-ordered-windows-v1"


class Identity:
    """The orders of an ordered epoch: output position g holds chain position g, and pass p of a
    source holds its windows in stream order."""

    def forward(self, q):
        return np.asarray(q, dtype=np.int64)

    def inverse(self, g):
        return np.asarray(g, dtype=np.int64)


@dataclass(frozen=True)
class OrderedPlan(EpochPlan):
    """The window plan (its sources, chains and windows), in chain order; the manifests name it SHUFFLE."""

    @property
    def algorithm(self) -> str:
        return SHUFFLE

    def order(self):
        return Identity()

    def window_perm(self, s: int, p: int):
        return Identity()

    @classmethod
    def of(cls, plan: EpochPlan) -> "OrderedPlan":
        return cls(**{f.name: getattr(plan, f.name) for f in fields(plan)})


WINDOWS = packings.named(packings.DEFAULT)


def from_manifest(manifest, sources, memory):
    """The plan an ordered epoch's manifest was written from (the window plan's reading of it)."""
    if manifest.get("shuffle") != SHUFFLE:
        raise AssertionError(f"the registry sent an epoch of {manifest.get('shuffle')} to {SHUFFLE}")
    return OrderedPlan.of(WINDOWS.from_manifest({**manifest, "shuffle": PLAN_ALGORITHM}, sources, memory))


ORDERED = replace(
    WINDOWS,
    name=NAME,
    shuffle=SHUFFLE,
    jitter=False,  # windows from each source's start: the order is the sources' own
    plan=lambda sources, **kw: OrderedPlan.of(WINDOWS.plan(sources, **kw)),
    chained=lambda plan, **kw: OrderedPlan.of(WINDOWS.chained(plan, **kw)),
    from_manifest=from_manifest,
    replay=lambda m, sources, order, memory: replay_hashes(m, sources, order, plan=from_manifest(m, sources, memory)),
)
