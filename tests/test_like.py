"""Adding epochs to a run without repeating its command (issue 35, item 2): `tokpack shuffle
--like RUN --epoch E` (API: `shuffle(like=RUN, epochs=[E])`) reads every setting from the run's
own manifests. Every hint that proposes writing an epoch proposes it; each hinted command,
parsed from the message and run as printed, succeeds, and the epoch it writes is byte for byte
the one the run's original command writes when asked for that epoch too."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError, UsageError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import read_manifest, write_manifest
from tokpack.loader.reader import SampleReader
from tokpack.loader.torch_adapter import TokpackDataset
from tokpack.packer import api
from tokpack.packer.cli import main

REPO = Path(__file__).resolve().parents[1]
SCHEDULE = """\
seq_len: 31
seed: 5
shard_samples: 40
packing: best-fit
stages:
  - name: warm
    epochs: 1
    sources: {web: 1}
  - name: mix
    tokens: 4K
    sources: {web: 0.6, code: 0.4}
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("like")
    write_source(root / "web", random_docs(np.random.default_rng(1), 120, 1000, 0), docs_per_shard=30)
    write_source(root / "code", random_docs(np.random.default_rng(2), 60, 1000, 0), docs_per_shard=30)
    (root / "run.yaml").write_text(SCHEDULE)
    return root


# (name, the run's command less -o and the epochs, the epochs written first, the epoch the hints name)
RUNS = {
    "concat": (
        [
            "{web}=0.7",
            "{code}=0.3",
            "--seq-len",
            "31",
            "--seed",
            "1",
            "--samples",
            "300",
            "--shard-samples",
            "64",
            "--jitter",
        ],
        2,
        2,
    ),
    "best-fit": (
        [
            "{web}=2",
            "{code}=1",
            "--seq-len",
            "31",
            "--seed",
            "3",
            "--samples",
            "250",
            "--shard-samples",
            "100",
            "--packing",
            "best-fit",
            "--pad-id",
            "7",
        ],
        2,
        2,
    ),
    "schedule": (["--schedule", "{root}/run.yaml"], 1, 1),
}


def cli(*args, cwd: Path | None = None):
    old = os.getcwd()
    os.chdir(cwd or old)
    try:
        res = CliRunner().invoke(main, [str(a) for a in args])
    finally:
        os.chdir(old)
    return res.exit_code, res.stdout, res.stderr


def command(case: str, corpus: Path) -> list[str]:
    return [a.format(web=corpus / "web", code=corpus / "code", root=corpus) for a in RUNS[case][0]]


def epochs_flag(n: int) -> list[str]:
    return ["--epochs", str(n)]


def hinted(message: str) -> list[str]:
    """The `tokpack shuffle ...` command a message proposes, as its words."""
    cmd = next(part for part in message.split("`")[1::2] if part.startswith("tokpack shuffle "))
    return shlex.split(cmd)


def tree(run: Path, epoch: int) -> dict[str, bytes]:
    d = run / epoch_dir_name(epoch)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module", params=list(RUNS))
def made(request, corpus, tmp_path_factory):
    """(case, a folder holding `run` with its first epochs, the reference run holding one more)."""
    case = request.param
    _, first, nxt = RUNS[case]
    base = tmp_path_factory.mktemp(f"made-{case}")
    code, _, err = cli("shuffle", *command(case, corpus), "-o", "run", *epochs_flag(first), cwd=base)
    assert code == 0, err
    ref = tmp_path_factory.mktemp(f"ref-{case}") / "run"
    code, _, err = cli("shuffle", *command(case, corpus), "-o", ref, *epochs_flag(nxt + 1))
    assert code == 0, err
    return case, base, ref


def hints(case: str, base: Path, corpus: Path) -> dict[str, str]:
    """Every message that proposes writing the run's next epoch, by what asked (paths relative to `base`)."""
    _, first, nxt = RUNS[case]
    run = base / "run"
    m = read_manifest(run)
    n_before = sum(m["epoch_samples"][:nxt]) if m.get("epoch_samples") else nxt * m["samples"]
    out = {}

    def refused(name, *args):
        code, stdout, err = cli(*args, cwd=base)
        assert code == 1 and stdout == "" and len(err.strip().splitlines()) == 1, (name, code, err)
        out[name] = err

    refused("read past the written epochs", "read", "run", "--start-sample", n_before + 3)
    refused("read: less than a global batch", "read", "run", "--start-sample", n_before - 1, "--world-size", 2)
    refused("stage --epochs", "stage", "run", "dest", "--epochs", nxt)
    refused(
        "stage a node slice --epochs",
        "stage",
        "run",
        "slice",
        "--node",
        "0/1",
        "--ranks-per-node",
        1,
        "--micro-batch",
        1,
        "--epochs",
        nxt,
    )
    epochs = [f"run/{epoch_dir_name(e)}" for e in range(first)]
    if case == "best-fit":  # another command into the run: the different-run hint
        refused(
            "shuffle into the run with other flags",
            "shuffle",
            corpus / "web",
            "-o",
            "run",
            "--seq-len",
            31,
            "--seed",
            3,
            "--epoch",
            nxt,
        )
    old = os.getcwd()
    os.chdir(base)
    try:
        for name, ask in (
            ("TokpackDataset(start_sample=)", lambda: TokpackDataset("run", start_sample=n_before + 3)),
            ("SampleReader.start_from", lambda: SampleReader.open("run").start_from(start_sample=n_before + 3)),
            (
                "the run's epochs read past their end",
                lambda: SampleReader.open(epochs).start_from(start_sample=n_before + 3),
            ),
            (
                "TokpackDataset.load_state_dict",
                lambda: TokpackDataset("run").load_state_dict({"epoch": nxt, "sample": 3}),
            ),
        ):
            with pytest.raises(TokpackError) as e:
                ask()
            out[name] = str(e.value)
    finally:
        os.chdir(old)
    return out


