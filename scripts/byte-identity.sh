#!/usr/bin/env bash
# A fixed set of runs whose every byte a restructuring must leave as it was (issue 40): pack of
# the sample corpus; windows and best-fit, two epochs, with weights, a schedule and --holdout;
# node slices; a --to-nodes run of 4 MPI processes, windows and best-fit. Prints one line a
# file, `sha256  path` relative to ROOT, sorted: diff two of these lists.
# Usage: bash scripts/byte-identity.sh ROOT > sums.txt  (ROOT is emptied first; manifests record
# absolute source paths, so compare lists made at the same ROOT).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${1:?usage: byte-identity.sh ROOT}"
rm -rf "$root" && mkdir -p "$root" && root="$(cd "$root" && pwd)"
cd "$here"  # `python -m` puts the working directory first on the import path: this checkout's
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" TOKPACK_PROGRESS=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
corpus="$here/examples/sample-corpus"
q() { "$@" >/dev/null; }
# this checkout's code, not whichever tokpack is installed
tokpack() { python -m tokpack "$@"; }

q tokpack pack "$corpus" -o "$root/source"
for i in 0 1; do q tokpack pack "$corpus/0000${i}_00000_doc_shuffled.ds" -o "$root/part-$i"; done

# windows: two epochs out of core; weights with jitter; holdout
q tokpack shuffle "$root/source" -o "$root/win" --seq-len 128 --seed 1234 --epochs 2 --memory 1MiB --shard-samples 1000
q tokpack shuffle "$root/part-0=0.7" "$root/part-1=0.3" -o "$root/win-weights" --seq-len 64 --seed 7 --epochs 2 \
  --samples 3000 --jitter --shard-samples 700
q tokpack shuffle "$root/source" -o "$root/win-holdout" --seq-len 128 --seed 5 --epochs 2 --holdout 2% --memory 1MiB
# best-fit: in memory and out of core, weights, holdout, a pad id
q tokpack shuffle "$root/source" -o "$root/bf" --seq-len 128 --seed 1234 --epochs 2 --packing best-fit --shard-samples 500
q tokpack shuffle "$root/source" -o "$root/bf-ooc" --seq-len 128 --seed 1234 --epochs 2 --packing best-fit --memory 1MiB
q tokpack shuffle "$root/part-0=2" "$root/part-1=1" -o "$root/bf-weights" --seq-len 96 --seed 3 --epochs 2 \
  --samples 2500 --packing best-fit --pad-id 7 --holdout 1%
# a schedule, and an epoch added later with --like
cp "$here/examples/schedule.yaml" "$root/schedule.yaml"
mkdir -p "$root/packed" && ln -s "$root/part-0" "$root/packed/part-0" && ln -s "$root/part-1" "$root/packed/part-1"
q tokpack shuffle --schedule "$root/schedule.yaml" -o "$root/sched" --memory 1MiB
q tokpack shuffle "$root/source" -o "$root/like" --seq-len 128 --seed 9 --epochs 1
q tokpack shuffle --like "$root/like" --epoch 1
# node slices of a finished run
for n in 0 1; do
  q tokpack stage "$root/win" "$root/win-node$n" --node "$n/2" --ranks-per-node 2 --micro-batch 2
  q tokpack stage "$root/bf" "$root/bf-node$n" --node "$n/2" --ranks-per-node 2 --micro-batch 2
done
# straight to the nodes: 4 MPI processes, windows and best-fit
if command -v mpirun >/dev/null; then
  for packing in concat best-fit; do
    q mpirun --oversubscribe -n 4 -x PYTHONPATH python -m tokpack shuffle "$root/source" -o "$root/tn-$packing" --seq-len 128 --seed 1234 \
      --epochs 2 --packing "$packing" --to-nodes "$root/tn-$packing-node{node}" --ranks-per-node 2 --micro-batch 2 \
      --memory 64MiB
  done
fi

cd "$root"
find . -type f ! -name tokpack.lock ! -path '*/logs/*' ! -path '*/.tokpack*' -print0 | sort -z | xargs -0 sha256sum
