"""Resuming training: sample numbers that never move, exact resume with DataLoader workers.

Runs are written by the real shuffle engine; loaders are torchdata's real StatefulDataLoader
with worker processes, saved in one Python process and loaded in another.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import read_manifest
from tokpack.loader.reader import SampleReader
from tokpack.loader.torch_adapter import TokpackDataset
from tokpack.packer.cli import main

SEQ = 15
N = 50  # samples per epoch
REPO = Path(__file__).resolve().parents[1]


def make_source(base: Path) -> Path:
    return write_source(base / "src", random_docs(np.random.default_rng(7), 120, 1000, 0))


def make_run(base: Path, epochs: list[int], shard_samples: int = 2) -> Path:
    shuffle_run(
        [str(make_source(base))],
        str(base / "run"),
        seq_len=SEQ,
        seed=4,
        epochs=epochs,
        samples=N,
        shard_samples=shard_samples,
        memory=8 << 20,
    )
    return base / "run"


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


def read_one(run: Path, g: int) -> dict:
    code, out, err = cli("read", run, "--start-sample", g, "--count", 1, "--json")
    assert code == 0, err
    return json.loads(out)


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 1 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def shuffle_command_in(message: str) -> list[str]:
    """The `tokpack shuffle ...` command an error line names, as CLI arguments."""
    cmd = message.split("`")[1]
    assert cmd.startswith("tokpack shuffle ")
    return shlex.split(cmd)[1:]


# ------------------------------------------------------------ sample numbers


def test_sample_numbers_do_not_move_when_a_missing_epoch_is_written(tmp_path):
    run = make_run(tmp_path, [0, 1, 2, 3, 5])
    assert read_manifest(run)["samples"] == N
    g5, g4 = 5 * N + 7, 4 * N + 7
    epoch5 = SampleReader.open(run / epoch_dir_name(5)).read(7)[0].tolist()

    # G in epoch 5 is sample G mod N of epoch G div N, with epoch 4 absent
    got = read_one(run, g5)
    assert (got["epoch"], got["sample"], got["tokens"]) == (5, 7, epoch5)
    ds = TokpackDataset(run, start_sample=g5, positions=None)
    assert next(iter(ds))["input_ids"][0].tolist() == epoch5[:-1]

    # G in epoch 4: one line naming the command that writes epoch 4, from read, SampleReader,
    # TokpackDataset and stage alike
    err = one_line_error(*cli("read", run, "--start-sample", g4))
    command = shuffle_command_in(err)
    assert command[-2:] == ["--epoch", "4"] and "epoch 4" in err
    for ask in (
        lambda: SampleReader.open(run).start_from(start_sample=g4),
        lambda: TokpackDataset(run, start_sample=g4),
        lambda: TokpackDataset(run).load_state_dict({"epoch": 4, "sample": 7}),
    ):
        with pytest.raises(TokpackError) as e:
            ask()
        assert shuffle_command_in(str(e.value)) == command
    err = one_line_error(*cli("stage", run, tmp_path / "dest", "--epochs", "4"))
    assert shuffle_command_in(err) == command
    # a stream that runs into the missing epoch stops there with the same line, not silently
    stream = SampleReader.open(run).batches(0, 1, 2, start=4 * N - 2)
    assert len(next(stream)) == 2
    with pytest.raises(TokpackError) as e:
        next(stream)
    assert shuffle_command_in(str(e.value)) == command

    # the named command writes epoch 4; epoch 5's number still reads the same sample
    code, _, err = cli(*command)
    assert code == 0, err
    got = read_one(run, g5)
    assert (got["epoch"], got["sample"], got["tokens"]) == (5, 7, epoch5)
    got = read_one(run, g4)
    epoch4 = SampleReader.open(run / epoch_dir_name(4)).read(7)[0].tolist()
    assert (got["epoch"], got["sample"], got["tokens"]) == (4, 7, epoch4)


def test_stage_ranks_keeps_the_run_numbering(tmp_path):
    """Rank 0 of 4 (m=1) reads samples G = 0 mod 4; epoch 5 starts at 5N = 250 = 2 mod 4, not at
    the 4N = 0 mod 4 where it would sit if the written epochs were chained."""
    run = make_run(tmp_path, [0, 1, 2, 3, 5])
    code, _, err = cli("stage", run, tmp_path / "dest", "--ranks", "0/4")
    assert code == 0, err
    start = -(-5 * N // 4) * 4  # the first global batch in epoch 5
    want = [r.tolist() for r in SampleReader.open(run).batches(0, 4, 1, start=start, at_end="stop")]
    got = [r.tolist() for r in SampleReader.open(tmp_path / "dest").batches(0, 4, 1, start=start, at_end="stop")]
    assert got == want and len(want) == N // 4


def test_chained_epochs_must_share_eos_id(tmp_path):
    run = make_run(tmp_path, [0, 1], shard_samples=20)
    dirs = [run / epoch_dir_name(e) for e in (0, 1)]
    manifests = [read_manifest(d) for d in dirs]
    manifests[1] = {**manifests[1], "eos_id": 1}
    with pytest.raises(TokpackError, match="eos_id") as e:
        SampleReader.from_manifests(list(zip(dirs, manifests)))
    assert "\n" not in str(e.value) and "expected 0, found 1" in str(e.value)


def test_read_with_less_than_one_global_batch_left_is_one_line(tmp_path):
    run = make_run(tmp_path, [0, 1], shard_samples=20)
    err = one_line_error(*cli("read", run, "--start-sample", 2 * N - 3, "--world-size", 2, "--micro-batch", 2))
    assert "less than one global batch" in err and "expected 4 samples" in err and "3 left" in err
    assert shuffle_command_in(err)[-2:] == ["--epoch", "2"]
    code, out, _ = cli("read", run, "--start-sample", 2 * N - 4, "--world-size", 2, "--micro-batch", 2)
    assert code == 0 and len(out.splitlines()) == 2


# ------------------------------------------------------ exact resume, workers

SCRIPT = r"""
import json, sys, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from tokpack.loader.torch_adapter import TokpackDataset

