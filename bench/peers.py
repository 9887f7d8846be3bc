"""Peers that tokpack is compared with, run on the same corpus: datatrove's merger, HF datasets,
litdata, and the step-indexed loaders (Nanoset, Megatron GPTDataset/BlendedDataset) whose index
memory and build time grow with the step count.

Each peer has an untimed `prepare_*` (input conversion, done once) and a `*_cmd` that returns the
command run_all times in a child process (bench/common.run_measured). Peers that are not installed
report why through `missing(...)`, so the table can say so instead of failing.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import struct
import sys
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import REPO, python_cmd  # noqa: E402


def tokpack_cmd(*args: str, result: Path | None = None) -> str:
    """`python -m tokpack.packer.cli ARGS --json` from the repo, its summary kept in `result`."""
    cmd = shlex.join([sys.executable, "-m", "tokpack.packer.cli", *args, "--json"])
    return f"cd {shlex.quote(str(REPO))} && {cmd} > {shlex.quote(str(result or '/dev/null'))}"


def summary_of(result: Path) -> dict:
    """The last JSON line a `--json` command left in `result` ({} if none)."""
    try:
        return json.loads(Path(result).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}


# Bytes of the index each step-indexed loader keeps in every rank, from its dtypes:
# - Nanoset: two int64 arrays over train_steps x GBS samples, 16 B per sample.
# - Megatron GPTDataset: document_index, int32 per document per epoch, the epochs being as many
#   passes as it takes to cover n * seq_len tokens; sample_index [n+1, 2] of positions in it
#   (int32, int64 once document_index passes 2^31 entries); shuffle_index (uint32, int64 past
#   2^32 - 1 samples).
# - Megatron BlendedDataset, on top of its GPTDatasets: dataset_index int16 + dataset_sample_index int64.
NANOSET_B = 16
BLENDED_B = 2 + 8


def index_arrays(style: str, samples: int, seq_len: int, mean_doc: int) -> list[tuple[int, str]]:
    """(length, dtype) of each array `style` allocates for `samples` samples."""
    if style == "nanoset":
        return [(samples, "int64"), (samples, "int64")]
    documents = -(-samples * seq_len // mean_doc)
    arrays = [
        (documents, "int32"),
        (2 * (samples + 1), "int64" if documents > 2**31 - 1 else "int32"),
        (samples, "int64" if samples >= 2**32 - 1 else "uint32"),
    ]
    if style == "megatron-blended":
        arrays += [(samples, "int16"), (samples, "int64")]
    elif style != "megatron-gpt":
        raise ValueError(style)
    return arrays


def index_bytes(style: str, samples: int, seq_len: int, mean_doc: int) -> int:
    return sum(n * np.dtype(t).itemsize for n, t in index_arrays(style, samples, seq_len, mean_doc))


def missing(module: str) -> str | None:
    """Why `module` cannot be used, or None when it imports."""
    if importlib.util.find_spec(module) is None:
        return f"not installed (pip install '.[bench]' brings {module})"
    return None


def token_files(corpus: Path) -> list[Path]:
    return sorted(Path(corpus).glob("*.ds"))


def read_tokens(path: Path, dtype) -> np.ndarray:
    return np.fromfile(path, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Input conversions for `tokpack pack` (untimed)


def prepare_megatron(corpus: Path, prefix: Path, dtype=np.uint16) -> Path:
    """The corpus as one Megatron .bin/.idx pair, in megatron-core's IndexedDataset layout
    (header, version, dtype code, counts, int32 lengths, int64 byte pointers, int64 document
    indices with a leading 0), one sequence per document."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    lengths = []
    with open(f"{prefix}.bin", "wb") as out:
        for f in token_files(corpus):
            ends = np.fromfile(f"{f}.index", dtype="<u8").astype(np.int64)
            lengths.append(np.diff(ends, prepend=0))
            with open(f, "rb") as src:
                while block := src.read(64 << 20):
                    out.write(block)
    lengths = np.concatenate(lengths).astype(np.int32)
    size = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * size, out=pointers[1:])
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.uint32): 4}[np.dtype(dtype)]
    with open(f"{prefix}.idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        idx.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
        idx.write(lengths.tobytes())
        idx.write(pointers.tobytes())
        idx.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return prefix


def prepare_parquet(corpus: Path, out: Path, dtype=np.uint16, rows_per_group: int = 8192) -> Path:
    """The corpus as Parquet files, one per .ds file, one row per document in an `input_ids`
    list<int32> column (what a HF `map(tokenize)` leaves behind)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(token_files(corpus)):
        tokens = read_tokens(f, dtype)
        ends = np.fromfile(f"{f}.index", dtype="<u8").astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        with pq.ParquetWriter(out / f"part-{i:05d}.parquet", pa.schema([("input_ids", pa.list_(pa.int32()))])) as w:
            for g in range(0, len(ends), rows_per_group):
                lo, hi = starts[g], ends[min(g + rows_per_group, len(ends)) - 1]
                offsets = np.concatenate([[0], ends[g : g + rows_per_group] - lo]).astype(np.int32)
                values = pa.array(tokens[lo:hi].astype(np.int32))
                w.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}))
    return out


# ---------------------------------------------------------------------------------------------
# Shuffle peers


def datatrove_merger_cmd(corpus: Path, out: Path, seed: int = 0) -> list[str]:
    """datatrove's DocumentTokenizerMerger(shuffle=True): interleaves whole documents into new
    files; it does not cut or shuffle training windows."""
    return python_cmd(
        "from datatrove.pipeline.tokens.merger import DocumentTokenizerMerger\n"
        f"DocumentTokenizerMerger({str(corpus)!r}, {str(out)!r}, 'merged', shuffle=True, seed={seed},"
        " progress=False).run(None, 0, 1)"
    )


def prepare_hf_windows(corpus: Path, arrow_path: Path, seq_len: int, dtype=np.uint16) -> Path:
    """The corpus cut into non-overlapping windows of seq_len + 1 tokens, as one Arrow stream file
    that `datasets.Dataset.from_file` memory-maps (the cache-file layout HF writes itself)."""
    import pyarrow as pa

    row = seq_len + 1
    schema = pa.schema([("input_ids", pa.list_(pa.uint16() if np.dtype(dtype).itemsize == 2 else pa.uint32()))])
    carry = np.empty(0, dtype=dtype)
    rows_per_batch = max(1, (32 << 20) // (row * np.dtype(dtype).itemsize))
    with pa.OSFile(str(arrow_path), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for f in token_files(corpus):
            stream = np.concatenate([carry, read_tokens(f, dtype)])
            n = len(stream) // row
            for b in range(0, n, rows_per_batch):
                k = min(rows_per_batch, n - b)
                offsets = pa.array(np.arange(0, (k + 1) * row, row, dtype=np.int32))
                values = pa.array(stream[b * row : (b + k) * row])
                w.write_batch(pa.record_batch([pa.ListArray.from_arrays(offsets, values)], schema=schema))
            carry = stream[n * row :]
    return arrow_path


def hf_shuffle_cmd(arrow_path: Path, out: Path, scratch: Path, seed: int = 0) -> list[str]:
    """HF datasets: shuffle(seed).flatten_indices().save_to_disk() over the windows. Its cache
    files (indices mapping, flattened copy) go to `scratch`, which the caller empties before
    each run: a cache hit would skip the work being timed."""
    return python_cmd(
        "from datasets import Dataset, disable_progress_bars\n"
        "disable_progress_bars()\n"
        f"ds = Dataset.from_file({str(arrow_path)!r})\n"
        f"ds = ds.shuffle(seed={seed}, load_from_cache_file=False, indices_cache_file_name={str(scratch / 'indices.arrow')!r})\n"
        f"ds.flatten_indices(cache_file_name={str(scratch / 'flat.arrow')!r}).save_to_disk({str(out)!r})"
    )


def litdata_optimize_cmd(corpus: Path, out: Path, seq_len: int, workers: int = 1) -> list[str]:
    """litdata optimize() with TokensLoader: one item per document, as litgpt's prepare scripts
    do. It writes chunks in input order; litdata shuffles later, at load time
    (StreamingDataset(shuffle=True)), so this row is conversion only."""
    files = [str(f) for f in token_files(corpus)]
    return python_cmd(
        "import numpy as np\n"
        "from litdata import optimize\n"
        "from litdata.streaming.item_loader import TokensLoader\n"
        "def docs(path):\n"
        "    tokens = np.fromfile(path, dtype=np.uint16)\n"
        "    ends = np.fromfile(path + '.index', dtype='<u8')\n"
        "    start = 0\n"
        "    for end in ends.tolist():\n"
        "        yield tokens[start:end]\n"
        "        start = end\n"
        "if __name__ == '__main__':\n"
        f"    optimize(fn=docs, inputs={files!r}, output_dir={str(out)!r}, chunk_size={(seq_len + 1) * 4096},"
        f" item_loader=TokensLoader(), num_workers={workers}, mode='overwrite', verbose=False)\n"
    )


# ---------------------------------------------------------------------------------------------
# Step-indexed loaders: index memory (allocated in a child) and Megatron-style build time


def allocate_index_cmd(
    style: str, samples: int, seq_len: int, mean_doc: int, cap_bytes: int, result: Path
) -> list[str]:
    """Allocates and touches (np.ones) the arrays `style` keeps per rank, capped at cap_bytes: above
    it every array shrinks by the same factor, and the result says which fraction was allocated."""
    need = index_bytes(style, samples, seq_len, mean_doc)
    scale = min(1.0, cap_bytes / need)
    arrays = [(max(1, int(n * scale)), t) for n, t in index_arrays(style, samples, seq_len, mean_doc)]
    return python_cmd(
        "import json, time, numpy as np\n"
        "t = time.perf_counter()\n"
        f"arrays = [np.ones(n, t) for n, t in {arrays!r}]\n"
        "seconds = time.perf_counter() - t\n"
        f"json.dump({{'scale': {scale}, 'bytes': sum(a.nbytes for a in arrays), 'seconds': seconds}},"
        f" open({str(result)!r}, 'w'))\n"
    )


def megatron_index_build_cmd(
    samples: int, documents: int, mean_doc: int, seq_len: int, cap_bytes: int, result: Path
) -> list[str]:
    """Builds a Megatron GPTDataset-style index with numpy, the way megatron-core does it:
    document_index (every document once per epoch, RandomState.shuffle), sample_index (document
    position and offset of every window start; megatron-core does this loop in C++, numpy does it
    in vectorised chunks here), shuffle_index (arange + RandomState.shuffle). Documents all have
    the corpus's mean length. Above cap_bytes it builds a proportionally smaller index and says
    which fraction; the build is linear in the count, so run_all scales the time up."""
    need = index_bytes("megatron-gpt", samples, seq_len, mean_doc)
    n = samples if need <= cap_bytes else max(1, int(samples * cap_bytes / need))
    return python_cmd(
        "import json, time, numpy as np\n"
        f"n, docs, mean_doc, seq_len = {n}, {documents}, {mean_doc}, {seq_len}\n"
        "rs = np.random.RandomState(1234)\n"
        "t = time.perf_counter()\n"
        "epochs = -(-n * seq_len // (docs * mean_doc))\n"
        "doc_index = np.tile(np.arange(docs, dtype=np.int32), epochs)\n"
        "rs.shuffle(doc_index)\n"
        "sample_index = np.empty((n + 1, 2), np.int64 if len(doc_index) >= 2**31 else np.int32)\n"
        "chunk = 1 << 22\n"
        "for lo in range(0, n + 1, chunk):\n"
        "    starts = np.arange(lo, min(lo + chunk, n + 1), dtype=np.int64) * seq_len\n"
        "    sample_index[lo:lo + len(starts), 0] = starts // mean_doc\n"
        "    sample_index[lo:lo + len(starts), 1] = starts % mean_doc\n"
        "shuffle_index = np.arange(n, dtype=np.uint32 if n < 2**32 - 1 else np.int64)\n"
        "rs.shuffle(shuffle_index)\n"
        "seconds = time.perf_counter() - t\n"
        f"json.dump({{'scale': n / {samples}, 'seconds': seconds}}, open({str(result)!r}, 'w'))\n"
    )


def read_result(path: Path) -> dict:
    return json.loads(Path(path).read_text())
