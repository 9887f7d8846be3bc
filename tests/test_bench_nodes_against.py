"""bench/nodes.py --against REV (issue 41, "Done when": CPU seconds a GB of an exchange process
against today's engine, in one run): its pure parts, without MPI or a timed run. Never how fast:
the figures are the benchmark's, on a shared machine."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nodes():
    """bench/nodes.py as a module (it puts the repository first on sys.path: put it back after)."""
    saved = list(sys.path)
    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module("bench.nodes")
    finally:
        sys.path[:] = saved


# What `shuffle --help` lists at b0a2bc6 (one process a node) and now, cut to the lines that matter.
OLD_HELP = """  --to-nodes DEST          Under MPI ...
  --ranks-per-node INTEGER  With --to-nodes: K ranks a node.
  --keep-sources DIR        With --to-nodes: each process keeps ... ({node} is replaced by n)
"""
NEW_HELP = OLD_HELP + "  --procs-per-node INTEGER  With --to-nodes: P processes a node.\n"


def test_the_options_a_tree_lacks_skip_its_cases_and_nothing_else(nodes):
    old, new, two = nodes.against_engines("b0a2bc6", Path("/old"), "abc1234")
    assert (old.shape, new.shape, two.shape) == ("4 nodes x 1", "4 nodes x 1", "2 nodes x 2")
    assert old.nodes * old.ranks == two.nodes * two.ranks == 8  # the same ranks: rank files comparable
    assert nodes.tree_options(OLD_HELP) == {"--keep-sources"}
    assert nodes.tree_options(NEW_HELP) == {"--keep-sources", "--procs-per-node"}
    assert nodes.tree_options("  --keep-sources-later DIR  not the option") == set()
    old_opts = nodes.tree_options(OLD_HELP)
    assert [nodes.runnable(old, c, old_opts) for c in nodes.AGAINST_CASES] == [None] * 4
    assert nodes.runnable(two, "first", old_opts) == "its tree has no --procs-per-node"
    assert nodes.runnable(new, "later", set()) == "its tree has no --keep-sources"
    assert nodes.runnable(new, "ooc", set()) is None


def test_the_command_is_the_same_but_for_the_shape(nodes):
    old, new, two = nodes.against_engines("b0a2bc6", Path("/old"), "HEAD")
    where = (Path("/s/src"), Path("/s/run"), Path("/n/a"), 512 << 20, 7)
    a, b, c = (nodes.exchange_argv(e, "later", *where) for e in (old, new, two))
    assert a == b  # 4x1: the very same command, whichever tree runs it
    assert "--procs-per-node" not in a  # b0a2bc6 would refuse it
    opt = {x: a[a.index(x) + 1] for x in ("--epoch", "--memory", "--ranks-per-node", "--keep-sources", "--to-nodes")}
    assert opt["--epoch"] == 1 and opt["--keep-sources"] == Path("/n/a/keep{node}")
    assert opt["--to-nodes"] == Path("/n/a/node{node}")
    two_opt = {x: c[c.index(x) + 1] for x in ("--memory", "--ranks-per-node", "--procs-per-node")}
    assert two_opt == {
        "--memory": 2 * opt["--memory"],
        "--ranks-per-node": 2 * opt["--ranks-per-node"],
        "--procs-per-node": 2,
    }
    first = nodes.exchange_argv(new, "first", *where)
    ooc = nodes.exchange_argv(new, "ooc", *where)
    assert "--keep-sources" not in first and first[first.index("--epoch") + 1] == 0
    assert ooc[ooc.index("--memory") + 1] < first[first.index("--memory") + 1]  # out of core: less than the rows


def test_same_bytes_compares_every_file_or_rank_files_across_shapes(nodes, tmp_path):
    def write(root: Path, files: dict) -> None:
        for name, data in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)

    ranks = {f"epoch-00000/rank-0000{r}.ds": bytes([r]) * 10 for r in range(4)}
    four = {f"node{r // 2}/{k}": v for r, (k, v) in enumerate(ranks.items())}
    two = {f"node0/{k}": v for k, v in ranks.items()}
    write(tmp_path / "a" / "dest", {**four, "node0/tokpack.json": b"{node 0 of 2}", "node0/tokpack.lock": b"1"})
    write(tmp_path / "a" / "run", {"tokpack.json": b"run", "tokpack-nodes.json": b"N=2"})
    write(tmp_path / "b" / "dest", {**two, "node0/tokpack.json": b"{node 0 of 1}"})
    write(tmp_path / "b" / "run", {"tokpack.json": b"run", "tokpack-nodes.json": b"N=1"})

    def digests(side):
        return {
            **nodes.file_digests(tmp_path / side / "dest", "dest"),
            **nodes.file_digests(tmp_path / side / "run", "run"),
        }

    a, b = digests("a"), digests("b")
    assert not any(k.endswith("tokpack.lock") for k in a)
    assert nodes.same_bytes(a, dict(a), whole=True) == f"yes ({len(a)} files)"
    assert nodes.same_bytes(a, b, whole=False) == "yes (5 files)"  # 4 rank files and RUN's manifest
    assert nodes.same_bytes(a, b, whole=True).startswith("NO: ")  # node folders, manifests and sidecar differ
    (tmp_path / "b" / "dest" / "node0" / "epoch-00000" / "rank-00003.ds").write_bytes(b"\0" * 10)
    verdict = nodes.same_bytes(a, digests("b"), whole=False)
    assert verdict == "NO: 1 of 5 files differ (dest/epoch-00000/rank-00003.ds)", verdict
    assert nodes.same_bytes({}, {}, whole=True).startswith("NO: ")  # nothing written is not "the same"


def _sample(wall, cpu, phases, same="yes (9 files)"):
    return {"wall": wall, "cores": 2.0, "cpu": cpu, "procs_cpu": cpu - 1, "phases": phases, "same": same}


def test_the_ratio_table_divides_the_reference_by_each_engine_per_case(nodes):
    engines = nodes.against_engines("b0a2bc6", Path("/old"), "HEAD")
    old, new, two = (e.label for e in engines)
    gb = 2e9  # the epoch's token bytes: CPU s a GB is CPU s / 2
    samples = {
        ("first", old): [
            _sample(9.0, 12.0, {"route": 8.0}),
            _sample(5.0, 10.0, {"route": 6.0}),
            _sample(7.0, 11.0, {"route": 7.0}),
        ],
        ("first", new): [_sample(3.0, 4.0, {"route": 2.0, "write": 1.0})],
        ("first", two): [_sample(3.0, 5.0, {"route": 3.0}, same="NO: 1 of 9 files differ (x)")],
        ("ooc", old): [_sample(9.0, 12.0, {})],
        ("ooc", new): [_sample(9.0, 8.0, {})],
    }
    rows = nodes.against_rows(samples, engines, int(gb), {("later", new): "its tree has no --keep-sources"})
    by = {(r["case"], r["engine"].split(" (")[0]): r for r in rows}
    ref = by[("first epoch", old)]
    assert (ref["runs"], ref["wall s"], ref["CPU s"], ref["CPU s/GB"]) == (3, 7.0, 11.0, 5.5)  # medians
    assert ref["same bytes"] == "reference" and "old/new" not in ref
    first = by[("first epoch", new)]
    assert first["CPU s/GB"] == 2.0 and first["old/new"] == 11.0 / 4.0
    assert first["phases CPU s/GB"] == 1.5 and first["phases old/new"] == pytest.approx(7.0 / 3.0)
    assert first["--json CPU s/GB"] == 1.5
    other = nodes.against_rows({("first", new): [_sample(3.0, 4.0, {"route": 2.0, "other": 4.0})]}, engines, int(gb))
    assert [(r["phases CPU s/GB"], r["other CPU s/GB"]) for r in other if r.get("runs")] == [
        (1.0, 2.0)
    ]  # start-up apart
    assert by[("first epoch", two)]["old/new"] == 11.0 / 5.0
    assert by[("first epoch", two)]["same bytes"].startswith("NO: ")  # a run's difference is shown, not hidden
    assert by[("first epoch, out of core", new)]["old/new"] == 1.5
    assert by[("first epoch, out of core", new)]["phases CPU s/GB"] is None  # no phases: no figure, no ratio
    assert by[("later epoch from kept sources", new)]["same bytes"] == "not run: its tree has no --keep-sources"
    assert "CPU s/GB" not in by[("later epoch from kept sources", old)]  # nothing measured: an empty row
    phases, names = nodes.phase_rows(samples, engines, int(gb))
    assert names == ["route", "write"]
    assert [(r["engine"], r["route"]) for r in phases if r["case"] == "first epoch"] == [
        (old, 3.5),
        (new, 1.0),
        (two, 1.5),
    ]


def test_a_rev_that_is_not_here_is_one_line_and_leaves_no_worktree(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    before = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "nodes.py"), "--against", "no-such-rev-41", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "nodes --against: 'no-such-rev-41' is not a commit of" in done.stderr.strip().splitlines()[-1]
    after = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before and not list(tmp_path.iterdir())


def test_a_gb_more_is_the_difference_of_two_sizes_over_their_gb(nodes):
    """--slope-from: each case and engine's CPU at the larger size less the smaller, over their
    GB; old/new against REV's of the same case; a case an engine did not run has no figure."""
    old, new, two = nodes.against_engines("b0a2bc6", Path("/old"), "abc1234")

    def runs(*cpu):
        return [{"cpu": c} for c in cpu]

    small = ({("first", old.label): runs(3.0, 3.2, 9.0), ("first", new.label): runs(2.0)}, 500_000_000)
    large = ({("first", old.label): runs(8.2), ("first", new.label): runs(4.5)}, 2_500_000_000)
    rows = {(r["case"], r["engine"]): r for r in nodes.slope_rows(small, large, [old, new])}
    first = nodes.AGAINST_CASES["first"]
    a, b = rows[(first, f"{old.label} ({old.shape})")], rows[(first, f"{new.label} ({new.shape})")]
    assert a["CPU s, smaller"] == 3.2 and a["CPU s a GB more"] == pytest.approx(2.5)  # the median run: 3.2
    assert b["CPU s a GB more"] == pytest.approx(1.25) and b["old/new"] == pytest.approx(2.0)
    later = rows[(nodes.AGAINST_CASES["later"], f"{new.label} ({new.shape})")]
    assert later["CPU s a GB more"] is None and later.get("old/new") is None


