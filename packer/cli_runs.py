"""`tokpack validate`, `read`, `inspect` and `stage`: the commands that read a written source or
run (stage copies it). They parse their arguments, call tokpack.packer.api (or the loader) and
print what it returns."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import click

from tokpack.packer.cli_options import BYTES, LOG_INTERVAL, MAX_SEQ_LEN, MAX_WORKERS, TOKENS, Int, command_log
from tokpack.packer.cli_report import emit, user_errors


@click.command()
@click.argument("dirs", nargs=-1, required=True)
@click.option("--quick", is_flag=True, help="Structure and sizes only; skip checksums and token scans.")
@click.option("--against", multiple=True, help="Packed SOURCE(s) the epoch was shuffled from: recompute its content.")
@click.option(
    "--workers",
    type=Int(1, MAX_WORKERS),
    default=min(4, os.cpu_count() or 1),
    show_default="min(4, cores)",
    help="Files checked in parallel (more reads in flight keep the disk busy).",
)
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def validate(dirs, quick, against, workers, as_json):
    """Check the integrity of tokpack directories (sources, runs, epochs). Exit 1 on any problem.

    \b
    Example:
      tokpack validate /data/packed/web /data/runs/r1
      tokpack validate /data/runs/r1/epoch-00000 --against /data/packed/web --json
    """
    from tokpack.packer.api import validate as validate_api
    from tokpack.packer.validation import report_lines

    result = validate_api(list(dirs), quick=quick, against=list(against), workers=workers)
    emit(result, as_json, report_lines, err=not result.ok)
    sys.exit(0 if result.ok else 1)


@click.command()
@click.argument("directory")
@click.option(
    "--rank",
    type=Int(0),
    default=0,
    show_default=True,
    help="The data-parallel rank whose samples to print (below --world-size).",
)
@click.option(
    "--world-size",
    type=Int(1),
    default=1,
    show_default=True,
    help="Data-parallel ranks sharing each global batch of world-size x micro-batch samples.",
)
@click.option("--micro-batch", type=Int(1), default=1, show_default=True, help="Samples per rank per step.")
@click.option(
    "--start-sample",
    type=Int(0),
    help="Consumed samples so far (Megatron's consumed_samples).",
)
@click.option(
    "--consumed-tokens",
    type=TOKENS,
    help="Consumed tokens: start = T // seq_len. K/M/B/T are 10^3..10^12.",
)
@click.option("--count", type=Int(0), default=10, show_default=True, help="Samples this rank prints.")
@click.option("--verify", is_flag=True, help="Checksum each shard when it is first read.")
@click.option(
    "--tokenizer",
    help="Local tokenizer.json: print each sample as text (EOS as its token, a best-fit row's padding as "
    '[padding: N tokens]); with --json, adds "text" and "padding".',
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@user_errors
def read(directory, tokenizer, as_json, **kw):
    """Print what rank R of W is fed from DIRECTORY (a run or an epoch), for debugging.

    \b
    Example:
      tokpack read /data/runs/r1 --rank 3 --world-size 8 --micro-batch 4 --start-sample 1024 --count 4
      tokpack read /data/runs/r1 --count 2 --tokenizer tokenizer.json
    """
    from tokpack.packer.api import read as read_api

    reader, samples = read_api(directory, **kw)
    rank = kw["rank"]
    if tokenizer is not None:
        from tokpack.packer.vocab import load_tokenizer, sample_text

        tok = load_tokenizer(tokenizer)
    for item in samples:
        fields = {"epoch": item.epoch, "sample": item.sample, "rank": rank, "tokens": item.tokens.tolist()}
        header = f"epoch {item.epoch} sample {item.sample} rank {rank}:"
        if item.split is not None:  # RUN/holdout/ is no epoch of the run: named as inspect names it
            fields = {"split": item.split, **fields}
            header = f"held-out split sample {item.sample} rank {rank}:"
        if tokenizer is not None:  # decoded by packer.vocab.sample_text
            pad = int(reader.padding(item.index, 1)[0]) if reader.packed else 0
            fields.update(text=sample_text(tok, item.tokens, reader.eos_id, pad), padding=pad)
        if as_json:
            click.echo(json.dumps(fields))
        elif tokenizer is not None:
            # under its header line, indented: a line that starts a sample is never one of the text's own lines
            click.echo(header)
            click.echo(textwrap.indent(fields["text"], "    "))
        else:
            head = " ".join(map(str, item.tokens[:16].tolist()))
            click.echo(f"{header} [{head}{' ...' if len(item.tokens) > 16 else ''}]")


@click.command()
@click.argument("directory")
@click.option("--batch-size", type=Int(1), help="Global batch size in samples [default: 64].")
@click.option("--batches", type=Int(1), default=64, show_default=True, help="Global batches to analyse.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the figures to FILE.png (needs matplotlib).")
@click.option(
    "--epoch",
    type=Int(0),
    help="Run: the epoch whose batches to analyse [default: first].",
)
@click.option("--seq-len", type=Int(1, MAX_SEQ_LEN), help="Packed source: window length for the batch analysis.")
@click.option(
    "--memory",
    type=BYTES,
    help="Memory budget in bytes of a best-fit epoch's plan and row table, built on disk and read "
    "in parts [default: 256MiB].",
)
@click.option(
    "--documents-per-row",
    is_flag=True,
    help="Also find the largest document count of a row of the epoch: the max_documents to train "
    "with. Reads the epoch's tokens once.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def inspect(directory, as_json, **kw):
    """Report what a directory holds and what the shuffle did to batch diversity.

    \b
    Example:
      tokpack inspect /data/runs/r1 --epoch 0 --batch-size 512
      tokpack inspect /data/runs/r1 --epoch 0 --documents-per-row
      tokpack inspect /data/packed/web --seq-len 4096 --plot web.png
    """
    from tokpack.packer.api import inspect as inspect_api
    from tokpack.packer.inspection import report_lines

    emit(inspect_api(directory, **kw), as_json, report_lines)


@click.command()
@click.argument("directory")
@click.argument("dest")
@click.option(
    "--workers",
    type=Int(1, MAX_WORKERS),
    help="Files copied in parallel [default: 4]; a replacement node (--node on a RUN of shuffle --to-nodes): "
    "processes rebuilding its rank files, each a share of its ranks within --memory / N [default: 1].",
)
@click.option("--epochs", help="Only these epochs of a run, e.g. '0,1' or '0-3'.")
@click.option(
    "--shards-of",
    help="'r/W' (also 'r1,r2/W', 'a-b/W'): only the whole epoch shards ranks r of W read, manifests unchanged.",
)
@click.option(
    "--ranks",
    help="With --world-size: the node slice of consecutive ranks 'A-B' (only their rows, one file per rank).",
)
@click.option("--world-size", type=Int(1), help="W: data-parallel ranks; makes a node slice.")
@click.option(
    "--node",
    help="'n/N': the node slice of node n of N, 0-based: n is 0 to N-1, "
    "as SLURM_NODEID (with --ranks-per-node K; W = N*K; its ranks are n*K to n*K+K-1).",
)
@click.option("--ranks-per-node", type=Int(1), help="K: ranks on each node, with --node.")
@click.option(
    "--micro-batch",
    type=Int(1),
    help="m: samples each rank reads per step, as training reads them; required for a node slice "
    "(--node, or --ranks with --world-size), whose rows depend on it; with --shards-of r/W [default: 1].",
)
@click.option(
    "--start-sample",
    type=Int(0),
    default=0,
    show_default=True,
    help="Node slice: global batches start at this sample mod W*m (a run resumed off that grid).",
)
@click.option(
    "--memory",
    type=BYTES,
    help="A replacement node (--node on a RUN of shuffle --to-nodes): memory budget in bytes of the "
    "rows it rebuilds at a time, and of a best-fit epoch's row table [default: 256MiB].",
)
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def stage(directory, dest, as_json, **kw):
    """Copy a tokpack DIRECTORY to DEST (e.g. local NVMe), verifying every file's checksum.

    \b
    Example:
      tokpack stage s3://bucket/runs/r1 /local_nvme/r1 --epochs 0-1 --workers 8
      tokpack stage /shared/runs/r1 /local_nvme/r1 --shards-of 0-7/64 --micro-batch 4
      tokpack stage /shared/runs/r1 /local_nvme/slice --ranks 0-7 --world-size 64 --micro-batch 4
      tokpack stage /shared/runs/r1 /local_nvme/slice --node "$SLURM_NODEID/8" --ranks-per-node 8 --micro-batch 4
    """
    from tokpack.packer.api import stage as stage_api

    emit(stage_api(directory, dest, log=command_log(as_json), **stage_options(kw)), as_json)


def stage_options(kw: dict) -> dict:
    """stage's options, checked. Its --ranks names a node slice's ranks A-B (with --world-size or
    --node); its older shard-level form, `--ranks r/W` alone, still works with one warning and means
    --shards-of r/W (docs/COMMANDS.md, "Words"). It reaches the stage as before, so it behaves as it
    did. --micro-batch: a node slice holds the rows of one micro-batch, and one forgotten (it was 1 by
    default) showed only when training started, on another node."""
    sliced = kw["world_size"] is not None or kw["node"] is not None
    if kw["shards_of"] is not None and (sliced or kw["ranks"] is not None):
        raise click.UsageError(
            "--shards-of copies whole shards; a node slice is --ranks A-B --world-size W "
            "(or --node): give one of the two"
        )
    if kw["ranks"] is not None and not sliced and "/" in str(kw["ranks"]):
        click.echo(
            "tokpack: warning: --ranks r/W without --world-size is deprecated (it reads like a node "
            "slice's --ranks A-B); use --shards-of r/W, the whole shards ranks r of W read",
            err=True,
        )
    if kw["micro_batch"] is None:
        if sliced:
            raise click.UsageError(
                "a node slice (--node, or --ranks with --world-size) needs --micro-batch M, the "
                "samples each rank reads per step: its rows depend on it"
            )
        kw["micro_batch"] = 1
    return kw
