#!/usr/bin/env bash
# Builds tokpack's wheel, installs it (not editable) into a fresh venv, and runs it from a folder
# outside the checkout: nothing may land in site-packages as a top-level formats, loader, shuffle
# or packer; the console script, `python -m tokpack`, the quickstart and the installed package's
# tests must work with no source tree on the path. .ci/run calls it, so a file left out of the
# wheel fails CI.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d -t tokpack-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# Built from a copy of the files git knows: setuptools' build/ in the checkout can hold modules
# that were moved or deleted since, and they would ship in the wheel.
mkdir "$WORK/src"
(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$WORK/src")
python -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src" 2>&1 | grep -v "^WARNING: Location" || true
wheel=$(ls "$WORK"/dist/tokpack-*.whl)
python -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$wheel" pytest hypothesis 2>&1 | grep -v "^WARNING: Location" || true

site=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for name in formats loader shuffle packer; do
  if [ -e "$site/$name" ]; then echo "wheel-check: the wheel installed a top-level '$name' into site-packages" >&2; exit 1; fi
done
top=$(unzip -Z1 "$wheel" | grep -v '\.dist-info/' | cut -d/ -f1 | sort -u | tr '\n' ' ')
[ "$top" = "tokpack " ] || { echo "wheel-check: the wheel holds top-level entries other than tokpack: $top" >&2; exit 1; }

cd "$WORK"  # not the checkout: only the installed package can be imported
PATH="$WORK/venv/bin:$PATH"
tokpack --version
python -m tokpack --version >/dev/null
python -c "import tokpack, sys; assert 'site-packages' in tokpack.__file__, tokpack.__file__; \
from tokpack import pack, shuffle, validate, stage, inspect, plan, SampleReader; \
assert 'torch' not in sys.modules"
bash "$REPO/examples/quickstart.sh" "$WORK/quickstart" >/dev/null
# The tests that need only the runtime dependencies, run against the installed package.
TOKPACK_WHEEL_CHECK=1 python -m pytest -q -p no:cacheprovider --rootdir "$WORK" \
  "$REPO/tests/test_installed.py" "$REPO/tests/test_api.py"
echo "wheel-check: ok ($(basename "$wheel"))"
