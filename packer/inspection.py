"""`tokpack inspect`: what a directory holds, and what the shuffle did to batch diversity.

Batch diversity is measured on the first K global batches of B samples:
- distinct documents per batch, and
- the largest share of a batch's tokens that comes from one document,
each BEFORE the shuffle (window i = tokens [i(L+1), (i+1)(L+1)) of the sources read in
order, i.e. what a sequential loader would feed) and AFTER it (the epoch's order).

After the shuffle, each epoch sample is mapped back to its source window through the
shuffle plan (tokpack.shuffle.plan.EpochPlan.locate), so a document cut across several samples is
still one document. The mapping is checked against the epoch's bytes; if the sources are
unreachable or do not match, inspect falls back to EOS-delimited fragments inside the
samples (then a document split across samples counts once per sample), and says so
("document_identity": "plan" or "eos"). The measure is tokpack.packer.diversity's.

Document lengths come from the sources' `.ds.index` files, streamed in blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path, local_path
from tokpack.formats.io.gate import contained
from tokpack.formats.constants import EPOCH, HOLDOUT_DIR, MANIFEST, NODES_SIDECAR, RUN, SOURCE, STAGE_SIDECAR, WORK_DIR
from tokpack.formats.guard import lock_holder
from tokpack.formats.names import EPOCH_DIR_PATTERN
from tokpack.formats.slices import contained_epoch_dir
from tokpack.formats.numbering import shuffle_command
from tokpack.formats.reading import manifest_kind, partial_stage_absent, read_manifest, read_source_manifest
from tokpack.formats.packing import holdout_recorded
from tokpack.formats.shards import PackedSource, tokens_on_nodes
from tokpack.formats.units import counted
from tokpack.loader.reader import SampleReader
from tokpack.packer.shared import Result, optional_field

from .diversity import batch_diversity
from .doc_lengths import LengthHistogram, document_lengths

DEFAULT_BATCH_SIZE = 64


# --------------------------------------------------------------------------- sources


def _open_source(entry: dict, near: Path) -> PackedSource | None:
    """The packed source an epoch names, if reachable: its recorded path (absolute, or
    relative to the working directory or to the run), checked by fingerprint."""
    path = as_path(str(entry.get("path", "")))
    candidates = [path] if path.is_absolute() else [path, near / path, near.parent / path]
    if entry.get("name"):
        candidates.append(near.parent / str(entry["name"]))
    for c in candidates:
        try:
            src = PackedSource.open(c)
        except (TokpackError, OSError, ValueError):  # ValueError: a NUL byte in the recorded path
            continue
        if not entry.get("fingerprint") or src.fingerprint == entry["fingerprint"]:
            return src
    return None


# ---------------------------------------------------------------------------- inspect


def _share_text(r: dict) -> str:
    """'name 75.0% (300 samples, chain pass 0-1)': the passes of the source's permutation chain it used."""
    first, passes = r.get("first_pass"), r.get("passes") or 1
    span = f"{first}" if first is None or passes <= 1 else f"{first}-{first + passes - 1}"
    return f"{r['name']} {r['share']:.1%} ({r['samples']:,} samples, chain pass {span})"


@dataclass
class InspectResult(Result):
    """What `inspect --json` prints."""

    kind: str  # source, run or epoch
    path: str
    batch_size: int
    unreachable_sources: list[str] | None = optional_field()  # named by the epochs, not found: no document statistics
    unfinished: dict | None = optional_field()  # a run's epochs (holdout) begun, not committed; the command to finish
    totals: dict = field(default_factory=dict)
    epochs: list[dict] | None = optional_field()  # each epoch's samples, sources' shares and packing figures
    packing: dict | None = optional_field()  # a run's or epoch's: method, padding, documents cut (over its epochs)
    holdout: dict | None = optional_field()  # a run made with --holdout: RUN/holdout/'s path, samples, packing
    stages: list[dict] | None = optional_field()  # a scheduled run: each stage's epochs, samples and mixture
    document_lengths: dict | None = optional_field()
    batch_diversity: dict | None = optional_field()  # before and after the shuffle
    documents_per_row: dict | None = optional_field()  # the chosen epoch's largest row: max_documents to pass
    plot: str | None = optional_field()
    split: str | None = optional_field()  # "holdout": RUN/holdout/, the held-out split (an epoch directory, no epoch)


