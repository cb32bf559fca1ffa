"""Per-backend facts as data: capabilities, the package that implements the protocol, the storage
options ckptfs sets by default, and how each guarantee is obtained.

Looked up once, by the fsspec filesystem's own protocol names, when a store is opened; the rest
of ckptfs reads the resulting `Capabilities` and never inspects URLs.
`capability_table` renders this table for docs/backends.md (a test keeps the two in step)
and ``ckptfs doctor`` checks a live store against it.

Default options are merged *under* the user's (the user's win; dict-valued options such as
s3fs's ``config_kwargs`` are merged one level deep).  They exist for three reasons:

- listing caches off (``use_listings_cache=False``) and fsspec's instance cache off
  (``skip_instance_cache=True``): a commit by another process must be visible at once, and a
  store must never reuse a client bound to credentials or an endpoint it was not given;
- bounded retries and timeouts where the library lets us set them (botocore's), so a dead
  endpoint fails in seconds;
- nothing else: every other default is the library's own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import InvalidURLError
from ckptfs.storage.base import Capabilities

#: botocore: fail a refused/blackholed connection in seconds, keep AWS's standard retry mode
#: (3 attempts, with backoff, for throttling and 5xx).  botocore's legacy default is 5 attempts
#: and a 60 s connect timeout: about 12 s for a closed port, minutes for a blackholed one.
S3_CONFIG: Mapping[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}


@dataclass(frozen=True)
class BackendSpec:
    capabilities: Capabilities
    package: str | None
    #: Options merged under the user's (the user's win): keep listings fresh, so that a commit by
    #: another process is seen at once, and bound retries.
    default_options: Mapping[str, Any] = field(default_factory=dict)
    #: Options for streaming reads (``open(path, "rb", **read_options)``).
    read_options: Mapping[str, Any] = field(default_factory=dict)
    #: Options for whole-object reads (``cat_file(path, **cat_options)``).
    cat_options: Mapping[str, Any] = field(default_factory=dict)
    #: The weaker guarantee, stated when exclusive create is not enforced across processes.
    caveat: str = ""
    #: A file being written is visible (half-written) under its name at once, so an aborted
    #: write must delete it (fsspec's memory filesystem).
    partial_visible: bool = False
    #: Reads return one shared file object per path (memory): read through ``cat_file``.
    shared_read_handles: bool = False
    #: How ``create_exclusive`` is done on this backend, in words (docs, doctor).
    exclusive_how: str = "not available"
    #: Which empty-create behaviour of the library the ``empty_create_safe`` flag records.
    empty_create_note: str = ""
    #: How listings are kept fresh (docs, doctor).
    listing_cache: str = ""
    #: What an aborted streaming write leaves behind, and how ckptfs cleans it up.
    abort: str = ""
    #: Check the bucket/container on open (one cheap request, bounded in time), so a missing
    #: bucket, bad credentials or a dead endpoint fail at ``ckptfs.open`` before anything is
    #: written.  Off for local disk and memory (nothing to reach).
    probe_on_open: bool = False
    #: The smallest block size the library accepts for a streaming write split into several
    #: requests (S3 multipart parts, GCS resumable chunks, Azure blocks); ``None`` where a
    #: streaming write is one stream (local, memory).  The doctor writes objects larger than it.
    min_block_size: int | None = None
    #: The part size of ckptfs's streaming writes (``block_size`` given to the library), and
    #: how many part-sized buffers one open stream holds at its peak: the library's buffer, the
    #: part copied out of it for the request, and the HTTP layer's copy of the body while it is
    #: sent.  Their product is the memory one stream costs (``stream_buffer_bytes``); the save
    #: caps the sum over its parallel streams (``ckptfs.protocol.commit.WRITE_BUFFER_BUDGET``).
    #: ``None``/0 where a write goes straight to the OS (local) or to a dict (memory).
    write_block_size: int | None = None
    write_block_copies: int = 0
    #: The keys of the library's ``info`` that carry an object's modification time, in order
    #: of preference; empty where none is known (then the store does not offer
    #: `ModifiedTimes`, and GC leaves files it cannot age alone).
    mtime_keys: tuple[str, ...] = ()
    #: The whole-object checksums the store keeps for objects ckptfs writes through the
    #: library, and reports from a metadata request (names of
    #: ``ckptfs.format.hashing.STORE_CHECKSUMS``); empty where it keeps none that ckptfs can
    #: compute.  The store offers `ServerChecksums` where this is
    #: not empty (docs/remote-verify.md).
    server_checksums: tuple[str, ...] = ()

    @property
    def stream_buffer_bytes(self) -> int:
        """Peak bytes one open streaming write holds in this process (0: none beyond the
        caller's own chunk)."""
        return (self.write_block_size or 0) * self.write_block_copies


#: Object stores: one part per 8 MiB written instead of the library's default block (s3fs:
#: 50 MiB), so a stream costs ~3 x 8 MiB and two streams fit the save's 64 MiB budget (one
#: stream of 16 MiB parts saved 1 GiB to moto 1.9x slower than two).  S3 allows 10,000 parts:
#: ~80 GiB per object, far above a shard (512 MiB by default).
_OBJECT_BLOCK = 8 * 2**20
_OBJECT_COPIES = 3


_LOCAL = BackendSpec(
    Capabilities("file", exclusive_create="os_excl", atomic_rename=True, fsync=True,
                 empty_create_safe=True, real_directories=True, shared=True,
                 exclusive_multipart=True),
    package=None,
    exclusive_how="write + fsync a private temporary file, then link(2) it to the name "
    "(EEXIST if taken): atomic, and never a partial marker",
    empty_create_note='open("xb") is O_EXCL whatever the size',
    listing_cache="none (os.scandir)",
    abort="the partial file stays inside the hidden .tmp- attempt directory, removed with it",
    mtime_keys=("mtime",),
)
_MEMORY = BackendSpec(
    Capabilities("memory", exclusive_create="process_lock", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=False,
                 exclusive_multipart=True),
    package=None,
    partial_visible=True,
    shared_read_handles=True,
    caveat="memory:// is private to this process: exclusive create is enforced by a lock in "
    "this process only",
    exclusive_how="exists-check + write under a lock held by this process",
    empty_create_note='open("xb") checks existence first',
    listing_cache="none (one dict per process)",
    abort="a file opened for writing is visible at once: ckptfs deletes it on abort",
    mtime_keys=("created",),
)
_S3 = BackendSpec(
    Capabilities("s3", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=False, real_directories=False, shared=True,
                 exclusive_multipart=True),
    package="s3fs",
    default_options={"use_listings_cache": False, "skip_instance_cache": True,
                     "config_kwargs": S3_CONFIG},
    read_options={"cache_type": "none"},
    # s3fs's cat_file otherwise sends a HEAD before each GET (to decide on a concurrent
    # download): resolving latest would take 5 requests instead of 3.
    cat_options={"max_concurrency": 1},
    exclusive_how="PutObject with If-None-Match: * (s3fs pipe_file(mode='create')); 412 "
    "PreconditionFailed in any exception class means taken",
    empty_create_note='s3fs open("xb") closed with zero bytes calls touch(), an unconditional '
    "PutObject that truncates an existing object",
    listing_cache="use_listings_cache=False, skip_instance_cache=True, invalidate_cache() and "
    "ls(refresh=True) before every listing",
    abort="the multipart upload is aborted (AbortMultipartUpload) on an exception in the block "
    "or a failed close",
    probe_on_open=True,
    min_block_size=5 * 2**20,
    write_block_size=_OBJECT_BLOCK,
    write_block_copies=_OBJECT_COPIES,
    mtime_keys=("LastModified",),
    # botocore (>= 1.36, without awscrt) sends a CRC32 of every PutObject body, which S3 keeps
    # as the object's full-object checksum; multi-part uploads: see docs/remote-verify.md.
    server_checksums=("crc32",),
)
_GCS = BackendSpec(
    Capabilities("gs", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=True,
                 exclusive_multipart=True),
    package="gcsfs",
    default_options={"skip_instance_cache": True, "use_listings_cache": False},
    read_options={"cache_type": "none"},
    exclusive_how="upload with ifGenerationMatch=0 (gcsfs pipe_file(mode='create'), a single "
    "multipart/related request below the block size); 412 means taken",
    empty_create_note='gcsfs open("xb") with zero bytes is a single upload with '
    "ifGenerationMatch=0",
    listing_cache="use_listings_cache=False, skip_instance_cache=True, invalidate_cache() and "
    "ls(refresh=True) before every listing",
    abort="the resumable upload session is cancelled (DELETE of the session URL)",
    probe_on_open=True,
    min_block_size=256 * 2**10,
    write_block_size=_OBJECT_BLOCK,
    write_block_copies=_OBJECT_COPIES,
    mtime_keys=("mtime", "updated"),
    # GCS computes a crc32c of every object (composite objects included).
    server_checksums=("crc32c",),
)
_AZURE = BackendSpec(
    Capabilities("az", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=True,
                 exclusive_multipart=True),
    package="adlfs",
    default_options={"skip_instance_cache": True, "use_listings_cache": False},
    read_options={"cache_type": "none"},
    exclusive_how="Put Blob with If-None-Match: * (adlfs pipe_file(mode='create')); "
    "BlobAlreadyExists / 409 / 412 means taken",
    empty_create_note="adlfs sends If-None-Match: * for empty blobs too",
    listing_cache="use_listings_cache=False, skip_instance_cache=True, invalidate_cache() before "
    "every listing (adlfs ignores ls(refresh=True))",
    abort="staged blocks are never committed (no Put Block List); the service drops them "
    "after 7 days",
    probe_on_open=True,
    min_block_size=256 * 2**10,
    write_block_size=_OBJECT_BLOCK,
    write_block_copies=_OBJECT_COPIES,
    mtime_keys=("last_modified",),
)

#: The package that implements a protocol -> the extra of ckptfs that installs it
#: (pyproject.toml), named by the error of a store whose package is missing.
EXTRAS: Mapping[str, str] = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "az"}

