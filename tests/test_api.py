"""The Python API (`from packer import ...`, docs/API.md): typed inputs, dataclass results that
hold what `--json` prints and no text for humans, URLs staged as on the command line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.packer import ExecutorConfig, inspect, pack, shuffle, stage, validate
from tokpack.packer.api import ShuffleResult
from tokpack.packer.cli import main
from tokpack.packer.inspection import InspectResult
from tokpack.packer.packing import PackResult
from tokpack.packer.staging import StageResult
from tokpack.packer.validation import ValidateResult

ROOT = Path(__file__).resolve().parent.parent
VOCAB, EOS = 1000, 0
TIMINGS = {"seconds", "mb_per_s", "mib_per_s"}  # differ between two runs of the same command


def write_corpus(path: Path, n: int = 120, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, n, VOCAB, EOS, max_len=200)
    path.write_text("".join(json.dumps({"input_ids": d[d != EOS].tolist()}) + "\n" for d in docs))
    return path


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cli_json(*args) -> dict:
    r = CliRunner().invoke(main, [*map(str, args), "--json"])
    return json.loads(r.stdout.strip().splitlines()[-1])


def untimed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMINGS}


@pytest.fixture
def sources(tmp_path) -> tuple[Path, Path]:
    a = write_source(tmp_path / "a", random_docs(np.random.default_rng(1), 80, VOCAB, EOS), vocab_size=VOCAB)
    b = write_source(tmp_path / "b", random_docs(np.random.default_rng(2), 40, VOCAB, EOS), vocab_size=VOCAB)
    return Path(a), Path(b)


def test_docs_api_blocks_run(tmp_path, monkeypatch, capsys):
    """Every python block of docs/API.md runs, in order, against a small corpus: the doc cannot drift."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "API.md").read_text(), re.S)
    assert len(blocks) >= 7
    write_corpus(tmp_path / "web.jsonl", seed=1)
    write_corpus(tmp_path / "code.jsonl", n=60, seed=2)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/API.md", "exec"), namespace)
    assert validate(["web", "code", "run", "mixed", "local-run"]).ok
    assert capsys.readouterr().out.count("\n") >= 6


def test_weights_as_numbers_mapping_and_cli_text_give_one_run(sources, tmp_path):
    a, b = sources
    kw = dict(seq_len=31, seed=4, epochs=2, samples=150, shard_samples=40)
    by_mapping = shuffle({a: 3, b: 1}, tmp_path / "mapping", **kw)
    by_pairs = shuffle([(str(a), "3"), (str(b), 1)], tmp_path / "pairs", **kw)
    cli = cli_json(
        "shuffle",
        f"{a}=3",
        f"{b}=1",
        "-o",
        tmp_path / "cli",
        "--seq-len",
        31,
        "--seed",
        4,
        "--epochs",
        2,
        "--samples",
        150,
        "--shard-samples",
        40,
    )
    assert tree(tmp_path / "mapping") == tree(tmp_path / "pairs") == tree(tmp_path / "cli")
    assert [s["weight"] for s in by_mapping.epochs_detail[0]["sources"]] == ["3", "1"]
    for result, out in ((by_mapping, "mapping"), (by_pairs, "pairs")):
        expected = {**untimed(cli), "output": str(tmp_path / out)}
        assert untimed(result.to_json()) == expected
    # a float weight is recorded as it reads: 0.75, not 3/4 or 0.75000000000000001
    f = shuffle({a: 0.75, b: 0.25}, tmp_path / "float", **kw)
    assert [s["weight"] for s in f.epochs_detail[0]["sources"]] == ["0.75", "0.25"]


def test_executor_config_local_workers_same_bytes(sources, tmp_path):
    a, _ = sources
    kw = dict(seq_len=31, seed=2, epochs=[0, 1], shard_samples=30, memory=64 << 10)
    one = shuffle(a, tmp_path / "one", **kw)
    two = shuffle([a], tmp_path / "two", executor=ExecutorConfig(workers=2, tasks=3), **kw)
    assert one.path == two.path == "out-of-core"
    assert tree(tmp_path / "one") == tree(tmp_path / "two")


def test_results_are_dataclasses_with_the_cli_json(sources, tmp_path):
    """Each call returns its dataclass; its to_json() is what the command prints under --json,
    with no 'lines' of human text inside."""
    a, b = sources
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    packed = pack([corpus], tmp_path / "src", eos_id=EOS, vocab_size=VOCAB)
    again = cli_json("pack", corpus, "-o", tmp_path / "src", "--eos-id", EOS, "--vocab-size", VOCAB)
    assert untimed(again) == untimed({**packed.to_json(), "status": "already complete", "input_bytes": 0})

    run = shuffle({a: 1, b: 1}, tmp_path / "run", seq_len=31, seed=3, epochs=1)
    checked = validate([tmp_path / "run"], against=[a, b])
    info = inspect(tmp_path / "run", batch_size=4, batches=3)
    staged = stage(tmp_path / "run", tmp_path / "copy", epochs="0", ranks="1/2")
    for result, kind in (
        (packed, PackResult),
        (run, ShuffleResult),
        (checked, ValidateResult),
        (info, InspectResult),
        (staged, StageResult),
    ):
        assert isinstance(result, kind) and dataclasses.is_dataclass(result)
        assert "lines" not in result.to_json()
        json.dumps(result.to_json())  # plain data only
    assert staged.ranks == [1] and staged.world_size == 2

    assert untimed(cli_json("validate", tmp_path / "run", "--against", a, "--against", b)) == untimed(checked.to_json())
    assert cli_json("inspect", tmp_path / "run", "--batch-size", 4, "--batches", 3) == info.to_json()
    assert "batch_diversity" in info.to_json() and "plot" not in info.to_json()  # optional facts: only when known
    restaged = cli_json("stage", tmp_path / "run", tmp_path / "copy", "--epochs", "0", "--ranks", "1/2")
    assert set(restaged) == set(staged.to_json()) and restaged["files"] == staged.files