def _plot_path(plot) -> str | None:
    """`plot` checked before any work: the local file matplotlib will write, in an existing folder."""
    if plot is None:
        return None
    if local_path(plot) is None:  # matplotlib writes local files: the analysis would be lost at the end
        raise TokpackError(
            "--plot writes a local file",
            file=str(plot),
            where="--plot",
            expected="a local path (FILE.png)",
            found="a URL",
            hint="write the figure locally, then copy it to the store (e.g. aws s3 cp)",
        )
    plot = local_path(plot)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TokpackError(
            "--plot needs matplotlib, which is not installed",
            where="--plot",
            hint="pip install matplotlib (or pip install 'tokpack[plot]')",
        ) from None
    if not Path(plot).absolute().parent.is_dir():  # was savefig's FileNotFoundError, after the whole report
        raise TokpackError(
            "the plot's folder does not exist",
            file=plot,
            where="--plot",
            expected="a file in an existing folder",
            hint="create the folder first, or choose another --plot path",
        )
    return plot


def inspect(directory, *, batch_size, batches, plot, seq_len, epoch, memory, documents_per_row) -> InspectResult:
    """tokpack.packer.api.inspect, its arguments checked and its defaults given there.
    Report on a source, a run or an epoch (`documents_per_row`: also the largest document
    count of a row of the chosen epoch, one pass over its tokens). For a run, the
    batch analysis uses `epoch` (default: the first listed); a packed source alone needs
    `seq_len` for it. `memory`: the budget (bytes) of the epoch's plan and of a best-fit row
    table [default: tokpack.shuffle.packed.DEFAULT_PLAN_MEMORY]."""
    directory = as_path(directory)
    plot = _plot_path(plot)  # checked before any work
    # a source's shard entries read from its text as used, as PackedSource reads them: not a dict each
    manifest = read_source_manifest(directory) if manifest_kind(directory) == SOURCE else read_manifest(directory)
    kind = manifest["kind"]
    if seq_len is not None and kind != SOURCE and seq_len != manifest.get("seq_len"):  # was silently ignored
        raise TokpackError(
            f"--seq-len is for a packed source: a {kind}'s samples have its seq_len",
            file=directory,
            where="--seq-len",
            expected=f"none, or {manifest.get('seq_len')}",
            found=seq_len,
            hint=f"drop --seq-len: the batch analysis of a {kind} uses its own",
        )
    for flag, given in (("--epoch", epoch is not None), ("--documents-per-row", bool(documents_per_row))):
        if given and kind == SOURCE:  # a source has no epochs nor rows: was silently ignored
            raise TokpackError(
                f"{flag} is for a run or an epoch: a packed source has no epochs, nor rows",
                file=directory,
                where=flag,
                expected=f"no {flag} with a packed source",
                found=epoch if flag == "--epoch" else "given",
                hint=f"drop {flag}, or inspect the run shuffled from the source",
            )
    batch = batch_size or DEFAULT_BATCH_SIZE
    report: dict = {"kind": kind, "path": str(directory), "batch_size": batch}
    if holdout_recorded(manifest)[1]:  # RUN/holdout/ (its manifest says so): an epoch directory, no epoch of the run
        report["split"] = "holdout"

    epochs = _epochs_of(directory, manifest)
    chosen = next((x for x in epochs if epoch is None or x[0] == epoch), None)
    if epochs and chosen is None:
        listed = [e for e, _, _ in epochs]
        raise TokpackError(
            "epoch not in this run" if kind == RUN else "this epoch directory holds another epoch",
            file=directory,
            where="--epoch",
            expected=listed,
            found=epoch,
            hint=f"give one of {listed}, or drop --epoch"
            + (f"; write epoch {epoch} with `{shuffle_command(manifest, directory, epoch)}`" if kind == RUN else ""),
        )
    if kind == RUN and (unfinished := _unfinished(directory, manifest)) is not None:
        report["unfinished"] = unfinished
    names, sources = _sources_of(directory, manifest, epochs, report)
    report["totals"] = _totals(manifest, epochs, sources)
    if epochs:
        from tokpack.shuffle.packings import shown_of_epochs

        report["epochs"] = _epoch_shares(epochs)
        report["packing"] = shown_of_epochs([m for _, _, m in epochs])
    held_dir = None  # the run's held-out split, inside the run as its epochs are
    if kind == RUN:
        where = f"epochs ({HOLDOUT_DIR})"
        held_dir = contained(directory, HOLDOUT_DIR, manifest=directory / MANIFEST, where=where, regular=False)
    if held_dir is not None and (held_dir / MANIFEST).is_file():
        from tokpack.shuffle.packings import shown

        held = read_manifest(held_dir, EPOCH)
        report["holdout"] = {
            "path": str(held_dir),
            "samples": int(held["samples"]),
            "sources": [
                {"name": e.get("name"), "held_documents": e.get("held_documents")} for e in held.get("sources") or []
            ],
            "packing": shown(held),
        }
    if kind == RUN and manifest.get("schedule"):
        report["stages"] = _stages(manifest)

    per_source: list[dict] = []
    hist = document_lengths(sources, per_source=per_source) if sources else None
    if hist is not None:
        report["document_lengths"] = {
            **hist.report(),
            "sources": [{"name": n, **d} for n, d in zip(names, per_source)],
        }

    L = report["totals"]["seq_len"] if kind != SOURCE else seq_len
    away = _tokens_away(chosen)
    if L is not None:
        diversity = batch_diversity(sources, None if away else chosen, int(L), batch, batches, memory)
        if away:  # the epoch's figures above are its manifests'; its samples are not here to analyse
            diversity["note"] = f"{away}: no batches after the shuffle analysed"
        if diversity:
            report["batch_diversity"] = diversity
    if documents_per_row and away:
        raise TokpackError(
            "--documents-per-row reads the epoch's tokens, which are not in this directory",
            file=chosen[1],
            where="--documents-per-row",
            expected="the epoch's token files",
            found=away,
            hint=_counted_elsewhere(chosen[1], chosen[2]),
        )
    if documents_per_row and chosen is not None and chosen[2].get("eos_id") is not None:
        # One pass over the epoch's rows (asked for: O(the epoch's bytes), where the rest of
        # inspect reads manifests and a few batches): the smallest max_documents it takes.
        most, g = SampleReader.from_manifests([(chosen[1], chosen[2])]).most_documents()
        report["documents_per_row"] = {"epoch": chosen[0], "max": most, "sample": g}
    if plot is not None:
        write_plot(plot, report, hist)
        report["plot"] = str(plot)
    return InspectResult(**report)


