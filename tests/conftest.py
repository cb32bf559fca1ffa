"""Shared fixtures.  Backends that need a server start it once per session (see
tests/test_backend_*.py); local and memory need nothing."""

from __future__ import annotations

import os

# gcsfs makes a failing gRPC call on every open against an emulator unless this is set before
# it is imported (see docs/backends.md).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest

from ckptfs.testing.backend import Backend, unique_name


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run the larger sweeps")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="larger sweep: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def local_backend(tmp_path) -> Backend:  # type: ignore[no-untyped-def]
    return Backend("local", f"file://{tmp_path}/{unique_name()}")


@pytest.fixture
def memory_backend() -> Backend:
    return Backend("memory", f"memory://{unique_name()}")
