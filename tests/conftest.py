"""Shared fixtures: a real tokenizer trained here, and packed sources written through the
project's own shard writer (for stages that must not depend on `pack`)."""

from __future__ import annotations

import fnmatch
import importlib
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tokpack.formats.shards import SourceShardWriter

from tokpack.formats.builders import source_manifest

from tokpack.formats.reading import write_manifest
from tokpack.formats.names import shard_name

PROJECT_PACKAGES = ("tokpack",)
# Open MPI's launcher sometimes fails to start under load, before any process of the job runs:
# exit 213, "The PMIx server's listener thread failed to start" (seen in 1 CI run of ~20, in a
# different MPI test each time). Nothing of tokpack ran, so the tests' MPI jobs (subprocess.run
# of mpirun, output captured) launch again, at most twice; any other result is the test's.
LAUNCHER_FAILED = "PMIx server's listener thread failed to start"
_LAUNCHERS = {"mpirun", "mpiexec", "prterun"}
_subprocess_run = subprocess.run


def _launcher_failed_to_start(args, result) -> bool:
    cmd = args[0] if args else None
    if not isinstance(cmd, (list, tuple)) or not cmd or Path(str(cmd[0])).name not in _LAUNCHERS:
        return False
    err = result.stderr if isinstance(result.stderr, str) else (result.stderr or b"").decode(errors="replace")
    return result.returncode == 213 and LAUNCHER_FAILED in err


def run_launching_again(*args, **kwargs):
    """subprocess.run, an MPI job whose launcher failed to start launched again (LAUNCHER_FAILED)."""
    for _ in range(2):
        result = _subprocess_run(*args, **kwargs)
        if not _launcher_failed_to_start(args, result):
            return result
    return _subprocess_run(*args, **kwargs)


subprocess.run = run_launching_again


def start_job(cmd: list[str], env: dict, ready, what: str, seconds: float = 60) -> subprocess.Popen:
    """An MPI job started in the background (stdout, stderr piped, text), returned once `ready()`
    holds, for a test that then stops it. A launcher that failed to start (LAUNCHER_FAILED, as
    run_launching_again) launches again, at most twice; a job that ends or is not ready within
    `seconds` fails the test with its exit status and stderr."""
    for _ in range(3):
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + seconds
        while job.poll() is None and not ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        if job.poll() is None and ready():
            return job
        if job.poll() is None:
            job.kill()
        out, err = job.communicate()
        if not _launcher_failed_to_start([cmd], subprocess.CompletedProcess(cmd, job.returncode, out, err)):
            break
    pytest.fail(f"{what}: the job ended (exit {job.returncode}) or was not ready in {seconds} s: {err[-3000:]}")


def wait_until(condition, what: str, seconds: float = 60):
    """Polls `condition` until it returns something true, and returns that: a test waits for
    what it relies on (a thread's item, a line written), never a fixed sleep, which a loaded
    machine (CI: the whole suite on two shared cores) can outlast. `seconds` bounds a hang, not
    a timing; past it the test fails naming `what`."""
    deadline = time.monotonic() + seconds
    while not (got := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds} s")
        time.sleep(0.005)
    return got


REPO = Path(__file__).resolve().parents[1]
# Folders a checkout may hold that are not the project's: a virtual environment made in the clone
# (`python -m venv .venv`, the common habit, whose site-packages hold other projects' code in
# syntax this Python may not parse), build output, installed packages and caches.
NOT_PROJECT = {
    ".git",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    ".eggs",
    "build",
    "dist",
    "site-packages",
    "dist-packages",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
}


def _not_project(folder: Path) -> bool:
    """A folder whose files are never the project's: by its name, or a virtual environment of any
    name (its pyvenv.cfg), or an egg-info."""
    return folder.name in NOT_PROJECT or folder.name.endswith(".egg-info") or (folder / "pyvenv.cfg").is_file()


def _listed_by_git(root: Path) -> list[str] | None:
    """The files git knows in this checkout, tracked or new but not ignored (relative paths), or
    None when root is not the top of a git checkout (an unpacked sdist) or git is absent."""
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if Path(top).resolve() != root.resolve():
            return None
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [name for name in listed.decode().split("\0") if name]


