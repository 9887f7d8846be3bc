"""The directory `tokpack stage` copies: a local path, or any fsspec URL, read through
tokpack.formats.io's one file-access layer (the gate), its manifests parsed and checked."""

from __future__ import annotations

import os
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path
from tokpack.formats.io.gate import contained, open_read, regular_size
from tokpack.formats.constants import MANIFEST, MAX_MANIFEST_BYTES
from tokpack.formats.reading import parse_manifest, require_valid

# Per-worker copy buffer. Large blocks keep a disk or an object store streaming; with a
# handful of workers the memory stays at workers x STAGE_BLOCK.
STAGE_BLOCK = 32 << 20


def join_rel(*parts: str) -> str:
    return "/".join(p for p in parts if p)


SOURCE_HINT = "the source file is truncated or replaced; run `tokpack validate` on it"


class Source:
    """The directory being staged: a local path, or any fsspec URL through tokpack.formats.io's one
    file-access layer."""

    def __init__(self, path: str):
        self.path = str(path)  # as the user gave it
        try:
            self.root = as_path(self.path)  # a Path (plain os calls, kernel copies) or a RemotePath
        except Exception as e:  # noqa: BLE001 - fsspec raises anything (ImportError, ValueError, auth...)
            raise TokpackError(
                "cannot open the source",
                file=self.path,
                expected="a readable local path or fsspec URL",
                found=f"{type(e).__name__}: {e}",
                hint="install the fsspec backend it names (e.g. pip install s3fs)"
                if isinstance(e, ImportError)
                else "check the path or URL, and the credentials of its filesystem",
            ) from None
        self.local_root = str(self.root.absolute()) if isinstance(self.root, Path) else None  # None: remote

    def open(self, rel: str, size: int | None = None):
        """The file `rel` through the gate (inside its folder, a regular file: a FIFO must not
        block the copy; `size`, when its manifest records one)."""
        if self.local_root is not None:
            return open_read(os.path.join(self.local_root, rel), ahead=False, size=size, hint=SOURCE_HINT)
        return open_read(self.root / rel, block=STAGE_BLOCK, size=size, hint=SOURCE_HINT)

    def check(self, rel: str, size: int, what: str = "file", hint: str | None = None) -> None:
        """The file `rel` passes the gate with the size its manifest records (nothing read)."""
        try:
            regular_size(self.root / rel, size=size, what=what, hint=hint or SOURCE_HINT)
        except OSError as e:
            raise self.read_error(rel, e) from None

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a remote file: one ranged GET on an object store."""
        try:
            return (self.root / rel).call("cat_file", start=start, end=end)
        except OSError as e:
            raise self.read_error(rel, e) from None

    def at(self, rel: str) -> str:
        """The file `rel` as errors name it: under the source's path as the user gave it."""
        return f"{self.path.rstrip('/')}/{rel}"

    def size_error(self, rel: str, size: int, found: str) -> TokpackError:
        """The file `rel` holds other than the `size` bytes its manifest records (`found`)."""
        return TokpackError(
            "file size does not match the manifest",
            file=self.at(rel),
            where="size",
            expected=f"{size} bytes",
            found=found,
            hint=SOURCE_HINT,
        )

    def read_error(self, rel: str, e: Exception) -> TokpackError:
        where = self.at(rel)
        if isinstance(e, TokpackError):
            return e
        if isinstance(e, FileNotFoundError):
            return TokpackError(
                "file listed in the manifest is missing",
                file=where,
                hint="restore it, or run `tokpack validate` on the source",
            )
        return TokpackError(
            "cannot read the source", file=where, expected="a readable file", found=f"{type(e).__name__}: {e}"
        )

    def manifest(self, rel_dir: str, kind=None) -> dict:
        rel = join_rel(rel_dir, MANIFEST)
        where = self.at(rel)
        if rel_dir:  # an epoch directory of the run: inside it, not a symlink out
            contained(self.root, rel_dir, manifest=self.root / MANIFEST, where=f"epochs ({rel_dir})", regular=False)
        try:
            with self.open(rel) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)  # parse_manifest refuses more
        except FileNotFoundError:
            if rel_dir:
                raise TokpackError(
                    "incomplete: no tokpack.json",
                    file=where,
                    hint="the run that writes it was interrupted or is still running",
                ) from None
            raise TokpackError(
                "not a tokpack directory, or unreachable: no tokpack.json",
                file=where,
                hint="check the path; stage copies sources, runs and epochs",
            ) from None
        except Exception as e:  # noqa: BLE001 - network/auth errors of any fsspec backend
            raise TokpackError(
                "cannot read the source",
                file=where,
                expected="a readable file",
                found=e.found if isinstance(e, TokpackError) else f"{type(e).__name__}: {e}",
                hint="check the path or URL, and the credentials of its filesystem",
            ) from None
        manifest = parse_manifest(raw, where, kind)
        require_valid(manifest, self.root / rel_dir if rel_dir else self.root)
        return manifest
