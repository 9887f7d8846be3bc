"""Data schedules (`tokpack shuffle --schedule run.yaml`): a run whose stages change the mixture.

Runs are written by the real shuffle engine (out of core under a small --memory, local
executor with worker processes); loaders are torchdata's StatefulDataLoader with workers and
datatrove's DatatroveFolderDataset.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError, UsageError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.shards import PackedSource
from tokpack.loader.reader import SampleReader
from tokpack.packer.api import inspect, shuffle, stage, validate
from tokpack.packer.cli import main
from tokpack.shuffle.plan import EpochPlan
from tokpack.shuffle.mixture import jitter_offset
from tokpack.shuffle.schedule import RunPlan, Schedule, Stage

REPO = Path(__file__).resolve().parents[1]
SEQ = 31  # a sample is 32 tokens
MEMORY = 48 << 10  # well under the windows of an epoch: the out-of-core path
# web: 576 windows, code: 307, math: 137. Stage "stable" takes 618 web samples an epoch (its
# chain wraps within epoch 0) and 265 code samples (its chain wraps within epoch 1); "mid" and
# "decay" continue both chains and start math's.
SCHEDULE = """\
seq_len: 31
seed: 7
shard_samples: 50
stages:
  - name: stable
    epochs: 2
    sources: {web: 0.7, code: 0.3}
  - name: mid
    tokens: 8K            # 258 samples
    sources: {web: 0.5, code: 0.3, math: 0.2}
  - name: decay
    tokens: 3K            # 96 samples
    sources: {math: 0.6, code: 0.4}
