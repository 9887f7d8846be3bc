"""The order of an epoch is proved (issue 24, item 6): `validate --against` compares, shard by
shard, the order hash of the samples read (tokpack.formats.shard_scan) with the one the plan's replay
gives (tokpack.shuffle.plan.replay_hashes). Epochs whose every field but the order is consistent (a swap
inside a shard, a swap across shards, a rotated shard, another seed's permutation) fail it; the
epochs the engine writes (in memory, out of core, weighted with repeats, scheduled) pass it.
Also the out-of-core order pass's scratch checksums: a bucket's positions or rows file that is
not what its scatter task wrote is refused before a misplaced sample is written, and with that
check gone the order proof is what catches the misplacement."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.hashes import hash_hex64, order_hash_terms
from tokpack.formats.reading import read_manifest
from tokpack.formats.shards import PackedSource, shard_suffixes
from tokpack.packer.api import shuffle, validate
from tokpack.packer.validation import validate_dirs
from tokpack.shuffle import steps
from tokpack.shuffle.plan import replay_hashes
from test_shuffle_integrity import cli
from test_engine_placement import KW as OOC_KW, bucket_files, refusal, scattered, scatter_folder  # noqa: F401
from tests.test_validate import EOS, SEQ_LEN, SHARD_SAMPLES, VOCAB, epoch_rows, load, rewrite_epoch, save

E0 = epoch_dir_name(0)
IN_MEMORY, OUT_OF_CORE = 64 << 20, 4096  # --memory for each engine path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """web/ and code/ sources; run/ (seed 1) and other/ (seed 2) of their whole windows, written in
    memory; ooc/ as run/ but out of core; mix/ weighted 1:3 with code repeated, both ways."""
    root = tmp_path_factory.mktemp("order-proof")
    write_source(root / "web", random_docs(np.random.default_rng(3), 60, VOCAB, EOS, max_len=120), docs_per_shard=20)
    write_source(root / "code", random_docs(np.random.default_rng(4), 15, VOCAB, EOS, max_len=120), docs_per_shard=6)
    srcs = [str(root / "web"), str(root / "code")]
    kw = dict(seq_len=SEQ_LEN, epochs=[0], shard_samples=SHARD_SAMPLES)
    paths = {
        "run": shuffle_run(srcs, str(root / "run"), seed=1, memory=IN_MEMORY, **kw)["path"],
        "other": shuffle_run(srcs, str(root / "other"), seed=2, memory=IN_MEMORY, **kw)["path"],
        "ooc": shuffle_run(srcs, str(root / "ooc"), seed=1, memory=OUT_OF_CORE, **kw)["path"],
    }
    for name, memory in (("mix-in-memory", IN_MEMORY), ("mix-out-of-core", OUT_OF_CORE)):
        paths[name] = shuffle_run(
            srcs, str(root / name), weights=["1", "3"], samples=400, seed=5, memory=memory, **{**kw, "epochs": [0, 1]}
        )["path"]
    assert paths == {
        "run": "in-memory",
        "other": "in-memory",
        "ooc": "out-of-core",
        "mix-in-memory": "in-memory",
        "mix-out-of-core": "out-of-core",
    }
    return root


@pytest.fixture
def env(base, tmp_path) -> Path:
    for name in ("web", "code", "run", "other"):
        shutil.copytree(base / name, tmp_path / name)
    return tmp_path


def sources(root: Path) -> list[str]:
    return [str(root / "web"), str(root / "code")]


def proved(epoch: Path, srcs: list[str]) -> list[int]:
    """The per-shard order hashes of an epoch's samples, asserted equal to its plan's, and the
    multiset replay equal to the recorded one: what --against compares, seen directly."""
    report = validate_dirs([epoch], order=True)
    assert report.ok, [p.line() for p in report.problems]
    (d,) = report.dirs
    m = read_manifest(epoch)
    multiset, planned = replay_hashes(m, [PackedSource.open(s) for s in srcs])
    assert multiset == m["sample_multiset_hash"]
    assert [d.shard_orders[s["path"]] for s in m["shards"]] == planned and len(planned) == len(m["shards"])
    return planned


def order_lines(result) -> list[tuple]:
    return [(Path(p["file"]).name, p["where"], p["message"]) for p in result.to_json()["problems"]]


def swap(rows: np.ndarray, a: int, b: int) -> np.ndarray:
    assert not np.array_equal(rows[a], rows[b])
    rows[[a, b]] = rows[[b, a]]
    return rows


def assert_only_order_wrong(epoch: Path, srcs: list[str], planned: list[int], first: int, wrong: int) -> None:
    """Everything but the order holds: the epoch validates alone and its multiset is the planned
    one (what --against checked before). Against its sources: one line, naming shard `first`."""
    assert validate(epoch).ok, validate(epoch).to_json()["problems"]
    m = load(epoch)
    assert replay_hashes(m, [PackedSource.open(s) for s in srcs], order=False)[0] == m["sample_multiset_hash"]
    r = validate(epoch, against=srcs)
    assert not r.ok and r.status == "corrupt"
    (p,) = r.to_json()["problems"]
    found = validate_dirs([epoch], order=True).dirs[0].shard_orders[f"{first:05d}.ds"]
    assert (p["file"], p["where"], p["expected"], p["found"], p["message"]) == (
        str(epoch / f"{first:05d}.ds"),
        "order_hash",
        f"{hash_hex64(planned[first])} (replayed from the sources)",
        f"{hash_hex64(found)} (from its samples)",
        f"sample order differs from the plan ({wrong} of {len(planned)} shards checked differ)",
    )
    assert "restore the epoch" in p["hint"]


# ------------------------------------------------------------------ what the engine writes passes


@pytest.mark.parametrize("name", ["run", "ooc", "mix-in-memory", "mix-out-of-core"])
def test_engine_epochs_pass_the_order_proof(base, name):
    for epoch in sorted((base / name).glob("epoch-*")):
        assert len(proved(epoch, sources(base))) > 1
    assert validate(base / name, against=sources(base)).ok


def test_both_engine_paths_give_the_proved_order(base):
    assert proved(base / "run" / E0, sources(base)) == proved(base / "ooc" / E0, sources(base))
    assert proved(base / "mix-in-memory" / E0, sources(base)) == proved(base / "mix-out-of-core" / E0, sources(base))


def test_mixture_with_repeats_is_proved(base):
    """code gives 300 of 400 samples from its few windows: each window at several positions, each
    position proved (a window's terms are added at every position the plan sends it to)."""
    m = load(base / "mix-in-memory" / E0)
    code = next(s for s in m["sources"] if s["name"] == "code")
    assert code["samples"] > 2 * code["windows"]
    proved(base / "mix-in-memory" / E0, sources(base))


SCHEDULE = f"""\
seq_len: {SEQ_LEN}
seed: 9
shard_samples: {SHARD_SAMPLES}
stages:
  - name: first
    epochs: 1
    sources: {{web: 0.7, code: 0.3}}
  - name: second
    tokens: 2K
    sources: {{code: 0.8, web: 0.2}}
"""


def test_scheduled_run_is_proved(base, tmp_path):
    for name in ("web", "code"):
        shutil.copytree(base / name, tmp_path / name)
    (tmp_path / "run.yaml").write_text(SCHEDULE)
    result = shuffle(None, tmp_path / "run", schedule=tmp_path / "run.yaml", memory=OUT_OF_CORE)
    assert result.written == [0, 1]
    for e in (0, 1):
        proved(tmp_path / "run" / epoch_dir_name(e), sources(tmp_path))
    assert validate(tmp_path / "run", against=sources(tmp_path)).ok


# ------------------------------------------------------------------ what only the order proof catches


def test_swapped_pair_inside_one_shard(env):
    epoch, srcs = env / "run" / E0, sources(env)
    planned = proved(epoch, srcs)
    rewrite_epoch(epoch, swap(epoch_rows(epoch), 1, 5))
    assert_only_order_wrong(epoch, srcs, planned, first=0, wrong=1)
    r = cli("validate", env / "run", "--against", srcs[0], "--against", srcs[1])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = [x for x in r.stdout.splitlines() + r.stderr.splitlines() if "order_hash" in x]
    assert line.startswith(f"CORRUPT {epoch / '00000.ds'} [order_hash]: sample order differs from the plan (1 of ")


def test_swapped_pair_across_two_shards(env):
    epoch, srcs = env / "run" / E0, sources(env)
    planned = proved(epoch, srcs)
    rewrite_epoch(epoch, swap(epoch_rows(epoch), 2 * SHARD_SAMPLES + 3, 4 * SHARD_SAMPLES + 1))
    assert_only_order_wrong(epoch, srcs, planned, first=2, wrong=2)


def test_shifted_shard(env):
    """Shard 3's rows rotated by one: every sample of the shard one position late."""
    epoch, srcs = env / "run" / E0, sources(env)
    planned = proved(epoch, srcs)
    rows = epoch_rows(epoch)
    a, b = 3 * SHARD_SAMPLES, 4 * SHARD_SAMPLES
    rows[a:b] = np.roll(rows[a:b], 1, axis=0)
    rewrite_epoch(epoch, rows)
    assert_only_order_wrong(epoch, srcs, planned, first=3, wrong=1)


def test_permutation_of_another_seed(env):
    """The shards of a seed-2 epoch under a manifest that says seed 1, its shard entries and
    sums taken over: a consistent epoch, with the same samples, in another seed's order."""
    epoch, srcs = env / "run" / E0, sources(env)
    planned = proved(epoch, srcs)
    other = env / "other" / E0
    m, o = load(epoch), load(other)
    assert (m["seed"], o["seed"]) == (1, 2) and m["sample_multiset_hash"] == o["sample_multiset_hash"]
    for s in o["shards"]:
        for suffix in shard_suffixes(s):  # the row hashes (.ds.rows) go with their samples
            shutil.copy(other / (s["path"] + suffix), epoch / (s["path"] + suffix))
    for key in ("shards", "fragments"):
        m[key] = o[key]
    save(epoch, m)
    wrong = sum(a != b for a, b in zip(planned, proved(other, srcs)))
    assert wrong == len(planned)  # another permutation moves samples in every shard
    assert_only_order_wrong(epoch, srcs, planned, first=0, wrong=wrong)


def test_quick_mode_does_not_claim_the_order(env):
    """--quick reads no samples: a swapped epoch still passes the manifest-level --against checks."""
    epoch, srcs = env / "run" / E0, sources(env)
    rewrite_epoch(epoch, swap(epoch_rows(epoch), 1, 5))
    assert validate(epoch, against=srcs, quick=True).ok


def test_terms_are_xxh3_64_of_position_and_row_hash():
    """The definition docs/FORMAT.md gives, byte by byte, for a reimplementation to follow."""
    g, h = np.array([0, 7, 2**40 + 3], dtype=np.int64), np.array([5, 2**64 - 1, 123456789], dtype=np.uint64)
    want = [xxhash.xxh3_64_intdigest(int(a).to_bytes(8, "little") + int(b).to_bytes(8, "little")) for a, b in zip(g, h)]
    assert order_hash_terms(g, h).tolist() == want


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    docs=st.integers(8, 60),
    seq_len=st.sampled_from([7, 15, 31]),
    shard_samples=st.integers(3, 40),
    memory=st.sampled_from([OUT_OF_CORE, IN_MEMORY]),
    epoch=st.integers(0, 2),
    mixture=st.none() | st.tuples(st.integers(1, 4), st.floats(0.3, 2.5)),
    data=st.data(),
)
def test_any_engine_epoch_is_proved_and_any_swap_caught(
    tmp_path_factory, seed, docs, seq_len, shard_samples, memory, epoch, mixture, data
):
    """Any corpus, seed, epoch and shard size, on either path, one source or a weighted pair whose
    epoch size is a random fraction of the windows (repeats and chains straddling passes): the
    engine's epoch is proved, and swapping any two distinct samples fails exactly their shards."""
    root = tmp_path_factory.mktemp("h")
    rng = np.random.default_rng(seed)
    srcs = [str(write_source(root / "a", random_docs(rng, docs, VOCAB, EOS, max_len=90), docs_per_shard=7))]
    kw = {}
    if mixture is not None:
        srcs.append(str(write_source(root / "b", random_docs(rng, 6, VOCAB, EOS, max_len=90), docs_per_shard=4)))
        windows = sum(PackedSource.open(s).tokens // (seq_len + 1) for s in srcs)
        kw = dict(weights=[str(mixture[0]), "1"], samples=max(2, int(windows * mixture[1])))
    shuffle_run(
        srcs,
        str(root / "run"),
        seq_len=seq_len,
        seed=seed,
        epochs=[epoch],
        shard_samples=shard_samples,
        memory=memory,
        **kw,
    )
    path = root / "run" / epoch_dir_name(epoch)
    planned = proved(path, srcs)
    m = load(path)
    rows = np.concatenate([np.fromfile(path / s["path"], dtype="<u2") for s in m["shards"]]).reshape(-1, seq_len + 1)
    a, b = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=2, max_size=2, unique=True))
    if np.array_equal(rows[a], rows[b]):
        return  # identical samples (a repeated window): the same epoch
    rows[[a, b]] = rows[[b, a]]
    for i, s in enumerate(m["shards"]):  # the checksums now fail too; the order hashes are what is looked at
        rows[i * shard_samples : i * shard_samples + s["samples"]].tofile(path / s["path"])
    found = validate_dirs([path], order=True).dirs[0].shard_orders
    assert {i for i, s in enumerate(m["shards"]) if found[s["path"]] != planned[i]} == {
        a // shard_samples,
        b // shard_samples,
    }


