"""Shared fixtures.  Backends that need a server start it once per session (see
tests/storage/test_backend_*.py); local and memory need nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator

# gcsfs makes a failing gRPC call on every open against an emulator unless this is set before
# it is imported (see docs/backends.md).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest

from ckptfs.testing.backend import Backend, unique_name
from ckptfs.torch_versions import SHARDED_TORCH_FLOOR, floor_text, sharded_supported, torch_version


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run the larger sweeps")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not sharded_supported():
        # Below the sharded floor ckptfs refuses sharded checkpoints with TorchCompatError
        # (tests/project/test_torch_compat.py checks it); the torch matrix runs these tests
        # on 2.9.1 and 2.14.1 (docs/installation.md).
        old = pytest.mark.skip(
            reason=f"sharded checkpoints need torch >= {floor_text(SHARDED_TORCH_FLOOR)}: "
                   f"this torch is {torch_version()} (refused with TorchCompatError)")
        for item in items:
            if "sharded" in item.keywords:
                item.add_marker(old)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="larger sweep: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_determinism_restored() -> Iterator[None]:
    """A test that turns torch's deterministic algorithms on (Lightning's
    ``Trainer(deterministic=True)`` does, globally) leaves them as they were for the next
    test: with them on, ``torch.empty`` fills new memory on OpenMP threads, and a later test's
    forked child then hangs in libgomp (seen in CI's torch 2.6 matrix)."""
    import torch

    on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    if (torch.are_deterministic_algorithms_enabled() != on
            or torch.is_deterministic_algorithms_warn_only_enabled() != warn_only):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)


@pytest.fixture
def local_backend(tmp_path) -> Backend:  # type: ignore[no-untyped-def]
    return Backend("local", f"file://{tmp_path}/{unique_name()}")


@pytest.fixture
def memory_backend() -> Backend:
    return Backend("memory", f"memory://{unique_name()}")


# -- storage servers ---------------------------------------------------------------------------
# One server per session on a free loopback port (fixed ports collide between parallel runs),
# reset before each test that uses it, stopped in the context manager's ``finally``.  A server
# that cannot start fails the tests that need it (never a silent skip): the README's set-up
# installs all of them.

from ckptfs.testing import servers  # noqa: E402


def _server(name: str) -> Iterator[servers.ServerInfo]:
    reason = servers.available(name)
    if reason is not None:
        pytest.fail(f"storage server {name!r} unavailable: {reason}; run scripts/setup.sh")
    with servers.SERVERS[name]() as info:
        yield info


@pytest.fixture(scope="session")
def moto() -> Iterator[servers.ServerInfo]:
    yield from _server("moto")


@pytest.fixture(scope="session")
def ministack() -> Iterator[servers.ServerInfo]:
    yield from _server("ministack")


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[servers.ServerInfo]:
    yield from _server("gcs")


@pytest.fixture(scope="session")
def azurite() -> Iterator[servers.ServerInfo]:
    yield from _server("azurite")


def server_backend(name: str, info: servers.ServerInfo) -> Backend:
    info.reset()
    return Backend(name, info.url(unique_name()), dict(info.storage_options), env=dict(info.env))


@pytest.fixture
def s3_backend(moto: servers.ServerInfo) -> Backend:
    return server_backend("s3-moto", moto)


@pytest.fixture
def ministack_backend(ministack: servers.ServerInfo) -> Backend:
    return server_backend("s3-ministack", ministack)


@pytest.fixture
def gcs_backend(fake_gcs: servers.ServerInfo) -> Backend:
    return server_backend("gcs-fake", fake_gcs)


@pytest.fixture
def azure_backend(azurite: servers.ServerInfo) -> Backend:
    return server_backend("azure-azurite", azurite)


ALL_BACKENDS = ["local", "memory", "s3", "ministack", "gcs", "azure"]


@pytest.fixture(params=ALL_BACKENDS)
def any_backend(request: pytest.FixtureRequest) -> Backend:
    """Every backend, for tests that are not conformance classes (e.g. crash sweeps)."""
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]
