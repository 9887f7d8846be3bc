"""A held-out split (`tokpack shuffle ... --holdout F`, issue 35 item 7): whole documents of each
source set aside from every training epoch, chosen from the run's seed alone.

Which documents: source s's D_s documents are permuted by rho_h = Bijection(D_s, "holdout",
seed, fingerprint_s) (keyed by the source's fingerprint, not its position, so that a source
holds out the same documents in every epoch, stage and place on the command line); the
documents at positions [0, k_s) of that order are held out. `F` is a fraction of the
documents (`0.01`, `1%`: k_s = ceil(F * D_s)) or a token count (`5M`, `20000`: the fewest
positions whose documents hold at least that many tokens). Document d is held out exactly
when rho_h^-1(d) < k_s: one evaluation of the bijection, no list of documents.

The plan seam: a packed plan (shuffle/packed.py) drops held-out documents from each pass before
it packs it, so no row of any epoch holds a piece of one, and `validate --against`, which
replays the plan from the manifest, rebuilds the rows without them (and checks every piece).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.units import token_count

from .permutation import Bijection


def parse_holdout(text) -> dict | None:
    """`--holdout F` as the manifests record it: {"fraction": "0.01"} or {"tokens": N}; None for none."""
    if text is None:
        return None
    raw = str(text).strip()
    hint = "give a fraction of each source's documents (0.01 or 1%) or a token count per source (5M)"
    try:
        if raw.endswith("%"):
            fraction = Fraction(raw[:-1]) / 100
        elif "." in raw or "/" in raw:
            fraction = Fraction(raw)
        else:
            tokens = token_count(raw)
            if tokens < 1:
                raise ValueError
            return {"tokens": int(tokens)}
    except (ValueError, ZeroDivisionError, TokpackError):
        raise TokpackError("bad --holdout", where="--holdout", expected="a fraction or a token count", found=raw,
                           hint=hint) from None
    if not 0 < fraction < 1:
        raise TokpackError("--holdout fraction out of range", where="--holdout", expected="0 < F < 1", found=raw,
                           hint=hint)
    return {"fraction": str(fraction)}


@dataclass(frozen=True)
class Holdout:
    """One source's held-out documents: positions [0, held) of rho_h."""

    documents: int  # D_s
    held: int  # k_s
    seed: int
    fingerprint: str
    split: bool = False  # the plan of RUN/holdout/: it keeps the held-out documents and leaves out the others

    def left_out(self, docs: np.ndarray) -> np.ndarray:
        """Whether a plan of this split leaves each of `docs` out: a training epoch the held-out
        ones, RUN/holdout/ every other."""
        held = self.is_held(docs)
        return ~held if self.split else held

    def order(self) -> Bijection:
        return Bijection(max(self.documents, 1), "holdout", self.seed, self.fingerprint)

    def is_held(self, docs: np.ndarray) -> np.ndarray:
        """Whether each of the source's documents `docs` is held out."""
        docs = np.asarray(docs, dtype=np.int64)
        if not self.held or not len(docs):
            return np.zeros(len(docs), dtype=bool)
        return self.order().inverse(docs) < self.held

    def held_documents(self) -> np.ndarray:
        """The held-out documents, ascending (O(k_s): for tests and the holdout folder)."""
        return np.sort(self.order().forward(np.arange(self.held, dtype=np.int64)))


def holdout_of(src, spec: dict | None, seed: int, documents: int, lengths_in_order=None) -> Holdout:
    """Source `src`'s Holdout for `spec` (parse_holdout's), of its `documents` D_s. A token count
    reads the documents' lengths in rho_h's order (`lengths_in_order(order)`: chunks of
    lengths), until they reach it."""
    d = int(documents)
    h = Holdout(d, 0, int(seed), src.fingerprint)
    if spec is None:
        return h
    if "fraction" in spec:
        k = math.ceil(Fraction(spec["fraction"]) * d)
    else:
        k, total, want = 0, 0, int(spec["tokens"])
        for lengths in lengths_in_order(h.order()):
            cum = total + np.cumsum(lengths)
            i = int(np.searchsorted(cum, want, side="left"))
            if i < len(cum):
                k += i + 1
                total = want
                break
            k, total = k + len(lengths), int(cum[-1]) if len(cum) else total
        if total < want:
            k = d
    if k >= d:
        raise TokpackError("--holdout would hold out every document of a source", file=src.path, where="--holdout",
                           expected=f"fewer than its {d} documents", found=spec,
                           hint="hold out a smaller fraction or fewer tokens")
    return Holdout(d, int(k), int(seed), src.fingerprint)
