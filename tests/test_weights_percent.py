"""A mixture weight written as a percentage (issue 43): `SOURCE=70%` on the command line, in a
schedule file's `{SOURCE: WEIGHT}` and in the API's mapping is 0.7, as `--holdout 2%` is 0.02.
A run made with `70%` is the run made with `0.7`, byte for byte, manifests included."""

from __future__ import annotations

import hashlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.packer.api import shuffle
from tokpack.packer.cli import main

SEQ, MEMORY = 31, 1 << 20


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("percent")
    rng = np.random.default_rng(3)
    return (
        write_source(root / "a", random_docs(rng, 120, 1000, 0, max_len=120)),
        write_source(root / "b", random_docs(rng, 90, 1000, 0, max_len=120)),
    )


@pytest.mark.parametrize(
    "text,fraction,recorded",
    [
        ("70%", Fraction(7, 10), "0.7"),
        ("12.5%", Fraction(1, 8), "0.125"),
        (" 100 %", Fraction(1), "1"),
        ("250%", Fraction(5, 2), "2.5"),
        ("1/3%", Fraction(1, 300), "1/300"),
        ("0.7", Fraction(7, 10), "0.7"),  # not a percentage: as given
        ("1/3", Fraction(1, 3), "1/3"),
    ],
)
def test_a_percentage_is_its_number(text, fraction, recorded):
    from tokpack.formats.units import parse_weight, weight_text

    assert parse_weight(text, "w") == fraction
    assert weight_text(text) == recorded


@pytest.mark.parametrize("text", ["%", "abc%", "7O%", "nan%"])
def test_a_percentage_that_is_no_number_is_refused(text):
    from tokpack.formats.units import parse_weight, weight_text

    with pytest.raises(TokpackError, match="weight is not a number"):
        parse_weight(weight_text(text), "w")


def test_cli_70_percent_is_the_run_of_0_7(sources, tmp_path):
    """`a=70% b=30%` writes the bytes `a=0.7 b=0.3` writes (epochs and manifests); before, `70%`
    was refused ("weight is not a number")."""
    a, b = sources
    for name, (wa, wb) in {"percent": ("70%", "30%"), "decimal": ("0.7", "0.3")}.items():
        args = [f"{a}={wa}", f"{b}={wb}", "-o", tmp_path / name, "--seq-len", SEQ, "--seed", 2, "--epochs", 2]
        r = CliRunner().invoke(main, ["shuffle", *map(str, args), "--samples", "300", "--memory", "1MiB"])
        assert r.exit_code == 0, r.output
    assert tree(tmp_path / "percent") == tree(tmp_path / "decimal")
    assert '"0.7"' in (tmp_path / "percent" / "tokpack.json").read_text()


def test_api_mapping_and_schedule_file_take_percentages(sources, tmp_path):
    """The API's mapping {path: "70%"} and a schedule's {SOURCE: 70%} are 0.7: the same epochs
    as the decimal weights, and the schedule records 0.7."""
    a, b = sources
    common = dict(seq_len=SEQ, seed=5, epochs=1, samples=200, memory=MEMORY)
    shuffle({str(a): "70%", str(b): "30%"}, tmp_path / "api-percent", **common)
    shuffle({str(a): 0.7, str(b): 0.3}, tmp_path / "api-decimal", **common)
    assert tree(tmp_path / "api-percent") == tree(tmp_path / "api-decimal")
    for name, (wa, wb) in {"percent": ("70%", "30%"), "decimal": ("0.7", "0.3")}.items():
        stage = f"  - {{name: only, epochs: 1, sources: {{{a}: {wa}, {b}: {wb}}}}}\n"
        (tmp_path / f"{name}.yaml").write_text(f"seq_len: {SEQ}\nseed: 5\nstages:\n{stage}")
        shuffle(None, tmp_path / f"sched-{name}", schedule=tmp_path / f"{name}.yaml", memory=MEMORY)
    percent, decimal = tree(tmp_path / "sched-percent"), tree(tmp_path / "sched-decimal")
    assert {k: v for k, v in percent.items() if k != "tokpack.json"} == {
        k: v for k, v in decimal.items() if k != "tokpack.json"
    }  # the run manifest names its schedule file (and that file's hash), which differ
    assert '"0.7"' in (tmp_path / "sched-percent" / "tokpack.json").read_text()


def test_a_url_source_takes_a_percentage():
    """In a URL, `=` starts a weight only when a number follows: `70%` is one."""
    from tokpack.packer.cli_options import weighted_sources as _weighted_sources

    assert _weighted_sources(["s3://bucket/web=70%", "s3://bucket/q?a=b"]) == [
        ("s3://bucket/web", "70%"),
        ("s3://bucket/q?a=b", None),
    ]


@pytest.mark.parametrize("text", ["1e99999999", "1e99999999%", "1e308%", "1e-31", "2E+31", "1/1e99999"])
def test_a_weight_past_ten_to_the_thirty_is_one_line_at_once(text):
    """Fraction('1e99999999') computes 10**99999999 (minutes, then memory): a weight's power of
    ten is bounded on its text, before any number is built (a timeout here is the bug)."""
    import time

    from tokpack.formats.units import parse_weight, weight_text

    t0 = time.monotonic()
    with pytest.raises(TokpackError, match="weight out of range") as e:
        parse_weight(weight_text(text), "w")
    assert time.monotonic() - t0 < 5 and "1e-30..1e30" in str(e.value)


@pytest.mark.parametrize("text,fraction", [("1e30", Fraction(10**30)), ("1e-30", Fraction(1, 10**30)), ("3E5%", 3000)])
def test_a_weight_at_ten_to_the_thirty_is_taken(text, fraction):
    from tokpack.formats.units import parse_weight, weight_text

    assert parse_weight(weight_text(text), "w") == fraction


def test_a_weight_out_of_range_is_one_line_from_the_command_line(sources, tmp_path):
    """A URL's `=1e99999` is a weight (a number, if not a valid one), told apart without building
    it; a local source's is refused in one line, before anything is written."""
    from tokpack.packer.cli_options import weighted_sources as _weighted_sources

    assert _weighted_sources(["s3://bucket/web=1e99999"]) == [("s3://bucket/web", "1e99999")]
    args = ["shuffle", f"{sources[0]}=1e99999", "-o", tmp_path / "r", "--seq-len", 8, "--seed", 1, "--epochs", 1]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 1 and "weight out of range" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "r" / "tokpack.json").exists()
