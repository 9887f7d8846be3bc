#!/usr/bin/env bash
# The main job end to end on the shipped sample corpus:
# pack -> shuffle into two epochs -> validate -> read what two ranks are fed.
# Usage: bash examples/quickstart.sh [OUT]: OUT keeps what it writes; without it, a temporary
# folder is used and removed at the end.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -ge 1 ]; then
  out="$1"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  out="$tmp/tokpack-quickstart"
fi

echo "== pack (datatrove folder -> packed source)"
tokpack pack "$here/sample-corpus" -o "$out/source"

echo "== shuffle (2 epochs of 128-token samples in shards of 1000, out of core with a 1 MiB budget)"
tokpack shuffle "$out/source" -o "$out/run" --seq-len 128 --seed 1234 --epochs 2 --memory 1MiB --shard-samples 1000

echo "== validate (checksums, sizes, EOS, vocabulary, and the epochs' content against the source)"
tokpack validate "$out/source" "$out/run" --against "$out/source"

echo "== read (rank 0 and rank 1 of 2, micro-batch 2, from the start)"
tokpack read "$out/run" --rank 0 --world-size 2 --micro-batch 2 --count 4
tokpack read "$out/run" --rank 1 --world-size 2 --micro-batch 2 --count 4

if [ $# -ge 1 ]; then
  echo "== done: $out"
else
  echo "== done (the temporary $out is removed now; bash examples/quickstart.sh OUT keeps it in OUT)"
fi
