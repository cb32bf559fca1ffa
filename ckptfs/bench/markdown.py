"""What the report's writers share: matplotlib's pyplot on a file-only backend, and splicing
one section into an existing ``benchmarks.md`` (``ckptfs bench report --only ...``) without
touching the rest of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Where a spliced section goes when the document has none yet: before the hand-written notes
#: (where `ckptfs.bench.report.write_report` puts them).
NOTES_HEADING = "## How ckptfs gets these figures"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or None where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return None
    return plt


def splice_section(out: Path, heading: str, section: list[str]) -> Path:
    """Put ``section`` (which starts with ``heading``) into the Markdown file ``out``: where a
    section of that heading is (up to the next ``## `` heading), else before the hand-written
    notes (`NOTES_HEADING`), else at the end."""
    old = out.read_text().splitlines() if out.exists() else ["# Benchmarks", ""]
    if heading in old:
        start = old.index(heading)
        end = next((i for i in range(start + 1, len(old)) if old[i].startswith("## ")),
                   len(old))
    elif NOTES_HEADING in old:
        start = end = old.index(NOTES_HEADING)
    else:
        start = end = len(old)
    new = [*old[:start], *section, *old[end:]]
    out.write_text("\n".join(new).rstrip() + "\n")
    return out
