"""Object stores (issue 15): a real S3 API (moto's server on 127.0.0.1) through s3fs, found the
standard way (AWS_ENDPOINT_URL and the AWS credential variables)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import EOS_TOKEN, S3_ENV, random_docs, start_s3_server, write_source
from tokpack.formats.constants import MANIFEST
from tokpack.packer import ExecutorConfig, pack, shuffle, stage, validate
from test_pack import dt_tokenize, varied_docs, write_text_jsonl


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_paths(files: dict[str, bytes]) -> dict[str, object]:
    """Shard bytes as they are; manifests with each source's `path` (the directory as given:
    a URL here, a local path there) left out."""
    out = {}
    for name, data in files.items():
        if name.endswith(MANIFEST):
            m = json.loads(data)
            for s in m.get("sources") or []:
                s.pop("path", None)
            out[name] = m
        else:
            out[name] = data
    return out


def upload(fs, local: Path, url: str) -> None:
    fs.put(str(local), url.removeprefix("s3://"), recursive=True)


def cli(*args, env=None, check=False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=check,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error line of a command that failed with exit 1 (progress lines aside), no traceback."""
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tokpack: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_pack_shuffle_stage_validate_through_a_bucket_equals_local(s3_bucket, tokenizer_path, tmp_path):
    """datatrove's tokenizer writes into the bucket; pack from it, shuffle into it, stage the run
    back and validate: the same bytes as the same steps on local paths."""
    fs, bucket = s3_bucket
    write_text_jsonl(tmp_path / "text", files=2, docs=80)
    dt_tokenize(tmp_path / "text", tmp_path / "tokenized", tokenizer_path, seed=3)
    dt_tokenize(tmp_path / "text", f"s3://{bucket}/tokenized", tokenizer_path, seed=3)
    assert sorted(Path(p).name for p in fs.ls(f"{bucket}/tokenized")) == sorted(
        p.name for p in (tmp_path / "tokenized").iterdir()
    )

    pack(tmp_path / "tokenized", tmp_path / "packed", tokenizer=str(tokenizer_path))
    pack(f"s3://{bucket}/tokenized", f"s3://{bucket}/packed", tokenizer=str(tokenizer_path))
    args = dict(seq_len=31, seed=5, epochs=2, shard_samples=40)
    shuffle(tmp_path / "packed", tmp_path / "run", **args)
    shuffle(f"s3://{bucket}/packed", f"s3://{bucket}/run", **args)

    stage(f"s3://{bucket}/run", tmp_path / "staged", workers=3)
    assert validate(tmp_path / "staged").ok
    assert without_paths(tree(tmp_path / "staged")) == without_paths(tree(tmp_path / "run"))
    run = json.loads((tmp_path / "staged" / MANIFEST).read_text())
    assert [s["path"] for s in run["sources"]] == [f"s3://{bucket}/packed"]  # as given, not a temporary copy


@pytest.fixture
def bucket_run(s3_bucket, tmp_path):
    """A packed source and a two-epoch run of it, made locally and uploaded: (fs, bucket, run dir)."""
    fs, bucket = s3_bucket
    docs = random_docs(np.random.default_rng(11), 400, 1000, 0)
    src = write_source(tmp_path / "src", docs, docs_per_shard=100)
    shuffle(src, tmp_path / "run", seq_len=63, seed=2, epochs=2, shard_samples=150)
    upload(fs, tmp_path / "run", f"s3://{bucket}/run")
    return fs, bucket, tmp_path / "run"


def test_stage_reads_large_objects_in_parallel_ranges(bucket_run, tmp_path, monkeypatch):
    """Files larger than a range are fetched as ranged reads, several at once, and still
    hashed in order: the copy is byte-identical and verified."""
    from tokpack.packer.staging import RANGES_IN_FLIGHT, stage as stage_copy
    from tokpack.packer.stage_plan import Source

    fs, bucket, run = bucket_run
    block = 4096
    span = block // RANGES_IN_FLIGHT
    ranges, real = [], Source.read_range
    monkeypatch.setattr(
        Source, "read_range", lambda self, rel, a, b: ranges.append((rel, a, b)) or real(self, rel, a, b)
    )
    result = stage_copy(f"s3://{bucket}/run", tmp_path / "staged", workers=3, block=block)
    assert tree(tmp_path / "staged") == tree(run)
    big = {str(p.relative_to(run)): p.stat().st_size for p in run.rglob("*.ds") if p.stat().st_size > span}
    assert big and {rel for rel, _, _ in ranges} >= set(big)
    for rel, size in big.items():  # every byte of each large shard, in span-sized ranges
        assert sorted((a, b) for r, a, b in ranges if r == rel) == [
            (a, min(size, a + span)) for a in range(0, size, span)
        ]
    assert result.copied_files == len(list(run.rglob("*.ds*"))) and result.bytes_copied > 0
    assert validate(tmp_path / "staged").ok


