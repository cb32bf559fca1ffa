#!/usr/bin/env bash
# The torch versions ckptfs declares (pyproject.toml: torch>=FLOOR,<3), tested: the whole suite
# runs on one version (scripts/run-tests.sh, .venv, 2.13.0 CPU); this runs, on the other
# versions, each in its own virtualenv .venv-torch-VERSION (created and filled once, re-used
# while pyproject.toml is unchanged):
#   - from the sharded floor (2.9, ckptfs/torch_versions.py) up: the tests that touch
#     torch.distributed, DCP and DTensor (sharded saves and loads, the DCP adapter, async saves,
#     the integrations, torch_compat): $TESTS;
#   - below it (the floor 2.6 up to 2.8): the single-process tests (formats, protocol,
#     lifecycle, CLI, reliability sweeps: $SINGLE_TESTS), where the tests marked `sharded`
#     skip (ckptfs refuses sharded checkpoints there with TorchCompatError, which
#     tests/project/test_torch_floor.py checks).
#
#   bash scripts/run-torch-matrix.sh                  # the default: 2.6.0 2.9.1 2.14.1
#   bash scripts/run-torch-matrix.sh 2.8.0            # any versions
#   bash scripts/run-torch-matrix.sh 2.9.1 -- -k dcp  # after --: pytest's arguments
#
# Environment:
#   PYTHON                  the interpreter that creates the virtualenvs (default python3)
#   CKPTFS_MATRIX_WORKERS   pytest-xdist workers per version (default 2; 0 runs serially)
#   CKPTFS_MATRIX_KEEP      1: keep each virtualenv for the next run; 0: remove it after its run
#                           (a torch build from PyPI takes 6-7.5 GB installed: a disk rarely holds
#                           three). Default: 0 where CI is set (.ci/run on a fresh clone), else 1.
#   CKPTFS_MATRIX_MIN_FREE_GB  the free space a version's install may need (default 10: the
#                           downloaded wheels plus the installed build); with less, a warning
#                           says how much is free and where before the install is tried.
# A version is pip's default wheel of it (on Linux x86_64: a CUDA build, which runs on the CPU).
# Exit status: non-zero if any version failed; a summary line per version at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WORKERS=${CKPTFS_MATRIX_WORKERS:-2}
if [ -n "${CI:-}" ]; then KEEP=${CKPTFS_MATRIX_KEEP:-0}; else KEEP=${CKPTFS_MATRIX_KEEP:-1}; fi
MIN_FREE_GB=${CKPTFS_MATRIX_MIN_FREE_GB:-10}
DEFAULT_VERSIONS=(2.6.0 2.9.1 2.14.1)

versions=()
pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
  versions+=("$1"); shift
done
[ ${#versions[@]} -gt 0 ] || versions=("${DEFAULT_VERSIONS[@]}")

# (A test module that imports the sharded machinery at its top belongs here: below the
# sharded floor it could not even be collected. Single tests elsewhere: mark them `sharded`.)
# The tests that depend on torch's distributed internals (the private ones are reached through
# ckptfs/torch_compat.py only) or on the integrations' own torch requirements.
TESTS=(
  tests/project/test_torch_floor.py tests/project/test_torch_compat.py
  tests/protocol/test_sharded.py tests/protocol/test_sharded_backends.py
  tests/protocol/test_sharded_cells.py tests/protocol/test_sharded_perf.py
  tests/protocol/test_sharded_ranks.py tests/protocol/test_rank_metadata_sharded.py
  tests/protocol/test_rank_metadata_nodes.py
  tests/protocol/test_incremental_sharded.py tests/protocol/test_tiers_sharded.py
  tests/protocol/test_save_rounds.py tests/protocol/test_plan_tiling.py
  tests/protocol/test_group.py tests/protocol/test_cooperative_load.py
  tests/protocol/test_inplace_load.py tests/protocol/test_load_rounds.py
  tests/protocol/test_async_save.py tests/protocol/test_async_collective.py
  tests/lifecycle/test_manager_sharded.py tests/lifecycle/test_manager_distributed.py
  tests/reliability/test_sharded_crash.py tests/reliability/test_sharded_hardening.py
  tests/integrations
)

# Below the sharded floor: the single-process tests (those of $TESTS excluded, the `sharded`
# ones skipping).
SINGLE_TESTS=(
  tests/project/test_torch_floor.py tests/format tests/protocol tests/lifecycle tests/cli
  tests/reliability tests/integrations/test_lightning.py tests/integrations/test_transformers.py
)
SHARDED_FLOOR=$("$PYTHON" -c "import re; print('.'.join(re.search(
  r'^SHARDED_TORCH_FLOOR = \((\d+), (\d+)\)', open('ckptfs/torch_versions.py').read(),
  re.M).groups()))")

# Whether version $1 is older than the sharded floor.
below_sharded_floor() {
  "$PYTHON" -c "import sys; v, f = ([int(x) for x in a.split('.')[:2]] for a in sys.argv[1:]); sys.exit(0 if v < f else 1)" "$1" "$SHARDED_FLOOR"
}

