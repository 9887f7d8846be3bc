"""Errors that reach the user as one line: file, where, expected, found, hint."""

from __future__ import annotations

import errno
import functools
import os


class TokpackError(Exception):
    """Bad input or bad data. The CLI prints `str(err)` and exits with status 1.

    Every field is optional except the message; fill in as many as are known so the
    user can find the problem without a debugger.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,  # the file (or directory) at fault
        where: str | None = None,  # offset, field, document number, shard...
        expected: object = None,  # what tokpack needed to see
        found: object = None,  # what it saw instead
        hint: str | None = None,  # what the user can do about it
    ):
        self.message = message
        self.file = None if file is None else str(file)
        self.where = where
        self.expected = expected
        self.found = found
        self.hint = hint
        super().__init__(str(self))

    def with_hint(self, hint: str) -> "TokpackError":
        """The same line with another hint: a caller that knows what the user gave says what to do."""
        return type(self)(
            self.message, file=self.file, where=self.where, expected=self.expected, found=self.found, hint=hint
        )

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(f"{self.file}" + (f" [{self.where}]" if self.where else ""))
        elif self.where:
            parts.append(f"[{self.where}]")
        parts.append(self.message)
        # a field that is not known is left out: "expected None" would read as a requirement
        seen = [
            f"{name} {value}"
            for name, value in (("expected", self.expected), ("found", self.found))
            if value is not None
        ]
        if seen:
            parts.append(", ".join(seen))
        line = ": ".join(parts[:2]) + ("; " + parts[2] if len(parts) > 2 else "")
        if self.hint:
            line += f". HINT: {self.hint}"
        return line

    def to_json(self) -> dict:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "file": self.file,
            "where": self.where,
            "expected": None if self.expected is None else str(self.expected),
            "found": None if self.found is None else str(self.found),
            "hint": self.hint,
        }


class IncompleteError(TokpackError):
    """A directory without its tokpack.json: a run that has not finished, not corrupt data."""


# EMFILE past the hard limit the gate raises the soft one to (formats.io.gate.more_files)
OPEN_FILES_HINT = "raise the open-files limit (`ulimit -Hn`, then `ulimit -n`), or give a smaller --memory, and rerun"


# errno -> what the user can do about it
OS_HINTS = {
    errno.ELOOP: "a symbolic link points (through others) back to itself: fix or remove the link",
    errno.EROFS: "the filesystem is read-only: write to a writable directory",
    errno.EACCES: "no permission to write there: choose a directory you may write, or fix its permissions",
    errno.EPERM: "the operation is not permitted there (immutable file or directory?): choose another path",
    errno.ENOSPC: "the disk is full: free some space, then rerun the same command to resume",
    errno.EDQUOT: "the disk quota is exhausted: free some space, then rerun the same command to resume",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EMFILE: OPEN_FILES_HINT,
    errno.EFBIG: "the file would pass the file-size limit (`ulimit -f`) or what the filesystem holds: raise the "
    "limit or write to another filesystem, then rerun the same command to resume",
}


class OSFailure(TokpackError):
    """An OSError of the environment (a full disk, a read-only output, a symlink loop...) as one
    line: the file, the system's words and errno name, what to do. The OSError is its
    `__cause__` (`raise os_failure(e) from e`); `to_json()` names its class in `error`, as the
    command line's --json always has."""

    def __init__(self, message: str, *, kind: str = "OSError", **fields):
        self.kind = kind
        super().__init__(message, **fields)

    def to_json(self) -> dict:
        return {**super().to_json(), "error": self.kind}


def os_failure(e: OSError) -> OSFailure:
    """The one line of an OSError, the same from the Python API and the command line."""
    where = e.filename
    if getattr(e, "filename2", None):
        where = f"{where} -> {e.filename2}"
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    message = f"{e.strerror or e}" + (f" ({name})" if name else "")
    return OSFailure(message, kind=type(e).__name__, file=where or None, hint=OS_HINTS.get(e.errno))


def symlink_loop(e: RuntimeError) -> OSError | None:
    """pathlib's resolve() before Python 3.13 says a symlink loop as a RuntimeError: the OSError
    (ELOOP) it is, or None for any other RuntimeError (a bug)."""
    if not str(e).startswith("Symlink loop"):
        return None
    return OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(e).split("'")[1] if "'" in str(e) else None)


def one_line(fn):
    """The Python API's calls (tokpack.packer.api): an OSError (a full disk, a read-only output,
    a symlink loop...) raised as the TokpackError line the command prints for it (os_failure),
    the OSError its `__cause__`; docs/API.md promises a TokpackError wherever the command prints
    one line."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise os_failure(e) from e
        except RuntimeError as e:
            loop = symlink_loop(e)
            if loop is None:
                raise
            raise os_failure(loop) from e

    return run


def task_failed(job_name: str, rank: int, tasks: int, e: OSError) -> TokpackError:
    """An OSError in a task (disk full, permissions...) is the user's to fix, then rerun."""
    hint = "fix the cause and rerun the same command; finished outputs are kept"
    if getattr(e, "errno", None) == errno.EMFILE:
        hint = OPEN_FILES_HINT
    return TokpackError(f"{job_name} task {rank} of {tasks} failed: {e}", file=getattr(e, "filename", None), hint=hint)


class UsageError(TokpackError):
    """Arguments that do not go together, or one missing, found before anything is read: the
    Python API raises it, the command line reports it as its usage error (exit status 2)."""
