"""Words with one meaning each (docs/COMMANDS.md, "Words"; issue 31, item 7): each renamed
option's new spelling, its old spelling as a hidden alias (works, warns once, gives the same
output), and the docs that name every result class."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tokpack.packer.cli import main

from conftest import project_files, random_docs, shuffle_run, write_source

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = {"seconds", "mib_per_s", "dest"}
WARNING = "tokpack: warning: --ranks r/W without --world-size is deprecated"


@pytest.fixture
def run(tmp_path) -> Path:
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0)
    src = write_source(tmp_path / "src", docs, docs_per_shard=40)
    shuffle_run(
        [str(src)],
        str(tmp_path / "run"),
        seq_len=63,
        seed=0,
        epochs=[0, 1],
        samples=None,
        tokens=None,
        shard_samples=12,
        memory=8 << 20,
        jitter=False,
        log=None,
    )
    return tmp_path / "run"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def untimed(out: str) -> dict:
    return {k: v for k, v in json.loads(out).items() if k not in TIMINGS}


def test_shards_of_is_the_shard_level_stage_and_ranks_r_w_its_warned_alias(run, tmp_path):
    new = invoke("stage", run, tmp_path / "new", "--shards-of", "1/4", "--micro-batch", 5, "--json")
    old = invoke("stage", run, tmp_path / "old", "--ranks", "1/4", "--micro-batch", 5, "--json")
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)
    assert new.stderr == "" and old.stderr.count("tokpack: warning:") == 1 and WARNING in old.stderr
    assert "--shards-of r/W" in old.stderr
    got = untimed(new.stdout)
    assert got == untimed(old.stdout) and got["partial"] and got["ranks"] == [1] and got["world_size"] == 4
    assert tree(tmp_path / "new") == tree(tmp_path / "old")
    # the human summary too, but for its timings and DEST
    lines = [
        invoke("stage", run, tmp_path / d, flag, "1/4", "--micro-batch", 5)
        for d, flag in (("new-text", "--shards-of"), ("old-text", "--ranks"))
    ]
    assert [[line for line in r.stdout.splitlines() if line.split(":")[0].strip() not in TIMINGS] for r in lines][
        0
    ] == [[line for line in r.stdout.splitlines() if line.split(":")[0].strip() not in TIMINGS] for r in lines][1]


def test_plan_stage_takes_both_spellings_alike(run, tmp_path):
    args = ("plan", "stage", run, tmp_path / "d", "--micro-batch", 3, "--disk-mbps", 100)
    new = invoke(*args, "--shards-of", "1/4")
    old = invoke(*args, "--ranks", "1/4")
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)

    def steady(text):  # the target's free space moves with whatever else writes to that disk
        return [line for line in text.splitlines() if "free" not in line]

    assert steady(new.stdout) == steady(old.stdout) and "whole-run copy" in new.stdout
    assert "--shards-of 1/4" in new.stdout
    assert new.stderr == "" and old.stderr.count("tokpack: warning:") == 1

    def planned(flag):
        out = json.loads(invoke(*args, flag, "1/4", "--json").stdout)
        return {
            **out,
            "space": [{k: v for k, v in s.items() if k not in ("free_bytes", "enough")} for s in out["space"]],
        }

    assert planned("--shards-of") == planned("--ranks")


def test_node_slice_ranks_do_not_warn(run, tmp_path):
    r = invoke("stage", run, tmp_path / "s", "--ranks", "0-1", "--world-size", 4, "--micro-batch", 2, "--json")
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout)["kind"] == "slice"


def test_shards_of_refuses_a_node_slice_and_names_itself_in_errors(run, tmp_path):
    for extra in (["--world-size", 4], ["--ranks", "0-1"], ["--node", "0/2", "--ranks-per-node", 2]):
        r = invoke("stage", run, tmp_path / "x", "--shards-of", "1/4", *extra)
        assert r.exit_code == 2 and "--shards-of" in r.output, r.output
    r = invoke("stage", run, tmp_path / "y", "--shards-of", "4/4")
    assert r.exit_code == 1 and "bad --shards-of" in r.stderr and "warning" not in r.stderr, r.output
    old = invoke("stage", run, tmp_path / "z", "--ranks", "4/4")  # the old spelling's errors name it, as before
    assert old.exit_code == 1 and "bad --ranks" in old.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_help_shows_shards_of_and_no_longer_offers_ranks_r_w():
    shown = invoke("stage", "--help").output
    assert "'r/W'" in shown.split("--shards-of TEXT", 1)[1].split("--ranks TEXT", 1)[0]
    ranks_help = shown.split("--ranks TEXT", 1)[1].split("--world-size INTEGER", 1)[0]
    assert "A-B" in ranks_help and "r/W" not in ranks_help


def test_api_stage_shards_of_equals_its_old_spelling(run, tmp_path):
    from tokpack import stage
    from tokpack.formats.errors import TokpackError

    new = stage(run, tmp_path / "new", shards_of="0/2", micro_batch=2)
    old = stage(run, tmp_path / "old", ranks="0/2", micro_batch=2)
    assert untimed(json.dumps(new.to_json())) == untimed(json.dumps(old.to_json()))
    assert tree(tmp_path / "new") == tree(tmp_path / "old")
    with pytest.raises(TokpackError, match="--shards-of"):
        stage(run, tmp_path / "bad", shards_of="0/2", world_size=2)


def _result_classes() -> dict[str, str]:
    """Every command result class in packer/: its name -> its module (tokpack.packer.X)."""
    found = {}
    for path in project_files("packer", pattern="*.py", recursive=False):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Result") and node.name != "Result":
                found[node.name] = f"tokpack.packer.{path.stem}"
    return found


def test_api_md_lists_every_result_class_with_its_module():
    classes = _result_classes()
    assert {
        "PackResult",
        "ShuffleResult",
        "ValidateResult",
        "StageResult",
        "SliceResult",
        "InspectResult",
        "PlanResult",
    } <= set(classes)
    rows = {
        line.split("|")[2].strip(" `"): line.split("|")[3].strip(" `")
        for line in (ROOT / "docs" / "API.md").read_text().splitlines()
        if line.startswith("| `") and line.count("|") == 4 and "Result" in line
    }
    assert rows == classes


def test_commands_md_glossary_gives_each_colliding_word_one_meaning():
    text = (ROOT / "docs" / "COMMANDS.md").read_text()
    words = text.split("## Words", 1)[1].split("\n## ", 1)[0]
    for word in (
        "pack, packed source",
        "packing (`--packing`)",
        "schedule stage",
        "stage, staging",
        "`--shards-of r/W`",
        "`--ranks A-B`",
    ):
        assert f"| {word} |" in words, word
    assert "[--shards-of r/W|r1,r2/W|a-b/W --micro-batch m]" in text and "[--ranks r/W" not in text
