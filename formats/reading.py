"""Writing and reading manifests: the one serialisation (`canonical_bytes`), the strict bounded
JSON parser every manifest read goes through (`strict_json`, `parse_manifest`, `read_manifest`),
validate's reader of a manifest whose shard entries stay text until used (`read_manifest_text`,
`ShardEntries`), and the partial-stage sidecar's reader."""

from __future__ import annotations

import heapq
import json
import math
import re
import shlex
from array import array
from pathlib import Path

from .checks import check_manifest, raise_first
from .constants import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HOLDOUT_DIR,
    INT_RANGE,
    KINDS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    SHARD_NAME_DIGITS,
    SLICE_KINDS,
    SOURCE,
    STAGE_SIDECAR,
    WORK_DIR,
)
from .errors import IncompleteError, TokpackError
from .fields import STAGE_FIELDS, field_problems, upgrade
from .io.paths import as_path
from .io.writes import TMP_MARK, fsync_dir, write_bytes_atomic
from .io.gate import read_limited
from .names import EPOCH_DIR_PREFIX


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
        if not directory.is_dir():  # a file (or an object) given for a directory: nothing unfinished
            raise TokpackError(
                "not a directory",
                file=directory,
                expected="a tokpack directory",  # validate's words
                found="a file" if directory.is_file() else "neither a file nor a directory",
                hint="pass the directory that holds tokpack.json",
            )
        if isinstance(directory, Path) and not written_by_tokpack(directory):
            # another tool's data, or an empty folder: no command of tokpack's to rerun here
            raise IncompleteError(
                "not a tokpack directory: no tokpack.json",
                file=directory,
                expected="a directory tokpack wrote (a packed source, a run, an epoch or a node slice)",
                found=_what_is_there(directory),
                hint="give the directory tokpack wrote; other tokenized data (Megatron .bin/.idx, a Hugging Face "
                f"dataset, JSONL, Parquet) is packed first: `tokpack pack {shlex.quote(str(directory))} -o PACKED`",
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


# What a tokpack command leaves in a folder before its tokpack.json: a shard's or rank file's
# files, a temporary name, its lock, its work folder, an epoch folder, a sidecar.
# Its names are the format's own (constants.py, names.py, slices.py' rank files); "tokpack." and
# "tokpack-" begin the manifest, the lock and the sidecars.
_TRACE = re.compile(
    rf"^(\d{{{SHARD_NAME_DIGITS},}}\.ds|rank-\d+\.ds|{re.escape(EPOCH_DIR_PREFIX)}\d+$|{re.escape(HOLDOUT_DIR)}$|tokpack[.-])"
    rf"|{re.escape(TMP_MARK)}|^{re.escape(WORK_DIR)}$"
)


def written_by_tokpack(directory: Path) -> bool:
    """Whether a folder without tokpack.json holds what a tokpack command writes before it (or
    is an epoch folder of a run being written): an unfinished directory, which the command's
    rerun finishes, not another tool's data or an empty folder. Unreadable: assume it is."""
    try:
        beside = (p for p in directory.parent.iterdir() if p.name != directory.name)
        if _TRACE.match(directory.name) and any(_TRACE.match(p.name) for p in beside):
            return True  # a run's epoch-NNNNN/ or holdout/ just created, still empty
        return any(_TRACE.search(p.name) for p in directory.iterdir())
    except OSError:
        return True


def _what_is_there(directory: Path) -> str:
    """The folder's entries in a few words: their count and the first three names (a dataset's
    folder may hold millions: counted as listed, never all held)."""
    count, first = 0, []
    for p in directory.iterdir():
        count += 1
        first = heapq.nsmallest(3, [*first, p.name])
    if not count:
        return "an empty folder"
    return f"{count:,} other file{'s' * (count != 1)} ({', '.join(first)}{', ...' * (count > 3)})"


def require_valid(manifest: dict, directory) -> None:
    """check_manifest for a command about to use `manifest`: its first problem is a TokpackError."""
    check_manifest(upgrade(manifest), directory, raise_first)


class _Refused(ValueError):
    """A JSON value the format never holds: (what was found, what was expected)."""


def _constant(name: str):
    raise _Refused(name, "a finite number (JSON has no NaN or Infinity)")


def _check_values(obj, depth: int = 1) -> None:
    """Every integer in range, every number finite, lists and objects nested at most
    MAX_MANIFEST_DEPTH deep (`obj` is `depth` deep): one walk without recursion (json's own parser
    does the work of reading the numbers, which a per-number hook would slow down 1.6x)."""
    stack = [(obj, depth)]
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
        found, expected = e.args
    except ValueError:  # an integer of more than 4300 digits, which int() refuses to read
        found, expected = "an integer of thousands of digits", "an integer in [-2**63, 2**64)"
    except RecursionError:
        found, expected = "deeper", f"at most {MAX_MANIFEST_DEPTH} levels of lists and objects"
    else:
        return value
    raise TokpackError(f"{what} holds a value outside the format", expected=expected, found=found, **bad)


def parse_manifest(raw: bytes, path: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """A manifest's bytes as written (earlier writers' keys unchanged), read by strict_json, its
    header checked."""
    return _checked_header(strict_json(raw, path), path, kind)


def _checked_header(manifest, path, kind) -> dict:
    """parse_manifest's checks of a parsed manifest: an object of tokpack's format, version and kind."""
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
            "not a tokpack manifest",
            file=path,
            where="format",
            expected=FORMAT_NAME,
            found=repr(manifest.get("format"))[:60],
            hint="this tokpack.json was not written by tokpack: give a directory tokpack wrote, or restore its "
            "manifest from the run that wrote it",
        )
    if type(manifest.get("version")) is not int or manifest["version"] != FORMAT_VERSION:
        version = manifest.get("version")
        raise TokpackError(
            "unsupported format version",
            file=path,
            where="version",
            expected=FORMAT_VERSION,
            found=version if type(version) is int else repr(version)[:60],  # "1" is not 1
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
            hint=_kind_hint(manifest, kinds),
        )
    return manifest


def _kind_hint(manifest: dict, kinds) -> str:
    """What to give a command instead of a tokpack directory of another kind (a caller that knows
    better, as shuffle does of its SOURCEs, says so in its own words)."""
    found = manifest.get("kind")
    if found in SLICE_KINDS:
        run = manifest.get("source")
        run = f" ({run})" if isinstance(run, str) and len(run) < 4096 else ""
        return (
            "a node slice holds some ranks' rows only: read it with `tokpack read` and check it with "
            f"`tokpack validate`; give other commands the run it was staged from{run}"
        )
    if found in (*KINDS, *SLICE_KINDS):
        return f"give a {' or '.join(kinds)} directory: this one is a tokpack {found}"
    return "the manifest was edited or belongs elsewhere; restore it or rerun the command that wrote it"


# ------------------------------------------------------------------ a manifest read by validate
#
# validate of a 1.5M-entry manifest (20 MB) peaked at 1.16 GB (issue 42, item 7): every entry a
# dict, twice (the canonical-bytes check parsed it again), plus what the checks built of them.
# read_manifest_text keeps the manifest's text and, per shard entry, where it starts and ends:
# 16 bytes an entry; each pass over `shards` parses one entry at a time from the text.

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder(parse_constant=_constant)


class _Irregular(Exception):
    """Text the entry-by-entry reader does not follow: the whole-manifest parser reads it (and
    words its error, if any, as every command does)."""


class ShardEntries(list):
    """A manifest's `shards`, read from its text entry by entry, each time it is iterated or
    indexed: the same dicts json.loads gives, never all held. It is a list for the field checks
    (a JSON array), but holds no items of its own: anything that reads a list's storage directly
    (json.dumps, numpy, `==` on two lists) must be given `list(entries)` instead."""

    def __init__(self, text: str, starts: array, ends: array):
        super().__init__()
        self._text, self._starts, self._ends = text, starts, ends

    def _entry(self, i: int):
        return _DECODER.scan_once(self._text, self._starts[i])[0]  # read once already: no error

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self):
        scan, text = _DECODER.scan_once, self._text
        for start in self._starts:
            yield scan(text, start)[0]

    def __reversed__(self):
        return map(self._entry, reversed(range(len(self._starts))))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._entry(k) for k in range(*i.indices(len(self._starts)))]
        n = len(self._starts)
        if not -n <= i < n:
            raise IndexError("list index out of range")
        return self._entry(i % n)

    def __contains__(self, value) -> bool:
        return any(e == value for e in self)

    def __eq__(self, other) -> bool:
        return list(self) == (list(other) if isinstance(other, ShardEntries) else other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return repr(list(self))

    def __add__(self, other):
        return list(self) + list(other)

    def __reduce__(self):  # a copy or a pickle is the plain list
        return (list, (list(self),))

    def copy(self) -> list:
        return list(self)

    def index(self, value, *args) -> int:
        return list(self).index(value, *args)

    def count(self, value) -> int:
        return sum(e == value for e in self)

    def _read_only(self, *args, **kw):
        raise TypeError("a manifest's shard entries read from its text are read-only: use list(entries)")

    append = extend = insert = pop = remove = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only

    def canonical(self, start: int, chunk: int = 4096) -> bool:
        """The entries' text is canonical_bytes' (entries 2 deep, as json.dumps(indent=1) writes
        them), the first starting at `start`: compared `chunk` entries at a time, each chunk
        written as a list of its own (1 deep), each line then indented once more."""
        text, starts, ends = self._text, self._starts, self._ends
        if not starts or starts[0] != start:
            return False
        for lo in range(0, len(starts), chunk):
            hi = min(lo + chunk, len(starts))
            want = json.dumps([self._entry(i) for i in range(lo, hi)], indent=1).replace("\n", "\n ")
            want = want[len("[\n  ") : -len("\n ]")]  # the entries and the ",\n  " between them
            if ends[hi - 1] - starts[lo] != len(want) or not text.startswith(want, starts[lo]):
                return False
            if hi < len(starts) and text[ends[hi - 1] : starts[hi]] != ",\n  ":
                return False
        return True


def _space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def _value(text: str, i: int, depth: int):
    """The JSON value at `i` (its end too), checked as strict_json checks a value `depth` deep."""
    try:
        value, end = _DECODER.scan_once(text, i)  # raw_decode's own call, less its frame
        _check_values(value if type(value) in (dict, list) else (value,), depth)  # a scalar: as a list's item
    except (StopIteration, ValueError, RecursionError):  # StopIteration: no value at `i`; _Refused is a ValueError
        raise _Irregular from None
    return value, end


_BETWEEN = ",\n  "  # between two entries, as canonical_bytes writes them: the common case first


def _shard_entries(text: str, i: int) -> tuple[ShardEntries, int]:
    """The array at `i` (the manifest's `shards`, 2 deep): each entry's span, each checked."""
    starts, ends = array("q"), array("q")
    i = _space(text, i + 1)
    if text.startswith("]", i):
        return ShardEntries(text, starts, ends), i + 1
    while True:
        _, end = _value(text, i, 3)
        starts.append(i)
        ends.append(end)
        if text.startswith(_BETWEEN, end) and not text.startswith((" ", "\t", "\n", "\r"), end + 4):
            i = end + 4
            continue
        i = _space(text, end)
        if text.startswith(",", i):
            i = _space(text, i + 1)
        elif text.startswith("]", i):
            return ShardEntries(text, starts, ends), i + 1
        else:
            raise _Irregular


def _parse_text(text: str) -> tuple[dict, int | None]:
    """The manifest object of `text` with its `shards` as ShardEntries, and where in the text the
    first entry starts (None: no entries). _Irregular for anything else."""
    obj: dict = {}
    first = None
    i = _space(text, 0)
    if not text.startswith("{", i):
        raise _Irregular
    i = _space(text, i + 1)
    if text.startswith("}", i):
        i += 1
    else:
        while True:
            if not text.startswith('"', i):
                raise _Irregular
            try:
                key, i = json.decoder.scanstring(text, i + 1, True)
            except ValueError:
                raise _Irregular from None
            i = _space(text, i)
            if not text.startswith(":", i):
                raise _Irregular
            i = _space(text, i + 1)
            if key == "shards" and text.startswith("[", i):
                value, i = _shard_entries(text, i)
                first = value._starts[0] if value else None
            else:
                value, i = _value(text, i, 2)
            obj[key] = value
            i = _space(text, i)
            if text.startswith(",", i):
                i = _space(text, i + 1)
            elif text.startswith("}", i):
                i += 1
                break
            else:
                raise _Irregular
    if _space(text, i) != len(text):
        raise _Irregular
    shards = obj.get("shards")
    if isinstance(shards, ShardEntries) and not shards:
        obj["shards"] = []  # an empty array is the plain one
    return obj, first if isinstance(obj.get("shards"), ShardEntries) else None


def _canonical(raw: bytes, text: str, m: dict, first: int | None) -> bool:
    """raw == canonical_bytes(m), `m` as parsed (before upgrade), its entries compared one by one."""
    shards = m.get("shards")
    if not isinstance(shards, ShardEntries):
        return raw == canonical_bytes(m)
    if not raw.isascii():  # canonical bytes escape every other character
        return False
    mark = "\x00tokpack: the shard entries\x00"  # a string no manifest holds: where the entries go
    head = json.dumps({**m, "shards": [mark]}, indent=1) + "\n"
    cut = head.index(json.dumps(mark))
    before, after = head[:cut], head[cut + len(json.dumps(mark)) :]
    last = shards._ends[-1]
    return (
        text.startswith(before)
        and first == len(before)
        and len(text) - last == len(after)
        and text.endswith(after)
        and shards.canonical(len(before))
    )


def read_manifest_text(
    directory: str | Path, kind: str | tuple[str, ...] | None = None, canonical: bool = True
) -> tuple[dict, bool | None, int]:
    """validate's read_manifest(directory, kind, checked=False): (the manifest, upgraded, with its
    `shards` as ShardEntries when it has any; whether its bytes are canonical_bytes' (None when
    not `canonical`: not asked); its size). Anything but a plain manifest object (bad JSON, a
    value outside the format) is read by read_manifest, so its error is the one every command gives."""
    directory = as_path(directory)
    path = directory / MANIFEST
    if not path.exists():
        read_manifest(directory, kind, checked=False)  # raises its own error: no such directory, ...
    raw = read_limited(path, MAX_MANIFEST_BYTES, "manifest")
    try:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _Irregular
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        parsed, first = _parse_text(text)
    except (_Irregular, UnicodeDecodeError):
        manifest = parse_manifest(raw, path, kind)  # raises strict_json's or the header's own error
        return upgrade(manifest), raw == canonical_bytes(manifest) if canonical else None, len(raw)
    _checked_header(parsed, path, kind)
    return upgrade(parsed), _canonical(raw, text, parsed, first) if canonical else None, len(raw)


def read_source_manifest(directory: str | Path) -> dict:
    """read_manifest(directory, SOURCE), checked, its `shards` as ShardEntries: what a command
    holds of a source it reads (PackedSource) is its manifest's text, not a dict per shard entry
    (a 50,000-entry source held 38 MB of them, a 1.5M-entry one over 1 GB)."""
    manifest = read_manifest_text(directory, SOURCE, canonical=False)[0]
    require_valid(manifest, directory)
    return manifest


def manifest_kind(directory) -> str | None:
    """The `kind` of the JSON object in `directory`'s manifest (None: unreadable, or not an
    object), read as read_manifest_text reads it: not one dict per shard entry."""
    path = as_path(directory) / MANIFEST
    try:
        raw = read_limited(path, MAX_MANIFEST_BYTES, "manifest")
        try:
            return _parse_text(raw.decode(json.detect_encoding(raw), "surrogatepass"))[0].get("kind")
        except (_Irregular, UnicodeDecodeError):
            return strict_json(raw, path).get("kind")
    except (TokpackError, OSError, AttributeError):
        return None


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