#: fsspec protocol name -> spec.  Unknown protocols get a conservative spec (no exclusive create,
#: no rename), which the store reports when opened.
BACKENDS: dict[str, BackendSpec] = {
    "file": _LOCAL, "local": _LOCAL,
    "memory": _MEMORY,
    "s3": _S3, "s3a": _S3,
    "gs": _GCS, "gcs": _GCS,
    "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE,
}

_UNKNOWN_CAVEAT = (
    "this backend has no create-only write known to ckptfs: two writers racing on the same "
    "step can both 'commit'; the last marker wins, and verify detects a mix of files. Run one "
    "writer per run root, or use a backend with exclusive create (local, s3, gs, az)"
)


def spec_for(protocols: str | tuple[str, ...]) -> BackendSpec:
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    for name in names:
        if name in BACKENDS:
            return BACKENDS[name]
    return BackendSpec(
        Capabilities(names[0] if names else "unknown", exclusive_create="none",
                     atomic_rename=False, fsync=False, empty_create_safe=False,
                     real_directories=False, shared=True),
        package=None,
        caveat=_UNKNOWN_CAVEAT,
        exclusive_how="none: exists-check then write (racy)",
        listing_cache="invalidate_cache() and ls(refresh=True) where the library accepts it",
    )


#: ``name:`` at the start of a URL: a protocol's shape (RFC 3986: a letter, then letters,
#: digits, ``+``, ``-``, ``.``), not followed by a second ``:`` (fsspec's ``a::b`` chaining).
_SCHEME_PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?!:)(.*)", re.DOTALL)
#: Protocols fsspec reads a ``name:`` prefix of (``file:/x`` is ``/x``): legal without ``//``.
_PREFIX_PROTOCOLS = frozenset({"file", "local"})


