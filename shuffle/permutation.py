"""Keyed pseudo-random bijections on [0, n): the only source of randomness in a shuffle.

A balanced Feistel network over the smallest even-bit domain 2^(2h) >= n, made a bijection
on [0, n) by cycle-walking. Round keys come from xxh3_64 of a text label, so the same
(seed, label) gives the same permutation on every machine, numpy version and word order.
Everything is vectorised uint64 numpy: permuting a million positions takes milliseconds,
and the state is a handful of integers (no O(n) table ever exists).
"""

from __future__ import annotations

import numpy as np
import xxhash

KEY_PREFIX = "tokpack-shuffle-v1"
ROUNDS = 6  # >= 4 rounds make a Feistel network a strong pseudo-random permutation
_C1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finaliser constants
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def derive_key(*parts) -> int:
    """xxh3_64 (seed 0) of the UTF-8 text "tokpack-shuffle-v1/part1/part2/...", parts in decimal or as given."""
    return xxhash.xxh3_64_intdigest("/".join((KEY_PREFIX, *map(str, parts))).encode())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array: every output bit depends on every input bit."""
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31
    return x


class Bijection:
    """A keyed permutation of [0, n) with O(1) state; `forward` and `inverse` take int arrays."""

    def __init__(self, n: int, *key_parts):
        if n < 1:
            raise ValueError(f"a bijection needs n >= 1, got {n}")
        self.n = int(n)  # domain size
        bits = max(2, (self.n - 1).bit_length())
        bits += bits & 1  # even, so both Feistel halves have the same width
        self.half = bits // 2  # bits per half
        self.mask = np.uint64((1 << self.half) - 1)  # low-half mask
        self.shift = np.uint64(self.half)
        # round r key: derive_key(*key_parts, "round", r)
        self.keys = [np.uint64(derive_key(*key_parts, "round", r)) for r in range(ROUNDS)]

    def _round(self, half_in: np.ndarray, r: int) -> np.ndarray:
        f = half_in ^ self.keys[r]
        return _mix(f) & self.mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.shift, x & self.mask
        for r in range(ROUNDS):
            left, right = right, left ^ self._round(right, r)
        return (left << self.shift) | right

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        left, right = y >> self.shift, y & self.mask
        for r in reversed(range(ROUNDS)):
            left, right = right ^ self._round(left, r), left
        return (left << self.shift) | right

    def _walk(self, x, step) -> np.ndarray:
        """Cycle-walking: re-apply the domain permutation until the value falls back into [0, n)."""
        x = np.asarray(x)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"values outside [0, {self.n})")
        y = step(x.astype(np.uint64).ravel())
        n = np.uint64(self.n)
        todo = np.flatnonzero(y >= n)
        while todo.size:
            z = step(y[todo])
            y[todo] = z
            todo = todo[z >= n]
        return y.astype(np.int64).reshape(x.shape)

    def forward(self, x) -> np.ndarray:
        return self._walk(x, self._encrypt)

    def inverse(self, y) -> np.ndarray:
        return self._walk(y, self._decrypt)


def inverse_each(n: int, key_parts: tuple, last_parts, y) -> np.ndarray:
    """`Bijection(n, *key_parts, t).inverse(y)` for each t of `last_parts`, as the rows of one
    (len(last_parts), len(y)) array. The passes of a source drawn many times each have their
    own bijection: one walk over all of them costs a few numpy calls, where a Bijection each
    cost its six key derivations and a dozen calls, per pass (issue 42)."""
    geometry = Bijection(n)
    y = np.asarray(y, dtype=np.int64).ravel()
    if y.size and (y.min() < 0 or y.max() >= n):
        raise ValueError(f"values outside [0, {n})")
    last = [str(t) for t in last_parts]
    # derive_key's text, its common head joined once
    head = "/".join((KEY_PREFIX, *map(str, key_parts)))
    digest = xxhash.xxh3_64_intdigest
    keys = np.array(
        [[digest(f"{head}/{t}/round/{r}".encode()) for r in range(ROUNDS)] for t in last], dtype=np.uint64
    ).reshape(len(last), ROUNDS)
    who = np.repeat(np.arange(len(last)), y.size)
    mask, shift = geometry.mask, geometry.shift

    def decrypt(v: np.ndarray, rows: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & mask
        for r in reversed(range(ROUNDS)):
            left, right = right ^ (_mix(left ^ keys[rows, r]) & mask), left
        return (left << shift) | right

    out = decrypt(np.tile(y.astype(np.uint64), len(last)), who)
    bound = np.uint64(n)
    todo = np.flatnonzero(out >= bound)
    while todo.size:  # cycle-walking, as Bijection._walk
        z = decrypt(out[todo], who[todo])
        out[todo] = z
        todo = todo[z >= bound]
    return out.astype(np.int64).reshape(len(last), y.size)