def report_lines(r: InspectResult) -> list[str]:
    """The report for humans."""
    lines = [
        f"{r.kind} {r.path}"
        if r.split is None
        else f"held-out split {r.path} (RUN/holdout/: the documents `shuffle --holdout` sets aside from every "
        "training epoch; read it as an epoch)"
    ]
    if r.unfinished is not None:
        lines.append(_unfinished_line(r.unfinished))
    if r.unreachable_sources:
        lines.append(f"  sources not reachable (no document statistics): {', '.join(r.unreachable_sources)}")
    t = r.totals
    if r.kind == SOURCE:
        lines.append(f"  tokens {t['tokens']:,}  documents {t['documents']:,}  shards {t['shards']}")
    else:
        lines.append(
            ("" if r.split else f"  epochs {t['epochs']}")
            + f"  samples {t['samples']:,}  tokens {t['tokens']:,}  shards {t['shards']}  seq_len {t['seq_len']}"
        )
        if "source_tokens" in t:
            documents = counted(t["source_documents"], "document")
            lines.append(f"  sources: {t['sources']}, {t['source_tokens']:,} tokens, {documents}")
    if r.packing is not None:
        from tokpack.shuffle.packings import shown_line

        over = f" (over {len(r.epochs)} epochs)" if len(r.epochs or []) > 1 else ""
        lines.append(f"  packing: {shown_line(r.packing)}{over}")
    if r.holdout is not None:
        h = r.holdout
        lines.append(
            f"  holdout: {h['samples']:,} samples in {h['path']} (read it as an epoch), held out: "
            + ", ".join(f"{s['name']} {s['held_documents']:,} documents" for s in h["sources"])
        )
    for st in r.stages or []:
        mixture = ", ".join(f"{s['name']} weight {s['weight']} ({s['samples']:,} samples)" for s in st["sources"])
        lines.append(
            f"  stage {st['stage']}: epochs {st['epochs'][0]}-{st['epochs'][-1]} ({len(st['written'])} "
            f"written), {st['samples']:,} samples; {mixture}"
        )
    for e in r.epochs or []:
        used = [s for s in e["sources"] if s["samples"] or s["weight"] is not None]  # a scheduled run lists all
        pk, padded = e["packing"], ""
        if pk["padding_tokens"] or "max_documents_per_row" in pk:  # a padded epoch's own figures
            padded = f"; padding {pk['padding_tokens']:,} tokens ({pk['padding_percent']:g}%)"
            if "documents_cut" in pk:
                padded += f", {pk['documents_cut']:,} documents cut"
            if "max_documents_per_row" in pk:
                padded += f", at most {pk['max_documents_per_row']:,} documents per row"
        lines.append(
            f"  {_epoch_name(r.split, e['epoch'])}: {e['samples']:,} samples; "
            + ", ".join(_share_text(s) for s in used)
            + padded
        )
    dl = r.document_lengths
    if dl is not None:
        lines.append(
            f"  document length: mean {dl.get('mean')}  "
            + "  ".join(f"{k} {v:g}" for k, v in dl.get("quantiles", {}).items())
            + f"  max {dl.get('max')}"
            + (
                f"  (sampled: {dl['documents']:,} of {dl['sampled_from_documents']:,} documents)"
                if "sampled_from_documents" in dl
                else ""
            )
        )
        lines += _source_length_lines(dl.get("sources") or [])
    if r.batch_diversity is None and (r.kind == SOURCE or t.get("seq_len") is None):
        lines.append("  batch diversity: pass --seq-len to see it for a packed source")
    elif r.batch_diversity:
        lines += _diversity_lines(r.batch_diversity, r.batch_size, r.split)
    recorded = (r.packing or {}).get("max_documents_per_row")
    if r.documents_per_row is None and r.kind != SOURCE and "after" not in (r.batch_diversity or {}):
        # the epoch's tokens are not here (the note above says why): --documents-per-row cannot read them
        if recorded is not None:
            lines.append(
                f"  documents per row: at most {recorded}, as the epochs' manifests record; fixed shapes: "
                f"TokpackDataset(..., max_documents={recorded})"
            )
    elif r.documents_per_row is None and r.kind != SOURCE:
        lines.append(
            "  documents per row: --documents-per-row finds the max_documents to train with (reads the epoch once)"
        )
    if r.documents_per_row is not None:
        d = r.documents_per_row
        lines.append(
            f"  documents per row ({_epoch_name(r.split, d['epoch'])}): at most {d['max']} (first at sample {d['sample']}), "
            f"padding counted as one; fixed shapes: TokpackDataset(..., max_documents={d['max']})"
        )
    if r.plot is not None:
        lines.append(f"  plot written to {r.plot}")
    return lines