# ------------------------------------------------------------------ the out-of-core scratch checksums


def swap_in_bucket_file(out: Path, ext: str) -> Path:
    """Two records of one bucket file swapped: two rows (ext "rows"), or the positions of two rows
    ("pos"). Either way the bucket still holds each of its positions once, so only the file's
    checksum can tell that the rows would land in each other's places."""
    rows_file = next(f for f in sorted(out.rglob("b*.rows")) if f.stat().st_size >= 2 * steps_row_bytes())
    f = rows_file.with_suffix(f".{ext}")
    width = steps_row_bytes() if ext == "rows" else 8
    data = bytearray(f.read_bytes())
    first, second = bytes(data[:width]), bytes(data[width : 2 * width])
    assert first != second
    data[:width], data[width : 2 * width] = second, first
    f.write_bytes(bytes(data))
    return f


def steps_row_bytes() -> int:
    return (OOC_KW["seq_len"] + 1) * 2


@pytest.mark.parametrize("ext", ["pos", "rows"])
def test_bucket_file_swap_is_refused_by_its_checksum(scattered, ext):
    srcs, out = scattered
    f = swap_in_bucket_file(out, ext)
    table = np.fromfile(scatter_folder(f).with_suffix(".records"), dtype="<u8").reshape(-1, 3)
    recorded = int(table[int(f.stem[1:]), 1 if ext == "rows" else 2])
    found = xxhash.xxh3_64_intdigest(f.read_bytes())
    assert refusal(srcs, out) == (
        f"{f} [xxh3_64]: scatter bucket file does not match the checksum its task recorded; expected "
        f"{recorded:016x}, found {found:016x}. HINT: rerun the same command: the scatter task that wrote it runs again"
    )
    shuffle_run(srcs, str(out), **OOC_KW)  # the rerun redoes the task that wrote the file
    assert validate(out, against=srcs).ok


