"""Issue 32, item 5: the Python API is as strict as the CLI. Each public function of
tokpack.packer.api, SampleReader and TokpackDataset check their arguments (types, ranges, unit
strings parsed as the CLI parses them) and every loader state they load, with one TokpackError
line naming the argument or the state's field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats import arguments
from tokpack.formats.errors import TokpackError
from tokpack.formats.names import epoch_dir_name
from tokpack.loader.reader import SampleReader
from tokpack.loader.torch_adapter import TokpackDataset
from tokpack.packer import api

SEQ, N = 15, 48


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("strict")
    src = write_source(base / "src", random_docs(np.random.default_rng(3), 120, 1000, 0))
    shuffle_run(
        [str(src)], str(base / "run"), seq_len=SEQ, seed=1, epochs=[0, 1], samples=N, shard_samples=8, memory=8 << 20
    )
    return base / "run"


def one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    line = str(e.value)
    assert type(e.value) is TokpackError and "\n" not in line
    for w in words:
        assert w in line, line
    return line


# ------------------------------------------------------------------ the checks themselves


@pytest.mark.parametrize("value", [3.5, "5", True, None, np.float64(2.0)])
def test_whole_refuses_what_is_not_an_int(value):
    with pytest.raises(TokpackError) as e:
        arguments.whole(value, "start_sample", optional=False)
    one_line(e, "[start_sample]", "must be an integer", repr(value))


def test_whole_takes_numpy_ints_and_checks_the_range():
    assert arguments.whole(np.int64(4), "n") == 4 and type(arguments.whole(np.int64(4), "n")) is int
    with pytest.raises(TokpackError) as e:
        arguments.whole(0, "micro_batch", least=1)
    one_line(e, "[micro_batch]", "out of range", "expected >= 1, found 0")


def test_units_as_the_cli_parses_them():
    assert arguments.tokens("3M", "tokens") == 3_000_000 and arguments.size("64MiB", "memory") == 64 << 20
    assert arguments.size("4G", "memory") == 4 << 30 and arguments.tokens(7, "tokens") == 7
    for parse, value, words in [
        (arguments.tokens, "1GB", ("[tokens]", "byte size")),
        (arguments.size, "64Mi", ("[memory]", "not a byte size")),
        (arguments.tokens, 2.5, ("[tokens]", "must be an integer or text")),
        (arguments.size, True, ("[memory]", "must be an integer or text")),
        (arguments.tokens, "1.5", ("[tokens]", "whole number")),
    ]:
        with pytest.raises(TokpackError) as e:
            parse(value, value and ("tokens" if parse is arguments.tokens else "memory"))
        one_line(e, *words)


# ------------------------------------------------------------------ packer/api.py


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: api.shuffle("s", "o", seq_len=0), ("[seq_len]", "out of range")),
        (lambda: api.shuffle("s", "o", seq_len=3.5), ("[seq_len]", "must be an integer")),
        (lambda: api.shuffle("s", "o", samples="5"), ("[samples]", "must be an integer", "'5'")),
        (lambda: api.shuffle("s", "o", epochs=0), ("[epochs]", "out of range")),
        (lambda: api.shuffle("s", "o", epochs=[0, 1.0]), ("[epochs[1]]", "must be an integer")),
        (lambda: api.shuffle("s", "o", memory="lots"), ("[memory]", "not a byte size")),
        (lambda: api.shuffle("s", "o", tokens="3MiB"), ("[tokens]", "byte size")),
        (lambda: api.shuffle("s", "o", jitter=1), ("[jitter]", "True or False")),
        (lambda: api.shuffle("s", "o", pad_id=-1), ("[pad_id]", "out of range")),
        (lambda: api.pack("i", "o", shard_tokens="1GB"), ("[shard_tokens]", "byte size")),
        (lambda: api.pack("i", "o", eos_id=2.0), ("[eos_id]", "must be an integer")),
        (lambda: api.pack("i", "o", executor=api.ExecutorConfig(workers=0)), ("[executor.workers]", "out of range")),
        (lambda: api.validate("d", workers=0), ("[workers]", "out of range")),
        (lambda: api.validate("d", quick="yes"), ("[quick]", "True or False")),
        # found by tests/test_fuzz.py (test_api_arguments_and_loader_states): a TypeError from deep inside
        (lambda: api.validate("d", against=0), ("[against]", "a path or a sequence of paths", "found 0")),
        (lambda: api.validate(3), ("[dirs]", "a path or a sequence of paths")),
        (lambda: api.validate("d", against=["e", 1]), ("[against]", "['e', 1]")),
        (lambda: api.stage("d", "e", micro_batch=0), ("[micro_batch]", "out of range")),
        (lambda: api.stage("d", "e", world_size=0), ("[world_size]", "out of range")),
        (lambda: api.stage("d", "e", start_sample=3.5), ("[start_sample]", "must be an integer")),
        (lambda: api.inspect("d", batches=True), ("[batches]", "must be an integer")),
        (lambda: api.inspect("d", memory="1Q"), ("[memory]", "not a byte size")),
        (lambda: api.plan("stage", "d", "e", world_size=0), ("[world_size]", "out of range")),
        (lambda: api.plan("shuffle", "s", "o", memory="64Mi"), ("[memory]", "not a byte size")),
        (lambda: api.plan("shuffle", "s", "o", disk_mbps=0), ("[disk_mbps]", "number > 0")),
        (lambda: api.plan(3), ("[command]", "no such command")),
    ],
)
def test_api_refuses_bad_arguments_before_touching_a_path(call, words):
    with pytest.raises(TokpackError) as e:
        call()
    one_line(e, *words)


# Found trying the API as a training script would (not the CLI): a path argument of the wrong
# type was str()-ed into a folder named "None" or "5" in the working directory, or raised a bare
# TypeError/ValueError/AttributeError from deep inside (after writing an epoch folder, for `log`).
@pytest.mark.parametrize(
    "call, words",
    [
        (lambda src: api.pack(src / "x.jsonl", None, eos_id=0), ("[output]", "must be a path", "None")),
        (lambda src: api.pack(None, "o", eos_id=0), ("[inputs]", "a path or a sequence of paths")),
        (lambda src: api.pack(src, "", eos_id=0), ("[output]", "found ''")),  # packed into the working directory
        (lambda src: api.shuffle([src, ""], "o", seq_len=SEQ, seed=1), ("[sources[1]]", "found ''")),
        (lambda src: api.pack(3, "o", eos_id=0), ("[inputs]", "found 3")),
        (lambda src: api.shuffle(src, 5, seq_len=SEQ, seed=1), ("[output]", "found 5")),
        (lambda src: api.shuffle(5, "o", seq_len=SEQ, seed=1), ("[sources]", "found 5")),
        (lambda src: api.shuffle([None], "o", seq_len=SEQ, seed=1), ("[sources[0]]", "must be a path")),
        (lambda src: api.shuffle([(src, 1, 2)], "o", seq_len=SEQ, seed=1), ("[sources[0]]", "(path, weight) pair")),
        (lambda src: api.shuffle({src: [1]}, "o", seq_len=SEQ, seed=1), ("weight must be a number or text",)),
        (lambda src: api.shuffle(None, "o", schedule=3), ("[schedule]", "found 3")),
        (lambda src: api.shuffle(src, "o", seq_len=SEQ, seed=1, scratch=3), ("[scratch]",)),
        (lambda src: api.shuffle(src, "o", seq_len=SEQ, seed=1, log=3), ("[log]", "callable")),
        (lambda src: api.pack(src, "o", log="verbose"), ("[log]", "callable")),
        (
            lambda src: api.shuffle(src, "o", seq_len=SEQ, seed=1, epochs=[0, 0]),
            ("[epochs]", "each epoch once", "0 twice"),
        ),
        (lambda src: api.shuffle(src, "o", seq_len=SEQ, seed=1, epochs=[]), ("[epochs]", "names no epoch")),
        (
            lambda src: api.shuffle(src, "o", seq_len=SEQ, seed=1, executor=api.ExecutorConfig(executor="slurmm")),
            ("[executor.executor]", "'slurmm'"),
        ),
        (lambda src: api.stage(src, None), ("[dest]", "None")),
        # a node's slice meant, node= forgotten: the whole directory was copied, without a word
        (lambda src: api.stage(src, "o", ranks_per_node=2), ("[--ranks-per-node]", "only with --node")),
        (lambda src: api.plan("stage", src, "o", ranks_per_node=2, disk_mbps=100), ("[--ranks-per-node]",)),
        (lambda src: api.inspect(None), ("[directory]", "must be a path")),
        (lambda src: api.inspect(src, plot=3), ("[plot]", "found 3")),
        # savefig's FileNotFoundError once the whole report was made
        (lambda src: api.inspect(src, plot="nodir/x.png"), ("nodir/x.png [--plot]", "folder does not exist")),
        (lambda src: SampleReader.open(None), ("[path]", "a path or a sequence of paths", "found None")),
        (lambda src: SampleReader.open(b"run"), ("[path]", "found b'run'")),
        (lambda src: TokpackDataset(7), ("[path]", "found 7")),
    ],
)
def test_wrong_path_and_callable_types_are_one_line_and_write_nothing(run, tmp_path, monkeypatch, call, words):
    src = Path(run).parent / "src"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TokpackError) as e:
        call(src)
    one_line(e, *words)
    assert list(tmp_path.iterdir()) == []  # no folder "None", "5" or "o" begun


def test_a_tokenizer_given_as_a_path_packs_as_its_text(tokenizer_path, tmp_path):
    """pack's tokenizer is a local tokenizer.json: tokenizer=Path(...) was refused as "must be a
    string" where every other path argument takes a pathlib.Path."""
    (tmp_path / "t.jsonl").write_text('{"text": "hello world"}\n{"text": "one more line"}\n')
    as_path = api.pack(tmp_path / "t.jsonl", tmp_path / "a", tokenizer=Path(tokenizer_path))
    as_text = api.pack(tmp_path / "t.jsonl", tmp_path / "b", tokenizer=str(tokenizer_path))
    assert as_path.fingerprint == as_text.fingerprint and as_path.tokens == as_text.tokens > 0


