"""validate's memory does not grow with the manifest's entries (issue 42, item 7): a 1.5M-entry
manifest (20 MB) peaked at 1.16 GB, every entry a dict, twice, and what the checks built of
them. The manifest is now read entry by entry from its text (tokpack.formats.reading's
ShardEntries), with the same findings and the same output."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.formats.names import shard_digits, shard_name
from tokpack.formats.reading import ShardEntries, read_manifest_text

# validate in a child, which prints its own peak RSS last (VmHWM: ru_maxrss of RUSAGE_CHILDREN
# keeps the largest child this test process ever waited for).
CHILD = """
import sys
from tokpack.packer.cli import main
try:
    main(["validate", *sys.argv[1:]])
except SystemExit as e:
    code = e.code
print(next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:")))
sys.exit(code)
"""

ENTRIES = 75_000  # 19.7 MB of manifest: a real source's entries (7 fields each)
DAMAGED = 54_321
PEAK = 160 << 20  # measured: 298 MB before, 97 MB now (the text, 20 MB, and 16 bytes an entry)


def test_validate_of_a_20mb_manifest_stays_far_below_its_parsed_size(tmp_path):
    """A source manifest of 75,000 entries, one of them damaged: validate names that entry
    (the damage keeps the shard files unchecked, so the test is quick) and peaks under 160 MB;
    it peaked at 298 MB holding the entries as dicts."""
    src = write_source(tmp_path / "big", random_docs(np.random.default_rng(1), 20, 1000, 0))
    m = json.loads((src / MANIFEST).read_text())
    entry = m["shards"][0]
    digits = shard_digits(ENTRIES)
    m["shards"] = [{**entry, "path": shard_name(i, digits)} for i in range(ENTRIES)]
    m["shards"][DAMAGED]["xxh3_128"] = "not-a-checksum"
    raw = canonical_bytes(m)
    del m
    (src / MANIFEST).write_bytes(raw)
    assert len(raw) > 19_000_000
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(src)],
        capture_output=True,
        text=True,
        cwd=Path.cwd(),
    )
    peak, lines = res.stdout.split()[-1], res.stderr.splitlines()  # the report is on stderr
    assert res.returncode == 1, res.stderr
    assert lines[0] == (
        f"CORRUPT {src / MANIFEST} [shards[{DAMAGED}].xxh3_128]: malformed checksum; expected 32 lowercase "
        "hex digits, found 'not-a-checksum'. HINT: the manifest was edited or belongs elsewhere; restore it "
        "or rerun the command that wrote it"
    ), lines
    assert lines[1] == f"CORRUPT source {src}: 1 problem", lines
    assert int(peak) < PEAK, f"validate peaked at {int(peak) / 2**20:.0f} MB"


def _as_read(m: dict) -> dict:
    shards = m.get("shards")
    return {**m, "shards": list(shards)} if isinstance(shards, ShardEntries) else m


def _variants(raw: bytes) -> dict[str, bytes]:
    text = raw.decode()
    compact = json.dumps(json.loads(raw)).encode()
    return {
        "as written": raw,
        "compact": compact,
        "a space in an entry": text.replace('"tokens": ', '"tokens":  ', 1).encode(),
        "a space between entries": text.replace("},\n  {", "}, \n  {", 1).encode(),
        "an entry less indented": text.replace("\n  {", "\n {", 1).encode(),
        "the last entry more indented": text.replace("\n  }\n ]", "\n   }\n ]").encode(),
        "a trailing space": raw + b" ",
        "no final newline": raw[:-1],
        "BOM": b"\xef\xbb\xbf" + raw,
        "raw UTF-8": text.replace('"test-tokenizer"', '"t\u00e9st"').encode(),
        "escaped UTF-8": text.replace('"test-tokenizer"', '"t\\u00e9st"').encode(),
        "shards twice": text.replace('"shards": [', '"shards": [1, 2], "shards": [', 1).encode(),
        "no shards": json.dumps({**json.loads(raw), "shards": []}, indent=1).encode() + b"\n",
        "entries not objects": json.dumps({**json.loads(raw), "shards": [1, "x", None, [{}]]}, indent=1).encode()
        + b"\n",
    }


def test_a_manifest_read_entry_by_entry_is_the_one_read_whole(small_source, tmp_path):
    """read_manifest_text gives what read_manifest(checked=False) gives (the shard entries
    listed), says the bytes are canonical exactly when canonical_bytes(json.loads(raw)) is
    them, and refuses what read_manifest refuses, with the same line."""
    src, _ = small_source
    raw = (src / MANIFEST).read_bytes()
    d = tmp_path / "v"
    d.mkdir()
    for name, variant in _variants(raw).items():
        (d / MANIFEST).write_bytes(variant)
        m, canonical, size = read_manifest_text(d)
        assert _as_read(m) == read_manifest(d, checked=False), name
        assert canonical == (variant == canonical_bytes(json.loads(variant))), name
        assert size == len(variant)
    assert isinstance(read_manifest_text(src)[0]["shards"], ShardEntries) and read_manifest_text(src)[1]
    text = raw.decode()
    for name, bad in {
        "cut short": raw[:-30],
        "NaN": text.replace('"tokens": ', '"tokens": NaN, "x": ', 1).encode(),
        "an integer too large": text.replace('"tokens": ', '"tokens": 99999999999999999999999, "x": ', 1).encode(),
        "too deep": text.replace('"tokens": ', '"tokens": ' + "[" * 40 + "]" * 40 + ', "x": ', 1).encode(),
        "not an object": b"[1, 2]\n",
        "another kind": text.replace('"kind": "source"', '"kind": "nothing"').encode(),
        "not UTF-8": raw.replace(b"test-tokenizer", b"test-\xff"),
    }.items():
        (d / MANIFEST).write_bytes(bad)
        with pytest.raises(TokpackError) as whole:
            read_manifest(d, checked=False)
        with pytest.raises(TokpackError) as by_entry:
            read_manifest_text(d)
        assert str(by_entry.value) == str(whole.value), name
    with pytest.raises(TokpackError, match="no such directory"):
        read_manifest_text(tmp_path / "absent")


def test_shard_entries_read_as_the_list_they_stand_for(small_source):
    src, _ = small_source
    m, _, _ = read_manifest_text(src)
    entries, listed = m["shards"], read_manifest(src)["shards"]
    assert len(listed) == 3 and len(entries) == 3 and bool(entries)
    assert list(entries) == listed and list(entries) == listed  # read again, the same
    assert entries == listed and listed == entries and not entries != listed
    assert entries[0] == listed[0] and entries[-1] == listed[-1] and entries[1:] == listed[1:]
    assert list(reversed(entries)) == listed[::-1] and listed[2] in entries
    assert entries.index(listed[1]) == 1 and entries.count(listed[0]) == 1
    assert repr(entries) == repr(listed) and entries + [5] == [*listed, 5]
    for copied in (copy.copy(entries), copy.deepcopy(entries), pickle.loads(pickle.dumps(entries))):
        assert type(copied) is list and copied == listed
    with pytest.raises(IndexError):
        entries[3]
    for change in (lambda: entries.append({}), lambda: entries.__setitem__(0, {}), entries.sort, entries.clear):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert list(entries) == listed
