"""The output seam (formats/outputs.py): pack and shuffle write through one Output, the same
bytes to a local folder as to a bucket (moto's S3 server), each directory's manifest sent
after everything it lists, and no other module threading the store's plumbing again."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np

from conftest import random_docs, write_source
from tokpack.formats.io import Outbox
from tokpack.formats.manifest import MANIFEST
from tokpack.formats.outputs import BucketOutput, LocalOutput
from tokpack.formats.guard import WORK_DIR
from tokpack.packer import pack, shuffle

ROOT = Path(__file__).resolve().parents[1]


def recorded_sends(monkeypatch) -> list[str]:
    """Every object a command sends to a store, in the order it sends them."""
    sent: list[str] = []
    real = Outbox.send

    def send(self, *files, keep=False):
        sent.extend(str(self.remote_of(f)) for f in files)
        real(self, *files, keep=keep)

    monkeypatch.setattr(Outbox, "send", send)
    return sent


def bucket_tree(fs, url: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {k[len(root) + 1:]: fs.cat(k) for k in sorted(fs.find(root))}


def local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_manifests_last(sent: list[str], url: str) -> None:
    """A folder's manifest is sent after every file under it; the output's own manifest is the
    last send, and each earlier send of it (a run's, listing the epochs so far) follows an epoch's."""
    top = f"{url}/{MANIFEST}"
    for i, name in enumerate(sent):
        if name.endswith("/" + MANIFEST) and name != top:
            folder = name[: -len(MANIFEST)]
            assert not [s for s in sent[i + 1:] if s.startswith(folder)], name
        elif name == top and i < len(sent) - 1:
            assert sent[i - 1].endswith(f"/{MANIFEST}") and sent[i - 1] != top, sent[i - 1]
    assert sent[-1] == top, sent[-3:]


def test_shuffle_through_a_bucket_output_writes_the_local_output_bytes_manifests_last(s3_bucket, tmp_path,
                                                                                     monkeypatch):
    """The same shuffle (out of core: a small memory) to a folder and to a bucket: the bucket
    holds exactly the folder's files, byte for byte, and nothing of the work folder; each shard's
    files are sent before the record that it is done, and each epoch's manifest after its shards."""
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/run"
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(7), 400, 1000, 0), docs_per_shard=100)
    kw = dict(seq_len=63, seed=3, epochs=2, shard_samples=60, memory=40_000)
    local = shuffle(src, tmp_path / "run", **kw)
    sent = recorded_sends(monkeypatch)
    remote = shuffle(src, url, scratch=tmp_path / "scratch", **kw)
    assert local.output == str(tmp_path / "run") and remote.output == url
    assert remote.path == local.path == "out-of-core"
    files = local_tree(tmp_path / "run")
    assert sum(n.endswith(".ds") for n in files) >= 4
    assert bucket_tree(fs, url) == files
    assert_manifests_last(sent, url)
    shards = [s for s in sent if s.endswith(".ds")]
    for shard in shards:  # its files, then its record
        epoch, name = shard[len(url) + 1:].split("/")
        record = next(i for i, s in enumerate(sent) if re.search(rf"/{epoch}-[0-9a-f]+/done/{name}\.json$", s))
        assert max(i for i, s in enumerate(sent) if s.startswith(shard)) < record
    assert len(shards) == sum(n.endswith(".ds") for n in files)  # each shard sent once


def test_pack_through_a_bucket_output_writes_the_local_output_bytes_manifest_last(s3_bucket, tmp_path, monkeypatch):
    """pack's shard writer commits through the Output as shuffle's does: to a bucket, each part's
    shards are sent before its part record, the plan before the manifest, the manifest last, and
    the bucket ends holding the local pack's files exactly."""
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/packed"
    (tmp_path / "in").mkdir()
    rng = np.random.default_rng(5)
    for name in ("a", "b"):
        np.save(tmp_path / "in" / f"{name}.npy", np.concatenate(random_docs(rng, 200, 1000, 0)).astype(np.uint16))
    kw = dict(input_format="numpy", eos_id=0, vocab_size=1000, shard_tokens=4000)
    local = pack(tmp_path / "in", tmp_path / "packed", **kw)
    sent = recorded_sends(monkeypatch)
    remote = pack(tmp_path / "in", url, scratch=tmp_path / "scratch", **kw)
    assert remote.output == url and local.output == str(tmp_path / "packed") and local.shards >= 4
    assert bucket_tree(fs, url) == local_tree(tmp_path / "packed")
    assert_manifests_last(sent, url)
    for part in sorted({s.rsplit("/", 1)[0] for s in sent if "/part-" in s and s.endswith(".ds")}):
        record = sent.index(f"{part}.json")
        assert max(i for i, s in enumerate(sent) if s.startswith(part + "/")) < record
    plan = sent.index(f"{url}/{WORK_DIR}/finalize.json")
    assert all(sent.index(f"{url}/{WORK_DIR}/{p.rsplit('/', 1)[-1]}") < plan
               for p in sent if re.search(r"/part-\d+\.json$", p))


def test_outputs_travel_to_tasks_and_answer_for_their_place(tmp_path):
    """An EpochJob (pickled to executor tasks) keeps its Output; each Output names and sizes
    its own place, and a local folder's removal removes it."""
    from tokpack.shuffle.steps import EpochJob

    bucket = BucketOutput(Outbox(tmp_path / "out", "s3://b/run/"))
    job = EpochJob(None, (), "uint16", 0, "", str(tmp_path / "out" / "epoch-00000"), "w", 10, output=bucket)
    again = pickle.loads(pickle.dumps(job))
    assert type(again.output) is BucketOutput and again.output.where(job.epoch_dir).url == "s3://b/run/epoch-00000"
    assert pickle.loads(pickle.dumps(LocalOutput())) == LocalOutput()
    assert bucket.shown(tmp_path / "out") == "s3://b/run" and LocalOutput().shown(tmp_path) == str(tmp_path)
    assert bucket.staged and not LocalOutput.staged
    # a bucket's folder holds what is in flight only; a local folder all that is written, less what is there
    assert bucket.local_need(10_000, 300, here=50) == 300 and LocalOutput().local_need(10_000, 300, here=50) == 9_950
    (tmp_path / "work" / "x").mkdir(parents=True)
    LocalOutput().remove_tree(tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_only_the_seam_knows_about_the_store_plumbing():
    """The local-or-bucket choice is made once (packer/executors.py picks the Output) and
    carried out once (formats/outputs.py over formats/io.py's Outbox). No other module of
    formats/, loader/, shuffle/ or packer/ names an outbox, so it cannot be threaded through again."""
    allowed = {"formats/io.py", "formats/outputs.py", "packer/executors.py"}
    naming = sorted(p.relative_to(ROOT).as_posix() for d in ("formats", "loader", "shuffle", "packer")
                    for p in (ROOT / d).rglob("*.py") if re.search("outbox", p.read_text(), re.IGNORECASE))
    assert set(naming) <= allowed, sorted(set(naming) - allowed)
    assert "formats/outputs.py" in naming  # the check looks where the name is