def test_validate_of_no_directory_is_the_usage_error(tmp_path):
    """validate([]) reported ok=True having validated nothing (a CI gate over an empty glob
    passed); `tokpack validate` without DIRS is a usage error."""
    with pytest.raises(api.UsageError, match="give one or more DIRs"):
        api.validate([])


def test_epochs_as_any_iterable_of_numbers(run, tmp_path):
    """A generator or numpy array of epoch numbers is a list of them (it was 'epochs must be an
    integer', though a list is what it is)."""
    src = Path(run).parent / "src"
    kw = dict(seq_len=SEQ, seed=1, samples=N, shard_samples=8)
    assert api.shuffle(src, tmp_path / "g", epochs=(e for e in [1]), **kw).epochs == [1]
    assert api.shuffle(src, tmp_path / "a", epochs=np.array([0]), **kw).epochs == [0]


def test_api_takes_unit_strings_as_the_cli_does(run, tmp_path):
    src = Path(run).parent / "src"
    got = api.shuffle(src, tmp_path / "r", seq_len=SEQ, seed=1, tokens="1K", memory="64MiB", shard_samples=8)
    assert got.epoch_samples == [1000 // SEQ]
    plan = api.plan("shuffle", [str(src)], str(tmp_path / "p"), seq_len=SEQ, seed=1, tokens="1K", memory="64MiB")
    assert plan.to_json()["ok"]


# ------------------------------------------------------------------ SampleReader


def test_reader_arguments(run):
    r = SampleReader.open(run)
    for call, words in [
        (lambda: r.start_from(start_sample=3.5), ("[start_sample]", "must be an integer")),
        (lambda: r.start_from(start_sample="5"), ("[start_sample]", "'5'")),
        (lambda: r.start_from(consumed_tokens="1GB"), ("[consumed_tokens]", "byte size")),
        (lambda: r.batches(0, 0, 1), ("[world_size]", "out of range")),
        (lambda: r.batches(0, 1, 0), ("[micro_batch]", "out of range")),
        (lambda: r.batches(2, 2, 1), ("[rank]", "expected 0..1")),
        (lambda: r.batches(0, 1, 1, positions="bos"), ("[positions]", "'bos'")),
        (lambda: r.batches(0, 1, 1, worker=1, num_workers=2, first_step=2), ("[first_step]",)),
        (lambda: r.position(0, 1.5), ("[sample]", "must be an integer")),
        (lambda: r.read(2 * N, 1), ("rows outside the chained stream",)),
        (lambda: SampleReader.open(run, verify="no"), ("[verify]",)),
    ]:
        with pytest.raises(TokpackError) as e:
            call()
        one_line(e, *words)
    assert r.start_from(consumed_tokens="150") == 150 // SEQ
    with pytest.raises(TokpackError, match="start must not be negative"):
        r.start_from(start_sample=-1)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda r: r.steps(0, 1), ("[world_size]", "out of range")),  # was a ZeroDivisionError
        (lambda r: r.steps("2", 1), ("[world_size]", "'2'")),  # was 197, as if 1
        (lambda r: r.locate(-1), ("[g]", "out of range")),  # an IndexError
        (lambda r: r.locate(2 * N), ("[sample 96]", "in no epoch of this chain")),
        (lambda r: r.locate(2.5), ("[g]", "must be an integer")),  # was (0, 2)
        (lambda r: r.epoch_sample(-1), ("[g]", "out of range")),  # was (-1, -1)
        (lambda r: r.epoch_sample("5"), ("[g]", "'5'")),  # a numpy UFuncTypeError
        (lambda r: r.most_documents(0.5, 3), ("[start]", "must be an integer")),  # a TypeError
        (lambda r: r.padding(-1, 2), ("[g]", "out of range")),  # an IndexError
        (lambda r: r.index_positions(-3, 2), ("[g]", "out of range")),  # an IndexError
        (lambda r: r.micro_batch(np.zeros((2, 5), dtype=np.uint16), None, 0), ("[rows]", "shape (2, 5)")),  # 4 columns
    ],
)
def test_reader_methods_check_their_arguments(run, call, words):
    """docs/API.md: every public function of SampleReader checks its arguments as the CLI's
    options are checked. Tried one by one, these raised a bare error from numpy or Python, or
    answered for another input."""
    with pytest.raises(TokpackError) as e:
        call(SampleReader.open(run))
    one_line(e, *words)