def _epoch_name(split: str | None, epoch) -> str:
    """How a line names an epoch of the report: RUN/holdout/ is the held-out split, not "epoch 0"."""
    return "held-out split" if split == "holdout" else f"epoch {epoch}"


# What a shuffle leaves of an epoch (or of RUN/holdout/) it began and did not commit: the epoch's
# folder, or its scratch in the work folder (named by run_setup: the epoch's folder, "-", a key).
_EPOCH_FOLDER = re.compile(EPOCH_DIR_PATTERN)
_SCRATCH = re.compile(rf"(?:{EPOCH_DIR_PATTERN}|{re.escape(HOLDOUT_DIR)})-[0-9a-f]+")


def _unfinished(directory, manifest: dict) -> dict | None:
    """The epochs of a run that a shuffle began and did not commit (a folder or scratch of an
    epoch the run does not list), whether RUN/holdout/ is unfinished, and how to finish them: the
    command its lock names (a killed shuffle's, or the one still writing), else `--like`. None when
    there are none, or the run is not a local folder (its listing is not read)."""
    local = local_path(directory)
    if local is None:
        return None
    local, listed = Path(local), {int(e) for e in manifest.get("epochs") or []}
    epochs, holdout = set(), (local / HOLDOUT_DIR).is_dir() and not (local / HOLDOUT_DIR / MANIFEST).exists()
    try:
        names = [p.name for p in local.iterdir() if p.is_dir()]
        names += [p.name for p in (local / WORK_DIR).iterdir()] if (local / WORK_DIR).is_dir() else []
    except OSError:
        return None
    for name in names:
        folder, scratch = _EPOCH_FOLDER.fullmatch(name), _SCRATCH.fullmatch(name)
        if folder or scratch and scratch.group(1):
            epochs.add(int((folder or scratch).group(1)))
        holdout = holdout or bool(scratch and not scratch.group(1))
    epochs -= listed
    if not epochs and not holdout:
        return None
    held = lock_holder(local)
    holder, running = held if held is not None else ({}, False)
    command = str(holder.get("command") or "")
    # the killed command line is the one to rerun; the Python API's entry point is no command
    on_nodes = (local / NODES_SIDECAR).is_file()  # a --to-nodes run: rerun as launched; --like writes no slices
    if not running and (not command.startswith("tokpack shuffle ") or command.endswith("(Python API)")):
        command = "" if on_nodes else "; ".join(shuffle_command(manifest, directory, e) for e in sorted(epochs))
    return {
        "epochs": sorted(epochs),
        "holdout": holdout,
        "command": command or None,
        "running": running,
        "to_nodes": on_nodes,
    }


