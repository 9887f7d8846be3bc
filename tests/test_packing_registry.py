"""A third packing algorithm, registered from this module only (tokpack.shuffle.packings),
runs through `tokpack shuffle`, `tokpack validate --against` and `tokpack plan shuffle` without
a change to any other module: the CLI, the schedule file, the engine, the replay and the plan
all reach it through its registry entry.

The algorithm is the window shuffle with its epoch order reversed: output position g holds the
window the default packing puts at N-1-g. Every sample is a valid window, so the epoch passes
every check of the format, and its order is recognisably not the default's: an engine or a
replay that bypassed the registry (the default's plan for a name it does not know) would
write, or prove, the other order.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.reading import read_manifest, write_manifest
from tokpack.loader.reader import SampleReader
from tokpack.packer.cli import main  # imported before the packing is registered: its choices are read at parse time
from tokpack.shuffle import packings
from tokpack.formats.constants import PLAN_ALGORITHM
from tokpack.shuffle.plan import EpochPlan, replay_hashes
from tokpack.shuffle.schedule import read_schedule

NAME, SHUFFLE = "reversed", "test-reversed-feistel6-splitmix-xxh3-v1"
E0 = "epoch-00000"


class Flipped:
    """sigma_e followed by g -> N-1-g: still a bijection on [0, N)."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def forward(self, q):
        return self.n - 1 - self.inner.forward(q)

    def inverse(self, g):
        return self.inner.inverse(self.n - 1 - np.asarray(g, dtype=np.int64))


@dataclass(frozen=True)
class ReversedPlan(EpochPlan):
    """The window plan, its epoch order reversed; the manifests name it SHUFFLE."""

    @property
    def algorithm(self) -> str:
        return SHUFFLE

    def order(self):
        return Flipped(super().order(), self.samples)

    @classmethod
    def of(cls, plan: EpochPlan) -> "ReversedPlan":
        return cls(**{f.name: getattr(plan, f.name) for f in fields(plan)})


def _from_manifest(manifest, sources, memory):
    if manifest.get("shuffle") != SHUFFLE:  # as the window plan refuses another algorithm's epoch
        raise AssertionError(f"the registry sent an epoch of {manifest.get('shuffle')} to {SHUFFLE}")
    return ReversedPlan.of(EpochPlan.from_manifest({**manifest, "shuffle": PLAN_ALGORITHM}, sources))


WINDOWS = packings.named(packings.DEFAULT)
REVERSED = replace(
    WINDOWS,
    name=NAME,
    shuffle=SHUFFLE,
    plan=lambda sources, **kw: ReversedPlan.of(WINDOWS.plan(sources, **kw)),
    chained=lambda plan, **kw: ReversedPlan.of(WINDOWS.chained(plan, **kw)),
    from_manifest=_from_manifest,
    replay=lambda m, sources, order, memory: replay_hashes(m, sources, order, plan=_from_manifest(m, sources, memory)),
)


@pytest.fixture
def registered():
    packings.register(REVERSED)
    try:
        yield REVERSED
    finally:
        packings.unregister(NAME)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rng = np.random.default_rng(31)
    return write_source(tmp_path_factory.mktemp("registry-src") / "src", random_docs(rng, 300, 1000, 0, 1, 200))


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res


SHUFFLE_ARGS = ("--epochs", 1, "--seq-len", 63, "--seed", 5, "--shard-samples", 64, "--memory", "64MiB")


def _rows(edir: Path) -> np.ndarray:
    m = read_manifest(edir, kind="epoch")
    return SampleReader.from_manifests([(edir, m)]).read(0, m["samples"])


def test_an_unregistered_packing_is_no_choice_and_a_registered_one_is(source, tmp_path):
    """The CLI was imported above, before the registration: its --packing choices are the
    registry's when a command line is parsed, and the schedule file's `packing:` likewise."""
    res = _cli("shuffle", source, "-o", tmp_path / "no", *SHUFFLE_ARGS, "--packing", NAME)
    assert res.exit_code == 2 and f"'{NAME}' is not one of" in res.output, res.output
    sched = tmp_path / "run.yaml"
    sched.write_text(
        f"seq_len: 63\nseed: 5\npacking: {NAME}\nstages:\n  - name: a\n    sources: {{{source}: 1}}\n    epochs: 1\n"
    )
    with pytest.raises(Exception, match="unknown packing in the schedule"):
        read_schedule(sched)
    packings.register(REVERSED)
    try:
        assert NAME in _cli("shuffle", "--help").output
        assert read_schedule(sched).packing == NAME
    finally:
        packings.unregister(NAME)