"""
SIZES = [883, 883, 258, 96]
STAGES = ["stable", "stable", "mid", "decay"]
BOUNDARY = SIZES[0] + SIZES[1]  # consumed-sample number of the first sample of stage "mid" (epoch 2)
RESULTS: dict = {}  # the ShuffleResult of the `run` fixture


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("schedule")
    for k, (name, n) in enumerate([("web", 120), ("code", 60), ("math", 30)]):
        write_source(root / name, random_docs(np.random.default_rng(k), n, 1000, 0), docs_per_shard=20)
    (root / "run.yaml").write_text(SCHEDULE)
    return root


@pytest.fixture(scope="module")
def run(corpus) -> Path:
    """The three-stage run, every epoch written by one command, in order."""
    out = corpus / "run"
    result = shuffle(None, out, schedule=corpus / "run.yaml", memory=MEMORY)
    RESULTS["run"] = result
    assert result.written == [0, 1, 2, 3]
    assert "out-of-core" in result.path
    return out


def tree(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def cli(*args) -> tuple[int, list[str]]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output.strip().splitlines()


# ------------------------------------------------------------------ building


def test_the_run_records_its_schedule(run, corpus):
    m = read_manifest(run, kind="run")
    assert m["epoch_samples"] == SIZES and m["samples"] == 0 and m["epochs"] == [0, 1, 2, 3]
    assert [e["stage"] for e in m["schedule"]] == STAGES
    assert [s["name"] for s in m["sources"]] == ["web", "code", "math"]
    assert m["schedule"][3] == {"stage": "decay", "sources": [2, 1], "weights": ["0.6", "0.4"], "samples": [58, 38]}
    assert m["schedule_file"] == str((corpus / "run.yaml").resolve())
    for e, size in enumerate(SIZES):
        assert read_manifest(run / epoch_dir_name(e), kind="epoch")["samples"] == size


@pytest.mark.parametrize("workers", [1, 2])
def test_epochs_built_one_by_one_in_shuffled_order_are_byte_identical(run, corpus, tmp_path, workers):
    out = tmp_path / "run"
    order = [0, 1, 2, 3]
    random.Random(workers).shuffle(order)
    order = order if order != [0, 1, 2, 3] else [3, 1, 0, 2]
    for e in order:
        code, lines = cli(
            "shuffle",
            "--schedule",
            corpus / "run.yaml",
            "-o",
            out,
            "--epoch",
            e,
            "--memory",
            MEMORY,
            "--workers",
            workers,
            "--json",
        )
        assert code == 0, lines
    assert tree(out) == tree(run)


def test_a_flags_run_is_a_schedule_of_one_stage(corpus, tmp_path):
    """The same mixture from flags and from a one-stage schedule file: the same epochs, byte for byte."""
    stage = f"  - {{name: only, epochs: 2, sources: {{{corpus}/web: 2, {corpus}/code: 1}}}}\n"
    (tmp_path / "one.yaml").write_text(f"seq_len: {SEQ}\nseed: 7\nshard_samples: 50\nstages:\n{stage}")
    shuffle(None, tmp_path / "a", schedule=tmp_path / "one.yaml", memory=MEMORY)
    shuffle(
        {str(corpus / "web"): "2", str(corpus / "code"): "1"},
        tmp_path / "b",
        seq_len=SEQ,
        seed=7,
        epochs=2,
        shard_samples=50,
        memory=MEMORY,
    )
    for e in range(2):
        assert tree(tmp_path / "a" / epoch_dir_name(e)) == tree(tmp_path / "b" / epoch_dir_name(e))
    assert "cursor" not in json.dumps(read_manifest(tmp_path / "a" / epoch_dir_name(1)))


# ---------------------------------------------------------- chains across stages


def test_each_window_once_per_pass_across_stages(run, corpus):
    """Directly, from the samples: every sample of every epoch is its source's window (read
    from the source), and each source's windows are taken once each, pass after pass, over the
    whole run: a later stage continues the chain where the earlier epochs left it."""
    sources = {name: PackedSource.open(corpus / name) for name in ("web", "code", "math")}
    taken: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    reader = SampleReader.open(run)
    for e, size in enumerate(SIZES):
        m = read_manifest(run / epoch_dir_name(e), kind="epoch")
        plan = EpochPlan.from_manifest(m, list(sources.values()))
        s, window, passes = plan.locate(np.arange(size))
        rows = reader.read(reader.position(e, 0), size)
        for g in range(size):
            src = sources[plan.sources[s[g]].name]
            lo, hi = plan.token_range(int(s[g]), int(window[g]))
            got = np.empty(hi - lo, dtype=src.dtype)
            src.read_into(lo, got, {})
            assert np.array_equal(rows[g], got), (e, g)
        for g in range(size):
            taken[int(s[g])].append((int(passes[g]), int(window[g])))
    windows = {0: 576, 1: 307, 2: 137}
    totals = {0: 618 * 2 + 129, 1: 265 * 2 + 77 + 38, 2: 52 + 58}
    for u, pairs in taken.items():
        assert len(pairs) == totals[u]
        assert len(set(pairs)) == len(pairs)  # no (pass, window) twice: no window twice within a pass
        for p in range(totals[u] // windows[u]):  # every complete pass holds every window once
            assert sorted(w for q, w in pairs if q == p) == list(range(windows[u]))
        assert max(q for q, _ in pairs) == (totals[u] - 1) // windows[u]  # and no pass is started early


# ------------------------------------------------------------------ reading


def test_global_batch_across_a_stage_boundary_sample_reader(run):
    reader = SampleReader.open(run)
    g0 = BOUNDARY - 3
    assert reader.epoch_sample(g0) == (1, SIZES[1] - 3)
    assert reader.epoch_sample(BOUNDARY) == (2, 0)
    assert reader.total_samples == sum(SIZES)
    epoch1, epoch2 = (SampleReader.open(run / epoch_dir_name(e)) for e in (1, 2))
    want = np.concatenate([epoch1.read(SIZES[1] - 3, 3), epoch2.read(0, 3)])
    world, micro = 2, 3  # one global batch of 6: three samples of "stable", three of "mid"
    got = [s for r in range(world) for s in reader.rank_samples(r, world, micro, start=g0, count=micro)]
    assert [(s.epoch, s.sample) for s in got] == [
        (1, SIZES[1] - 3),
        (1, SIZES[1] - 2),
        (1, SIZES[1] - 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert np.array_equal(np.stack([s.tokens for s in got]), want)
    code, lines = cli(
        "read", run, "--rank", 1, "--world-size", 2, "--micro-batch", 3, "--start-sample", g0, "--count", 3, "--json"
    )
    assert code == 0 and [(x["epoch"], x["sample"]) for x in map(json.loads, lines)] == [(2, 0), (2, 1), (2, 2)]


def test_reading_past_the_schedules_end_says_where_it_ends(run):
    """The run directory was passed: the hint says where the schedule's epochs end and how to
    train longer, not "or pass the run directory"."""
    with pytest.raises(TokpackError) as e:
        SampleReader.open(run).start_from(start_sample=sum(SIZES) + 1)
    assert str(e.value).endswith(
        f"HINT: the run's schedule plans {len(SIZES)} epochs, ending at sample {sum(SIZES)}: "
        "to train longer, add a stage to the schedule"
    )
    code, lines = cli("read", run, "--start-sample", sum(SIZES) + 1)
    assert code == 1 and "pass the run directory" not in lines[-1] and "add a stage" in lines[-1]


def test_reading_an_epoch_folder_past_the_schedules_end_says_where_the_schedule_ends(run):
    """The last epoch's folder passed alone: `shuffle --like RUN --epoch E` past the schedule is
    refused, so the hint is not that command but where the schedule ends (it proposed it, and
    "or pass the run directory", which leads to the same end)."""
    last = run / "epoch-00003"
    code, lines = cli("read", last, "--start-sample", SIZES[3] + 1)
    assert code == 1 and lines[-1].endswith(
        f"HINT: the schedule of run {run} plans {len(SIZES)} epochs, ending at sample {sum(SIZES)}: "
        "to train longer, add a stage to the schedule"
    ), lines
    code, lines = cli("shuffle", "--like", run, "--epoch", len(SIZES))  # what it proposed: refused
    assert code == 1 and "epoch is not in the schedule" in lines[-1]


def test_tokpack_dataset_workers_cross_a_stage_boundary_and_resume_inside_it(run):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tokpack.loader.torch_adapter import TokpackDataset

    world, micro = 2, 3
    start = BOUNDARY - 9  # step 0 ends in "stable", step 1 spans the boundary, step 2 is in "mid"
    reader = SampleReader.open(run)
    want = [reader.read(start + b * world * micro + micro, micro).astype(np.int64) for b in range(3)]
    ds = TokpackDataset(run, rank=1, world_size=world, micro_batch=micro, start_sample=start, positions="eos")
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    first = next(it)
    saved = loader.state_dict()  # after step 0: the next item is the one across the boundary
    crossing, after = next(it), next(it)
    del it
    for batch, rows in zip((first, crossing, after), want):
        assert torch.equal(batch["input_ids"], torch.from_numpy(rows[:, :-1]))
    assert int(crossing["consumed_samples"]) == BOUNDARY + 3
    assert ds.state_dict(crossing) == {
        "epoch": 2,
        "sample": 3,
        "consumed_samples": BOUNDARY + 3,
        "seq_len": ds.reader.seq_len,
        "run": ds.reader.run_digest,
    }
    resumed = StatefulDataLoader(
        TokpackDataset(run, rank=1, world_size=world, micro_batch=micro, start_sample=start, positions="eos"),
        batch_size=None,
        num_workers=2,
    )
    resumed.load_state_dict(saved)
    it = iter(resumed)
    again = next(it), next(it)
    del it
    assert torch.equal(again[0]["input_ids"], crossing["input_ids"])
    assert torch.equal(again[1]["input_ids"], after["input_ids"])
    assert TokpackDataset.consumed_samples(saved) == start + world * micro


def test_datatrove_folder_dataset_reads_the_epochs_in_order(run):
    code = (
        "import json\n"
        "from datatrove.utils.dataset import DatatroveFolderDataset\n"
        f"ds = DatatroveFolderDataset({str(run)!r}, {SEQ}, filename_pattern='**/*.ds', token_size=2)\n"
        "print(json.dumps([ds[i]['input_ids'].tolist() for i in range(len(ds))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    theirs = json.loads(out.stdout.splitlines()[-1])
    reader = SampleReader.open(run)
    assert len(theirs) == reader.total_samples == sum(SIZES)
    assert np.array_equal(np.array(theirs), reader.read(0, reader.total_samples))


def test_stage_ranks_and_inspect_follow_the_stages(run, tmp_path):
    world, micro = 2, 3
    start = BOUNDARY - 3
    stage(run, tmp_path / "copy", ranks=f"1/{world}", micro_batch=micro)
    full, part = SampleReader.open(run), SampleReader.open(tmp_path / "copy")
    ours = [(s.epoch, s.sample, s.tokens.tolist()) for s in part.rank_samples(1, world, micro, start=start, count=9)]
    assert ours == [
        (s.epoch, s.sample, s.tokens.tolist()) for s in full.rank_samples(1, world, micro, start=start, count=9)
    ]
    assert ours[0][:2] == (2, 0)
    report = inspect(run, batches=2, batch_size=8)
    assert [(st["stage"], st["epochs"], st["samples"]) for st in report.stages] == [
        ("stable", [0, 1], SIZES[0] + SIZES[1]),
        ("mid", [2], SIZES[2]),
        ("decay", [3], SIZES[3]),
    ]
    assert [s["name"] for s in report.stages[2]["sources"]] == ["math", "code"]


# ------------------------------------------------------------------ checking


def test_validate_checks_each_epoch_against_its_stage_sources(run, corpus):
    result = validate(run, against=[corpus / "web", corpus / "code", corpus / "math"])
    assert result.ok, result.problems
    # epoch 3 ("decay") against its stage's sources only
    assert validate(run / epoch_dir_name(3), against=[corpus / "math", corpus / "code"]).ok


@pytest.mark.parametrize(
    "cursor, first_pass, message",
    [
        (600, 1, "taken twice before its source is exhausted"),  # restarts web's chain inside pass 1, not at 1236
        (1300, 2, "windows of its chain skipped"),
    ],
)
def test_validate_reports_a_chain_that_does_not_continue(run, tmp_path, cursor, first_pass, message):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / epoch_dir_name(2)
    m = read_manifest(path, kind="epoch")
    web = m["sources"][0]
    assert (web["name"], web["cursor"]) == ("web", 2 * 618)
    web.update(cursor=cursor, first_pass=first_pass, passes=1)  # the pass bookkeeping agrees with the cursor
    (path / MANIFEST).write_bytes(canonical_bytes(m))
    problems = validate(copy).problems
    assert [p["where"] for p in problems] == ["sources[0].cursor"]
    assert message in problems[0]["message"]
    assert problems[0]["expected"].startswith("1236")


def test_validate_reports_a_changed_schedule_file(run, corpus, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    changed = tmp_path / "run.yaml"
    changed.write_text(SCHEDULE.replace("math: 0.6", "math: 0.7"))
    m = read_manifest(copy, kind="run")
    m["schedule_file"] = str(changed)
    (copy / MANIFEST).write_bytes(canonical_bytes(m))
    problems = validate(copy).problems
    assert [p["where"] for p in problems] == ["xxh3_128"]
    assert "schedule file changed" in problems[0]["message"]
    changed.unlink()
    result = validate(copy)
    assert result.status == "unverified" and [p["where"] for p in result.problems] == ["schedule_file"]


# ------------------------------------------------------------------ bad input


def stage_line(**kw) -> str:
    fields = {"name": "a", "epochs": 1, "sources": "{web: 1}", **kw}
    return "  - {" + ", ".join(f"{k}: {v}" for k, v in fields.items() if v is not None) + "}\n"


BAD = {
    "no sources": (stage_line(sources="{}"), "stage has no sources"),
    "weight 0": (stage_line(sources="{web: 0, code: 1}"), "weight is 0"),
    "unknown key": (stage_line(weight=2), "unknown key in the schedule"),
    "smaller than one sample": (stage_line(epochs=None, tokens=30), "stage is smaller than one sample"),
    "dtype differs": (stage_line() + stage_line(name="b", sources="{wide: 1}"), "sources disagree"),
    "same name twice": (stage_line() + stage_line(sources="{code: 1}"), "two stages have the same name"),
    "a source twice": (stage_line(sources="{web: 1, code: 1, code: 2}"), "schedule key given twice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_schedule_is_one_line_and_writes_nothing(corpus, tmp_path, case):
    if not (corpus / "wide").exists():
        write_source(corpus / "wide", random_docs(np.random.default_rng(9), 10, 70000, 0), vocab_size=70000)
    stages, message = BAD[case]
    (tmp_path / "bad.yaml").write_text(
        f"seq_len: {SEQ}\nseed: 1\nstages:\n{stages}".replace("{web", f"{{{corpus}/web")
        .replace("code:", f"{corpus}/code:")
        .replace("{wide", f"{{{corpus}/wide")
    )
    code, lines = cli("shuffle", "--schedule", tmp_path / "bad.yaml", "-o", tmp_path / "out", "--memory", MEMORY)
    assert code == 1 and len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith("tokpack: error: ")
    assert not (tmp_path / "out").exists()


def test_changed_schedule_is_refused_against_the_existing_run(run, corpus, tmp_path):
    changed = corpus / "changed.yaml"
    for text, where in (
        (SCHEDULE.replace("web: 0.5, code: 0.3", "web: 0.4, code: 0.4"), "epoch 2"),
        (SCHEDULE.replace("tokens: 3K", "tokens: 4K"), "epoch 3"),
        (SCHEDULE.replace("epochs: 2", "epochs: 3"), "epoch 2"),
    ):
        changed.write_text(text)
        before = tree(run)
        code, lines = cli("shuffle", "--schedule", changed, "-o", run, "--epoch", 0, "--memory", MEMORY)
        assert code == 1 and len(lines) == 1, lines
        assert "the schedule differs from the one the run was made with" in lines[0] and f"[{where}]" in lines[0]
        assert tree(run) == before
    # the same schedule, weights respelled (equal ratios): the run, unchanged, is complete already
    changed.write_text(SCHEDULE.replace("web: 0.7, code: 0.3", "web: 7, code: 3"))
    before = tree(run)
    code, lines = cli("shuffle", "--schedule", changed, "-o", run, "--memory", MEMORY, "--json")
    assert code == 0 and json.loads(lines[-1])["skipped"] == [0, 1, 2, 3]
    assert tree(run) == before


# ------------------------------------------------------------------ the plan, any schedule


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 4), min_size=3, max_size=3).filter(any),
            st.one_of(
                st.integers(1, 3).map(lambda k: ("epochs", k)), st.integers(SEQ, 40 * SEQ).map(lambda t: ("tokens", t))
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_any_schedule_continues_every_chain(corpus, stages, jitter):
    """For any schedule: each epoch starts each source's chain where the epochs before it left
    it, and no (pass, window) of a source is taken twice over the whole run."""
    paths = [str(corpus / name) for name in ("web", "code", "math")]
    schedule = Schedule(
        SEQ,
        3,
        tuple(
            Stage(
                f"s{k}",
                tuple(p for p, w in zip(paths, ws) if w),
                tuple(str(w) for w in ws if w),
                size if kind == "epochs" else 1,
                tokens=size if kind == "tokens" else None,
            )
            for k, (ws, (kind, size)) in enumerate(stages)
        ),
        jitter,
    )
    union = schedule.paths
    plan = RunPlan(schedule, [PackedSource.open(p) for p in union], [Path(p).name for p in union])
    taken = [0] * len(union)
    seen: set = set()
    for e in range(schedule.epochs):
        ep = plan.epoch_plan(e)
        for u, sp in enumerate(ep.sources if len(stages) > 1 else ()):
            assert (sp.index, ep.chain_start(u)) == (u, taken[u])
        # jitter offsets are keyed by the run's epoch and the source's key: a later stage never
        # repeats an earlier stage's offsets
        assert [sp.offset for sp in ep.sources] == [
            jitter_offset(3, e, sp.index, SEQ) if jitter else 0 for sp in ep.sources
        ]
        s, window, passes = ep.locate(np.arange(ep.samples))
        keys = {(ep.sources[i].index, p, w) for i, p, w in zip(s.tolist(), passes.tolist(), window.tolist())}
        counts = np.bincount(s, minlength=len(ep.sources)).tolist()
        assert not keys & seen
        # within an epoch, a window repeats only in another pass: the keys are distinct
        assert len(keys) == ep.samples
        seen |= keys
        taken = [t + counts[u] for u, t in enumerate(taken)] if len(stages) > 1 else taken


def test_plan_of_a_schedule_is_the_run(run, corpus, tmp_path):
    """`tokpack plan shuffle --schedule` plans every epoch of the schedule as the run made them:
    sizes, shards, and the run manifest's size (its schedule fields included)."""
    from tokpack.packer import plan

    planned = plan("shuffle", None, tmp_path / "planned", schedule=corpus / "run.yaml", memory=MEMORY, disk_mbps=100)
    assert [e["samples"] for e in planned.epochs] == SIZES
    assert [e["shards"] for e in planned.epochs] == [
        len(list((run / epoch_dir_name(e)).glob("*.ds"))) for e in range(4)
    ]
    assert (
        abs(planned.manifests["tokpack.json"] - (run / "tokpack.json").stat().st_size)
        <= 0.01 * (run / "tokpack.json").stat().st_size
    )
    assert not (tmp_path / "planned").exists()
    code, lines = cli(
        "plan",
        "shuffle",
        "--schedule",
        corpus / "run.yaml",
        "-o",
        tmp_path / "p2",
        "--epoch",
        "2",
        "--memory",
        str(MEMORY),
        "--disk-mbps",
        "100",
        "--json",
    )
    assert code == 0 and [e["samples"] for e in json.loads("\n".join(lines))["epochs"]] == [SIZES[2]]


