"""Issue 42, item 4: the loader at the end of the written epochs raises one line naming the epoch
to write (the line `tokpack read` prints at that sample), unless asked to stop there; never zero
batches silently. Issue 43, item 6: a StatefulDataLoader state loaded into a loader with another
number of workers is one TokpackError line with the way to resume."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.loader.reader import SampleReader
from tokpack.loader.torch_adapter import TokpackDataset

SEQ, N, M = 15, 48, 2  # two epochs of N samples: the written chain ends at sample 2N
END = 2 * N


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("end")
    src = write_source(base / "src", random_docs(np.random.default_rng(5), 120, 1000, 0))
    shuffle_run(
        [str(src)], str(base / "run"), seq_len=SEQ, seed=2, epochs=[0, 1], samples=N, shard_samples=8, memory=8 << 20
    )
    return base / "run"


def read_line(run: Path, start: int) -> str:
    """What `tokpack read` prints at sample `start` for rank 0 of 1, micro-batch M (exit 1)."""
    out = subprocess.run(
        [sys.executable, "-m", "tokpack", "read", str(run), "--micro-batch", str(M), "--start-sample", str(start)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out
    return out.stderr


def one_line(err: BaseException, run: Path) -> str:
    line = str(err)
    assert isinstance(err, TokpackError) and "\n" not in line, line
    assert f"[sample {END}]" in line and f"tokpack shuffle --like {run} --epoch 2" in line, line
    return line


def test_reader_started_at_the_end_raises_the_line_read_prints(run):
    reader = SampleReader.open(run)
    with pytest.raises(TokpackError) as e:
        next(reader.batches(0, 1, M, END))
    assert one_line(e.value, run) in read_line(run, END)
    assert list(reader.batches(0, 1, M, END, at_end="stop")) == []


def test_reader_reaching_the_end_raises_after_its_last_batch(run):
    reader = SampleReader.open(run)
    stream = reader.batches(0, 1, M, END - 3 * M)
    got = [next(stream) for _ in range(3)]
    assert [r.tolist() for r in got] == [reader.read(END - 3 * M + M * i, M).tolist() for i in range(3)]
    with pytest.raises(TokpackError) as e:
        next(stream)
    one_line(e.value, run)
    assert len(list(reader.batches(0, 1, M, END - 3 * M, at_end="stop"))) == 3
    # a count of steps the written samples hold ends the stream without an error
    assert len(list(reader.batches(0, 1, M, END - 3 * M, steps=3))) == 3


def test_dataset_started_at_the_end_raises(run):
    with pytest.raises(TokpackError) as e:
        list(TokpackDataset(run, micro_batch=M, start_sample=END))
    assert one_line(e.value, run) in read_line(run, END)
    assert list(TokpackDataset(run, micro_batch=M, start_sample=END, at_end="stop")) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_reaching_the_end_raises_after_every_batch(run, workers):
    start = END - 5 * M
    loader = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, start_sample=start), batch_size=None, num_workers=workers
    )
    got = []
    with pytest.raises(TokpackError) as e:
        for batch in loader:
            got.append(int(batch["consumed_samples"]))
    assert got == [start + M * (i + 1) for i in range(5)]  # every written batch, in order, then the error
    one_line(e.value, run)
    stop = TokpackDataset(run, micro_batch=M, start_sample=start, at_end="stop")
    assert len(list(StatefulDataLoader(stop, batch_size=None, num_workers=workers))) == 5


def test_at_end_is_checked(run):
    with pytest.raises(TokpackError) as e:
        TokpackDataset(run, at_end="wrap")
    assert "[at_end]" in str(e.value)
    with pytest.raises(TokpackError) as e:
        SampleReader.open(run).batches(0, 1, 1, at_end=None)
    assert "[at_end]" in str(e.value)


@pytest.mark.parametrize("loaded_with", [1, 3])
def test_state_of_another_worker_count_is_one_line_through_load_state_dict(run, loaded_with):
    """torchdata's own `loader.load_state_dict(state)`: the worker's error reaches the loop as one
    line (torch re-raises a worker's exception with its whole traceback as the message)."""
    ds = TokpackDataset(run, micro_batch=M, positions=None)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    again = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, positions=None), batch_size=None, num_workers=loaded_with
    )
    again.load_state_dict(state)
    with warnings.catch_warnings(), pytest.raises(TokpackError) as e:
        warnings.simplefilter("ignore")  # 3 workers on a 2-core machine: torch's advice
        next(iter(again))
    line = str(e.value)
    assert "\n" not in line, line
    for words in ("[num_workers]", "another number of DataLoader workers", f"expected 2, found {loaded_with}"):
        assert words in line, line
    assert "use num_workers=2, or restart from the consumed-sample count" in line, line
    assert TokpackDataset.consumed_samples(state) == 3 * M  # the way out the hint names


