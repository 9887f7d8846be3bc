#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the modules that decide what a user's tokens become: the plan,
# the permutation, the engine's placement and records, the reader, the validator, the input
# readers; and those that keep them safe: units, the lock, the torch adapter, schedules, the
# outbox and plan's arithmetic.
#
#   scripts/mutation.sh               every mutant of those modules (hours on 2 cores)
#   scripts/mutation.sh --sample D    every D-th mutant of each module, in name order (D=10: ~1/10)
#   scripts/mutation.sh --module M    only module M (e.g. shuffle/plan.py); combines with --sample
#   scripts/mutation.sh --module M --functions 'P...'   only the mutants of M's functions matching
#                                     these mutmut name patterns (e.g. '*ǁrecorded__*')
#   scripts/mutation.sh --ci          a small fixed subset (the permutation's key and round set-up
#                                     against tests/test_permutation_golden.py); .ci/run calls it;
#                                     exits 1 if one of them survives
#
# mutmut writes its mutants/ tree into a scratch copy of the repository ($MUTATION_DIR, default
# a temporary directory), never into the checkout. Per module it prints mutants, killed
# (a timeout counts as killed: the tests did not pass), survived, known equivalent, and the
# score killed / (checked - equivalent). Surviving mutants listed in
# scripts/mutation-equivalent.txt ("name  reason", one a line) are printed with their reason.
# Config: [tool.mutmut] in pyproject.toml (the test files run against the mutants).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
EQUIVALENT="$REPO/scripts/mutation-equivalent.txt"
MODULES=(shuffle/plan.py shuffle/permutation.py shuffle/steps.py loader/reader.py formats/numbering.py formats/shard_scan.py
         packer/validation.py
         formats/inputs/discover.py formats/inputs/datatrove_ds.py formats/inputs/megatron_bin.py
         formats/inputs/tables.py formats/inputs/npy_raw.py formats/inputs/jsonl.py
         formats/units.py formats/guard.py loader/torch_adapter.py shuffle/schedule.py formats/io/writes.py
         packer/planning.py packer/plan_result.py packer/plan_nodes.py)
CI_TESTS='["tests/test_permutation_golden.py"]'
# The --ci subset: the mutants of key derivation, the mixer and the Feistel set-up. Pinned
# by name so the run is the same every time (mutmut numbers a function's mutants in order).
CI_MUTANTS=("tokpack.shuffle.permutation.x_derive_key__mutmut_*" "tokpack.shuffle.permutation.x__mix__mutmut_*"
            "tokpack.shuffle.permutation.xǁBijectionǁ__init____mutmut_*")

mode=full sample=1 only="" functions=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ci) mode=ci ;;
    --sample) sample=${2:?--sample needs D}; shift ;;
    --module) only=${2:?--module needs a path like shuffle/plan.py}; shift ;;
    --functions) functions=${2:?--functions needs mutmut name patterns}; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "mutation.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
command -v mutmut >/dev/null || { echo "mutation.sh: mutmut not found: pip install -e '.[test]'" >&2; exit 2; }