def test_summary_and_plan_of_a_schedule_report_every_epoch_and_stage(run, corpus, tmp_path):
    """shuffle's summary gives each epoch's size (not one samples_per_epoch of 0) and stage; the
    plan shows every epoch's stage and per-source lines, and gives shuffle's own repeat warnings,
    whose hint points at the schedule file, not at --samples/--tokens."""
    from tokpack.packer import plan

    result = RESULTS["run"]
    assert result.samples_per_epoch is None and result.epoch_samples == SIZES
    assert [d["stage"] for d in result.epochs_detail] == STAGES
    assert result.bytes_written == sum(p.stat().st_size for p in run.rglob("*.ds")) and result.mb_per_s is not None
    planned = plan("shuffle", None, tmp_path / "planned", schedule=corpus / "run.yaml", memory=MEMORY, disk_mbps=100)
    assert [e["stage"] for e in planned.epochs] == STAGES and planned.samples_per_epoch is None
    for e, d in zip(planned.epochs, result.epochs_detail):
        assert e["sources"] == [s for s in d["sources"] if s["samples"] or s["weight"] is not None]
    assert [s["name"] for s in planned.epochs[2]["sources"]] == ["web", "code", "math"]
    # web wraps in epoch 0 and 1, code in 1 and 3 (decay): a later stage repeats a source
    assert planned.warnings == result.warnings and len(result.warnings) == 4
    assert "epoch 3 (stage decay): source code" in result.warnings[-1]
    assert all("schedule file" in w and "--samples" not in w for w in result.warnings)
    code, lines = cli(
        "plan",
        "shuffle",
        "--schedule",
        corpus / "run.yaml",
        "-o",
        tmp_path / "p",
        "--memory",
        str(MEMORY),
        "--disk-mbps",
        "100",
    )
    text = "\n".join(lines)
    assert code == 0 and "epoch 2 (stage mid)" in text and "source math: 58 samples" in text
    assert text.count("tokpack: warning:") == 4


