"""`tokpack pack` and `tokpack shuffle`: the commands that write a packed source or a run. They
parse their arguments, call tokpack.packer.api and print its result."""

from __future__ import annotations

import json

import click

from tokpack.formats.constants import DEFAULT_SHARD_TOKENS
from tokpack.formats.io import log_interval
from tokpack.formats.units import counted
from tokpack.packer.cli_options import (
    BYTES,
    LOG_INTERVAL,
    SCRATCH,
    SHUFFLE_TASKS_HELP,
    TOKENS,
    ListedChoice,
    PackingChoice,
    command_log,
    executor_config,
    executor_options,
    weighted_sources,
)
from tokpack.packer.cli_report import emit, user_errors
from tokpack.shuffle.spec import DEFAULT_MEMORY


def _real_shard_size(result) -> dict:
    """shuffle's shard_samples for humans: the run's setting (which --json keeps, and adding an
    epoch must repeat) is larger than an epoch by default on a small corpus; say what a shard holds."""
    largest = max(result.epoch_samples or [0])
    if not 0 < largest < result.shard_samples:
        return {}
    return {
        "shard_samples": f"{largest} (one shard an epoch: the run's shard_samples, {result.shard_samples}, "
        "is larger than an epoch)"
    }


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output directory for the packed source.")
@click.option(
    "--format",
    "input_format",
    type=ListedChoice("tokpack.formats.inputs.discover", "FORMATS", extra=("auto",)),
    default="auto",
    show_default=True,
    help="Input format; auto detects it and says what it found.",
)
@click.option(
    "--column",
    default=None,
    help="Parquet/Arrow column or JSONL key holding token lists [default: input_ids]; "
    "for --format text, the text column/key [default: text].",
)
@click.option(
    "--dtype",
    default=None,
    help="Token dtype of raw token files (uint16, uint32, int32, ...); "
    "inputs that record their own dtype must agree with it.",
)
@click.option("--tokenizer", default=None, help="Local tokenizer.json: for raw text, and to learn EOS and vocab size.")
@click.option(
    "--eos-id", type=int, default=None, help="EOS token id (default: from the tokenizer or datatrove metadata)."
)
@click.option(
    "--vocab-size", type=int, default=None, help="Vocabulary size (default: from the tokenizer or the input dtype)."
)
@click.option("--overwrite", is_flag=True, help="Replace an output directory that holds a different packed source.")
@click.option(
    "--shard-tokens",
    type=TOKENS,
    default=DEFAULT_SHARD_TOKENS,
    help="Target tokens per output shard (documents never span shards) [default: 2^30 = 1Gi tokens].",
)
@click.option(
    "--link",
    is_flag=True,
    help="Hard-link (else reflink) a datatrove input that already is its shard's bytes, once verified, "
    "instead of copying it; the input must then not be edited in place (docs/COMMANDS.md).",
)
@click.option(
    "--append-eos",
    is_flag=True,
    help="Pack an input whose documents all end with one id that is not the EOS id, an EOS appended "
    "to each; without it such an input is refused as a wrong --eos-id.",
)
@executor_options
@SCRATCH
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def pack(inputs, output, as_json, **kw):
    """Pack tokenized INPUTs into one packed source.

    \b
    Example:
      tokpack pack /data/tokenized/web/ -o /data/packed/web --workers 8
      tokpack pack data.parquet -o packed --column input_ids --eos-id 0 --vocab-size 50304
    """
    from tokpack.packer.api import pack as pack_api

    executor = executor_config(kw)
    emit(pack_api(list(inputs), output, executor=executor, log=command_log(as_json), **kw), as_json)


# What --like reads from the run, as its usage line names it (the sources aside).
TAKEN_BY_LIKE = (
    "--seq-len",
    "--seed",
    "--samples/--tokens",
    "--shard-samples",
    "--jitter",
    "--schedule",
    "--packing",
    "--pad-id",
    "--holdout",
)