def test_a_short_ranged_read_is_refused_and_nothing_half_written_is_kept(bucket_run, tmp_path, monkeypatch):
    """A ranged read that returns fewer bytes than asked (the object shrank after its size was
    checked, or a store cut the response short) is refused where it happens, before its bytes
    are hashed or written: one line naming the object, its recorded size and how far the bytes
    came, not a checksum mismatch after the fact. The object's copy is neither committed nor
    left as a temporary, and its epoch and the run get no manifest at DEST."""
    from tokpack.formats.io.writes import TMP_MARK
    from tokpack.formats.errors import TokpackError
    from tokpack.packer.staging import RANGES_IN_FLIGHT, stage as stage_copy
    from tokpack.packer.stage_plan import SOURCE_HINT, Source

    fs, bucket, run = bucket_run
    block = 4096
    span, victim, cut = block // RANGES_IN_FLIGHT, "epoch-00000/00000.ds", 5
    size = (run / victim).stat().st_size
    assert size > 2 * span  # the second range is a whole span
    real = Source.read_range

    def second_range_short(self, rel: str, a: int, b: int) -> bytes:
        data = real(self, rel, a, b)
        return data[:-cut] if (rel, a) == (victim, span) else data

    monkeypatch.setattr(Source, "read_range", second_range_short)
    dest = tmp_path / "staged"
    with pytest.raises(TokpackError) as err:
        stage_copy(f"s3://{bucket}/run", dest, workers=2, block=block)
    e = err.value
    assert (e.message, e.file, e.where, e.expected, e.found, e.hint) == (
        "file size does not match the manifest",
        f"s3://{bucket}/run/{victim}",
        "size",
        f"{size} bytes",
        f"{2 * span - cut} bytes or fewer",
        SOURCE_HINT,
    ), str(e)
    assert "\n" not in str(e)
    assert not (dest / victim).exists()
    assert not [p for p in dest.rglob("*") if TMP_MARK in p.name]
    assert not (dest / "epoch-00000" / MANIFEST).exists() and not (dest / MANIFEST).exists()


def test_stage_killed_midway_then_rerun_is_identical(bucket_run, tmp_path):
    fs, bucket, run = bucket_run
    dest = tmp_path / "staged"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokpack.packer.cli", "stage", f"s3://{bucket}/run", str(dest), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    while proc.poll() is None and not any(dest.rglob("*.ds")):  # the first verified shard is in place
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed"
    assert not (dest / MANIFEST).exists()  # a killed stage never looks complete
    rerun = cli("stage", f"s3://{bucket}/run", str(dest), "--json")
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["skipped_files"] >= 1  # what the killed stage verified is not fetched again
    assert tree(dest) == tree(run)


def test_corrupted_object_is_caught_by_stage(bucket_run, tmp_path):
    fs, bucket, run = bucket_run
    key = f"{bucket}/run/epoch-00001/00000.ds"
    data = bytearray(fs.cat(key))
    data[len(data) // 2] ^= 0x01  # one bit of one token
    fs.pipe(key, bytes(data))
    line = one_line_error(cli("stage", f"s3://{bucket}/run", str(tmp_path / "staged")))
    assert f"s3://{bucket}/run/epoch-00001/00000.ds" in line and "checksum mismatch" in line and "HINT" in line
    assert not (tmp_path / "staged" / MANIFEST).exists()
    assert not (tmp_path / "staged" / "epoch-00001" / MANIFEST).exists()
    assert not (tmp_path / "staged" / "epoch-00001" / "00000.ds").exists()


def test_missing_bucket_and_wrong_endpoint_are_one_line(s3_endpoint, tmp_path):
    line = one_line_error(cli("stage", "s3://no-such-bucket-here/run", str(tmp_path / "a")))
    assert "s3://no-such-bucket-here/run" in line
    closed = f"http://127.0.0.1:{_closed_port()}"
    line = one_line_error(
        cli("stage", "s3://any/run", str(tmp_path / "b"), env={"AWS_ENDPOINT_URL": closed, "AWS_MAX_ATTEMPTS": "1"})
    )
    assert "s3://any/run" in line and "cannot read the source" in line
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_denied_access_is_one_line_and_never_shows_the_secret(tmp_path):
    """A server that checks credentials (moto with IAM enforced) refusing ours."""
    proc, url = start_s3_server(INITIAL_NO_AUTH_ACTION_COUNT="0")
    try:
        secret = "s3cr3t-never-printed"
        env = {**S3_ENV, "AWS_ENDPOINT_URL": url, "AWS_SECRET_ACCESS_KEY": secret}
        result = cli("stage", "s3://locked/run", str(tmp_path / "dst"), env=env)
        line = one_line_error(result)
        assert "s3://locked/run" in line
        assert secret not in result.stderr + result.stdout
        result = cli("stage", "s3://locked/run", str(tmp_path / "dst"), "--json", env=env)
        assert result.returncode == 1 and secret not in result.stderr + result.stdout
        assert json.loads(result.stdout)["ok"] is False
    finally:
        proc.terminate()
        proc.wait(60)  # a bound on a hang: a loaded machine may take seconds


def test_reading_commands_give_one_line_for_missing_unreachable_and_denied(s3_endpoint, tmp_path):
    """pack, validate and inspect of a URL, pack and shuffle to a URL: a missing bucket, an
    endpoint nobody answers at and a refused access each give one line naming the URL, exit 1,
    never the secret, and nothing is left in the scratch folder."""
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(1), 50, 1000, 0))
    (tmp_path / "scratch").mkdir()
    scratch = ["--scratch", str(tmp_path / "scratch")]
    closed = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "AWS_MAX_ATTEMPTS": "1"}
    proc, url = start_s3_server(INITIAL_NO_AUTH_ACTION_COUNT="0")
    secret = "s3cr3t-never-printed"
    denied = {**S3_ENV, "AWS_ENDPOINT_URL": url, "AWS_SECRET_ACCESS_KEY": secret}
    try:
        for env, found in (
            (None, ("no such",)),
            (closed, ("cannot read from the object store", "EndpointConnectionError")),
            (denied, ("Forbidden",)),
        ):
            for command in (
                ["pack", "s3://no-such-bucket-here/d", "-o", str(tmp_path / "out")],
                ["validate", "s3://no-such-bucket-here/d"],
                ["inspect", "s3://no-such-bucket-here/d"],
                ["pack", str(src), "-o", "s3://no-such-bucket-here/d", *scratch],
                [
                    "shuffle",
                    str(src),
                    "-o",
                    "s3://no-such-bucket-here/d",
                    "--seq-len",
                    "7",
                    "--seed",
                    "1",
                    "--epochs",
                    "1",
                    *scratch,
                ],
            ):
                result = cli(*command, env=env)
                line = (
                    one_line_error(result)
                    if "tokpack: error" in result.stderr
                    else next(x for x in result.stderr.splitlines() if x.startswith("MISSING s3://"))
                )  # validate's report
                assert result.returncode == 1 and "s3://no-such-bucket-here/d" in line, (command, result.stderr)
                assert any(f in line for f in found) and secret not in result.stdout + result.stderr, (command, line)
    finally:
        proc.terminate()
        proc.wait(60)  # a bound on a hang: a loaded machine may take seconds
    assert not (tmp_path / "out").exists() and not any((tmp_path / "scratch").iterdir())