job = json.loads(sys.argv[1])
out = {}
for case in job["cases"]:
    ds = TokpackDataset(job["run"], rank=case["rank"], world_size=case["world"], micro_batch=case["micro"],
                        positions=None)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=case["workers"])
    if "load" in case:
        loader.load_state_dict(torch.load(case["load"]))
        try:
            out[case["name"]] = next(iter(loader))["input_ids"].tolist()
        except Exception as e:
            out[case["name"]] = {"error": type(e).__name__, "message": str(e)}
    else:
        it = iter(loader)
        for _ in range(case["k"]):
            next(it)
        torch.save(loader.state_dict(), case["save"])
        out[case["name"]] = next(it)["input_ids"].tolist()
        del it
print(json.dumps(out))
"""


def run_python(job: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(job)], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def test_stateful_dataloader_resumes_exactly_in_a_new_process(tmp_path):
    run = make_run(tmp_path, [0, 1], shard_samples=8)
    rows = SampleReader.open(run).read(0, 2 * N)[:, :-1].tolist()
    k = 12  # the next global batch, samples [48, 52), straddles epochs 0 and 1
    st = {name: str(tmp_path / f"{name}.pt") for name in ("w0", "w2r0", "w2r1")}
    saved = run_python(
        {
            "run": str(run),
            "cases": [
                {"name": "w0", "rank": 0, "world": 1, "micro": 4, "workers": 0, "k": k, "save": st["w0"]},
                {"name": "w2r0", "rank": 0, "world": 2, "micro": 2, "workers": 2, "k": k, "save": st["w2r0"]},
                {"name": "w2r1", "rank": 1, "world": 2, "micro": 2, "workers": 2, "k": k, "save": st["w2r1"]},
            ],
        }
    )
    assert saved == {
        "w0": rows[48:52],
        "w2r0": rows[48:50],
        "w2r1": rows[50:52],
    }  # what an uninterrupted job trains next

    cases = [
        {"name": "w0", "rank": 0, "world": 1, "micro": 4, "workers": 0, "load": st["w0"]},
        *({"name": f"w0-W2r{r}", "rank": r, "world": 2, "micro": 3, "workers": 0, "load": st["w0"]} for r in (0, 1)),
        *({"name": f"w2r{r}", "rank": r, "world": 2, "micro": 2, "workers": 2, "load": st[f"w2r{r}"]} for r in (0, 1)),
        # another world size with the same global batch: W=4, m=1 from the W=2, m=2 states
        *(
            {"name": f"w2-W4r{r}", "rank": r, "world": 4, "micro": 1, "workers": 2, "load": st[f"w2r{r % 2}"]}
            for r in range(4)
        ),
        # another global batch with workers: refused, pointing to consumed_samples
        {"name": "w2-B2", "rank": 0, "world": 1, "micro": 2, "workers": 2, "load": st["w2r0"]},
    ]
    got = run_python({"run": str(run), "cases": cases})
    assert got["w0"] == rows[48:52]
    assert got["w0-W2r0"] + got["w0-W2r1"] == rows[48:54]
    assert got["w2r0"] + got["w2r1"] == rows[48:52]
    assert [got[f"w2-W4r{r}"] for r in range(4)] == [[row] for row in rows[48:52]]
    # raised in a worker, the error reaches the loop as one line (WorkerError, a TokpackError)
    assert got["w2-B2"]["error"] == "WorkerError" and "\n" not in got["w2-B2"]["message"]
    assert "consumed_samples(loader_state)" in got["w2-B2"]["message"]

    # the way to restart with another global batch: the loader state's consumed-sample count
    for name in st:
        assert TokpackDataset.consumed_samples(torch.load(st[name])) == 48
    fresh = TokpackDataset(
        run,
        world_size=1,
        micro_batch=2,
        positions=None,
        start_sample=TokpackDataset.consumed_samples(torch.load(st["w2r0"])),
    )
    assert next(iter(fresh))["input_ids"].tolist() == rows[48:50]


def test_state_dict_in_main_process_while_workers_iterate_is_an_error(tmp_path):
    run = make_run(tmp_path, [0, 1], shard_samples=8)
    ds = TokpackDataset(run, micro_batch=4, positions=None)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))
    batches = [next(it) for _ in range(12)]  # 48 samples consumed
    with pytest.raises(TokpackError, match="loader.state_dict") as err:
        ds.state_dict()
    assert str(err.value) == (
        "[num_workers > 0]: TokpackDataset.state_dict() in the main process cannot see what "
        "DataLoader workers have served. HINT: save loader.state_dict() of a torchdata "
        "StatefulDataLoader, or call ds.state_dict(batch) with the last batch the loader returned"
    )
    assert ds.state_dict(batches[-1]) == {
        "epoch": 0,
        "sample": 48,
        "consumed_samples": 48,
        "seq_len": SEQ,
        "run": ds.reader.run_digest,
    }
    del it


@pytest.mark.parametrize("workers, every", [(2, 1), (2, 3), (2, 5), (0, 3)])
def test_consumed_samples_of_a_stateful_loader_on_every_rank_at_any_snapshot_interval(tmp_path, workers, every):
    """consumed_samples (each batch's, and the one read back from a StatefulDataLoader state) is
    the global count after that step on every rank, not only the last, whatever the loader's
    snapshot interval (a state between snapshots counts the steps since the last one)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    run = make_run(tmp_path, [0, 1], shard_samples=8)
    world, micro, k = 2, 2, 7  # 7 is no multiple of 3 or 5: the state falls between snapshots
    for rank in range(world):
        ds = TokpackDataset(run, rank=rank, world_size=world, micro_batch=micro, positions=None)
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers, snapshot_every_n_steps=every)
        it = iter(loader)
        seen = [int(next(it)["consumed_samples"]) for _ in range(k)]
        assert seen == [(b + 1) * world * micro for b in range(k)], (rank, seen)
        assert TokpackDataset.consumed_samples(loader.state_dict()) == k * world * micro, rank
        del it


