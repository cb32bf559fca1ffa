"""The pure layout module and the manifest/marker codecs."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from ckptfs.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    InvalidStepError,
    UnsafeCheckpointError,
)
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import (
    MAX_STEP,
    StepPaths,
    check_relpath,
    new_attempt_name,
    parse_attempt_name,
    parse_step_dir,
    step_dir_name,
)
from ckptfs.format.manifest import FileEntry, Manifest, Marker

ATTEMPT = "a-20261130T012500Z-3f9c2a1b0c4d5e6f"


def test_step_names_roundtrip_and_order() -> None:
    for step in (0, 1, 999, 10**6, MAX_STEP):
        assert parse_step_dir(step_dir_name(step)) == step
    assert step_dir_name(1000) == "step-000000001000"
    assert parse_step_dir("checkpoints/step-000000000042/") == 42
    for bad in ("step-1", "step-00000000001a", "Step-000000000001", "step-000000000001.tmp",
                "latest", "step-", "step-9999999999999"):
        assert parse_step_dir(bad) is None, bad
    with pytest.raises(InvalidStepError):
        step_dir_name(MAX_STEP + 1)


def test_attempt_names_unique_and_dated() -> None:
    when = datetime(2026, 11, 30, 1, 25, tzinfo=timezone.utc)
    name = new_attempt_name(when)
    assert parse_attempt_name(name) == when
    assert len({new_attempt_name(when) for _ in range(1000)}) == 1000
    assert parse_attempt_name("a-2026-bad") is None


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a\\b", "a\x00b",
                                 "s3://bucket/x", "C:/x", "", "a//b", ".hidden", "a/./b",
                                 "MANIFEST.json", "COMPLETE", "x" * 600, 5, None])
def test_check_relpath_rejects(bad: object) -> None:
    with pytest.raises(UnsafeCheckpointError):
        check_relpath(bad)


def test_check_relpath_accepts() -> None:
    for ok in ("state.msgpack", "tensors-00000.safetensors", "sub/dir/file_1.bin"):
        assert check_relpath(ok) == ok


def test_step_paths() -> None:
    p = StepPaths(5)
    assert p.marker == "checkpoints/step-000000000005/COMPLETE"
    assert p.manifest(ATTEMPT) == f"checkpoints/step-000000000005/{ATTEMPT}/MANIFEST.json"
    with pytest.raises(UnsafeCheckpointError):
        p.file(ATTEMPT, "../COMPLETE")


def _manifest() -> Manifest:
    return Manifest(5, ATTEMPT, (FileEntry("state.msgpack", 10, digest_bytes("sha256", b"x")),),
                    "2026-11-30T01:25:00+00:00", "sha256", {"tensor_count": 0})


def test_manifest_roundtrip() -> None:
    m = _manifest()
    assert Manifest.from_bytes(m.to_bytes()) == m


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("files"),
    lambda d: d.update(step=-1),
    lambda d: d.update(step="5"),
    lambda d: d.update(attempt="../x"),
    lambda d: d.update(schema="other"),
    lambda d: d["files"][0].update(size=-1),
    lambda d: d["files"][0].update(size=2**60),
    lambda d: d["files"][0].update(digest="md5:abc"),
    lambda d: d["files"][0].update(digest="sha256:XYZ"),
    lambda d: d["files"].append(dict(d["files"][0])),
    lambda d: d["files"][0].update(path="../../etc/passwd"),
    lambda d: d.update(metadata=[1]),
])
def test_manifest_rejects(mutate) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(_manifest().to_bytes())
    mutate(doc)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[]", b"{", b'{"schema": NaN}',
                                  b"x" * (65 * 1024 * 1024)])
def test_manifest_rejects_garbage(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_bytes(data)


def test_marker_binds_manifest() -> None:
    mbytes = _manifest().to_bytes()
    marker = Marker(5, ATTEMPT, digest_bytes("sha256", mbytes), len(mbytes), "t")
    again = Marker.from_bytes(marker.to_bytes())
    assert again == marker
    again.check_manifest(mbytes, where="m")
    with pytest.raises(CorruptCheckpointError, match="does not match its commit marker"):
        again.check_manifest(mbytes.replace(b"10", b"11"), where="m")
    assert marker.to_bytes()  # never empty


def test_marker_newer_version() -> None:
    doc = json.loads(Marker(5, ATTEMPT, digest_bytes("sha256", b"m"), 1, "t").to_bytes())
    doc["format_version"] = 99
    with pytest.raises(FormatVersionError):
        Marker.from_bytes(json.dumps(doc).encode())


# -- one model: a format version is a set of features ---------------------------------------


def _featured(feats: frozenset[str]) -> Manifest:
    """A well-formed manifest of every feature set the table names: v1's whole file, or the
    chunked files a sharded (rank file + dcp.msgpack) or single-process (state.msgpack)
    checkpoint has, with one reference where the features carry references; with rank
    metadata, the tensor spec and one block of the table of rank files instead of the rank
    files."""
    from ckptfs.format.entries import Chunk, RankTable, Reference, make_entry
    from ckptfs.format.features import RANK_METADATA
    from ckptfs.format.layout import SPEC_NAME, table_block_name
    from ckptfs.format.versions import REFERENCES, SHARDED

    if not feats:
        return _manifest()
    hexd = "ab" * 32
    if RANK_METADATA in feats:
        files = (make_entry(SPEC_NAME, 4, "sha256", [Chunk(0, 4, hexd)], None),
                 make_entry(table_block_name(0), 170, "sha256", [Chunk(0, 170, hexd)],
                            None))
        return Manifest(5, ATTEMPT, files, "2026-11-30T01:25:00+00:00", "sha256", {}, feats,
                        world_size=2, rank_table=RankTable(128, 2, 100))
    if SHARDED in feats:
        files = (make_entry("dcp.msgpack", 4, "sha256", [Chunk(0, 4, hexd)], None),
                 make_entry("rank-00000/data-0.safetensors", 6, "sha256",
                            [Chunk(0, 2, hexd), Chunk(2, 4, hexd)], 0))
        source = "rank-00001/data-0.safetensors"
    else:
        files = (make_entry("state.msgpack", 4, "sha256", [Chunk(0, 4, hexd)], None),)
        source = "tensors-00000.safetensors"
    refs = (Reference("ref-00000.safetensors", 1, "a-20261130T000000Z-0123456789abcdef",
                      source, 10, "sha256", (Chunk(0, 2, hexd), Chunk(4, 3, hexd))),
            ) if REFERENCES in feats else ()
    return Manifest(5, ATTEMPT, files, "2026-11-30T01:25:00+00:00", "sha256", {}, feats,
                    world_size=2 if SHARDED in feats else 0, references=refs)


def test_the_version_is_the_name_of_the_features() -> None:
    """Every version of the table round-trips through the one encoder and decoder, and its
    manifest's ``format_version`` is derived from its features (the table's inverse)."""
    from ckptfs.format.versions import FEATURES, VERSIONS, decode_manifest, features

    assert {feats: v for v, feats in FEATURES.items()} == VERSIONS
    for version, feats in FEATURES.items():
        m = _featured(feats)
        assert m.format_version == version and features(m) == feats
        back = decode_manifest(m.to_bytes())
        assert back == m and back.to_bytes() == m.to_bytes(), version


def test_methods_behave_per_feature() -> None:
    """What only some versions had exists on the one model: without references, none;
    without chunks, no chunked file; a reference seen as a chunked file where it has one."""
    from ckptfs.format.entries import ReferencedFile
    from ckptfs.format.versions import FEATURES

    v1 = _featured(FEATURES[1])
    assert v1.references == () and v1.reference("state.msgpack") is None
    assert v1.logical_bytes == v1.bytes_written == v1.total_bytes
    with pytest.raises(KeyError):
        v1.chunked("state.msgpack")
    for version in (3, 4):
        m = _featured(FEATURES[version])
        ref = m.references[0]
        assert m.reference(ref.path) is ref
        assert m.logical_bytes == m.bytes_written + ref.used_bytes
        seen = m.chunked(ref.path)
        assert isinstance(seen, ReferencedFile) and seen.location == ref.location


def test_a_feature_set_no_version_names_is_refused() -> None:
    from ckptfs.format.entries import Chunk, Reference
    from ckptfs.format.versions import CHUNKED, REFERENCES, SHARDED

    for feats in ({SHARDED}, {REFERENCES}, {CHUNKED}, {SHARDED, REFERENCES}, {"compressed"}):
        with pytest.raises(ValueError, match="no manifest format version"):
            Manifest(5, ATTEMPT, (), "t", "sha256", {}, frozenset(feats))
    with pytest.raises(ValueError, match="sharded"):
        Manifest(5, ATTEMPT, (), "t", "sha256", {}, world_size=2)
    ref = Reference("r", 1, ATTEMPT, "x", 1, "sha256", (Chunk(0, 1, "ab" * 32),))
    with pytest.raises(ValueError, match="references"):
        Manifest(5, ATTEMPT, (), "t", "sha256", {}, frozenset({SHARDED, CHUNKED}),
                 world_size=1, references=(ref,))
