"""`tokpack shuffle` keeps its word on integrity (issue 12): it verifies the source shards it
reads, checks its own scratch files, never repeats windows without saying so, refuses inputs
that would repeat them silently, and refuses a --memory too small to be useful."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.reading import read_manifest
from tokpack.formats.shards import PackedSource
from tokpack.shuffle import run_setup, steps
from tokpack.shuffle.plan import EpochPlan, SourcePlan, epoch_plan

REPO = Path(__file__).resolve().parents[1]
L = 31  # 32-token rows
ROW_BYTES = (L + 1) * 2


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """The real command in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def dir_files(path) -> dict[str, bytes]:
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def sources(tmp_path):
    """'web' (3 shards, ~700 windows) and the much smaller 'code' (3 shards, ~190 windows)."""
    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(7), 150, 1000, 0))
    code = write_source(tmp_path / "code", random_docs(np.random.default_rng(8), 40, 1000, 0), docs_per_shard=15)
    return web, code


def edit_one_token(path: Path, where: str) -> None:
    """A same-size edit that stays inside the vocabulary (ids 1..999, EOS is 0)."""
    tokens = np.fromfile(path, dtype="<u2")
    i = {"middle": len(tokens) // 2, "first": 0, "last": len(tokens) - 1}[where]
    tokens[i] = tokens[i] % 998 + 1 if tokens[i] != 998 else 5
    tokens.tofile(path)


# ------------------------------------------------------------------ item 2: sources are verified


@pytest.mark.parametrize(
    "path,memory,extra",
    [
        ("in-memory", "1GiB", []),
        ("out-of-core", "4KiB", []),
        ("out-of-core", "8KiB", ["--workers", "2"]),  # tasks in datatrove's worker processes
    ],
)
@pytest.mark.parametrize("where", ["middle", "last"])
def test_same_size_edit_of_a_source_shard_fails_the_epoch(sources, tmp_path, path, memory, extra, where):
    web, code = sources
    victim = web / "00001.ds" if where == "middle" else web / "00002.ds"  # "last": the dropped tail, read by no window
    edit_one_token(victim, where)
    out = tmp_path / "run"
    r = cli("shuffle", web, code, "-o", out, "--seq-len", L, "--seed", 1, "--epochs", 1, "--memory", memory, *extra)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("tokpack: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(victim) in errors[0] and "changed since it was packed" in errors[0]
    recorded = next(s["xxh3_128"] for s in read_manifest(web)["shards"] if s["path"] == victim.name)
    assert f"expected {recorded}" in errors[0] and "HINT: re-pack" in errors[0]
    assert not (out / "epoch-00000" / "tokpack.json").exists() and not (out / "tokpack.json").exists()
    assert not list(out.rglob("*.rows")) and not list(out.rglob("*.ds")), "scatter output or shards left behind"
    # --json: one object on stdout, the same error
    r = cli(
        "shuffle",
        web,
        code,
        "-o",
        out,
        "--seq-len",
        L,
        "--seed",
        1,
        "--epochs",
        1,
        "--memory",
        memory,
        *extra,
        "--json",
    )
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error"]["file"] == str(victim) and doc["error"]["expected"] == recorded


def test_restored_source_then_shuffles_as_before(sources, tmp_path):
    web, code = sources
    ref = tmp_path / "ref"
    shuffle_run([str(web), str(code)], str(ref), seq_len=L, seed=1, epochs=[0], memory=4096, shard_samples=100)
    original = (web / "00001.ds").read_bytes()
    edit_one_token(web / "00001.ds", "middle")
    out = tmp_path / "run"
    with pytest.raises(TokpackError, match="changed since it was packed"):
        shuffle_run([str(web), str(code)], str(out), seq_len=L, seed=1, epochs=[0], memory=4096, shard_samples=100)
    (web / "00001.ds").write_bytes(original)
    shuffle_run([str(web), str(code)], str(out), seq_len=L, seed=1, epochs=[0], memory=4096, shard_samples=100)
    assert dir_files(out) == dir_files(ref)


def test_scatter_tasks_read_whole_shards(sources, tmp_path):
    """--tasks is capped at the shard count and every shard belongs to exactly one task."""
    web, code = sources
    srcs = [PackedSource.open(web), PackedSource.open(code)]
    plan = epoch_plan(srcs, seq_len=L, seed=1, epoch=0)
    runs = steps.split_shards(plan, srcs, 100)
    owned = [(s, k) for task in runs for s, k0, k1 in task for k in range(k0, k1)]
    assert len(runs) == 6 and sorted(owned) == [(s, k) for s in (0, 1) for k in range(3)]
    assert len(steps.split_shards(plan, srcs, 4)) == 4
    # the windows of all tasks together are every window once
    lay = steps.Layout(len(runs), np.array([0, plan.samples]), np.array([0, 1]), 64, str(tmp_path), runs)
    covered = Counter()
    for t in range(lay.tasks):
        for s, w0, w1, _, _ in steps.shard_segments(plan, srcs, lay.task_shards[t]):
            covered.update((s, w) for w in range(w0, w1))
    assert covered == Counter((s, w) for s, sp in enumerate(plan.sources) for w in range(sp.windows))


# ------------------------------------------------------------------ item 11: bucket files are checked


def test_garbled_bucket_file_is_caught_then_redone(sources, tmp_path, monkeypatch):
    """A bucket file that is not what its scatter task wrote (here: one byte flipped after the
    pass, as a crash before the page cache reached the disk could leave it) is refused by the
    order pass; the rerun redoes that scatter task and gives the reference bytes."""
    web, code = sources
    kw = dict(seq_len=L, seed=4, epochs=[0], memory=4096, shard_samples=150)
    ref = tmp_path / "ref"
    shuffle_run([str(web), str(code)], str(ref), **kw)
    out = tmp_path / "run"
    real_order = steps.OrderStep.run

    def stop(self, *a, **k):
        raise OSError("simulated crash after the scatter pass")

    monkeypatch.setattr(steps.OrderStep, "run", stop)
    with pytest.raises(TokpackError, match="simulated crash"):
        shuffle_run([str(web), str(code)], str(out), **kw)
    monkeypatch.setattr(steps.OrderStep, "run", real_order)
    victim = sorted(out.rglob("*.rows"))[0]
    raw = bytearray(victim.read_bytes())
    raw[3] ^= 0x10
    victim.write_bytes(raw)
    with pytest.raises(TokpackError, match="does not match the checksum") as err:
        shuffle_run([str(web), str(code)], str(out), **kw)
    assert str(victim) in str(err.value) and "rerun" in str(err.value)
    assert not (out / "epoch-00000" / "tokpack.json").exists()
    shuffle_run([str(web), str(code)], str(out), **kw)
    assert dir_files(out) == dir_files(ref)


# ------------------------------------------------------------------ item 5: no silent repeats


def run_json(*args) -> tuple[subprocess.CompletedProcess, dict | None]:
    r = cli("shuffle", *args, "--json")
    return r, (json.loads(r.stdout) if r.stdout.strip() else None)


def test_weight_zero_is_refused(sources, tmp_path):
    web, code = sources
    r = cli(
        "shuffle",
        f"{web}=0",
        f"{code}=1",
        "-o",
        tmp_path / "run",
        "--seq-len",
        L,
        "--seed",
        1,
        "--epochs",
        1,
        "--samples",
        500,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "weight is 0" in lines[0] and "leave the source out" in lines[0], r.stderr
    assert str(web) in lines[0]
    assert not (tmp_path / "run" / "epoch-00000").exists()


@pytest.mark.parametrize("how", ["same path", "another spelling", "a copy"])
def test_same_source_twice_is_refused(sources, tmp_path, how):
    web, _ = sources
    second = {"same path": web, "another spelling": Path(f"{web.parent}/./{web.name}/"), "a copy": tmp_path / "copy"}[
        how
    ]
    if how == "a copy":
        shutil.copytree(web, second)
    r = cli("shuffle", web, second, "-o", tmp_path / "run", "--seq-len", L, "--seed", 1, "--epochs", 1)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the same source is given twice" in lines[0], r.stderr
    assert ("fingerprint" if how == "a copy" else "path") in lines[0]
    assert not (tmp_path / "run" / "epoch-00000").exists()


def test_weights_equal_as_ratios_add_an_epoch(sources, tmp_path):
    web, code = sources
    kw = dict(seq_len=L, seed=2, samples=600, memory=1 << 30, shard_samples=200)
    full, part = tmp_path / "full", tmp_path / "part"
    shuffle_run([str(web), str(code)], str(full), weights=["7", "3"], epochs=[0, 1], **kw)
    shuffle_run([str(web), str(code)], str(part), weights=["7", "3"], epochs=[0], **kw)
    r = cli(
        "shuffle",
        f"{web}=0.7",
        f"{code}=0.3",
        "-o",
        part,
        "--seq-len",
        L,
        "--seed",
        2,
        "--epoch",
        1,
        "--samples",
        600,
        "--shard-samples",
        200,
    )
    assert r.returncode == 0, r.stderr
    assert read_manifest(part, kind="run")["weights"] == ["7", "3"]  # the run keeps one spelling
    assert dir_files(part) == dir_files(full)
    # a different ratio is still a different run
    r = cli(
        "shuffle",
        f"{web}=0.6",
        f"{code}=0.4",
        "-o",
        part,
        "--seq-len",
        L,
        "--seed",
        2,
        "--epoch",
        2,
        "--samples",
        600,
        "--shard-samples",
        200,
    )
    assert r.returncode == 1 and "different run" in r.stderr


def brute_repeats(plan: EpochPlan) -> list[int]:
    s, w, _ = plan.locate(np.arange(plan.samples))
    return [int((s == i).sum()) - len(set(w[s == i].tolist())) for i in range(len(plan.sources))]


def test_summary_counts_every_source_and_warns_per_repeated_source(sources, tmp_path):
    web, code = sources
    out = tmp_path / "run"
    r, doc = run_json(
        f"{web}=0.7",
        f"{code}=0.3",
        "-o",
        out,
        "--seq-len",
        L,
        "--seed",
        3,
        "--epochs",
        2,
        "--samples",
        1000,
        "--memory",
        "8KiB",
    )
    assert r.returncode == 0, r.stderr
    srcs = [PackedSource.open(web), PackedSource.open(code)]
    assert len(doc["epochs_detail"]) == 2
    for detail in doc["epochs_detail"]:
        plan = EpochPlan.from_manifest(read_manifest(out / f"epoch-{detail['epoch']:05d}"), srcs)
        by_name = {s["name"]: s for s in detail["sources"]}
        assert set(by_name) == {"web", "code"}
        for i, sp in enumerate(plan.sources):
            got = by_name[sp.name]
            assert (got["samples"], got["windows"], got["passes"]) == (sp.samples, sp.windows, plan.passes(i))
            assert got["fingerprint"] == srcs[i].fingerprint and got["path"] == str(srcs[i].path.resolve())
            assert got["weight"] == ["0.7", "0.3"][i]
        assert [by_name[sp.name]["repeats"] for sp in plan.sources] == brute_repeats(plan)
        assert by_name["code"]["samples"] > by_name["code"]["windows"] and by_name["code"]["repeats"] > 0
    code_lines = [w for w in doc["warnings"] if "source code " in w]
    assert len(code_lines) == 2 and all("used more than once" in w for w in code_lines), doc["warnings"]
    # human summary: the per-source lines on stdout, one warning line per repeated source and epoch on stderr
    r = cli(
        "shuffle",
        f"{web}=0.7",
        f"{code}=0.3",
        "-o",
        tmp_path / "human",
        "--seq-len",
        L,
        "--seed",
        3,
        "--epochs",
        2,
        "--samples",
        1000,
        "--memory",
        "8KiB",
    )
    assert r.returncode == 0, r.stderr
    assert sum(line.startswith('epoch 0, source "code": 300 samples') for line in r.stdout.splitlines()) == 1, r.stdout
    warnings = [line for line in r.stderr.splitlines() if line.startswith("tokpack: warning:")]
    assert warnings == [f"tokpack: warning: {w}" for w in doc["warnings"]]


def test_tokens_above_the_corpus_warn(sources, tmp_path):
    web, _ = sources
    windows = PackedSource.open(web).tokens // (L + 1)
    r, doc = run_json(
        web, "-o", tmp_path / "run", "--seq-len", L, "--seed", 1, "--epochs", 1, "--tokens", 3 * windows * L
    )
    assert r.returncode == 0, r.stderr
    (report,) = doc["epochs_detail"][0]["sources"]
    assert report["repeats"] == 2 * windows and report["passes"] == 3
    assert len(doc["warnings"]) == 1 and "web" in doc["warnings"][0]


def test_whole_corpus_epochs_do_not_warn(sources, tmp_path):
    web, code = sources
    r, doc = run_json(web, code, "-o", tmp_path / "run", "--seq-len", L, "--seed", 1, "--epochs", 3)
    assert r.returncode == 0, r.stderr
    assert doc["warnings"] == []
    assert all(s["repeats"] == 0 and s["passes"] == 1 for d in doc["epochs_detail"] for s in d["sources"])


@pytest.mark.parametrize("windows,samples", [(97, 40), (97, 60), (97, 150), (97, 200), (1000, 999), (5, 17)])
def test_repeats_is_exact(windows, samples):
    sp = SourcePlan(0, "s", "/s", "fp", None, windows * 8, 0, windows, samples, 0)
    for epoch in range(6):
        plan = EpochPlan(3, epoch, 7, False, samples, (sp,))
        assert [plan.repeats(0)] == brute_repeats(plan), epoch


# ------------------------------------------------------------------ item 7: budgets and feedback


def test_memory_below_one_useful_bucket_is_refused(sources, tmp_path):
    web, _ = sources
    floor = run_setup.min_memory(ROW_BYTES, 1)
    for memory in (0, 1, floor - 1):
        r = cli("shuffle", web, "-o", tmp_path / "run", "--seq-len", L, "--seed", 1, "--epochs", 1, "--memory", memory)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--memory {floor}" in lines[0], r.stderr
        assert not (tmp_path / "run").exists()
    r = cli("shuffle", web, "-o", tmp_path / "run", "--seq-len", L, "--seed", 1, "--epochs", 1, "--memory", floor)
    assert r.returncode == 0, r.stderr
    # per worker: two workers need twice as much
    r = cli(
        "shuffle",
        web,
        "-o",
        tmp_path / "run2",
        "--seq-len",
        L,
        "--seed",
        1,
        "--epochs",
        1,
        "--memory",
        floor,
        "--workers",
        2,
    )
    assert r.returncode == 1 and f"--memory {2 * floor}" in r.stderr


def on_a_terminal(args) -> str:
    """Runs the CLI with stderr on a pseudo-terminal; returns what it printed there."""
    leader, follower = pty.openpty()
    # a real terminal has a size; tqdm draws nothing on a 0x0 one
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.communicate()
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks)
    return b"".join(chunks).decode(errors="replace")


def test_out_of_core_passes_show_bars_on_a_terminal_but_not_under_json(sources, tmp_path):
    web, code = sources
    args = ["shuffle", web, code, "--seq-len", L, "--seed", 1, "--epochs", 1, "--memory", "4KiB"]
    shown = on_a_terminal([*args, "-o", tmp_path / "tty"])
    assert "epoch 0: scatter" in shown and "epoch 0: order" in shown, shown
    quiet = on_a_terminal([*args, "-o", tmp_path / "json", "--json"])
    assert "scatter" not in quiet and "order" not in quiet and "%" not in quiet, quiet


def test_tasks_help_speaks_of_input_ranges():
    r = CliRunner().invoke(
        __import__("tokpack.packer.cli", fromlist=["main"]).main, ["shuffle", "--help"], terminal_width=200
    )
    text = " ".join(r.output.split())
    tasks = text[text.index("--tasks") : text.index("--logging-dir")]
    assert "input range" in tasks and "input file" not in tasks, tasks