def test_each_hinted_command_run_as_printed_writes_the_epoch_of_the_original_command(made, corpus, tmp_path):
    case, base, ref = made
    nxt = RUNS[case][2]
    found = hints(case, base, corpus)
    assert len(found) >= 8
    want = tree(ref, nxt)
    for k, (name, message) in enumerate(found.items()):
        words = hinted(message)
        assert words == ["tokpack", "shuffle", "--like", "run", "--epoch", str(nxt)], (name, message)
        copy = tmp_path / f"h{k}"
        shutil.copytree(base, copy)
        if k == 0:  # one as a real process, the way a user pastes it
            r = subprocess.run(
                [sys.executable, "-m", "tokpack", *words[1:]],
                cwd=copy,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            code, err = r.returncode, r.stderr
        else:
            code, _, err = cli(*words[1:], cwd=copy)
        assert code == 0, (name, err)
        assert tree(copy / "run", nxt) == want, name
        assert (copy / "run" / MANIFEST).read_bytes() == (ref / MANIFEST).read_bytes(), name


def test_the_api_like_writes_the_same_epoch_into_another_output(made, tmp_path):
    case, base, ref = made
    nxt = RUNS[case][2]
    result = api.shuffle(like=base / "run", output=tmp_path / "elsewhere", epochs=[nxt], memory=8 << 20)
    assert result.written == [nxt]
    assert tree(tmp_path / "elsewhere", nxt) == tree(ref, nxt)
    assert not (base / "run" / epoch_dir_name(nxt)).exists()  # the run given is only read


def test_plan_shuffle_like_plans_the_epoch(made):
    case, base, ref = made
    nxt = RUNS[case][2]
    code, out, err = cli("plan", "shuffle", "--like", "run", "--epoch", nxt, "--disk-mbps", 100, "--json", cwd=base)
    assert code == 0, err
    planned = json.loads(out)
    assert planned["ok"]
    assert (
        read_manifest(ref / epoch_dir_name(nxt))["samples"]
        == [d for d in planned["epochs"] if d["epoch"] == nxt][0]["samples"]
    )
    assert not (base / "run" / epoch_dir_name(nxt)).exists()


def test_like_misuse_is_one_line(corpus, tmp_path):
    base = tmp_path
    code, _, err = cli("shuffle", *command("concat", corpus), "-o", "run", "--epochs", 1, cwd=base)
    assert code == 0, err
    code, _, err = cli("shuffle", "--like", "run", "--epoch", 5, "--seed", 2, "--packing", "best-fit", cwd=base)
    assert code == 2 and "--like takes the sources and --seq-len" in err and "drop --seed --packing" in err
    code, _, err = cli("shuffle", corpus / "web", "--like", "run", "--epoch", 5, cwd=base)
    assert code == 2 and "drop SOURCE" in err
    code, _, err = cli("shuffle", "--like", "run", cwd=base)
    assert code == 1 and "no epochs named to add to the run" in err and "--epoch E" in err
    for other, kind in ((f"run/{epoch_dir_name(0)}", "epoch"), (corpus / "web", "source")):
        code, _, err = cli("shuffle", "--like", other, "--epoch", 5, cwd=base)
        assert code == 1 and f"--like takes a run directory; expected {RUN_DIR}, found {kind}" in err
    code, _, err = cli("shuffle", corpus / "web", "--seq-len", 31, "--seed", 1, "--epochs", 1, cwd=base)
    assert code == 2 and "give -o OUT (or --like RUN" in err
    with pytest.raises(UsageError, match=r"^--like takes the sources and --seq-len, .* from the run; drop --seed$"):
        api.shuffle(like=base / "run", epochs=[5], seed=2)
    with pytest.raises(UsageError, match=r"^give -o OUT \(or --like RUN"):
        api.shuffle(corpus / "web", seq_len=31, seed=1)
    assert not (base / "run" / epoch_dir_name(5)).exists()


RUN_DIR = "run (a directory holding tokpack.json and epoch-NNNNN/)"


def test_like_given_what_is_no_run_says_so(tmp_path):
    """`--like /etc/passwd` said "incomplete: no tokpack.json" and to rerun the command that
    writes it: a file, or a folder no shuffle ever wrote into, is no run at all. One line: the
    path, what --like takes, what was found, the hint. A folder a shuffle was interrupted in
    (an epoch folder, no tokpack.json yet) is still an unfinished run."""
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    hint = "HINT: give the run directory (the one holding tokpack.json and epoch-NNNNN/)"
    for path, found in (
        (text, "a file"),
        (tmp_path / "empty", "a folder without tokpack.json or epoch folders"),
        (tmp_path / "notes", "a folder without tokpack.json or epoch folders"),
    ):
        code, out, err = cli("shuffle", "--like", path, "--epoch", 1)
        assert (code, out) == (1, "") and err.strip().splitlines() == [
            f"tokpack: error: {path} [kind]: --like takes a run directory; expected {RUN_DIR}, found {found}. {hint}"
        ]
    (tmp_path / "interrupted" / epoch_dir_name(0)).mkdir(parents=True)
    code, _, err = cli("shuffle", "--like", tmp_path / "interrupted", "--epoch", 1)
    assert code == 1 and "incomplete: no tokpack.json" in err and "rerun the same command" in err
    code, _, err = cli("read", text)  # every command: a file is not a directory, nothing is unfinished
    assert code == 1 and err.strip() == (
        f"tokpack: error: {text}: not a directory; expected a tokpack directory, "
        "found a file. HINT: pass the directory that holds tokpack.json"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "interrupted", "notes", "passwd"]


def test_a_run_that_lists_no_epochs_hints_the_command_that_writes_epoch_0(corpus, tmp_path):
    """A scheduled run's manifest is written before its first epoch (its numbering is fixed at
    creation): one interrupted there lists no epochs, and reading it names the command for epoch 0."""
    code, _, err = cli("shuffle", "--schedule", corpus / "run.yaml", "-o", "run", "--epoch", 0, cwd=tmp_path)
    assert code == 0, err
    shutil.rmtree(tmp_path / "run" / epoch_dir_name(0))
    m = read_manifest(tmp_path / "run")
    write_manifest(tmp_path / "run", {**m, "epochs": [], "tokens": 0, "fragments": 0})
    code, _, err = cli("read", "run", cwd=tmp_path)
    assert code == 1
    words = hinted(err)
    assert words == ["tokpack", "shuffle", "--like", "run", "--epoch", "0"]
    code, _, err = cli(*words[1:], cwd=tmp_path)
    assert code == 0, err
    assert read_manifest(tmp_path / "run")["epochs"] == [0]


def test_like_refuses_a_setting_given_as_zero(corpus, tmp_path):
    """Given is not truthy (issue 40): `--seed 0` or `pad_id=0` beside --like was taken for "not
    given" and silently dropped, the epoch written with the run's seed. Both are refused."""
    code, _, err = cli("shuffle", *command("concat", corpus), "-o", "run", "--epochs", 1, cwd=tmp_path)
    assert code == 0, err
    code, _, err = cli("shuffle", "--like", "run", "--epoch", 1, "--seed", 0, cwd=tmp_path)
    assert code == 2 and "drop --seed" in err
    for given in ({"seed": 0}, {"pad_id": 0}, {"packing": "concat"}):
        key = next(iter(given))
        flag = "--" + key.replace("_", "-")
        with pytest.raises(UsageError, match=rf"from the run; drop {flag}$"):
            api.shuffle(like=tmp_path / "run", epochs=[1], **given)
    assert not (tmp_path / "run" / epoch_dir_name(1)).exists()


def test_like_of_a_run_whose_input_moved_names_the_run_manifest_field(corpus, tmp_path):
    """--like reads paths the user never typed: a source (or a schedule file) moved since the run
    was made said only `/old/path: no such directory` (or ENOENT), naming no run and no field. The
    line names the run manifest and the field, under --json too; put back, the epoch is written."""
    for name in ("web", "code"):
        shutil.copytree(corpus / name, tmp_path / name)
    shutil.copy(corpus / "run.yaml", tmp_path / "run.yaml")
    flags = [a.replace(str(corpus), str(tmp_path)) for a in command("concat", corpus)]
    for run, first in (("flags", flags), ("sched", ["--schedule", tmp_path / "run.yaml"])):
        code, _, err = cli("shuffle", *first, "-o", run, "--epoch", 0, cwd=tmp_path)
        assert code == 0, err
    (tmp_path / "web").rename(tmp_path / "web-moved")
    (tmp_path / "run.yaml").rename(tmp_path / "run-moved.yaml")
    for run, where, gone in (("flags", "sources[0].path", "web"), ("sched", "schedule_file", "run.yaml")):
        code, out, err = cli("shuffle", "--like", run, "--epoch", 1, "--json", cwd=tmp_path)
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        error = json.loads(out)["error"]
        assert (error["file"], error["where"]) == (f"{run}/{MANIFEST}", where), error
        assert error["found"] == f"nothing at {tmp_path / gone}" and "put it back" in error["hint"], error
    (tmp_path / "web-moved").rename(tmp_path / "web")
    (tmp_path / "run-moved.yaml").rename(tmp_path / "run.yaml")
    for run in ("flags", "sched"):
        code, _, err = cli("shuffle", "--like", run, "--epoch", 1, cwd=tmp_path)
        assert code == 0, err