def test_a_run_made_with_flags_is_a_one_stage_schedule_of_those_flags(tmp_path):
    """`shuffle SOURCE... --tokens N --jitter` is planned as a schedule of one stage: the flags
    all reach it (a dropped --tokens or --jitter would plan another epoch)."""
    from tokpack.shuffle.schedule import read_schedule

    flags = Schedule.of_flags(["a", "b"], ["0.25", None], seq_len=31, seed=9, tokens=5000, jitter=True)
    assert (flags.seq_len, flags.seed, flags.jitter, flags.file) == (31, 9, True, None)
    (stage,) = flags.stages
    assert (stage.paths, stage.weights, stage.epochs, stage.samples, stage.tokens) == (
        ("a", "b"),
        ("0.25", None),
        None,
        None,
        5000,
    )
    assert Schedule.of_flags(["a"], [None], seq_len=31, seed=9, samples=12).stages[0].samples == 12
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 31\nseed: 1\nstages: [3]\n")
    with pytest.raises(TokpackError) as err:
        read_schedule(bad)
    assert str(err.value) == (
        f"{bad} [stages[0]]: schedule entry is not a mapping; expected key: value pairs, "
        'found int. HINT: see docs/COMMANDS.md, "Schedules", for the file\'s shape'
    )


SHAPE_HINT = 'HINT: see docs/COMMANDS.md, "Schedules", for the file\'s shape'
FIELD_PATHS = {
    "stages: [3]": "[stages[0]]: schedule entry is not a mapping; expected key: value pairs, found int.",
    "stages: [{name: a, sources: {x: 1}, weights: 1, epochs: 1}]": "[stages[0].weights]: unknown key in the schedule; expected one of name, sources, tokens, epochs, "
    "found 'weights'.",
    "stages: [{name: a, sources: {x: 1}}]": "[stages[0]]: stage needs exactly one of tokens and epochs; expected tokens: 8T or epochs: 3, found neither.",
    "stages: [{name: a, sources: {x: 1}, epochs: 1}, {name: b, sources: {x: 1}, epochs: 0}]": "[stages[1].epochs]: schedule value is not a valid integer; expected an integer >= 1, found 0.",
    "stages: [{name: a, sources: {x: 1}, epochs: 1}]\nweights: 1": "[weights]: unknown key in the schedule; expected one of seq_len, seed, jitter, shard_samples, stages, "
    "packing, found 'weights'.",
}