def _unfinished_line(u: dict) -> str:
    what = ", ".join([f"epoch {e}" for e in u["epochs"]] + ["the held-out split"] * u["holdout"])
    if u["running"]:
        return f"  unfinished: {what}, being written now by `{u['command']}`: inspect again when it is done"
    how = f"rerun `{u['command']}`" if u["command"] else "rerun the shuffle command that wrote the run"
    if u["to_nodes"]:  # its lock names process 0's command line, not the launcher
        how += " under the launcher that started it (mpirun/srun, the same processes)"
    return (
        f"  unfinished: {what} (begun, not committed: its shuffle was stopped); finish it: {how} "
        "(the complete epochs are kept, not written again)"
    )


def _source_length_lines(per_source: list[dict]) -> list[str]:
    """Each source's document lengths, when there are several (with one, the line above is its)."""
    if len(per_source) < 2:
        return []
    lines = ["  document length by source (tokens a document):"]
    for d in per_source:
        if not d.get("documents"):
            lines.append(f"    {d['name']}: no documents")
            continue
        q = d["quantiles"]
        sampled = f", sampled from {d['sampled_from_documents']:,}" if "sampled_from_documents" in d else ""
        lines.append(
            f"    {d['name']}: mean {d['mean']}  min {d['min']}  p50 {q['p50']:g}  p99 {q['p99']:g}  "
            f"max {d['max']}  ({d['documents']:,} documents{sampled})"
        )
    return lines


def _epochs_of(directory: Path, manifest: dict) -> list[tuple[int, Path, dict]]:
    """(epoch, directory, manifest) of a run's listed epochs, or of an epoch directory itself."""
    if manifest["kind"] == EPOCH:
        return [(int(manifest["epoch"]), directory, manifest)]
    if manifest["kind"] == RUN:
        # each inside the run: a symbolic link out (another run's epoch) is refused, never reported as this run's
        dirs = [(int(e), contained_epoch_dir(directory, int(e))) for e in manifest.get("epochs") or []]
        return [(e, d, read_manifest(d, EPOCH)) for e, d in dirs]
    return []


