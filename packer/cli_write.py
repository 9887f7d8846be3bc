"""`tokpack pack` and `tokpack shuffle`: the commands that write a packed source or a run. They
parse their arguments, call tokpack.packer.api and print its result."""

from __future__ import annotations

import json

import click

from tokpack.formats.constants import DEFAULT_SHARD_TOKENS
from tokpack.formats.io.progress_log import log_interval
from tokpack.formats.units import counted
from tokpack.packer.cli_options import (
    BYTES,
    HOLDOUT,
    MAX_SEQ_LEN,
    SEED_RANGE,
    MAX_TOKEN_ID,
    MAX_WORKERS,
    Int,
    Real,
    LOG_INTERVAL,
    SCRATCH,
    TOKENS,
    ListedChoice,
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
    help="Parquet/Arrow column or JSONL key holding token lists [default: input_ids]; "
    "for --format text, the text column/key [default: text].",
)
@click.option(
    "--dtype",
    help="Token dtype of raw token files (uint16, uint32, int32, ...); "
    "inputs that record their own dtype must agree with it.",
)
@click.option("--tokenizer", help="Local tokenizer.json: for raw text, and to learn EOS and vocab size.")
@click.option(
    "--eos-id",
    type=Int(0, MAX_TOKEN_ID),
    help="EOS token id (default: from the tokenizer or datatrove metadata).",
)
@click.option(
    "--vocab-size",
    type=Int(1, MAX_TOKEN_ID + 1),
    help="Vocabulary size (default: from the tokenizer or the input dtype).",
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

    emit(pack_api(list(inputs), output, executor=executor_config(kw), log=command_log(as_json), **kw), as_json)


@click.command()
@click.argument("sources", nargs=-1, metavar="SOURCE[=WEIGHT]...")
@click.option("-o", "--output", help="Run directory; one epoch-NNNNN/ per epoch inside [with --like: RUN].")
@click.option(
    "--like",
    metavar="RUN",
    help="Add epochs to the run RUN with its own settings, read from its manifests (sources, weights, "
    "--seq-len, --seed, --samples, --shard-samples, --jitter, --packing, --pad-id or its "
    "--schedule); give only --epoch E or --epochs N, and how to run (--memory, --workers...).",
)
@click.option(
    "--schedule",
    type=click.Path(dir_okay=False),
    help="A schedule YAML (seq_len, seed, stages of sources and weights) instead of SOURCEs, "
    "--seq-len, --seed, --samples/--tokens and --jitter; without --epoch(s), every epoch.",
)
@click.option("--seq-len", type=Int(1, MAX_SEQ_LEN), help="Tokens per sample is seq_len + 1.")
@click.option("--seed", type=Int(floor=SEED_RANGE[0], most=SEED_RANGE[1]), help="Shuffle seed.")
@click.option("--epochs", type=Int(1), help="Write epochs 0..N-1.")
@click.option("--epoch", type=Int(0), help="Write only epoch E (adds to an existing run).")
@click.option("--samples", type=Int(1), help="Samples per epoch (with weights).")
@click.option(
    "--tokens",
    type=TOKENS,
    help="Trained tokens per epoch: samples = T // seq_len. K/M/B/T are 10^3..10^12 (100B).",
)
@click.option(
    "--shard-samples",
    type=Int(1),
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
    type=ListedChoice("tokpack.shuffle.packings", "names"),
    show_default="concat",
    help="concat: windows of the concatenated documents; best-fit: whole documents packed into samples "
    "by best-fit decreasing, per epoch (only documents longer than a sample are cut).",
)
@click.option(
    "--pad-id",
    type=Int(0, MAX_TOKEN_ID),
    help="best-fit: the token that fills a sample's tail [default: the EOS id].",
)
@click.option(
    "--to-nodes",
    metavar="DEST",
    help="Under MPI (mpirun/srun, --procs-per-node processes a node; pip install 'tokpack[mpi]'): node n's "
    "processes write its slice (as `stage RUN DEST --node n/N`) into its local DEST ({node} is replaced by n); "
    "-o RUN gets only the manifests and row hashes.",
)
@click.option("--ranks-per-node", type=Int(1), help="With --to-nodes: K ranks a node.")
@click.option("--micro-batch", type=Int(1), help="With --to-nodes: m samples a rank a step.")
@click.option(
    "--keep-sources",
    metavar="DIR",
    help="With --to-nodes: each process keeps the source shards it reads, verified, in its local DIR "
    "({node} is replaced by n) and reads them there in later epochs, not on the shared filesystem.",
)
@click.option(
    "--procs-per-node",
    type=Int(1, MAX_WORKERS),
    metavar="P",
    help="With --to-nodes: P MPI processes a node (`mpirun --map-by ppr:P:node`, one a GPU), sharing its DEST, "
    "its lock, its kept sources and its --memory; a row crosses the network once to a node [default: as the "
    "launcher placed them on several hosts, else 1].",
)
@click.option(
    "--stall-timeout",
    type=Real(0, 7 * 86400),
    metavar="SECONDS",
    help="With --to-nodes: when a process hears nothing from a peer for this long (a node stopped, "
    "frozen or cut off), the job stops with one line naming that node; a rerun resumes [default: 300].",
)
@click.option(
    "--holdout",
    type=HOLDOUT,
    metavar="F",
    help="Set whole documents of each source aside from every epoch, chosen from --seed, and write "
    "them once to RUN/holdout/: a fraction of its documents (0.01, 1%) or a token count (5M).",
)
@executor_options(
    tasks_help="Out of core: scatter tasks, each reading one input range (a run of whole source shards, "
    "so at most one task per source shard) [default: --workers]; the order pass runs one task "
    "per output shard."
)
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
    from tokpack.packer.api import shuffle as shuffle_api, shuffle_usage

    epochs = shuffle_usage({**kw, "sources": sources, "output": output, "epochs": epochs, "epoch": epoch})
    sources = weighted_sources(sources) if sources else None
    if kw["to_nodes"] is not None:  # this process's node slice (tokpack.packer.exchange): one line a process
        kw.pop("deprecated_mem", None)  # how tasks run is not --to-nodes' business: one process a node
        executor_config(kw)
        result = shuffle_api(sources, output, epochs=epochs, log=command_log(as_json), **kw)
        if as_json:
            click.echo(json.dumps({"ok": True, **result}))  # first, as in every command's summary
            return
        P, p = result["procs_per_node"], result["process"]
        if result["node"] == 0 and p == 0:  # the epochs' figures are every node's: said once
            _epoch_lines(result["epochs_detail"])
            print_warnings(result["warnings"])
        click.echo(
            f"node {result['node']} of {result['nodes']}{'' if P == 1 else f' (process {p} of {P})'}: slice of "
            f"ranks {result['ranks'][0]}-{result['ranks'][-1]} at {result['dest']}: epochs {result['epochs']}"
        )
        return
    executor = executor_config(kw)
    quiet = as_json and log_interval() == 0  # --json asked for no lines: no bar on a terminal either
    progress = False if quiet else None
    result = shuffle_api(
        sources, output, epochs=epochs, executor=executor, log=command_log(as_json), progress=progress, **kw
    )
    emit(result, as_json, shown=_real_shard_size(result))
    if not as_json:
        _epoch_lines(result.epochs_detail)
        if result.holdout is not None:  # written by this command (once a run)
            click.echo(
                f"holdout: {result.holdout['samples']} samples of held-out documents in "
                f"{result.holdout['path']} (read it as an epoch; no training epoch holds them)"
            )
        print_warnings(result.warnings)


def _epoch_lines(details: list[dict]) -> None:
    """A shuffle's epochs in words (a plain one's, and node 0's of --to-nodes): per epoch, its
    shards and packing; per source, what the epoch takes of it."""
    from tokpack.packer.plan_result import repeated
    from tokpack.shuffle.packings import shown_line

    for detail in details:
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
                f"{unit}{' a pass' * (unit != 'windows')}, {counted(r['passes'], 'pass', plural='passes')}, {r['repeats']} {repeated(r)}"
                f"{'' if r['weight'] is None else ', weight ' + r['weight']} ({r['path']}, "
                f"fingerprint {r['fingerprint'][:16]})"
            )


def print_warnings(lines: list[str]) -> None:
    for line in lines:
        click.echo(f"tokpack: warning: {line}", err=True)