@pytest.mark.parametrize("body", sorted(FIELD_PATHS))
def test_schedule_errors_name_the_field_by_its_path(tmp_path, body):
    """The field of a bad schedule is `stages[0]`, `stages[0].weights` or a top-level key: no stray
    dot after a stage's index and none before a top-level key."""
    from tokpack.shuffle.schedule import read_schedule

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"seq_len: 31\nseed: 1\n{body}\n")
    with pytest.raises(TokpackError) as err:
        read_schedule(bad)
    assert str(err.value) == f"{bad} {FIELD_PATHS[body]} {SHAPE_HINT}"


def test_a_stage_naming_a_missing_source_names_the_file_and_the_stage(corpus, tmp_path):
    """A stage naming a source that is not there said only `DIR/nope: no such directory` (the
    file's directory joined to the key), naming neither the schedule file nor the stage: the
    line now names both, in shuffle and in plan, and nothing is written."""
    yaml = tmp_path / "gone.yaml"
    yaml.write_text(
        f"seq_len: 31\nseed: 7\nstages:\n  - name: s\n    epochs: 1\n    sources: {{{corpus}/web: 1}}\n"
        "  - name: t\n    epochs: 1\n    sources: {nope: 1}\n"
    )
    for args in (
        ["shuffle", "--schedule", yaml, "-o", tmp_path / "o"],
        ["plan", "shuffle", "--schedule", yaml, "-o", tmp_path / "p"],
    ):
        code, lines = cli(*args)
        assert code == 1 and lines == [
            f"tokpack: error: {yaml} [stages[1].sources.nope]: a stage names a source that is not there; "
            f"expected a packed source directory, found nothing at {tmp_path / 'nope'}. HINT: correct the path in "
            "the schedule (a relative one is relative to the file's directory), or put the source there"
        ], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone.yaml"]