def _closed_port() -> int:
    from conftest import _free_port

    return _free_port()  # nothing listens there once the probe socket is closed


def test_validate_reads_a_bucket(bucket_run, tmp_path):
    """validate of an s3:// run and source, read in place: OK when good; one byte changed in
    an object is its checksum line, naming the URL."""
    fs, bucket, run = bucket_run
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    for d in ("run", "src"):
        result = cli("validate", f"s3://{bucket}/{d}", "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert report["ok"] and report["files"] == len(list((tmp_path / d).rglob("*.ds*"))) + len(
            list((tmp_path / d).rglob(MANIFEST))
        )
        assert report["bytes"] == sum(
            p.stat().st_size for p in (tmp_path / d).rglob("*") if p.is_file() and p.name != "tokpack-stage.json"
        )
    key = f"{bucket}/run/epoch-00001/00001.ds"
    data = bytearray(fs.cat(key))
    data[len(data) // 3] ^= 0x01
    fs.pipe(key, bytes(data))
    shutil.copytree(run, tmp_path / "bad")
    (tmp_path / "bad" / "epoch-00001" / "00001.ds").write_bytes(bytes(data))
    remote, local = cli("validate", f"s3://{bucket}/run", "--json"), cli("validate", str(tmp_path / "bad"), "--json")
    assert remote.returncode == 1 and local.returncode == 1
    problems = json.loads(remote.stdout)["problems"]
    # the shard's row hashes vouch for it: the row the byte is in is named, on the bucket's file
    assert ("row ", "checksum mismatch") in [
        (p["where"][:4], p["message"]) for p in problems if p["file"] == f"s3://{key}"
    ], problems
    assert json.dumps(problems) == json.dumps(json.loads(local.stdout)["problems"]).replace(
        str(tmp_path / "bad"), f"s3://{bucket}/run"
    )


def test_validate_against_sources_in_the_bucket(bucket_run, tmp_path):
    """validate --against s3://SOURCE (the docs' CI step, for sources in a bucket) proves the
    epochs, with or without a trailing slash; a source shuffled from its URL and replaced there
    since is named as changed at that URL. It was an internal error (a URL is no pathlib path)."""
    fs, bucket, run = bucket_run
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    for against in (f"s3://{bucket}/src", f"s3://{bucket}/src/"):
        result = cli("validate", f"s3://{bucket}/run", "--against", against, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        assert json.loads(result.stdout)["ok"] is True
    shuffle(f"s3://{bucket}/src", tmp_path / "from-url", seq_len=63, seed=2, epochs=1)
    fs.rm(f"{bucket}/src", recursive=True)
    other = write_source(tmp_path / "other", random_docs(np.random.default_rng(12), 300, 1000, 0))
    upload(fs, other, f"s3://{bucket}/src")
    result = cli("validate", str(tmp_path / "from-url"), "--against", f"s3://{bucket}/src", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    found = [p["found"] for p in json.loads(result.stdout)["problems"] if p["where"] == "sources"]
    assert found and f"changed since the shuffle: s3://{bucket}/src now has fingerprint" in found[0], found


def _shuffle_refusals(cases, tmp_path) -> None:
    """Each (SOURCE, -o, file, hint) is one line naming `file`, the URL as given (not a local
    folder it was downloaded to or written through), with its hint; no temporary file is left in
    the scratch folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--seq-len", "7", "--seed", "1", "--epochs", "1", "--scratch", str(scratch), "--json"]
    for given, out, file, hint in cases:
        result = cli("shuffle", given, "-o", out, *args)
        line = one_line_error(result)
        error = json.loads(result.stdout)["error"]
        assert error["file"] == file and (error["hint"] or "").startswith(hint), (given, error)
        assert line.startswith(f"tokpack: error: {file}"), line
    assert not list(scratch.rglob("*.tmp-*")) and not list(scratch.glob("tokpack-out-*"))


def test_a_source_url_refused_is_named_by_its_url(bucket_run, tmp_path):
    """A source URL that is not a packed source, or not there: its URL, not the download."""
    fs, bucket, _ = bucket_run
    _shuffle_refusals(
        [
            (f"s3://{bucket}/run", str(tmp_path / "a"), f"s3://{bucket}/run/{MANIFEST}", "give a packed source"),
            (f"s3://{bucket}/nothing", str(tmp_path / "b"), f"s3://{bucket}/nothing", "check the path or URL"),
        ],
        tmp_path,
    )


def test_an_output_url_that_is_an_object_is_refused_as_a_local_file_is(bucket_run, tmp_path):
    """-o s3://.../tokpack.json (an object, not a folder): the state fetch wrote it onto the
    scratch folder itself (EISDIR naming two local paths, a temporary file left behind)."""
    fs, bucket, _ = bucket_run
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    obj = f"s3://{bucket}/src/{MANIFEST}"
    _shuffle_refusals([(f"s3://{bucket}/src", obj, obj, "choose another -o")], tmp_path)


def test_a_file_given_for_the_directory_is_not_a_directory_in_every_command(bucket_run, tmp_path):
    """RUN/tokpack.json given for RUN, in a bucket or on disk: stage and inspect say what
    validate says (not a directory, pass the one holding tokpack.json), not that a run was
    interrupted (inspect) or that the file cannot be read / is no tokpack directory (stage)."""
    fs, bucket, run = bucket_run
    for given in (f"s3://{bucket}/run/{MANIFEST}", str(run / MANIFEST)):
        for command in (["stage", given, str(tmp_path / "dest")], ["inspect", given], ["validate", given]):
            result = cli(*command, "--json")
            assert result.returncode == 1, (command, result.stderr)
            out = json.loads(result.stdout)
            error = out["problems"][0] if command[0] == "validate" else out["error"]
            assert (error["file"], error["message"], error["found"]) == (given, "not a directory", "a file"), error
            assert error["hint"] == "pass the directory that holds tokpack.json", error
    assert not (tmp_path / "dest").exists()


def test_a_scratch_folder_not_made_yet_is_made_for_url_sources_too(bucket_run, tmp_path):
    """--scratch (or $TOKPACK_STAGE_DIR) naming a folder not made yet: pack and shuffle -o URL
    made it, shuffle of a URL source failed (ENOENT on SCRATCH/tokpack-stage-RANDOM, a name the
    user never gave). The run is the one shuffled from the local source."""
    fs, bucket, run = bucket_run
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    scratch = tmp_path / "not" / "made"
    shuffle(
        f"s3://{bucket}/src", tmp_path / "from-url", seq_len=63, seed=2, epochs=2, shard_samples=150, scratch=scratch
    )
    assert without_paths(tree(tmp_path / "from-url")) == without_paths(tree(run))
    assert scratch.is_dir() and not any(scratch.iterdir())


_KILLED_HOLDER = """
import os, sys
from tokpack.formats.guard import OutputLock
OutputLock(sys.argv[1], "tokpack shuffle s3://b/src -o run").acquire()
os._exit(0)  # as a SIGKILL: no release, no cleanup
"""


def test_the_downloads_a_killed_command_left_are_removed_by_the_next(bucket_run, tmp_path, capfd, monkeypatch):
    """A shuffle of a URL source killed before its cleanup (SIGKILL, the OOM killer) left
    SCRATCH/tokpack-stage-RANDOM, a whole copy of its sources, and each rerun made another. The
    next command under that scratch now removes the folders whose holder on this host is gone,
    and only those: a live command's, one with no lock, and its own (until it ends) stay."""
    from tokpack.formats.guard import OutputLock, lock_holder
    from tokpack.packer import executors

    holders, stage_in = [], executors.stage_in

    def downloading(url, workdir):  # what a SIGKILL here would leave: a folder naming its live holder
        holders.append(lock_holder(workdir))
        return stage_in(url, workdir)

    monkeypatch.setattr(executors, "stage_in", downloading)
    fs, bucket, run = bucket_run
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    scratch = tmp_path / "scratch"
    killed, live, unlocked = (scratch / f"tokpack-stage-{name}" for name in ("killed", "live", "unlocked"))
    for folder in (killed, live, unlocked):
        (folder / "in-x").mkdir(parents=True)
        (folder / "in-x" / "00000.ds").write_bytes(b"a copy of a source shard")
    subprocess.run([sys.executable, "-c", _KILLED_HOLDER, str(killed)], check=True)
    assert (killed / "tokpack.lock").is_file()
    with OutputLock(live, "tokpack shuffle s3://b/other -o elsewhere"):  # a command that runs
        shuffle(
            f"s3://{bucket}/src", tmp_path / "out", seq_len=63, seed=2, epochs=2, shard_samples=150, scratch=scratch
        )
        assert sorted(p.name for p in scratch.iterdir()) == [live.name, unlocked.name]
    assert holders and all(h is not None and h[1] and h[0]["pid"] == os.getpid() for h in holders), holders
    assert without_paths(tree(tmp_path / "out")) == without_paths(tree(run))
    assert f"tokpack: removing {killed}, the downloads of a command that is gone" in capfd.readouterr().err


_WITHOUT_S3FS = """
import sys
sys.modules["s3fs"] = None  # as on a machine without tokpack's [s3] extra
from tokpack.packer.cli import main
main()
"""


def test_a_url_whose_filesystem_is_not_installed_is_one_line_in_every_command(tmp_path):
    """s3:// without s3fs (README: pip install 'tokpack[s3]'), or a scheme fsspec does not
    know: every command said 'internal error (a bug in tokpack): ImportError: Install s3fs to
    access S3' (exit 70) but stage; now one line naming the URL and what to install, exit 1."""
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(1), 30, 1000, 0))
    shuffle(src, tmp_path / "run", seq_len=15, seed=1, epochs=1)
    settings = ["--seq-len", "15", "--seed", "1", "--epochs", "1"]
    for url, hint in (("s3://b/d", "pip install 'tokpack[s3]' (s3fs)"), ("nosuch://b/d", "check the URL")):
        for command in (
            ["validate", url],
            ["validate", str(tmp_path / "run"), "--against", url],
            ["inspect", url],
            ["read", url],
            ["stage", url, str(tmp_path / "dest")],
            ["pack", url, "-o", str(tmp_path / "out")],
            ["pack", str(src), "-o", url],
            ["shuffle", url, "-o", str(tmp_path / "out"), *settings],
            ["shuffle", str(src), "-o", url, *settings],
            ["shuffle", "--like", url, "--epoch", "1"],
        ):
            result = subprocess.run(
                [sys.executable, "-c", _WITHOUT_S3FS, *command, "--json"], capture_output=True, text=True
            )
            line = one_line_error(result)
            error = json.loads(result.stdout)["error"]
            assert (error["file"], error["hint"]) == (url, hint), (command, error)
            assert line.startswith(f"tokpack: error: {url}: "), (command, line)
    assert not (tmp_path / "out").exists() and not (tmp_path / "dest").exists()


def test_inspect_reads_a_bucket(bucket_run, tmp_path):
    """inspect of an s3:// run whose source is in the bucket too (found next to the run, by
    name): the report of the local run with its local source."""
    fs, bucket, run = bucket_run
    args = ["--json", "--batch-size", "16", "--batches", "4"]
    local = cli("inspect", str(run), *args)
    assert local.returncode == 0, local.stderr
    upload(fs, tmp_path / "src", f"s3://{bucket}/src")
    (tmp_path / "src").rename(tmp_path / "elsewhere")  # the path the run records no longer leads to it
    remote = cli("inspect", f"s3://{bucket}/run", *args)
    assert remote.returncode == 0, remote.stderr
    local, remote = json.loads(local.stdout), json.loads(remote.stdout)
    assert remote.pop("path") == f"s3://{bucket}/run" and local.pop("path") == str(run)
    assert remote == local and remote["batch_diversity"]["document_identity"] == "plan"
    assert remote["totals"]["samples"] == 2 * json.loads((run / MANIFEST).read_text())["samples"]  # two epochs
    assert "unreachable_sources" not in remote and remote["document_lengths"]["documents"] > 0


# ---------------------------------------------------------------- pack streams URL inputs


def megatron_input(root: Path, tokenizer_path) -> dict:
    """datatrove's Megatron writer, two ranks."""
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    write_text_jsonl(root / "text", files=2, docs=30, seed=9)
    for rank, name in enumerate(["part0.jsonl", "part1.jsonl"]):
        MegatronDocumentTokenizer(
            str(root / "in"), tokenizer_name_or_path=str(tokenizer_path), eos_token=EOS_TOKEN
        ).run(JsonlReader(str(root / "text"), glob_pattern=name).run(None, 0, 1), rank=rank, world_size=2)
    return dict(tokenizer=str(tokenizer_path))


def parquet_input(root: Path, tokenizer_path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = varied_docs(seed=5, n=200)
    (root / "in").mkdir(parents=True)
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))})
    pq.write_table(table.slice(0, 120), root / "in" / "a.parquet", row_group_size=16)
    pq.write_table(table.slice(120), root / "in" / "b.parquet", row_group_size=16)
    return dict(eos_id=0, vocab_size=500)


