"""Durability and hygiene (issue 12, items 11 and 12): readers that own their buffers, writers
that leak no descriptor, stage manifests made durable, URL weights, and small user-facing fixes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import EOS_TOKEN, random_docs, write_source
from tokpack.formats.inputs.discover import discover, read_blocks
from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.constants import MANIFEST

REPO = Path(__file__).resolve().parents[1]


def tokpack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True
    )


# ------------------------------------------------------------------ read_blocks owns its buffers


def _documents(blocks) -> list[list[int]]:
    docs = []
    for b in blocks:
        start = 0
        for end in b.ends.tolist():
            docs.append(b.tokens[start:end].tolist())
            start = end
    return docs


def test_two_live_read_blocks_generators_do_not_share_buffers(tmp_path):
    """Two generators read in lockstep, each block kept until both have moved on: with one
    process-wide buffer per role, the second reader overwrote the first one's blocks."""
    a = write_source(tmp_path / "a", random_docs(np.random.default_rng(1), 80, 1000, 0), docs_per_shard=80)
    b = write_source(tmp_path / "b", random_docs(np.random.default_rng(2), 80, 1000, 0), docs_per_shard=80)
    (fa,) = discover([str(a / "00000.ds")], "datatrove")[1]
    (fb,) = discover([str(b / "00000.ds")], "datatrove")[1]
    want_a = _documents(read_blocks(fa, 0, block_bytes=512))
    want_b = _documents(read_blocks(fb, 0, block_bytes=512))
    ga, gb = read_blocks(fa, 0, block_bytes=512), read_blocks(fb, 0, block_bytes=512)
    got_a, got_b = [], []
    while True:
        ba, bb = next(ga, None), next(gb, None)
        if ba is None and bb is None:
            break
        # both blocks are alive here: each generator's read-ahead must not land in the other's block
        got_a += _documents([ba] if ba is not None else [])
        got_b += _documents([bb] if bb is not None else [])
    assert len(want_a) == 80 and got_a == want_a
    assert len(want_b) == 80 and got_b == want_b


# ------------------------------------------------------------------ no fd leak in the shard writers


LEAK_PROBE = textwrap.dedent("""
    import fcntl, mmap, os, resource, sys  # imported now: importing them later needs a descriptor
    import numpy as np
    from tokpack.formats.shards import EpochShardWriter, SourceShardWriter

    out = sys.argv[1]
    make = {
        "source": lambda: SourceShardWriter(out, "00000.ds", np.dtype("<u2"), "tok", with_loss=True),
        "epoch": lambda: EpochShardWriter(out, "00000.ds", np.dtype("<u2"), 7, 0, "tok"),
    }[sys.argv[2]]
    opened = int(sys.argv[3])  # files the writer may open before the next open fails
    before = len(os.listdir("/proc/self/fd"))
    free = os.open("/dev/null", os.O_RDONLY)  # the lowest free descriptor: the next one handed out
    os.close(free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (free + opened, hard))
    try:
        make()
    except OSError as e:
        print("failed", e.errno)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("leaked", len(os.listdir("/proc/self/fd")) - before)
""")


