"""`tokpack inspect`, `read` and `validate` on every kind of directory a user points them at:
a run whose folders lead elsewhere, a run whose tokens are elsewhere, another tool's data, an
empty folder. The report is true, or one line says what is there and what to give instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests.conftest import random_docs, shuffle_run, write_source
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.cli import main

SEQ_LEN = 31


def cli(*args) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """src/; run/ (windows, seed 1, epochs 0-1); bf/ and other/ (best-fit with --holdout, seeds 1 and 9)."""
    root = tmp_path_factory.mktemp("targets")
    docs = random_docs(np.random.default_rng(8), 120, 1000, 0, max_len=100)
    write_source(root / "src", docs, docs_per_shard=40)
    src = [str(root / "src")]
    shuffle_run(src, str(root / "run"), seq_len=SEQ_LEN, seed=1, epochs=[0, 1], shard_samples=50)
    for name, seed in (("bf", 1), ("other", 9)):
        shuffle_run(src, str(root / name), seq_len=SEQ_LEN, seed=seed, epochs=[0], packing="best-fit", holdout="5%")
    return root


@pytest.fixture
def env(base, tmp_path) -> Path:
    for name in ("src", "run", "bf", "other"):
        shutil.copytree(base / name, tmp_path / name, symlinks=True)
    return tmp_path


def _link_out(run: Path, name: str, target: Path) -> None:
    shutil.rmtree(run / name)
    (run / name).symlink_to(target, target_is_directory=True)


def test_inspect_refuses_an_epoch_folder_that_leads_out_of_the_run(env, base):
    """inspect read a run's epoch-00000/ through a symbolic link to another run's epoch (here
    another copy's epoch 1) and reported it, or its mismatch, as the run's; validate, read and
    stage refuse it. Now inspect gives their line: the field, the folder, where it leads."""
    _link_out(env / "run", epoch_dir_name(0), base / "run" / epoch_dir_name(1))
    for command in ("inspect", "validate", "read"):
        code, _, err = cli(command, env / "run")
        assert code == 1 and "manifest names a file outside its folder" in err, (command, err)
        assert f"{env / 'run' / 'tokpack.json'} [epochs (0)]" in err and "Traceback" not in err, (command, err)


def test_a_held_out_split_that_leads_out_of_the_run_is_not_the_runs(env):
    """RUN/holdout/ linked to another run's held-out split (another seed, another fraction):
    validate said OK and inspect reported that split as the run's. Both now refuse it, as
    stage does, naming the folder; nothing outside is read."""
    _link_out(env / "bf", "holdout", env / "other" / "holdout")
    code, out, err = cli("validate", env / "bf")
    assert code == 1 and "CORRUPT" in out + err and "manifest names a file outside its folder" in out + err
    assert f"OK epoch {env / 'bf' / 'holdout'}" not in out + err
    code, out, err = cli("inspect", env / "bf")
    assert code == 1 and out == "" and "[epochs (holdout)]: manifest names a file outside its folder" in err, err
    assert cli("validate", env / "other")[0] == 0  # the split linked to is fine where it is


def _megatron(folder: Path) -> Path:
    folder.mkdir()
    np.arange(100, dtype=np.uint16).tofile(folder / "data_text_document.bin")
    (folder / "data_text_document.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40))
    return folder


@pytest.mark.parametrize("what", ["megatron", "empty"])
def test_another_tools_data_is_not_called_an_interrupted_run(tmp_path, what):
    """inspect, validate and read of a Megatron .bin/.idx folder (or an empty one) said
    "incomplete: no tokpack.json. HINT: the run that writes it was interrupted or is still
    running; rerun the same command": no tokpack command ever wrote there. Now one line says
    it is not a tokpack directory, what is there, and how to make one of it."""
    folder = _megatron(tmp_path / "mega") if what == "megatron" else tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    found = "an empty folder" if what == "empty" else "2 other files (data_text_document.bin, data_text_document.idx)"
    for command in ("inspect", "read", "validate"):
        code, out, err = cli(command, folder)
        text = (out + err).strip()
        assert code == 1 and "rerun the same command" not in text, (command, text)
        assert f"{folder}: not a tokpack directory: no tokpack.json; expected a directory tokpack wrote" in text
        assert f"found {found}. HINT: " in text and f"`tokpack pack {folder} -o PACKED`" in text, text


def test_an_interrupted_run_is_still_one(env):
    """What a tokpack command left before its tokpack.json (an epoch folder being written, a
    lock, shard files) keeps the line that says to rerun it."""
    epoch = env / "run" / epoch_dir_name(5)
    epoch.mkdir()
    (env / "out").mkdir()
    (env / "out" / "tokpack.lock").write_text("{}")
    for folder in (epoch, env / "out"):
        code, _, err = cli("inspect", folder)
        assert code == 1 and "incomplete: no tokpack.json" in err and "rerun the same command" in err, err


def _as_to_nodes(run: Path) -> None:
    """The run as `shuffle --to-nodes` leaves it (docs/FORMAT.md, tokpack-nodes.json): its
    manifests and row hashes, the sidecar, no token file; the tokens are on the nodes."""
    sidecar = {"format": "tokpack-nodes", "note": "", "nodes": 2, "ranks_per_node": 1, "micro_batch": 1}
    (run / "tokpack-nodes.json").write_text(json.dumps({**sidecar, "dest": "/nvme/slice-{node}"}))
    for f in run.glob("epoch-*/*.ds"):
        f.unlink()


def test_an_epoch_of_a_to_nodes_run_says_where_its_tokens_are(env):
    """read of one epoch of a `shuffle --to-nodes` run said "shard listed in the manifest is
    missing. HINT: restore the file", and so did inspect of the run or the epoch: nothing is
    missing, the tokens are in the node slices. read now gives the line it gives for the run;
    inspect reports what the manifests and sources tell, with a note instead of the batches
    after the shuffle; --documents-per-row, which reads the tokens, is one line."""
    _as_to_nodes(env / "run")
    epoch = env / "run" / epoch_dir_name(1)
    for folder in (env / "run", epoch):
        code, _, err = cli("read", folder)
        assert code == 1 and "this run's tokens are in node slices (shuffle --to-nodes)" in err, err
        assert "/nvme/slice-{node}" in err and "missing" not in err, err
        code, out, err = cli("inspect", folder, "--json")
        diversity = json.loads(out)["batch_diversity"]
        assert code == 0 and "after" not in diversity and "before" in diversity, (out, err)
        assert diversity["note"].startswith("the epoch's tokens are in node slices"), diversity
    code, out, err = cli("inspect", epoch, "--documents-per-row")
    assert code == 1 and out == "" and "[--documents-per-row]" in err and "node slices" in err, err


def test_a_to_nodes_run_is_not_told_to_use_documents_per_row_which_cannot_read_it(env):
    """inspect of a `shuffle --to-nodes` run ended "documents per row: --documents-per-row finds
    the max_documents to train with", an option that exits 1 there (the tokens are in the node
    slices), whose line then said "inspect ... the run it was shuffled from": there is no such
    run. Windows: no suggestion, and the option's HINT says what does hold the epoch. Best-fit:
    the figure its manifests record, which is the one the option would find."""
    _as_to_nodes(env / "run")
    code, out, err = cli("inspect", env / "run")
    assert code == 0 and "node slices" in out and "documents per row" not in out, (out, err)
    code, out, err = cli("inspect", env / "run", "--documents-per-row")
    assert code == 1 and "shuffled from" not in err and "a `shuffle -o` of the same sources" in err, err

    _as_to_nodes(env / "bf")
    recorded = json.loads((env / "bf" / epoch_dir_name(0) / "tokpack.json").read_text())["packing"]
    most = recorded["max_documents_per_row"]
    code, out, err = cli("inspect", env / "bf")
    assert code == 0 and "--documents-per-row" not in out, (out, err)
    assert f"documents per row: at most {most}, as the epochs' manifests record" in out, out
    assert f"TokpackDataset(..., max_documents={most})" in out, out
    code, out, err = cli("inspect", env / "bf", "--documents-per-row")
    assert code == 1 and f"the epoch's manifest records the figure, max_documents_per_row {most}" in err, err


def test_a_partial_stage_is_inspected_without_the_shards_it_left_out(env, tmp_path):
    """inspect of a `stage --shards-of` copy that left shards out said "shard listed in the
    manifest is missing. HINT: restore the file" (validate and read know the copy is partial
    by design): the report now says so in its note, and analyses no batch it cannot read."""
    copy = tmp_path / "part"
    code, _, err = cli("stage", env / "run", copy, "--shards-of", "0/2", "--micro-batch", "50")
    assert code == 0 and (copy / "tokpack-stage.json").is_file(), err
    code, out, err = cli("inspect", copy, "--json")
    diversity = json.loads(out)["batch_diversity"]
    assert code == 0 and "after" not in diversity, (out, err)
    assert "shards were left out by a partial stage (tokpack-stage.json)" in diversity["note"], diversity
    code, out, err = cli("inspect", copy, "--documents-per-row")  # the run staged from holds it all
    assert code == 1 and "HINT: inspect the run it was staged from, which holds the whole epoch" in err, err


def test_a_node_slice_given_where_a_run_is_taken_says_what_to_give(env, tmp_path):
    """inspect (and stage, plan) of a node slice said "wrong kind of tokpack directory; expected
    source or run or epoch, found slice" and no HINT: the line now says what a slice is read
    with and names the run it was staged from."""
    dest = tmp_path / "slice"
    assert cli("stage", env / "run", dest, "--node", "0/2", "--ranks-per-node", "1", "--micro-batch", "1")[0] == 0
    for args in (("inspect", dest), ("stage", dest, tmp_path / "copy")):
        code, _, err = cli(*args)
        assert code == 1 and "found slice. HINT: a node slice holds some ranks' rows only" in err, err
        assert f"the run it was staged from ({env / 'run'})" in err, err


@pytest.mark.parametrize(
    "key,value,found",
    [
        ("version", "1", "found '1'. HINT: "),
        ("format", "x", "found 'x'. HINT: "),
    ],
)
def test_a_manifest_header_line_shows_what_was_found_and_a_hint(env, key, value, found):
    """`version: "1"` said "unsupported format version; expected 1, found 1" (the string and
    the number print alike), and a `format` not tokpack's had no HINT. The found value is now
    shown as JSON has it, each with a hint."""
    path = env / "src" / "tokpack.json"
    m = json.loads(path.read_bytes())
    m[key] = value
    path.write_text(json.dumps(m, indent=1) + "\n")
    code, _, err = cli("inspect", env / "src")
    assert code == 1 and f"{path} [{key}]: " in err and found in err, err


def test_read_from_a_start_past_every_epoch_a_run_can_hold(env):
    """read --consumed-tokens 1T of a small run (a start in epoch 2,058,629 here) said to write
    that epoch with `tokpack shuffle --like RUN --epoch ...`, which refuses any epoch past
    99,999: the line now says no run holds it and to check the start. A start in an epoch a run
    can hold keeps the command that writes it."""
    code, _, err = cli("read", env / "run", "--consumed-tokens", "1T")
    assert code == 1 and "past the last epoch a run holds (99,999)" in err and "--like" not in err, err
    assert "HINT: check the start (--start-sample, or --consumed-tokens" in err, err
    code, _, err = cli("read", env / "run", "--start-sample", "100000")
    assert code == 1 and "which is not written yet" in err and "shuffle --like" in err, err


@pytest.mark.parametrize("flag", [("--epoch", "0"), ("--documents-per-row",)])
def test_inspect_of_a_source_refuses_what_only_a_run_has(env, flag):
    """inspect SOURCE --epoch 0 or --documents-per-row printed the source's report and ignored
    the option (a source has no epochs, nor rows), as --seq-len of a run once was: one line."""
    code, out, err = cli("inspect", env / "src", *flag)
    assert code == 1 and out == "" and f"[{flag[0]}]: {flag[0]} is for a run or an epoch" in err, err
    assert "HINT: drop " in err


def test_inspect_of_an_epoch_not_there_says_what_to_give(env):
    """--epoch of an epoch the run does not hold had no HINT (and an epoch directory was called
    a run): the line names the epochs there and the command that writes the one asked for."""
    code, _, err = cli("inspect", env / "run", "--epoch", "5")
    assert code == 1 and "epoch not in this run; expected [0, 1], found 5. HINT: give one of [0, 1]" in err, err
    assert "shuffle --like" in err and "--epoch 5`" in err, err
    code, _, err = cli("inspect", env / "run" / epoch_dir_name(1), "--epoch", "0")
    assert code == 1 and "this epoch directory holds another epoch; expected [1], found 0. HINT: " in err, err


def test_read_with_a_file_that_is_no_tokenizer_says_what_to_give(env):
    """read --tokenizer of a JSON file that is no tokenizer said "unreadable tokenizer" with no
    option named and no HINT: the line now names --tokenizer and what to give."""
    code, _, err = cli("read", env / "run", "--count", "1", "--tokenizer", env / "src" / "tokpack.json")
    assert code == 1 and "[--tokenizer]: unreadable tokenizer; expected a tokenizers JSON file" in err, err
    assert "HINT: give the tokenizer.json the corpus was tokenized with" in err, err
