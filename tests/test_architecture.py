"""The package tree is the layer diagram of docs/architecture.md: no module imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ckptfs"

# Rank of each layer: a module may import its own layer and any layer of lower rank.
RANK = {"errors": 0, "torch_compat": 0, "format": 1, "storage": 1, "protocol": 2,
        "lifecycle": 3, "cli": 4, "bench": 4, "testing": 4, "integrations": 4}
# Same-rank layers that must not import each other (siblings), with the allowed exceptions.
SIBLINGS = {frozenset({"format", "storage"}), frozenset({"cli", "bench"}),
            frozenset({"cli", "testing"}), frozenset({"bench", "testing"}),
            frozenset({"integrations", "cli"}), frozenset({"integrations", "bench"}),
            frozenset({"integrations", "testing"})}
ALLOWED = {("bench", "ckptfs.testing.servers"), ("testing", "ckptfs.cli.demo")}
MAX_LINES = 650


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__init__":
        return "api"
    head = parts[1]
    if head in RANK:
        return head
    return "integrations"          # ckptfs/dcp.py, ckptfs/lightning.py, ...


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        out.append((name, path))
    return out


def imports_of(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append(mod)
    return [m for m in found if m == "ckptfs" or m.startswith("ckptfs.")]


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_no_upward_or_sideways_import(name: str, path: Path) -> None:
    src = layer_of(name)
    if src == "api":
        return
    for target in imports_of(name, path):
        dst = layer_of(target)
        if dst == src or (src, target) in ALLOWED:
            continue
        if dst == "api":
            # The top layers may use the public API; the layers below it would make a cycle.
            assert RANK[src] == 4, f"{name} ({src}) imports the public API module {target}"
            continue
        assert RANK[dst] <= RANK[src], f"{name} ({src}) imports {target} ({dst}): upward"
        assert frozenset({src, dst}) not in SIBLINGS, f"{name} ({src}) imports sibling {target}"
        if src == "integrations":
            assert dst != "integrations", f"{name} imports another integration {target}"


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_module_size(name: str, path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (f"{name} has {lines} lines; split it by concern "
                                "(docs/architecture.md)")
