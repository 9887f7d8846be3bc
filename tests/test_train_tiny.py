"""A real training loop resumes to the bit (issue 34, item 3): examples/train_tiny.py trains a
tiny GPT on a scheduled best-fit run (stage "stable" of two epochs, then stage "decay")
through a StatefulDataLoader with 2 workers. A fresh process resumed from the checkpoint at
step 11 gives the per-step losses of steps 12-30 of the uninterrupted run, bit for bit;
those steps cross the boundary between the stage's two epochs (after step 12) and the stage
boundary (after step 24). And torch.compile over fixed-shape boundaries never recompiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, write_source

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_tiny.py"
STEPS = 30


def train(run: Path, tmp: Path, *args) -> dict[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            str(run),
            "--steps",
            str(STEPS),
            "--checkpoint",
            str(tmp / "ckpt"),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


SCHEDULE = """\
seq_len: 63
seed: 2
shard_samples: 32
packing: best-fit
stages:
  - {name: stable, epochs: 2, sources: {web: 1}}
  - {name: decay, tokens: 3K, sources: {web: 1, code: 1}}
"""
M = 4  # the example's micro-batch


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    require("torchdata.stateful_dataloader", "pip install torchdata")
    from tokpack import shuffle

    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(11)
    write_source(root / "web", random_docs(rng, 96, 1000, 0, 2, 60))
    write_source(root / "code", random_docs(rng, 200, 1000, 0, 2, 60))
    (root / "run.yaml").write_text(SCHEDULE)
    result = shuffle(None, root / "run", schedule=root / "run.yaml", memory=64 << 20)
    assert [d["stage"] for d in result.epochs_detail] == ["stable", "stable", "decay"]
    return root / "run"


def last_steps(run: Path) -> list[int]:
    """The step that ends each of the first two epochs (steps count from 1; those epochs are
    whole steps here, so a step never straddles two)."""
    from tokpack.loader.reader import SampleReader

    ends = SampleReader.open(run).table.epoch_ends[:2]
    assert all(e % M == 0 for e in ends)
    return [int(e) // M for e in ends]


def test_resumed_losses_are_bitwise_the_uninterrupted_ones(run, tmp_path):
    epoch0, stable = last_steps(run)  # epoch 0 ends at step 12, stage "stable" (epoch 1) at 24
    assert 11 < epoch0 < stable < STEPS
    from tokpack.loader.reader import SampleReader

    K = SampleReader.open(run).most_documents()[0]  # fixed-shape boundaries through the workers
    whole = train(run, tmp_path, "--max-documents", K, "--save-at", 11)
    assert sorted(whole) == list(range(1, STEPS + 1))
    assert len(set(whole.values())) > 1  # it trains: the losses move
    resumed = train(run, tmp_path, "--max-documents", K, "--resume", tmp_path / "ckpt-11.pt")
    assert resumed == {s: whole[s] for s in range(12, STEPS + 1)}  # across an epoch and a stage boundary


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiled_frames(run: Path, steps: int, **kw) -> list[tuple[int, int]]:
    """(frames compiled, graphs) of dynamo's own counters after each of `steps` training steps
    of the example's model under torch.compile, over TokpackDataset(run, **kw)."""
    import torch
    from torch._dynamo.utils import counters

    from tokpack import TokpackDataset

    tiny = _example()
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    ds = TokpackDataset(run, micro_batch=M, **kw)
    model = tiny.TinyGPT(1000, ds.reader.seq_len, dim=32, layers=1, heads=2)
    # The "eager" backend: dynamo traces and guards each frame (and so recompiles on a new
    # shape) as with any backend, without generating C++ for each graph.
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    for step, batch in zip(range(steps), ds):
        tiny.train_step(compiled, optimizer, batch)
        seen.append((counters["frames"]["ok"], counters["stats"]["unique_graphs"]))
    return seen


def test_compiled_with_max_documents_never_recompiles(run):
    """torch.compile over fixed-shape boundaries: nothing is compiled after the first step, by
    dynamo's counters; the variable-length boundaries, on the same rows, recompile."""
    require("torch._dynamo", "pip install torch")
    from tokpack.loader.reader import SampleReader

    K = SampleReader.open(run).most_documents()[0]
    fixed = _compiled_frames(run, 12, max_documents=K)
    assert fixed[0][0] >= 1 and all(seen == fixed[0] for seen in fixed), fixed
    free = _compiled_frames(run, 12)
    assert free[-1][0] > free[0][0], free  # the document count changed, and dynamo compiled again