# ------------------------------------------------------------------ TokpackDataset


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"micro_batch": 0}, ("[micro_batch]", "out of range")),
        ({"world_size": 0}, ("[world_size]", "out of range")),
        ({"rank": 1, "world_size": 1}, ("[rank]", "expected 0..0")),
        ({"start_sample": 3.5}, ("[start_sample]", "must be an integer")),
        ({"start_sample": "5"}, ("[start_sample]", "'5'")),
        ({"start_sample": True}, ("[start_sample]",)),
        ({"consumed_tokens": 2.5}, ("[consumed_tokens]",)),
        ({"positions": "bos"}, ("[positions]",)),
        ({"verify": 1}, ("[verify]",)),
    ],
)
def test_dataset_arguments(run, kw, words):
    with pytest.raises(TokpackError) as e:
        TokpackDataset(run, **kw)
    one_line(e, *words)


@pytest.mark.parametrize(
    "state, words",
    [
        ([], ("not a TokpackDataset state",)),
        ({}, ("lacks a field", "[consumed_samples]")),
        ({"epoch": 0}, ("lacks a field", "[sample]")),
        ({"consumed_samples": "7"}, ("[loader state consumed_samples]", "must be an integer")),
        ({"consumed_samples": -1}, ("[loader state consumed_samples]", "out of range")),
        ({"consumed_samples": 2 * N + 1}, ("in epoch 2, which is not written yet",)),
        ({"epoch": 0, "sample": N + 1}, ("sample outside its epoch",)),
        ({"epoch": 0.0, "sample": 1}, ("[loader state epoch]",)),
        ({"next_step": 0}, ("lacks a field", "[start]")),
        ({"start": 0, "next_step": 1, "worker": 0, "num_workers": 2, "global_batch": 1}, ("not its own",)),
        ({"start": 0, "next_step": 0, "worker": 2, "num_workers": 2, "global_batch": 1}, ("not its own",)),
        (
            {"start": 0, "next_step": 0, "worker": 0, "num_workers": 0, "global_batch": 1},
            ("[loader state num_workers]",),
        ),
        (
            {"start": 0, "next_step": "0", "worker": 0, "num_workers": 1, "global_batch": 1},
            ("[loader state next_step]",),
        ),
        ({"start": 0, "next_step": 2 * N + 2, "worker": 0, "num_workers": 2, "global_batch": 1}, ("not written yet",)),
        ({"start": 2 * N + 4, "next_step": 0, "worker": 0, "num_workers": 1, "global_batch": 1}, ("not written yet",)),
    ],
)
def test_damaged_states_are_one_line(run, state, words):
    ds = TokpackDataset(run, positions=None)
    with pytest.raises(TokpackError) as e:
        ds.load_state_dict(state)
    one_line(e, *words)


