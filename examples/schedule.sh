#!/usr/bin/env bash
# A run in three stages declared in one file (examples/schedule.yaml): pack the sample
# corpus's two files as two sources, write the schedule's epochs (one of them first, alone),
# validate them against their stages' sources, and read a global batch across a stage boundary.
# Usage: bash examples/schedule.sh [OUT]: OUT keeps what it writes; without it, a temporary
# folder is used and removed at the end.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -ge 1 ]; then
  out="$1"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  out="$tmp/tokpack-schedule"
fi
mkdir -p "$out"
cp "$here/schedule.yaml" "$out/schedule.yaml"

echo "== pack (each file of the sample corpus -> one packed source)"
for i in 0 1; do
    tokpack pack "$here/sample-corpus/0000${i}_00000_doc_shuffled.ds" -o "$out/packed/part-$i" >/dev/null
done

echo "== shuffle: epoch 2 (stage decay) alone, then every other epoch; any order gives the same bytes"
tokpack shuffle --schedule "$out/schedule.yaml" -o "$out/run" --epoch 2 --memory 1MiB >/dev/null
tokpack shuffle --schedule "$out/schedule.yaml" -o "$out/run" --memory 1MiB >/dev/null

echo "== validate (each epoch against its stage's sources, the chains across stages, the schedule file)"
tokpack validate "$out/run" --against "$out/packed/part-0" --against "$out/packed/part-1"

echo "== inspect (per stage)"
tokpack inspect "$out/run" --batches 4 | grep -E "^run|stage|epoch [0-9]"

echo "== read (a global batch of 2 x 2 across the warmup -> stable boundary at sample 1818)"
tokpack read "$out/run" --rank 0 --world-size 2 --micro-batch 2 --start-sample 1816 --count 2
tokpack read "$out/run" --rank 1 --world-size 2 --micro-batch 2 --start-sample 1816 --count 2

if [ $# -ge 1 ]; then
  echo "== done: $out"
else
  echo "== done (the temporary $out is removed now; bash examples/schedule.sh OUT keeps it in OUT)"
fi
