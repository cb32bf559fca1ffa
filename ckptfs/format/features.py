"""The feature table: a format version is the name of a set of features.

`ckptfs.format.versions` states this table normatively (its module docstring) and re-exports
it; it is defined here, below the manifest model, because the model derives its
``format_version`` from its features (`version_of`) while `ckptfs.format.versions` decodes
manifests (it sits above the model).  Pure: constants and two lookups.

The features:

- ``"sharded"``: one data file per rank and ``dcp.msgpack`` (DCP's global metadata), written
  collectively; the manifest has ``world_size`` and each file its ``rank``.
- ``"chunked"``: every file tiled by chunks with their own digests; the file's digest is the
  digest of its chunk list.
- ``"references"``: chunks of other attempts' files used in place (the manifest's
  ``references``).
- ``"rank-metadata"``: the sharded metadata split so that each loading rank reads only what
  it needs (a tensor spec, a table of rank files in blocks, one index document per rank;
  docs/protocol.md §9.7).  Only with ``"sharded"``, not yet with ``"references"``; on
  shared storage and on each node's own disk (a two-tier store's local tier) alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptfs.errors import UnsupportedValueError
from ckptfs.format.layout import FORMAT_VERSION

SHARDED = "sharded"
CHUNKED = "chunked"
REFERENCES = "references"
RANK_METADATA = "rank-metadata"

#: The metadata layouts of a sharded save (a store's ``metadata_layout=``): ``"per-rank"``
#: writes the ``rank-metadata`` feature (format v5); None one ``dcp.msgpack`` (v2, v4);
#: ``"auto"`` (the default) ``"per-rank"`` for a save of at least `PER_RANK_MIN_WORLD` ranks
#: where the store allows it (not incremental: no version names per-rank metadata with
#: references yet), else None.
PER_RANK = "per-rank"
AUTO = "auto"
METADATA_LAYOUTS = (AUTO, PER_RANK, None)
PER_RANK_MIN_WORLD = 64


def check_metadata_layout(layout: Any) -> str | None:
    """``layout`` if it names a metadata layout, else ``UnsupportedValueError`` naming them."""
    if layout not in METADATA_LAYOUTS or not (layout is None or isinstance(layout, str)):
        raise UnsupportedValueError(f"metadata_layout {layout!r:.40}: one of "
                                    f"{', '.join(map(repr, METADATA_LAYOUTS))}")
    return layout


#: The file layouts of a store's saves (its ``layout=``): ``"auto"`` (the default) writes the
#: files of one process (format v1, v3) in a single process and the rank files of the
#: `SHARDED` feature (v2, v4, v5) under a process group; ``"ranks"`` writes the rank files
#: always, a single process being the world of one of the collective save.
RANKS = "ranks"
LAYOUTS = (AUTO, RANKS)


def check_layout(layout: Any) -> str:
    """``layout`` if it names a file layout of a store, else ``UnsupportedValueError``."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise UnsupportedValueError(f"layout {layout!r:.40}: one of "
                                    f"{', '.join(map(repr, LAYOUTS))}")
    return layout


def metadata_layout_for(layout: str | None, world: int, *, incremental: bool) -> str | None:
    """The layout a save of ``world`` ranks writes for the store's ``metadata_layout``
    (`AUTO` decided here; any other name as given)."""
    if layout != AUTO:
        return layout
    return PER_RANK if world >= PER_RANK_MIN_WORLD and not incremental else None

#: Format v2, the sharded layout (docs/protocol.md §8).
SHARDED_FORMAT_VERSION = 2
#: Format v3, incremental checkpoints (docs/protocol.md §9).
INCREMENTAL_FORMAT_VERSION = 3
#: Format v4, sharded incremental: v2's layout plus v3's references (docs/protocol.md §9.6).
SHARDED_INCREMENTAL_FORMAT_VERSION = 4
#: Format v5, sharded with per-rank metadata (docs/protocol.md §9.7).
RANK_METADATA_FORMAT_VERSION = 5

#: Version -> the features of its manifests.
FEATURES: dict[int, frozenset[str]] = {
    FORMAT_VERSION: frozenset(),
    SHARDED_FORMAT_VERSION: frozenset({SHARDED, CHUNKED}),
    INCREMENTAL_FORMAT_VERSION: frozenset({CHUNKED, REFERENCES}),
    SHARDED_INCREMENTAL_FORMAT_VERSION: frozenset({SHARDED, CHUNKED, REFERENCES}),
    RANK_METADATA_FORMAT_VERSION: frozenset({SHARDED, CHUNKED, RANK_METADATA}),
}
#: Features -> the version that names them: the inverse of `FEATURES` (a writer never chooses a
#: version, it chooses features).
VERSIONS: dict[frozenset[str], int] = {feats: version for version, feats in FEATURES.items()}


def version_of(feats: Iterable[str]) -> int:
    """The format version whose manifests have exactly the features ``feats``; ``ValueError``
    for a set no version names (e.g. references without chunks)."""
    key = frozenset(feats)
    try:
        return VERSIONS[key]
    except KeyError:
        known = ", ".join(f"{v}: {sorted(f)}" for v, f in FEATURES.items())
        raise ValueError(f"no manifest format version has the features {sorted(key)}; "
                         f"the versions are {known}") from None
