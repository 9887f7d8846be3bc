"""formats/ is the format: docs/FORMAT.md's field tables are formats/fields.py's tables, and
manifests written before `documents` of epochs and runs was renamed `fragments` still read,
validate, extend and stage.

`python tests/test_format.py` prints the tables as FORMAT.md must hold them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tokpack.formats.constants import MANIFEST
from tokpack.formats.fields import MANIFEST_FIELDS, PACKING_FIELDS, SHARD_FIELDS, SOURCE_FIELDS, STAGE_FIELDS
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.formats.names import epoch_dir_name
from tokpack.loader.reader import SampleReader
from tokpack.packer.validation import validate_dirs
from tests.conftest import random_docs, require, write_source
from tests.test_validate import EOS, VOCAB, make_run

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"
TABLES = [MANIFEST_FIELDS, SHARD_FIELDS, SOURCE_FIELDS, PACKING_FIELDS, STAGE_FIELDS]
HEADER = "| field | type | required | in | meaning |"


def markdown_rows(table: dict) -> list[str]:
    return [
        f"| `{name}` | {typ} | {required} | {kinds} | {meaning} |"
        for name, (typ, required, kinds, meaning) in table.items()
    ]


def doc_tables() -> list[list[str]]:
    """The rows of each field table in FORMAT.md (tables whose header is HEADER), in order."""
    tables, rows = [], None
    for line in FORMAT_MD.read_text().splitlines():
        if line == HEADER:
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("|"):
            if not re.fullmatch(r"\|( --- \|)+", line):
                rows.append(line)
        else:
            rows = None
    return tables


def test_format_md_tables_are_the_module_tables():
    found = doc_tables()
    assert len(found) == len(TABLES), "FORMAT.md must hold one field table per table of tokpack.formats.fields"
    for rows, table in zip(found, TABLES):
        parsed = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
        # names, types, required, kinds first: the facts a reader of either relies on
        assert [(n.strip("`"), t, r, k) for n, t, r, k, _ in parsed] == [
            (n, t, r, k) for n, (t, r, k, _) in table.items()
        ]
        assert rows == markdown_rows(table)  # and the meanings, word for word


def test_every_table_type_is_checked():
    """A type the doc shows but the checker does not know would pass anything."""
    from tokpack.formats.fields import _JSON, field_problems

    for table in TABLES:
        for name, (typ, _, kinds, _) in table.items():
            assert all(t in _JSON for t in typ.split(" or ")), (name, typ)
            bad = {name: object()}
            assert any(p[0] == name for p in field_problems(bad, table, kinds.split(", ")[0])), name


def _to_old_key(directory: Path) -> None:
    """Rewrites a manifest as writers before the rename did: `documents` where `fragments` is."""
    path = directory / MANIFEST
    m = json.loads(path.read_bytes())
    assert "fragments" in m and "documents" not in m
    path.write_bytes(canonical_bytes({("documents" if k == "fragments" else k): v for k, v in m.items()}))


@pytest.fixture
def old_run(tmp_path) -> tuple[Path, Path]:
    docs = random_docs(np.random.default_rng(5), 50, VOCAB, EOS, max_len=100)
    src = write_source(tmp_path / "src", docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=20)
    run = make_run(Path(src), tmp_path / "run", seed=4, epochs=[0, 1])
    for d in (run / epoch_dir_name(0), run / epoch_dir_name(1), run):
        _to_old_key(d)
    return Path(src), run


def test_old_key_manifests_read_and_validate(old_run):
    src, run = old_run
    report = validate_dirs([run])
    assert report.ok, [p.message for p in report.problems]
    epoch = read_manifest(run / epoch_dir_name(0), kind="epoch")
    assert "documents" not in epoch and epoch["fragments"] == sum(s["fragments"] for s in epoch["shards"])
    assert read_manifest(run, kind="run")["fragments"] == sum(
        read_manifest(run / epoch_dir_name(e))["fragments"] for e in (0, 1)
    )
    assert read_manifest(src, kind="source")["documents"] == 50  # a source's documents keep their name
    r = SampleReader.open(run)
    assert r.epochs == [0, 1] and r.total_samples > 0


def test_old_key_fragment_count_is_still_checked(old_run):
    _, run = old_run
    path = run / epoch_dir_name(1) / MANIFEST
    m = json.loads(path.read_bytes())
    m["documents"] += 1
    path.write_bytes(canonical_bytes(m))
    found = [(p.where, p.message) for p in validate_dirs([run]).problems]
    assert ("fragments", "fragment count wrong") in found and ("fragments", "run fragments count wrong") in found


def test_run_with_old_key_epochs_extends_and_stages(old_run, tmp_path):
    from tokpack.packer.staging import stage

    src, run = old_run
    make_run(src, run, seed=4, epochs=[2])
    m = json.loads((run / MANIFEST).read_bytes())
    assert "documents" not in m and m["epochs"] == [0, 1, 2]
    assert m["fragments"] == sum(read_manifest(run / epoch_dir_name(e))["fragments"] for e in (0, 1, 2))
    assert validate_dirs([run]).ok
    stage(str(run), tmp_path / "dest", epochs="0,2")
    staged = json.loads((tmp_path / "dest" / MANIFEST).read_bytes())
    assert (
        staged["epochs"] == [0, 2]
        and staged["fragments"] == m["fragments"] - read_manifest(run / epoch_dir_name(1))["fragments"]
    )
    assert validate_dirs([tmp_path / "dest"]).ok


def test_metadata_count_as_datatrove_writes_it():
    """`.ds.metadata`'s third line is humanize's metric(tokens, unit="T"), as datatrove writes it:
    tokpack makes it itself (humanize is not its dependency) and must write the same text."""
    import random

    from tokpack.formats.names import metric_tokens

    humanize = require("humanize", "a datatrove dependency: pip install datatrove")
    rng = random.Random(0)
    counts = list(range(2000)) + [10**k + d for k in range(1, 20) for d in (-1, 0, 1)]
    counts += [int(x * 10**k) for k in range(17) for x in (9.995, 9.9949, 99.95, 999.5, 999.49, 1.005)]
    counts += [rng.randrange(1, 10 ** rng.randrange(1, 20)) for _ in range(20000)] + [2**64 - 1]
    assert [metric_tokens(n) for n in counts] == [humanize.metric(n, unit="T") for n in counts]
    assert metric_tokens(489_600) == "490 kT" and metric_tokens(999_600) == "1.00 MT"


@pytest.mark.parametrize("body", [b'{"format": "tokpack", "version": 1, "kind": "run", "seed": NaN}', b"[1, 2"])
def test_stage_reads_dest_manifests_strictly(tmp_path, body):
    """stage reads what DEST holds through the format's strict parser: a manifest with a value
    outside the format (NaN), or not JSON, vouches for nothing."""
    from tokpack.packer.stage_dest import dest_holds

    (tmp_path / MANIFEST).write_bytes(body)
    held = dest_holds(tmp_path)
    assert (held.kind, held.words) == ("damaged", "an unreadable tokpack.json")


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_holdout_has_one_reader_and_one_writer(padded, split):
    """formats.packing decides where --holdout is recorded: a window manifest at its top level
    (RUN/holdout/'s `split` inside it), a packed one in its `packing` (`split` beside it), as
    format 1 has always written them; the reader finds it in either."""
    from tokpack.formats.packing import PackingRecord, holdout_recorded, record_holdout, run_holdout

    spec = {"fraction": "1/100"}
    fields = record_holdout(spec, split, padded=padded)
    if padded:
        m = {"packing": {"method": "best-fit", "group_tokens": 8, "pad_id": 0, **fields}}
        assert list(fields) == ["holdout", *(["split"] if split else [])] and fields["holdout"] == spec
        assert PackingRecord.of(m).settings() == {"method": "best-fit", "group_tokens": 8, "pad_id": 0, "holdout": spec}
    else:
        m = dict(fields)
        assert fields == {"holdout": {**spec, **({"split": "holdout"} if split else {})}}
        assert PackingRecord.of(m) is None
    assert holdout_recorded(m) == (spec, split) and run_holdout(m) == spec
    assert record_holdout(None, padded=padded) == {} and holdout_recorded({}) == (None, False)


if __name__ == "__main__":
    for table in TABLES:
        print(HEADER + "\n| --- | --- | --- | --- | --- |\n" + "\n".join(markdown_rows(table)) + "\n")
