"""Errors that reach the user as one line: file, where, expected, found, hint."""

from __future__ import annotations

import errno


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


def task_failed(job_name: str, rank: int, tasks: int, e: OSError) -> TokpackError:
    """An OSError in a task (disk full, permissions...) is the user's to fix, then rerun."""
    hint = "fix the cause and rerun the same command; finished outputs are kept"
    if getattr(e, "errno", None) == errno.EMFILE:
        hint = OPEN_FILES_HINT
    return TokpackError(f"{job_name} task {rank} of {tasks} failed: {e}", file=getattr(e, "filename", None), hint=hint)


class UsageError(TokpackError):
    """Arguments that do not go together, or one missing, found before anything is read: the
    Python API raises it, the command line reports it as its usage error (exit status 2)."""
