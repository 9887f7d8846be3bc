"""Every number a user gives goes through one parser (tokpack.formats.units.number and its unit
parsers), bounded (issue 42, item 6): each numeric option of every command, and $TOKPACK_PROGRESS,
refuses a number at its extremes (1e308, -1, nan, inf, '', 'abc', thirty nines, '2%' where no
percentage is taken...) with one line naming the option or variable and the text as typed, never
a traceback; the progress-line thread survives an interval and a line it cannot handle."""

from __future__ import annotations

import io
import sys
import threading
import time

import click
import pytest

from conftest import wait_until
from tokpack.formats import units
from tokpack.formats.errors import TokpackError
from tokpack.formats.io import progress_log
from tokpack.packer import cli_options
from tokpack.packer.cli import main

EXTREMES = ["1e308", "-1e308", "-1", "nan", "inf", "-inf", "", "  ", "abc", "9" * 30, "1" * 200, "2%", "1.5", "0x10"]
# The commands' paths, each with positional arguments that parse (the option refuses first).
COMMANDS = {
    ("pack",): ["in.jsonl", "-o", "out"],
    ("shuffle",): ["src"],
    ("validate",): ["dir"],
    ("read",): ["dir"],
    ("inspect",): ["dir"],
    ("stage",): ["dir", "dest"],
    ("plan", "shuffle"): ["src"],
    ("plan", "pack"): ["in.jsonl", "-o", "out"],
    ("plan", "stage"): ["dir", "dest"],
}


def _numeric_options():
    for path, positional in COMMANDS.items():
        cmd = main
        for name in path:
            cmd = cmd.commands[name]
        for p in cmd.params:
            numeric = isinstance(p.type, (click.types._NumberRangeBase, cli_options.Quantity))
            if isinstance(p, click.Option) and not p.is_flag and numeric:
                yield path, positional, p


OPTIONS = [(path, positional, p.opts[0], p.type) for path, positional, p in _numeric_options()]


def _accepts(option: str, kind, text: str) -> bool:
    """The extremes an option takes as a number of its own (the rest it must refuse)."""
    if option == "--seed" and text == "-1":
        return True  # a seed may be negative, as click's int took it
    if option == "--holdout" and text in ("2%",):
        return True
    if text == "1.5" and (isinstance(kind, click.FloatRange) or kind is cli_options.BYTES):
        return True  # a real option; a byte size rounds down to whole bytes
    return False


def test_every_numeric_option_is_found():
    names = {(path, option) for path, _, option, _ in OPTIONS}
    for expected in [
        (("shuffle",), "--seq-len"),
        (("shuffle",), "--log-interval"),
        (("shuffle",), "--holdout"),
        (("shuffle",), "--memory"),
        (("shuffle",), "--seed"),
        (("pack",), "--eos-id"),
        (("pack",), "--mem-per-cpu-gb"),
        (("stage",), "--start-sample"),
        (("plan", "shuffle"), "--disk-mbps"),
        (("plan", "shuffle"), "--nic-mbps"),
    ]:
        assert expected in names
    assert len(OPTIONS) >= 60  # every command's: workers, tasks, cpus, ranks, sizes, ids, speeds...


@pytest.mark.parametrize(
    ("path", "positional", "option", "kind"), OPTIONS, ids=[f"{' '.join(o[0])} {o[2]}" for o in OPTIONS]
)
def test_a_number_at_its_extremes_is_one_line_naming_the_option_and_the_text(path, positional, option, kind, capsys):
    for text in EXTREMES:
        if _accepts(option, kind, text):
            continue
        with pytest.raises(SystemExit) as exit_:
            main.main([*path, *positional, f"{option}={text}"], prog_name="tokpack")
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (option, text, err)
        assert "Traceback" not in err
        (line,) = [x for x in err.splitlines() if x.startswith("Error:")]
        assert line.startswith(f"Error: Invalid value for '{option}': "), (option, text, line)
        assert repr(text)[:40].rstrip("'") in line, (option, text, line)  # the text as typed (cut if long)


