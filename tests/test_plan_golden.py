"""Golden values for the shuffle plan: what `plan.locate` answers for a weighted, upsampled plan,
written down once and checked forever. The other shuffle tests compare the engine with the
plan; these pin the plan itself, so a change to any output order fails here and must come
with a new PLAN_ALGORITHM (which every epoch manifest records) and new values below."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.shards import PackedSource
from tokpack.formats.constants import PLAN_ALGORITHM
from tokpack.shuffle.plan import EpochPlan, SourcePlan, epoch_plan
from tokpack.shuffle.mixture import jitter_offset, windows_of

# The algorithm the values below were computed with. Changing the order means bumping
# PLAN_ALGORITHM in formats/constants.py, recomputing every value here, and changing this line.
GOLDEN_ALGORITHM = "tokpack-feistel6-splitmix-xxh3-v1"

SEQ_LEN, SEED, SAMPLES = 15, 1234, 40
ROW = SEQ_LEN + 1
# Source a: 20 rows exactly (19 windows with jitter); source b: 7 rows (6 with jitter).
# Weights 1:3 over 40 samples: a takes 10 per epoch (half a pass: epoch 2 is the first epoch of
# its second pass), b takes 30 (upsampled, 4 to 5 passes per epoch).
TOKENS = (20 * ROW, 7 * ROW)


def docs_of(total: int, seed: int) -> list[np.ndarray]:
    """Documents summing to exactly `total` tokens, each ending with EOS (0)."""
    rng = np.random.default_rng(seed)
    docs, left = [], total
    while left:
        n = min(left, int(rng.integers(1, 40)))
        d = rng.integers(1, 1000, size=n)
        d[-1] = 0
        docs.append(d)
        left -= n
    return docs


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[PackedSource]:
    root = tmp_path_factory.mktemp("golden")
    return [
        PackedSource.open(write_source(root / name, docs_of(t, k)))
        for k, (name, t) in enumerate(zip("ab", TOKENS), start=1)
    ]


def plan_of(sources, epoch: int, jitter: bool) -> EpochPlan:
    return epoch_plan(
        sources, seq_len=SEQ_LEN, seed=SEED, epoch=epoch, weights=["1", "3"], samples=SAMPLES, jitter=jitter
    )


# (jitter, epoch) -> per source (offset o_s, windows W_s, samples c_s, first pass, passes touched)
GOLDEN_SOURCES = {
    (False, 0): [(0, 20, 10, 0, 1), (0, 7, 30, 0, 5)],
    (False, 1): [(0, 20, 10, 0, 1), (0, 7, 30, 4, 5)],
    (False, 2): [(0, 20, 10, 1, 1), (0, 7, 30, 8, 5)],
    (True, 0): [(2, 19, 10, 0, 1), (9, 6, 30, 0, 5)],
    (True, 1): [(14, 19, 10, 0, 2), (1, 6, 30, 5, 5)],
    (True, 2): [(7, 19, 10, 1, 1), (10, 6, 30, 10, 5)],
}

# epoch -> source of output positions 0..39 (the same with and without jitter: the epoch
# order sigma_e does not depend on window offsets)
GOLDEN_SOURCE_OF = {
    0: "1110011110111011111110111111110001001111",
    1: "1010100111101111101111111110101111110101",
    2: "1110111111100111111000111000011111111111",
}

# (jitter, epoch) -> (window, pass) of output positions 0..39
GOLDEN_LOCATE = {
    (False, 0): (
        [
            5,
            6,
            3,
            9,
            4,
            3,
            5,
            6,
            6,
            17,
            2,
            2,
            4,
            15,
            0,
            4,
            6,
            0,
            0,
            4,
            5,
            7,
            1,
            5,
            1,
            1,
            3,
            2,
            4,
            1,
            6,
            10,
            3,
            4,
            18,
            8,
            2,
            2,
            0,
            3,
        ],
        [
            2,
            3,
            1,
            0,
            0,
            0,
            0,
            2,
            1,
            0,
            1,
            2,
            4,
            0,
            2,
            0,
            0,
            0,
            1,
            1,
            3,
            0,
            0,
            1,
            2,
            1,
            3,
            0,
            2,
            3,
            0,
            0,
            0,
            3,
            0,
            0,
            4,
            3,
            3,
            2,
        ],
    ),
    (False, 1): (
        [
            2,
            16,
            2,
            14,
            0,
            2,
            0,
            4,
            6,
            0,
            0,
            1,
            1,
            6,
            5,
            1,
            6,
            19,
            1,
            2,
            3,
            5,
            5,
            0,
            4,
            3,
            3,
            5,
            5,
            12,
            3,
            1,
            6,
            5,
            4,
            6,
            13,
            2,
            11,
            0,
        ],
        [
            8,
            0,
            6,
            0,
            8,
            0,
            0,
            5,
            6,
            7,
            5,
            0,
            7,
            4,
            4,
            4,
            5,
            0,
            6,
            5,
            6,
            6,
            5,
            6,
            6,
            7,
            4,
            0,
            7,
            0,
            5,
            5,
            7,
            8,
            7,
            8,
            0,
            7,
            0,
            4,
        ],
    ),
    (False, 2): (
        [
            0,
            3,
            1,
            4,
            4,
            2,
            5,
            6,
            2,
            5,
            0,
            10,
            0,
            1,
            2,
            6,
            4,
            4,
            1,
            19,
            8,
            3,
            5,
            4,
            4,
            11,
            16,
            18,
            5,
            3,
            6,
            0,
            1,
            0,
            5,
            3,
            3,
            6,
            3,
            1,
        ],
        [
            12,
            10,
            11,
            1,
            8,
            11,
            9,
            12,
            9,
            10,
            11,
            1,
            1,
            8,
            10,
            9,
            10,
            9,
            9,
            1,
            1,
            1,
            12,
            11,
            12,
            1,
            1,
            1,
            1,
            12,
            11,
            9,
            12,
            10,
            11,
            11,
            9,
            10,
            8,
            10,
        ],
    ),
    (True, 0): (
        [
            4,
            3,
            4,
            9,
            4,
            3,
            5,
            5,
            5,
            17,
            0,
            0,
            5,
            15,
            0,
            2,
            4,
            0,
            1,
            3,
            1,
            7,
            1,
            1,
            2,
            4,
            2,
            2,
            3,
            4,
            6,
            10,
            3,
            2,
            18,
            8,
            3,
            0,
            1,
            5,
        ],
        [
            3,
            3,
            2,
            0,
            0,
            0,
            0,
            3,
            1,
            0,
            1,
            2,
            4,
            0,
            3,
            1,
            0,
            0,
            2,
            1,
            3,
            0,
            0,
            1,
            2,
            1,
            4,
            0,
            2,
            4,
            0,
            0,
            0,
            3,
            0,
            0,
            4,
            4,
            4,
            2,
        ],
    ),
    (True, 1): (
        [
            0,
            11,
            0,
            14,
            3,
            2,
            0,
            1,
            3,
            1,
            2,
            1,
            2,
            3,
            0,
            5,
            4,
            16,
            2,
            3,
            4,
            1,
            4,
            5,
            2,
            4,
            2,
            5,
            5,
            12,
            0,
            5,
            5,
            4,
            0,
            1,
            13,
            3,
            11,
            1,
        ],
        [
            9,
            1,
            7,
            0,
            9,
            0,
            0,
            6,
            7,
            8,
            6,
            0,
            9,
            5,
            5,
            5,
            5,
            0,
            7,
            6,
            7,
            7,
            6,
            7,
            8,
            8,
            5,
            0,
            8,
            0,
            6,
            6,
            9,
            9,
            8,
            9,
            0,
            8,
            0,
            5,
        ],
    ),
    (True, 2): (
        [
            5,
            1,
            0,
            5,
            1,
            3,
            2,
            4,
            4,
            3,
            3,
            3,
            4,
            5,
            1,
            4,
            5,
            2,
            0,
            0,
            16,
            8,
            2,
            5,
            0,
            2,
            9,
            10,
            18,
            3,
            4,
            0,
            1,
            4,
            1,
            2,
            5,
            0,
            3,
            2,
        ],
        [
            14,
            11,
            13,
            1,
            10,
            13,
            10,
            14,
            10,
            11,
            12,
            1,
            1,
            10,
            12,
            11,
            12,
            11,
            11,
            1,
            1,
            1,
            14,
            13,
            14,
            1,
            1,
            1,
            1,
            14,
            13,
            10,
            14,
            12,
            13,
            13,
            11,
            12,
            10,
            12,
        ],
    ),
}

# (seed, epoch, source, seq_len) -> jitter offset, in [0, seq_len]
GOLDEN_JITTER = {
    (1234, 0, 0, 15): 2,
    (1234, 0, 1, 15): 9,
    (1234, 1, 0, 15): 14,
    (1234, 1, 1, 15): 1,
    (1234, 2, 0, 15): 7,
    (1234, 2, 1, 15): 10,
    (0, 0, 0, 4095): 1631,
    (7, 3, 2, 2047): 2041,
    (2**63, 5, 0, 1): 1,
    (0, 0, 0, 0): 0,
}


def test_goldens_belong_to_the_recorded_algorithm():
    """The values in this file hold for one algorithm only; manifests name it, so an epoch
    shuffled by another order is never replayed with this one."""
    assert PLAN_ALGORITHM == GOLDEN_ALGORITHM, (
        "PLAN_ALGORITHM changed: recompute the golden values of this file and update GOLDEN_ALGORITHM"
    )


@pytest.mark.parametrize("jitter", [False, True], ids=["plain", "jitter"])
@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_locate_golden(sources, epoch, jitter):
    plan = plan_of(sources, epoch, jitter)
    got = [(sp.offset, sp.windows, sp.samples, plan.first_pass(i), plan.passes(i)) for i, sp in enumerate(plan.sources)]
    assert got == GOLDEN_SOURCES[jitter, epoch]
    s, w, p = plan.locate(np.arange(SAMPLES))
    assert "".join(map(str, s.tolist())) == GOLDEN_SOURCE_OF[epoch]
    assert (w.tolist(), p.tolist()) == GOLDEN_LOCATE[jitter, epoch]
    # locate of any subset, in any order, agrees with locate of the whole epoch
    pick = np.array([39, 0, 17, 17, 5])
    s2, w2, p2 = plan.locate(pick)
    assert (s2.tolist(), w2.tolist(), p2.tolist()) == (s[pick].tolist(), w[pick].tolist(), p[pick].tolist())


@pytest.mark.parametrize("jitter", [False, True], ids=["plain", "jitter"])
def test_golden_epochs_consume_each_chain_in_order(sources, jitter):
    """Across epochs 0-2 each source's chain is read front to back with no gap or repeat: the
    golden (window, pass) pairs of a source, by pass, are whole permutations of its windows,
    except the partial passes at the ends of the range."""
    for s, tokens in enumerate(TOKENS):
        seen: dict[int, list[int]] = {}
        for epoch in range(3):
            src_of = GOLDEN_SOURCE_OF[epoch]
            windows, passes = GOLDEN_LOCATE[jitter, epoch]
            for g in range(SAMPLES):
                if int(src_of[g]) == s:
                    seen.setdefault(passes[g], []).append(windows[g])
        W = windows_of(tokens, SEQ_LEN, jitter)
        c = GOLDEN_SOURCES[jitter, 0][s][2]
        full, rest = divmod(3 * c, W)
        for p in range(full):
            assert sorted(seen[p]) == list(range(W))
        assert len(seen.get(full, [])) == rest and len(set(seen.get(full, []))) == rest
        assert set(seen) <= set(range(full + 1))


def test_first_epoch_of_a_second_pass(sources):
    """Source a without jitter: epoch 1 ends pass 0 exactly, epoch 2 is all of the first half of
    pass 1 and must not repeat pass 0's order."""
    plan1, plan2 = plan_of(sources, 1, False), plan_of(sources, 2, False)
    assert (plan2.first_pass(0), plan2.passes(0)) == (1, 1)
    order0 = plan1.window_perm(0, 0).forward(np.arange(20)).tolist()
    order1 = plan2.window_perm(0, 1).forward(np.arange(20)).tolist()
    assert order0 != order1
    s, w, p = plan2.locate(np.arange(SAMPLES))
    assert set(p[s == 0].tolist()) == {1}
    assert sorted(w[s == 0].tolist()) == sorted(order1[:10])