def _walked(root: Path) -> list[str]:
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _not_project(Path(here) / d)]
        found += [os.path.relpath(os.path.join(here, f), root) for f in files]
    return found


def project_files(*folders: str, pattern: str = "*", recursive: bool = True, root: Path = REPO) -> list[Path]:
    """The project's own files whose name matches pattern, under the given folders of the checkout
    (all of it when none is given; recursive=False: only the folders' own files), sorted. Every
    test that reads the source tree lists it here: `git ls-files` in a git checkout, else a walk,
    and never a file under a folder that is not the project's (NOT_PROJECT, a venv of any name),
    so a venv or a build inside the clone cannot break the suite."""
    root = Path(root)
    names = _listed_by_git(root)
    names = _walked(root) if names is None else names
    found = []
    for name in names:
        path = root / name
        rel = Path(name)
        if not fnmatch.fnmatchcase(rel.name, pattern) or not path.is_file():  # a deleted tracked file is not there
            continue
        if folders and not any(
            rel.parent == Path(f) if not recursive else Path(f) in (rel.parent, *rel.parent.parents) for f in folders
        ):
            continue
        if any(_not_project(root.joinpath(*rel.parts[: i + 1])) for i in range(len(rel.parts) - 1)):
            continue
        found.append(path)
    return sorted(found)


def require(module: str, install_hint: str):
    """Imports an optional third-party tool, or skips the test saying what is missing and how to
    install it. Only a tool that is absent skips: a tool that is installed but breaks on import,
    and any import error inside tokpack itself, fail the test."""
    if module.split(".")[0] in PROJECT_PACKAGES:
        raise ValueError(f"{module} is part of tokpack: import it, a failure there is a test failure")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not (module == missing or module.startswith(missing + ".")):
            raise  # the tool is there but something it (or tokpack) imports is not: a failure
        pytest.skip(f"{module} is not installed ({install_hint})")


# tokpack.shuffle.run.shuffle_run's own keywords: how the work runs, not a setting of the spec
ENGINE_KEYWORDS = ("local", "log", "workers", "tasks", "run_passes", "progress", "to")


def shuffle_run(sources, output, **kw):
    """tokpack.shuffle.run.shuffle_run of the ShuffleSpec of `sources` and the settings among
    `kw` (the rest are the engine's own keywords), with the runner tokpack.packer.api.shuffle
    gives it for a default ExecutorConfig (every rank in this process), for tests that call the
    engine directly."""
    from tokpack.packer.shared import ExecutorConfig
    from tokpack.packer.executors import pass_runner
    from tokpack.shuffle.run import shuffle_run as run
    from tokpack.shuffle.spec import ShuffleSpec

    engine = {k: kw.pop(k) for k in ENGINE_KEYWORDS if k in kw}
    engine["run_passes"] = engine.get("run_passes") or pass_runner(ExecutorConfig())
    return run(ShuffleSpec.given_as(sources=sources, **kw), output, **engine)


def as_written_before(epoch: Path, row_hashes: bool = True) -> None:
    """Rewrites an epoch's (or a slice epoch's) manifest as tokpack wrote it before its shard
    entries lost `xxh3_128` (docs/FORMAT.md, "History within version 1"): each entry records its
    token file's xxh3_128 again, after `samples`, where the writer put it; the manifest is
    serialised as every manifest is (formats/reading.py canonical_bytes). `row_hashes=False`:
    also as before row hashes, without `rows_xxh3_128` and `.ds.rows`. Users have both on disk."""
    from tokpack.formats.constants import MANIFEST
    from tokpack.formats.hashes import xxh3_128_file
    from tokpack.formats.reading import canonical_bytes
    import json

    m = json.loads((epoch / MANIFEST).read_bytes())
    shards = []
    for s in m["shards"]:
        assert "xxh3_128" not in s, "already an entry of the old form"
        old = {}
        for k, v in s.items():
            if k == "rows_xxh3_128" and not row_hashes:
                (epoch / (s["path"] + ".rows")).unlink()
                continue
            old[k] = v
            if k == "samples":
                old["xxh3_128"] = xxh3_128_file(epoch / s["path"])
        shards.append(old)
    (epoch / MANIFEST).write_bytes(canonical_bytes({**m, "shards": shards}))