@pytest.mark.parametrize(
    "state",
    [
        {"consumed_samples": N + 1},
        {"start": 0, "next_step": N + 2, "worker": 0, "num_workers": 2, "global_batch": 1},
        {"start": 0, "next_step": N, "worker": 0, "num_workers": 1, "global_batch": 2},
        {"start": N + 4, "next_step": 0, "worker": 0, "num_workers": 1, "global_batch": 1},
    ],
)
def test_a_state_past_the_end_is_refused(run, state):
    """An epoch directory has an end (a run's numbering names the epoch to write instead): a
    state past it, e.g. of another, longer run, is refused rather than yielding nothing."""
    ds = TokpackDataset(Path(run) / epoch_dir_name(0), positions=None)
    with pytest.raises(TokpackError) as e:
        ds.load_state_dict(state)
    one_line(e)
    assert "past the end" in str(e.value) or "beyond the end" in str(e.value)


def test_end_of_run_states_still_load(run):
    """The position after the last batch (the end of the run) is a state, not past it."""
    ds = TokpackDataset(run, positions=None, at_end="stop")
    ds.load_state_dict({"consumed_samples": 2 * N})
    assert list(ds) == []
    ds.load_state_dict({"start": 0, "next_step": 2 * N + 1, "worker": 1, "num_workers": 2, "global_batch": 1})
    ds.load_state_dict({"consumed_samples": torch.tensor(5)})
    assert ds.consumed == 5


