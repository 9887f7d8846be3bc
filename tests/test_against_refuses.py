"""`validate --against` refuses what it cannot compare (issue 32, item 3): a node slice given
anything but its run (a packed source, an epoch, another run), and a run given something that
is not one of its sources, are one line and exit 1, never OK "against N source(s)"."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.cli import main
from tokpack.packer.slicing import stage_slice

STATUS = re.compile(r"^(OK|CORRUPT|UNVERIFIED|INCOMPLETE)(: | (run|epoch|source|slice|directory) )")


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def problem_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line and not STATUS.match(line)]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("against")
    rng = np.random.default_rng(8)
    src = write_source(root / "src", random_docs(rng, 120, 1000, 0), docs_per_shard=40)
    other_src = write_source(root / "other-src", random_docs(rng, 120, 1000, 0), docs_per_shard=40)
    kw = dict(
        seq_len=63, epochs=[0], samples=None, tokens=None, shard_samples=12, memory=8 << 20, jitter=False, log=None
    )
    shuffle_run([str(src)], str(root / "run"), seed=0, **kw)
    shuffle_run([str(src)], str(root / "other-run"), seed=1, **kw)
    stage_slice(str(root / "run"), root / "slice", ranks="1-2", world_size=4, micro_batch=3)
    return {
        "src": src,
        "other_src": other_src,
        "run": root / "run",
        "other_run": root / "other-run",
        "epoch": root / "run" / epoch_dir_name(0),
        "slice": root / "slice",
    }


def test_a_slice_against_its_run_passes(world):
    code, out = cli("validate", world["slice"], "--against", world["run"])
    assert code == 0, out


@pytest.mark.parametrize("given,kind", [("src", "source"), ("epoch", "epoch"), ("other_src", "source")])
def test_a_slice_against_what_is_not_a_run_is_one_line(world, given, kind):
    code, out = cli("validate", world["slice"], "--against", world[given])
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert f"{world[given]} [--against]" in lines[0] and "a slice is compared only with its run" in lines[0], out
    assert f"found a {kind}" in lines[0] and str(world["run"]) in lines[0], out  # the hint names its run
    assert "against 1 source" not in out and out.splitlines()[-1].startswith("UNVERIFIED"), out


def test_a_slice_against_another_run_is_one_line(world):
    code, out = cli("validate", world["slice"], "--against", world["other_run"])
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1 and "slice was not staged from this run" in lines[0], out


def test_a_slice_against_a_folder_without_a_manifest_is_one_line(world, tmp_path):
    code, out = cli("validate", world["slice"], "--against", tmp_path)
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1 and "found no tokpack directory" in lines[0], out


def test_a_run_against_its_source_passes(world):
    code, out = cli("validate", world["run"], "--against", world["src"])
    assert code == 0, out


@pytest.mark.parametrize("given,kind", [("other_run", "run"), ("epoch", "epoch"), ("slice", "slice")])
def test_a_run_against_what_is_not_a_source_is_one_line(world, given, kind):
    """A run, epoch or slice given as a run's source: refused in one line, not validated as
    the source it is not (which gave three lines, one a misleading "wrong kind")."""
    code, out = cli("validate", world["run"], "--against", world[given])
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert f"{world[given]} [--against]" in lines[0] and f"found a {kind}" in lines[0], out
    assert "--against takes the packed sources of a run" in lines[0] and "against 1 source" not in out, out


def test_a_run_against_another_source_is_one_line(world):
    """A packed source, but not the run's: the epoch's source was not given, which is said once."""
    code, out = cli("validate", world["run"], "--against", world["other_src"])
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1 and "source not given to --against" in lines[0], out
    assert f"--against {world['src']}" in lines[0], out  # the hint names the run's own source


def test_a_run_against_its_source_and_a_run_compares_the_source(world):
    code, out = cli("validate", world["run"], "--against", world["src"], "--against", world["other_run"])
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1 and "found a run" in lines[0], out
    assert "against 1 source" in out.splitlines()[-1]
