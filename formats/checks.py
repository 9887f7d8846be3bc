"""A manifest's checks beyond its field table: header, shard names, an epoch's arithmetic (its sources,
sample counts and hashes), a run's epochs, a node slice's: each problem reported through `add`."""

from __future__ import annotations

import re
from array import array

import numpy as np

from .constants import (
    EPOCH,
    MANIFEST,
    MASK64,
    RUN,
    SLICE,
    SLICE_EPOCH,
    SLICE_KINDS,
    SOURCE,
)
from .errors import TokpackError
from .fields import MANIFEST_FIELDS, PACKING_FIELDS, SHARD_FIELDS, SOURCE_FIELDS, field_problems, type_ok
from .hashes import fingerprint, hash_hex64, name_hash
from .io.paths import as_path, name_problem
from .names import dtype_for_vocab, dtype_from_name, dtype_name
from .packing import rows_padded

EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


def _fields(obj: dict, table: dict, kind: str, mfile: str, add, prefix: str = "") -> int:
    """The fields of `kind` in one of the field tables: presence, type, range. Returns the count."""
    problems = list(field_problems(obj, table, kind))
    for key, expected, found, why in problems:
        add(mfile, f"{prefix}{key}", expected, found, why)
    return len(problems)


def _entries(items: list, table: dict, kind: str, mfile: str, name: str, add) -> int:
    """Each entry of the manifest's list `name` ("shards", "sources") against its field table."""
    n = 0
    for i, s in enumerate(items):
        if isinstance(s, dict):
            n += _fields(s, table, kind, mfile, add, f"{name}[{i}].")
        else:
            add(mfile, f"{name}[{i}]", "an object", repr(s)[:40], f"bad {name[:-1]} entry")
            n += 1
    return n


def epoch_sizes_problem(samples, planned) -> str | None:
    """Why a run's `samples` and `epoch_samples` do not say how many samples each epoch holds
    (None when they do): `samples` > 0, or `samples` 0 with every epoch's size in `epoch_samples`."""
    if not (planned is None or isinstance(planned, list) and all(type_ok(n, int) and n >= 0 for n in planned)):
        return "epoch_samples is not a list of sample counts"
    if not type_ok(samples, int) or samples < 0 or (samples == 0 and not planned):
        return "samples is neither a positive count nor 0 with an epoch_samples list"
    return None


def check_manifest(m: dict, directory, add) -> bool:
    """The manifest-level checks of `m` (read from `directory`); True when its shard entries can
    drive the file checks (every field well-formed and the rows cut evenly)."""
    mfile = str(as_path(directory) / MANIFEST)
    kind = m["kind"]
    if kind == RUN:
        _check_run_manifest(m, mfile, add)
        return False
    shards = m.get("shards") if isinstance(m.get("shards"), list) else []
    if _fields(m, MANIFEST_FIELDS, kind, mfile, add) + _entries(shards, SHARD_FIELDS, kind, mfile, "shards", add):
        return False  # a malformed manifest cannot drive the checks below
    if not _check_header(m, mfile, add):
        return False
    _check_packing(m, kind, mfile, add)
    if kind in SLICE_KINDS:  # a node slice's: its totals here, its rank arithmetic in formats/slices.py
        _check_slice_manifest(m, shards, mfile, add)
        _check_shard_names(shards, mfile, add)
        return m["kind"] == SLICE or all(s["tokens"] == s["samples"] * (m["seq_len"] + 1) for s in shards)
    _sum_of(m, shards, "tokens", mfile, add, "sum over shards", "token count wrong")
    _check_shard_names(shards, mfile, add)
    if kind == SOURCE:
        _sum_of(m, shards, "documents", mfile, add, "sum over shards", "document count wrong")
        fp = fingerprint((s["xxh3_128"] for s in shards), m["dtype"], m["vocab_size"], m["eos_id"])
        if fp != m["fingerprint"]:
            add(
                mfile,
                "fingerprint",
                fp,
                m["fingerprint"],
                "fingerprint disagrees with the shard checksums, dtype, vocab_size, eos_id",
            )
        for i, s in enumerate(shards):
            if s["documents"] > s["tokens"] or (s["tokens"] > 0) != (s["documents"] > 0):
                add(
                    mfile,
                    f"shards[{i}].documents",
                    f"1..{s['tokens']}",
                    s["documents"],
                    "document count impossible for the token count",
                )
        return True
    row = m["seq_len"] + 1
    _check_epoch_manifest(as_path(directory), m, mfile, add, row)
    # seq_len or the counts are wrong: rows cannot be cut, the lines above say why
    return all(s["tokens"] == s["samples"] * row for s in shards)


