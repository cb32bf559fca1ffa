"""The writer golden (tests/golden/make_writer_golden.py): for a fixed clock, attempt name,
writer identity and state, every writer (v1, v2 on one rank and through ``ckptfs.dcp``, v3,
v4 and v5 on one rank, ``save_async`` of each layout, ``cp`` of each, the remote copy of a two-tier
store, and v2/v4 on two gloo ranks with ``--runslow``) writes exactly the bytes recorded in
tests/golden/writers/: files, manifests and markers.  A difference names the writer and the
first differing file; a change meant to change the bytes regenerates the digests with
``python tests/golden/make_writer_golden.py --force``."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_writer_golden",
                                                  GOLDEN / "make_writer_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _generator()


@cache
def produced(group: str) -> dict[str, dict[str, str]]:
    """What the writers of ``group`` write now (one fresh process per group, once per run)."""
    result: dict[str, dict[str, str]] = G.group_in_subprocess(group)
    return result


def difference(writer: str, want: dict[str, str], got: dict[str, str]) -> str | None:
    """``None`` when equal, else a message naming ``writer`` and its first differing file."""
    if got == want:
        return None
    changed = sorted(p for p in set(want) & set(got) if want[p] != got[p])
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    first = sorted([*changed, *missing, *extra])[0]
    kind = ("changed" if first in changed else
            "not written any more" if first in missing else "new")
    return (f"writer {writer!r}: the first differing file is {first} ({kind}); "
            f"{len(changed)} changed, {len(missing)} not written any more, {len(extra)} new "
            f"(of {len(want)} expected).  If the change of bytes is meant (a fix of what this "
            "writer stores), regenerate with 'python tests/golden/make_writer_golden.py "
            "--force' and say so in the commit")


def _params() -> list[object]:
    def marks(w: str) -> list[Any]:
        out: list[Any] = [pytest.mark.slow] if G.group_of(w) == "two" else []
        if G.group_of(w) != "none" or w.endswith("dcp"):  # torch >= 2.9
            out.append(pytest.mark.sharded)
        return out

    return [pytest.param(w, id=w, marks=marks(w)) for w in G.writers()]


def test_every_writer_has_a_golden() -> None:
    """The digest files cover the writers the generator knows (none lost or left over)."""
    names = set(G.writers())
    assert {"v1", "v2", "v3", "v4", "v5", "dcp", "async-v1", "async-v2", "async-v3",
            "async-v4", "async-v5", "cp-v1", "cp-v2", "cp-v3", "cp-v4", "cp-v5", "cp-dcp",
            "replica-v1", "replica-v3", "v2x2", "v4x2", "cp-v4x2"} == names
    for w in names:
        assert G.expected(w), w


@pytest.mark.parametrize("writer", _params())
def test_writer_bytes_unchanged(writer: str) -> None:
    got = produced(G.group_of(writer)).get(writer)
    assert got is not None, f"the generator no longer runs writer {writer!r}"
    problem = difference(writer, G.expected(writer), got)
    if problem is not None:
        note = G.note_of(writer)
        pytest.fail(problem + (f"\nnote of this golden: {note}" if note else ""))


def test_difference_names_the_writer_and_the_first_file() -> None:
    want = {"a/COMPLETE": "1", "a/x/MANIFEST.json": "2", "b/COMPLETE": "3"}
    assert difference("v1", want, dict(want)) is None
    msg = difference("v3", want, {**want, "a/x/MANIFEST.json": "9"})
    assert msg is not None and "'v3'" in msg and "a/x/MANIFEST.json (changed)" in msg
    msg = difference("cp-v4", want, {k: v for k, v in want.items() if k != "a/COMPLETE"})
    assert msg is not None and "a/COMPLETE (not written any more)" in msg
    msg = difference("v2", want, {**want, "a/y": "4"})
    assert msg is not None and "a/y (new)" in msg
