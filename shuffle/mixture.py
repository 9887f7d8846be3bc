"""How an epoch's samples are drawn from its sources:
weights, the largest-remainder mixture, windows a source holds, the jitter of their starts,
and the bound on passes over one source.
"""

from __future__ import annotations

from fractions import Fraction


from tokpack.formats.errors import TokpackError
from tokpack.formats.shards import PackedSource
from tokpack.formats.units import at_most, parse_weight

from .permutation import derive_key

# Passes over one source in one epoch: each costs a step per block of the source it reads, so an epoch
# that repeats a source more often than this spends its time on repeats (and is surely a typo).
MAX_PASSES = 10**5


def largest_remainder(weights: list[Fraction], total: int) -> list[int]:
    """Integer shares of `total` proportional to `weights`, summing exactly to `total`."""
    wsum = sum(weights)
    exact = [w * total / wsum for w in weights]
    counts = [int(x) for x in exact]  # floor, the values are >= 0
    left = total - sum(counts)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


def windows_of(tokens: int, seq_len: int, jitter: bool) -> int:
    return (tokens - seq_len) // (seq_len + 1) if jitter else tokens // (seq_len + 1)


def jitter_offset(seed: int, epoch: int, s: int, seq_len: int) -> int:
    return derive_key("jitter", seed, epoch, s) % (seq_len + 1)


def mixture(
    sources: list[PackedSource],
    weights: list[str | None],
    units: list[int],
    *,
    samples: int | None,
    tokens: int | None,
    seq_len: int,
) -> tuple[int, list[int]]:
    """(N, c_s): the epoch's size and each source's share, from the weights (all given or
    none) and each source's units per pass (W_s, or a packed pass's rows)."""
    given = [w is not None for w in weights]
    if any(given) and not all(given):
        raise TokpackError(
            "some sources have a weight and some do not",
            where="SOURCE=WEIGHT",
            expected="a weight on every source or on none",
            found=", ".join(f"{src.path}={w}" for src, w in zip(sources, weights)),
        )
    if samples is not None:
        n = int(samples)
    elif tokens is not None:
        n = int(tokens) // seq_len
    else:
        n = sum(units)
    if n < 1:
        raise TokpackError(
            "the epoch would hold no samples", where="--samples/--tokens", expected=">= 1 sample", found=n
        )
    if all(w is not None for w in weights):
        fr = [parse_weight(w, f"weight of {src.path}") for src, w in zip(sources, weights)]
        for src, w, f in zip(sources, weights, fr):
            if f == 0:  # the other sources would be stretched over its share: silent repeats
                raise TokpackError(
                    "weight is 0",
                    file=src.path,
                    where="SOURCE=WEIGHT",
                    expected="a weight > 0",
                    found=w,
                    hint="leave the source out instead of giving it weight 0",
                )
        return n, largest_remainder(fr, n)
    if samples is not None or tokens is not None:
        return n, largest_remainder([Fraction(w) for w in units], n)
    return n, list(units)


def check_passes(sources, counts, rows_per_pass, what: str) -> None:
    """Each source's passes in one epoch (its samples over its rows per pass), bounded by
    arithmetic before any pass is planned, for either packing."""
    for src, count, w in zip(sources, counts, rows_per_pass):
        at_most(
            -(-count // max(1, w)),
            MAX_PASSES,
            "passes over one source in one epoch",
            file=src.path,
            where="--samples/--tokens/SOURCE=WEIGHT",
            hint=f"the epoch takes {count:,} samples from its "
            f"{w:,} {what}: ask for fewer samples, lower its weight, or add data",
        )
