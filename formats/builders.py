"""The builders of every manifest and sidecar tokpack writes: one function a kind, over a
`TokenHeader` (what the tokens are) and, for epochs and runs, `ShuffleFields` (how they were shuffled)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import (
    EPOCH,
    FORMAT_NAME,
    FORMAT_VERSION,
    RUN,
    SOURCE,
)
from .fields import SOURCE_FIELDS, upgrade
from .hashes import fingerprint, hash_hex64
from .names import dtype_from_name, dtype_name


@dataclass(frozen=True)
class TokenHeader:
    """What a manifest's tokens are, as every manifest's header records it."""

    dtype: np.dtype
    vocab_size: int
    eos_id: int
    tokenizer: str

    def fields(self, kind: str, tokens: int) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "kind": kind,
            "dtype": dtype_name(self.dtype),
            "token_size": np.dtype(self.dtype).itemsize,
            "vocab_size": int(self.vocab_size),
            "eos_id": int(self.eos_id),
            "tokenizer": self.tokenizer,
            "tokens": int(tokens),
        }


def header_like(m: dict, kind: str) -> dict:
    """A manifest header of `kind` for tokens described as `m` describes them (a run's, for its
    slices): the same dtype, vocabulary, EOS id and tokenizer."""
    return TokenHeader(dtype_from_name(m["dtype"]), m["vocab_size"], m["eos_id"], m["tokenizer"]).fields(kind, 0)


def source_manifest(shards: list[dict], dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, **extra) -> dict:
    return {
        **TokenHeader(dtype, vocab_size, eos_id, tokenizer).fields(SOURCE, sum(s["tokens"] for s in shards)),
        "documents": sum(s["documents"] for s in shards),
        "fingerprint": fingerprint([s["xxh3_128"] for s in shards], dtype_name(dtype), vocab_size, eos_id),
        "shards": shards,
        **extra,
    }


@dataclass(frozen=True)
class ShuffleFields:
    """How an epoch's samples were made, as its manifest and its run's record it (`samples`:
    a run's planned epoch size, 0 for a scheduled run; `shuffle`: the plan's name)."""

    seed: int
    seq_len: int
    samples: int
    shard_samples: int
    jitter: bool
    shuffle: str


def epoch_manifest(
    shards: list[dict],
    header: TokenHeader,
    shuffled: ShuffleFields,
    *,
    tokens: int,
    epoch: int,
    dropped_tokens: int,
    sources: list[dict],
) -> dict:
    return {
        **header.fields(EPOCH, tokens),
        "fragments": sum(s["fragments"] for s in shards),
        "shards": shards,
        "epoch": epoch,
        "seed": shuffled.seed,
        "seq_len": shuffled.seq_len,
        "samples": shuffled.samples,
        "shard_samples": shuffled.shard_samples,
        "dropped_tokens": dropped_tokens,
        "jitter": shuffled.jitter,
        "jitter_offsets": [s["offset"] for s in sources],
        "sources": sources,
        "sample_multiset_hash": hash_hex64(sum(int(s["multiset_hash"], 16) for s in shards)),
        "shuffle": shuffled.shuffle,
    }


def run_manifest(
    epochs: dict[int, dict],
    header: TokenHeader,
    shuffled: ShuffleFields,
    *,
    sources: list[dict],
    weights: list | None,
    extra: dict | None = None,
) -> dict:
    """`epochs`: the manifests of the epochs written so far, by number (only their `tokens` and
    `fragments` are read: shuffle passes those alone); `sources`: an epoch's entries;
    `extra`: a scheduled run's fields (epoch_samples, schedule...)."""
    written = [upgrade(m) for m in epochs.values()]
    sources = [{k: s[k] for k, field in SOURCE_FIELDS.items() if RUN in field[2]} for s in sources]
    return {
        **header.fields(RUN, sum(int(m["tokens"]) for m in written)),
        "fragments": sum(int(m["fragments"]) for m in written),
        "sources": sources,
        "weights": weights,
        "seq_len": shuffled.seq_len,
        "seed": shuffled.seed,
        "jitter": shuffled.jitter,
        "samples": shuffled.samples,
        "shard_samples": shuffled.shard_samples,
        "epochs": sorted(epochs),
        "shuffle": shuffled.shuffle,
        **(extra or {}),
    }


def nodes_sidecar(nodes: int, ranks_per_node: int, micro_batch: int, dest: str) -> dict:
    return {
        "format": "tokpack-nodes",
        "note": "shuffle --to-nodes: the epochs' tokens are in node slices, on the nodes",
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "micro_batch": micro_batch,
        "dest": dest,
    }


def stage_sidecar(stages: list[dict], missing_shards: dict[str, list[str]]) -> dict:
    return {
        "format": "tokpack-stage",
        "partial": True,
        "note": "a --ranks stage: only the listed ranks' shards were copied; the manifests are the source's",
        "stages": stages,
        "missing_shards": missing_shards,
    }