def _counted_elsewhere(folder, epoch: dict) -> str:
    """How to find the max_documents of an epoch whose tokens are not here: a best-fit epoch's
    manifest records it; a `shuffle --to-nodes` epoch is whole in no folder (was: "inspect the
    run it was shuffled from", which holds no more of it); a partial stage's run holds it all."""
    recorded = (epoch.get("packing") or {}).get("max_documents_per_row")
    if recorded is not None:
        return f"drop --documents-per-row: the epoch's manifest records the figure, max_documents_per_row {recorded}"
    if tokens_on_nodes(folder, epoch.get("shards") or []):
        return (
            "drop --documents-per-row: a `shuffle --to-nodes` epoch is whole in no folder; a `shuffle -o` "
            "of the same sources and settings writes the same epoch to one, which it reads"
        )
    return "inspect the run it was staged from, which holds the whole epoch"


def _tokens_away(chosen) -> str | None:
    """Why the chosen epoch's token files are not in its folder (None: they are): a run of
    `shuffle --to-nodes` keeps them in the node slices, a `stage --shards-of` copy left some out."""
    if chosen is None:
        return None
    _, folder, m = chosen
    shards = m.get("shards") or []
    if tokens_on_nodes(folder, shards):
        return "the epoch's tokens are in node slices (shuffle --to-nodes), not in the run"
    absent = partial_stage_absent(folder.parent) if isinstance(folder, Path) else {}
    left = sum(str(folder / s["path"]) in absent for s in shards)
    if left:
        return f"{left} of the epoch's {len(shards)} shards were left out by a partial stage ({STAGE_SIDECAR})"
    return None


def _sources_of(directory: Path, manifest: dict, epochs, report: dict) -> tuple[list[str], list[PackedSource]]:
    """The names and the packed sources to read: the directory itself (named by its folder), or
    every source the epochs name (all or none: statistics over part of a mixture would mislead),
    named as the epoch (or run) names them."""
    if manifest["kind"] == SOURCE:
        return [directory.name], [PackedSource.open(directory)]
    entries = (epochs[0][2].get("sources") if epochs else manifest.get("sources")) or []
    names = [str(e.get("name") or e.get("path")) for e in entries]
    near = directory if manifest["kind"] == RUN else directory.parent
    opened = [_open_source(e, near) for e in entries]
    missing = [name for name, s in zip(names, opened) if s is None]
    if missing:
        report["unreachable_sources"] = missing
        return names, []
    return names, opened


def _totals(manifest: dict, epochs, sources: list[PackedSource]) -> dict:
    if manifest["kind"] == SOURCE:
        return {
            "tokens": int(manifest["tokens"]),
            "documents": int(manifest["documents"]),
            "shards": len(manifest.get("shards") or []),
        }
    totals = {
        "epochs": [e for e, _, _ in epochs],
        "samples": sum(int(m["samples"]) for _, _, m in epochs),
        "tokens": sum(int(m["tokens"]) for _, _, m in epochs),
        "shards": sum(len(m.get("shards") or []) for _, _, m in epochs),
        "seq_len": int(epochs[0][2]["seq_len"]) if epochs else manifest.get("seq_len"),
    }
    if sources:
        totals["source_documents"] = sum(int(s.manifest["documents"]) for s in sources)
        totals["source_tokens"] = sum(s.tokens for s in sources)
        totals["sources"] = len(sources)
    return totals


def _epoch_shares(epochs) -> list[dict]:
    """Each epoch's sources and their share of its samples, and what its packing shows
    (tokpack.shuffle.packings.shown), from the epoch manifests."""
    from tokpack.shuffle.packings import shown

    shares = []
    for e, _, m in epochs:
        n = int(m["samples"])
        row = [
            {
                "name": str(s.get("name")),
                "samples": int(s.get("samples", 0)),
                "share": round(int(s.get("samples", 0)) / n, 6) if n else 0.0,
                "weight": s.get("weight"),
                "first_pass": s.get("first_pass"),
                "passes": s.get("passes"),
            }
            for s in m.get("sources") or []
        ]
        shares.append(
            {"epoch": e, "samples": n, "dropped_tokens": m.get("dropped_tokens"), "sources": row, "packing": shown(m)}
        )
    return shares