@pytest.mark.parametrize(
    "batch, words",
    [
        ({"input_ids": torch.zeros(1, 2)}, ("[batch]", "before a trainer form", "keys ['input_ids']")),
        ([1], ("[batch]", "found list")),
        ({"consumed_samples": -5}, ("[batch consumed_samples]", "out of range")),
        ({"consumed_samples": 3.7}, ("[batch consumed_samples]", "must be an integer")),
        ({"consumed_samples": torch.tensor(2.0)}, ("[batch consumed_samples]", "must be an integer")),
    ],
)
def test_state_dict_of_a_batch_that_names_no_position(run, batch, words):
    """ds.state_dict(batch) of a trainer's form (it drops consumed_samples), a non-dict or a bad
    count was a KeyError, a TypeError or a ValueError from int(), and -5 gave epoch -1: found
    handing it what a training loop holds."""
    ds = TokpackDataset(run, positions=None)
    with pytest.raises(TokpackError) as e:
        ds.state_dict(batch)
    one_line(e, *words)


def test_state_dict_of_a_collated_batch_is_the_position_after_it(run):
    """A collating loader stacks consumed_samples (docs/API.md): the position after its batch is
    after its last micro-batch (int() of the stacked tensor was a ValueError)."""
    ds = TokpackDataset(run, positions=None, micro_batch=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=3)
    first = next(iter(loader))
    assert first["consumed_samples"].tolist() == [2, 4, 6]
    state = ds.state_dict(first)
    assert state["consumed_samples"] == 6
    again = TokpackDataset(run, positions=None, micro_batch=2)
    again.load_state_dict(state)
    assert int(next(iter(again))["consumed_samples"]) == 8