PACK_KEYS = [
    "ok",
    "output",
    "status",
    "format",
    "inputs",
    "tokens",
    "documents",
    "shards",
    "bytes",
    "input_bytes",
    "seconds",
    "mb_per_s",
    "dtype",
    "vocab_size",
    "eos_id",
    "eos_appended",
    "empty_documents_dropped",
    "fingerprint",
    "warnings",
]
LINK_KEYS = ["linked_files", "linked_bytes", "reflinked_bytes", "copied_bytes", "link_notes"]  # with --link only
STAGE_KEYS = [
    "ok",
    "kind",
    "source",
    "dest",
    "epochs",
    "files",
    "copied_files",
    "skipped_files",
    "bytes_copied",
    "bytes_verified_in_place",
    "seconds",
    "mib_per_s",
    "partial",
]
RANKS_KEYS = ["ranks", "world_size", "micro_batch", "shards_skipped", "shards_total"]


def test_cli_json_keys_are_the_result_fields_in_order(sources, tmp_path):
    """pack, stage and inspect print under --json the keys of their result's to_json(), in the
    dataclass's order, which is the order --json has always had."""
    a, _ = sources
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    packed = pack(corpus, tmp_path / "src", eos_id=EOS, vocab_size=VOCAB)
    cli_pack = cli_json("pack", corpus, "-o", tmp_path / "src", "--eos-id", EOS, "--vocab-size", VOCAB)
    assert list(cli_pack) == list(packed.to_json()) == PACK_KEYS
    assert ["ok"] + [f.name for f in dataclasses.fields(PackResult)] == PACK_KEYS + LINK_KEYS
    linked = pack(corpus, tmp_path / "src2", eos_id=EOS, vocab_size=VOCAB, link=True)
    cli_linked = cli_json("pack", corpus, "-o", tmp_path / "src3", "--eos-id", EOS, "--vocab-size", VOCAB, "--link")
    assert list(cli_linked) == list(linked.to_json()) == PACK_KEYS + LINK_KEYS

    shuffle(a, tmp_path / "run", seq_len=31, seed=3, epochs=2)
    for extra, keys in (((), STAGE_KEYS), (("--epochs", "1", "--ranks", "0/2"), STAGE_KEYS + RANKS_KEYS)):
        kw = dict(zip(("epochs", "ranks"), extra[1::2]))
        staged = stage(tmp_path / "run", tmp_path / f"api{len(extra)}", **kw)
        cli_stage = cli_json("stage", tmp_path / "run", tmp_path / f"cli{len(extra)}", *extra)
        assert list(cli_stage) == list(staged.to_json()) == keys

    for args, kw in (
        ((), {}),
        (("--epoch", 1, "--batch-size", 4, "--batches", 2), dict(epoch=1, batch_size=4, batches=2)),
    ):
        info = inspect(tmp_path / "run", **kw)
        cli_inspect = cli_json("inspect", tmp_path / "run", *args)
        shown = ["ok"] + [f.name for f in dataclasses.fields(InspectResult) if getattr(info, f.name) is not None]
        assert list(cli_inspect) == list(info.to_json()) == shown and shown[:4] == ["ok", "kind", "path", "batch_size"]


def test_urls_are_staged_from_python(tmp_path):
    """pack and shuffle read and write fsspec URLs from Python as on the command line."""
    import fsspec

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    fs = fsspec.filesystem("memory")
    fs.pipe("/api-test/in/corpus.jsonl", corpus.read_bytes())
    try:
        packed = pack("memory://api-test/in", "memory://api-test/src", eos_id=EOS, vocab_size=VOCAB)
        run = shuffle("memory://api-test/src", "memory://api-test/run", seq_len=31, seed=1, epochs=1)
        got = {f[len("/api-test/run/") :]: fs.cat(f) for f in fs.find("/api-test/run")}
    finally:
        fs.rm("/api-test", recursive=True)
    pack([corpus], tmp_path / "src", eos_id=EOS, vocab_size=VOCAB)
    shuffle(tmp_path / "src", tmp_path / "run", seq_len=31, seed=1, epochs=1)
    local = tree(tmp_path / "run")
    assert packed.tokens > 0 and run.written == [0]
    assert set(got) == set(local) and all(got[k] == local[k] for k in local if k.endswith(".ds"))