# pip, without the notice some pip configurations print for an index directory that does
# not exist; pip's own exit status.
pip_in() {
  local py=$1 log rc=0; shift
  log=$(mktemp)
  # No pip cache: it would keep a second copy of each multi-GB build on the disk.
  "$py" -m pip install -q --no-cache-dir --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" || true
  rm -f "$log"
  return "$rc"
}

# The test dependencies, and matplotlib (bench: the async benchmark's smoke test plots).
EXTRAS=test,bench

# The requirements of the extras $EXTRAS (pyproject.toml), less those that need a newer torch
# than version $2 (pip would search every release of them in vain; their tests skip, naming the
# extra to install): torch-checkpointing needs torch >= 2.11.
requirements() {
  "$1" - "$2" "$EXTRAS" <<'PY'
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib

NEEDS_TORCH = {"torch-checkpointing": (2, 11)}
version = tuple(int(x) for x in re.findall(r"\d+", sys.argv[1])[:2])
with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
out: list[str] = []
for extra in sys.argv[2].split(","):
    for req in extras[extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
        if version >= NEEDS_TORCH.get(name, (0, 0)) and req not in out:
            out.append(req)
print("\n".join(out))
PY
}

# A warning when the disk holding this checkout may lack room for an install of torch $1 (its
# virtualenv and pip's temporary downloads).
free_space_for() {
  local free_kb
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((MIN_FREE_GB * 1024 * 1024)) ]; then
    echo "matrix: warning: torch==$1 may need up to ${MIN_FREE_GB} GB free to install; $((free_kb / 1024 / 1024)) GB free on $(df -P . | awk 'NR == 2 {print $6}') (remove unused .venv-torch-* directories if it fails)" >&2
  fi
}

# .venv-torch-VERSION with torch==VERSION, ckptfs (editable) and its $EXTRAS requirements,
# torch pinned by a constraint so that no dependency moves it.
setup_version() {
  local v=$1 venv=".venv-torch-$1" py constraint reqs stamp
  py="$venv/bin/python"
  stamp="$venv/.ckptfs-deps-$( (cat pyproject.toml; echo "$EXTRAS") | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  [ -x "$py" ] || { free_space_for "$v"; "$PYTHON" -m venv "$venv"; } || return 1
  constraint=$(mktemp)
  reqs=$(mktemp)
  echo "torch==$v" >"$constraint"
  echo "matrix: installing torch==$v and ckptfs[$EXTRAS] into $venv"
  pip_in "$py" -c "$constraint" "torch==$v" \
    && requirements "$py" "$v" >"$reqs" \
    && pip_in "$py" -c "$constraint" -e . -r "$reqs" \
    && "$py" -c "import ckptfs, torch, s3fs, gcsfs, adlfs, moto, matplotlib" \
    || { rm -f "$constraint" "$reqs"; rm -rf "$venv"  # a half-filled one would hold the disk
         echo "matrix: install of torch==$v failed" >&2; return 1; }
  rm -f "$constraint" "$reqs" "$venv"/.ckptfs-deps-*
  touch "$stamp"
}

declare -A result
status=0
for v in "${versions[@]}"; do
  start=$SECONDS
  if ! setup_version "$v"; then
    result[$v]="install failed"; status=1; continue
  fi
  installed=$((SECONDS - start))
  py=".venv-torch-$v/bin/python"
  echo "matrix: torch $($py -c 'import torch; print(torch.__version__)')"
  log=$(mktemp)
  xdist=(-n "$WORKERS")
  [ "$WORKERS" = 0 ] || xdist+=(--dist loadfile)
  if below_sharded_floor "$v"; then
    tests=("${SINGLE_TESTS[@]}")
    for t in "${TESTS[@]}"; do  # those of $TESTS inside the directories of $SINGLE_TESTS
      case $t in tests/format/*|tests/protocol/*|tests/lifecycle/*|tests/cli/*|tests/reliability/*)
        tests+=(--ignore "$t") ;;
      esac
    done
    echo "matrix: torch $v is below the sharded floor $SHARDED_FLOOR: the single-process tests"
  else
    tests=("${TESTS[@]}")
  fi
  # The venv's bin first: tests that start ckptfs, moto_server, ... find this version's.
  PATH="$PWD/.venv-torch-$v/bin:$PATH" "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
    "${tests[@]}" "${pytest_args[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  summary=$(grep -E "^=* *[0-9]+ (passed|failed|error)|^=+ .* in [0-9.]+s" "$log" | tail -1)
  rm -f "$log"
  result[$v]="rc=$rc, install ${installed}s, tests $((SECONDS - start - installed))s: ${summary}"
  [ "$rc" = 0 ] || status=1
  [ "$KEEP" = 1 ] || rm -rf ".venv-torch-$v"
done

echo "matrix summary:"
for v in "${versions[@]}"; do echo "  torch $v: ${result[$v]}"; done
exit "$status"
