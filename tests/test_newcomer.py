"""What a newcomer tripped on in the commands' own words (issue 35's cosmetic list): each line
says what it means once, in the right stream, with the right plural, naming the right thing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import project_files, random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.packer.cli import main
from tokpack.packer.slicing import stage_slice

REPO = Path(__file__).resolve().parents[1]
VOCAB, EOS = 1000, 0
SHUFFLE = ["--seq-len", "31", "--seed", "1", "--epochs", "2"]


def tokpack(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("newcomer")
    return write_source(base / "source", random_docs(np.random.default_rng(4), 200, VOCAB, EOS), docs_per_shard=50)


def test_epoch_lines_say_what_starts_on_stderr_and_what_was_written_on_stdout(src, tmp_path):
    r = tokpack("shuffle", src, "-o", tmp_path / "run", *SHUFFLE)
    assert r.returncode == 0, r.stderr
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    assert not set(out) & set(err)
    for e in (0, 1):
        assert [x for x in err if x.startswith(f"epoch {e}:")][0].startswith(f"epoch {e}: writing ")
        written = [x for x in out if x.startswith(f"epoch {e}")]
        assert len(written) == 2 and " 1 shard, " in written[0]  # one shard an epoch: not "1 shards"
        assert written[1].startswith(f'epoch {e}, source "source": ')  # was "epoch 0 source source:"


def test_output_is_absolute_for_pack_and_shuffle(src, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    packed = tokpack(
        "pack", "corpus.jsonl", "-o", "packed", "--eos-id", EOS, "--vocab-size", VOCAB, "--json", cwd=tmp_path
    )
    shuffled = tokpack(
        "shuffle", "packed", "-o", "run", "--seq-len", 1, "--seed", 1, "--epochs", 1, "--json", cwd=tmp_path
    )
    assert json.loads(packed.stdout)["output"] == str(tmp_path / "packed")
    assert json.loads(shuffled.stdout)["output"] == str(tmp_path / "run")
    # one document: "1 document", not "1 documents"
    again = tokpack("pack", "corpus.jsonl", "-o", "other", "--eos-id", EOS, "--vocab-size", VOCAB, cwd=tmp_path)
    assert "tokpack pack: 4 tokens, 1 document, 1 shard -> " in again.stderr, again.stderr


def test_the_summary_shows_the_shard_size_an_epoch_really_has(src, tmp_path):
    """The default shard_samples (about 1 GiB of samples) is larger than a small epoch: the
    summary says what a shard holds, and --json keeps the run's setting (an added epoch repeats it)."""
    r = CliRunner().invoke(main, ["shuffle", str(src), "-o", str(tmp_path / "run"), *SHUFFLE])
    assert r.exit_code == 0, r.output
    n = json.loads((tmp_path / "run" / "tokpack.json").read_text())["samples"]
    setting = json.loads((tmp_path / "run" / "tokpack.json").read_text())["shard_samples"]
    assert setting > n
    (line,) = [x for x in r.stdout.splitlines() if x.strip().startswith("shard_samples:")]
    assert line.split(":", 1)[1].strip() == (
        f"{n} (one shard an epoch: the run's shard_samples, {setting}, is larger than an epoch)"
    )
    again = CliRunner().invoke(main, ["shuffle", str(src), "-o", str(tmp_path / "run"), *SHUFFLE, "--json"])
    assert json.loads(again.stdout)["shard_samples"] == setting


