"""Every size, count and depth bound of the formats (v1 and v2), in one place.

A reader refuses a checkpoint beyond any of these bounds (hostile or corrupt metadata must not
make it allocate, recurse or parse without limit), so the writer checks the same bounds, with the
same constants, *before it writes anything*: a save either fails with a typed error naming what
is too large, or commits a checkpoint every reader accepts.  docs/protocol.md (section 2.5,
"Limits") lists them; tests/reliability/test_hardening_format.py checks writer and reader agree
on each.
"""

from __future__ import annotations

#: ``MANIFEST.json``: largest document, in bytes.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: ``COMPLETE``: largest marker, in bytes (it is never empty).
MAX_MARKER_BYTES = 64 * 1024
#: Files a manifest may list.
MAX_FILES = 1_000_000
#: Largest size a manifest may declare for one file (1 PiB): anything larger is hostile.
MAX_FILE_SIZE = 1 << 50
#: Nesting of a JSON document (manifest, marker): objects and arrays enclosing the deepest value,
#: the document object itself counting 1 (so ``metadata`` values may nest 62 levels).
MAX_JSON_DEPTH = 64
#: Longest ``"algorithm:hex"`` digest string.
MAX_DIGEST_CHARS = 200

#: ``state.msgpack``: largest document, in bytes.
MAX_STATE_DOC_BYTES = 2 * 1024 * 1024 * 1024
#: Depth of the state tree: the root dict is at depth 0, and every child of a ``d``/``l``/``t``/
#: ``S`` node (a dict's keys included) is one deeper than its container.  No node may be deeper.
MAX_DEPTH = 256
#: Decimal digits of a big int (``["i", "<decimal>"]``), the sign excluded: Python's default
#: ``int``/``str`` conversion limit, so any Python reader can parse it.
MAX_BIGINT_DIGITS = 4300

#: A safetensors header (the JSON after the 8-byte length): the ``safetensors`` library's own
#: limit (100,000,000 bytes), so every file ckptfs writes opens with it.
MAX_HEADER_BYTES = 100_000_000

#: Format v2: ``dcp.msgpack`` (DCP's global metadata) and one encoded non-tensor value, largest
#: documents in bytes, checked before anything is allocated.
MAX_METADATA_BYTES = 2 * 1024 * 1024 * 1024

#: Format v5 (``rank-metadata``): one rank's index document, largest in bytes (checked against
#: its table row before it is read); ``dcp-spec.msgpack`` is bounded by `MAX_METADATA_BYTES`.
MAX_RANK_INDEX_BYTES = 256 * 1024 * 1024
#: Format v5: rows of one table block (so a block is at most 64 Ki rows of 21 B + 2 digests).
MAX_ROWS_PER_BLOCK = 65_536
#: Format v5: cells of one tensor's grid layout (a reader enumerates those a load overlaps).
MAX_GRID_CELLS = 1 << 24