def arrow_input(root: Path, tokenizer_path) -> dict:
    """The Arrow stream layout of HF `save_to_disk` (state.json naming the files)."""
    import pyarrow as pa

    (root / "in").mkdir(parents=True)
    docs = varied_docs(seed=4, n=150)
    for k, part in enumerate((docs[:90], docs[90:])):
        with pa.ipc.new_stream(
            str(root / "in" / f"data-{k:05d}-of-00002.arrow"), pa.schema({"input_ids": pa.list_(pa.int64())})
        ) as w:
            w.write_table(pa.table({"input_ids": part}), max_chunksize=16)
    (root / "in" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": f"data-{k:05d}-of-00002.arrow"} for k in range(2)]})
    )
    return dict(eos_id=0, vocab_size=500)


def jsonl_input(root: Path, tokenizer_path) -> dict:
    (root / "in").mkdir(parents=True)
    (root / "in" / "t.jsonl").write_text("".join(json.dumps({"ids": d}) + "\n" for d in varied_docs(seed=6, n=150)))
    return dict(eos_id=0, vocab_size=500, column="ids")


def npy_input(root: Path, tokenizer_path) -> dict:
    (root / "in").mkdir(parents=True)
    np.save(root / "in" / "t.npy", np.concatenate([np.array(d, np.uint16) for d in varied_docs(seed=7) if d]))
    return dict(eos_id=0, vocab_size=500)