WORK=${MUTATION_DIR:-$(mktemp -d -t tokpack-mutation.XXXXXX)}
mkdir -p "$WORK"
echo "mutation.sh: working in $WORK"
(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$WORK" 2>/dev/null || true)
cd "$WORK"
# The copy takes the installed layout (tokpack/formats, tokpack/shuffle, ...): mutmut names a
# mutant and picks its tests by the file's path, and the tests import tokpack.shuffle.plan, so
# the paths must read as the module names (in the checkout they are top-level folders).
for folder in $(python -c "import tomllib; print(' '.join(v for k, v in tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir'].items() if k != 'tokpack'))"); do
  mv "$folder" "tokpack/$folder"
done

# Per module: the tests that run against its mutants (the fast golden files first), and for
# the engine only its placement (which row goes where), not its I/O plumbing. The engine's
# leave out the 10x-data memory test: under mutmut's tracer the process outgrows the budget
# it checks (the suite still runs it).
declare -A TESTS=(
  [shuffle/permutation.py]='["tests/test_permutation_golden.py", "tests/test_plan_golden.py"]'
  [shuffle/plan.py]='["tests/test_plan_golden.py", "tests/test_permutation_golden.py"]'
  [shuffle/steps.py]='["tests/test_engine_placement.py", "tests/test_shuffle.py", "tests/test_shuffle_integrity.py", "--deselect", "tests/test_shuffle.py::test_peak_memory_stays_within_budget_for_10x_data"]'
  [loader/reader.py]='["tests/test_reader.py", "tests/test_resume.py"]'
  [formats/numbering.py]='["tests/test_reader.py", "tests/test_resume.py"]'
  [formats/shard_scan.py]='["tests/test_validate.py"]'
  [packer/validation.py]='["tests/test_validate.py"]'
  [formats/inputs/]='["tests/test_pack.py"]'  # every module of the package
  [formats/units.py]='["tests/test_units.py"]'
  [formats/guard.py]='["tests/test_guard.py"]'  # mutmut picks a mutant's tests by the calls they make in-process; the CLI lock tests make theirs in subprocesses
  [loader/torch_adapter.py]='["tests/test_reader.py", "tests/test_resume.py", "-k", "torch or stateful or consumed or state_dict"]'
  [shuffle/schedule.py]='["tests/test_schedule.py"]'
  [formats/io/writes.py]='["tests/test_io.py", "tests/test_api.py", "-k", "send or urls"]'  # memory:// stores: no moto
  [packer/planning.py]='["tests/test_plan_command.py", "-k", "not writes_nothing and not virtual"]'  # (those run the CLI in another folder: mutmut's trampoline finds no config there)
  [packer/plan_result.py]='["tests/test_plan_command.py", "-k", "not writes_nothing and not virtual"]'
  [packer/plan_nodes.py]='["tests/test_plan_nodes.py"]'
)
# Within a module, only these functions' mutants (the rest is plumbing other tests cover): the
# engine's placement and its scatter records; formats/io/writes.py's Outbox (sending outputs to a store).
declare -A FUNCTIONS=([shuffle/steps.py]="*ǁgather__* *ǁinput_segments__* *ǁholds_rows_of__* *x_make_layout__* *ǁscatter__* *ǁorder__* *ǁ_blocks__* *x_source_rows__* *ǁrecorded__* *ǁscatter_done__* *ǁ_check_bucket__*"
                      [formats/io/writes.py]="*ǁOutboxǁ*")

if [ "$mode" = ci ]; then targets=(shuffle/permutation.py); elif [ -n "$only" ]; then targets=("$only"); else targets=("${MODULES[@]}"); fi
[ -z "$functions" ] || [ -n "$only" ] || { echo "mutation.sh: --functions needs --module" >&2; exit 2; }
[ -z "$functions" ] || FUNCTIONS[$only]=$functions
all_names=()
for target in "${targets[@]}"; do
  tests=${TESTS[$target]:-${TESTS[${target%/*}/]:-}}
  [ -n "$tests" ] || { echo "mutation.sh: no tests listed for $target" >&2; exit 2; }
  [ "$mode" = ci ] && tests=$CI_TESTS
  # The scratch copy's [tool.mutmut]: this module, its tests.
  python - "$tests" "$target" <<'PY'
import json, sys, tomllib
tests, target = sys.argv[1:]
text = open("pyproject.toml").read()
cfg = tomllib.loads(text)["tool"]["mutmut"]
cfg["source_paths"] = ["tokpack"]
cfg["only_mutate"] = ["tokpack/" + target]
cfg["pytest_add_cli_args_test_selection"] = json.loads(tests)
head = text[: text.index("\n[tool.mutmut]")]
open("pyproject.toml", "w").write(head + "\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
PY
  module=${target%.py}; module=tokpack.${module//\//.}
  names=()
  if [ "$mode" = ci ]; then
    names=("${CI_MUTANTS[@]}")
  elif [ "$sample" -gt 1 ] || [ -n "${FUNCTIONS[$target]:-}" ]; then
    # Generate the mutants without running anything, then keep every D-th name of the module.
    python -c "
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(2)" >/dev/null
    mapfile -t names < <(mutmut results --all true | awk '{sub(":$", "", $1); print $1}' | grep -F "$module.x" |
      python -c "
import fnmatch, sys
pats = sys.argv[2].split()
names = sorted(n.strip() for n in sys.stdin if not pats or any(fnmatch.fnmatch(n.strip(), p) for p in pats))
print('\n'.join(names[:: int(sys.argv[1])]))" "$sample" "${FUNCTIONS[$target]:-}")
    echo "mutation.sh: $target: ${#names[@]} mutants (every ${sample}th)"
  else
    names=("$module.x*")
  fi
  [ ${#names[@]} -gt 0 ] || continue
  t0=$(date +%s)
  mutmut run --max-children "${MUTATION_JOBS:-2}" "${names[@]}" >> mutmut-run.log 2>&1 || true
  echo "mutation.sh: $target: mutmut ran in $(( $(date +%s) - t0 )) s (log: $WORK/mutmut-run.log)"
  all_names+=("${names[@]}")
done

mutmut results --all true > mutmut-results.txt
python - "$mode" "$EQUIVALENT" "${all_names[@]}" <<'PY'
import fnmatch, sys
from collections import defaultdict

mode, equivalent_file, *wanted = sys.argv[1:]
reasons = {}
for line in open(equivalent_file):
    if line.strip() and not line.startswith("#"):
        name, _, why = line.strip().partition(" ")
        reasons[name] = why.strip()
rows = defaultdict(lambda: defaultdict(int))
survivors = []
for line in open("mutmut-results.txt"):
    name, _, status = line.strip().rpartition(": ")
    if wanted and not any(fnmatch.fnmatch(name, w) or name == w for w in wanted):
        continue
    module = name.split(".x")[0]
    r = rows[module]
    r["mutants"] += 1
    if status in ("killed", "timeout", "segfault", "caught by type check"):
        r["killed"] += 1
    elif status == "survived" and name in reasons:
        r["equivalent"] += 1
        print(f"equivalent  {name}: {reasons[name]}")
    elif status == "survived":
        r["survived"] += 1
        survivors.append(name)
    else:  # not checked, no tests, suspicious, skipped
        r[status.replace(" ", "_")] += 1
print(f"\n{'module':<22} {'mutants':>7} {'killed':>6} {'survived':>8} {'equiv.':>6} {'other':>5} {'score':>6}")
bad = False
for module, r in sorted(rows.items()):
    other = r["mutants"] - r["killed"] - r["survived"] - r["equivalent"]
    checked = r["killed"] + r["survived"]
    score = r["killed"] / checked if checked else float("nan")
    bad |= r["survived"] > 0 or not checked
    print(f"{module:<22} {r['mutants']:>7} {r['killed']:>6} {r['survived']:>8} {r['equivalent']:>6} {other:>5} {score:>6.1%}")
for name in survivors:
    print(f"survived    {name}   (mutmut show '{name}' in the work dir)")
bad |= not rows  # nothing was checked at all (a layout mutmut cannot map to the tests' imports)
sys.exit(1 if bad and mode == "ci" else 0)  # the CI subset must stay fully killed
PY
