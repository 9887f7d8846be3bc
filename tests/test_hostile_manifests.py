"""Manifests edited by hand or damaged, as a user meets them: `validate` gives each a CORRUPT
line (file, field, expected, found, hint) and exit 1, never a traceback and never OK."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes
from tokpack.packer.api import validate as validate_result
from tests.conftest import random_docs, shuffle_run, write_source

VOCAB, EOS, SEQ_LEN = 1000, 0, 31


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """src/ (a packed source of 3 shards), bf/ (a best-fit run of it, epoch 0) and run/ (windows, shards of 20)."""
    root = tmp_path_factory.mktemp("hostile")
    docs = random_docs(np.random.default_rng(5), 90, VOCAB, EOS, max_len=100)
    write_source(root / "src", docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=30)
    shuffle_run([str(root / "src")], str(root / "bf"), seq_len=SEQ_LEN, seed=2, epochs=[0], packing="best-fit")
    shuffle_run([str(root / "src")], str(root / "run"), seq_len=SEQ_LEN, seed=2, epochs=[0], shard_samples=20)
    return root


@pytest.fixture
def env(base, tmp_path) -> Path:
    for name in ("src", "bf", "run"):
        shutil.copytree(base / name, tmp_path / name)
    return tmp_path


def edit(directory: Path, change) -> None:
    """Changes the manifest in `directory` and writes it back as tokpack serialises it, so that
    only the change, not the bytes, tells it from one tokpack wrote."""
    m = json.loads((directory / MANIFEST).read_bytes())
    change(m)
    (directory / MANIFEST).write_bytes(canonical_bytes(m))


def problems(*dirs: Path, against: list[Path] = ()) -> tuple[str, list[tuple]]:
    r = validate_result([str(d) for d in dirs], quick=False, against=[str(a) for a in against], workers=1)
    j = r.to_json()
    return j["status"], [(p["file"], p["where"], p["expected"], p["found"], p["message"]) for p in j["problems"]]


@pytest.mark.parametrize("value", [5, -1, 2**63, 1.5, True])
def test_shards_that_is_no_list_is_one_line(env, value):
    """`shards` a number or a bool (not a list) crashed validate (TypeError: 'int' object is
    not iterable: the listing and padding checks iterated it): one line naming the field."""
    edit(env / "src", lambda m: m.__setitem__("shards", value))
    status, found = problems(env / "src")
    assert status == "corrupt" and found == [
        (str(env / "src" / MANIFEST), "shards", "a JSON list", repr(value), "manifest field has the wrong type")
    ]


@pytest.mark.parametrize("value", ["x", None, [], {}])
def test_best_fit_shard_samples_of_the_wrong_type_is_one_line(env, value):
    """A best-fit shard entry's `samples` not an int crashed validate (its `.ds.pad` size was
    worked out with int() of it): the field's own line, and the pad file is not read by it."""
    epoch = env / "bf" / "epoch-00000"
    edit(epoch, lambda m: m["shards"][0].__setitem__("samples", value))
    status, found = problems(epoch)
    assert status == "corrupt" and found == [
        (str(epoch / MANIFEST), "shards[0].samples", "a JSON int", repr(value), "manifest field has the wrong type")
    ]


PLANNED = [
    ("passes", 2**63),
    ("first_pass", 2**62),
    ("windows", 2**63),
    ("documents", 7),
    ("tokens", 5),
]


@pytest.mark.parametrize("key,value", PLANNED, ids=[k for k, _ in PLANNED])
def test_best_fit_source_entry_edited_is_never_proven_ok(env, key, value):
    """A best-fit epoch's source entries (passes, first pass, rows of a pass, documents) were
    checked by nothing: `validate --against` replayed the samples, found them right and said
    OK of a manifest whose figures (shown by inspect) were edited. Now the replay's plan must
    record them: CORRUPT, naming the field, the planned value and the one found."""
    epoch = env / "bf" / "epoch-00000"
    want = json.loads((epoch / MANIFEST).read_bytes())["sources"][0][key]
    edit(epoch, lambda m: m["sources"][0].__setitem__(key, value))
    status, found = problems(epoch, against=[env / "src"])
    assert status == "corrupt", found
    assert (
        str(epoch / MANIFEST),
        f"sources[0].{key}",
        f"{want} (replayed from the sources)",
        str(value),
        "epoch manifest's source entry is not its plan's",
    ) in found, found


