"""The one `tokpack.` namespace and its public API, as a user of the installed package sees it.
scripts/wheel-check.sh runs this file against a wheel installed into a fresh venv, from a folder
outside the checkout (TOKPACK_WHEEL_CHECK=1 there); the suite runs it against the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tokpack

REPO = Path(__file__).resolve().parents[1]
PUBLIC = ("pack", "shuffle", "validate", "stage", "inspect", "plan", "SampleReader", "TokpackDataset")


def test_the_public_api_is_one_import():
    assert set(PUBLIC) <= set(tokpack.__all__)
    from tokpack import inspect, pack, plan, shuffle, stage, validate  # noqa: F401
    from tokpack.packer import api

    assert (tokpack.pack, tokpack.validate, tokpack.stage, tokpack.inspect, tokpack.plan) == (
        api.pack,
        api.validate,
        api.stage,
        api.inspect,
        api.plan,
    )
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        tokpack.nothing_here  # noqa: B018


def test_shuffle_is_the_function_and_the_subpackage():
    """`tokpack.shuffle` is both names the issue asks for: calling it runs api.shuffle, and its
    submodules import, in either order."""
    import inspect

    import tokpack.shuffle.plan as plan_module
    from tokpack import shuffle
    from tokpack.packer import api

    assert plan_module.__name__ == "tokpack.shuffle.plan" and shuffle is sys.modules["tokpack.shuffle"]
    assert callable(shuffle) and inspect.signature(shuffle) == inspect.signature(api.shuffle)


def test_importing_tokpack_or_its_reader_loads_neither_torch_nor_datatrove():
    code = (
        "import sys, tokpack; from tokpack import SampleReader, pack, shuffle; "
        "print(sorted(m for m in ('torch', 'datatrove') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path.home())
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_version_is_the_distributions():
    from importlib import metadata

    done = subprocess.run(
        [sys.executable, "-m", "tokpack", "--version"], capture_output=True, text=True, cwd=Path.home()
    )
    assert done.returncode == 0 and done.stdout.strip() == f"tokpack, version {metadata.version('tokpack')}"
    assert tokpack.__version__ == metadata.version("tokpack")


def test_no_top_level_formats_shuffle_or_packer_comes_from_tokpack():
    """Outside the checkout (whose folders are importable from its own root) tokpack's install
    adds no top-level formats, loader, shuffle or packer for a user's module of that name to collide with."""
    code = (
        "import importlib.util, json; print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None) "
        "for n in ('formats', 'loader', 'shuffle', 'packer', 'tokpack.formats')}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on the path is not an install
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path.home(), env=env)
    found = json.loads(done.stdout)
    here = str(Path(tokpack.__file__).resolve().parents[1])
    assert found["tokpack.formats"] is not None
    for name in ("formats", "loader", "shuffle", "packer"):
        assert found[name] is None or not found[name].startswith((str(REPO), here)), (name, found[name])


@pytest.mark.skipif(os.environ.get("TOKPACK_WHEEL_CHECK") != "1", reason="scripts/wheel-check.sh runs it on the wheel")
def test_the_wheel_is_what_runs():
    """Under wheel-check the package comes from the venv's site-packages, subpackages inside it."""
    here = Path(tokpack.__file__).parent
    assert "site-packages" in here.parts and not str(here).startswith(str(REPO))
    assert all(
        (here / p / "__init__.py").is_file() for p in ("formats", "loader", "shuffle", "packer", "formats/inputs")
    )


def test_a_job_end_to_end_through_the_public_api(tmp_path):
    rng = np.random.default_rng(3)
    lines = [json.dumps({"input_ids": rng.integers(1, 500, rng.integers(5, 80)).tolist()}) for _ in range(200)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    packed = tokpack.pack(tmp_path / "in.jsonl", tmp_path / "src", eos_id=0, vocab_size=500)
    run = tokpack.shuffle([packed.output], tmp_path / "run", seq_len=16, seed=7, epochs=2, memory=1 << 20)
    assert run.epochs == [0, 1]
    assert tokpack.validate([tmp_path / "run"], against=[tmp_path / "src"]).ok
    reader = tokpack.SampleReader.open(tmp_path / "run")
    batch = next(iter(reader.batches(0, 2, 2, start=reader.start_from(start_sample=0))))
    assert batch.shape == (2, 17)
