"""`tokpack validate`: every fault of issue 5 injected into real directories (a packed source
and a real shuffled run), the detection table printed, and a hypothesis property: any
single-byte corruption of any file is caught by full validation."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.hashes import hash_hex64, xxh3_128_file
from tokpack.formats.shards import EpochShardWriter
from tokpack.packer.api import validate as validate_result
from tokpack.packer.validation import report_lines, validate_dirs
from tests.conftest import random_docs, write_source

VOCAB, EOS, SEQ_LEN, SHARD_SAMPLES = 1000, 0, 15, 8
ROW = SEQ_LEN + 1


def validate_all(*args, **kw) -> dict:
    """The result as `--json` prints it, and the lines the command prints for humans."""
    result = validate_result(*args, **kw)
    return {**result.to_json(), "lines": report_lines(result)}


def make_run(src: Path, out: Path, seed: int, epochs: list[int]) -> Path:
    """A real shuffled run (tokpack.shuffle.run), small shards so epochs have several."""
    from tests.conftest import shuffle_run

    shuffle_run(
        [str(src)],
        str(out),
        seq_len=SEQ_LEN,
        seed=seed,
        epochs=epochs,
        samples=None,
        tokens=None,
        shard_samples=SHARD_SAMPLES,
        memory=1 << 20,
        jitter=False,
        log=None,
    )
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """src/ (3 shards), run/ (seed 1, epochs 0 and 1), other/ (seed 2, epoch 0)."""
    root = tmp_path_factory.mktemp("validate-base")
    docs = random_docs(np.random.default_rng(3), 60, VOCAB, EOS, max_len=120)
    write_source(root / "src", docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=20)
    make_run(root / "src", root / "run", seed=1, epochs=[0, 1])
    make_run(root / "src", root / "other", seed=2, epochs=[0])
    return root


@pytest.fixture
def env(base, tmp_path) -> Path:
    """A private copy of the base directories, free to corrupt."""
    for name in ("src", "run", "other"):
        shutil.copytree(base / name, tmp_path / name)
    return tmp_path


# ------------------------------------------------------------------ fault helpers


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def load(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def save(path: Path, manifest: dict) -> None:
    """Rewrites a manifest exactly as tokpack writes it, as a buggy tool would."""
    (path / MANIFEST).write_bytes(json.dumps(manifest, indent=1).encode() + b"\n")


def reseal_source(src: Path) -> None:
    """Recomputes every checksum and the fingerprint after an edit, so only content checks remain."""
    from tokpack.formats.hashes import fingerprint

    m = load(src)
    for s in m["shards"]:
        s["xxh3_128"] = xxh3_128_file(src / s["path"])
        s["index_xxh3_128"] = xxh3_128_file(src / (s["path"] + ".index"))
    m["fingerprint"] = fingerprint([s["xxh3_128"] for s in m["shards"]], m["dtype"], m["vocab_size"], m["eos_id"])
    save(src, m)


def rewrite_epoch(epoch: Path, rows: np.ndarray) -> None:
    """Writes `rows` as the epoch's samples with the real shard writer and a manifest that agrees
    with them: what a shuffle bug that lost or repeated a sample would leave behind."""
    m = load(epoch)
    for s in m["shards"]:
        for suffix in ("", ".index", ".metadata"):
            (epoch / (s["path"] + suffix)).unlink()
    entries = []
    for i in range(0, len(rows), SHARD_SAMPLES):
        w = EpochShardWriter(epoch, f"{i // SHARD_SAMPLES:05d}.ds", np.dtype("<u2"), SEQ_LEN, EOS, m["tokenizer"])
        w.write_rows(rows[i : i + SHARD_SAMPLES])
        entries.append(w.close())
        entries[-1]["fragments"] = (epoch / (entries[-1]["path"] + ".index")).stat().st_size // 8
    m["shards"] = entries
    m["fragments"] = sum(e["fragments"] for e in entries)
    m["tokens"] = len(rows) * ROW
    m["sample_multiset_hash"] = hash_hex64(sum(int(e["multiset_hash"], 16) for e in entries))
    delta = len(rows) - m["samples"]
    m["samples"] = len(rows)
    m["sources"][0]["samples"] += delta
    save(epoch, m)


def epoch_rows(epoch: Path) -> np.ndarray:
    m = load(epoch)
    return np.concatenate([np.fromfile(epoch / s["path"], dtype="<u2") for s in m["shards"]]).reshape(-1, ROW)


# Each fault: (name, target directory, function(env)). "consistent" faults also rewrite the
# manifest to agree with the damage, so only the deeper checks can see them.
E0 = "run/epoch-00000"


def _swap(env, a, b):
    for suffix in ("", ".index", ".metadata"):
        pa, pb = env / E0 / (a + suffix), env / E0 / (b + suffix)
        tmp = pa.with_name("swap")
        pa.rename(tmp)
        pb.rename(pa)
        tmp.rename(pb)


def _from_other_epoch(env):
    for suffix in ("", ".index", ".metadata"):
        shutil.copy(env / "run/epoch-00001" / ("00000.ds" + suffix), env / E0 / ("00000.ds" + suffix))


def _extra_shard(env):
    n = len(load(env / E0)["shards"])
    for suffix in ("", ".index", ".metadata"):
        shutil.copy(env / E0 / ("00000.ds" + suffix), env / E0 / (f"{n:05d}.ds" + suffix))


def _delete_shard(env):
    for suffix in ("", ".index", ".metadata"):
        (env / E0 / ("00001.ds" + suffix)).unlink()


def _manifest_value(path: Path, key: str):
    """Flips the lowest bit of the last digit of the first `"key": <int>` in a manifest."""
    text = (path / MANIFEST).read_bytes()
    at = text.index(f'"{key}": '.encode()) + len(key) + 4
    while chr(text[at]).isdigit():
        at += 1
    flip_bit(path / MANIFEST, at - 1)


def _set_token(env, token: int, value: int, reseal: bool):
    p = env / "src/00001.ds"
    a = np.fromfile(p, dtype="<u2")
    a[token] = value
    a.tofile(p)
    if reseal:
        reseal_source(env / "src")


def _missing_eos(env, reseal: bool):
    ends = np.fromfile(env / "src/00001.ds.index", dtype="<u8")
    _set_token(env, int(ends[3]) - 1, 7, reseal)


def _dtype_label(env):
    m = load(env / "src")
    m["dtype"] = "uint32"
    save(env / "src", m)


def _duplicate_sample(env, consistent: bool):
    rows = epoch_rows(env / E0)
    if consistent:  # sample 5 written twice, sample 6 lost: counts unchanged
        rows[6] = rows[5]
        rewrite_epoch(env / E0, rows)
    else:  # sample 1 overwritten with sample 0, in place
        p = env / E0 / "00000.ds"
        a = np.fromfile(p, dtype="<u2").reshape(-1, ROW)
        a[1] = a[0]
        a.tofile(p)


def _drop_sample(env, consistent: bool):
    rows = epoch_rows(env / E0)
    if consistent:
        rewrite_epoch(env / E0, rows[:-1])
    else:
        m = load(env / E0)
        p = env / E0 / m["shards"][-1]["path"]
        p.write_bytes(p.read_bytes()[: -ROW * 2])


FAULTS = {
    "bit flip in a source token": ("src", lambda env: flip_bit(env / "src/00001.ds", 101, 3)),
    "bit flip in an epoch token": (E0, lambda env: flip_bit(env / E0 / "00001.ds", 77, 5)),
    "bit flip in a source index": ("src", lambda env: flip_bit(env / "src/00000.ds.index", 8 * 5, 1)),
    "bit flip in an epoch index": (E0, lambda env: flip_bit(env / E0 / "00000.ds.index", 8 * 2, 0)),
    "bit flip in a source manifest value": ("src", lambda env: _manifest_value(env / "src", "documents")),
    "bit flip in an epoch manifest value": (E0, lambda env: _manifest_value(env / E0, "seed")),
    "truncated source shard": (
        "src",
        lambda env: (env / "src/00002.ds").write_bytes((env / "src/00002.ds").read_bytes()[:-2]),
    ),
    "truncated epoch shard": (
        E0,
        lambda env: (env / E0 / "00000.ds").write_bytes((env / E0 / "00000.ds").read_bytes()[: -ROW * 2]),
    ),
    "extended epoch shard": (E0, lambda env: (env / E0 / "00000.ds").open("ab").write(b"\x01\x00" * ROW)),
    "extended source shard": ("src", lambda env: (env / "src/00000.ds").open("ab").write(b"\x00\x00")),
    "deleted shard": (E0, _delete_shard),
    "extra shard": (E0, _extra_shard),
    "two shards swapped": (E0, lambda env: _swap(env, "00000.ds", "00001.ds")),
    "shard taken from another epoch": (E0, _from_other_epoch),
    "duplicated sample": (E0, lambda env: _duplicate_sample(env, False)),
    "dropped sample": (E0, lambda env: _drop_sample(env, False)),
    "duplicated sample, manifest rewritten to match": (E0, lambda env: _duplicate_sample(env, True)),
    "dropped sample, manifest rewritten to match": (E0, lambda env: _drop_sample(env, True)),
    "token >= vocab_size": ("src", lambda env: _set_token(env, 10, VOCAB, False)),
    "token >= vocab_size, checksums rewritten": ("src", lambda env: _set_token(env, 10, VOCAB + 5, True)),
    "missing EOS": ("src", lambda env: _missing_eos(env, False)),
    "missing EOS, checksums rewritten": ("src", lambda env: _missing_eos(env, True)),
    "epoch manifest from another run": (
        E0,
        lambda env: shutil.copy(env / "other/epoch-00000" / MANIFEST, env / E0 / MANIFEST),
    ),
    "empty shard file": (E0, lambda env: (env / E0 / "00001.ds").write_bytes(b"")),
    "empty metadata file": ("src", lambda env: (env / "src/00000.ds.metadata").write_bytes(b"")),
    "wrong dtype label": ("src", _dtype_label),
    "zero-byte source manifest": ("src", lambda env: (env / "src" / MANIFEST).write_bytes(b"")),
    "zero-byte epoch manifest": (E0, lambda env: (env / E0 / MANIFEST).write_bytes(b"")),
}
# Only a replay of the plan can tell these from a correct epoch: the manifest agrees with the data.
NEEDS_AGAINST = {"duplicated sample, manifest rewritten to match", "dropped sample, manifest rewritten to match"}
# (the dropped one is also caught without --against: its per-source pass bookkeeping no longer adds up)


def detect(env: Path, target: str) -> dict:
    """Validates the directory holding the fault the way a user would: an epoch through its run."""
    path = env / ("run" if target.startswith("run") else target)
    full = validate_all([str(path)], quick=False, against=[], workers=2, show_progress=False)
    quick = validate_all([str(path)], quick=True, against=[], workers=1, show_progress=False)
    against = (
        validate_all([str(path)], quick=False, against=[str(env / "src")], show_progress=False)
        if target != "src"
        else full
    )
    return {"full": full, "quick": quick, "against": against}


@pytest.fixture(scope="module")
def detections(base, tmp_path_factory) -> dict:
    """Every fault injected into its own copy of the base directories, validated three ways."""
    out = {}
    for i, (fault, (target, inject)) in enumerate(FAULTS.items()):
        env = tmp_path_factory.mktemp(f"fault{i}")
        for name in ("src", "run", "other"):
            shutil.copytree(base / name, env / name)
        inject(env)
        out[fault] = detect(env, target)
    return out


def test_clean_directories_validate(base):
    for quick in (False, True):
        r = validate_all(
            [str(base / "src"), str(base / "run"), str(base / "other")],
            quick=quick,
            against=[str(base / "src")],
            workers=2,
            show_progress=False,
        )
        assert r["ok"], r["lines"]
        assert r["status"] == "ok" and r["problems"] == []
        assert {d["kind"] for d in r["dirs"]} == {"source", "run", "epoch"}
        assert r["files"] > 10 and r["bytes"] > 0


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_detected(detections, fault):
    r = detections[fault]
    if fault in NEEDS_AGAINST:
        assert not r["against"]["ok"]
        assert any("plan" in p["message"] for p in r["against"]["problems"]), r["against"]["lines"]
    else:
        assert not r["full"]["ok"], f"{fault}: full validation passed"
        assert r["full"]["status"] == "corrupt", r["full"]["lines"]
        assert all(p["file"] for p in r["full"]["problems"])
        assert not r["against"]["ok"]


def test_detection_table(detections, capsys):
    """The table issue 5 asks for: which mode catches which fault. Printed even without -s."""
    rows = []
    for fault, (target, _) in FAULTS.items():
        r = detections[fault]
        first = (r["against"] if fault in NEEDS_AGAINST else r["full"])["problems"][0]
        rows.append(
            (
                fault,
                target.split("/")[0],
                not r["quick"]["ok"],
                not r["full"]["ok"],
                not r["against"]["ok"],
                first["message"] + (f" [{first['where']}]" if first["where"] else ""),
            )
        )
    assert all(full or (fault in NEEDS_AGAINST and against) for fault, _, _, full, against, _ in rows)
    assert all(against for *_, against, _ in rows)
    width = max(len(r[0]) for r in rows)
    yes = lambda b: "yes" if b else "-"  # noqa: E731
    lines = [f"{'fault':<{width}}  dir  quick  full  against  first problem reported", "-" * (width + 70)]
    lines += [f"{f:<{width}}  {t:<3}  {yes(q):<5}  {yes(fu):<4}  {yes(a):<7}  {m}" for f, t, q, fu, a, m in rows]
    with capsys.disabled():
        print("\n\nvalidate: fault detection (quick / full / full --against SOURCE)\n" + "\n".join(lines) + "\n")


def test_incomplete_is_not_corrupt(env):
    (env / E0 / MANIFEST).unlink()
    r = validate_all([str(env / "run")], quick=False, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "incomplete", r["lines"]
    assert all(p["severity"] == "incomplete" for p in r["problems"])
    assert "INCOMPLETE" in r["lines"][0]
    # the epoch directory on its own, and a source without its manifest
    r = validate_all([str(env / E0)], quick=True, against=[], workers=1, show_progress=False)
    assert r["status"] == "incomplete"
    (env / "src" / MANIFEST).unlink()
    assert validate_all([str(env / "src")], quick=True, against=[], workers=1)["status"] == "incomplete"


def test_wrong_paths_are_errors_not_incomplete(env):
    r = validate_all([str(env / "src/00000.ds"), str(env / "nope")], quick=True, against=[], workers=1)
    assert r["status"] == "corrupt" and [p["message"] for p in r["problems"]] == [
        "not a directory",
        "no such directory",
    ]
    assert _all_lines(r)[0] == (str(env / "src/00000.ds"), None, "a tokpack directory", "a file", "not a directory")


def test_unlisted_epoch_is_incomplete(env):
    shutil.copytree(env / "run/epoch-00001", env / "run/epoch-00002")
    r = validate_all([str(env / "run")], quick=True, against=[], workers=1)
    assert r["status"] == "incomplete", r["lines"]


def test_tmp_files_are_not_data(env):
    (env / E0 / f"00000.ds{TMP_MARK}123-abcd").write_bytes(b"junk")
    (env / "src" / f"{MANIFEST}{TMP_MARK}9-x").write_bytes(b"{")
    assert validate_all([str(env / "run"), str(env / "src")], quick=False, against=[], workers=1)["ok"]


def test_against_wrong_source(env, tmp_path):
    other = write_source(tmp_path / "src2", random_docs(np.random.default_rng(9), 30, VOCAB, EOS), vocab_size=VOCAB)
    r = validate_all([str(env / "run")], quick=True, against=[str(other)], workers=1)
    assert not r["ok"]
    assert any(p["where"] == "sources" and p["severity"] == "unverified" for p in r["problems"]), r["lines"]


def test_problem_lines_name_file_where_expected_found(env):
    _set_token(env, 10, VOCAB, True)
    r = validate_all([str(env / "src")], quick=False, against=[], workers=1)
    (p,) = r["problems"]
    assert p["file"].endswith("00001.ds") and p["where"].startswith("token 10")
    assert p["expected"] == f"< {VOCAB} (vocab_size)" and p["found"] == str(VOCAB)
    assert r["lines"][0].startswith("CORRUPT ") and "00001.ds [token 10" in r["lines"][0]


def test_cli_exit_codes_and_json(env):
    cmd = [sys.executable, "-m", "tokpack.packer.cli", "validate"]
    ok = subprocess.run(
        cmd + [str(env / "src"), "--json"], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert ok.returncode == 0, ok.stderr
    rep = json.loads(ok.stdout)
    assert rep["ok"] and rep["files"] > 0 and rep["mb_per_s"] >= 0 and {"bytes", "seconds"} <= rep.keys()
    flip_bit(env / "src/00000.ds", 3)
    bad = subprocess.run(cmd + [str(env / "src")], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert bad.returncode == 1 and "checksum mismatch" in bad.stderr and "Traceback" not in bad.stderr
    usage = subprocess.run(cmd + ["--no-such-flag"], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert usage.returncode == 2


def test_workers_give_the_same_report(env):
    flip_bit(env / E0 / "00001.ds", 9)
    flip_bit(env / "src/00002.ds.index", 17)
    a = validate_dirs([env / "src", env / "run"], quick=False, workers=1, show_progress=False)
    b = validate_dirs([env / "src", env / "run"], quick=False, workers=4, show_progress=False)
    assert [p.line() for p in a.problems] == [p.line() for p in b.problems] and len(a.problems) >= 2


def test_blocks_smaller_than_a_shard(env, monkeypatch):
    """The streaming path (several blocks per file, index consumed across blocks) on real data."""
    import tokpack.formats.shard_scan as v

    monkeypatch.setattr(v, "BLOCK", 64)
    assert validate_dirs([env / "src", env / "run"], quick=False, workers=1).ok
    _missing_eos(env, True)
    r = validate_dirs([env / "src"], quick=False, workers=1)
    assert [p.message for p in r.problems] == ["document does not end with EOS"]


# ------------------------------------------------------------------ property


@pytest.fixture(scope="module")
def corruptible(base, tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("prop")
    shutil.copytree(base / "src", root / "src")
    shutil.copytree(base / "run", root / "run")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return root, files


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_corruption_is_detected(corruptible, data):
    root, files = corruptible
    path = data.draw(st.sampled_from(files), label="file")
    raw = path.read_bytes()
    offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != raw[offset]), label="new byte")
    path.write_bytes(raw[:offset] + bytes([value]) + raw[offset + 1 :])
    try:
        r = validate_dirs([root / "src", root / "run"], quick=False, workers=1, show_progress=False)
    finally:
        path.write_bytes(raw)
    assert not r.ok, f"undetected: {path.relative_to(root)} byte {offset} {raw[offset]} -> {value}"


def test_real_pack_and_weighted_jittered_shuffle_validate(tmp_path):
    """No false alarms on the other writers' real outputs: `pack` from JSONL token lists, and a
    two-source weighted, jittered, upsampling shuffle over three epochs."""
    from tests.conftest import pack, shuffle_run

    rng = np.random.default_rng(5)
    (tmp_path / "in.jsonl").write_text(
        "".join(
            json.dumps({"input_ids": rng.integers(1, VOCAB, int(rng.integers(1, 90))).tolist()}) + "\n"
            for _ in range(150)
        )
    )
    pack([str(tmp_path / "in.jsonl")], str(tmp_path / "a"), eos_id=EOS, vocab_size=VOCAB, shard_tokens=2500)
    write_source(tmp_path / "b", random_docs(np.random.default_rng(6), 20, VOCAB, EOS, max_len=60), vocab_size=VOCAB)
    sources = [str(tmp_path / "a"), str(tmp_path / "b")]
    shuffle_run(
        sources,
        str(tmp_path / "run"),
        weights=["0.3", "0.7"],
        seq_len=SEQ_LEN,
        seed=4,
        epochs=[0, 1, 2],
        samples=300,
        tokens=None,
        shard_samples=40,
        memory=1 << 20,
        jitter=True,
        log=None,
    )
    dirs = [str(tmp_path / x) for x in ("a", "b", "run")]
    r = validate_all(dirs, quick=False, against=dirs[:2], workers=2, show_progress=False)
    assert r["ok"], r["lines"]
    m = load(tmp_path / "run/epoch-00002")
    assert m["jitter"] and m["sources"][1]["first_pass"] > 0 and len(r["dirs"]) == 6  # b is upsampled
    # the same run checked against only one of its sources is refused
    r = validate_all([dirs[2]], quick=True, against=dirs[:1], workers=1, show_progress=False)
    assert not r["ok"] and all(p["where"] == "sources" and p["severity"] == "unverified" for p in r["problems"])


# ------------------------------------------------------------------ --against tells the truth (issue 12)


def test_against_one_source_of_a_mixed_run_is_unverified_not_corrupt(tmp_path):
    """A run mixed from web and code, validated --against web only: every epoch is reported
    UNVERIFIED, naming code's fingerprint; no epoch is printed OK or marked "ok" in the JSON."""
    from tests.conftest import shuffle_run

    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(1), 60, VOCAB, EOS), vocab_size=VOCAB)
    code = write_source(tmp_path / "code", random_docs(np.random.default_rng(2), 40, VOCAB, EOS), vocab_size=VOCAB)
    shuffle_run(
        [str(web), str(code)],
        str(tmp_path / "run"),
        weights=["0.7", "0.3"],
        seq_len=SEQ_LEN,
        seed=1,
        epochs=[0, 1],
        samples=200,
        tokens=None,
        shard_samples=50,
        memory=1 << 20,
        jitter=False,
        log=None,
    )
    code_fp = load(code)["fingerprint"]
    cmd = [sys.executable, "-m", "tokpack.packer.cli", "validate", str(tmp_path / "run"), "--against", str(web)]
    human = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    as_json = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert human.returncode == 1 and as_json.returncode == 1
    lines = human.stderr.splitlines()
    problem_lines = [x for x in lines if "not given to --against" in x]
    assert len(problem_lines) == 2, lines
    for line in problem_lines:
        assert line.startswith("UNVERIFIED ") and code_fp in line and "code" in line
        assert "edited" not in line and "CORRUPT" not in line
        assert f"--against {code}" in line  # the hint names what to add
    assert not any(x.startswith("OK epoch") for x in lines), lines
    assert sum(x.startswith("UNVERIFIED epoch") for x in lines) == 2
    assert lines[-1].startswith("UNVERIFIED:")
    r = json.loads(as_json.stdout)
    assert not r["ok"] and r["status"] == "unverified"
    epochs = [d for d in r["dirs"] if d["kind"] == "epoch"]
    assert len(epochs) == 2 and all(d["status"] == "unverified" and d["problems"] == 1 for d in epochs), r["dirs"]
    assert [p["severity"] for p in r["problems"]] == ["unverified", "unverified"]
    assert all(code_fp in p["found"] for p in r["problems"])
    # with both sources the same run validates
    both = validate_all([str(tmp_path / "run")], quick=False, against=[str(web), str(code)], workers=1)
    assert both["ok"], both["lines"]


