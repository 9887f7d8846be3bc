"""Writing and reading manifests: the one serialisation (`canonical_bytes`), the strict bounded
JSON parser every manifest read goes through (`strict_json`, `parse_manifest`, `read_manifest`),
and the partial-stage sidecar's reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .checks import check_manifest, raise_first
from .constants import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INT_RANGE,
    KINDS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    STAGE_SIDECAR,
)
from .errors import IncompleteError, TokpackError
from .fields import STAGE_FIELDS, field_problems, upgrade
from .io.paths import as_path
from .io.writes import fsync_dir, write_bytes_atomic
from .io.gate import read_limited


def canonical_bytes(manifest: dict) -> bytes:
    """The one serialisation of every manifest: a manifest whose bytes differ was edited."""
    return json.dumps(manifest, indent=1, sort_keys=False).encode() + b"\n"


def write_manifest(directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
    """Written last, atomically: its presence is what makes a directory complete (an Output that
    sends its files elsewhere sends it last too: tokpack.formats.outputs)."""
    fsync_dir(directory)  # the shards' renames are on disk before a manifest can claim them
    write_bytes_atomic(Path(directory) / name, canonical_bytes(manifest), fsync=True)
    fsync_dir(directory)


def read_manifest(directory: str | Path, kind: str | tuple[str, ...] | None = None, checked: bool = True) -> dict:
    """Reads a manifest, strictly and bounded (parse_manifest), and with `checked` applies
    check_manifest: its first problem is a TokpackError. Keys of earlier writers come under
    their current names. `checked=False` is for validate, which reports every problem."""
    directory = as_path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise TokpackError("no such directory", file=directory, hint="check the path or URL")
    if not path.exists():
        if isinstance(directory, Path) and not directory.is_dir():  # a file given for a directory: nothing unfinished
            raise TokpackError(
                "not a directory",
                file=directory,
                expected="a tokpack directory",  # validate's words
                found="a file" if directory.is_file() else "neither a file nor a directory",
                hint="pass the directory that holds tokpack.json",
            )
        raise IncompleteError(
            "incomplete: no tokpack.json",
            file=directory,
            hint="the run that writes it was interrupted or is still running; rerun the same command to finish it",
        )
    manifest = upgrade(parse_manifest(read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path, kind))
    if checked:
        require_valid(manifest, directory)
    return manifest


def require_valid(manifest: dict, directory) -> None:
    """check_manifest for a command about to use `manifest`: its first problem is a TokpackError."""
    check_manifest(upgrade(manifest), directory, raise_first)


class _Refused(ValueError):
    """A JSON value the format never holds: (what was found, what was expected)."""


def _constant(name: str):
    raise _Refused(name, "a finite number (JSON has no NaN or Infinity)")


def _check_values(obj) -> None:
    """Every integer in range, every number finite, lists and objects nested at most
    MAX_MANIFEST_DEPTH deep: one walk without recursion (json's own parser does the work of
    reading the numbers, which a per-number hook would slow down 1.6x)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > MAX_MANIFEST_DEPTH:
            raise _Refused("deeper", f"at most {MAX_MANIFEST_DEPTH} levels of lists and objects")
        for c in o.values() if type(o) is dict else o:
            kind = type(c)
            if kind is dict or kind is list:
                stack.append((c, depth + 1))
            elif kind is int and not INT_RANGE[0] <= c < INT_RANGE[1]:
                text = str(c)
                raise _Refused(f"{text[:24]}{'...' if len(text) > 24 else ''}", "an integer in [-2**63, 2**64)")
            elif kind is float and not math.isfinite(c):
                raise _Refused(repr(c), "a finite number")


