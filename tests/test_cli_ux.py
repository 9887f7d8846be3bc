"""What a newcomer meets first: one JSON schema for every command, help that shows an example,
options that say what they mean, deprecated spellings that still work."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs
from tokpack.packer.cli_options import executor_config as _executor_config, executor_options
from tokpack.packer.cli import main

VOCAB, EOS = 1000, 0


def run(*args) -> click.testing.Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def json_of(*args) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def corpus(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 80, VOCAB, EOS, max_len=200)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d[d != EOS].tolist()}) + "\n" for d in docs))
    return path


def test_every_command_json_has_ok(corpus, tmp_path):
    """On success every command's --json object says "ok": true, as a failure's says false, so a
    CI script can test `.ok` whatever it ran."""
    src, out = tmp_path / "src", tmp_path / "run"
    shuffle_args = [src, "-o", out, "--seq-len", 31, "--seed", 1, "--epochs", 1, "--memory", "64KiB"]
    results = {
        "plan pack": json_of(
            "plan", "pack", corpus, "-o", src, "--eos-id", EOS, "--vocab-size", VOCAB, "--disk-mbps", 100
        ),
        "pack": json_of("pack", corpus, "-o", src, "--eos-id", EOS, "--vocab-size", VOCAB),
        "plan shuffle": json_of("plan", "shuffle", *shuffle_args, "--disk-mbps", 100),
        "shuffle": json_of("shuffle", *shuffle_args),
        "validate": json_of("validate", out),
        "inspect": json_of("inspect", out, "--batch-size", 4, "--batches", 2),
        "plan stage": json_of("plan", "stage", out, tmp_path / "copy", "--disk-mbps", 100),
        "stage": json_of("stage", out, tmp_path / "copy"),
    }
    assert {name: r.get("ok") for name, r in results.items()} == dict.fromkeys(results, True)
    assert list(results["pack"])[0] == "ok"
    failed = run("inspect", tmp_path / "nowhere", "--json")
    assert failed.exit_code == 1 and json.loads(failed.stdout)["ok"] is False


def commands(group: click.Group = main, prefix: tuple = ()):
    """(path, command) of the group and of every command under it."""
    yield prefix, group
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, prefix + (name,))
        else:
            yield prefix + (name,), cmd


@pytest.mark.parametrize("path", [p for p, _ in commands()], ids=lambda p: " ".join(p) or "tokpack")
def test_every_help_has_an_example_and_every_option_a_meaning(path):
    r = run(*path, "--help")
    assert r.exit_code == 0
    example = r.output.split("Example:", 1)
    assert len(example) == 2, f"no example in tokpack {' '.join(path)} --help"
    first = example[1].strip().splitlines()[0].strip()
    assert first.startswith("tokpack " + " ".join(path)), first  # the command itself, its lines kept
    cmd = dict(commands())[path]
    no_help = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert no_help == []


def test_only_plan_shuffle_speaks_of_virtual_sources():
    assert "virtual:" in run("plan", "shuffle", "--help").output
    for command in ("pack", "stage"):
        assert "virtual" not in run("plan", command, "--help").output


def test_shard_tokens_default_reads_as_a_count():
    text = " ".join(run("pack", "--help").output.split())
    assert "2^30 = 1Gi tokens" in text and "1073741824" not in text


def test_plan_takes_every_argument_of_the_command_it_plans(corpus, tmp_path):
    """`plan X` has every parameter of X (it says it takes the command's arguments): --scratch
    included, which with a local -o changes nothing, in the plan as in the command."""
    plan = main.commands["plan"]
    for name in ("pack", "shuffle", "stage"):
        own = {p.name for p in main.commands[name].params}
        assert own <= {p.name for p in plan.commands[name].params}, name
    with_scratch = json_of(
        "plan",
        "pack",
        corpus,
        "-o",
        tmp_path / "src",
        "--eos-id",
        EOS,
        "--vocab-size",
        VOCAB,
        "--scratch",
        tmp_path / "scratch",
        "--disk-mbps",
        100,
    )
    without = json_of(
        "plan", "pack", corpus, "-o", tmp_path / "src", "--eos-id", EOS, "--vocab-size", VOCAB, "--disk-mbps", 100
    )
    assert with_scratch["passes"] == without["passes"] and not (tmp_path / "scratch").exists()


@click.command()
@executor_options
def probe(**kw):
    click.echo(json.dumps(dataclasses.asdict(_executor_config(kw))))


def test_slurm_memory_option_is_unambiguous_and_mem_still_works():
    """--mem (GB per CPU) sat next to shuffle's --memory (bytes): it is --mem-per-cpu-gb now;
    --mem still works, hidden, with one warning."""
    runner = CliRunner()
    new = runner.invoke(probe, ["--mem-per-cpu-gb", "5"])
    assert json.loads(new.stdout)["mem_per_cpu_gb"] == 5 and new.stderr == ""
    old = runner.invoke(probe, ["--mem", "3"])
    assert json.loads(old.stdout)["mem_per_cpu_gb"] == 3
    assert old.stderr.count("warning: --mem is deprecated") == 1 and "--mem-per-cpu-gb" in old.stderr
    assert runner.invoke(probe, ["--mem", "3", "--mem-per-cpu-gb", "5"]).exit_code == 2
    shown = run("shuffle", "--help").output
    assert "--mem-per-cpu-gb" in shown and "--mem " not in shown and "--memory" in shown


PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # as PyTorch's install page shows it for "CPU"


def test_readme_installs_torch_without_the_cuda_wheel():
    """The [torch] extra takes any torch >= 2.1; the README installs the CPU build first, from
    PyTorch's CPU index (its literal URL: a variable defined nowhere made pip fall back to
    PyPI's CUDA build) through pip's --index-url, then the extra (which keeps it)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("Installing torch", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first, second = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert first == ["python", "-m", "pip", "install", "torch", "--index-url", PYTORCH_CPU_INDEX]
    assert second == ["python", "-m", "pip", "install", "-e", "'.[torch]'"]
    assert "$" not in block


def test_readme_test_command_cannot_pull_the_cuda_build_and_ci_runs_it_verbatim():
    """The test command takes torch alone (--no-deps: one lookup of an index that cannot be
    reached, not one per dependency) from PyTorch's CPU index, then the [test] extra, whose
    Linux pin is the +cpu build that no PyPI wheel is; pytest runs a worker per core, so the
    extra must carry pytest-xdist; .ci/run runs the same line."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    command = readme.split("Install what the tests need", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    assert "\n" not in command and command in (root / ".ci" / "run").read_text().splitlines()
    torch_step, install, run_tests = [part.split() for part in command.split(" && ")]
    assert torch_step[:4] == ["python", "-m", "pip", "install"] and "--no-deps" in torch_step
    assert torch_step[torch_step.index("--index-url") + 1] == PYTORCH_CPU_INDEX
    (pin,) = [a for a in torch_step if a.startswith("torch==")]
    assert install == ["python", "-m", "pip", "install", "-q", "-e", "'.[test]'"] and run_tests == [
        "python",
        "-m",
        "pytest",
        "-q",
        "-n",
        "auto",
    ]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("pytest-xdist==") for r in extras["test"])
    for extra in ("test", "bench"):
        torch_pins = sorted(r for r in extras[extra] if r.startswith("torch=="))
        assert torch_pins == [f"{pin}+cpu; sys_platform == 'linux'", f"{pin}; sys_platform != 'linux'"], extra


def test_pack_shows_an_overall_bar_over_its_files(corpus, tmp_path, monkeypatch):
    """Besides a bar per input file, one bar over all of them, moved by each file's bytes."""
    import tokpack.formats.io.progress_log
    import tokpack.packer.packing
    from tokpack.packer import pack

    bars = []

    class Recorder(tokpack.formats.io.progress_log._NoBar):
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.done = total, desc, 0
            bars.append(self)

        def update(self, n: int = 1) -> None:
            self.done += n

        def close(self) -> None:
            pass

    monkeypatch.setattr(tokpack.packer.packing, "progress", Recorder)
    other = tmp_path / "more.jsonl"
    other.write_text(corpus.read_text())
    pack([corpus, other], tmp_path / "src", eos_id=EOS, vocab_size=VOCAB)
    (overall,) = [b for b in bars if b.desc == "pack: 2 files"]
    assert overall.total == overall.done == corpus.stat().st_size + other.stat().st_size
    assert sorted(b.desc for b in bars if b is not overall) == ["pack corpus.jsonl", "pack more.jsonl"]


def test_shuffle_of_an_unpacked_folder_says_to_pack_it_not_to_rerun(corpus, tmp_path):
    """`shuffle CORPUS_DIR` (the tokenized corpus, not yet packed) said "incomplete: no
    tokpack.json. HINT: ... rerun the same command to finish it", which no rerun finishes. A
    folder no pack wrote into is "not a packed source", with the pack command as the hint, in
    shuffle and plan, under --json too; one a pack is still writing (its work folder) stays
    incomplete."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "corpus.jsonl").write_bytes(corpus.read_bytes())
    args = [raw, "-o", tmp_path / "run", "--seq-len", 15, "--seed", 1, "--epochs", 1, "--json"]
    for command in (["shuffle", *args], ["plan", "shuffle", *args, "--disk-mbps", 100]):
        r = run(*command)
        error = json.loads(r.stdout)["error"]
        assert r.exit_code == 1 and (error["message"], error["file"]) == ("not a packed source", str(raw)), error
        assert f"tokpack pack {raw} -o PACKED" in error["hint"] and "rerun" not in error["hint"], error
    (raw / ".tokpack-work").mkdir()
    r = run("shuffle", *args)
    assert r.exit_code == 1 and json.loads(r.stdout)["error"]["message"] == "incomplete: no tokpack.json"
    assert not (tmp_path / "run").exists()


def test_shuffle_given_the_wrong_kind_of_directory_says_what_to_give(corpus, tmp_path):
    """An epoch or run given as a SOURCE, or a packed source as -o, was "wrong kind of tokpack
    directory; expected source, found epoch" with no HINT ("hint": null under --json): the line
    now says what the argument takes, in shuffle and plan."""
    packed = tmp_path / "packed"
    assert run("pack", corpus, "-o", packed, "--eos-id", EOS, "--vocab-size", VOCAB).exit_code == 0
    base = ["--seq-len", 15, "--seed", 1, "--epochs", 1, "--json"]
    assert run("shuffle", packed, "-o", tmp_path / "run", *base).exit_code == 0
    for source, out, hint in (
        (tmp_path / "run", tmp_path / "r2", "give a packed source"),
        (tmp_path / "run" / "epoch-00000", tmp_path / "r2", "give a packed source"),
        (packed, packed, "-o takes a run directory"),
        (packed, tmp_path / "run" / "epoch-00000", "-o takes a run directory"),
    ):
        for command in (["shuffle"], ["plan", "shuffle"]):
            extra = ["--disk-mbps", 100] if command == ["plan", "shuffle"] else []
            r = run(*command, source, "-o", out, *base, *extra)
            error = json.loads(r.stdout)["error"]
            assert r.exit_code == 1 and error["where"] == "kind", (command, source, out, error)
            assert error["hint"] and error["hint"].startswith(hint), (command, source, out, error)
    assert not (tmp_path / "r2").exists()