def source_files(out: Path) -> tuple[dict, dict]:
    """(shard files' bytes, manifest less its `inputs` paths) of a packed source."""
    files = tree(out)
    manifest = json.loads(files.pop(MANIFEST))
    paths = [i.pop("path") for i in manifest["inputs"]]
    manifest.pop("request", None)
    return files, manifest, paths


def test_pack_streams_datatrove_output_written_to_the_bucket(s3_bucket, tokenizer_path, tmp_path):
    """datatrove's tokenizer writes straight into the bucket; pack reads it from there (two
    worker processes, each reading its own objects) into the same bytes as from local paths,
    and the manifest names the objects it read."""
    fs, bucket = s3_bucket
    write_text_jsonl(tmp_path / "text", files=3, docs=60)
    dt_tokenize(tmp_path / "text", tmp_path / "tokenized", tokenizer_path, save_loss_metadata=True, seed=3)
    dt_tokenize(tmp_path / "text", f"s3://{bucket}/tokenized", tokenizer_path, save_loss_metadata=True, seed=3)
    pack(tmp_path / "tokenized", tmp_path / "local", tokenizer=str(tokenizer_path))
    # a fresh process: datatrove's worker processes must see the endpoint this test set (a
    # forkserver started earlier in the session would not)
    result = cli(
        "pack",
        f"s3://{bucket}/tokenized",
        "-o",
        str(tmp_path / "remote"),
        "--tokenizer",
        str(tokenizer_path),
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    local, remote = source_files(tmp_path / "local"), source_files(tmp_path / "remote")
    assert remote[:2] == local[:2] and any(name.endswith(".loss") for name in remote[0])
    assert remote[2] == [f"s3://{bucket}/tokenized/{Path(p).name}" for p in local[2]]


@pytest.mark.parametrize(
    "make",
    [megatron_input, parquet_input, arrow_input, jsonl_input, npy_input],
    ids=["megatron", "parquet", "arrow", "jsonl", "npy"],
)
def test_pack_streams_uploaded_inputs(make, s3_bucket, tokenizer_path, tmp_path):
    fs, bucket = s3_bucket
    kw = make(tmp_path, tokenizer_path)
    upload(fs, tmp_path / "in", f"s3://{bucket}/in")
    pack(tmp_path / "in", tmp_path / "local", **kw)
    pack(f"s3://{bucket}/in", tmp_path / "remote", **kw)
    local, remote = source_files(tmp_path / "local"), source_files(tmp_path / "remote")
    assert remote[:2] == local[:2]
    assert remote[2] == [f"s3://{bucket}/in/{Path(p).name}" for p in local[2]]


def test_slurm_tasks_read_their_own_objects(s3_bucket, tmp_path):
    """Slurm array tasks (scripts/slurm-local.sh) each open their own input objects from the
    bucket (the endpoint and credentials reach them through the job's environment)."""
    from test_executors import slurm_unavailable

    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)
    fs, bucket = s3_bucket
    npy_input(tmp_path, None)
    np.save(tmp_path / "in" / "u.npy", np.concatenate([np.array(d, np.uint16) for d in varied_docs(seed=8) if d]))
    upload(fs, tmp_path / "in", f"s3://{bucket}/in")
    kw = dict(eos_id=0, vocab_size=500, shard_tokens=500)
    pack(tmp_path / "in", tmp_path / "local", **kw)
    pack(
        f"s3://{bucket}/in",
        tmp_path / "remote",
        **kw,
        executor=ExecutorConfig(executor="slurm", time_limit="00:10:00", logging_dir=str(tmp_path / "logs")),
    )
    assert len(list((tmp_path / "logs").glob("*/completions/*"))) == 2  # one task per input object
    remote, local = source_files(tmp_path / "remote"), source_files(tmp_path / "local")
    assert remote[:2] == local[:2] and remote[2] == [f"s3://{bucket}/in/t.npy", f"s3://{bucket}/in/u.npy"]
    # and to the bucket: the tasks send their own shards from the (shared) scratch folder
    result = pack(
        f"s3://{bucket}/in",
        f"s3://{bucket}/packed",
        **kw,
        scratch=tmp_path / "scratch",
        executor=ExecutorConfig(executor="slurm", time_limit="00:10:00", logging_dir=str(tmp_path / "logs2")),
    )
    assert len(list((tmp_path / "logs2").glob("*/completions/*"))) == 2 and result.output == f"s3://{bucket}/packed"
    stage(f"s3://{bucket}/packed", tmp_path / "staged")
    assert source_files(tmp_path / "staged")[:2] == local[:2]