@pytest.mark.parametrize("key,offset", list(GOLDEN_JITTER.items()), ids=str)
def test_jitter_offset_golden(key, offset):
    seed, epoch, s, seq_len = key
    assert jitter_offset(seed, epoch, s, seq_len) == offset


@pytest.mark.parametrize("seq_len", [1, 15, 4095])
@pytest.mark.parametrize("k", [1, 2, 37])
def test_window_count_exact_fit_boundaries(seq_len, k):
    """k windows fit exactly in k(L+1) tokens; with jitter the offset can be as large as L, so
    k windows need L + k(L+1) tokens. One token less loses a window."""
    row = seq_len + 1
    assert windows_of(k * row, seq_len, False) == k
    assert windows_of(k * row - 1, seq_len, False) == k - 1
    assert windows_of(k * row + seq_len, seq_len, False) == k
    assert windows_of(seq_len + k * row, seq_len, True) == k
    assert windows_of(seq_len + k * row - 1, seq_len, True) == k - 1
    assert windows_of(seq_len + k * row + seq_len, seq_len, True) == k


@pytest.mark.parametrize("tokens", [ROW + SEQ_LEN, 3 * ROW + SEQ_LEN, 3 * ROW + SEQ_LEN + 1, 3 * ROW + 2 * SEQ_LEN])
def test_jittered_windows_fit_every_offset(tokens):
    """Whatever the offset in [0, L], every jittered window lies inside the source, and at the
    exact fit the largest offset ends the last window on the last token."""
    W = windows_of(tokens, SEQ_LEN, True)
    offsets = {jitter_offset(seed, e, 0, SEQ_LEN) for seed in range(40) for e in range(4)}
    assert offsets == set(range(ROW))  # every offset occurs, the largest (L) included
    for o in offsets:
        assert o + W * ROW <= tokens
    assert SEQ_LEN + W * ROW <= tokens < SEQ_LEN + (W + 1) * ROW