def test_a_stage_too_large_for_its_sources_names_the_stage_not_flags(corpus, tmp_path):
    """A stage whose tokens take a source more than 10^5 times in one epoch was refused naming
    the source directory and "--samples/--tokens/SOURCE=WEIGHT", flags a schedule run is not
    given: the line names the schedule file and the stage's field, in shuffle and in plan."""
    yaml = tmp_path / "huge.yaml"
    yaml.write_text(
        f"seq_len: 31\nseed: 7\nstages:\n  - name: s\n    epochs: 1\n    sources: {{{corpus}/web: 1}}\n"
        f"  - name: t\n    tokens: 100T\n    sources: {{{corpus}/web: 1, {corpus}/code: 1}}\n"
    )
    for args in (
        ["shuffle", "--schedule", yaml, "-o", tmp_path / "o"],
        ["plan", "shuffle", "--schedule", yaml, "-o", tmp_path / "p"],
    ):
        code, lines = cli(*args)
        assert code == 1 and len(lines) == 1, lines
        assert lines[0].startswith(f"tokpack: error: {yaml} [stages[1].tokens]: passes over one source"), lines
        assert "--samples" not in lines[0] and "lower the stage's tokens" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.yaml"]


@pytest.mark.parametrize("spelling", ["./web", "weblink"])
def test_a_stage_naming_one_source_twice_is_the_clis_line(corpus, tmp_path, spelling):
    """Issue 32: `web` and `./web` (or a symlink to web) in one stage is one source twice: the
    CLI's duplicate-source line (exit 1), in shuffle and in plan, not an IndexError (exit 70)."""
    link = corpus / "weblink"
    if not link.exists():
        link.symlink_to(corpus / "web")
    yaml = tmp_path / "dup.yaml"
    yaml.write_text(
        f"seq_len: 31\nseed: 7\nstages:\n  - name: s\n    epochs: 1\n"
        f"    sources: {{{corpus}/web: 0.5, {corpus}/{spelling}: 0.5}}\n"
    )
    for args in (
        ["shuffle", "--schedule", yaml, "-o", tmp_path / "o"],
        ["plan", "shuffle", "--schedule", yaml, "-o", tmp_path / "p"],
    ):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        assert "the same source is given twice" in res.stderr and "give each source once" in res.stderr