def disk_use(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def test_pack_from_a_bucket_keeps_no_local_copy(s3_bucket, tokenizer_path, tmp_path):
    """The local temp folder (TMPDIR) stays far below the corpus while pack reads it from the
    bucket: the inputs are streamed, not downloaded."""
    fs, bucket = s3_bucket
    write_text_jsonl(tmp_path / "text", files=2, docs=400)
    dt_tokenize(tmp_path / "text", f"s3://{bucket}/tokenized", tokenizer_path)
    corpus = sum(fs.du(f"{bucket}/tokenized", total=False).values())
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TOKPACK_STAGE_DIR"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokpack.packer.cli",
            "pack",
            f"s3://{bucket}/tokenized",
            "-o",
            str(tmp_path / "out"),
            "--tokenizer",
            str(tokenizer_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "TMPDIR": str(tmp), "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, disk_use(tmp))
    assert proc.wait() == 0, proc.stderr.read()
    assert (tmp_path / "out" / MANIFEST).exists()
    assert peak < corpus / 10, (peak, corpus)


def test_corrupted_input_object_is_one_line_naming_it(s3_bucket, tokenizer_path, tmp_path):
    """One byte changed in an index object: the same one line as for the local file, naming
    the object's URL; nothing is left that could pass for data."""
    fs, bucket = s3_bucket
    write_text_jsonl(tmp_path / "text", files=2, docs=40)
    dt_tokenize(tmp_path / "text", tmp_path / "tokenized", tokenizer_path)
    index = sorted((tmp_path / "tokenized").glob("*.ds.index"))[0]
    data = bytearray(index.read_bytes())
    data[8 + 7] = 0x01  # entry 1's top byte: its end now lies past entry 2's
    index.write_bytes(bytes(data))
    upload(fs, tmp_path / "tokenized", f"s3://{bucket}/tokenized")
    args = ["--tokenizer", str(tokenizer_path)]
    local = one_line_error(cli("pack", str(tmp_path / "tokenized"), "-o", str(tmp_path / "a"), *args))
    remote = one_line_error(cli("pack", f"s3://{bucket}/tokenized", "-o", str(tmp_path / "b"), *args))
    url = f"s3://{bucket}/tokenized/{index.name}"
    assert url in remote and "does not increase" in remote
    assert remote == local.replace(str(index), url)
    assert not (tmp_path / "b" / MANIFEST).exists()


# ------------------------------------------------------------------ output to a bucket (item 3)


def versions(fs, bucket: str, prefix: str) -> dict[str, int]:
    """Object key -> how many times it was written (a versioned bucket keeps every upload)."""
    counts: dict[str, int] = {}
    page = {"IsTruncated": True}
    while page.get("IsTruncated"):
        more = (
            {"KeyMarker": page["NextKeyMarker"], "VersionIdMarker": page["NextVersionIdMarker"]}
            if "NextKeyMarker" in page
            else {}
        )
        page = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=prefix, **more)
        for v in page.get("Versions", []):
            counts[v["Key"]] = counts.get(v["Key"], 0) + 1
    return counts


def run_watched(args: list[str], scratch: Path, until=None, env=None) -> tuple[subprocess.Popen, int]:
    """The CLI in its own process group, the disk use under `scratch` sampled until it exits or
    `until()` holds (then the whole group is killed with SIGKILL); returns (process, peak bytes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokpack.packer.cli", *args, "--scratch", str(scratch)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})},
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, disk_use(scratch))
        if until is not None and until():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
    return proc, peak


def objects(fs, url: str, suffix: str) -> list[str]:
    """The keys under `url` ending in `suffix`, as the store lists them now (no s3fs cache)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listed = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix + "/")
    assert not listed.get("IsTruncated")
    return sorted(f"{bucket}/{o['Key']}" for o in listed.get("Contents", []) if o["Key"].endswith(suffix))