def _stages(run: dict) -> list[dict]:
    """A scheduled run's stages, from its recorded schedule: epochs (planned and written),
    samples, and each source's weight and samples over the stage."""
    stages: dict[str, dict] = {}
    for e, entry in enumerate(run["schedule"]):
        st = stages.setdefault(
            entry["stage"], {"stage": entry["stage"], "epochs": [], "written": [], "samples": 0, "sources": {}}
        )
        st["epochs"].append(e)
        st["written"] += [e] if e in run["epochs"] else []
        st["samples"] += sum(entry["samples"])
        for i, w, c in zip(entry["sources"], entry["weights"], entry["samples"]):
            src = st["sources"].setdefault(i, {"name": run["sources"][i]["name"], "weight": w, "samples": 0})
            src["samples"] += c
    return [{**st, "sources": list(st["sources"].values())} for st in stages.values()]


def _diversity_lines(diversity: dict, batch: int, split: str | None = None) -> list[str]:
    lines = []
    for when in ("before", "after"):
        if when not in diversity:
            continue
        s = diversity[when].get("summary")
        if when == "before":  # a packed source's batches: no epoch to name
            label = when
        else:
            label = f"after ({_epoch_name(split, diversity['epoch'])}, {diversity['document_identity']})"
        if not s:
            lines.append(f"  batches {label}: fewer samples than one batch of {batch}")
            continue
        lines.append(
            f"  batches {label}: {diversity[when]['batches']} x {batch} samples; distinct documents "
            f"mean {s['distinct_documents']['mean']:g} min {s['distinct_documents']['min']}; "
            f"max single-document share mean {s['max_doc_share']['mean']:.3f} "
            f"max {s['max_doc_share']['max']:.3f}"
        )
    if diversity.get("note"):
        lines.append(f"  note: {diversity['note']}")
    return lines


# ------------------------------------------------------------------------------ plot


def write_plot(path, report: dict, hist: LengthHistogram | None) -> None:
    import matplotlib  # inspect checked that it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    div = report.get("batch_diversity", {})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    fig.suptitle(
        f"tokpack inspect: {report['kind']} {report['path']}  (global batch = {report['batch_size']} samples)",
        fontsize=12,
    )

    ax = axes[0]
    if hist is not None and hist.count:
        edges, counts = hist.plot_bins()
        ax.stairs(counts, edges, fill=True, color="#4c72b0", alpha=0.85)
        ax.set_xscale("log")
        ax.set_yscale("log")  # so a single very long document stays visible
        med = hist.quantile(0.5)
        ax.axvline(med, color="k", ls="--", lw=1, label=f"median {med:,.0f}")
        ax.axvline(
            hist.total / hist.count, color="#c44e52", ls=":", lw=1.5, label=f"mean {hist.total / hist.count:,.0f}"
        )
        ax.axvline(hist.max, color="#8172b2", ls="-.", lw=1, label=f"longest {hist.max:,}")
        ax.set_ylim(bottom=0.5)  # a bin holding one document stays visible
        ax.legend(fontsize=9)
        ax.set_title(f"document length ({hist.count:,} documents)")
    else:
        ax.text(0.5, 0.5, "sources not reachable", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("document length")
    ax.set_xlabel("tokens per document (log scale)")
    ax.set_ylabel("documents (log scale)")

    styles = {
        "before": dict(color="#c44e52", label="before shuffle (sequential)"),
        "after": dict(
            color="#55a868",
            label=f"after shuffle ({_epoch_name(report.get('split'), div.get('epoch'))})",
        ),
    }
    for ax, key, title, ylabel, top in (
        (axes[1], "distinct_documents", "distinct documents per batch", "documents", None),
        (axes[2], "max_doc_share", "largest single-document share per batch", "share of the batch's tokens", 1.05),
    ):
        for when, style in styles.items():
            series = div.get(when, {}).get(key)
            if series:
                ax.plot(range(len(series)), series, marker="o", ms=3, lw=1.2, **style)
        ax.set_ylim(bottom=0, top=top)  # top None: matplotlib's
        ax.set_title(title)
        ax.set_xlabel("global batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=9)
        else:
            ax.text(0.5, 0.5, "no batches to analyse", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=110)
    plt.close(fig)