def check_url(url: str) -> None:
    """Refuse a run root URL that fsspec would take for a local relative path although it was
    almost surely meant as a URL: a protocol followed by one slash or none (``s3:/bucket/run``,
    ``s3:bucket/run``, ``gs:/b``, ``memory:/x``) opens ``./s3:/bucket/run`` on local disk, where
    a save "succeeds" and the checkpoint disappears with the node.

    Refused (`InvalidURLError`, naming the URL and ``s3://bucket/run``): any ``name:`` prefix
    whose first path component ends in ``:`` (``foo:/x``, ``s3:``), and a known protocol's
    ``name:`` prefix followed by anything but ``//`` (``s3:bucket``); each link of a chained
    URL (``simplecache::s3:/b``) alike.  Left alone: ``file:`` and ``local:``, which fsspec
    reads as local paths (``file:/data/run`` is ``/data/run``), an unknown name followed by
    more than a slash (``run:1/x``, a directory named ``run:1``), and on Windows a drive
    letter (``C:/x``).  A local directory whose name ends in ``:`` is written ``./s3:/x``
    or as an absolute path."""
    if os.name == "nt" and re.match(r"[A-Za-z]:[\\/]", url):
        return
    for link in url.split("::"):
        m = _SCHEME_PREFIX.fullmatch(link)
        if m is None or m.group(2).startswith("//"):
            continue
        name, rest = m.group(1), m.group(2)
        if name.lower() in _PREFIX_PROTOCOLS:
            continue
        if len(name) == 1 and rest.startswith(("/", "\\")):
            raise InvalidURLError(
                f"{url!r} looks like a Windows drive path; on this system it is the local "
                f"relative path './{link}'. Write './{link}' if that is meant, or an absolute "
                "path or URL (file:///..., s3://bucket/...)")
        first_ends_in_colon = rest == "" or rest.startswith("/")
        if not first_ends_in_colon and not _known_protocol(name):
            continue
        intended = f"{name.lower()}://{rest.lstrip('/')}"
        raise InvalidURLError(
            f"{url!r}: without '//' after '{name}:' fsspec reads this as the local relative "
            f"path './{link}', and a checkpoint saved there stays on this "
            f"machine's disk. Did you mean {intended!r}? (A local directory of that name: write "
            f"'./{link}' or an absolute path.)")


