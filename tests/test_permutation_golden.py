"""Golden values for tokpack.shuffle.permutation, the only source of randomness in a shuffle: fast and
file-free, so `scripts/mutation.sh --ci` can run every permutation mutant against them. The
values hold for PLAN_ALGORITHM "tokpack-feistel6-splitmix-xxh3-v1" (tests/test_plan_golden.py
ties the two together)."""

from __future__ import annotations

import numpy as np
import pytest

from tokpack.shuffle.permutation import Bijection, _mix, derive_key

# n -> (forward, inverse) of 0..min(n, 8)-1 under Bijection(n, "golden", 9). The sizes straddle
# the Feistel domain's even-bit rounding (4 = 2^2, 16 = 2^4, 64 = 2^6) and cycle-walking.
GOLDEN = {
    1: ([0], [0]),
    2: ([1, 0], [1, 0]),
    3: ([2, 0, 1], [1, 2, 0]),
    4: ([2, 0, 1, 3], [1, 2, 0, 3]),
    5: ([3, 2, 1, 0, 4], [3, 2, 1, 0, 4]),
    15: ([3, 5, 11, 12, 4, 2, 7, 6], [14, 9, 5, 0, 4, 1, 7, 6]),
    16: ([3, 5, 11, 12, 4, 2, 7, 6], [14, 15, 5, 0, 4, 1, 7, 6]),
    17: ([10, 12, 11, 6, 0, 16, 4, 7], [4, 16, 8, 12, 6, 10, 3, 7]),
    64: ([45, 12, 36, 56, 0, 20, 19, 25], [4, 57, 8, 28, 30, 51, 41, 32]),
    65: ([56, 28, 37, 57, 2, 49, 8, 13], [38, 33, 4, 37, 62, 19, 29, 51]),
    1000: ([457, 980, 735, 66, 916, 591, 93, 359], [931, 872, 581, 140, 277, 992, 738, 481]),
    2**20 + 1: (
        [750911, 100686, 354880, 60100, 707353, 501389, 808114, 55806],
        [628009, 933178, 608142, 880676, 712334, 285513, 197254, 598127],
    ),
}


@pytest.mark.parametrize("n", list(GOLDEN))
def test_bijection_golden(n):
    b = Bijection(n, "golden", 9)
    k = np.arange(min(n, 8))
    forward, inverse = GOLDEN[n]
    assert b.forward(k).tolist() == forward
    assert b.inverse(k).tolist() == inverse
    assert b.forward(k).dtype == np.int64
    if n <= 5000:  # the whole domain: a permutation, undone by its inverse, in any array shape
        y = b.forward(np.arange(n))
        assert sorted(y.tolist()) == list(range(n))
        assert b.inverse(y).tolist() == list(range(n))
        assert b.forward(np.arange(n).reshape(-1, 1)).ravel().tolist() == y.tolist()


def test_keys_and_mixer_golden():
    assert derive_key("golden", 9, "round", 5) == 16132589637879099654
    assert derive_key() == 17788976949752927641  # the prefix alone
    assert derive_key(-1, "x") == 4546299273427317664
    assert derive_key(1, 2) != derive_key(12) != derive_key("1/2")
    assert _mix(np.array([0, 1, 2**64 - 1], dtype=np.uint64)).tolist() == [0, 6238072747940578789, 13029008266876403067]


def test_bijection_refuses_bad_input():
    with pytest.raises(ValueError, match=r"a bijection needs n >= 1, got 0"):
        Bijection(0, "x")
    b = Bijection(10, "x")
    for bad in ([10], [-1], [0, 11]):
        with pytest.raises(ValueError, match=r"values outside \[0, 10\)"):
            b.forward(np.array(bad))
        with pytest.raises(ValueError, match=r"values outside \[0, 10\)"):
            b.inverse(np.array(bad))
    assert b.forward(np.array([], dtype=np.int64)).tolist() == []
    assert b.forward(9).tolist() == b.forward(np.array([9])).tolist()[0]