def test_shard_samples_given_beside_a_schedule_that_declares_it_is_refused_not_taken(corpus, tmp_path):
    """`--shard-samples 20` beside a schedule declaring `shard_samples: 50` silently won over the
    file (a run of 20-sample shards, the file saying 50). Refused in one line, naming the file,
    nothing written; the file's own value, or a file silent about it, is taken as before."""
    args = ["--schedule", corpus / "run.yaml", "--epoch", 3, "--memory", MEMORY]
    for command in (["shuffle"], ["plan", "shuffle"]):
        code, lines = cli(*command, *args, "-o", tmp_path / "a", "--shard-samples", 20)
        assert code == 1 and lines == [
            f"tokpack: error: {corpus / 'run.yaml'} [--shard-samples]: --shard-samples differs from the schedule's "
            "shard_samples; expected 50, found 20. HINT: drop --shard-samples, or change shard_samples in the schedule"
        ], lines
    assert not (tmp_path / "a").exists()
    assert cli("shuffle", *args, "-o", tmp_path / "b", "--shard-samples", 50)[0] == 0
    assert read_manifest(tmp_path / "b")["shard_samples"] == 50
    silent = corpus / "silent.yaml"  # beside the sources it names
    silent.write_text(SCHEDULE.replace("shard_samples: 50\n", ""))
    assert cli("shuffle", "--schedule", silent, "--epoch", 3, "-o", tmp_path / "c", "--shard-samples", 20)[0] == 0
    assert read_manifest(tmp_path / "c")["shard_samples"] == 20