@pytest.mark.parametrize(
    "key,value,where,expected",
    [
        ("offset", 3, "sources[0].offset", "0 (a packed epoch cuts no windows)"),
        ("dropped_tokens", 9, "sources[0].dropped_tokens", "0 (a packed epoch cuts no windows)"),
        ("passes", 2**63, "sources[0].passes", None),
    ],
)
def test_best_fit_source_entry_impossible_without_the_sources(env, key, value, where, expected):
    """What the manifest alone tells of a best-fit epoch's entries (no window offset, nothing
    dropped, at most a pass a sample) is checked without --against too: it was OK."""
    epoch = env / "bf" / "epoch-00000"
    edit(epoch, lambda m: m["sources"][0].__setitem__(key, value))
    status, found = problems(epoch)
    assert status == "corrupt" and [w for _, w, *_ in found] == [where], found
    samples = json.loads((epoch / MANIFEST).read_bytes())["sources"][0]["samples"]
    assert found[0][2] == (expected or f"1..{samples} (at most a pass a sample)") and found[0][3] == str(value)


def test_the_undamaged_best_fit_run_is_ok(env):
    """The checks above blame edits only: the run as written is OK, against its source too."""
    assert problems(env / "bf", against=[env / "src"]) == ("ok", [])


PACKING_EDITS = [
    ("group_tokens", None, "field 'group_tokens'", "no such field", "manifest field missing"),
    ("pad_id", None, "field 'pad_id'", "no such field", "manifest field missing"),
    ("method", 5, "a JSON str", "5", "manifest field has the wrong type"),
    ("group_tokens", 0, ">= 1", "0", "manifest field out of range"),
    ("pad_id", -1, ">= 0", "-1", "manifest field out of range"),
    ("table_xxh3_128", "XYZ", "32 lowercase hex digits", "'XYZ'", "malformed checksum"),
    ("padding_tokens", None, "field 'padding_tokens'", "no such field", "manifest field missing"),
]


@pytest.mark.parametrize(
    "key,value,expected,found,message", PACKING_EDITS, ids=[f"{e[0]}={e[1]}" for e in PACKING_EDITS]
)
def test_best_fit_packing_object_is_checked(env, key, value, expected, found, message):
    """A best-fit epoch's `packing` object was checked by no field table: without `group_tokens`
    or `pad_id` validate said OK, and with --against crashed (KeyError, exit 70); a method of
    the wrong type or a malformed row-table checksum was OK. Now each is its field's line, with
    and without --against, and nothing crashes."""
    epoch = env / "bf" / "epoch-00000"
    edit(epoch, lambda m: m["packing"].pop(key) if value is None else m["packing"].__setitem__(key, value))
    line = (str(epoch / MANIFEST), f"packing.{key}", expected, found, message)
    for against in ([], [env / "src"]):
        status, lines = problems(epoch, against=against)
        assert status == "corrupt" and line in lines, (against, lines)


def test_a_best_fit_run_manifest_without_its_pad_id_is_one_line(env):
    """The run's `packing` (what --like and stage repeat) has its table's required fields too."""
    edit(env / "bf", lambda m: m["packing"].pop("pad_id"))
    status, lines = problems(env / "bf")
    assert status == "corrupt" and lines == [
        (str(env / "bf" / MANIFEST), "packing.pad_id", "field 'pad_id'", "no such field", "manifest field missing")
    ]


@pytest.mark.parametrize("change", [lambda t: t + 1, lambda t: 2**63])
def test_a_node_slice_root_whose_tokens_are_not_its_epochs_sum(env, change):
    """A node slice's root `tokens` (its rank files' tokens over the staged epochs) set to any
    other number was OK: validate checked each slice epoch's sum, never the root's, as it
    does a run's. Now it is one line naming the field and the sum."""
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    dest = env / "slice"
    args = ["stage", str(env / "bf"), str(dest), "--node", "0/2", "--ranks-per-node", "1", "--micro-batch", "2"]
    assert CliRunner().invoke(main, args).exit_code == 0
    total = json.loads((dest / MANIFEST).read_bytes())["tokens"]
    assert problems(dest) == ("ok", [])
    edit(dest, lambda m: m.__setitem__("tokens", change(total)))
    assert problems(dest) == (
        "corrupt",
        [
            (
                str(dest / MANIFEST),
                "tokens",
                f"{total} (sum over its epochs)",
                str(change(total)),
                "slice token count wrong",
            )
        ],
    )


