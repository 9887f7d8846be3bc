"""The packed plan (`--packing best-fit`): whole documents packed into rows by best-fit
decreasing, per source and per pass, then the rows of all sources permuted globally.

Specified in docs/COMMANDS.md, "Best-fit packing", and pinned by tests/test_packing.py; the
names follow it (R = L + 1, D_s, rho_{s,p}, G, R_{s,p}, c_s, sigma_e).

Unlike the window plan (O(#sources), tokpack.shuffle.plan.EpochPlan), a packed plan is materialised:
its row table (per output row, the pieces of documents it holds) is computed from the sources'
document lengths (their `.ds.index`) and checksummed; the checksum is recorded in the epoch
manifest so `validate --against` proves the epoch is this table's. The table is O(documents),
so a shuffle builds it on disk in the epoch's work folder within --memory (build_table) and
each task reads only its rows' or its source shard's part (PackedTable); the plan object
itself holds row counts per source and pass, O(#sources x passes).

The package holds one idea a module: passes.py (a source's documents and one pass packed),
packed_plan.py (the plan: row counts, mixture, chains, manifest fields), table.py (the row table
on disk, its figures and rules) and replay.py (rows rebuilt from the table: the token pool and
`validate --against`). Each name is imported from its module; build_table is also here, since
docs/COMMANDS.md names `tokpack.shuffle.packed.build_table`.
"""

from .table import build_table  # noqa: F401 (a re-export)