def pack(inputs, output, **kw):
    """tokpack.packer.packing.pack of the PackOptions among `kw` (the rest are its own keywords:
    log, config, block_bytes, to), for tests that call the stage directly."""
    from tokpack.packer.pack_setup import PackOptions
    from tokpack.packer.packing import pack as run

    own = {k: kw.pop(k) for k in ("log", "config", "block_bytes", "to") if k in kw}
    return run(inputs, output, PackOptions(**kw), **own)


EOS_TOKEN = "<|endoftext|>"
WORDS = (
    "the of and to in is was for on that with as by at from his her they were this which be are an "
    "or had not but what all when we there can one their been has more if will would who so no out "
    "token shard epoch window sample shuffle seed vocabulary document corpus stream index manifest"
).split()


def generate_texts(n: int, seed: int = 0, min_words: int = 5, max_words: int = 400) -> list[str]:
    """Deterministic English-like documents of varied length."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained locally with `tokenizers` (nothing is downloaded).
    `<|endoftext|>` is id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOS_TOKEN], show_progress=False)
    tok.train_from_iterator(generate_texts(300, seed=1), trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def random_docs(
    rng: np.random.Generator, n: int, vocab_size: int, eos_id: int, min_len: int = 1, max_len: int = 300
) -> list[np.ndarray]:
    """Documents of random ids, each ending with EOS and holding no other EOS."""
    docs = []
    for _ in range(n):
        body = rng.integers(0, vocab_size - 1, size=int(rng.integers(min_len, max_len)), dtype=np.int64)
        body[body >= eos_id] += 1  # skip eos_id inside the body
        docs.append(np.append(body, eos_id))
    return docs


def write_source(
    path: str | Path,
    docs: list[np.ndarray],
    vocab_size: int = 1000,
    eos_id: int = 0,
    docs_per_shard: int = 50,
    tokenizer: str = "test-tokenizer",
) -> Path:
    """A packed source written with the project's shard writer, bypassing `pack`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    groups = [docs[i : i + docs_per_shard] for i in range(0, len(docs), docs_per_shard)]
    entries = []
    for i, group in enumerate(groups):
        w = SourceShardWriter(path, shard_name(i), dtype, tokenizer)
        w.write(np.concatenate(group).astype(dtype), np.cumsum([len(d) for d in group]))
        entries.append(w.close())
    write_manifest(path, source_manifest(entries, dtype, vocab_size, eos_id, tokenizer))
    return path


@pytest.fixture
def small_source(tmp_path) -> tuple[Path, list[np.ndarray]]:
    """A 3-shard packed source of 150 random documents (uint16, vocab 1000, EOS 0)."""
    docs = random_docs(np.random.default_rng(7), 150, 1000, 0)
    return write_source(tmp_path / "src", docs), docs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_server(**env) -> tuple:
    """moto's S3 API server on 127.0.0.1 (a real HTTP server, in its own process); returns
    (process, endpoint URL) once it answers."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    require("moto.server", "pip install 'moto[server]'")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    # moto's imports take seconds, many more on a loaded machine (CI: the whole suite on two
    # shared cores): a bound on a hang, returned from as soon as it answers
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=5)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}")
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not answer within 120 s")


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server for the session; AWS_ENDPOINT_URL and test credentials are set in this
    process's environment (so subprocesses and s3fs find it the standard way) while it runs."""
    import os

    require("s3fs", "pip install s3fs")
    proc, url = start_s3_server()
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=url)
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(60)  # a bound on a hang: a loaded machine may take seconds


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A fresh bucket on the session's S3 server; returns (s3fs filesystem, bucket name)."""
    import re

    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    import zlib

    # unique per test id (parametrized ids share their first 50 characters), at most 63 characters
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") or "bucket"
    name = f"{name}-{zlib.crc32(request.node.nodeid.encode()):08x}"
    fs.mkdir(name)
    return fs, name
