"""``ckptfs doctor`` against every backend: the guarantees ckptfs needs hold, the known
differences between servers are reported as such, the CLI's text, ``--json`` and exit status,
and nothing is left behind."""

from __future__ import annotations

import json
import uuid
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ckptfs.cli import core as cli
from ckptfs.cli.doctor import PREFIX, run_doctor
from ckptfs.errors import StorageNotFoundError
from ckptfs.testing.backend import Backend
from ckptfs.testing.servers import ServerInfo

NEEDED = ["exclusive_create", "create_race", "listing_fresh", "delete_visible", "ranged_read"]

#: What each server really does for the two checks ckptfs does not need (measured; see
#: docs/backends.md): fake-gcs-server ignores ifGenerationMatch=0 on resumable uploads (which
#: gcsfs uses for every open("xb"), even empty ones); s3fs turns a zero-byte "xb" into an
#: unconditional PutObject.
KNOWN = {
    "local": {"exclusive_multipart": "n/a", "empty_create": "held"},
    "memory": {"exclusive_multipart": "n/a", "empty_create": "held"},
    "s3-moto": {"exclusive_multipart": "held", "empty_create": "not held"},
    "s3-ministack": {"exclusive_multipart": "held", "empty_create": "not held"},
    "gcs-fake": {"exclusive_multipart": "not held", "empty_create": "not held"},
    "azure-azurite": {"exclusive_multipart": "held", "empty_create": "held"},
}


def test_doctor_on_every_backend(any_backend: Backend) -> None:
    backend = any_backend
    backend.raw_write("keep/user-file.bin", b"the user's data")  # must survive the doctor
    report = run_doctor(backend.url, **backend.options)
    by_name = {c.name: c for c in report.checks}
    assert list(by_name) == [*NEEDED, "exclusive_multipart", "empty_create"]
    for name in NEEDED:
        assert by_name[name].needed and by_name[name].status == "held", by_name[name]
    for name, status in KNOWN[backend.name].items():
        assert by_name[name].status == status, by_name[name]
        assert not by_name[name].needed
    assert report.ok
    assert report.leftovers == []
    assert backend.raw_files() == {"keep/user-file.bin": len(b"the user's data")}
    assert "1 of 8 won" in by_name["create_race"].detail
    text = report.render()
    assert "verdict: OK" in text and "cleanup: everything removed" in text


def test_doctor_names_the_libraries_412_shapes(s3_backend: Backend,
                                              ministack_backend: Backend) -> None:
    moto = run_doctor(s3_backend.url, **s3_backend.options).check("exclusive_create")
    mini = run_doctor(ministack_backend.url, **ministack_backend.options).check(
        "exclusive_create")
    assert moto.detail.startswith("refused with FileExistsError carrying 412")
    assert mini.detail.startswith("refused with OSError(errno 22) carrying 412")


def test_doctor_reports_truncating_empty_create_on_s3(s3_backend: Backend) -> None:
    check = run_doctor(s3_backend.url, **s3_backend.options).check("empty_create")
    assert check.status == "not held" and "truncated to 0 bytes" in check.detail
    assert "never writes an empty marker" in check.meaning


def test_doctor_reports_fake_gcs_resumable_gap(gcs_backend: Backend) -> None:
    check = run_doctor(gcs_backend.url, **gcs_backend.options).check("exclusive_multipart")
    assert check.status == "not held" and check.declared == "yes"
    assert "succeeded" in check.detail


# -- the CLI -----------------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def _opts(options: dict[str, Any]) -> list[str]:
    out = []
    for k, v in options.items():
        out += ["-o", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return out


def test_cli_json_and_exit_status(s3_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(capsys, "doctor", s3_backend.url, "--json", *_opts(dict(s3_backend.options)))
    assert code == 0
    payload = json.loads(out)
    assert payload["ok"] is True and payload["leftovers"] == []
    assert {c["name"]: c["status"] for c in payload["checks"]}["empty_create"] == "not held"
    assert payload["probe_url"].startswith(f"{s3_backend.url}/{PREFIX}")
    assert s3_backend.raw_files() == {}


def test_cli_text(memory_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(capsys, "doctor", memory_backend.url)
    assert code == 0
    assert "| exclusive_create | yes | held |" in out and "verdict: OK" in out


def test_cli_missing_bucket_is_usage_error(moto: ServerInfo,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url = "s3://no-such-bucket-ckptfs/scratch"
    with pytest.raises(StorageNotFoundError):
        run_doctor(url, **moto.storage_options)
    code = cli.main(["doctor", url, *_opts(dict(moto.storage_options))])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and url in err and "does not exist" in err


class BlindMemoryFS(MemoryFileSystem):  # type: ignore[misc]
    """A store without create-only writes whose existence check of a marker says "absent" (an
    eventually consistent HEAD, a proxy that caches 404s): the exists-then-write fallback of a
    backend without exclusive create lets a second writer overwrite."""

    protocol = ("ckptfs-blindmem",)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return False if str(path).endswith("COMPLETE") else bool(super().exists(path, **kwargs))


fsspec.register_implementation("ckptfs-blindmem", BlindMemoryFS, clobber=True)


def test_missing_guarantee_fails_the_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"ckptfs-blindmem://{uuid.uuid4().hex}/scratch"
    report = run_doctor(url)
    check = report.check("exclusive_create")
    assert check.status == "not held" and "second create succeeded" in check.detail
    assert "both 'commit'" in check.meaning
    assert not report.ok
    assert report.leftovers == []
    code, out = _cli(capsys, "doctor", url)
    assert code == cli.EXIT_FAILED and "verdict: FAILED: exclusive_create" in out