def strict_json(raw: bytes, path, what: str = "manifest"):
    """JSON a tokpack file holds, read strictly and bounded (docs/COMMANDS.md, "Containment"):
    at most MAX_MANIFEST_BYTES, integers in [-2**63, 2**64), finite numbers only, lists and
    objects nested at most MAX_MANIFEST_DEPTH deep. Anything else is one TokpackError."""
    bad = dict(
        file=path,
        hint=f"this is not a {what} tokpack wrote; restore it from the run that wrote this "
        "directory, or rerun that run",
    )
    if len(raw) > MAX_MANIFEST_BYTES:
        raise TokpackError(
            f"{what} is too large", expected=f"at most {MAX_MANIFEST_BYTES:,} bytes", found=f"{len(raw):,} bytes", **bad
        )
    try:
        value = json.loads(raw, parse_constant=_constant)
        if type(value) is dict or type(value) is list:
            _check_values(value)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokpackError(
            f"{what} is not valid JSON",
            where=f"byte {getattr(e, 'pos', getattr(e, 'start', 0))}",
            expected="a JSON object",
            found=f"{len(raw)} bytes" if raw else "an empty file",
            **bad,
        ) from None
    except _Refused as e:
        raise TokpackError(
            f"{what} holds a value outside the format", expected=e.args[1], found=e.args[0], **bad
        ) from None
    except ValueError:  # an integer of more than 4300 digits, which int() refuses to read
        raise TokpackError(
            f"{what} holds a value outside the format",
            expected="an integer in [-2**63, 2**64)",
            found="an integer of thousands of digits",
            **bad,
        ) from None
    except RecursionError:
        raise TokpackError(
            f"{what} holds a value outside the format",
            expected=f"at most {MAX_MANIFEST_DEPTH} levels of lists and objects",
            found="deeper",
            **bad,
        ) from None
    return value


def parse_manifest(raw: bytes, path: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """A manifest's bytes as written (earlier writers' keys unchanged), read by strict_json, its
    header checked."""
    manifest = strict_json(raw, path)
    if not isinstance(manifest, dict):
        raise TokpackError(
            "manifest is not a JSON object",
            file=path,
            expected="object",
            found=type(manifest).__name__,
            hint="restore it from the run that wrote this directory",
        )
    if manifest.get("format") != FORMAT_NAME:
        raise TokpackError(
            "not a tokpack manifest", file=path, where="format", expected=FORMAT_NAME, found=manifest.get("format")
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise TokpackError(
            "unsupported format version",
            file=path,
            where="version",
            expected=FORMAT_VERSION,
            found=manifest.get("version"),
            hint="use the tokpack release that wrote this directory",
        )
    kinds = ((kind,) if isinstance(kind, str) else kind) or KINDS
    if manifest.get("kind") not in kinds:
        raise TokpackError(
            "wrong kind of tokpack directory",
            file=path,
            where="kind",
            expected=" or ".join(kinds),
            found=manifest.get("kind"),
        )
    return manifest


def partial_stage_absent(run_dir: Path) -> dict[str, str]:
    """Shards a `tokpack stage --ranks` copy left out, from its `tokpack-stage.json` sidecar:
    {shard path: "staged for ranks ... of W, micro-batch m"}."""
    sidecar = as_path(run_dir) / STAGE_SIDECAR
    if not sidecar.exists():
        return {}
    try:
        info = strict_json(
            read_limited(sidecar, MAX_MANIFEST_BYTES, "partial-stage sidecar"), sidecar, "partial-stage sidecar"
        )
        if any(field_problems(info, STAGE_FIELDS, "sidecar")) or any(
            any(field_problems(st, STAGE_FIELDS, "stages[]")) for st in info["stages"]
        ):
            raise ValueError
        stages = "; ".join(
            f"ranks {st['ranks']} of {st['world_size']}, micro-batch {st['micro_batch']}"
            for st in info.get("stages", [])
        )
        return {
            str(as_path(run_dir) / epoch / name): f"staged only for {stages}"
            for epoch, names in info.get("missing_shards", {}).items()
            for name in names
        }
    except (ValueError, KeyError, TypeError, AttributeError, TokpackError):
        raise TokpackError("unreadable partial-stage sidecar", file=sidecar, hint="stage the directory again") from None