def test_exact_fit_plan_drops_nothing(sources):
    plan = plan_of(sources, 0, False)
    assert plan.dropped_tokens() == 0
    assert plan.token_range(0, 19) == (19 * ROW, 20 * ROW) == (19 * ROW, TOKENS[0])
    jittered = plan_of(sources, 0, True)
    assert jittered.dropped_tokens() == sum(t - w * ROW for t, w in zip(TOKENS, (19, 6))) == 2 * ROW
    for s, sp in enumerate(jittered.sources):
        assert jittered.token_range(s, sp.windows - 1)[1] <= sp.tokens


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    windows=st.integers(16, 3000),
    seed=st.integers(0, 2**64 - 1),
    s=st.integers(0, 7),
    p1=st.integers(0, 1000),
    p2=st.integers(0, 1000),
)
def test_no_two_passes_share_an_order(windows, seed, s, p1, p2):
    """Every pass over a source takes its windows in its own order (the flaw of repeating one
    order every pass is what this rules out). 16! orders: a chance collision is out of reach."""
    if p1 == p2:
        p2 = p1 + 1
    srcs = tuple(SourcePlan(i, "", "", "", None, windows * ROW, 0, windows, windows, i * windows) for i in range(s + 1))
    plan = EpochPlan(seed, 0, SEQ_LEN, False, windows * (s + 1), srcs)
    k = np.arange(windows)
    a = plan.window_perm(s, p1).forward(k)
    b = plan.window_perm(s, p2).forward(k)
    assert not np.array_equal(a, b)