def _check_packing(m: dict, kind: str, mfile: str, add) -> None:
    """A packed epoch's or run's `packing` object against its field table: what replays its rows
    (method, group size, pad id) and what vouches for them (the row table's checksum, the padding)."""
    if rows_padded(m) and kind in (EPOCH, RUN):
        _fields(m["packing"], PACKING_FIELDS, kind, mfile, add, "packing.")


def _check_header(m: dict, mfile: str, add) -> bool:
    """The invariants every kind's header keeps: the dtype the vocabulary needs, its token size,
    an EOS id inside the vocabulary. False when the dtype cannot even be read."""
    try:
        dtype, rule = dtype_from_name(m["dtype"]), dtype_name(dtype_for_vocab(m["vocab_size"]))
    except TokpackError as e:
        add(mfile, e.where, e.expected, e.found, e.message)
        return False
    if m["dtype"] != rule:
        add(
            mfile,
            "dtype",
            f"{rule} (vocab_size {m['vocab_size']})",
            m["dtype"],
            "dtype label disagrees with the vocabulary size",
        )
    if m["token_size"] != dtype.itemsize:
        add(
            mfile,
            "token_size",
            f"{dtype.itemsize} ({m['dtype']})",
            m["token_size"],
            "token size disagrees with the dtype label",
        )
    if m["eos_id"] >= m["vocab_size"]:
        add(mfile, "eos_id", f"< {m['vocab_size']} (vocab_size)", m["eos_id"], "EOS id out of vocabulary")
    return True


# What a slice's tokens are, as its run says them: a slice of a run holds the run's tokens.
_SLICE_HEADER = ("dtype", "token_size", "vocab_size", "eos_id", "tokenizer", "seq_len")


def _check_slice_manifest(m: dict, shards: list[dict], mfile: str, add) -> None:
    """A slice's (or slice epoch's) header is its run's, and a slice epoch's totals add up: each
    rank file holds whole rows, their tokens sum to the epoch's, and no more rows than the run's epoch."""
    run = m["run"]
    for key in _SLICE_HEADER:
        if run.get(key) != m.get(key):
            add(mfile, key, f"{run.get(key)!r} (the run's, in run.{key})", m.get(key), "slice disagrees with its run")
    if m["kind"] != SLICE_EPOCH:
        return
    row = m["seq_len"] + 1
    for i, s in enumerate(shards):
        _whole_rows(i, s, row, mfile, add, "rank file")
        if s["bytes"] != s["tokens"] * m["token_size"]:
            add(
                mfile,
                f"shards[{i}].bytes",
                f"{s['tokens'] * m['token_size']} (tokens x token_size)",
                s["bytes"],
                "rank file byte count wrong",
            )
    _sum_of(m, shards, "tokens", mfile, add, "sum over rank files", "token count wrong")
    rows = sum(s["samples"] for s in shards)
    if rows > m["samples"]:
        add(
            mfile,
            "shards[].samples",
            f"at most {m['samples']} (the run epoch's samples)",
            rows,
            "rank files hold more samples than the epoch",
        )


def _sum_of(m: dict, entries: list[dict], key: str, mfile: str, add, what: str, message: str) -> None:
    """The manifest's total `key` is its entries' sum (`what`: how the expected value says so)."""
    total = sum(s[key] for s in entries)
    if total != m[key]:
        add(mfile, key, f"{total} ({what})", m[key], message)


def _whole_rows(i: int, s: dict, row: int, mfile: str, add, what: str) -> None:
    """Shard entry `s` (the i-th, a `what`) holds its samples' tokens: rows of `row` tokens."""
    if s["tokens"] != s["samples"] * row:
        add(
            mfile,
            f"shards[{i}].tokens",
            f"{s['samples'] * row} (samples x {row})",
            s["tokens"],
            f"{what} token count wrong",
        )


def _check_shard_names(shards: list[dict], mfile: str, add) -> None:
    """Each shard's `path` a plain `.ds` file name (tokpack.formats.io's containment rule), once each,
    of one width, in sorted order. Two passes over the entries, holding neither their names nor
    a set of them (validate's memory is not the manifest's length, issue 42): the first finds
    the names whose 64-bit hash another shares, the second checks each name, only those
    hashes' names kept to tell a name listed twice."""

    def good(name) -> bool:
        return not (name_problem(name) or name.startswith(".") or not name.endswith(".ds"))

    keys = np.sort(np.array(array("Q", (name_hash(s.get("path")) for s in shards if good(s.get("path"))))))
    shared = {int(k) for k in keys[1:][keys[1:] == keys[:-1]]}
    del keys
    listed, first, widths = set(), [], set()
    in_order, previous = True, None
    for i, s in enumerate(shards):
        name = s.get("path")
        if len(first) < 5:
            first.append(name)
        if isinstance(name, str):
            widths.add(len(name))
        if i and in_order and str(name) < previous:
            in_order = False
        previous = str(name)
        if not good(name):
            why = name_problem(name)
            add(
                mfile,
                f"shards[{i}].path",
                "a plain NNNNN.ds file name",
                repr(name)[:120],
                f"bad shard path ({why})" if why else "bad shard path",
            )
            continue
        if name_hash(name) not in shared:
            continue
        if name in listed:
            add(mfile, f"shards[{i}].path", "unique names", name, "shard listed twice")
        listed.add(name)
    if not in_order or len(widths) > 1:
        add(mfile, "shards", "names of one width, in sorted order", first, "shard names out of order")


