"""The I/O layer every stage reads and writes through, one module an idea:

- `paths`: local paths and fsspec URLs behind one set of calls (as_path, RemotePath);
- `gate`: every file tokpack reads that it did not just write is opened there (containment,
  regular files, the recorded size: docs/COMMANDS.md, "The gate"), and its bounded reads
  (read_limited, read_record, read_array, memory maps);
- `memory`: anonymous private mappings and the reusable buffers a reader owns;
- `reads`: read-until-full and the one pipelining idiom (Worker, read_ahead);
- `writes`: atomic and O_DIRECT writes (DurableFile), temporary names, the Outbox to a bucket;
- `progress_log`: progress, a bar on a terminal, a line every 30 s in a log ($TOKPACK_PROGRESS).

Every public name is importable from here, `from tokpack.formats.io import X`, as before the split,
but `gate` (the gate's one check, used by the gate's own calls): `tokpack.formats.io.gate` is its
module, as `tokpack.formats.io.progress` is the function (its module is `progress_log`)."""

from .paths import (
    RemotePath,
    as_path,
    is_url,
    local_path,
    name_problem,
)
from .gate import (
    IO_BLOCK,
    MAX_RECORD_BYTES,
    contained,
    hash_mapped,
    iter_file_blocks,
    map_array,
    map_file,
    open_append,
    open_new,
    open_read,
    read_array,
    read_limited,
    read_record,
    regular_fd,
    regular_size,
    sequential,
)
from .memory import (
    Buffer,
    MADV_POPULATE_READ,
    anonymous,
    drop_buffers,
    give_buffers,
    lent,
    populate,
    take_buffer,
)
from .reads import (
    STOP_GRACE,
    ThreadPool,
    Worker,
    read_ahead,
    read_full,
)
from .writes import (
    DIRECT_ALIGN,
    DIRECT_STAGING,
    DurableFile,
    HashedFile,
    Outbox,
    TMP_MARK,
    commit_file,
    fsync_dir,
    is_tmp_name,
    remove_tmp_files,
    tmp_path,
    write_bytes_atomic,
)
from .progress_log import (
    DEFAULT_LOG_INTERVAL,
    LOG_INTERVAL_ENV,
    OLD_INTERVAL_ENV,
    PROGRESS_ENV,
    log_interval,
    logging_every,
    progress,
    progress_mode,
    progress_on,
)

__all__ = [
    "RemotePath",
    "as_path",
    "is_url",
    "local_path",
    "name_problem",
    "IO_BLOCK",
    "MAX_RECORD_BYTES",
    "contained",
    "hash_mapped",
    "iter_file_blocks",
    "map_array",
    "map_file",
    "open_append",
    "open_new",
    "open_read",
    "read_array",
    "read_limited",
    "read_record",
    "regular_fd",
    "regular_size",
    "sequential",
    "Buffer",
    "MADV_POPULATE_READ",
    "anonymous",
    "drop_buffers",
    "give_buffers",
    "lent",
    "populate",
    "take_buffer",
    "STOP_GRACE",
    "ThreadPool",
    "Worker",
    "read_ahead",
    "read_full",
    "DIRECT_ALIGN",
    "DIRECT_STAGING",
    "DurableFile",
    "HashedFile",
    "Outbox",
    "TMP_MARK",
    "commit_file",
    "fsync_dir",
    "is_tmp_name",
    "remove_tmp_files",
    "tmp_path",
    "write_bytes_atomic",
    "DEFAULT_LOG_INTERVAL",
    "LOG_INTERVAL_ENV",
    "OLD_INTERVAL_ENV",
    "PROGRESS_ENV",
    "log_interval",
    "logging_every",
    "progress",
    "progress_mode",
    "progress_on",
]