def test_plan_refuses_an_epoch_of_another_algorithm(sources):
    """An epoch whose manifest names another order cannot be replayed (validate --against,
    inspect) with this one."""
    plan = plan_of(sources, 0, False)
    manifest = {
        "seed": SEED,
        "epoch": 0,
        "seq_len": SEQ_LEN,
        "jitter": False,
        "samples": SAMPLES,
        "sources": plan.source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }
    assert (
        EpochPlan.from_manifest(manifest, sources).locate(np.arange(5))[1].tolist()
        == plan.locate(np.arange(5))[1].tolist()
    )
    manifest["shuffle"] = "tokpack-feistel6-splitmix-xxh3-v0"
    with pytest.raises(TokpackError, match="another shuffle algorithm"):
        EpochPlan.from_manifest(manifest, sources)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(windows=st.integers(1, 60), samples=st.integers(0, 200), epoch=st.integers(0, 30))
def test_first_pass_and_passes_count_the_chain(windows, samples, epoch):
    """first_pass / passes (recorded in every epoch manifest, and the passes outputs_of walks)
    are those of the chain positions [e c, (e+1) c) counted one by one."""
    sp = SourcePlan(0, "", "", "", None, windows * ROW, 0, windows, samples, 0)
    plan = EpochPlan(1, epoch, SEQ_LEN, False, max(samples, 1), (sp,))
    touched = sorted({pos // windows for pos in range(epoch * samples, (epoch + 1) * samples)})
    assert plan.passes(0) == len(touched)
    if touched:
        assert plan.first_pass(0) == touched[0]


def test_epoch_size_golden(sources):
    """N and c_s from --tokens, from --samples without weights (shares by window count), and
    from nothing (every window once)."""
    plan = lambda **kw: epoch_plan(sources, seq_len=SEQ_LEN, seed=5, epoch=0, **kw)  # noqa: E731
    assert [(p.samples, [sp.samples for sp in p.sources]) for p in (plan(tokens=400), plan(samples=10), plan())] == [
        (26, [19, 7]),
        (10, [7, 3]),
        (27, [20, 7]),
    ]


# weights -> (c_s, base_s, and locate of the 9 samples of epoch 1: sources, windows, passes)
GOLDEN_WEIGHTED = {
    ("1/3", "2/3"): (
        [3, 6],
        [0, 3],
        [1, 1, 0, 0, 1, 1, 1, 0, 1],
        [1, 3, 2, 4, 4, 6, 0, 10, 4],
        [1, 1, 0, 0, 1, 1, 1, 0, 0],
    ),
    ("0.5", "0.5"): (
        [5, 4],
        [0, 5],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [6, 4, 1, 2, 17, 0, 4, 8, 13],
        [0, 1, 0, 0, 0, 0, 0, 0, 0],
    ),  # a tie: the lower source gets the extra sample
}


@pytest.mark.parametrize("weights", list(GOLDEN_WEIGHTED), ids="/".join)
def test_weighted_shares_golden(sources, weights):
    """Exact rational shares, and ties to the lower source."""
    p = epoch_plan(sources, seq_len=SEQ_LEN, seed=5, epoch=1, weights=list(weights), samples=9)
    s, w, passes = p.locate(np.arange(9))
    got = ([sp.samples for sp in p.sources], [sp.base for sp in p.sources], s.tolist(), w.tolist(), passes.tolist())
    assert got == GOLDEN_WEIGHTED[weights]
    for i, sp in enumerate(p.sources):
        placed = [g for _, _, gs in p.outputs_of(i, np.arange(sp.windows)) for g in gs.tolist()]
        assert sorted(placed) == sorted(np.flatnonzero(s == i).tolist())


NEEDS_113 = (
    "<root>/b [--seq-len]: seq_len is larger than the source; expected a source of at least 113 tokens, "
    "found 112 tokens. HINT: lower --seq-len or drop this source"
)
NOT_A_NUMBER = (
    "[weight of <root>/b]: weight is not a number; expected a non-negative number like 0.3, 2 or 1/3, "
    "found '{}'. HINT: write SOURCE=WEIGHT"
)


@pytest.mark.parametrize(
    "kw,line",
    [
        (dict(weights=["1", "-1"]), "[weight of <root>/b]: weight is negative; expected >= 0, found -1"),
        (dict(weights=["1", "x"]), NOT_A_NUMBER.format("x")),
        (dict(weights=["1", "1/0"]), NOT_A_NUMBER.format("1/0")),
        (
            dict(weights=["0", "1"]),
            "<root>/a [SOURCE=WEIGHT]: weight is 0; expected a weight > 0, found 0. "
            "HINT: leave the source out instead of giving it weight 0",
        ),
        (
            dict(weights=["1", "0"]),
            "<root>/b [SOURCE=WEIGHT]: weight is 0; expected a weight > 0, found 0. "
            "HINT: leave the source out instead of giving it weight 0",
        ),
        (
            dict(weights=["1", None]),
            "[SOURCE=WEIGHT]: some sources have a weight and some do not; expected a weight on "
            "every source or on none, found <root>/a=1, <root>/b=None",
        ),
        (dict(samples=0), "[--samples/--tokens]: the epoch would hold no samples; expected >= 1 sample, found 0"),
        (
            dict(tokens=SEQ_LEN - 1),
            "[--samples/--tokens]: the epoch would hold no samples; expected >= 1 sample, found 0",
        ),
        (dict(seq_len=TOKENS[1]), NEEDS_113),
        (dict(seq_len=(TOKENS[1] - 1) // 2 + 1, jitter=True), NEEDS_113),  # 56 + 1 + 56 for a jittered window
    ],
)
def test_plan_refuses_bad_parameters(sources, kw, line):
    """The whole error line, as the CLI prints it (file, field, expected, found, hint)."""
    root = str(sources[0].path.parent)
    kw = {"seq_len": SEQ_LEN, "seed": 1, "epoch": 0, **kw}
    with pytest.raises(TokpackError) as e:
        epoch_plan(sources, **kw)
    assert str(e.value).replace(root, "<root>") == line
    with pytest.raises(TokpackError) as e:
        epoch_plan([], seq_len=SEQ_LEN, seed=1, epoch=0)
    assert str(e.value) == "no sources given. HINT: tokpack shuffle SOURCE[=WEIGHT]... -o OUT"


def test_source_entries_golden(sources):
    """What every epoch manifest records per source, and the plan it is read back into."""
    plan = plan_of(sources, 2, True)
    root = str(sources[0].path.parent)
    entries = [{**e, "path": e["path"].replace(root, "<root>")} for e in plan.source_entries()]
    assert entries == [
        {
            "name": "a",
            "path": "<root>/a",
            "fingerprint": sources[0].fingerprint,
            "weight": "1",
            "samples": 10,
            "first_pass": 1,
            "passes": 1,
            "windows": 19,
            "tokens": 320,
            "offset": 7,
            "dropped_tokens": 16,
        },
        {
            "name": "b",
            "path": "<root>/b",
            "fingerprint": "9b727902748cf5240826f120f1f5e7ba",
            "weight": "3",
            "samples": 30,
            "first_pass": 10,
            "passes": 5,
            "windows": 6,
            "tokens": 112,
            "offset": 10,
            "dropped_tokens": 16,
        },
    ]
    manifest = {
        "seed": SEED,
        "epoch": 2,
        "seq_len": SEQ_LEN,
        "jitter": True,
        "samples": SAMPLES,
        "sources": plan.source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }
    assert EpochPlan.from_manifest(manifest, sources) == plan
    assert EpochPlan.from_manifest(manifest, sources[::-1]) == plan  # sources matched by fingerprint


def test_plan_from_a_manifest_that_does_not_fit_its_sources(sources):
    """An epoch manifest replayed against the wrong or changed sources, or written by another
    order, is refused, naming the field, before any window is read."""
    root = str(sources[0].path.parent)
    good = {
        "seed": SEED,
        "epoch": 0,
        "seq_len": SEQ_LEN,
        "jitter": True,
        "samples": SAMPLES,
        "sources": plan_of(sources, 0, True).source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }

    def refused(manifest, srcs=sources) -> str:
        with pytest.raises(TokpackError) as e:
            EpochPlan.from_manifest(manifest, srcs)
        return str(e.value).replace(root, "<root>")

    assert refused({**good, "shuffle": "tokpack-feistel6-splitmix-xxh3-v0"}) == (
        "[shuffle]: epoch shuffled by another shuffle algorithm; expected tokpack-feistel6-splitmix-xxh3-v1, found "
        "tokpack-feistel6-splitmix-xxh3-v0. HINT: use the tokpack version that wrote the epoch to replay its plan"
    )
    assert refused(good, sources[:1]) == (
        "[sources[1] (b)]: source of the epoch not given; expected a source with fingerprint "
        "9b727902748cf5240826f120f1f5e7ba, found none left. HINT: pass every source the epoch was shuffled from, unchanged"
    )
    too_far = {**good, "sources": [dict(e) for e in good["sources"]]}
    too_far["sources"][1]["offset"] += ROW  # 6 windows from offset 9 + 16 end past 112 tokens
    assert refused(too_far) == (
        "<root>/b [sources[1]]: epoch manifest windows exceed the source; expected <= 112 tokens, found 121"
    )
    exact = {**good, "sources": [dict(e) for e in good["sources"]]}
    exact["sources"][1]["offset"] = TOKENS[1] - 6 * ROW  # the last window ends on the last token: fine
    assert EpochPlan.from_manifest(exact, sources).sources[1].offset == SEQ_LEN + 1
    assert refused({**good, "samples": SAMPLES + 1}) == (
        "[sources[].samples]: epoch manifest source samples do not add up; expected 41, found 40"
    )


GOLDEN_MULTISET = {
    (False, 0): "18c1dfa62ca96791",
    (True, 0): "8a895b30b1a66dde",
    (False, 1): "3d66e3262320b813",
    (True, 1): "8598d2a9b0f73deb",
    (False, 2): "1d5ea5502317a37f",
    (True, 2): "2e2cc75ae87ad0e6",
}


@pytest.mark.parametrize("jitter", [False, True], ids=["plain", "jitter"])
@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_expected_multiset_hash(sources, epoch, jitter):
    """The multiset hash validate --against recomputes through the plan is the golden value, and
    equals the hash of the windows locate() names, read straight from the shard files."""
    import tokpack.shuffle.plan as plan_mod
    import xxhash

    from tokpack.formats.hashes import hash_hex64

    plan = plan_of(sources, epoch, jitter)
    manifest = {
        "seed": SEED,
        "epoch": epoch,
        "seq_len": SEQ_LEN,
        "jitter": jitter,
        "samples": SAMPLES,
        "sources": plan.source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }
    assert plan_mod.replay_hashes(manifest, sources, order=False)[0] == GOLDEN_MULTISET[jitter, epoch]
    tokens = [np.concatenate([np.fromfile(src.path / s["path"], dtype="<u2") for s in src.shards]) for src in sources]
    s, w, _ = plan.locate(np.arange(SAMPLES))
    total = 0
    for si, wi in zip(s.tolist(), w.tolist()):
        a, b = plan.token_range(si, wi)
        total += xxhash.xxh3_64_intdigest(tokens[si][a:b].tobytes())
    assert hash_hex64(total) == GOLDEN_MULTISET[jitter, epoch]


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
@pytest.mark.parametrize("block", [1, 3 * 2 * ROW, 1 << 20], ids=["row-blocks", "3-row-blocks", "one-block"])
@pytest.mark.parametrize("w0,w1", [(0, None), (2, 5), (4, 4)])
def test_iter_source_windows_reads_the_jittered_windows(sources, block, w0, w1, mapped):
    """... and `mapped` (the exchange's reads): the same windows, each block a view of the shard's
    mapped pages unless a window in it crosses a shard's end (then that window alone, read into
    an array of its own), every block still valid once the iteration is over."""
    import mmap

    from tokpack.shuffle.plan import iter_source_windows

    def mapping(a):  # the mmap under a view, if any
        while isinstance(a, (np.ndarray, memoryview)):
            a = a.base if isinstance(a, np.ndarray) else a.obj
        return isinstance(a, mmap.mmap)

    plan = plan_of(sources, 1, True)
    for s, src in enumerate(sources):
        tokens = np.concatenate([np.fromfile(src.path / sh["path"], dtype="<u2") for sh in src.shards])
        end = plan.sources[s].windows if w1 is None else w1
        got, blocks = {}, []
        for a, rows in iter_source_windows(plan, s, src, block_bytes=block, w0=w0, w1=w1, mapped=mapped):
            blocks.append((a, rows))
            for k, row in enumerate(rows):
                got[a + k] = row.tolist()
        assert list(got) == list(range(w0, end))
        for a, rows in blocks if mapped else ():
            lo = plan.sources[s].offset + a * plan.row_tokens  # the block's stream tokens, read whole
            hi = lo + len(rows) * plan.row_tokens
            crosses = bool(((src.shard_starts > lo) & (src.shard_starts < hi)).any())
            assert len(rows) == 1 if crosses else mapping(rows), (a, len(rows))
            assert [got[a + k] for k in range(len(rows))] == rows.tolist()  # still valid
        for k, row in got.items():
            lo, hi = plan.token_range(s, k)
            assert row == tokens[lo:hi].tolist()


@pytest.mark.parametrize("jitter", [False, True])
@pytest.mark.parametrize("block", [1, 3 * 2 * ROW, 1 << 20], ids=["row-blocks", "3-row-blocks", "one-block"])
def test_mapped_windows_are_cut_at_shard_ends_into_mappings_and_lone_crossing_windows(tmp_path, block, jitter):
    """iter_source_windows(mapped=True) over a source of many shards, some shorter than a window:
    every window once, in order, with its tokens; a block is a view of one shard's mapped pages,
    or a lone window that crosses a shard's end (read into an array of its own); every block
    still valid once the iteration is over."""
    import mmap

    from conftest import random_docs
    from tokpack.shuffle.plan import iter_source_windows

    def mapping(a):
        while isinstance(a, (np.ndarray, memoryview)):
            a = a.base if isinstance(a, np.ndarray) else a.obj
        return isinstance(a, mmap.mmap)

    rng = np.random.default_rng(7)
    docs = random_docs(rng, 120, 1000, 0, 1, 40)  # a shard of 2 documents: 2 to 80 tokens, a window 16
    src = PackedSource.open(write_source(tmp_path / "src", docs, docs_per_shard=2))
    assert (np.diff(src.shard_starts) < ROW).any() and len(src.shards) > 20
    plan = epoch_plan([src], seq_len=SEQ_LEN, seed=SEED, epoch=0, jitter=jitter)
    tokens = np.concatenate([np.fromfile(src.path / sh["path"], dtype="<u2") for sh in src.shards])
    sp, blocks, alone = plan.sources[0], [], 0
    for a, rows in iter_source_windows(plan, 0, src, block_bytes=block, mapped=True):
        blocks.append((a, rows))
        lo = sp.offset + a * ROW
        crosses = bool(((src.shard_starts > lo) & (src.shard_starts < lo + len(rows) * ROW)).any())
        assert (len(rows) == 1 and not mapping(rows)) if crosses else mapping(rows), (a, len(rows))
        alone += crosses
    assert [a + k for a, rows in blocks for k in range(len(rows))] == list(range(sp.windows))
    assert alone > 5
    for a, rows in blocks:
        for k, row in enumerate(rows):
            lo, hi = plan.token_range(0, a + k)
            assert row.tolist() == tokens[lo:hi].tolist(), a + k


def test_iter_source_windows_asks_the_disk_for_the_next_block_while_it_works_on_this_one(sources, monkeypatch):
    """Before a block is hashed and handed over, the reading thread asks the kernel for the next
    one (POSIX_FADV_WILLNEED): exactly its bytes, in its shards, so the disk reads it meanwhile."""
    import os

    from tokpack.shuffle.plan import iter_source_windows

    calls, fadvise, read_into = [], os.posix_fadvise, PackedSource.read_into

    def advised(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append(("advise", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return fadvise(fd, offset, length, advice)

    def read(self, start, out, handles=None):
        calls.append(("read", start, len(out)))
        return read_into(self, start, out, handles)

    monkeypatch.setattr(os, "posix_fadvise", advised)
    monkeypatch.setattr(PackedSource, "read_into", read)
    src, plan = sources[0], plan_of(sources, 1, False)
    shard_of = {sh["path"].rsplit("/", 1)[-1]: int(src.shard_starts[i]) for i, sh in enumerate(src.shards)}
    list(iter_source_windows(plan, 0, src, block_bytes=3 * ROW * 2))
    reads = [i for i, c in enumerate(calls) if c[0] == "read"]
    assert len(reads) > 3
    for before, at in zip(reads, reads[1:]):
        _, start, n = calls[at]
        asked = [c for c in calls[before + 1 : at] if c[0] == "advise"]  # after the read before it
        tokens = [(shard_of[f] + off // 2, length // 2) for _, f, off, length in asked]
        assert tokens and tokens[0][0] == start and sum(k for _, k in tokens) == n
        assert all(a + k == b for (a, k), (b, _) in zip(tokens, tokens[1:]))  # one range, shard after shard
    assert not [c for c in calls[reads[-1] :] if c[0] == "advise"]  # nothing past the last block


def test_three_sources_share_bases(sources):
    """Bases accumulate over every source before s (three sources, the same data twice; the
    engine refuses a repeated source, the plan itself does not care)."""
    three = epoch_plan(
        [sources[0], sources[1], sources[0]], seq_len=SEQ_LEN, seed=5, epoch=1, weights=["1", "1", "1"], samples=9
    )
    assert [(sp.samples, sp.base) for sp in three.sources] == [(3, 0), (3, 3), (3, 6)]
    s, _, _ = three.locate(np.arange(9))
    assert sorted(s.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_manifest_entries_without_name_or_path(sources):
    """name and path are for humans: an entry without them still replays, with empty ones."""
    plan = plan_of(sources, 0, False)
    entries = [{k: v for k, v in e.items() if k not in ("name", "path")} for e in plan.source_entries()]
    manifest = {
        "seed": SEED,
        "epoch": 0,
        "seq_len": SEQ_LEN,
        "jitter": False,
        "samples": SAMPLES,
        "sources": entries,
        "shuffle": PLAN_ALGORITHM,
    }
    back = EpochPlan.from_manifest(manifest, sources)
    assert [(sp.name, sp.path) for sp in back.sources] == [("", ""), ("", "")]
    assert back.locate(np.arange(SAMPLES))[1].tolist() == GOLDEN_LOCATE[False, 0][0]


def test_edges_of_locate_and_outputs_of(sources, tmp_path):
    """A source of exactly one window (W = 1, upsampled: every pass is that window), an epoch of
    one sample, an empty query, single-window queries, and names given on the command line."""
    one = PackedSource.open(write_source(tmp_path / "one", docs_of(ROW, 9)))
    plan = epoch_plan(
        [one, sources[1]], seq_len=SEQ_LEN, seed=5, epoch=2, weights=["1", "1"], samples=6, names=["first", "second"]
    )
    assert [(sp.name, sp.windows, sp.samples) for sp in plan.sources] == [("first", 1, 3), ("second", 7, 3)]
    s, w, p = plan.locate(np.arange(6))
    assert sorted(zip(s.tolist(), w.tolist(), p.tolist()))[:3] == [(0, 0, 6), (0, 0, 7), (0, 0, 8)]
    assert [x.tolist() for x in plan.locate(np.array([], dtype=np.int64))] == [[], [], []]
    for src in (0, 1):
        for k in range(plan.sources[src].windows):
            got = sorted(int(g) for _, _, gs in plan.outputs_of(src, np.array([k])) for g in gs)
            assert got == sorted(np.flatnonzero((s == src) & (w == k)).tolist())
    single = epoch_plan(sources, seq_len=SEQ_LEN, seed=5, epoch=0, samples=1)
    assert single.samples == 1 and [sp.samples for sp in single.sources] == [1, 0]
    assert [sp["weight"] for sp in single.source_entries()] == [None, None]


def test_replay_details(sources, monkeypatch):
    """A source matched twice leaves the other unmatched and is named; a manifest without a
    jitter field is an unjittered epoch; the replayed multiset hash is the same in blocks of any
    size."""
    import functools

    import tokpack.shuffle.plan as plan_mod
    import xxhash

    from tokpack.formats.hashes import hash_hex64

    root = str(sources[0].path.parent)
    good = {
        "seed": SEED,
        "epoch": 0,
        "seq_len": SEQ_LEN,
        "samples": SAMPLES,
        "sources": plan_of(sources, 0, False).source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }
    assert EpochPlan.from_manifest(good, sources) == plan_of(sources, 0, False)  # no "jitter": False
    with pytest.raises(TokpackError) as e:
        EpochPlan.from_manifest(good, [sources[0]] * 3)
    assert (
        str(e.value)
        .replace(root, "<root>")
        .endswith("found <root>/a, <root>/a. HINT: pass every source the epoch was shuffled from, unchanged")
    )
    plan = epoch_plan(sources, seq_len=SEQ_LEN, seed=5, epoch=1, weights=["1", "2"], samples=9)
    manifest = {
        "seed": 5,
        "epoch": 1,
        "seq_len": SEQ_LEN,
        "jitter": False,
        "samples": 9,
        "sources": plan.source_entries(),
        "shuffle": PLAN_ALGORITHM,
    }
    tokens = [np.concatenate([np.fromfile(src.path / sh["path"], dtype="<u2") for sh in src.shards]) for src in sources]
    s, w, _ = plan.locate(np.arange(9))
    want = hash_hex64(
        sum(
            xxhash.xxh3_64_intdigest(tokens[a][slice(*plan.token_range(a, b))].tobytes())
            for a, b in zip(s.tolist(), w.tolist())
        )
    )
    assert plan_mod.replay_hashes(manifest, sources, order=False)[0] == want
    monkeypatch.setattr(
        plan_mod, "iter_source_windows", functools.partial(plan_mod.iter_source_windows, block_bytes=3 * 2 * ROW)
    )
    assert plan_mod.replay_hashes(manifest, sources, order=False)[0] == want
    assert (
        plan_mod.replay_hashes(
            {
                **manifest,
                **{
                    "sources": plan_of(sources, 2, True).source_entries(),
                    "seed": SEED,
                    "epoch": 2,
                    "jitter": True,
                    "samples": SAMPLES,
                },
            },
            sources,
            order=False,
        )[0]
        == GOLDEN_MULTISET[True, 2]
    )