def shard_objects(fs, url: str) -> list[str]:
    return objects(fs, url, ".ds")


@pytest.fixture
def many_shard_source(tmp_path):
    docs = random_docs(np.random.default_rng(5), 20000, 1000, 0)
    return write_source(tmp_path / "src", docs, docs_per_shard=2000)


SHUFFLE_ARGS = ["--seq-len", "1023", "--seed", "4", "--epochs", "1", "--shard-samples", "16", "--workers", "2"]
SHUFFLE_KW = dict(seq_len=1023, seed=4, epochs=1, shard_samples=16)
LOGS = 256 << 10  # the task logs and records of finished work a command keeps in its scratch folder


def test_shuffle_to_a_bucket_keeps_a_few_shards_on_the_local_disk(s3_bucket, many_shard_source, tmp_path):
    """`shuffle -o s3://` sends each shard once committed and removes it locally: the scratch
    folder holds a few shards at a time, never the run; the run in the bucket is the local run."""
    fs, bucket = s3_bucket
    shuffle(many_shard_source, tmp_path / "local", **SHUFFLE_KW)
    run_bytes = sum(p.stat().st_size for p in (tmp_path / "local").rglob("*") if p.is_file())
    shard_bytes = max(p.stat().st_size for p in (tmp_path / "local").rglob("*.ds"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc, peak = run_watched(["shuffle", str(many_shard_source), "-o", f"s3://{bucket}/run", *SHUFFLE_ARGS], scratch)
    assert proc.returncode == 0, proc.stderr.read()
    assert len(shard_objects(fs, f"s3://{bucket}/run")) > 50
    # two workers, each with a shard being written and one being sent; the index and metadata files are small
    assert 0 < peak <= 6 * shard_bytes + LOGS < run_bytes / 8, (peak, shard_bytes, run_bytes)
    assert not any(scratch.iterdir())  # removed once the run is complete
    stage(f"s3://{bucket}/run", tmp_path / "staged")
    assert without_paths(tree(tmp_path / "staged")) == without_paths(tree(tmp_path / "local"))


@pytest.mark.parametrize("path", ["in-memory", "out-of-core"])
def test_shuffle_to_a_bucket_killed_then_rerun_sends_only_what_is_missing(s3_bucket, many_shard_source, tmp_path, path):
    """SIGKILL while shards are being sent: the bucket holds no run manifest (a partial upload
    never looks complete); the rerun, from a fresh scratch folder as on another machine, sends
    only the missing shards (a versioned bucket counts every upload) and the run equals the
    local one."""
    fs, bucket = s3_bucket
    fs.call_s3("put_bucket_versioning", Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    memory = ["--memory", "600KiB"] if path == "out-of-core" else []
    url = f"s3://{bucket}/run"
    made = shuffle(many_shard_source, tmp_path / "local", **SHUFFLE_KW, memory=600 << 10 if memory else 4 << 30)
    assert made.path == path
    args = ["shuffle", str(many_shard_source), "-o", url, *SHUFFLE_ARGS, *memory]
    (tmp_path / "a").mkdir()
    proc, _ = run_watched(args, tmp_path / "a", until=lambda: len(shard_objects(fs, url)) >= 5)
    before = shard_objects(fs, url)
    total = len(list((tmp_path / "local").rglob("*.ds")))
    assert proc.returncode == -signal.SIGKILL and 5 <= len(before) < total, (proc.returncode, len(before), total)
    assert not objects(fs, url, MANIFEST)
    recorded = [Path(p).name.removesuffix(".ds.json") for p in objects(fs, f"{url}/.tokpack-work", ".ds.json")]
    assert recorded  # the records of shards sent in full
    check = cli("validate", url)
    assert check.returncode == 1 and f"INCOMPLETE {url}: incomplete: no tokpack.json" in check.stderr, check.stderr

    (tmp_path / "b").mkdir()
    proc, _ = run_watched(args, tmp_path / "b")
    assert proc.returncode == 0, proc.stderr.read()
    written = versions(fs, bucket, "run/epoch-")
    again = sorted(k for k, n in written.items() if n > 1)
    assert len({k.split(".")[0] for k in written if k.endswith(".ds")}) == total
    # at most a shard per worker was being sent when the kill came; every recorded shard went once
    assert len({k.split(".")[0] for k in again}) <= 2, again
    assert not {Path(k).name.split(".")[0] for k in again} & set(recorded), (again, recorded)
    assert not objects(fs, f"{url}/.tokpack-work", "")  # the records go once the run is complete
    stage(url, tmp_path / "staged")
    assert without_paths(tree(tmp_path / "staged")) == without_paths(tree(tmp_path / "local"))


def test_pack_to_a_bucket_bounded_and_resumed(s3_bucket, tmp_path):
    """`pack -o s3://`: each shard is sent once written (the scratch folder stays a few shards),
    a SIGKILL leaves no manifest, and the rerun (from another scratch folder) sends again only the shards of inputs whose
    record was not sent (pack resumes input by input), names the shards with copies inside
    the store, and the source equals the local pack."""
    fs, bucket = s3_bucket
    fs.call_s3("put_bucket_versioning", Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    rng = np.random.default_rng(8)
    (tmp_path / "in").mkdir()
    for name in "abcdef":
        np.save(tmp_path / "in" / f"{name}.npy", np.concatenate(random_docs(rng, 2500, 1000, 0)).astype(np.uint16))
    args = ["--format", "numpy", "--eos-id", "0", "--vocab-size", "1000", "--shard-tokens", "16000"]
    assert cli("pack", str(tmp_path / "in"), "-o", str(tmp_path / "local"), *args).returncode == 0
    shard_bytes = 16000 * 2
    url = f"s3://{bucket}/packed"

    def parts_recorded() -> set[str]:
        return {Path(p).stem for p in objects(fs, f"{url}/.tokpack-work", ".json") if "/part-" in p}

    (tmp_path / "a").mkdir()
    command = ["pack", str(tmp_path / "in"), "-o", url, *args, "--workers", "2"]
    proc, peak = run_watched(command, tmp_path / "a", until=lambda: len(parts_recorded()) >= 1)
    recorded = parts_recorded()
    assert proc.returncode == -signal.SIGKILL and not objects(fs, url, MANIFEST) and 1 <= len(recorded) < 6
    (tmp_path / "b").mkdir()
    proc, peak2 = run_watched(command, tmp_path / "b")  # another scratch folder: as on another machine
    assert proc.returncode == 0, proc.stderr.read()
    local_bytes = sum(p.stat().st_size for p in (tmp_path / "local").iterdir())
    assert max(peak, peak2) <= 8 * shard_bytes + LOGS < local_bytes / 4, (peak, peak2, local_bytes)
    written = versions(fs, bucket, "packed/")
    final = {k: n for k, n in written.items() if ".tokpack-work" not in k}
    assert len(final) == len(list((tmp_path / "local").iterdir())) and set(final.values()) == {1}
    kept = {k: n for k, n in written.items() if any(f"/{part}/" in k for part in recorded)}
    assert kept and set(kept.values()) == {1}, kept  # the recorded inputs' shards were not sent again
    assert not objects(fs, f"{url}/.tokpack-work", "")
    stage(url, tmp_path / "staged")
    assert tree(tmp_path / "staged") == tree(tmp_path / "local")
    again = json.loads(cli("pack", str(tmp_path / "in"), "-o", url, *args, "--json").stdout)
    assert again["status"] == "already complete" and again["output"] == url


def test_pack_to_a_bucket_killed_while_naming_its_shards_finishes_from_another_machine(
    s3_bucket, tmp_path, monkeypatch
):
    """Killed between the copies that name the shards and the manifest: a rerun from another
    scratch folder finds the plan in the bucket, finishes the moves and sends the manifest."""
    from tokpack.formats import outputs

    fs, bucket = s3_bucket
    (tmp_path / "in").mkdir()
    np.save(
        tmp_path / "in" / "a.npy", np.concatenate(random_docs(np.random.default_rng(3), 300, 1000, 0)).astype(np.uint16)
    )
    kw = dict(input_format="numpy", eos_id=0, vocab_size=1000, shard_tokens=4000)
    pack(tmp_path / "in", tmp_path / "local", **kw)
    real = outputs.write_manifest

    def killed(directory, manifest, name=MANIFEST):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        pack(tmp_path / "in", f"s3://{bucket}/p", scratch=tmp_path / "a", **kw)
    monkeypatch.setattr(outputs, "write_manifest", real)
    assert objects(fs, f"s3://{bucket}/p", ".ds") and not objects(fs, f"s3://{bucket}/p", MANIFEST)
    result = pack(tmp_path / "in", f"s3://{bucket}/p", scratch=tmp_path / "b", **kw)
    assert result.status == "packed" and result.output == f"s3://{bucket}/p"
    stage(f"s3://{bucket}/p", tmp_path / "staged")
    assert tree(tmp_path / "staged") == tree(tmp_path / "local")


def test_two_commands_on_one_bucket_output_meet_at_the_scratch_lock(s3_bucket, many_shard_source, tmp_path):
    """A second shuffle to the same URL from this machine, while the first runs, is refused with
    one line before it touches anything; the first finishes and its run is whole."""
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/run"
    (tmp_path / "s").mkdir()
    args = ["shuffle", str(many_shard_source), "-o", url, *SHUFFLE_ARGS, "--scratch", str(tmp_path / "s")]
    first = subprocess.Popen(
        [sys.executable, "-m", "tokpack.packer.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not objects(fs, url, ".ds") and first.poll() is None:
        time.sleep(0.05)
    second = cli(*args)
    line = one_line_error(second)
    assert "in use by another tokpack command" in line and "tokpack.lock" in line, line
    assert first.wait() == 0, first.stderr.read()
    assert cli("validate", url).returncode == 0


def test_node_slice_from_a_bucket_equals_the_local_slice(bucket_run, tmp_path):
    """`stage RUN DEST --ranks A-B --world-size W` from an s3:// run: ranged reads of the
    ranks' rows and the row hashes only; the slice is byte-identical to the one staged from
    the local run, and reads less than the run holds."""
    from tokpack.packer.slicing import stage_slice

    fs, bucket, run = bucket_run
    remote = stage_slice(f"s3://{bucket}/run", tmp_path / "remote", ranks="1-2", world_size=4, micro_batch=2, workers=4)
    local = stage_slice(str(run), tmp_path / "local", ranks="1-2", world_size=4, micro_batch=2)
    files = lambda root: {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))  # noqa: E731
        if p.is_file() and p.name != "tokpack.lock" and p.name != MANIFEST
    }
    assert files(tmp_path / "remote") == files(tmp_path / "local") and remote.rows_kept == local.rows_kept
    assert remote.bytes_read == local.bytes_read < sum(p.stat().st_size for p in run.rglob("*.ds"))