def row_bytes_of(manifest: dict) -> int:
    """Bytes of one sample of an epoch, run or slice: `seq_len + 1` tokens of `token_size` bytes."""
    return (int(manifest["seq_len"]) + 1) * int(manifest["token_size"])


def _check_epoch_manifest(path, m: dict, mfile: str, add, row: int) -> None:
    shards = m["shards"]
    per = m["shard_samples"]
    for i, s in enumerate(shards):
        _whole_rows(i, s, row, mfile, add, "shard")
        last = i == len(shards) - 1
        if (not last and s["samples"] != per) or (last and not 1 <= s["samples"] <= per):
            add(
                mfile,
                f"shards[{i}].samples",
                per if not last else f"1..{per}",
                s["samples"],
                "every shard but the last holds exactly shard_samples samples",
            )
    _sum_of(m, shards, "samples", mfile, add, "sum over shards", "sample count wrong")
    multiset = sum(int(s["multiset_hash"], 16) for s in shards) & MASK64
    if hash_hex64(multiset) != m["sample_multiset_hash"]:
        add(
            mfile,
            "sample_multiset_hash",
            f"{hash_hex64(multiset)} (sum of the shards' multiset_hash)",
            m["sample_multiset_hash"],
            "multiset hash disagrees with its shards",
        )
    srcs = m["sources"]
    bad = next((i for i, s in enumerate(srcs) if not isinstance(s, dict)), len(srcs))
    _entries(srcs[: bad + 1], SOURCE_FIELDS, EPOCH, mfile, "sources", add)  # up to the first that is no object
    if bad < len(srcs):
        return  # nothing below can read its entries
    if all(type_ok(s.get("samples"), int) for s in srcs) and sum(s["samples"] for s in srcs) != m["samples"]:
        add(
            mfile,
            "sources[].samples",
            f"{m['samples']} (the epoch's samples)",
            sum(s["samples"] for s in srcs),
            "per-source sample counts do not add up",
        )
    if "fragments" in m and all(type_ok(s.get("fragments"), int) for s in shards):
        _sum_of(m, shards, "fragments", mfile, add, "sum of the shards' fragments", "fragment count wrong")
    if not rows_padded(m):  # a padded epoch has no windows: its plan is proven by --against's replay
        _check_epoch_sources(m, srcs, row, lambda *a: add(mfile, *a))
    else:
        _check_packed_sources(m, srcs, lambda *a: add(mfile, *a))
    dir_epoch = EPOCH_DIR.match(path.name)
    if dir_epoch and int(dir_epoch.group(1)) != m["epoch"]:
        add(mfile, "epoch", f"{int(dir_epoch.group(1))} (from the directory name)", m["epoch"], "epoch number wrong")


def chain_start(epoch: int, samples: int, cursor: int | None = None) -> int:
    """Position in a source's chain of windows of an epoch's first sample from it: where the
    epochs before it left the chain (`cursor`, as a schedule records it), else `epoch * samples`."""
    return epoch * samples if cursor is None else cursor


def pass_span(start: int, samples: int, windows: int) -> tuple[int, int]:
    """(first pass, passes touched) of `samples` windows of a chain from position `start`, with
    `windows` windows a pass; (0, 0) when the source gives the epoch nothing."""
    if not samples:
        return 0, 0
    first = start // windows
    return first, (start + samples - 1) // windows - first + 1