def test_import_packer_is_light():
    """`import packer` gives the API without importing datatrove, torch or ray."""
    code = (
        "import sys, packer; from packer import pack, shuffle, validate, stage, inspect, ExecutorConfig; "
        "print(sorted(m for m in ('datatrove', 'torch', 'ray', 'numpy') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_api_names_survive_importing_the_modules():
    """No module of packer/ is named as an API function, so importing every one of them leaves
    tokpack.packer.pack, tokpack.packer.stage and tokpack.packer.inspect the functions."""
    import importlib
    import pkgutil

    import tokpack.packer

    modules = [m.name for m in pkgutil.iter_modules(tokpack.packer.__path__)]
    assert {"packing", "staging", "inspection"} <= set(modules) and not set(modules) & set(tokpack.packer.__all__)
    for name in modules:
        importlib.import_module(f"tokpack.packer.{name}")
    assert (
        tokpack.packer.pack,
        tokpack.packer.shuffle,
        tokpack.packer.validate,
        tokpack.packer.stage,
        tokpack.packer.inspect,
    ) == (pack, shuffle, validate, stage, inspect)


def test_shuffle_goes_to_a_process_pool_as_pack_does(sources, tmp_path):
    """`from tokpack import shuffle` is the subpackage made callable (tokpack/__init__.py); a module
    cannot be pickled, so `pool.submit(shuffle, ...)` was "cannot pickle '_ShufflePackage'
    object" where `pool.submit(pack, ...)` works: found running two shuffles in a process pool."""
    import multiprocessing
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    import tokpack

    assert pickle.loads(pickle.dumps(tokpack.shuffle)) is tokpack.shuffle
    a, _ = sources
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = pool.submit(tokpack.shuffle, a, tmp_path / "run", seq_len=31, seed=1).result()
    assert done.written == [0] and validate(tmp_path / "run").ok


def test_help_of_shuffle_is_the_functions():
    """`help(tokpack.shuffle)` (a notebook's `shuffle?`) showed the subpackage, which has no
    docstring: the package contents, not one word of what shuffle takes."""
    import pydoc

    import tokpack
    from tokpack.packer import api

    assert tokpack.shuffle.__doc__ == api.shuffle.__doc__
    assert "globally shuffled epochs" in pydoc.render_doc(tokpack.shuffle, renderer=pydoc.plaintext)


def _under_file_size_limit(args: list[str], limit: int) -> subprocess.CompletedProcess:
    """`python ARGS` run in a Python whose files cannot grow past `limit` bytes (RLIMIT_FSIZE, which
    root obeys too; SIGXFSZ ignored, so a write fails with EFBIG as on a full disk)."""
    import resource
    import signal

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, preexec_fn=limited)


def test_api_raises_the_clis_line_for_an_os_error_not_a_raw_one(tmp_path):
    """A write the system refuses midway (here the file-size limit, as a full disk would) was a
    raw OSError traceback from the Python API, with no file named, where the command printed one
    line: the API raises the TokpackError of that same line (naming the file), the OSError its
    cause, and the command's --json names the OSError as before."""
    docs = random_docs(np.random.default_rng(3), 120, VOCAB, EOS, max_len=20)
    src = write_source(tmp_path / "src", docs, vocab_size=VOCAB, docs_per_shard=1)  # small shards, a large manifest
    limit = 8000
    assert max(p.stat().st_size for p in src.iterdir() if p.name != "tokpack.json") < limit
    assert (src / "tokpack.json").stat().st_size > limit
    code = (
        "import errno, json, tokpack\n"
        "from tokpack.formats.errors import TokpackError\n"
        "try:\n"
        f"    tokpack.stage({str(src)!r}, {str(tmp_path / 'dest')!r})\n"
        "except TokpackError as e:\n"
        "    print(json.dumps([str(e), e.to_json(), type(e.__cause__).__name__, e.__cause__.errno == errno.EFBIG]))\n"
    )
    r = _under_file_size_limit(["-c", code], limit)
    assert r.returncode == 0 and r.stdout, r.stderr  # a raw OSError: a traceback, exit 1, nothing printed
    line, error, cause, efbig = json.loads(r.stdout)
    assert cause == "OSError" and efbig and error["error"] == "OSError"
    assert line.startswith(f"{tmp_path / 'dest' / 'tokpack.json'}: File too large (EFBIG). HINT: ")
    # the command, into a fresh DEST of the same name: the same line, and its --json object
    shutil.rmtree(tmp_path / "dest")
    r = _under_file_size_limit(["-m", "tokpack", "stage", str(src), str(tmp_path / "dest"), "--json"], limit)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"tokpack: error: {line}", r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["error"] == error


def test_api_raises_one_line_for_a_symlink_loop(tmp_path):
    """pathlib says a symlink loop as a RuntimeError (before Python 3.13): validate's raised it
    raw; it is the ELOOP line the command prints."""
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(TokpackError, match=r"loop: Too many levels of symbolic links \(ELOOP\)\. HINT: ") as e:
        validate([tmp_path / "loop"])
    assert isinstance(e.value.__cause__, (OSError, RuntimeError))
