"""The I/O layer every stage reads and writes through, one module an idea:

- `paths`: local paths and fsspec URLs behind one set of calls (as_path, RemotePath);
- `gate`: every file tokpack reads that it did not just write is opened there (containment,
  regular files, the recorded size: docs/COMMANDS.md, "The gate"), and its bounded reads
  (read_limited, read_record, read_array, memory maps);
- `memory`: anonymous private mappings and the reusable buffers a reader owns;
- `reads`: read-until-full and the one pipelining idiom (Worker, read_ahead);
- `writes`: atomic and O_DIRECT writes (DurableFile), temporary names, the Outbox to a bucket;
- `progress_log`: progress, a bar on a terminal, a line every 30 s in a log ($TOKPACK_PROGRESS).

Each name is imported from its module; the four below stay importable from here by the names
docs/COMMANDS.md and BENCHMARKS.md give them (`tokpack.formats.io.contained`, `.anonymous`,
`.DurableFile`, `.progress`)."""

# ruff: noqa: F401 (every import here is a re-export)

from .gate import contained
from .memory import anonymous
from .progress_log import progress
from .writes import DurableFile