def _check_epoch_sources(m: dict, srcs: list, row: int, add) -> None:
    """The windowing arithmetic of docs/COMMANDS.md ("The shuffle algorithm") for each source entry that
    records it: a corrupted count cannot hide behind a field nobody reads."""
    keys = ("tokens", "windows", "offset", "dropped_tokens", "samples", "first_pass", "passes")
    dropped = 0
    for i, s in enumerate(srcs):
        if not all(type_ok(s.get(k), int) and s[k] >= 0 for k in keys):
            return
        t, w, o, c = s["tokens"], s["windows"], s["offset"], s["samples"]
        if o >= row or (not m.get("jitter", False) and o):
            add(
                f"sources[{i}].offset",
                f"< {row}" + (" and 0 without jitter" if not m.get("jitter") else ""),
                o,
                "window offset impossible",
            )
        if w < 1 or o + w * row > t or t - w * row != s["dropped_tokens"]:
            add(
                f"sources[{i}].windows",
                f"windows x {row} + dropped_tokens == tokens ({t})",
                f"{w} x {row} + {s['dropped_tokens']}",
                "source window counts do not add up",
            )
            return
        first, passes = pass_span(
            chain_start(m["epoch"], c, s["cursor"] if type_ok(s.get("cursor"), int) else None), c, w
        )
        if (s["first_pass"], s["passes"]) != (first, passes):
            add(
                f"sources[{i}].first_pass/passes",
                f"{first}/{passes} (epoch {m['epoch']}, {c} of {w} windows)",
                f"{s['first_pass']}/{s['passes']}",
                "source pass bookkeeping wrong",
            )
        offsets = m.get("jitter_offsets")
        if isinstance(offsets, list) and (i >= len(offsets) or offsets[i] != o):
            add(
                f"jitter_offsets[{i}]",
                o,
                offsets[i] if i < len(offsets) else "no entry",
                "jitter offset disagrees with its source entry",
            )
        dropped += s["dropped_tokens"]
    if srcs and dropped != m["dropped_tokens"]:
        add("dropped_tokens", f"{dropped} (sum over sources)", m["dropped_tokens"], "dropped token count wrong")


def _check_packed_sources(m: dict, srcs: list, add) -> None:
    """What a packed (best-fit) epoch's source entries say without its sources (FORMAT.md,
    "Best-fit epochs"): nothing dropped, no window offset, and the passes its samples can span
    (each pass the epoch touches gives it a row at least). Its other figures are its plan's,
    compared by --against's replay (tokpack.shuffle.packed.packed_plan)."""
    for i, s in enumerate(srcs):
        for key in ("offset", "dropped_tokens"):
            if type_ok(s.get(key), int) and s[key] != 0:
                add(
                    f"sources[{i}].{key}",
                    "0 (a packed epoch cuts no windows)",
                    s[key],
                    "packed epoch source entry impossible",
                )
        offsets = m.get("jitter_offsets")
        if isinstance(offsets, list) and (i >= len(offsets) or offsets[i] != 0):
            found = offsets[i] if i < len(offsets) else "no entry"
            add(f"jitter_offsets[{i}]", 0, found, "jitter offset disagrees with its source entry")
        c, passes, first = s.get("samples"), s.get("passes"), s.get("first_pass")
        if not all(type_ok(v, int) for v in (c, passes, first)):
            continue  # the field lines say why
        if (passes, first) != (0, 0) if c == 0 else not 1 <= passes <= c:
            add(
                f"sources[{i}].passes",
                f"1..{c} (at most a pass a sample)" if c else "0, from pass 0 (the source gives the epoch no sample)",
                f"{passes}, from pass {first}" if not c else passes,
                "source pass bookkeeping wrong",
            )
    if type_ok(m.get("dropped_tokens"), int) and m["dropped_tokens"] != 0:
        add("dropped_tokens", "0 (a packed epoch cuts no windows)", m["dropped_tokens"], "dropped token count wrong")


def _check_run_manifest(m: dict, mfile: str, add) -> None:
    sources = m.get("sources") if isinstance(m.get("sources"), list) else []
    if _fields(m, MANIFEST_FIELDS, RUN, mfile, add) + _entries(sources, SOURCE_FIELDS, RUN, mfile, "sources", add):
        return
    if not _check_header(m, mfile, add):
        return
    _check_packing(m, RUN, mfile, add)
    epochs = m["epochs"]
    if not all(type_ok(e, int) and e >= 0 for e in epochs) or len(set(epochs)) != len(epochs):
        add(mfile, "epochs", "distinct epoch numbers >= 0", epochs[:8], "bad epoch list")
        return
    why = epoch_sizes_problem(m["samples"], m.get("epoch_samples"))
    planned = m.get("epoch_samples") or []
    if why is None and m["samples"] == 0 and any(e >= len(planned) for e in epochs):
        why = f"epoch {max(epochs)} is written but epoch_samples sizes only epochs 0..{len(planned) - 1}"
    if why:
        add(
            mfile,
            "samples/epoch_samples",
            "a size for every epoch the run lists",
            f"samples {m['samples']!r}, epoch_samples {repr(m.get('epoch_samples'))[:60]}",
            f"run manifest does not say how many samples its epochs hold: {why}",
        )


def raise_first(file, where, expected, found, message, **kw):
    raise TokpackError(
        message,
        file=file,
        where=where,
        expected=expected,
        found=found,
        hint=kw.get("hint")
        or "the manifest was edited or damaged; restore it (or rerun the "
        "command that wrote it), and run `tokpack validate` on the directory",
    )