@pytest.mark.parametrize("script", ["quickstart.sh", "schedule.sh"])
def test_the_examples_clean_up_their_temporary_folder_or_keep_the_one_given(tmp_path, script):
    temp, kept = tmp_path / "tmp", tmp_path / "kept"
    temp.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(temp),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    if shutil.which("tokpack", path=env["PATH"]) is None:  # the README's first command installs it
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "tokpack").write_text(f'#!/bin/sh\nexec {sys.executable} -m tokpack.packer.cli "$@"\n')
        (tmp_path / "bin" / "tokpack").chmod(0o755)
    r = subprocess.run(["bash", str(REPO / "examples" / script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert list(temp.iterdir()) == [] and "removed now" in r.stdout.splitlines()[-1]
    if script == "schedule.sh":
        return  # OUT given: the same as quickstart.sh's
    (line,) = [x for x in r.stdout.splitlines() if x.strip().startswith("shard_samples:")]
    assert line.split(":", 1)[1].strip() == "1000"  # a shard smaller than the epoch (3795 samples)
    r = subprocess.run(
        ["bash", str(REPO / "examples" / script), str(kept)], capture_output=True, text=True, env=env, timeout=600
    )
    assert (
        r.returncode == 0
        and (kept / "run" / "tokpack.json").is_file()
        and r.stdout.splitlines()[-1] == f"== done: {kept}"
    )


def test_validate_names_a_missing_path_missing_and_counts_the_padding_files(src, tmp_path):
    r = tokpack("validate", "runs/mxi", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stdout == "" and r.stderr.splitlines() == [
        "MISSING runs/mxi: no such directory. HINT: check the path or URL",
        "MISSING directory runs/mxi: 1 problem",
        r.stderr.splitlines()[-1],
    ]
    assert r.stderr.splitlines()[-1].startswith("MISSING: 1 directory, 0 files, ")
    r = tokpack("validate", "runs/mxi", "--json", cwd=tmp_path)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["status"] == "missing" and report["problems"][0]["severity"] == "missing"
    # a best-fit epoch's .ds.pad files are counted with the shard's others
    shuffle_run(
        [str(src)],
        str(tmp_path / "bf"),
        seq_len=31,
        seed=1,
        epochs=[0],
        shard_samples=60,
        memory=8 << 20,
        packing="best-fit",
        log=None,
    )
    epoch = tmp_path / "bf" / "epoch-00000"
    assert any(p.name.endswith(".ds.pad") for p in epoch.iterdir())
    report = json.loads(tokpack("validate", tmp_path / "bf", "--json").stdout)
    assert {d["path"]: d["files"] for d in report["dirs"]}[str(epoch)] == len(list(epoch.iterdir()))


def test_validate_says_what_against_named(src, tmp_path):
    run = tmp_path / "run"
    shuffle_run([str(src)], str(run), seq_len=31, seed=1, epochs=[0], shard_samples=60, memory=8 << 20, log=None)
    last = tokpack("validate", run, "--against", src).stdout.splitlines()[-1]
    assert last.endswith(", against 1 source")
    stage_slice(str(run), tmp_path / "slice", ranks="0-1", world_size=4, micro_batch=2)
    r = tokpack("validate", tmp_path / "slice", "--against", run)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].endswith(", against 1 run"), r.stdout


def test_inspect_refuses_a_seq_len_a_run_does_not_have(src, tmp_path):
    run = tmp_path / "run"
    shuffle_run([str(src)], str(run), seq_len=31, seed=1, epochs=[0], shard_samples=60, memory=8 << 20, log=None)
    r = CliRunner().invoke(main, ["inspect", str(run), "--seq-len", "2048"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        f"tokpack: error: {run} [--seq-len]: --seq-len is for a packed source: a run's samples have its seq_len; "
        "expected none, or 31, found 2048. HINT: drop --seq-len: the batch analysis of a run uses its own"
    ]
    assert CliRunner().invoke(main, ["inspect", str(run), "--seq-len", "31"]).exit_code == 0
    assert CliRunner().invoke(main, ["inspect", str(src), "--seq-len", "2048"]).exit_code == 0  # a source: its use


def test_restaging_a_slice_of_another_run_names_the_field_that_differs(src, tmp_path):
    """Both runs have seed 1: the packing is what differs, and the line says so."""
    concat, best_fit = tmp_path / "concat", tmp_path / "best-fit"
    for out, packing in ((concat, "concat"), (best_fit, "best-fit")):
        shuffle_run(
            [str(src)],
            str(out),
            seq_len=31,
            seed=1,
            epochs=[0],
            shard_samples=60,
            memory=8 << 20,
            packing=packing,
            log=None,
        )
    stage_slice(str(concat), tmp_path / "slice", ranks="0", world_size=2, micro_batch=2)
    with pytest.raises(TokpackError) as e:
        stage_slice(str(best_fit), tmp_path / "slice", ranks="0", world_size=2, micro_batch=2)
    assert e.value.message == "DEST holds a slice of another run" and e.value.where == "run.packing"
    assert e.value.found == "concat (no packing recorded)" and "seed" not in str(e.value)
    # the packing in words (its method, then its settings), not a Python dict
    assert e.value.expected.startswith("best-fit (") and "{" not in e.value.expected and "'" not in e.value.expected


def test_plan_says_when_its_disk_probe_wrote(src, tmp_path):
    args = ["plan", "shuffle", str(src), "-o", str(tmp_path / "run"), *SHUFFLE]
    measured = CliRunner().invoke(main, args).stdout.splitlines()[0]
    given = CliRunner().invoke(main, [*args, "--disk-mbps", "100"]).stdout.splitlines()[0]
    assert given.endswith("; nothing written")
    assert measured.endswith(
        "; no output written (the disk probe wrote and read back a temporary file; --disk-mbps skips it)"
    )
    assert not (tmp_path / "run").exists()


def test_a_count_in_a_line_takes_its_plural_never_s_in_parentheses(src, tmp_path):
    """ "1 shards" and "1 source(s)" were on the issue's list (and "1 pass(es)" after it); the out-of-core epoch line still
    said "1 shards", plan "1 shard(s)", pack "2 file(s)", read "expected 1 samples": each now
    says the count with its plural (formats/units.py counted), and no f-string of tokpack's
    modules puts "(s)" after a number."""
    import ast

    bad = []
    for path in project_files(pattern="*.py"):
        where = path.relative_to(REPO).parts
        if len(where) == 1 or where[0] in {"tests", "bench", "scripts", "examples"}:  # tokpack's modules only
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts = node.values
                for a, b in zip(parts, parts[1:]):
                    if (
                        isinstance(a, ast.FormattedValue)
                        and isinstance(b, ast.Constant)
                        and isinstance(b.value, str)
                        and b.value.split(",")[0].split(")")[0].endswith(("(s", "(es"))
                    ):
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert bad == []
    r = tokpack("shuffle", src, "-o", tmp_path / "run", *SHUFFLE, "--memory", "64KiB")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("epoch 0: writing ")]
    assert "out of core" in line and line.endswith(" 1 shard)"), line
    plan = tokpack("plan", "shuffle", src, "-o", tmp_path / "p", *SHUFFLE[:-1], 1, "--disk-mbps", "100")
    assert ", 1 shard; " in plan.stdout.splitlines()[0] and "(s)" not in plan.stdout, plan.stdout
    r = tokpack(
        "read",
        tmp_path / "run",
        "--micro-batch",
        1,
        "--start-sample",
        json.loads((tmp_path / "run" / "tokpack.json").read_text())["samples"] * 2,
    )
    assert r.returncode == 1 and "expected 1 sample (W*m), found 0 left" in r.stderr, r.stderr