def test_a_chain_holding_one_epoch_number_twice_resumes_from_its_own_state(run):
    """A chain of epoch directories may hold one epoch number twice (epoch 0 of two runs, here the
    same one twice): the state saved in the second was refused at its load as "damaged", since
    its (epoch, sample) also names a sample of the first. Found resuming such a chain."""
    chain = [Path(run) / epoch_dir_name(0)] * 2
    ds = TokpackDataset(chain, positions=None, micro_batch=2, read_ahead=False)
    batches = iter(ds)
    for _ in range(30):
        next(batches)
    state = ds.state_dict()
    assert (state["epoch"], state["sample"], state["consumed_samples"]) == (0, 60 - N, 60)
    again = TokpackDataset(chain, positions=None, micro_batch=2)
    again.load_state_dict(state)
    assert again.consumed == 60 and int(next(iter(again))["consumed_samples"]) == 62
    with pytest.raises(TokpackError) as e:  # a count neither occurrence's (epoch, sample) names is still refused
        again.load_state_dict({**state, "consumed_samples": 61})
    one_line(e, "damaged")


def test_a_relative_path_still_reads_after_the_script_changes_directory(run, tmp_path, monkeypatch):
    """A dataset built from a relative path opens its shard files at the first read (in each
    DataLoader worker too): after a chdir (Hydra's job.chdir, a notebook's %cd) that read was
    "file disappeared after the reader was opened". Found building the dataset, then chdir."""
    monkeypatch.chdir(Path(run).parent)
    reader = SampleReader.open(Path(run).name, verify=True)  # checksummed at the first read, after the chdir
    ds = TokpackDataset(Path(run).name, positions=None, micro_batch=2)
    first = next(iter(TokpackDataset(run, positions=None, micro_batch=2)))["input_ids"]
    monkeypatch.chdir(tmp_path)
    assert torch.equal(next(iter(ds))["input_ids"], first)
    assert reader.read(0, 2).shape == (2, SEQ + 1)


def _saved(run, workers: int) -> dict:
    ds = TokpackDataset(run, positions=None, micro_batch=2)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize("saved_with, loaded_with", [(2, 0), (0, 2), (2, 1)])
def test_worker_count_change_is_one_line_including_zero(run, saved_with, loaded_with):
    state = _saved(run, saved_with)
    ds = TokpackDataset(run, positions=None, micro_batch=2)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=loaded_with)
    with pytest.raises(TokpackError) as e:
        ds.load_loader_state(loader, state)
    one_line(
        e,
        "[num_workers]",
        "another number of DataLoader workers",
        f"expected {saved_with}, found {loaded_with}",
        "consumed_samples(loader_state)",
    )
    assert TokpackDataset.consumed_samples(state) == 6  # the way out the hint names works


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_own_state_loaded_into_the_loader_is_one_line(run, workers):
    """ds.state_dict() (the dataset's own position) handed to loader.load_state_dict was torchdata's
    bare AssertionError ("State doesn't contain key '_num_yielded'") at the next iter(loader), and
    load_loader_state took it; a torch DataLoader there was an AttributeError. Found mixing the
    two states up, as a checkpoint of the dataset's state would."""
    own = TokpackDataset(run, positions=None).state_dict()
    ds = TokpackDataset(run, positions=None)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers)
    with pytest.raises(TokpackError) as e:
        ds.load_loader_state(loader, own)
    one_line(e, "[loader state]", "a TokpackDataset's own state", "ds.load_state_dict(state)")
    loader.load_state_dict(own)  # torchdata takes it as it is; the line comes before any worker starts
    with pytest.raises(TokpackError) as e:
        iter(loader)
    one_line(e, "[loader state]", "a TokpackDataset's own state")
    with pytest.raises(TokpackError) as e:
        ds.load_loader_state(torch.utils.data.DataLoader(ds, batch_size=None), _saved(run, 0))
    one_line(e, "[loader]", "takes a torchdata StatefulDataLoader", "found DataLoader")


def test_load_loader_state_resumes_as_load_state_dict(run):
    state = _saved(run, 2)
    ds = TokpackDataset(run, positions=None, micro_batch=2)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    ds.load_loader_state(loader, state)
    assert int(next(iter(loader))["consumed_samples"]) == 8


@pytest.mark.parametrize(
    "state",
    [
        {"_snapshot": {}},
        {"_snapshot": {"_worker_snapshots": {"w": 3}}},
        {"dataset_state": {"consumed_samples": 1.5}},
        "x",
    ],
)
def test_consumed_samples_of_a_damaged_loader_state(state):
    with pytest.raises(TokpackError) as e:
        TokpackDataset.consumed_samples(state)
    one_line(e)