# ------------------------------------------------------- a state of another run


def other_run(base: Path, source: Path, **settings) -> Path:
    """A run of `source` like make_run's but for `settings` (another seed, another seq_len)."""
    kw = dict(seq_len=SEQ, seed=4, epochs=[0, 1], samples=N, shard_samples=2, memory=8 << 20) | settings
    shuffle_run([str(source)], str(base), **kw)
    return base


def test_a_state_of_another_run_or_seq_len_or_edited_is_refused_at_its_load(tmp_path):
    """A loader state's counts name samples of the run it was saved over, at its seq_len. Loaded
    over a run reshuffled with another seed, or over another seq_len, it read other samples at
    the same count without a word; a position whose consumed_samples was edited (-1, "6", 999)
    loaded as if it were whole, the count never looked at. Each is now one line at the load; the
    same state still loads over the run, its staged copy and a node slice of it."""
    from tokpack import stage

    run = make_run(tmp_path, [0, 1])
    reseeded = other_run(tmp_path / "seed5", tmp_path / "src", seed=5)
    longer = other_run(tmp_path / "seq16", tmp_path / "src", seq_len=SEQ + 1)
    position = TokpackDataset(run, micro_batch=2).state_dict({"consumed_samples": 56})
    assert position["seq_len"] == SEQ and position["consumed_samples"] == 56
    share = {"start": 0, "next_step": 28, "worker": 0, "num_workers": 1, "global_batch": 2}
    share |= {k: position[k] for k in ("seq_len", "run")}
    for state in (position, share):
        with pytest.raises(TokpackError, match=r"\[loader state run\]: loader state was saved over another run"):
            TokpackDataset(reseeded, micro_batch=2).load_state_dict(state)
        with pytest.raises(TokpackError) as err:
            TokpackDataset(longer, micro_batch=2).load_state_dict(state)
        assert str(err.value).startswith(
            f"[loader state seq_len]: loader state was saved reading another seq_len: its counts are of other "
            f"samples; expected {SEQ + 1}, found {SEQ}. HINT: restart from the tokens consumed"
        )
    for edited in (-1, "6", 999, 2.0):
        with pytest.raises(TokpackError, match=r"\[loader state consumed_samples\]"):
            TokpackDataset(run, micro_batch=2).load_state_dict({**position, "consumed_samples": edited})
    # the run's own state goes on where it was saved: over the run, its staged copy, its node slice
    stage(str(run), str(tmp_path / "copy"))
    stage(str(run), str(tmp_path / "slice"), ranks="0", world_size=1, micro_batch=2)
    want = next(iter(TokpackDataset(run, micro_batch=2, start_sample=56)))["input_ids"]
    for where in (run, tmp_path / "copy", tmp_path / "slice"):
        for state in (position, share):
            ds = TokpackDataset(where, micro_batch=2)
            ds.load_state_dict(state)
            assert torch.equal(next(iter(ds))["input_ids"], want), (where, state)


def test_a_run_holding_an_epoch_of_another_run_is_refused_at_open(tmp_path):
    """An epoch directory replaced by one of another run (reshuffled with another seed, of the
    same size) was read as the run's: other samples at every count. `validate` calls it
    CORRUPT; the reader now refuses it at open, on the same field."""
    import shutil

    run = make_run(tmp_path, [0, 1])
    reseeded = other_run(tmp_path / "seed5", tmp_path / "src", seed=5)
    shutil.rmtree(run / epoch_dir_name(1))
    shutil.copytree(reseeded / epoch_dir_name(1), run / epoch_dir_name(1))
    with pytest.raises(TokpackError) as err:
        SampleReader.open(run)
    assert str(err.value).startswith(
        f"{run / epoch_dir_name(1) / 'tokpack.json'} [seed]: epoch manifest belongs to another run; "
        "expected 4 (the run's), found 5."
    )
    code, out, err_text = cli("read", run, "--count", 1)
    assert "epoch manifest belongs to another run" in one_line_error(code, out, err_text)