def _known_protocol(name: str) -> bool:
    """Whether fsspec knows ``name`` as a protocol (registered or importable by name)."""
    from fsspec.registry import known_implementations, registry

    lower = name.lower()
    return lower in BACKENDS or lower in known_implementations or lower in registry


def endpoint_of(protocol: str, options: Mapping[str, Any]) -> str | None:
    """The endpoint URL an object store's library will connect to, from the storage options
    and the environment as the library reads them (its own default where none is given);
    None where ckptfs does not know it.  The open-time probe resolves its host first."""
    env = os.environ
    if protocol in ("s3", "s3a"):
        client = options.get("client_kwargs")
        given = (options.get("endpoint_url")
                 or (client.get("endpoint_url") if isinstance(client, Mapping) else None)
                 or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
        if given:
            return str(given)
        # botocore also reads an endpoint_url from the config file's profile: then unknown
        config = os.path.expanduser(env.get("AWS_CONFIG_FILE", "~/.aws/config"))
        try:
            with open(config, encoding="utf-8", errors="replace") as f:
                if "endpoint_url" in f.read():
                    return None
        except OSError:
            pass
        return "https://s3.amazonaws.com"
    if protocol in ("gs", "gcs"):  # as gcsfs.core._location decides (mTLS aside)
        emulator = env.get("STORAGE_EMULATOR_HOST", "")
        if emulator and emulator != "default" and "://" not in emulator:
            emulator = f"http://{emulator}"
        universe = env.get("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "googleapis.com")
        return str(options.get("endpoint_url") or (emulator != "default" and emulator)
                   or f"https://storage.{universe}")
    if protocol in ("az", "abfs", "abfss"):
        if options.get("account_url"):
            return str(options["account_url"])
        parts = dict(p.split("=", 1) for p in str(options.get("connection_string") or "")
                     .split(";") if "=" in p)
        if parts.get("BlobEndpoint"):
            return parts["BlobEndpoint"]
        account = parts.get("AccountName") or options.get("account_name")
        suffix = parts.get("EndpointSuffix", "core.windows.net")
        return f"https://{account}.blob.{suffix}" if account else None
    return None


def merge_options(defaults: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """The user's options over ours; dict values (``config_kwargs``) merged one level deep."""
    out = dict(defaults)
    for key, value in user.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


_TABLE_BACKENDS = (("local (file://)", _LOCAL), ("memory://", _MEMORY), ("S3 (s3://)", _S3),
                   ("GCS (gs://)", _GCS), ("Azure Blob (az://)", _AZURE))


def capability_table() -> str:
    """The capability table of docs/backends.md, rendered from this module (markdown)."""
    def yn(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = ["| backend | package | exclusive create | how | multi-request create-only | "
            "empty create safe | atomic rename | fsync | listing caches |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, spec in _TABLE_BACKENDS:
        c = spec.capabilities
        rows.append(
            f"| {label} | {spec.package or '-'} | {c.exclusive_create} | {spec.exclusive_how} | "
            f"{yn(c.exclusive_multipart)} | {yn(c.empty_create_safe)} | {yn(c.atomic_rename)} | "
            f"{yn(c.fsync)} | {spec.listing_cache} |")
    return "\n".join(rows)