def test_epoch_multiset_line_expects_the_recorded_hash(env):
    """An altered sample whose shard checksums were rewritten: the epoch's multiset line
    expects what its manifest records and found what its samples hash to."""
    from tokpack.formats.hashes import row_hashes

    m = load(env / E0)
    recorded = m["sample_multiset_hash"]
    shard = env / E0 / m["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    rows = np.frombuffer(bytes(data), dtype="<u2").reshape(-1, ROW)
    # a token in the middle of a row, not EOS before or after: the index stays right
    r_, c_ = next((r, c) for r in range(len(rows)) for c in range(1, ROW - 1) if rows[r, c] not in (EOS, 1))
    data[(r_ * ROW + c_) * 2 : (r_ * ROW + c_) * 2 + 2] = (1).to_bytes(2, "little")
    shard.write_bytes(bytes(data))
    found = int(row_hashes(np.frombuffer(bytes(data), dtype="<u2").reshape(-1, ROW)).sum(dtype=np.uint64))
    for d in m["shards"][1:]:
        found = (found + int(d["multiset_hash"], 16)) & ((1 << 64) - 1)
    r = validate_all([str(env / E0)], quick=False, against=[], workers=1, show_progress=False)
    (line,) = [p for p in r["problems"] if p["where"] == "sample_multiset_hash" and p["file"] == str(env / E0)]
    assert line["expected"].startswith(recorded), line
    assert line["found"].startswith(hash_hex64(found)), line


def test_a_bug_in_validate_is_not_reported_as_corrupt_data(base, monkeypatch):
    """An exception that is not about the data (here a KeyError standing for a bug in a shard
    check) propagates: the report must not blame the data for it."""
    import tokpack.packer.validation as fv

    def buggy_check(job):
        raise KeyError("a field tokpack forgot")

    monkeypatch.setattr(fv, "check_shard", buggy_check)
    with pytest.raises(KeyError):
        validate_dirs([base / "src"], quick=False, workers=2, show_progress=False)


def test_an_unreadable_shard_file_is_still_a_data_problem(env):
    """OSError stays a data problem: a metadata file replaced by a directory is one CORRUPT line."""
    meta = env / "src/00000.ds.metadata"
    meta.unlink()
    meta.mkdir()
    r = validate_all([str(env / "src")], quick=False, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "corrupt"
    (p,) = r["problems"]
    assert (p["file"], p["where"], p["expected"], p["found"], p["message"]) == (
        str(meta),
        None,
        "a regular file",
        "a directory",
        "not a regular file",
    ), r["lines"]


# ------------------------------------------------------------------ checks no other check covers


def reseal_epoch_index(epoch: Path, shard: str) -> None:
    """Records the index file's current checksum in the epoch manifest, as a buggy writer would."""
    m = load(epoch)
    for s in m["shards"]:
        if s["path"] == shard:
            s["index_xxh3_128"] = xxh3_128_file(epoch / (shard + ".index"))
    save(epoch, m)


def test_swapped_rows_fail_on_the_row_hashes(env, tmp_path):
    """Two samples of an epoch shard swapped, the index rewritten by the real writer: sizes,
    index, metadata, fragment count and sample multiset all stay valid. Only the shard's row
    hashes (`.ds.rows`, in order, which vouch for its tokens) can tell, and they must, naming
    the first row that moved (and, against the sources, the order proof)."""
    shard = env / E0 / "00000.ds"
    rows = np.fromfile(shard, dtype="<u2").reshape(-1, ROW)
    assert not np.array_equal(rows[0], rows[3])
    rows[[0, 3]] = rows[[3, 0]]
    rows.tofile(shard)
    w = EpochShardWriter(tmp_path, "00000.ds", np.dtype("<u2"), SEQ_LEN, EOS, load(env / E0)["tokenizer"])
    w.write_rows(rows)
    entry = w.close()
    shutil.copy(tmp_path / "00000.ds.index", env / E0 / "00000.ds.index")
    reseal_epoch_index(env / E0, "00000.ds")
    before = next(s for s in load(env / E0)["shards"] if s["path"] == "00000.ds")
    assert entry["multiset_hash"] == before["multiset_hash"] and entry["rows_xxh3_128"] != before["rows_xxh3_128"]
    r = validate_all([str(env / "run")], quick=False, against=[str(env / "src")], workers=1, show_progress=False)
    assert [(Path(p["file"]).name, p["where"], p["message"]) for p in r["problems"]] == [
        ("00000.ds", "row 0 (byte 0)", "checksum mismatch"),
        ("00000.ds", "order_hash", "sample order differs from the plan (1 of 27 shards checked differ)"),
    ], r["lines"]
    assert r["status"] == "corrupt"


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_epoch_index_with_fewer_entries_than_samples(env, quick):
    """An epoch index cut to 7 entries for a shard of 8 samples, with the shard's and the
    epoch's fragment counts and the index checksum rewritten to agree: every sample ends a fragment, so
    the index size alone proves the shard wrong, and the line says what size it has."""
    idx = env / E0 / "00001.ds.index"
    idx.write_bytes(idx.read_bytes()[: 7 * 8])
    m = load(env / E0)
    m["fragments"] -= m["shards"][1]["fragments"] - 7
    m["shards"][1]["fragments"] = 7
    save(env / E0, m)
    reseal_epoch_index(env / E0, "00001.ds")
    r = validate_all([str(env / "run")], quick=quick, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "corrupt", r["lines"]
    assert [
        (p["where"], p["expected"], p["found"], p["message"])
        for p in r["problems"]
        if p["file"].endswith("00001.ds.index")
    ] == [
        (
            "size",
            f"a multiple of 8 in [{8 * SHARD_SAMPLES}, {8 * SHARD_SAMPLES * ROW}] bytes",
            "56 bytes",
            "index size impossible for this shard",
        )
    ], r["lines"]


def _index_fault(path: Path, how: str) -> int:
    """Repeats or reverses entries 2 and 3 of an index; returns the entry number reported."""
    a = np.fromfile(path, dtype="<u8")
    if how == "repeated":
        a[3] = a[2]
    else:
        a[[2, 3]] = a[[3, 2]]
    a.tofile(path)
    return 3


@pytest.mark.parametrize("how", ["repeated", "decreasing"])
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_source_index_not_increasing(env, how, quick):
    """A source index whose entries repeat or decrease, checksums rewritten to match, so only
    the order check can see it (a repeated end still points just past an EOS)."""
    k = _index_fault(env / "src/00001.ds.index", how)
    reseal_source(env / "src")
    r = validate_all([str(env / "src")], quick=quick, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "corrupt"
    (p,) = r["problems"]
    assert p["file"].endswith("00001.ds.index") and p["where"] == f"entry {k}", r["lines"]
    assert p["message"] == "index does not increase"


@pytest.mark.parametrize("how", ["repeated", "decreasing"])
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_epoch_index_not_increasing(env, how, quick):
    k = _index_fault(env / E0 / "00001.ds.index", how)
    reseal_epoch_index(env / E0, "00001.ds")
    r = validate_all([str(env / "run")], quick=quick, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "corrupt"
    idx = [p for p in r["problems"] if p["file"].endswith("00001.ds.index")]
    assert idx and all(p["where"] == f"entry {k}" for p in idx), r["lines"]
    assert idx[0]["message"] in ("index does not increase", "index disagrees with the tokens")
    if quick:  # the index alone: only its order can tell
        assert [p["message"] for p in idx] == ["index does not increase"]


def _edit(m: dict, path: str, value) -> None:
    """Sets m[a][b]... along a dotted path (integers index lists); value None deletes."""
    *head, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    for k in head:
        m = m[k]
    if value is None:
        del m[last]
    elif callable(value):
        m[last] = value(m[last])
    else:
        m[last] = value


# (directory, dotted field, new value or function of the old one) -> the problem reported
# (where, expected, found); the base run has 210 samples in 27 shards of 8, 15 dropped tokens.
MANIFEST_EDITS = [
    (E0, "sources.0.offset", 3, ("sources[0].offset", "< 16 and 0 without jitter", "3")),
    (
        E0,
        "sources.0.windows",
        lambda v: v + 1,
        ("sources[0].windows", "windows x 16 + dropped_tokens == tokens (3375)", "211 x 16 + 15"),
    ),
    (E0, "sources.0.first_pass", 1, ("sources[0].first_pass/passes", "0/1 (epoch 0, 210 of 210 windows)", "1/1")),
    (E0, "sources.0.passes", 2, ("sources[0].first_pass/passes", "0/1 (epoch 0, 210 of 210 windows)", "0/2")),
    (E0, "jitter_offsets", [5], ("jitter_offsets[0]", "0", "5")),
    (E0, "jitter_offsets", [], ("jitter_offsets[0]", "0", "no entry")),
    (E0, "dropped_tokens", lambda v: v + 1, ("dropped_tokens", "15 (sum over sources)", "16")),
    (E0, "fragments", lambda v: v + 1, ("fragments", "262 (sum of the shards' fragments)", "263")),
    (E0, "epoch", 1, ("epoch", "0 (from the directory name)", "1")),
    (E0, "samples", lambda v: v + 1, ("samples", "210 (sum over shards)", "211")),
    (E0, "shards.0.tokens", lambda v: v + ROW, ("shards[0].tokens", "128 (samples x 16)", "144")),
    (E0, "shards.0.samples", lambda v: v - 1, ("shards[0].samples", "8", "7")),
    (E0, "shards.26.samples", SHARD_SAMPLES + 1, ("shards[26].samples", "1..8", "9")),
    (E0, "sources.0", 5, ("sources[0]", "an object", "5")),
    (
        E0,
        "sample_multiset_hash",
        "0" * 16,
        ("sample_multiset_hash", "e73f96199c6c04f9 (sum of the shards' multiset_hash)", "0000000000000000"),
    ),
    (E0, "shards.0.xxh3_128", "XYZ", ("shards[0].xxh3_128", "32 lowercase hex digits", "'XYZ'")),
    (E0, "seed", None, ("seed", "field 'seed'", "no such field")),
    (E0, "seed", "1", ("seed", "a JSON int", "'1'")),
    (E0, "seq_len", -1, ("seq_len", ">= 1", "-1")),
    ("src", "tokens", lambda v: v + 1, ("tokens", "3375 (sum over shards)", "3376")),
    ("src", "eos_id", VOCAB, ("eos_id", "< 1000 (vocab_size)", "1000")),
    ("src", "dtype", "int8", ("dtype", "uint16 or uint32", "int8")),
    ("src", "shards.1.documents", 0, ("shards[1].documents", "1..989", "0")),
    ("src", "shards.1.path", "../x.ds", ("shards[1].path", "a plain NNNNN.ds file name", "'../x.ds'")),
    ("run", "epochs", [0, 0], ("epochs", "distinct epoch numbers >= 0", "[0, 0]")),
]


@pytest.mark.parametrize(
    "target,field,value,problem",
    MANIFEST_EDITS,
    ids=[f"{t}:{f}={v if not callable(v) else 'edit'}" for t, f, v, _ in MANIFEST_EDITS],
)
def test_manifest_field_checks(env, target, field, value, problem):
    """Each consistency rule of a manifest, broken alone: validation names that field, what it
    expected and what it found."""
    m = load(env / target)
    _edit(m, field, value)
    save(env / target, m)
    path = env / ("run" if target.startswith("run") else target)
    r = validate_all([str(path)], quick=True, against=[], workers=1, show_progress=False)
    assert not r["ok"] and r["status"] == "corrupt", r["lines"]
    assert problem in [(p["where"], p["expected"], p["found"]) for p in r["problems"]], r["lines"]


@pytest.fixture
def lossy(tmp_path) -> Path:
    """A source whose shards carry a .loss mask (datatrove's save_loss_metadata), written with
    the project's shard writer."""
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.names import shard_name

    docs = random_docs(np.random.default_rng(11), 40, VOCAB, EOS, max_len=50)
    src = tmp_path / "lossy"
    src.mkdir()
    entries = []
    for i in range(2):
        group = docs[20 * i : 20 * (i + 1)]
        toks = np.concatenate(group).astype("<u2")
        w = SourceShardWriter(src, shard_name(i), np.dtype("<u2"), "test-tokenizer", with_loss=True)
        w.write(toks, np.cumsum([len(d) for d in group]), (np.arange(len(toks)) % 3 > 0).astype(np.uint8))
        entries.append(w.close())
    write_manifest(src, source_manifest(entries, np.dtype("<u2"), VOCAB, EOS, "test-tokenizer"))
    return src


def _loss_value(src: Path, value: int, reseal: bool) -> None:
    p = src / "00001.ds.loss"
    a = np.fromfile(p, dtype=np.uint8)
    a[7] = value
    a.tofile(p)
    if reseal:
        m = load(src)
        m["shards"][1]["loss_xxh3_128"] = xxh3_128_file(p)
        save(src, m)


LOSS_FAULTS = {
    "clean": (lambda src: None, []),
    "value 2": (lambda src: _loss_value(src, 2, True), [("00001.ds.loss", "byte 7", "loss mask value invalid")]),
    "flipped 0/1": (
        lambda src: _loss_value(src, 1 - int(np.fromfile(src / "00001.ds.loss", np.uint8)[7]), False),
        [("00001.ds.loss", "xxh3_128", "checksum mismatch")],
    ),
    "missing": (lambda src: (src / "00000.ds.loss").unlink(), [("00000.ds.loss", None, "loss mask missing")]),
    "short": (
        lambda src: (src / "00000.ds.loss").write_bytes((src / "00000.ds.loss").read_bytes()[:-1]),
        [("00000.ds.loss", "size", "loss mask size wrong")],
    ),
    "unlisted": (lambda src: _unlist_loss(src), [("00000.ds.loss", None, "file not listed in the manifest")]),
}


def _unlist_loss(src: Path) -> None:
    m = load(src)
    del m["shards"][0]["loss_xxh3_128"]
    save(src, m)


@pytest.mark.parametrize("fault", list(LOSS_FAULTS))
def test_loss_mask_checks(lossy, fault):
    inject, expected = LOSS_FAULTS[fault]
    inject(lossy)
    r = validate_all([str(lossy)], quick=False, against=[], workers=1, show_progress=False)
    got = [(Path(p["file"]).name, p["where"], p["message"]) for p in r["problems"]]
    assert [g for g in got if g[0].endswith(".loss")] == expected, r["lines"]
    assert r["ok"] == (not expected)


def test_quick_mode_streams_the_index_in_small_chunks(env, monkeypatch):
    """Quick mode reads each index in chunks of BLOCK/32 entries: with chunks of 2 entries every
    sample boundary and every order check crosses chunk seams."""
    import tokpack.formats.shard_scan as v

    monkeypatch.setattr(v, "BLOCK", 64)
    assert validate_dirs([env / "src", env / "run"], quick=True, workers=1).ok
    a = np.fromfile(env / E0 / "00002.ds.index", dtype="<u8")
    a[5] = a[4]
    a.tofile(env / E0 / "00002.ds.index")
    r = validate_dirs([env / "run"], quick=True, workers=1)
    assert [(Path(p.file).name, p.where, p.message) for p in r.problems] == [
        ("00002.ds.index", "entry 5", "index does not increase")
    ]


def test_whole_problem_for_size_and_entry_faults(env):
    """Every part of a problem is pinned, the message included: a shard two rows short, and a
    run manifest whose source entry is not an object."""
    shard = env / E0 / "00000.ds"
    shard.write_bytes(shard.read_bytes()[: -2 * ROW * 2])

    def problems():
        r = validate_all([str(env / "run")], quick=True, against=[], workers=1, show_progress=False)
        return {(Path(p["file"]).name, p["where"], p["expected"], p["found"], p["message"]) for p in r["problems"]}

    assert (
        "00000.ds",
        "size",
        "256 bytes (128 tokens x 2)",
        "192 bytes",
        "shard size does not match the manifest",
    ) in problems()
    m = load(env / "run")
    m["sources"][0] = 5
    save(env / "run", m)
    assert (MANIFEST, "sources[0]", "an object", "5", "bad source entry") in problems()


@pytest.mark.parametrize(
    "target,field,value,problem",
    [
        (E0, "seq_len", -1, ("seq_len", ">= 1", "-1", "manifest field out of range")),
        ("src", "eos_id", -1, ("eos_id", ">= 0", "-1", "manifest field out of range")),
        ("src", "documents", lambda v: v + 1, ("documents", "60 (sum over shards)", "61", "document count wrong")),
    ],
    ids=["seq_len", "eos_id", "documents"],
)
def test_manifest_rule_messages(env, target, field, value, problem):
    m = load(env / target)
    _edit(m, field, value)
    save(env / target, m)
    r = validate_all(
        [str(env / ("run" if target.startswith("run") else target))],
        quick=True,
        against=[],
        workers=1,
        show_progress=False,
    )
    got = [(p["where"], p["expected"], p["found"], p["message"]) for p in r["problems"]]
    assert problem in got, got


def test_metadata_text_not_as_tokpack_writes_it(env):
    """Metadata whose values are right but whose bytes differ (a trailing newline) is named, with
    the text expected and found."""
    meta = env / "src/00000.ds.metadata"
    meta.write_bytes(meta.read_bytes() + b"\n")
    r = validate_all([str(env / "src")], quick=True, against=[], workers=1, show_progress=False)
    got = [(Path(p["file"]).name, p["where"], p["message"]) for p in r["problems"]]
    assert got == [("00000.ds.metadata", "line 3", "metadata text differs from what tokpack writes")], r["lines"]
    assert r["problems"][0]["found"].endswith("\\n'")


# ------------------------------------------------------------------ each line of the shard scan, whole


def _lines(r: dict, quick: bool) -> list[tuple]:
    """The shard files' problems of one mode (the manifest's own lines left out), whole."""
    return [
        (Path(p["file"]).name, p["where"], p["expected"], p["found"], p["message"])
        for p in r["quick" if quick else "full"]["problems"]
        if not p["file"].endswith(MANIFEST)
    ]


def _scan(env: Path, target: str) -> dict:
    path = env / ("run" if target.startswith("run") else target)
    return {
        mode: validate_all([str(path)], quick=mode == "quick", against=[], workers=1, show_progress=False)
        for mode in ("full", "quick")
    }


def _set_entry(directory: Path, shard: str, **fields) -> None:
    m = load(directory)
    entry = next(s for s in m["shards"] if s["path"] == shard)
    if "tokens" in fields:
        m["tokens"] += fields["tokens"] - entry["tokens"]
    if "fragments" in fields:
        m["fragments"] += fields["fragments"] - entry["fragments"]
    entry.update(fields)
    save(directory, m)


def _write_index(epoch: Path, shard: str, entries: np.ndarray) -> None:
    """An epoch index rewritten with its fragment counts and checksum made to agree, so only the
    scan of its entries can tell."""
    np.asarray(entries, dtype="<u8").tofile(epoch / (shard + ".index"))
    _set_entry(epoch, shard, fragments=len(entries))
    reseal_epoch_index(epoch, shard)


MISSING = ("a file listed in the manifest", "no such file")


@pytest.mark.parametrize(
    "suffix,message", [("", "shard missing"), (".index", "index missing"), (".metadata", "metadata missing")]
)
def test_missing_shard_file_line(env, suffix, message):
    (env / "src" / ("00000.ds" + suffix)).unlink()
    r = _scan(env, "src")
    for quick in (False, True):
        assert _lines(r, quick) == [("00000.ds" + suffix, None, *MISSING, message)], r
        assert r["quick" if quick else "full"]["status"] == "corrupt"


def test_source_index_size_lines(env):
    """A source index one entry short, and an empty one for a shard whose manifest claims no
    documents (its other counts rewritten to agree): neither is read, and each says why."""
    idx = env / "src/00000.ds.index"
    idx.write_bytes(idx.read_bytes()[:-8])
    docs = load(env / "src")["shards"][0]["documents"]
    want = [
        (
            "00000.ds.index",
            "size",
            f"{8 * docs} bytes ({docs} documents x 8)",
            f"{8 * docs - 8} bytes",
            "index size does not match the manifest's document count",
        )
    ]
    r = _scan(env, "src")
    assert _lines(r, False) == want and _lines(r, True) == want, r
    idx.write_bytes(b"")
    m = load(env / "src")
    m["documents"] -= docs
    m["shards"][0]["documents"] = 0
    save(env / "src", m)
    want = [("00000.ds.index", "size", "a non-empty multiple of 8 bytes", "0 bytes", "index size invalid")]
    r = _scan(env, "src")
    assert _lines(r, False) == want and _lines(r, True) == want, r


def test_manifest_byte_count_line(env):
    _set_entry(env / "src", "00000.ds", bytes=2 * load(env / "src")["shards"][0]["tokens"] + 2)
    r = validate_all([str(env / "src")], quick=False, against=[], workers=1, show_progress=False)
    tokens = load(env / "src")["shards"][0]["tokens"]
    assert [(p["file"], p["where"], p["expected"], p["found"], p["message"]) for p in r["problems"]] == [
        (
            str(env / "src" / MANIFEST),
            "shards[00000.ds].bytes",
            str(2 * tokens),
            str(2 * tokens + 2),
            "manifest byte count disagrees with its token count",
        )
    ], r["lines"]


def test_metadata_field_lines(env):
    """Metadata naming another tokenizer, token size and token count: one line each, and its
    checksum in full mode."""
    from tokpack.formats.names import metadata_text

    meta = env / "src/00000.ds.metadata"
    meta.write_text(metadata_text("other-tokenizer", 4, 999))
    tokens = load(env / "src")["shards"][0]["tokens"]
    want = [
        (
            "00000.ds.metadata",
            "tokenizer",
            "test-tokenizer",
            "other-tokenizer",
            "metadata tokenizer differs from the manifest",
        ),
        ("00000.ds.metadata", "token_size", "2", "4", "metadata token size differs from the manifest dtype"),
        ("00000.ds.metadata", "tokens", str(tokens), "999", "metadata token count differs from the manifest"),
    ]
    r = _scan(env, "src")
    assert _lines(r, True) == want, r
    recorded = load(env / "src")["shards"][0]["metadata_xxh3_128"]
    assert (
        _lines(r, False)
        == [("00000.ds.metadata", "xxh3_128", recorded, xxh3_128_file(meta), "checksum mismatch")] + want
    ), r


def test_recorded_index_and_multiset_hash_lines(env):
    """An epoch shard entry whose index checksum and multiset hash were rewritten: the scan names
    each, what the manifest records and what the files hold. Quick mode reads neither."""
    shard = load(env / E0)["shards"][0]
    _set_entry(env / E0, "00000.ds", index_xxh3_128="0" * 32, multiset_hash="0" * 16)
    r = _scan(env, E0)
    assert _lines(r, False) == [
        ("00000.ds.index", "xxh3_128", "0" * 32, xxh3_128_file(env / E0 / "00000.ds.index"), "checksum mismatch"),
        (
            "00000.ds",
            "multiset_hash",
            "0" * 16,
            shard["multiset_hash"],
            "sample multiset hash of the shard differs from the manifest",
        ),
    ], r
    assert _lines(r, True) == []


# Entries of the base run's epoch 0, shard 00000.ds: [16, 32, 48, 53, 64, 80, 96, 112, 128] (8
# samples of 16 tokens; 53 is an EOS inside sample 3). Each edit keeps the entries increasing.
EPOCH_INDEX_EDITS = {
    "EOS entry moved": (
        lambda a: np.where(a == 53, 54, a),
        [("entry 3", "53 (EOS positions + sample ends)", "54", "index disagrees with the tokens")],
        [],
    ),
    "sample end moved": (
        lambda a: np.where(a == 48, 49, a),
        [("entry 2", "48 (EOS positions + sample ends)", "49", "index disagrees with the tokens")],
        [("sample end 48", "an index entry at every sample end", "no entry", "index misses a sample boundary")],
    ),
    "last entry dropped": (
        lambda a: a[:-1],
        [("entry 8", "128 (EOS positions + sample ends)", "no entry", "index disagrees with the tokens")],
        [("entry 7 (last)", "128 (the token count)", "112", "index does not end at the token count")],
    ),
    "entry past the end": (
        lambda a: np.append(a, 133),
        [("entry 9", "<= 128 (the token count)", "1 more entries", "index runs past the end of the shard")],
        [("entry 9 (last)", "128 (the token count)", "133", "index does not end at the token count")],
    ),
}


@pytest.mark.parametrize("block", [None, 64], ids=["one block", "64-byte blocks"])
@pytest.mark.parametrize("edit", list(EPOCH_INDEX_EDITS))
def test_epoch_index_entry_lines(env, monkeypatch, edit, block):
    """An epoch index edited with its fragment counts and checksum rewritten: full mode compares
    it with the EOS positions and sample ends, quick mode with the sample ends alone, and each
    names the first wrong entry, what it expected and what it found. Also in blocks of a few
    rows, where the index is handed out block by block (and in quick mode, 2 entries a chunk)."""
    import tokpack.formats.shard_scan as v

    if block:
        monkeypatch.setattr(v, "BLOCK", block)
    change, full, quick = EPOCH_INDEX_EDITS[edit]
    a = np.fromfile(env / E0 / "00000.ds.index", dtype="<u8")
    assert a.tolist() == [16, 32, 48, 53, 64, 80, 96, 112, 128]
    _write_index(env / E0, "00000.ds", change(a))
    r = _scan(env, E0)
    assert _lines(r, False) == [("00000.ds.index", *p) for p in full], r["full"]["lines"]
    assert _lines(r, True) == [("00000.ds.index", *p) for p in quick], r["quick"]["lines"]


@contextlib.contextmanager
def _bound(file: Path, onto: Path):
    """`file` mounted over `onto` (a bind mount: root only, skipped otherwise): a pseudo-file
    inside the dataset's folder, where a symlink out of it would be refused."""
    r = subprocess.run(["mount", "--bind", str(file), str(onto)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount a file here (needs root): {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(onto)], capture_output=True)


def test_shard_shorter_than_its_size(env):
    """A file whose size promises more bytes than a read delivers (a pseudo-file here; in life a
    file cut short while validate reads it): named at the byte where the data ended."""
    short = Path("/sys/devices/system/cpu/online")
    if not short.is_file() or short.stat().st_size <= len(short.read_bytes()):
        pytest.skip("needs sysfs: a file whose st_size exceeds its content")
    size, content = short.stat().st_size, short.read_bytes()
    _set_entry(env / "src", "00000.ds", tokens=size // 2, bytes=size)
    with _bound(short, env / "src/00000.ds"):
        r = validate_all([str(env / "src")], quick=False, against=[], workers=1, show_progress=False)
    assert [p[1:] for p in _lines({"full": r}, False) if p[0] == "00000.ds"] == [
        (f"byte {len(content)}", "more data", "end of file", "shard shorter than expected")
    ], r["lines"]
    assert r["status"] == "corrupt"


# ------------------------------------------------------------------ each line of the directory checks, whole


def _all_lines(r: dict) -> list[tuple]:
    return [(p["file"], p["where"], p["expected"], p["found"], p["message"]) for p in r["problems"]]


def _check(path: Path, quick: bool = True, **kw) -> dict:
    return validate_all([str(path)], quick=quick, against=kw.pop("against", []), workers=1, show_progress=False, **kw)


def test_manifest_text_altered_line(env):
    """A manifest with the same JSON in other bytes (re-indented by an editor), in a source and
    in a run: one line each, and the run's other checks still run and keep it."""
    for d in ("src", "run"):
        (env / d / MANIFEST).write_text(json.dumps(load(env / d), indent=2))
        r = _check(env / d)
        assert _all_lines(r) == [
            (
                str(env / d / MANIFEST),
                "bytes",
                "the JSON text tokpack writes",
                "different bytes (edited after writing?)",
                "manifest text was altered",
            )
        ], r["lines"]
        assert f"CORRUPT {load(env / d)['kind']} {env / d}: 1 problem" in r["lines"]
        assert r["lines"][-1].startswith("CORRUPT: ") and ", 1 problem, quick" in r["lines"][-1]


def test_shard_path_lines(env):
    m = load(env / "src")
    m["shards"][0]["path"] = ".00000.ds"
    save(env / "src", m)
    mfile = str(env / "src" / MANIFEST)
    assert (mfile, "shards[0].path", "a plain NNNNN.ds file name", "'.00000.ds'", "bad shard path") in _all_lines(
        _check(env / "src")
    )
    m["shards"][0]["path"] = m["shards"][1]["path"]
    save(env / "src", m)
    assert (mfile, "shards[1].path", "unique names", "00001.ds", "shard listed twice") in _all_lines(
        _check(env / "src")
    )
    m = load(env / "src")
    m["shards"][0]["path"] = "sub/00000.ds"
    save(env / "src", m)
    assert (
        mfile,
        "shards[0].path",
        "a plain NNNNN.ds file name",
        "'sub/00000.ds'",
        "bad shard path (holds a path separator)",
    ) in _all_lines(_check(env / "src"))
    m = load(env / "src")
    m["shards"][0]["path"], m["shards"][1]["path"] = "00001.ds", "00000.ds"
    save(env / "src", m)
    assert (
        mfile,
        "shards",
        "names of one width, in sorted order",
        "['00001.ds', '00000.ds', '00002.ds']",
        "shard names out of order",
    ) in _all_lines(_check(env / "src"))


def test_unlisted_shard_file_line(env):
    """A shard file the manifest does not list is named, next to a killed writer's leftover that is not."""
    shutil.copy(env / "src/00000.ds", env / "src/00003.ds")
    (env / "src" / f"00004.ds{TMP_MARK}1-x").write_bytes(b"junk")
    assert _all_lines(_check(env / "src")) == [
        (
            str(env / "src/00003.ds"),
            None,
            "only the files listed in the manifest",
            "an unlisted file",
            "file not listed in the manifest",
        )
    ]


@pytest.mark.parametrize("sidecar", [".pad", ".rows"])
def test_a_sidecar_its_entry_does_not_record_is_unlisted(env, sidecar):
    """Padding or row hashes beside a source shard whose entry records none: a reader could
    take it for the shard's, so it is named, as a stray shard is (a stray loss mask has its own
    line: test_loss_mask_checks)."""
    stray = env / "src" / f"00000.ds{sidecar}"
    stray.write_bytes(b"\0" * 8)
    assert _all_lines(_check(env / "src")) == [
        (
            str(stray),
            None,
            "only the files listed in the manifest",
            "an unlisted file",
            "file not listed in the manifest",
        )
    ]


def test_one_window_source_with_no_samples_validates(env, tmp_path):
    """A weighted run whose second source has a single window and, at its small weight, no sample
    in the epoch: a valid manifest (one window, no passes), not a window or pass problem."""
    from tests.conftest import shuffle_run

    tiny = write_source(tmp_path / "tiny", [np.array([5] * 19 + [EOS])], vocab_size=VOCAB)
    shuffle_run(
        [str(env / "src"), str(tiny)],
        str(tmp_path / "mixed"),
        weights=["1", "0.001"],
        seq_len=SEQ_LEN,
        seed=3,
        epochs=[0],
        samples=20,
        tokens=None,
        shard_samples=8,
        memory=1 << 20,
        jitter=False,
        log=None,
    )
    s = load(tmp_path / "mixed/epoch-00000")["sources"][1]
    assert (s["windows"], s["samples"], s["first_pass"], s["passes"]) == (1, 0, 0, 0)
    r = validate_all([str(tmp_path / "mixed")], quick=False, against=[str(env / "src"), str(tiny)], workers=1)
    assert r["ok"], r["lines"]


def test_source_manifest_rule_lines(env):
    """dtype label and EOS id against the vocabulary: whole lines, file included."""
    m = load(env / "src")
    m["dtype"], m["token_size"] = "uint32", 4
    save(env / "src", m)
    mfile = str(env / "src" / MANIFEST)
    assert (
        mfile,
        "dtype",
        "uint16 (vocab_size 1000)",
        "uint32",
        "dtype label disagrees with the vocabulary size",
    ) in _all_lines(_check(env / "src"))
    m = load(env / "src")
    m["dtype"], m["token_size"], m["eos_id"] = "uint16", 2, VOCAB
    save(env / "src", m)
    assert (mfile, "eos_id", "< 1000 (vocab_size)", "1000", "EOS id out of vocabulary") in _all_lines(
        _check(env / "src")
    )


def test_epoch_source_entry_field_line(env):
    """A field missing from an epoch's source entry is named with its place in the list."""
    m = load(env / E0)
    del m["sources"][0]["first_pass"]
    save(env / E0, m)
    assert [(p[1], p[2], p[3]) for p in _all_lines(_check(env / E0))] == [
        ("sources[0].first_pass", "field 'first_pass'", "no such field")
    ]


def test_window_past_the_source_end_line(env):
    """An epoch source entry whose windows fit its token count only without the offset: the
    windows line, though tokens - windows x row still equals dropped_tokens."""
    m = load(env / E0)
    s = m["sources"][0]
    s["tokens"], s["dropped_tokens"], s["offset"] = s["windows"] * ROW + 1, 1, 3
    m["dropped_tokens"] = 1
    save(env / E0, m)
    assert (
        str(env / E0 / MANIFEST),
        "sources[0].windows",
        f"windows x 16 + dropped_tokens == tokens ({s['tokens']})",
        f"{s['windows']} x 16 + 1",
        "source window counts do not add up",
    ) in _all_lines(_check(env / E0))


def test_run_directory_lines(env):
    """An epoch directory left unlisted, one listed but gone: whole lines with their severities."""
    shutil.copytree(env / "run/epoch-00001", env / "run/epoch-00002")
    shutil.rmtree(env / "run/epoch-00001")
    r = _check(env / "run")
    assert [(*p, q["severity"]) for p, q in zip(_all_lines(r), r["problems"])] == [
        (
            str(env / "run/epoch-00002"),
            None,
            "an epoch listed in the run's `epochs`",
            "an unlisted epoch directory",
            "epoch not yet recorded in the run manifest (interrupted shuffle?); rerun it",
            "incomplete",
        ),
        (
            str(env / "run/epoch-00001"),
            None,
            "the epoch directory listed in the run manifest",
            "no such directory",
            "epoch missing",
            "corrupt",
        ),
    ], r["lines"]


def test_partial_stage_line(env, tmp_path):
    from tokpack.packer.api import stage

    summary = stage(env / "run", tmp_path / "dst", ranks="0/4", micro_batch=8)
    assert summary.partial and summary.shards_skipped > 0
    r = _check(tmp_path / "dst")
    assert _all_lines(r) == [
        (
            str(tmp_path / "dst/tokpack-stage.json"),
            "missing_shards",
            "every shard of the run",
            r["problems"][0]["found"],
            "partial stage: serves only the ranks it was staged for",
        )
    ]
    assert r["problems"][0]["found"].startswith(
        f"{summary.shards_skipped} shards absent, staged only for ranks [0] of 4"
    )


def test_a_runs_epochs_hold_no_job_per_shard(env, tmp_path, monkeypatch):
    """validate of a run, whole or a partial stage (its absent shards dropped by index): each
    shard's check is made when its turn comes, as in an epoch folder (issue 42, item 7), never
    one held per shard."""
    from tokpack.packer import dir_checks
    from tokpack.packer.api import stage

    summary = stage(env / "run", tmp_path / "dst", ranks="0/4", micro_batch=8)
    held = sorted(str(f) for f in (tmp_path / "dst").glob("epoch-*/*.ds"))
    live, most, checked = [0], [0], []

    class Counted(dir_checks.ShardJob):
        def __init__(self, directory, entry, *shared):
            super().__init__(directory, entry, *shared)
            live[0] += 1
            most[0] = max(most[0], live[0])
            checked.append(str(directory / entry["path"]))

        def __del__(self):
            live[0] -= 1

    monkeypatch.setattr(dir_checks, "ShardJob", Counted)
    whole = _check(env / "run", quick=False)
    assert whole["ok"] and len(list((env / "run").glob("epoch-*/*.ds"))) >= 8 and most[0] <= 2, most
    most[0], checked[:] = 0, []
    r = _check(tmp_path / "dst", quick=False)
    assert [p["message"] for p in r["problems"]] == ["partial stage: serves only the ranks it was staged for"]
    assert summary.shards_skipped > 0 and len(held) >= 4
    assert sorted(set(checked)) == held  # a check made for every held shard, none for an absent one
    assert most[0] <= 2, f"{most[0]} shard checks held at once for {len(held)} shards"


def test_a_partial_stages_complete_epoch_keeps_its_whole_epoch_check(env, tmp_path):
    """In a partial stage, an epoch none of whose shards is absent is whole: its samples'
    multiset is recomputed and compared (only an epoch missing shards skips that check)."""
    from tokpack.formats.constants import STAGE_SIDECAR
    from tokpack.formats.reading import canonical_bytes
    from tokpack.packer.api import stage

    dst = tmp_path / "dst"
    stage(env / "run", dst, ranks="0/4", micro_batch=8)
    side = json.loads((dst / STAGE_SIDECAR).read_text())
    for name in side["missing_shards"].pop("epoch-00000"):  # epoch 0 made whole again
        for f in (env / "run" / "epoch-00000").glob(name + "*"):
            shutil.copy(f, dst / "epoch-00000" / f.name)
    (dst / STAGE_SIDECAR).write_bytes(canonical_bytes(side))
    report = validate_dirs([str(dst)], quick=False)
    epochs = {Path(d.path).name: d for d in report.dirs if Path(d.path).name.startswith("epoch-")}
    assert [p.message for d in report.dirs for p in d.problems] == [
        "partial stage: serves only the ranks it was staged for"
    ]
    assert epochs["epoch-00000"].multiset is not None and epochs["epoch-00001"].multiset is None


def test_token_files_gone_from_a_run_are_missing_unless_it_says_its_tokens_are_on_the_nodes(env, tmp_path):
    """An epoch folder whose token files are gone but whose row hashes are there is a damaged
    run, reported as such; only a run that declares itself written by shuffle --to-nodes
    (its tokpack-nodes.json) may lack them."""
    from tokpack.formats.constants import NODES_SIDECAR
    from tokpack.formats.reading import canonical_bytes
    from tokpack.formats.builders import nodes_sidecar

    run = tmp_path / "copy"
    shutil.copytree(env / "run", run)
    epoch = run / epoch_dir_name(0)
    for f in epoch.glob("*.ds"):
        f.unlink()
    r = _check(run)
    assert not r["ok"] and any(p["file"].endswith(".ds") and p["file"].startswith(str(epoch)) for p in r["problems"]), r
    (run / NODES_SIDECAR).write_bytes(canonical_bytes(nodes_sidecar(4, 1, 1, str(tmp_path / "n{node}"))))
    r = _check(run)
    assert r["ok"], r["lines"]


def test_epoch_against_its_run_lines(env):
    """Each field an epoch must share with its run, broken alone in the epoch: the line names the
    epoch's manifest, the run's value and the epoch's."""
    efile = str(env / E0 / MANIFEST)
    run_m, epoch_m = load(env / "run"), load(env / E0)
    cases = [
        (lambda m, e: e.update(seed=2), (efile, "seed", "1 (the run's)", "2", "epoch manifest belongs to another run")),
        (
            lambda m, e: e["sources"][0].update(name="other"),
            (efile, "sources[0].name", "'src' (the run's)", "'other'", "epoch source differs from the run's"),
        ),
        (
            lambda m, e: m.update(weights=[0.5]),
            (efile, "sources[0].weight", "0.5", "None", "epoch weight differs from the run's"),
        ),
        (
            lambda m, e: e["sources"][0].update(fingerprint="0" * 32),
            (
                efile,
                "sources",
                str([run_m["sources"][0]["fingerprint"]]),
                str(["0" * 32]),
                "epoch was shuffled from other sources than its run",
            ),
        ),
        (
            lambda m, e: m.update(tokens=m["tokens"] + 1),
            (
                str(env / "run" / MANIFEST),
                "tokens",
                f"{run_m['tokens']} (sum over its epochs)",
                str(run_m["tokens"] + 1),
                "run tokens count wrong",
            ),
        ),
    ]
    for edit, line in cases:
        m, e = json.loads(json.dumps(run_m)), json.loads(json.dumps(epoch_m))
        edit(m, e)
        save(env / "run", m)
        save(env / E0, e)
        assert line in _all_lines(_check(env / "run")), line


def test_problems_per_file_are_capped_after_five(env):
    """Five problems in one manifest are all listed; a sixth is counted in a last line instead."""
    m = load(env / "src")
    m["tokens"] += 1
    m["documents"] += 1
    m["eos_id"] = VOCAB
    m["fingerprint"] = "0" * 32
    m["shards"][2]["documents"] = m["shards"][2]["tokens"] + 1
    save(env / "src", m)
    mfile = str(env / "src" / MANIFEST)
    lines = [p for p in _all_lines(_check(env / "src")) if p[0] == mfile]
    assert [p[1] for p in lines] == ["eos_id", "tokens", "documents", "fingerprint", "shards[2].documents"]
    m["shards"][1]["documents"] = 0
    save(env / "src", m)
    lines = [p for p in _all_lines(_check(env / "src")) if p[0] == mfile]
    assert len(lines) == 6 and lines[-1] == (mfile, None, None, None, "1 more problems in this file"), lines


def test_against_without_the_epochs_source_line(env, tmp_path, monkeypatch):
    """--against a source the epoch was not shuffled from: UNVERIFIED, naming the source missing
    and, in the hint, the --against to add; an entry without path or name is shown as "?"."""
    other = write_source(tmp_path / "src2", random_docs(np.random.default_rng(9), 30, VOCAB, EOS), vocab_size=VOCAB)
    fp, path = load(env / E0)["sources"][0]["fingerprint"], load(env / E0)["sources"][0]["path"]
    want = {
        "file": str(env / E0 / MANIFEST),
        "where": "sources",
        "expected": "--against for each of its 1 source",
        "found": f"none for src (fingerprint {fp})",
        "message": "epoch holds samples from a source not given to --against; its content is not verified",
        "severity": "unverified",
        "hint": f"give every source the epoch was shuffled from, as it was then: --against {path}",
    }
    assert _check(env / E0, against=[str(other)])["problems"] == [want]
    m = load(env / E0)
    del m["sources"][0]["path"], m["sources"][0]["name"]
    save(env / E0, m)
    monkeypatch.chdir(other)  # an entry without a path is not taken for the source at "."
    got = [p for p in _check(env / E0, against=["."])["problems"] if p["where"] == "sources"]
    assert got == [
        {
            **want,
            "found": f"none for ? (fingerprint {fp})",
            "hint": "give every source the epoch was shuffled from, as it was then: --against ?",
        }
    ]


def test_against_a_source_that_cannot_be_replayed(env):
    """A source with its fingerprint intact whose shard reads shorter than its size (a pseudo-file
    here): the replay's own line, in the epoch's report, names the shard."""
    short = Path("/sys/devices/system/cpu/online")
    if not short.is_file() or short.stat().st_size <= len(short.read_bytes()):
        pytest.skip("needs sysfs: a file whose st_size exceeds its content")
    _set_entry(env / "src", "00000.ds", tokens=short.stat().st_size // 2, bytes=short.stat().st_size)
    with _bound(short, env / "src/00000.ds"):
        r = _check(env / E0, against=[str(env / "src")])
    epoch = [p for p in r["problems"] if p["file"] == str(env / "src/00000.ds")]
    assert [(p["where"], p["expected"], p["found"], p["message"]) for p in epoch] == [
        (None, None, None, "shard shorter than its manifest says")
    ], r["lines"]
    assert [d["status"] for d in r["dirs"] if d["kind"] == "epoch"] == ["corrupt"]


def test_report_text(env):
    """The summary line: sizes in B, kB, MB and GB switching at exactly 1000, the time taken, and
    what quick mode leaves out."""
    from tokpack.packer.validation import ValidateResult

    def summary(nbytes: int) -> str:
        r = ValidateResult(
            ok=True,
            status="ok",
            quick=False,
            problems=[],
            dirs=[],
            files=1,
            bytes=nbytes,
            seconds=2.0,
            mb_per_s=0.0,
            against=[],
        )
        return report_lines(r)[-1]

    assert [summary(n).split(", ")[2].split(" in ")[0] for n in (999, 1000, 999_999, 10**6, 10**9 - 10**5, 10**9)] == [
        "999 B",
        "1.0 kB",
        "1000.0 kB",
        "1.0 MB",
        "999.9 MB",
        "1.0 GB",
    ]
    t0 = time.perf_counter()
    r = _check(env / "src")
    took = time.perf_counter() - t0
    assert isinstance(r["seconds"], float) and 0 < r["seconds"] <= took
    assert _check(env / "src", quick=False)["lines"][-2] == f"OK source {env / 'src'} ({r['files']} files, 8.3 kB)"
    assert r["lines"][-1] == (
        f"OK: 1 directory, {r['files']} files, 8.3 kB in {r['seconds']:.2f} s "
        f"({r['mb_per_s']:.0f} MB/s), 0 problems, quick (no checksums, no token scan)"
    )


def test_progress_bar_counts_bytes_or_shards(env, capsys):
    """show_progress=True: a bar over the bytes to read in full mode, over the shards in quick mode."""
    from tqdm import tqdm

    total = sum(s["bytes"] for s in load(env / "src")["shards"])
    for quick, head in (
        (False, f"validate:   0%|          | 0.00/{tqdm.format_sizeof(total, divisor=1024)} "),
        (True, "validate --quick:   0%|          | 0.00/3.00 "),
    ):
        validate_all([str(env / "src")], quick=quick, against=[], workers=1, show_progress=True)
        err = capsys.readouterr().err
        assert head in err and ("?shard/s" if quick else "?B/s") in err, err


def test_unreadable_manifest_line(env):
    """A manifest tokpack refuses to read (another format version): its whole line, hint included."""
    m = load(env / "src")
    m["version"] = 99
    save(env / "src", m)
    assert _check(env / "src")["problems"] == [
        {
            "file": str(env / "src" / MANIFEST),
            "where": "version",
            "expected": "1",
            "found": "99",
            "message": "unsupported format version",
            "severity": "corrupt",
            "hint": "use the tokpack release that wrote this directory",
        }
    ]


def test_epoch_index_size_against_fragments_line(env):
    idx = env / E0 / "00000.ds.index"
    idx.write_bytes(idx.read_bytes()[:-8])
    want = [
        (
            "00000.ds.index",
            "size",
            "72 bytes (9 fragments x 8)",
            "64 bytes",
            "index size does not match the manifest's fragment count",
        )
    ]
    r = _scan(env, E0)
    assert _lines(r, False) == want and _lines(r, True) == want, r


@pytest.mark.parametrize("block", [None, 64], ids=["one block", "64-byte blocks"])
def test_source_index_ending_before_the_tokens(env, monkeypatch, block):
    """A source whose last document was dropped from the index (counts and checksums rewritten to
    agree): its tokens run on past the last entry, through blocks the index has nothing for."""
    import tokpack.formats.shard_scan as v

    if block:
        monkeypatch.setattr(v, "BLOCK", block)
    idx = env / "src/00001.ds.index"
    a = np.fromfile(idx, dtype="<u8")
    a[:-1].tofile(idx)
    m = load(env / "src")
    m["documents"] -= 1
    m["shards"][1]["documents"] -= 1
    save(env / "src", m)
    reseal_source(env / "src")
    assert int(a[-1] - a[-2]) > 32  # the last document spans more than one 64-byte block
    want = [
        (
            "00001.ds.index",
            f"entry {len(a) - 2} (last)",
            f"{int(a[-1])} (the token count)",
            str(int(a[-2])),
            "index does not end at the token count",
        )
    ]
    r = _scan(env, "src")
    assert _lines(r, False) == want and _lines(r, True) == want, r


@pytest.mark.parametrize("block", [None, 64], ids=["one block", "64-byte blocks"])
def test_missing_eos_line_once_per_shard(env, monkeypatch, block):
    """Two documents of one shard without their EOS, far apart (in different blocks when blocks
    are small): the first is named, token, document and the id found; the shard gets one line."""
    import tokpack.formats.shard_scan as v

    if block:
        monkeypatch.setattr(v, "BLOCK", block)
    ends = np.fromfile(env / "src/00001.ds.index", dtype="<u8")
    p = env / "src/00001.ds"
    t = np.fromfile(p, dtype="<u2")
    t[int(ends[3]) - 1] = 7
    t[int(ends[15]) - 1] = 9
    t.tofile(p)
    reseal_source(env / "src")
    r = _scan(env, "src")
    assert _lines(r, False) == [
        (
            "00001.ds",
            f"token {int(ends[3]) - 1} (end of document 3)",
            f"EOS id {EOS}",
            "7",
            "document does not end with EOS",
        )
    ], r["full"]["lines"]


def test_quick_index_past_the_end_across_chunks(env, monkeypatch):
    """Quick mode, an epoch index running two entries past the token count, read 2 entries a
    chunk so that the chunk after them starts beyond the last sample: the line says the index
    does not end at the token count (it said "sample end -1" once)."""
    import tokpack.formats.shard_scan as v

    monkeypatch.setattr(v, "BLOCK", 64)
    a = np.fromfile(env / E0 / "00000.ds.index", dtype="<u8")
    _write_index(env / E0, "00000.ds", np.append(a, [150, 160]))
    r = _scan(env, E0)
    assert _lines(r, True) == [
        ("00000.ds.index", "entry 10 (last)", "128 (the token count)", "160", "index does not end at the token count")
    ], r["quick"]["lines"]
    assert _lines(r, False) == [
        (
            "00000.ds.index",
            "entry 9",
            "<= 128 (the token count)",
            "2 more entries",
            "index runs past the end of the shard",
        )
    ], r["full"]["lines"]


def test_against_replay_lines(env):
    """--against: an epoch whose samples differ from what its plan assigns (manifest rewritten to
    agree), and one recorded as shuffled by another algorithm: each line whole."""
    mfile = str(env / E0 / MANIFEST)
    planned = load(env / E0)["sample_multiset_hash"]
    _duplicate_sample(env, True)
    r = _check(env / E0, against=[str(env / "src")])
    assert (
        mfile,
        "sample_multiset_hash",
        f"{planned} (replayed from the sources)",
        f"{load(env / E0)['sample_multiset_hash']} (recorded in {MANIFEST})",
        "epoch does not hold the samples its plan assigns (dropped/duplicated/altered)",
    ) in _all_lines(r), r["lines"]
    m = load(env / E0)
    shuffle = m["shuffle"]
    m["shuffle"] = "other-v0"
    save(env / E0, m)
    r = _check(env / E0, against=[str(env / "src")])
    assert (mfile, "shuffle", shuffle, "other-v0", "epoch shuffled by another shuffle algorithm") in _all_lines(r), r[
        "lines"
    ]


def test_loss_mask_lines_whole(lossy):
    """The .loss lines with what they expected and found: a checksum, and a file not listed."""
    recorded = load(lossy)["shards"][1]["loss_xxh3_128"]
    _loss_value(lossy, 1 - int(np.fromfile(lossy / "00001.ds.loss", np.uint8)[7]), False)
    _unlist_loss(lossy)
    size = (lossy / "00000.ds.loss").stat().st_size
    r = validate_all([str(lossy)], quick=False, against=[], workers=1, show_progress=False)
    assert [p for p in _lines({"full": r}, False) if p[0].endswith(".loss")] == [
        ("00000.ds.loss", None, "no .loss file (none listed)", f"{size} bytes", "file not listed in the manifest"),
        ("00001.ds.loss", "xxh3_128", recorded, xxh3_128_file(lossy / "00001.ds.loss"), "checksum mismatch"),
    ], r["lines"]


def test_run_epoch_list_of_booleans(env):
    """JSON true is not an epoch number, though Python counts it as 1."""
    m = load(env / "run")
    m["epochs"] = [True]
    save(env / "run", m)
    assert (
        str(env / "run" / MANIFEST),
        "epochs",
        "distinct epoch numbers >= 0",
        "[True]",
        "bad epoch list",
    ) in _all_lines(_check(env / "run"))


def test_empty_shard_with_a_loss_mask_validates(lossy):
    """A shard of no tokens, written by the shard writer with its (empty) .loss: valid, and its
    empty loss mask is scanned without error."""
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.names import shard_name

    m = load(lossy)
    w = SourceShardWriter(lossy, shard_name(2), np.dtype("<u2"), "test-tokenizer", with_loss=True)
    (lossy / MANIFEST).unlink()
    write_manifest(lossy, source_manifest(m["shards"] + [w.close()], np.dtype("<u2"), VOCAB, EOS, "test-tokenizer"))
    assert (lossy / "00002.ds.loss").stat().st_size == 0
    r = validate_all([str(lossy)], quick=False, against=[], workers=1, show_progress=False)
    assert r["ok"], r["lines"]


def test_a_manifest_of_many_broken_shard_entries_lists_a_bounded_report(tmp_path):
    """Issue 32: validate of a manifest with 1.5M shard entries grew to 3.3 GB collecting its 9M
    problems. Each directory lists its first MAX_PROBLEMS_LISTED problems (a few per file), then
    counts the rest in one line; the total and the status are those of every problem, and the
    directory's list never holds more than the cap while it is collected."""
    from tokpack.formats.reading import canonical_bytes
    from tokpack.formats.names import shard_digits, shard_name
    from tokpack.packer import dir_checks

    src = write_source(tmp_path / "many", random_docs(np.random.default_rng(1), 20, VOCAB, 0), vocab_size=VOCAB)
    m = json.loads((src / MANIFEST).read_text())
    n = 4000  # each entry's three files are missing: 3 problems an entry, and 3 for the manifest's sums
    m["shards"] = [{**m["shards"][0], "path": shard_name(i, shard_digits(n))} for i in range(n)]
    (src / MANIFEST).write_bytes(canonical_bytes(m))
    for f in src.glob("*.ds*"):
        f.unlink()
    held = []
    real_append = dir_checks.ProblemList.append

    def watching(self, p):
        real_append(self, p)
        held.append(list.__len__(self))

    dir_checks.ProblemList.append = watching
    try:
        r = validate_result([str(src)])
    finally:
        dir_checks.ProblemList.append = real_append
    assert max(held) <= dir_checks.MAX_PROBLEMS_LISTED
    total = 3 * n + 3  # tokens, documents, fingerprint of the manifest, and .ds, .ds.index, .ds.metadata per entry
    assert r.problems_total == total and r.dirs[0]["problems"] == total and r.status == "corrupt" and not r.ok
    assert len(r.problems) == dir_checks.MAX_PROBLEMS_LISTED + 1
    last = r.problems[-1]
    listed = dir_checks.MAX_PROBLEMS_LISTED
    assert last["file"] == str(src) and last["message"].startswith(f"{total - listed:,} more problems"), last
    lines = report_lines(r)
    assert lines[-1].endswith(f"{total} problems") and len(lines) == listed + 3
    res = subprocess.run(
        [sys.executable, "-m", "tokpack", "validate", str(src), "--json"], capture_output=True, text=True
    )
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and len(doc["problems"]) == listed + 1 and doc["problems_total"] == total


def test_an_unlisted_problem_still_sets_the_status():
    """The first unlisted problem of each severity is kept: a MISSING past the cap still counts."""
    from tokpack.formats.shard_scan import Problem
    from tokpack.packer.dir_checks import MAX_PROBLEMS_LISTED, ProblemList

    ps = ProblemList(Problem(f"f{i}", None, None, None, "x", incomplete=True) for i in range(MAX_PROBLEMS_LISTED))
    ps.append(Problem("late", None, None, None, "corrupt one"))
    assert list.__len__(ps) == MAX_PROBLEMS_LISTED and ps.total == MAX_PROBLEMS_LISTED + 1
    assert ps.status == "corrupt" and ps.summarised("d").status == "corrupt"
    assert ps.summarised("d")[-1].message.startswith("1 more problems in other files")