def test_a_shard_refused_before_its_scan_is_not_blamed_on_the_other_samples(env, base):
    """A shard's `.ds.rows` replaced by a symbolic link out of the epoch (to an identical copy):
    validate refused the shard, rightly, and then summed the multiset hash of the other shards
    alone and reported "the epoch's samples are not the ones recorded ... the data changed",
    though no sample had. Only the link's line remains: no sum is compared without every shard."""
    epoch = env / "run" / "epoch-00000"
    rows = epoch / "00000.ds.rows"
    rows.unlink()
    rows.symlink_to(base / "run" / "epoch-00000" / "00000.ds.rows")
    status, found = problems(epoch)
    assert status == "corrupt" and [(w, m) for _, w, _, _, m in found] == [
        (
            "shards[0].path",
            "manifest names a file outside its folder (a symlink to "
            f"{base / 'run' / 'epoch-00000' / '00000.ds.rows'}, outside the folder)",
        )
    ], found


AGAINST_EDITS = [
    ("epoch", 2**63),
    ("seq_len", 2**63),
    ("shards.0.path", []),
    ("shards.0.path", {}),
    ("shards.0.path", None),
]


@pytest.mark.parametrize("key,value", AGAINST_EDITS, ids=[f"{k}={v!r}" for k, v in AGAINST_EDITS])
def test_validate_against_a_damaged_epoch_manifest_never_crashes(env, key, value):
    """`validate EPOCH --against SOURCE` of a best-fit epoch whose epoch or seq_len is 2**63
    exited 70 (OverflowError in the replay's numpy arithmetic), and one whose shard entry's
    path is a list, an object or absent exited 70 too (the order proof keyed on it). Each
    manifest is already CORRUPT by its field's line: the replay it cannot drive adds none."""

    def change(m):
        *head, last = [int(k) if k.isdigit() else k for k in key.split(".")]
        for k in head:
            m = m[k]
        m.pop(last) if value is None else m.__setitem__(last, value)

    epoch = env / "bf" / "epoch-00000"
    edit(epoch, change)
    status, found = problems(epoch, against=[env / "src"])
    assert status == "corrupt" and found and all(f == str(epoch / MANIFEST) for f, *_ in found), found


def test_a_one_shard_epoch_of_any_shard_samples_is_replayed(env):
    """A one-shard epoch holds every sample in shard 0 whatever its shard_samples (at least
    its samples): 2**63 made --against exit 70 (numpy's g // shard_samples). Alone the epoch
    is consistent and proven OK; in its run, the run's shard_samples tells the edit."""
    epoch = env / "bf" / "epoch-00000"
    edit(epoch, lambda m: m.__setitem__("shard_samples", 2**63))
    assert problems(epoch, against=[env / "src"]) == ("ok", [])
    status, found = problems(env / "bf", against=[env / "src"])
    assert status == "corrupt" and [w for _, w, *_ in found] == ["shard_samples"], found


@pytest.mark.parametrize("key,value", [("seq_len", -1), ("shard_samples", 2**63), ("shard_samples", 2**62)])
def test_validate_against_a_window_epoch_of_impossible_sizes_never_crashes(env, key, value):
    """A window epoch of several shards validated --against its source: seq_len -1 exited 70
    (ZeroDivisionError, a row of 0 tokens in the replay), shard_samples 2**63 or 2**62 exited 70
    (its samples numbered past uint64 for the order proof). Each is its field's lines."""
    epoch = env / "run" / "epoch-00000"
    edit(epoch, lambda m: m.__setitem__(key, value))
    status, found = problems(epoch, against=[env / "src"])
    assert status == "corrupt" and found and all(f == str(epoch / MANIFEST) for f, *_ in found), found
    assert {w.split(".")[-1] for _, w, *_ in found if w} == {key if key == "seq_len" else "samples"}, found


@pytest.mark.parametrize("key,value", [("fingerprint", []), ("fingerprint", {}), ("offset", -1)])
def test_validate_against_a_window_epoch_source_entry_of_the_wrong_kind_never_crashes(env, key, value):
    """A window epoch's source entry with a fingerprint that is a list or an object exited 70
    under --against (unhashable: it was looked up among the given sources' fingerprints), and
    one with offset -1 exited 70 too (the replay read tokens from -1). Each is CORRUPT, its
    field's line first."""
    epoch = env / "run" / "epoch-00000"
    edit(epoch, lambda m: m["sources"][0].__setitem__(key, value))
    status, found = problems(epoch, against=[env / "src"])
    assert status == "corrupt" and found[0][:2] == (str(epoch / MANIFEST), f"sources[0].{key}"), found