def test_a_third_packing_runs_through_shuffle_validate_and_plan(registered, source, tmp_path):
    out, ref = tmp_path / "rev", tmp_path / "win"
    res = _cli("shuffle", source, "-o", out, *SHUFFLE_ARGS, "--packing", NAME, "--json")
    assert res.exit_code == 0, res.output
    assert _cli("shuffle", source, "-o", ref, *SHUFFLE_ARGS, "--json").exit_code == 0
    m, run = read_manifest(out / E0, kind="epoch"), read_manifest(out, kind="run")
    assert m["shuffle"] == run["shuffle"] == SHUFFLE and "packing" not in m and "packing" not in run

    # Its plan wrote the bytes: the default order, reversed, and not the default order itself.
    rev, win = _rows(out / E0), _rows(ref / E0)
    assert len(rev) == len(win) > 2 and np.array_equal(rev, win[::-1]) and not np.array_equal(rev, win)

    # Its replay proves them: validate --against passes.
    res = _cli("validate", out, "--against", source, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["ok"], res.output

    # Bypassing the registry breaks it: the default's replay of the same bytes (the manifest
    # naming the default algorithm) finds every shard out of order.
    bypass = tmp_path / "bypass"
    shutil.copytree(out / E0, bypass)
    write_manifest(bypass, {**m, "shuffle": PLAN_ALGORITHM})
    res = _cli("validate", bypass, "--against", source, "--json")
    assert res.exit_code == 1 and "order_hash" in res.output, res.output

    # Altered content fails too: two shards swapped whole, files and entries (each still
    # agrees with its own checksums, so only the replay of the order can tell).
    altered = tmp_path / "altered"
    shutil.copytree(out / E0, altered)
    shards = m["shards"]
    assert len(shards) >= 2 and shards[0]["samples"] == shards[1]["samples"]
    for f in sorted(altered.glob(shards[0]["path"] + "*")):
        other = altered / f.name.replace(shards[0]["path"], shards[1]["path"])
        tmp = f.with_name("swap")
        f.rename(tmp), other.rename(f), tmp.rename(other)
    swapped = [{**shards[1], "path": shards[0]["path"]}, {**shards[0], "path": shards[1]["path"]}, *shards[2:]]
    write_manifest(altered, {**m, "shards": swapped})
    assert _cli("validate", altered, "--json").exit_code == 0  # without --against: every file is its entry's
    res = _cli("validate", altered, "--against", source, "--json")
    assert res.exit_code == 1 and "order_hash" in res.output, res.output

    # `tokpack plan shuffle` plans it through its entry: the default's passes, its own name.
    res = _cli("plan", "shuffle", source, "-o", tmp_path / "planned", *SHUFFLE_ARGS, "--packing", NAME, "--json")
    want = _cli("plan", "shuffle", source, "-o", tmp_path / "planned", *SHUFFLE_ARGS, "--json")
    assert res.exit_code == 0 and want.exit_code == 0, res.output + want.output
    got, want = json.loads(res.output), json.loads(want.output)
    assert [e.pop("packing")["method"] for e in got["epochs"]] == [NAME] * len(got["epochs"])  # its own name
    assert [e.pop("packing")["method"] for e in want["epochs"]] == ["concat"] * len(want["epochs"])
    assert got["passes"] == want["passes"] and got["epochs"] == want["epochs"] and got["shards"] == want["shards"]


def test_the_registry_dispatches_by_name_only(registered, source):
    """Each lookup finds the third entry by its own name: a plan it made, a manifest it wrote,
    its --packing name; the built-in ones stay where they were."""
    from tokpack.formats.shards import PackedSource

    plan = registered.plan(
        [PackedSource.open(source)],
        seq_len=63,
        seed=5,
        epoch=0,
        weights=None,
        samples=None,
        tokens=None,
        jitter=False,
        names=None,
        memory=1 << 20,
    )
    assert packings.of_plan(plan) is registered and packings.named(NAME) is registered
    assert packings.of_manifest({"shuffle": SHUFFLE}) is registered
    assert packings.of_manifest({"shuffle": PLAN_ALGORITHM}) is WINDOWS
    assert packings.names()[:2] == (packings.DEFAULT, packings.BEST_FIT.name) and packings.names()[-1] == NAME
    with pytest.raises(Exception, match="registered twice"):
        packings.register(REVERSED)


# ------------------------------------------------------------------ a toy third packing, "ordered"


@pytest.fixture
def ordered():
    from ordered_packing import ORDERED

    packings.register(ORDERED)  # its one registry line
    try:
        yield ORDERED
    finally:
        packings.unregister(ORDERED.name)


def test_a_toy_ordered_packing_runs_through_shuffle_validate_and_stage(ordered, source, tmp_path):
    """tests/ordered_packing.py (windows in source order, no permutation) plugs in by its module
    and one registry line: `shuffle` writes its bytes, `validate --against` proves them by its
    replay (and the default's replay of the same bytes refuses them), `stage --node` slices the
    run and each slice validates against it and serves the run's batches."""
    from ordered_packing import SHUFFLE

    from tokpack.formats.shards import PackedSource

    out = tmp_path / "ordered"
    res = _cli("shuffle", source, "-o", out, *SHUFFLE_ARGS[2:], "--epochs", 2, "--packing", ordered.name, "--json")
    assert res.exit_code == 0, res.output
    m, run = read_manifest(out / E0, kind="epoch"), read_manifest(out, kind="run")
    assert m["shuffle"] == run["shuffle"] == SHUFFLE and "packing" not in m and "packing" not in run

    # Its bytes: the source's token stream cut into rows of seq_len + 1, in order, each epoch.
    src = PackedSource.open(source)
    tokens = np.concatenate([np.fromfile(source / sh["path"], dtype=src.dtype) for sh in src.shards])
    rows = _rows(out / E0)
    assert len(rows) == len(tokens) // 64 > 2
    assert np.array_equal(rows, tokens[: len(rows) * 64].reshape(-1, 64))
    assert np.array_equal(_rows(out / "epoch-00001"), rows)

    # Its replay proves them; the default's replay of the same bytes finds them out of order.
    res = _cli("validate", out, "--against", source, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["ok"], res.output
    bypass = tmp_path / "bypass"
    shutil.copytree(out / E0, bypass)
    write_manifest(bypass, {**m, "shuffle": PLAN_ALGORITHM})
    res = _cli("validate", bypass, "--against", source, "--json")
    assert res.exit_code == 1 and "order_hash" in res.output, res.output

    # stage --node: two nodes of two ranks; each slice is the run's, rank by rank.
    full = SampleReader.open(out)
    for n in (0, 1):
        dest = tmp_path / f"node{n}"
        res = _cli("stage", out, dest, "--node", f"{n}/2", "--ranks-per-node", 2, "--micro-batch", 2, "--json")
        assert res.exit_code == 0, res.output
        res = _cli("validate", dest, "--against", out, "--json")
        assert res.exit_code == 0 and json.loads(res.output)["ok"], res.output
        part = SampleReader.open(dest)
        for rank in (2 * n, 2 * n + 1):
            want = [b.tolist() for b in full.batches(rank, 4, 2, 0, at_end="stop")]
            assert want and [b.tolist() for b in part.batches(rank, 4, 2, 0, at_end="stop")] == want


def test_each_entry_says_whether_its_rows_carry_padding_as_its_epochs_show(source, tmp_path):
    """The registry's `padded` and `table_rows` are what an epoch of the packing is: padded rows
    carry a `.ds.pad` per shard and a `packing` object (the format's rows_padded), and a packing
    whose rows come from a row table has a pool to assemble them and the hooks to reopen it."""
    from tokpack.formats.packing import has_pad, rows_padded

    for name in packings.names():
        entry = packings.named(name)
        out = tmp_path / name
        res = _cli("shuffle", source, "-o", out, *SHUFFLE_ARGS, "--packing", name, "--json")
        assert res.exit_code == 0, res.output
        m = read_manifest(out / E0, kind="epoch")
        assert packings.of_manifest(m) is entry
        assert rows_padded(m) == entry.padded and all(has_pad(s) == entry.padded for s in m["shards"])
        built = (entry.table_rows, entry.token_pool, entry.open_table)
        assert all(hook is None for hook in built) or all(hook is not None for hook in built)
        assert (entry.row_padding is not None) == entry.padded
    assert packings.BEST_FIT.padded and packings.BEST_FIT.table_rows is not None
    assert not packings.WINDOWS.padded and packings.WINDOWS.table_rows is None