def epochs_asked(sources, epochs, epoch, kw) -> list[int] | int | None:
    """shuffle's --epochs N / --epoch E (None: every epoch of --schedule), with the usage checks
    of its arguments."""
    if kw.get("like") is not None:
        from tokpack.shuffle.like import given_with_like

        twice = given_with_like({**kw, "sources": sources}, cli=True)
        if twice:
            raise click.UsageError(
                f"--like takes the sources and {', '.join(TAKEN_BY_LIKE)} from the run; drop {' '.join(twice)}"
            )
        if epochs is not None and epoch is not None:
            raise click.UsageError("give at most one of --epochs N and --epoch E")
        return [epoch] if epoch is not None else epochs
    if kw["output"] is None:
        raise click.UsageError("give -o OUT (or --like RUN to add epochs to RUN with its own settings)")
    if kw["schedule"] is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("seq_len", "seed", "samples", "tokens") if kw[k] is not None]
        if sources or given or kw["jitter"]:
            raise click.UsageError(
                "--schedule declares the sources, --seq-len, --seed, --samples/--tokens and "
                f"--jitter; drop {' '.join(given + ['--jitter'] * kw['jitter']) or 'the SOURCEs'}"
            )
        if epochs is not None and epoch is not None:
            raise click.UsageError("give at most one of --epochs N and --epoch E")
    elif not sources or kw["seq_len"] is None or kw["seed"] is None:
        raise click.UsageError("give SOURCE[=WEIGHT]..., --seq-len and --seed (or --schedule FILE)")
    elif (epochs is None) == (epoch is None):
        raise click.UsageError("give exactly one of --epochs N or --epoch E")
    if kw["samples"] is not None and kw["tokens"] is not None:
        raise click.UsageError("give at most one of --samples and --tokens")
    return [epoch] if epoch is not None else epochs


@click.command()
@click.argument("sources", nargs=-1, metavar="SOURCE[=WEIGHT]...")
@click.option(
    "-o", "--output", default=None, help="Run directory; one epoch-NNNNN/ per epoch inside [with --like: RUN]."
)
@click.option(
    "--like",
    default=None,
    metavar="RUN",
    help="Add epochs to the run RUN with its own settings, read from its manifests (sources, weights, "
    "--seq-len, --seed, --samples, --shard-samples, --jitter, --packing, --pad-id or its "
    "--schedule); give only --epoch E or --epochs N, and how to run (--memory, --workers...).",
)
@click.option(
    "--schedule",
    type=click.Path(dir_okay=False),
    default=None,
    help="A schedule YAML (seq_len, seed, stages of sources and weights) instead of SOURCEs, "
    "--seq-len, --seed, --samples/--tokens and --jitter; without --epoch(s), every epoch.",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sample is seq_len + 1.")
@click.option("--seed", type=int, default=None, help="Shuffle seed.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Write epochs 0..N-1.")
@click.option("--epoch", type=click.IntRange(min=0), default=None, help="Write only epoch E (adds to an existing run).")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Samples per epoch (with weights).")
@click.option(
    "--tokens",
    type=TOKENS,
    default=None,
    help="Trained tokens per epoch: samples = T // seq_len. K/M/B/T are 10^3..10^12 (100B).",
)
@click.option(
    "--shard-samples",
    type=click.IntRange(min=1),
    default=None,
    help="Samples per output shard [default: 1 GiB // ((seq_len+1) * token_size), about 1 GiB].",
)
@click.option(
    "--memory",
    type=BYTES,
    default=f"{DEFAULT_MEMORY >> 30}GiB",  # tokpack.shuffle.spec's, as the help shows it
    show_default=True,
    help="Total memory budget in bytes (KB/MB/GB are 10^n; KiB/MiB/GiB and a bare K/M/G are 2^n). An epoch whose windows fit runs in memory (one read, one write); "
    "otherwise out of core, each of --workers tasks using memory/workers.",
)
@click.option("--jitter", is_flag=True, help="Shift window starts by a seeded per-epoch offset.")
@click.option(
    "--packing",
    type=PackingChoice(),
    default=None,
    show_default="concat",
    help="concat: windows of the concatenated documents; best-fit: whole documents packed into samples "
    "by best-fit decreasing, per epoch (only documents longer than a sample are cut).",
)
@click.option(
    "--pad-id",
    type=click.IntRange(min=0),
    default=None,
    help="best-fit: the token that fills a sample's tail [default: the EOS id].",
)
@click.option(
    "--to-nodes",
    "to_nodes",
    default=None,
    metavar="DEST",
    help="Under MPI (mpirun/srun, one process per node; pip install 'tokpack[mpi]'): process n writes "
    "node n's slice (as `stage RUN DEST --node n/N`) into its local DEST ({node} is replaced by n); "
    "-o RUN gets only the manifests and row hashes.",
)
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None, help="With --to-nodes: K ranks a node.")
@click.option(
    "--micro-batch", type=click.IntRange(min=1), default=None, help="With --to-nodes: m samples a rank a step."
)
@click.option(
    "--keep-sources",
    "keep_sources",
    default=None,
    metavar="DIR",
    help="With --to-nodes: each process keeps the source shards it reads, verified, in its local DIR "
    "({node} is replaced by n) and reads them there in later epochs, not on the shared filesystem.",
)
@click.option(
    "--holdout",
    default=None,
    metavar="F",
    help="Set whole documents of each source aside from every epoch, chosen from --seed, and write "
    "them once to RUN/holdout/: a fraction of its documents (0.01, 1%) or a token count (5M).",
)
@executor_options(tasks_help=SHUFFLE_TASKS_HELP)
@SCRATCH
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def shuffle(sources, output, epochs, epoch, as_json, **kw):
    """Write globally shuffled epochs of fixed-length samples from packed SOURCEs.

    \b
    Example:
      tokpack shuffle /data/packed/web=0.7 /data/packed/code=0.3 -o /data/runs/r1 \\
          --seq-len 4096 --seed 1234 --epochs 3 --tokens 100B --memory 16GiB --workers 4
      tokpack shuffle --schedule run.yaml -o /data/runs/r2
      tokpack shuffle --like /data/runs/r1 --epoch 3
    """
    from tokpack.packer.api import shuffle as shuffle_api

    epochs = epochs_asked(sources, epochs, epoch, {**kw, "output": output})
    if kw["to_nodes"] is not None:
        return _shuffle_to_nodes(sources, output, epochs, as_json, kw)
    if kw.pop("ranks_per_node") is not None or kw.pop("micro_batch") is not None or kw.pop("keep_sources") is not None:
        raise click.UsageError("--ranks-per-node, --micro-batch and --keep-sources go with --to-nodes DEST")
    kw.pop("to_nodes")
    executor = executor_config(kw)
    quiet = as_json and log_interval() == 0  # --json asked for no lines: no bar on a terminal either
    result = shuffle_api(
        weighted_sources(sources) if sources else None,
        output,
        epochs=epochs,
        executor=executor,
        log=command_log(as_json),
        progress=False if quiet else None,
        **kw,
    )
    emit(result, as_json, shown=_real_shard_size(result))
    if not as_json:
        from tokpack.shuffle.packings import shown_line

        for detail in result.epochs_detail:
            stage = "" if detail["stage"] is None else f" (stage {detail['stage']})"
            reused = f" ({detail['shards_reused']} reused from an earlier attempt)" if detail["shards_reused"] else ""
            click.echo(
                f"epoch {detail['epoch']}{stage}: {detail['samples']} samples, {detail['shards']} "
                f"shard{'s' * (detail['shards'] != 1)}{reused}, {detail['path']}; {shown_line(detail['packing'])}"
            )
            unit = detail["packing"]["unit"]  # a source's "windows" are a best-fit pass's rows
            for r in detail["sources"]:
                if not r["samples"] and r["weight"] is None:
                    continue  # a source of the schedule that this epoch's stage does not use
                click.echo(
                    f'epoch {detail["epoch"]}, source "{r["name"]}": {r["samples"]} samples of {r["windows"]} '
                    f"{unit}{' a pass' * (unit != 'windows')}, {counted(r['passes'], 'pass', plural='passes')}, {r['repeats']} {_repeated(r)}"
                    f"{'' if r['weight'] is None else ', weight ' + r['weight']} ({r['path']}, "
                    f"fingerprint {r['fingerprint'][:16]})"
                )
        if result.holdout is not None:  # written by this command (once a run)
            click.echo(
                f"holdout: {result.holdout['samples']} samples of held-out documents in "
                f"{result.holdout['path']} (read it as an epoch; no training epoch holds them)"
            )
        for line in result.warnings:
            click.echo(f"tokpack: warning: {line}", err=True)