@pytest.mark.parametrize("var", ["TOKPACK_PROGRESS", "TOKPACK_LOG_INTERVAL"])
@pytest.mark.parametrize("text", ["1e308", "-1", "nan", "inf", "abc", "9" * 30, "1" * 200, "2%", "86401", "0x10"])
def test_a_bad_progress_variable_is_one_line_before_the_command_runs(var, text, capsys, monkeypatch):
    """Checked before the command does anything, by every command (shuffle too): exit 1, one
    error line naming the variable and its text (the former variable adds its deprecation line)."""
    monkeypatch.delenv("TOKPACK_PROGRESS", raising=False)
    monkeypatch.delenv("TOKPACK_LOG_INTERVAL", raising=False)
    monkeypatch.setattr(progress_log, "_warned_old", False)
    monkeypatch.setenv(var, text)
    for args in (
        ["validate", "no-such-dir"],
        ["shuffle", "no-such-src", "-o", "x", "--seq-len", "8", "--seed", "1", "--epochs", "1"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main.main(args, prog_name="tokpack")
        err = capsys.readouterr().err
        assert exit_.value.code == 1 and "Traceback" not in err, err
        (line,) = [x for x in err.splitlines() if x.startswith("tokpack: error:")]
        assert line.startswith(f"tokpack: error: [${var}]: "), line
        assert f"found {units.typed(text)}" in line, line
        monkeypatch.setenv(var, text)  # the former variable's text was handed to the new one


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        (None, ("on", 30.0)),
        ("", ("on", 30.0)),
        ("off", ("off", 0.0)),
        ("0", ("off", 0.0)),
        ("bar", ("bar", 30.0)),
        ("LOG", ("log", 30.0)),
        ("2.5", ("on", 2.5)),
        ("86400", ("on", 86400.0)),
    ],
)
def test_one_variable_governs_progress(text, mode, monkeypatch):
    monkeypatch.delenv("TOKPACK_LOG_INTERVAL", raising=False)
    if text is None:
        monkeypatch.delenv("TOKPACK_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("TOKPACK_PROGRESS", text)
    assert progress_log.progress_mode() == mode
    assert progress_log.progress_on() == (mode[0] != "off")


def test_the_parser_bounds_and_names():
    assert units.number("  42 ", "--x") == 42 and units.number("-3", "--seed", least=-10) == -3
    assert units.number("2.5e1", "--s", real=True) == 25.0
    with pytest.raises(TokpackError) as e:
        units.number("1e308", "--log-interval", real=True, most=86400)
    assert str(e.value) == "[--log-interval]: out of range; expected a number >= 0, <= 86,400, found '1e308'"
    for bad in (True, 1.5, "1.0", "1e3", None, [1]):
        with pytest.raises(TokpackError, match=r"^\[--n\]: not an integer"):
            units.number(bad, "--n")
    assert units.typed("9" * 500).endswith("...'") and len(units.typed("9" * 500)) <= 60
    assert units.holdout_amount("1%") == ("fraction", units.Fraction(1, 100))
    assert units.holdout_amount("5M") == ("tokens", 5_000_000)


def test_a_huge_holdout_is_refused_in_one_line_without_a_dict(capsys):
    for text in ["99999999999999999999999999T", "1e400", "1e99999999", "10**30"]:
        with pytest.raises(SystemExit) as exit_:
            main.main(
                ["shuffle", "src", "-o", "o", "--seq-len", "8", "--seed", "1", "--epochs", "1", "--holdout", text]
            )
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "{" not in err and "Traceback" not in err, err
        assert "Invalid value for '--holdout'" in err and repr(text) in err


# ------------------------------------------------------------------ the progress thread cannot die


@pytest.fixture
def thread_failures(monkeypatch):
    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    return failures


def test_the_progress_thread_survives_an_interval_it_cannot_wait(thread_failures, capsys):
    """An interval past what threading can wait (1e308: OverflowError in Event.wait), or nan,
    given to a bar by a caller that skipped the parser: the lines go on, bounded, no traceback."""
    for interval in (1e308, float("nan"), float("inf")):
        bar = progress_log._LogBar(10, "huge interval", "B", interval)
        time.sleep(0.1)
        bar.close()
        time.sleep(0.05)
    assert thread_failures == []
    assert "Traceback" not in capsys.readouterr().err


def test_the_progress_thread_survives_a_line_it_cannot_make(thread_failures, monkeypatch):
    """Each step waits for what it relies on (a line tried, a line written), not a fixed time: a
    loaded machine may not run the writer thread for a while."""
    failed = []

    class Broken(progress_log._LogBar):
        def line(self, now=None):
            failed.append(1)
            raise ValueError("a bar whose line fails")

    # read while the writer writes: a StringIO's getvalue never drops a line (capsys's read would)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    broken = Broken(100, "broken", "B", 0.05)
    wait_until(lambda: len(failed) > 1, "the writer tried the broken bar's line twice")
    good = progress_log._LogBar(100, "good", "B", 0.05)
    broken.update(100)  # finished: the good bar is shown next
    wait_until(lambda: " tokpack: good: " in sys.stderr.getvalue(), "the good bar's line")
    good.close()
    broken.close()
    err = sys.stderr.getvalue()
    assert thread_failures == [] and "Traceback" not in err
    assert " tokpack: good: " in err  # the writer lived on after the failing lines


@pytest.mark.parametrize(
    ("option", "text"),
    [
        ("--shards-of", "0/²"),  # str.isdigit() passed it, int() refused it: an internal error
        ("--shards-of", "0/" + "9" * 60),
        ("--epochs", "٠-١"),  # Arabic-Indic digits, which int() takes
        ("--epochs", "0-1_0"),  # int() takes the underscore
        ("--ranks", "0-1_0"),
        ("--node", "0/1_0"),
    ],
)
def test_numbers_inside_a_spelling_are_ascii_digits(option, text, capsys):
    """'0-3', 'r/W', 'n/N': each number in them goes through the same parser (units.digits)."""
    extra = ["--ranks-per-node", "1", "--micro-batch", "1"] if option == "--node" else []
    extra += ["--world-size", "4", "--micro-batch", "1"] if option == "--ranks" else []
    with pytest.raises(SystemExit) as exit_:
        main.main(["stage", "no-such-run", "dest", option, text, *extra], prog_name="tokpack")
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err and "internal error" not in err, err
    (line,) = err.splitlines()
    assert line.startswith(f"tokpack: error: [{option}]: bad {option}"), line


def test_digits():
    assert units.digits(" 42 ") == 42 and units.digits("-3") == -3
    for bad in ["²", "٤٢", "1_0", "", "1.0", "9" * 41, "+", "0x1"]:
        with pytest.raises(ValueError):
            units.digits(bad)


def test_a_seed_is_any_integer_a_manifest_records(tmp_path, capsys):
    """64 unsigned bits too, as before; past them (or below -2**63) one line, and a schedule's
    seed is checked before anything is written (it wrote the epoch, then refused its manifest)."""
    from conftest import random_docs, write_source

    import numpy as np

    (seed,) = [p for p in main.commands["shuffle"].params if p.name == "seed"]
    for ok in (2**64 - 1, -(2**63), 0):
        assert seed.type.convert(str(ok), seed, None) == ok
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(click.BadParameter, match=f"found '{bad}'"):
            seed.type.convert(str(bad), seed, None)
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(1), 50, 1000, 0))
    schedule = tmp_path / "s.yaml"
    schedule.write_text(f"seq_len: 16\nseed: {10**30}\nstages:\n  - {{name: a, sources: {{{src}: 1}}, epochs: 1}}\n")
    with pytest.raises(SystemExit) as exit_:
        main.main(["shuffle", "--schedule", str(schedule), "-o", str(tmp_path / "run")], prog_name="tokpack")
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and not (tmp_path / "run").exists(), err
    assert err.splitlines() == [
        f"tokpack: error: {schedule} [seed]: schedule value is out of range; expected an integer in "
        f'[-2**63, 2**64), found {10**30}. HINT: see docs/COMMANDS.md, "Schedules", for the file\'s shape'
    ]