def test_a_setting_the_schedule_declares_given_too_is_refused_not_ignored(corpus, tmp_path):
    """`--packing concat` beside a schedule whose packing is best-fit was silently ignored (concat
    could not be told from "not given"; issue 40), and the API dropped a `seq_len` given beside a
    schedule. The spec knows what was given: each is one error line, and nothing is written."""
    sched = corpus / "best-fit.yaml"  # beside the sources it names
    sched.write_text(SCHEDULE.replace("shard_samples: 50\n", "shard_samples: 50\npacking: best-fit\n"))
    code, lines = cli("shuffle", "--schedule", sched, "-o", tmp_path / "a", "--packing", "concat", "--epoch", 0)
    assert code == 1 and lines == [
        "tokpack: error: [--packing]: --packing differs from the schedule's packing; expected best-fit, "
        "found concat. HINT: drop --packing"
    ]
    with pytest.raises(TokpackError, match=r"\[--packing\]: --packing differs from the schedule's packing"):
        shuffle(None, tmp_path / "b", schedule=sched, packing="concat", epochs=[0], memory=MEMORY)
    with pytest.raises(UsageError, match=r"^--schedule declares the sources, .*; drop --seq-len$"):
        shuffle(None, tmp_path / "c", schedule=corpus / "run.yaml", seq_len=63, epochs=[0], memory=MEMORY)
    assert not any((tmp_path / d).exists() for d in "abc")
    # a schedule without `packing:` takes --packing, as before
    code, lines = cli(
        "plan",
        "shuffle",
        "--schedule",
        corpus / "run.yaml",
        "-o",
        tmp_path / "d",
        "--packing",
        "best-fit",
        "--epoch",
        0,
        "--disk-mbps",
        100,
        "--json",
    )
    assert code == 0 and json.loads(lines[-1])["epochs"][0]["packing"]["method"] == "best-fit"