@pytest.mark.parametrize("kind, opened", [("source", 1), ("source", 2), ("epoch", 1), ("epoch", 2)])
def test_shard_writer_leaks_nothing_when_a_later_file_fails_to_open(tmp_path, kind, opened):
    """A real EMFILE on the writer's second or third file: the files it had opened are closed
    and their temporaries removed."""
    r = subprocess.run(
        [sys.executable, "-c", LEAK_PROBE, str(tmp_path), kind, str(opened)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert "failed 24" in r.stdout, r.stdout  # EMFILE: the open after `opened` files failed
    assert "leaked 0" in r.stdout, r.stdout
    assert not [p.name for p in tmp_path.iterdir() if TMP_MARK in p.name]


# ------------------------------------------------------------------ stage fsyncs the directory


def test_stage_fsyncs_each_directory_after_its_manifest(tmp_path):
    """Traced with strace: every tokpack.json stage renames into place is followed by an fsync
    of its directory, so the manifest (what makes the copy complete) survives a power loss."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    from conftest import shuffle_run

    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 60, 1000, 0), docs_per_shard=20)
    shuffle_run(
        [str(src)], str(tmp_path / "run"), seq_len=31, seed=1, epochs=[0, 1], shard_samples=50, memory=8 << 20, log=None
    )
    dest = tmp_path / "dest"
    trace = tmp_path / "trace.txt"
    r = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            str(trace),
            "-e",
            "trace=openat,rename,renameat,renameat2,fsync,fdatasync,close",
            sys.executable,
            "-m",
            "tokpack.packer.cli",
            "stage",
            str(tmp_path / "run"),
            str(dest),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    fds: dict[str, str] = {}  # fd -> path it was opened on (fds are shared by the threads)
    pending: set[str] = set()  # directories whose manifest was renamed in and not yet fsync'd
    renamed = []
    for line in trace.read_text().splitlines():
        if m := re.search(r'openat\(AT_FDCWD, "([^"]+)", [^)]*\) = (\d+)', line):
            fds[m.group(2)] = os.path.normpath(m.group(1))
        elif m := re.search(r'rename(?:at2?)?\((?:AT_FDCWD, )?"[^"]+", (?:AT_FDCWD, )?"([^"]+)"', line):
            if m.group(1).endswith("/" + MANIFEST):
                renamed.append(m.group(1))
                pending.add(os.path.dirname(os.path.normpath(m.group(1))))
        elif m := re.search(r"\bfsync\((\d+)\)\s+=\s+0", line):
            pending.discard(fds.get(m.group(1), ""))
    assert len(renamed) == 3, renamed  # two epochs and the run
    assert not pending, f"renamed a manifest into these directories and never fsync'd them: {pending}"


# ------------------------------------------------------------------ URL sources with weights


def test_url_source_with_a_fractional_weight(tmp_path):
    """memory://bucket/web=1/3 is the source memory://bucket/web with weight 1/3, as a local
    path=1/3 is; it used to be staged as a path named 'web=1/3'."""
    import fsspec

    from tokpack.packer.cli import main

    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(1), 60, 1000, 0))
    code = write_source(tmp_path / "code", random_docs(np.random.default_rng(2), 60, 1000, 0))
    fs = fsspec.filesystem("memory")
    for p in web.iterdir():
        fs.pipe(f"/hygiene-weights/web/{p.name}", p.read_bytes())
    try:
        r = CliRunner().invoke(
            main,
            [
                "shuffle",
                "memory://hygiene-weights/web=1/3",
                f"{code}=2/3",
                "-o",
                str(tmp_path / "run"),
                "--seq-len",
                "15",
                "--seed",
                "1",
                "--epochs",
                "1",
                "--samples",
                "300",
                "--json",
            ],
        )
    finally:
        fs.rm("/hygiene-weights", recursive=True)
    assert r.exit_code == 0, r.output
    run = json.loads((tmp_path / "run" / MANIFEST).read_text())
    assert [s["name"] for s in run["sources"]] == ["web", "code"]
    epoch = json.loads((tmp_path / "run/epoch-00000" / MANIFEST).read_text())
    assert [s["samples"] for s in epoch["sources"]] == [100, 200]


# ------------------------------------------------------------------ item 12: smaller ones


def test_stage_errors_never_print_expected_none(tmp_path):
    """An unparsable manifest: the error knows what it found, not what it expected, and says
    only what it knows."""
    src = tmp_path / "src"
    src.mkdir()
    (src / MANIFEST).write_text("{ not json")
    r = tokpack("stage", src, tmp_path / "dest")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert "not valid JSON" in line and "found 10 bytes" in line
    assert "None" not in line


def test_readme_pack_example_runs_as_written(tmp_path):
    """The README's `tokpack pack` line, run on a datatrove folder written by datatrove whose
    tokenizer is no longer where its metadata says (the usual case on a training cluster);
    only the paths are changed."""
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    readme = (REPO / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("tokpack pack ")]
    args = shlex.split(line)[2:]
    # a GPT-2-sized word-level tokenizer, so the README's ids are this corpus's ids
    words = [f"w{i}" for i in range(50255)]
    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, EOS_TOKEN: 50256}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS_TOKEN])
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    rng = np.random.default_rng(0)
    (tmp_path / "text").mkdir()
    with open(tmp_path / "text/part0.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 30)))), "id": str(i)}) + "\n")
    tokenized = tmp_path / "tokenized"
    DocumentTokenizer(str(tokenized), tokenizer_name_or_path=str(tok_path), eos_token=EOS_TOKEN).run(
        JsonlReader(str(tmp_path / "text")).run(None, 0, 1), rank=0, world_size=1
    )
    tok_path.unlink()  # tokenized elsewhere: the metadata names a file this machine does not have
    paths = {"/data/tokenized/": str(tokenized), "/data/packed/web": str(tmp_path / "packed/web")}
    r = tokpack("pack", *[paths.get(a, a) for a in args], "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["documents"] == 40 and summary["eos_id"] == 50256 and summary["dtype"] == "uint16"
    assert tokpack("validate", tmp_path / "packed/web").returncode == 0


def test_pack_says_when_it_widens_to_uint32(tmp_path):
    """int32 Parquet without --vocab-size: stored as uint32, said in one line with a hint, and
    listed under "warnings" in --json; with --vocab-size it is uint16 and nothing is said."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 500, int(rng.integers(1, 50))), 0).astype(np.int32) for _ in range(30)]
    pq.write_table(pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))}), tmp_path / "in.parquet")

    human = tokpack("pack", tmp_path / "in.parquet", "-o", tmp_path / "a", "--eos-id", "0")
    assert human.returncode == 0, human.stderr
    said = [x for x in human.stderr.splitlines() if "uint32" in x]
    assert len(said) == 1 and "--vocab-size" in said[0] and "HINT" in said[0], human.stderr
    from tokpack.packer.cli import main

    # the --json summaries through click's runner in this process (the line above is the process's)
    as_json = CliRunner().invoke(
        main, ["pack", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "b"), "--eos-id", "0", "--json"]
    )
    assert as_json.exit_code == 0, as_json.output
    summary = json.loads(as_json.stdout)
    assert summary["dtype"] == "uint32"
    (warning,) = summary["warnings"]
    assert "uint32" in warning and "--vocab-size" in warning
    narrow = CliRunner().invoke(
        main,
        [
            "pack",
            str(tmp_path / "in.parquet"),
            "-o",
            str(tmp_path / "c"),
            "--eos-id",
            "0",
            "--vocab-size",
            "500",
            "--json",
        ],
    )
    assert narrow.exit_code == 0, narrow.output
    summary = json.loads(narrow.stdout)
    assert summary["dtype"] == "uint16" and summary["warnings"] == []
