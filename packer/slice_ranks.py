"""Which ranks a node slice holds: `--ranks A-B` of
`--world-size`, or `--node n/N` of `--ranks-per-node`, checked and bounded.
"""

from __future__ import annotations


from tokpack.formats.errors import TokpackError
from tokpack.formats.units import at_most, digits
from tokpack.packer.stage_plan import MAX_WORLD_SIZE


def parse_rank_range(spec) -> tuple[int, int, int | None]:
    """'A-B', 'A' or 'A-B/W' -> (A, B, W or None)."""
    head, sep, tail = str(spec).partition("/")
    lo, dash, hi = head.partition("-")
    try:
        a, b = digits(lo), digits(hi) if dash else digits(lo)
        w = digits(tail) if sep else None
    except ValueError:
        raise TokpackError(
            "bad --ranks", where="--ranks", expected="'A-B' (consecutive ranks of one node) or 'A'", found=spec
        ) from None
    if a < 0 or b < a:
        raise TokpackError("bad --ranks", where="--ranks", expected="0 <= A <= B", found=spec)
    return a, b, w


# Ranks one node slice holds: each is a file written at once during a stage, so the bound is the
# open files a process may hold, far above the GPUs a node has.
MAX_SLICE_RANKS = 256
# Samples in a global batch: far above any run's (2^48 rows is an exabyte at seq_len 4096), and
# low enough that the row arithmetic of formats/slices.py stays inside int64.
MAX_GLOBAL_BATCH = 1 << 48


def slice_ranks(
    ranks=None,
    world_size: int | None = None,
    node=None,
    ranks_per_node: int | None = None,
    micro_batch: int | None = None,
) -> tuple[int, int, int]:
    """(A, B, W) from `--ranks A-B --world-size W` or `--node n/N --ranks-per-node K` (W = N*K),
    with at most MAX_SLICE_RANKS ranks and, given `micro_batch` m, W*m at most MAX_GLOBAL_BATCH:
    checked before anything is written, for every command that makes a node slice."""
    a, b, w = _slice_ranks(ranks, world_size, node, ranks_per_node)
    at_most(
        b - a + 1,
        MAX_SLICE_RANKS,
        "ranks in one node slice",
        where="--ranks/--ranks-per-node",
        hint="a node slice holds the ranks of one node: stage each node's ranks (--node n/N) on that node",
    )
    at_most(
        w,
        MAX_WORLD_SIZE,
        "world size",
        where="--world-size",
        hint="W is the number of data-parallel ranks that read the run",
    )
    if micro_batch is not None:
        at_most(
            w * micro_batch,
            MAX_GLOBAL_BATCH,
            "samples in a global batch (W*m)",
            where="--world-size/--micro-batch",
            hint="W is the data-parallel ranks and m the samples each reads per step; a run holds far fewer samples",
        )
    return a, b, w


def _slice_ranks(ranks, world_size, node, ranks_per_node) -> tuple[int, int, int]:
    if node is not None:
        if ranks is not None:
            raise TokpackError("give --ranks or --node, not both", where="--node")
        try:
            n, _, count = str(node).partition("/")
            n, count = digits(n), digits(count)
        except ValueError:
            raise TokpackError("bad --node", where="--node", expected="'n/N': node n of N", found=node) from None
        k = ranks_per_node
        if k is None or k < 1 or count < 1 or not 0 <= n < count:
            raise TokpackError(
                "bad --node",
                where="--node/--ranks-per-node",
                expected="0 <= n < N and K >= 1",
                found=f"{node}, --ranks-per-node {k}",
            )
        if world_size is not None and world_size != count * k:
            raise TokpackError(
                "--world-size disagrees with --node and --ranks-per-node",
                where="--world-size",
                expected=f"{count * k} (N*K)",
                found=world_size,
            )
        return n * k, n * k + k - 1, count * k
    if ranks is None:
        raise TokpackError(
            "a node slice needs its ranks", where="--ranks", hint="add --ranks A-B, or --node n/N --ranks-per-node K"
        )
    a, b, w = parse_rank_range(ranks)
    if w is not None and world_size is not None and w != world_size:
        raise TokpackError("--ranks and --world-size disagree", where="--ranks", expected=f"/{world_size}", found=ranks)
    w = world_size if world_size is not None else w
    if w is None or w < 1 or b >= w:
        raise TokpackError(
            "bad --ranks",
            where="--ranks",
            expected=f"ranks in [0, {w})" if w else "a --world-size",
            found=ranks,
            hint="each rank must be below the world size W",
        )
    return a, b, w
