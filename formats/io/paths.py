"""Local paths and fsspec URLs behind one set of calls: `as_path` gives a pathlib.Path for a
local path and a RemotePath (the pathlib calls tokpack's readers make) for any other URL, and
`name_problem` says why a name is not a plain file name."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Iterator


from ..errors import TokpackError


def is_url(path) -> bool:
    return "://" in str(path)


def local_path(path) -> str | None:
    """The local path a plain path or a `file://` URL names; None for other fsspec URLs."""
    text = str(path)
    if not is_url(text):
        return text
    if text.startswith("file://"):
        from fsspec.implementations.local import make_path_posix

        return make_path_posix(text[len("file://") :])
    return None


def as_path(path) -> "Path | RemotePath":
    """A `pathlib.Path` for a local path (plain os calls, nothing in between), a RemotePath for
    any other fsspec URL."""
    if isinstance(path, (Path, RemotePath)):
        return path
    local = local_path(path)
    return Path(local) if local is not None else RemotePath(str(path))


def url_filesystem(url: str):
    """fsspec's filesystem for `url`; a scheme fsspec does not know, or whose package is not
    installed (s3fs for s3://, gcsfs for gs://), is one line naming the URL."""
    from fsspec.core import url_to_fs

    scheme = url.split("://", 1)[0]
    try:
        return url_to_fs(url)[0]
    except ImportError as e:  # fsspec's own words name the package: "Install s3fs to access S3"
        raise TokpackError(
            "the filesystem for this URL is not installed",
            file=url,
            expected=f"an fsspec backend for {scheme}://",
            found="none installed",
            hint="pip install 'tokpack[s3]' (s3fs)" if scheme in ("s3", "s3a") else f"{e}".rstrip("."),
        ) from None
    except ValueError as e:
        if "protocol not known" not in str(e).lower():
            raise
        raise TokpackError(
            "unknown URL scheme",
            file=url,
            expected="a local path or an fsspec URL (s3://, gs://, file://, ...)",
            found=f"{scheme}://",
            hint="check the URL",
        ) from None


class RemotePath:
    """A file or folder at an fsspec URL (s3://bucket/key...) with the pathlib calls tokpack's
    readers make, so one code path reads local files and objects alike. The filesystem is
    fsspec's (s3fs for s3://: credentials and endpoint from the standard AWS environment)."""

    def __init__(self, url: str, fs=None):
        self.url = url.rstrip("/")  # as given, scheme included: what messages and manifests name
        self.fs = url_filesystem(self.url) if fs is None else fs
        self.key = self.fs._strip_protocol(self.url)  # the path the filesystem knows it by

    def __str__(self) -> str:
        return self.url

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and self.url == other.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other) -> bool:
        return self.url < str(other)

    def __truediv__(self, name) -> "RemotePath":
        return RemotePath(f"{self.url}/{name}", self.fs)

    name = property(lambda self: posixpath.basename(self.url))
    suffix = property(lambda self: posixpath.splitext(self.name)[1])
    stem = property(lambda self: posixpath.splitext(self.name)[0])
    parent = property(lambda self: RemotePath(posixpath.dirname(self.url), self.fs))

    def with_name(self, name: str) -> "RemotePath":
        return self.parent / name

    def with_suffix(self, suffix: str) -> "RemotePath":
        return self.parent / (self.stem + suffix)

    def is_absolute(self) -> bool:
        return True

    def resolve(self) -> "RemotePath":
        return self

    def call(self, method: str, *args, **kw):
        """The filesystem's `method` on this path. Its own errors other than OSError's (botocore's
        for an endpoint that does not answer, expired credentials...) become one line naming
        the URL; not found and denied stay OSErrors, as for a local file."""
        return self._guarded(getattr(self.fs, method), "read from", self.key, *args, **kw)

    def _guarded(self, fn, doing: str, *args, **kw):
        try:
            return fn(*args, **kw)
        except OSError as e:
            if e.filename is None:  # s3fs's errors name no object
                raise type(e)(e.errno, e.strerror or str(e), self.url) from None
            raise
        except Exception as e:  # noqa: BLE001 - whatever the fsspec backend raises
            raise TokpackError(
                f"cannot {doing} the object store",
                file=self.url,
                found=f"{type(e).__name__}: {e}",
                hint="check the URL, the endpoint (AWS_ENDPOINT_URL) and the credentials",
            ) from None

    def upload_from(self, local: str | Path) -> None:
        """This object written whole from a local file. An object store has no rename, but an
        object appears only once its upload is complete (one PUT, or a multipart upload's
        completion), which is what a rename gives a local file."""
        self._guarded(self.fs.put_file, "write to", str(local), self.key)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self._guarded(self.fs.rm_file, "write to", self.key)

    def remove_tree(self) -> None:
        """Every object under this prefix deleted; nothing there is fine."""
        if self.exists():
            self._guarded(self.fs.rm, "write to", self.key, recursive=True)

    def replace(self, other: "RemotePath") -> None:
        """pathlib's rename onto `other`: a copy inside the store (no bytes through this
        machine), then this object deleted."""
        self._guarded(self.fs.mv, "write to", self.key, other.key)

    def exists(self) -> bool:
        return self.call("exists")

    def is_dir(self) -> bool:
        return self.call("isdir")

    def is_file(self) -> bool:
        return self.call("isfile")

    def is_symlink(self) -> bool:
        return False  # a store has no links

    def iterdir(self) -> Iterator["RemotePath"]:
        return (self / posixpath.basename(k.rstrip("/")) for k in self.call("ls", detail=False))

    def stat(self) -> os.stat_result:
        return os.stat_result((0, 0, 0, 0, 0, 0, self.call("size"), 0, 0, 0))

    def read_bytes(self) -> bytes:
        return self.call("cat_file")

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")


def name_problem(name) -> str | None:
    """Why `name` is not a plain file name (None when it is): the string half of the rule,
    which needs no filesystem."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "empty"
    if "\0" in name:
        return "holds a NUL byte"
    if name.startswith("/"):
        return "an absolute path"
    if name in (".", "..") or ".." in name.split("/"):
        return "climbs out with '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    return None
