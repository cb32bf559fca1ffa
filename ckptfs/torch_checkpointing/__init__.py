"""A torch_checkpointing ``Storage`` over any URL ckptfs reaches, committed by a marker.

meta-pytorch's torch_checkpointing (the "DCPv2" torchtitan's ``TorchCheckpointingManager``
drives) writes every rank's files under ``tmp_<name>``, rank 0 adds ``metadata.pkl``, and the
save is committed by ``Storage.rename(tmp_<name>, <name>, is_directory=True)``.  Its only
backend is the local filesystem, it hashes nothing, and on an object store a directory rename
is a copy of every object followed by deletes: a job killed half way leaves ``<name>`` holding
some of the files (``metadata.pkl`` among them, possibly), which step discovery accepts.

`CkptfsStorage` keeps the files where they were written and makes the rename one request:

* **The commit is an exclusive marker.**  ``rename(<parent>/tmp_x, <parent>/x,
  is_directory=True)`` lists ``tmp_x`` once and creates ``<parent>/.ckptfs-commit.x`` with
  ckptfs's exclusive create (``O_EXCL``/``link`` on disk, ``If-None-Match: *`` on S3 and
  Azure, ``ifGenerationMatch=0`` on GCS, a lock in the process for ``memory://``).  The
  marker names the source directory and is the manifest of the committed directory: every
  file's size and content digests.  It is O(1) in the size of the checkpoint and atomic on
  every backend: before it exists, ``x`` does not; after, all of ``x`` does.  An occupied
  destination (a committed ``x``, a file, a directory with anything in it) raises
  ``FileExistsError`` and is never merged into, as the ``Storage.rename`` contract requires;
  two jobs committing the same name race on the marker and exactly one wins.
* **``x`` is a logical directory.**  Its listing, ``exists``, ``isdir``, ``getsize`` come from
  the marker (its manifest, immutable, cached once read); its files are read from the source
  directory.  ``ls(<parent>)`` shows ``x`` and hides ``tmp_x``; an uncommitted ``tmp_y`` (a
  job killed before its commit) stays visible under its own name, so torchtitan's retention
  deletes it, and a committed ``x`` is never half there.  Committed files are immutable:
  writing or deleting inside ``x`` raises; ``rmdir(x)`` deletes the marker first (``x`` is
  gone at once), then the source's files.
* **Content is hashed while written and verified when read.**  Each stream written through
  this storage records its size and the digests of its blocks (`DEFAULT_BLOCK_SIZE`, ckptfs's
  `DEFAULT_ALGORITHM`) in a small sidecar (``.ckptfs-sum.<file>``) when it closes, so rank
  N's files are hashed by rank N from bytes already in memory; the commit copies the sidecars
  into the marker (a file without one, or whose size changed, is hashed there).  Every read,
  whole or ranged (``seek`` + ``readinto``, as torch_checkpointing's resharder and parallel
  mmap fill do), fetches whole blocks and checks each against its digest before returning a
  byte: a flipped byte raises `ckptfs.errors.CorruptCheckpointError` naming the file.

Layout under the storage's root URL (``.ckptfs-*`` names are never listed)::

    outputs/checkpoint/
      .ckptfs-commit.step-10      # marker: {"source": "outputs/checkpoint/tmp_step-10", files}
      tmp_step-10/                # the files of step-10 (hidden: committed as step-10)
        metadata.pkl  model_0.pt  .ckptfs-sum.metadata.pkl  .ckptfs-sum.model_0.pt
      tmp_step-20/                # a save killed before its commit: visible, not a step
        model_0.pt  .ckptfs-sum.model_0.pt

Paths: torch_checkpointing passes ``pathlib.Path`` objects, which cannot hold a URL
(``Path("s3://b/x")`` is ``s3:/b/x``), so paths are names under the root URL: a relative path
is relative to the URL; an absolute path is accepted under ``mount`` (a local prefix that
stands for the URL, e.g. the directory a job would have used on disk) and refused otherwise.
``remap_path`` gives the URL a path stands for.

Costs and limits: each operation on a path that is not inside a committed directory already
seen lists each level of the path once (markers live in their parent's listing; a marker read
is cached, it never changes): on S3 (moto) one save of a tiny model by
``CheckpointManager`` with four files under ``outputs/checkpoint/tmp_step-N`` took about 28
listings, 5 to 7 small writes and 9 small reads besides the files; its commit is one of them.
A directory rename must stay in its parent directory (torch_checkpointing's always does) so
that the source is hidden by the same listing that shows the destination; a file rename copies
the file; deleting a directory that holds the source of a committed directory elsewhere is not
detected.  See docs/integrations.md for the wiring into torchtitan.
"""

from __future__ import annotations

from ckptfs.torch_checkpointing.records import DEFAULT_BLOCK_SIZE, CommitRecord, FileSum
from ckptfs.torch_checkpointing.storage import CkptfsStorage, CkptfsStorageConfig

__all__ = ["DEFAULT_BLOCK_SIZE", "CkptfsStorage", "CkptfsStorageConfig", "CommitRecord",
           "FileSum"]
