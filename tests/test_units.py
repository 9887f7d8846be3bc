"""Token counts and byte sizes: different units, parsed exactly, never mistaken for each other."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import project_files, random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.units import byte_size, token_count

REPO = Path(__file__).resolve().parents[1]


def tokpack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokpack.packer.cli", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize(
    "text, count",
    [
        ("0", 0),
        ("1000", 1000),
        ("1K", 10**3),
        ("2k", 2000),
        ("1M", 10**6),
        ("1.5M", 1_500_000),
        ("100B", 10**11),
        ("11T", 11 * 10**12),
        ("0.001K", 1),
        (" 3 K ", 3000),
        ("123456789012345678", 123456789012345678),  # beyond float's 2^53: must stay exact
        ("12345678901234567.8K", 12345678901234567800),
        ("9007199254740993", 2**53 + 1),
    ],
)
def test_token_counts_are_decimal_and_exact(text, count):
    assert token_count(text) == count
    assert type(token_count(text)) is int


@pytest.mark.parametrize(
    "text, says",
    [
        ("100GB", "byte size"),
        ("1GiB", "byte size"),
        ("5MB", "byte size"),
        ("1G", "byte size"),
        ("1.5", "whole number"),
        ("1.2345K", "whole number"),
        ("ten", "not a token count"),
        ("-5", "not a token count"),
        ("1X", "unknown suffix"),
    ],
)
def test_token_counts_refuse_byte_units_and_fractions(text, says):
    with pytest.raises(TokpackError) as e:
        token_count(text)
    assert says in str(e.value)
    assert "K/M/B/T" in str(e.value) or "K, M, B, T" in str(e.value) or "smaller suffix" in str(e.value)


@pytest.mark.parametrize(
    "text, size",
    [
        ("1048576", 1 << 20),
        ("100B", 100),
        ("2KB", 2000),
        ("2GB", 2 * 10**9),
        ("16GiB", 16 << 30),
        ("512MiB", 512 << 20),
        ("4G", 4 << 30),
        ("1K", 1024),
        ("1.5KiB", 1536),
        ("1TiB", 1 << 40),
        ("123456789012345678", 123456789012345678),
        # every unit once: an SI unit read as binary (or the reverse) changes a budget by 5-10%
        ("3KB", 3 * 10**3),
        ("3MB", 3 * 10**6),
        ("3GB", 3 * 10**9),
        ("3TB", 3 * 10**12),
        ("3KiB", 3 << 10),
        ("3MiB", 3 << 20),
        ("3GiB", 3 << 30),
        ("3TiB", 3 << 40),
        ("3K", 3 << 10),
        ("3M", 3 << 20),
        ("3G", 3 << 30),
        ("3T", 3 << 40),
        ("3mb", 3 * 10**6),
        ("3b", 3),
    ],
)
def test_byte_sizes_take_si_and_iec_units(text, size):
    assert byte_size(text) == size


def test_byte_sizes_refuse_nonsense():
    for text in ("4 apples", "GiB", "-1GiB"):
        with pytest.raises(TokpackError, match="not a byte size"):
            byte_size(text)


@pytest.fixture
def source(tmp_path) -> Path:
    return write_source(tmp_path / "src", random_docs(np.random.default_rng(7), 150, 1000, 0))


def test_shuffle_tokens_are_decimal(source, tmp_path):
    """--tokens 1.5K with seq_len 9 is 1500 // 9 = 166 samples (a byte parser made it 1536 -> 170)."""
    r = tokpack(
        "shuffle",
        str(source),
        "-o",
        str(tmp_path / "run"),
        "--seq-len",
        "9",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--tokens",
        "1.5K",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples_per_epoch"] == 166


@pytest.mark.parametrize("value", ["1KB", "2KiB"])  # small: a parser that took them would run quickly
def test_shuffle_refuses_a_byte_size_as_tokens(source, tmp_path, value):
    r = tokpack(
        "shuffle",
        str(source),
        "-o",
        str(tmp_path / "run"),
        "--seq-len",
        "9",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--tokens",
        value,
    )
    assert r.returncode == 2
    assert "byte size" in r.stderr and "K/M/B/T" in r.stderr and "--memory" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_shuffle_memory_takes_byte_units(source, tmp_path):
    """--memory keeps byte units: 2KiB forces the out-of-core path, 1GB is in memory."""
    for memory, path in (("2KiB", "out-of-core"), ("1GB", "in-memory")):
        r = tokpack(
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / memory),
            "--seq-len",
            "9",
            "--seed",
            "1",
            "--epochs",
            "1",
            "--memory",
            memory,
            "--json",
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["path"] == path


def test_read_consumed_tokens_take_suffixes(source, tmp_path):
    r = tokpack(
        "shuffle", str(source), "-o", str(tmp_path / "run"), "--seq-len", "9", "--seed", "1", "--epochs", "1", "--json"
    )
    assert r.returncode == 0, r.stderr
    r = tokpack("read", str(tmp_path / "run"), "--consumed-tokens", "1K", "--count", "1", "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert (first["epoch"], first["sample"]) == (0, 1000 // 9)


def test_pack_shard_tokens_take_suffixes(tmp_path):
    """--shard-tokens 2K is 2000 tokens per shard, not 2048."""
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(1, 500, 24), 0) for _ in range(200)]  # 25 tokens each
    with open(tmp_path / "in.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"input_ids": d.tolist()}) + "\n")
    r = tokpack(
        "pack",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out"),
        "--eos-id",
        "0",
        "--vocab-size",
        "500",
        "--shard-tokens",
        "2K",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    shards = json.loads((tmp_path / "out" / "tokpack.json").read_text())["shards"]
    assert [s["tokens"] for s in shards] == [2000, 2000, 1000]


def test_docs_use_token_units_for_token_counts():
    """Every `--tokens X` / `--consumed-tokens X` the docs show parses as a token count."""
    shown = []
    for doc in [REPO / "README.md", *project_files("docs", pattern="*.md", recursive=False)]:
        shown += re.findall(r"--(?:consumed-)?tokens[ =]([0-9][^\s`]*)", doc.read_text())
    assert shown, "the README shows --tokens"
    for value in shown:
        token_count(value)


def test_unit_errors_say_what_was_wrong_and_what_to_write():
    """Whole lines, so a lost hint, a lost `found` or the wrong kind of refusal shows."""

    def line(fn, value, **kw) -> str:
        with pytest.raises(TokpackError) as e:
            fn(value, **kw)
        return str(e.value)

    assert line(token_count, -5, what="--tokens") == "a --tokens cannot be negative: found -5"
    assert line(byte_size, -1) == "a byte size cannot be negative: found -1"
    assert line(token_count, "5PB") == (
        "'5PB' is not a token count: it is a byte size. HINT: token counts take K/M/B/T "
        "(10^3, 10^6, 10^9, 10^12), e.g. 100B for 10^11 tokens; byte sizes are for --memory"
    )
    assert line(token_count, "5XiB").startswith("'5XiB' is not a token count: it is a byte size. HINT")
    assert line(token_count, "2x").startswith("'2x' is not a token count: unknown suffix 'X'. HINT")
    assert line(token_count, "ten") == (
        "'ten' is not a token count. HINT: write an integer or use K, M, B, T (10^3..10^12), e.g. 100B"
    )
    assert line(token_count, "1.5") == (
        "'1.5' is not a whole number of tokens: found 1.5. HINT: give more digits or a smaller suffix, e.g. 1500K"
    )
    assert line(byte_size, "4 apples") == (
        "'4 apples' is not a byte size. HINT: use e.g. 512MiB, 4GiB, 2GB or 1048576 "
        "(KB/MB/GB are 10^n, KiB/MiB/GiB and a bare K/M/G are 2^n)"
    )
    assert line(token_count, True).startswith("True is not a token count")  # a bool is no count


@pytest.mark.parametrize("value", [0, 1, 7, 2**70])
def test_whole_numbers_pass_as_they_are(value):
    assert token_count(value) == byte_size(value) == value