@pytest.mark.parametrize("smaller", ["2GiB", "4GiB"])
def test_a_slope_from_a_size_not_below_the_run_s_is_one_line_before_anything_is_made(nodes, smaller, tmp_path):
    with pytest.raises(SystemExit, match=f"--slope-from {smaller} is not below --size 2GiB"):
        nodes.main_against("HEAD", "2GiB", work=tmp_path / "w", slope_from=smaller)
    assert not (tmp_path / "w").exists()


def test_a_full_scratch_disk_ends_a_bench_in_one_line_and_other_errors_still_raise(nodes):
    """bench/nodes.py filled / once and ended in a traceback from its own corpus writer."""
    import errno

    from bench.common import disk_full_is_one_line

    with pytest.raises(SystemExit) as stop:
        with disk_full_is_one_line("bench/nodes.py", Path("/scratch")):
            raise OSError(errno.ENOSPC, "No space left on device", "/scratch/corpus/000.ds")
    line = str(stop.value.code)
    assert "\n" not in line and line.startswith("bench/nodes.py: no space left")
    assert "/scratch/corpus/000.ds" in line and "hint:" in line and "--work" in line
    with pytest.raises(PermissionError):
        with disk_full_is_one_line("bench/nodes.py", Path("/scratch")):
            raise PermissionError(errno.EACCES, "Permission denied", "/scratch")