def _saved_state(run: Path, workers: int) -> dict:
    loader = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, positions=None), batch_size=None, num_workers=workers
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    return state


@pytest.mark.parametrize("saved_with, loaded_with", [(2, 0), (2, 1), (0, 2), (1, 0)])
@pytest.mark.parametrize("then", ["iter", "state_dict"])
def test_state_of_another_worker_count_is_one_line_to_and_from_no_workers(run, saved_with, loaded_with, then):
    """A real StatefulDataLoader, its own `load_state_dict(state)`: to or from num_workers=0,
    torchdata refused the state with a bare AssertionError ("State doesn't contain key
    '_num_yielded' expected for single process dataloader") before the dataset saw it; now every
    change is the same line, in the main process, at `iter(loader)` or `loader.state_dict()`
    (both make the iterator), and resuming as the hint says works."""
    state = _saved_state(run, saved_with)
    again = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, positions=None), batch_size=None, num_workers=loaded_with
    )
    again.load_state_dict(state)
    with pytest.raises(TokpackError) as e:
        next(iter(again)) if then == "iter" else again.state_dict()
    line = str(e.value)
    assert "\n" not in line, line
    for words in (
        "[num_workers]: loader state was saved with another number of DataLoader workers",
        f"expected {saved_with}, found {loaded_with}",
        f"HINT: use num_workers={saved_with}, or restart from the consumed-sample count",
    ):
        assert words in line, line
    fresh = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, positions=None, start_sample=TokpackDataset.consumed_samples(state)),
        batch_size=None,
        num_workers=loaded_with,
    )
    assert int(next(iter(fresh))["consumed_samples"]) == 4 * M  # the batch after the 3 the state saw
    same = StatefulDataLoader(
        TokpackDataset(run, micro_batch=M, positions=None), batch_size=None, num_workers=saved_with
    )
    same.load_state_dict(state)  # the other way out: the saved count of workers
    assert int(next(iter(same))["consumed_samples"]) == 4 * M


@pytest.mark.parametrize("workers", [0, 2])
def test_state_saved_once_the_iteration_ended_resumes_at_its_end_not_the_start(run, workers):
    """A loader run to the end of the written epochs (at_end="stop"), then saved: torchdata marks
    the state finished and, with workers, dropped the workers' shares for a fresh iterator whose
    workers started where the dataset was built, so the resumed job read the run again from
    sample 0 (the state's own count, TokpackDataset.consumed_samples, said END). Now it goes on
    at END: nothing to read there (stop), or the end's line before any batch (error)."""
    start = END - 3 * M

    def loader(at_end: str) -> StatefulDataLoader:
        ds = TokpackDataset(run, micro_batch=M, start_sample=0 if at_end == "error" else start, at_end=at_end)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    ended = loader("stop")
    assert len(list(ended)) == 3
    state = ended.state_dict()
    assert state["_iterator_finished"] is True and TokpackDataset.consumed_samples(state) == END
    resumed = loader("stop")
    resumed.load_state_dict(state)
    assert [int(b["consumed_samples"]) for b in resumed] == []
    resumed = loader("error")
    resumed.load_state_dict(state)
    got = []
    with pytest.raises(TokpackError) as e:
        for batch in resumed:
            got.append(int(batch["consumed_samples"]))
    assert got == []
    one_line(e.value, run)