def _shuffle_to_nodes(sources, output, epochs, as_json, kw):
    """shuffle --to-nodes (tokpack.packer.api.shuffle, to_nodes=): this process's node slice; one
    JSON line per process. The usage checks are the command line's; the API runs it."""
    from tokpack.packer.api import shuffle as shuffle_api
    from tokpack.shuffle.like import run_settings

    if kw["ranks_per_node"] is None or kw["micro_batch"] is None:
        raise click.UsageError("--to-nodes needs --ranks-per-node K and --micro-batch M")
    if kw.get("scratch") is not None:
        raise click.UsageError("--to-nodes writes no scratch to the shared filesystem; drop --scratch")
    if kw.get("holdout") is not None or (kw.get("like") is not None and run_settings(kw["like"]).get("holdout")):
        raise click.UsageError(
            "--to-nodes does not write a held-out split (--holdout) yet; shuffle the run without "
            "--to-nodes, then `tokpack stage` it to the nodes"
        )
    kw.pop("deprecated_mem", None)  # how tasks run is not --to-nodes' business: one process a node
    executor_config(kw)
    result = shuffle_api(
        weighted_sources(sources) if sources else None, output, epochs=epochs, log=command_log(as_json), **kw
    )
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(
            f"node {result['node']} of {result['nodes']}: slice of ranks {result['ranks'][0]}-"
            f"{result['ranks'][-1]} at {result['dest']}: epochs {result['epochs']}"
        )


def _repeated(r: dict) -> str:
    """'repeated' for a count of samples; a count in another unit names it (best-fit: pieces)."""
    unit = r.get("repeat_unit", "samples")
    return "repeated" if unit == "samples" else f"{unit} repeated"
