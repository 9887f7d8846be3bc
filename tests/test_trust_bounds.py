"""The trust boundary, bounds and ownership (issue 24, items 3-5): a count a user types is
checked by arithmetic before anything its size is allocated; a command deletes only files it
wrote; the exit status says whose fault a failure is.

Every command here runs as a subprocess under an address-space limit and a timeout, as a typo
would run on a shared node: a bound checked after allocating shows as a MemoryError (an internal
error, exit 70) or a timeout, not as the one line and exit 1 asserted here."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, shuffle_run, write_source

REPO = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 3 << 30  # address space of each command: far above what any of these needs when bounded
TIMEOUT = 120  # a hang guard only; nothing is asserted about time


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def tokpack(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        preexec_fn=_limit_memory,
        env={**os.environ, **(env or {})},
    )


def refused(r: subprocess.CompletedProcess, *says: str) -> str:
    """The failure is one line with exit 1 (data or arguments), naming what `says` lists."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    # pack says first what it detected; the failure itself is the last line, and the only error
    assert [line for line in lines if "error" in line] == lines[-1:], r.stderr[-2000:]
    assert lines[-1].startswith("tokpack: error:") and all(line.startswith("tokpack ") for line in lines[:-1])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    for text in says:
        assert text in lines[-1], lines[-1]
    return lines[-1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(a packed source of 496 windows of 64 tokens, a two-epoch run shuffled from it)."""
    root = tmp_path_factory.mktemp("bounds")
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0)
    src = write_source(root / "src", docs, docs_per_shard=40)
    shuffle_run(
        [str(src)],
        str(root / "run"),
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
    return src, root / "run"


# ------------------------------------------------------------------ item 3: bounded by arithmetic


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--epochs", "0-100000000000", ["100,000,000,000", "99,999"]),  # a range is never expanded before its check
        ("--epochs", "3-5", ["epochs not in this run"]),
        ("--shards-of", "0-99999999/100000000", ["world size", "100,000,000", "1,048,576"]),
        ("--shards-of", "0-99999999/1000", ["bad --shards-of", "[0, 1000)"]),
    ],
)
def test_stage_selection_is_bounded_before_it_is_expanded(data, tmp_path, option, value, says):
    _, run = data
    refused(tokpack("stage", run, tmp_path / "dest", option, value), *says)
    assert not (tmp_path / "dest").exists()  # the lock and the folder it made are gone again


SHUFFLE = ["--seq-len", "63", "--seed", "1", "--memory", "1MiB"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--epochs", "1", "--samples", str(10**15)], ["passes over one source", "100,000"]),
        (["--epochs", "1", "--tokens", "1000T"], ["passes over one source", "15,873,015,873,015"]),
        (
            ["--epochs", "1", "--samples", str(10**7), "--shard-samples", "1"],
            ["number of output shards", "10,000,000", "1,000,000"],
        ),
        (["--epochs", str(10**12)], ["epoch count", "1,000,000,000,000", "100,000"]),
        (["--epoch", str(10**12)], ["epoch number", "99,999"]),
        # 496 windows each used 100,000+ times: the out-of-core passes would loop per repeat
        (["--epochs", "1", "--samples", str(496 * 100_001)], ["passes over one source", "100,000"]),
        # best-fit packs each pass to count its rows: 10^10 samples once ran on past a minute
        (
            ["--epochs", "1", "--samples", str(10**10), "--packing", "best-fit"],
            ["passes over one source", "100,000", "rows a pass"],
        ),
        (["--epochs", "1", "--tokens", "1000T", "--packing", "best-fit"], ["passes over one source", "100,000"]),
    ],
)
def test_shuffle_counts_are_bounded_before_allocation(data, tmp_path, args, says):
    src, _ = data
    refused(tokpack("shuffle", src, "-o", tmp_path / "out", *SHUFFLE, *args), *says)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "args, says",
    [
        (["--epochs", str(10**12)], ["epoch count"]),
        (["--epochs", "1", "--samples", str(10**7), "--shard-samples", "1"], ["number of output shards"]),
        (["--epochs", "1", "--samples", str(496 * 100_001)], ["passes over one source"]),
        (["--epochs", "1", "--samples", str(10**10), "--packing", "best-fit"], ["passes over one source"]),
    ],
)
def test_plan_shuffle_is_bounded_too(data, tmp_path, args, says):
    src, _ = data
    refused(tokpack("plan", "shuffle", src, "-o", tmp_path / "out", *SHUFFLE, "--disk-mbps", "100", *args), *says)


def _schedule(tmp_path: Path, src: Path, body: str) -> Path:
    path = tmp_path / "schedule.yaml"
    path.write_text(f"seq_len: 63\nseed: 1\nstages:\n{body.replace('SRC', str(src))}")
    return path


def test_schedule_alias_bomb_is_refused(data, tmp_path):
    src, _ = data
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [
        f"{chr(ord('b') + i)}: &{chr(ord('b') + i)} [{','.join(['*' + chr(ord('a') + i)] * 10)}]" for i in range(8)
    ]  # 10^9 strings once expanded
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(
        "\n".join(lines) + f"\nseq_len: 63\nseed: 1\nstages: [{{name: a, sources: {{{src}: 1}}, epochs: 1}}]\n"
    )
    refused(tokpack("shuffle", "--schedule", bomb, "-o", tmp_path / "out", "--memory", "1MiB"), "alias", "line 2")


@pytest.mark.parametrize(
    "body, says",
    [
        ("  - {name: a, sources: {SRC: 1}, epochs: 1000000000000}\n", ["epoch count", "100,000"]),
        ("".join(f"  - {{name: s{i}, sources: {{SRC: 1}}, epochs: 1000}}\n" for i in range(101)), ["epoch count"]),
        ("  - {name: a, sources: {SRC: 1}, tokens: 1000T}\n", ["passes over one source"]),
    ],
    ids=["epochs-10^12", "101-stages-of-1000-epochs", "tokens-1000T"],
)
def test_schedule_sizes_are_bounded(data, tmp_path, body, says):
    src, _ = data
    refused(
        tokpack("shuffle", "--schedule", _schedule(tmp_path, src, body), "-o", tmp_path / "out", "--memory", "1MiB"),
        *says,
    )


def test_huge_schedule_file_is_not_read_whole(data, tmp_path):
    src, _ = data
    path = _schedule(tmp_path, src, "  - {name: a, sources: {SRC: 1}, epochs: 1}\n")
    with open(path, "a") as f:
        f.write("#" * (2 << 20) + "\n")
    refused(tokpack("shuffle", "--schedule", path, "-o", tmp_path / "out"), "schedule file size", "1,048,576")


@pytest.mark.parametrize(
    "args",
    [
        ["--start-sample", str(10**18)],
        ["--world-size", str(10**12), "--rank", "5"],
        ["--micro-batch", str(10**12)],
    ],
)
def test_read_positions_beyond_the_run_are_refused(data, args):
    _, run = data
    refused(tokpack("read", run, *args))


def test_read_count_is_a_limit_not_an_allocation(data):
    _, run = data
    r = tokpack("read", run, "--count", str(10**18))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2 * 496  # every sample of both epochs, then the end of the run


def test_plan_warns_when_an_in_memory_epoch_exceeds_this_machines_ram(tmp_path):
    """--memory above the RAM picks the in-memory path for an epoch no machine holds (22 TB)."""
    source = "virtual:tokens=11T,documents=5.5B,dtype=uint16"
    args = [
        "plan",
        "shuffle",
        source,
        "-o",
        tmp_path / "out",
        "--seq-len",
        "2047",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--disk-mbps",
        "100",
        "--json",
    ]
    big = tokpack(*args, "--memory", "1000T")
    assert big.returncode == 0, big.stderr
    plan = json.loads(big.stdout)
    assert plan["epochs"][0]["path"] == "in-memory"
    [warning] = plan["warnings"]
    assert "more than this machine's" in warning and "RAM" in warning and "--memory below" in warning
    small = tokpack(*args, "--memory", "4GiB")  # out of core: within any machine
    assert small.returncode == 0, small.stderr
    assert "warnings" not in json.loads(small.stdout)


def test_plan_pack_sizes_a_manifest_of_tiny_shards_without_listing_them(tmp_path):
    """--shard-tokens 1 over 10^7 tokens: the plan sized a manifest of 10^7 entries by building them."""
    np.save(tmp_path / "tokens.npy", np.ones(10**7, dtype=np.uint16))
    r = tokpack(
        "plan",
        "pack",
        tmp_path / "tokens.npy",
        "-o",
        tmp_path / "out",
        *PACK,
        "--shard-tokens",
        "1",
        "--disk-mbps",
        "100",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["shards"] == 10**7 and plan["manifests"]["tokpack.json"] > 10**7 * 200


# ------------------------------------------------------------------ item 4: own files only


def test_shuffle_refuses_a_user_file_in_an_epoch_folder_before_writing(data, tmp_path):
    src, _ = data
    out = tmp_path / "run"
    (out / "epoch-00000").mkdir(parents=True)
    (out / "epoch-00000" / "notes.txt").write_text("mine")
    line = refused(tokpack("shuffle", src, "-o", out, *SHUFFLE, "--epochs", "1"), "notes.txt", "tokpack did not write")
    assert str(out / "epoch-00000" / "notes.txt") in line
    assert (out / "epoch-00000" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.rglob("*")) == ["epoch-00000", "notes.txt"]  # nothing written


def _jsonl(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(
        "".join(json.dumps({"input_ids": rng.integers(1, 1000, 20).tolist() + [0]}) + "\n" for _ in range(rows))
    )
    return path


PACK = ["--eos-id", "0", "--vocab-size", "1000"]


@pytest.mark.parametrize(
    "name, folder",
    [
        ("notes.ds", True),  # named like a shard, but a user's folder: main deleted it recursively
        ("mine.ds.index", False),  # a shard suffix on a name tokpack never gives
        ("draft.tmp-v2", False),  # the temporary mark, but not tokpack's FINAL.tmp-PID-HEX
    ],
)
def test_pack_overwrite_replaces_only_its_own_files(tmp_path, name, folder):
    out = tmp_path / "out"
    assert tokpack("pack", _jsonl(tmp_path / "a.jsonl", 30, 1), "-o", out, *PACK).returncode == 0
    user = out / name
    if folder:
        user.mkdir()
        (user / "keep.txt").write_text("mine")
    else:
        user.write_text("mine")
    r = tokpack("pack", _jsonl(tmp_path / "b.jsonl", 30, 2), "-o", out, *PACK, "--overwrite")
    refused(r, name, "other files")
    assert (user / "keep.txt" if folder else user).read_text() == "mine"
    assert json.loads((out / "tokpack.json").read_text())["inputs"][0]["path"].endswith("a.jsonl")  # untouched


def test_a_folder_named_like_a_lock_temporary_is_left_alone(data, tmp_path):
    src, _ = data
    out = tmp_path / "run"
    stray = out / ".tokpack.lock.tmp-999999999-notes"
    stray.mkdir(parents=True)
    (stray / "keep.txt").write_text("mine")
    r = tokpack("shuffle", src, "-o", out, *SHUFFLE, "--epochs", "1")
    assert r.returncode == 0, r.stderr
    assert (stray / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "folder and a file in it"])
def test_pack_refuses_the_same_input_twice(tmp_path, how):
    folder = tmp_path / "in"
    folder.mkdir()
    a = _jsonl(folder / "a.jsonl", 10, 1)
    _jsonl(folder / "b.jsonl", 10, 2)
    if how == "same path":
        args = [a, a]
    elif how == "symlink":
        (tmp_path / "link.jsonl").symlink_to(a)
        args = [a, tmp_path / "link.jsonl"]
    elif how == "hard link":
        os.link(a, tmp_path / "hard.jsonl")
        args = [tmp_path / "hard.jsonl", a]
    else:
        args = [folder, a]
    line = refused(tokpack("pack", *args, "-o", tmp_path / "out", *PACK), "given twice")
    assert repr(str(args[0])) in line and repr(str(args[1])) in line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ item 5: exit codes mean one thing


@pytest.mark.parametrize(
    "content",
    [b"garbage", b"[1, 2]", b'"text"', b'{"host": "HOST", "pid": [1]}', b""],
    ids=["not-json", "a-list", "a-string", "pid-of-wrong-type", "empty"],
)
def test_a_lock_that_names_no_holder_is_one_line_with_how_to_clear_it(data, tmp_path, content):
    import socket

    src, _ = data
    out = tmp_path / "run"
    out.mkdir()
    lock = out / "tokpack.lock"
    lock.write_bytes(content.replace(b"HOST", socket.gethostname().encode()))
    line = refused(tokpack("shuffle", src, "-o", out, *SHUFFLE, "--epochs", "1"), "names no command", f"delete {lock}")
    assert "None" not in line
    assert lock.exists() and sorted(p.name for p in out.iterdir()) == ["tokpack.lock"]  # not taken, nothing written


def test_a_damaged_pack_work_record_is_one_line_and_overwrite_replaces_it(tmp_path):
    out = tmp_path / "out"
    (out / ".tokpack-work").mkdir(parents=True)
    (out / ".tokpack-work" / "request.json").write_text('{"inputs": [')
    src = _jsonl(tmp_path / "a.jsonl", 10, 1)
    refused(tokpack("pack", src, "-o", out, *PACK), "damaged .tokpack-work/request.json", "--overwrite")
    r = tokpack("pack", src, "-o", out, *PACK, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert tokpack("validate", out).returncode == 0


DEAD_STORE = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_MAX_ATTEMPTS": "1",
}  # nothing listens on port 1


@pytest.mark.parametrize("command", ["shuffle", "pack", "validate --against"])
def test_an_unreachable_store_is_exit_1_not_a_bug(data, tmp_path, command):
    require("s3fs", "pip install s3fs")
    src, run = data
    args = {
        "shuffle": ["shuffle", "s3://nowhere/src", "-o", tmp_path / "out", *SHUFFLE, "--epochs", "1"],
        "pack": ["pack", "s3://nowhere/a.jsonl", "-o", tmp_path / "out", *PACK],
        "validate --against": ["validate", run / "epoch-00000", "--against", "s3://nowhere/src"],
    }[command]
    refused(tokpack(*args, env=DEAD_STORE), "s3://nowhere/", "AWS_ENDPOINT_URL")


def test_a_damaged_work_record_in_the_bucket_is_one_line(s3_bucket, tmp_path):
    """A URL output keeps its records of work in the store (`.tokpack-work/request.json`): a
    damaged one is the data's fault, exit 1, and --overwrite replaces it."""
    fs, bucket = s3_bucket
    out = f"s3://{bucket}/out"
    fs.pipe(f"{bucket}/out/.tokpack-work/request.json", b"\x00not json")
    src = _jsonl(tmp_path / "a.jsonl", 10, 1)
    scratch = ["--scratch", tmp_path / "scratch"]
    refused(tokpack("pack", src, "-o", out, *PACK, *scratch), "damaged .tokpack-work/request.json")
    r = tokpack("pack", src, "-o", out, *PACK, *scratch, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.loads(fs.cat(f"{bucket}/out/tokpack.json"))["kind"] == "source"


@pytest.mark.parametrize(
    "args",
    [["--ranks", "0-99999999", "--world-size", "100000000"], ["--node", "0/2", "--ranks-per-node", "300"]],
    ids=["ranks", "node"],
)
def test_a_node_slice_of_too_many_ranks_is_refused_before_writing(tmp_path, args):
    """A slice writes one file per rank at once: 10^8 ranks ran out of open files after writing
    ~20,000 temporaries. The count is refused by arithmetic, and nothing is written."""
    import subprocess
    import sys

    dest = tmp_path / "slice"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokpack.packer.cli",
            "stage",
            str(tmp_path / "no-run"),
            str(dest),
            *args,
            "--micro-batch",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
    )
    lines = [x for x in r.stderr.splitlines() if x.startswith("tokpack")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "ranks in one node slice is too large" in lines[0] and "at most 256" in lines[0], lines[0]
    assert not dest.exists()


@pytest.mark.parametrize(
    "args,said",
    [
        (["--ranks", "0", "--world-size", str(10**15), "--micro-batch", "1"], "world size is too large"),
        (
            ["--ranks", "0-1", "--world-size", "4", "--micro-batch", str(10**15)],
            "samples in a global batch (W*m) is too large",
        ),
    ],
    ids=["world-size", "micro-batch"],
)
def test_a_node_slice_of_an_impossible_global_batch_is_refused_before_writing(tmp_path, args, said):
    """--micro-batch 10^15 once asked numpy for 14 PiB (exit 70): W and W*m are refused by
    arithmetic before the run is opened, and nothing is written."""
    import subprocess
    import sys

    dest = tmp_path / "slice"
    r = subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", "stage", str(tmp_path / "no-run"), str(dest), *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
    )
    lines = [x for x in r.stderr.splitlines() if x.startswith("tokpack")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert said in lines[0] and "HINT" in lines[0], lines[0]
    assert not dest.exists()
