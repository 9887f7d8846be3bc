"""The format's checksums and hashes: xxh3-128 of a file, a row's xxh3-64, the sample multiset
and order hashes, and a source's fingerprint (docs/FORMAT.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

from .constants import MASK64
from .io.gate import IO_BLOCK, iter_file_blocks


def xxh3_128_file(path: str | Path, buf: bytearray | None = None) -> str:
    """Streaming xxh3_128 of a whole file, as 32 lowercase hex digits."""
    h = xxhash.xxh3_128()
    for block in iter_file_blocks(path, buf if buf is not None else bytearray(IO_BLOCK)):
        h.update(block)
    return h.hexdigest()


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """xxh3_64 (seed 0) of each row of a 2-D array (or of each item of a 1-D np.void row array):
    a sample's hash, which `sample_multiset_hash` sums."""
    rows = np.ascontiguousarray(rows)
    n = rows.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    flat = memoryview(rows.reshape(-1).view(np.uint8))
    step = flat.nbytes // n
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(flat[i : i + step]) for i in range(0, flat.nbytes, step)), dtype=np.uint64, count=n)


def order_hash_terms(positions: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """What a sample adds to an order hash: xxh3_64 (seed 0) of 16 bytes, its output position g
    in the epoch then its hash (`row_hashes`), each a little-endian uint64. Keyed by g, a term moves
    with its position, so samples swapped, shifted or permuted change the sum (docs/FORMAT.md,
    "Checksums"), where the multiset hash cannot see them."""
    pairs = np.empty((len(hashes), 2), dtype="<u8")
    pairs[:, 0] = positions
    pairs[:, 1] = hashes
    return row_hashes(pairs)


def order_hash(positions: np.ndarray, hashes: np.ndarray) -> int:
    """Sum mod 2^64 of `order_hash_terms`: the order hash of the samples at `positions`."""
    return int(order_hash_terms(positions, hashes).sum(dtype=np.uint64))


def hash_hex64(value: int) -> str:
    return f"{value & MASK64:016x}"


def name_hash(name: str) -> int:
    """A file name's xxh3-64: what validate holds of a manifest's shard names, not the names."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"))


def fingerprint(shard_checksums: list[str], dtype: str, vocab_size: int, eos_id: int) -> str:
    """A source's identity: its data (shard checksums, in order) and how to read it."""
    h = xxhash.xxh3_128()
    h.update(f"tokpack-source-v1|{dtype}|{vocab_size}|{eos_id}|".encode())
    for c in shard_checksums:
        h.update(c.encode() + b"|")
    return h.hexdigest()