@pytest.mark.parametrize("ext", ["pos", "rows"])
def test_unchecked_bucket_swap_would_misplace_samples(scattered, monkeypatch, ext):
    """What the checksum above prevents: without it the order pass writes the two rows in each
    other's places; the epoch is consistent in itself and holds the planned multiset, and only
    the order proof fails it."""
    srcs, out = scattered
    swap_in_bucket_file(out, ext)
    monkeypatch.setattr(steps.OrderStep, "_check_file", lambda *a: None)
    shuffle_run(srcs, str(out), **OOC_KW)
    epoch = out / E0
    assert validate(out).ok
    m = load(epoch)
    assert replay_hashes(m, [PackedSource.open(s) for s in srcs], order=False)[0] == m["sample_multiset_hash"]
    lines = order_lines(validate(out, against=srcs))
    assert len(lines) == 1 and lines[0][1:] == (
        "order_hash",
        f"sample order differs from the plan (1 of {len(m['shards'])} shards checked differ)",
    ), lines


def test_replay_refuses_a_sample_count_its_shards_cannot_hold(env):
    """A manifest claiming 10^15 samples (its source entry made to agree) but listing a few shards:
    the replay refuses it by arithmetic, in one line, before it would walk 10^15 positions."""
    epoch, srcs = env / "run" / E0, sources(env)
    m = load(epoch)
    listed = len(m["shards"])
    m["sources"][0]["samples"] += 10**15 - m["samples"]
    m["samples"] = 10**15
    save(epoch, m)
    problems = validate(epoch, against=srcs).to_json()["problems"]
    lines = [
        (p["where"], p["message"], p["expected"], p["found"])
        for p in problems
        if p["where"] == "shards" and "do not hold" in p["message"]
    ]
    assert lines == [
        (
            "shards",
            "epoch manifest's shards do not hold its samples",
            f"{-(-(10**15) // SHARD_SAMPLES)} shards ({10**15} samples, {SHARD_SAMPLES} a shard)",
            f"{listed} shards",
        )
    ]
