"""The package's structure, as rules with reasons (docs/architecture.md).

Each rule says why in its docstring; each allowlist entry names the module and the reason.  An
allowlist entry that is no longer needed fails its own test, so the lists only shrink.

- layers: no module imports upward or sideways (the layer diagram);
- no import cycle, inside a layer or across layers (deferred imports count: a cycle hidden in a
  function is still two modules that cannot be understood apart);
- no private (``_name``) import across modules inside ``ckptfs/`` (no friend modules);
- no storage probe outside ``ckptfs/storage/`` (the storage interface is declared);
- one place creates commit markers;
- messages between ranks are JSON through ``protocol/group.py`` (no module sends its own),
  never pickle (imported only where it is tested or measured), and ckptfs's own process groups come
  from its one factory;
- module size as a smell only, far above today's largest, with a named allowlist.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "ckptfs"

# Rank of each layer: a module may import its own layer and any layer of lower rank.
RANK = {"errors": 0, "torch_versions": 0, "torch_compat": 0, "format": 1, "storage": 1,
        "protocol": 2, "lifecycle": 3, "cli": 4, "bench": 4, "testing": 4, "integrations": 4}
# Same-rank layers that must not import each other (siblings), with the allowed exceptions.
SIBLINGS = {frozenset({"format", "storage"}), frozenset({"cli", "bench"}),
            frozenset({"cli", "testing"}), frozenset({"bench", "testing"}),
            frozenset({"integrations", "cli"}), frozenset({"integrations", "bench"}),
            frozenset({"integrations", "testing"})}
ALLOWED = {("bench", "ckptfs.testing.servers"), ("testing", "ckptfs.cli.demo")}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__init__":
        return "api"
    head = parts[1]
    if head == "__main__":
        return "cli"               # ``python -m ckptfs``: the command, nothing else
    if head in RANK:
        return head
    return "integrations"          # ckptfs/dcp.py, ckptfs/lightning.py, ...


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


@cache
def tree_of(name: str) -> ast.Module:
    path = modules()[name]
    return ast.parse(path.read_text(), str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, runtime: bool) -> Iterator[ast.AST]:
    """Every node; with ``runtime``, not the bodies of ``if TYPE_CHECKING:`` (imports for
    annotations only, which never run)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if runtime and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _walk(other, runtime)
            continue
        yield from _walk(child, runtime)


@dataclass(frozen=True)
class Imported:
    module: str                 # the module imported from (absolute)
    names: tuple[str, ...]      # the names taken from it (empty for ``import x``)
    bound: tuple[tuple[str, str], ...] = ()  # (local name, absolute module) for module bindings
    line: int = 0


def _absolute(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    if modules()[name].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(name: str, runtime: bool = False) -> tuple[Imported, ...]:
    """Every import of a module, module level and deferred; with ``runtime`` only those that
    run (not under ``if TYPE_CHECKING:``)."""
    found = []
    for node in _walk(tree_of(name), runtime):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                target = a.name if a.asname else a.name.split(".")[0]
                found.append(Imported(a.name, (), ((local, target),), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(name, node)
            bound = tuple((a.asname or a.name, f"{mod}.{a.name}") for a in node.names
                          if f"{mod}.{a.name}" in modules())
            found.append(Imported(mod, tuple(a.name for a in node.names), bound, node.lineno))
    return tuple(found)


def internal_targets(name: str) -> set[str]:
    """The ckptfs modules ``name`` imports when it runs (a package's submodule when one is
    named)."""
    out = set()
    for imp in imports_of(name, runtime=True):
        if not (imp.module == "ckptfs" or imp.module.startswith("ckptfs.")):
            continue
        subs = {f"{imp.module}.{n}" for n in imp.names} & modules().keys()
        out |= subs or ({imp.module} & modules().keys())
        if not imp.names and imp.module in modules():
            out.add(imp.module)
    out.discard(name)
    return out


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# -- layers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(modules()))
def test_no_upward_or_sideways_import(name: str) -> None:
    """The layer diagram of docs/architecture.md: the format knows no storage, the protocol no
    lifecycle, and nothing below the top layers uses the public API module (a cycle)."""
    src = layer_of(name)
    if src == "api":
        return
    for imp in imports_of(name):
        target = imp.module
        if not (target == "ckptfs" or target.startswith("ckptfs.")):
            continue
        dst = layer_of(target)
        if dst == src or (src, target) in ALLOWED:
            continue
        if dst == "api":
            assert RANK[src] == 4, f"{name} ({src}) imports the public API module {target}"
            continue
        assert RANK[dst] <= RANK[src], f"{name} ({src}) imports {target} ({dst}): upward"
        assert frozenset({src, dst}) not in SIBLINGS, f"{name} ({src}) imports sibling {target}"
        if src == "integrations":
            assert dst != "integrations", f"{name} imports another integration {target}"


# -- cycles -----------------------------------------------------------------------------------

#: Import cycles that exist today, each with the reason and the work that removes it.  Deferred
#: (in-function) imports count: they hide a cycle from the interpreter, not from a reader.
#: Imports under ``if TYPE_CHECKING:`` (annotations only) do not.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def import_cycles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = {m: internal_targets(m) for m in modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    """Modules in a cycle cannot be read, tested or changed apart; across layers a cycle also
    breaks the layer diagram.  Cycles hidden in deferred imports count."""
    new = []
    for cycle in import_cycles():
        if cycle in KNOWN_CYCLES:
            continue
        layers = {layer_of(m) for m in cycle}
        where = "inside " + layers.pop() if len(layers) == 1 else "across layers"
        new.append(f"{where}: {sorted(cycle)}")
    assert not new, "import cycles:\n" + "\n".join(new)


def test_known_cycles_still_exist() -> None:
    """An allowlisted cycle that is gone must leave the list (it only shrinks)."""
    current = set(import_cycles())
    assert [sorted(c) for c in KNOWN_CYCLES if c not in current] == []


# -- no friend modules -------------------------------------------------------------------------

#: The compat module for torch's private APIs: importing from it is the way
#: to use them.
COMPAT_MODULE = "ckptfs.torch_compat"


def private_uses(name: str) -> list[str]:
    """Private names of another ckptfs module used by ``name``: imported (``from m import
    _x``, a ``_private`` module) or reached through an imported module (``m._x``)."""
    out = []
    module_names: dict[str, str] = {}
    for imp in imports_of(name):
        if not imp.module.startswith("ckptfs") or imp.module.startswith(COMPAT_MODULE):
            continue
        if any(is_private(p) for p in imp.module.split(".")):
            out.append(f"line {imp.line}: imports private module {imp.module}")
        out += [f"line {imp.line}: from {imp.module} import {n}" for n in imp.names
                if is_private(n)]
        for local, target in imp.bound:
            if target.startswith("ckptfs.") and target != name:
                module_names[local] = target
    for node in ast.walk(tree_of(name)):
        if (isinstance(node, ast.Attribute) and is_private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in module_names):
            out.append(f"line {node.lineno}: {node.value.id}.{node.attr} "
                       f"({module_names[node.value.id]})")
    return out


#: Friend modules that exist today, with the work that removes them.
KNOWN_PRIVATE_USES: dict[str, str] = {}


@pytest.mark.parametrize("name", list(modules()))
def test_no_private_use_across_modules(name: str) -> None:
    """A ``_name`` is the module's own business: another module that uses it is a friend that
    breaks when the owner changes, and hides an API the owner should state.  Make it public
    (and document it) or move the code.  (Torch's private APIs go through the compat module,
    ckptfs.torch_compat.)"""
    if name in KNOWN_PRIVATE_USES:
        return
    assert private_uses(name) == [], f"{name} uses private names of other modules"


def test_known_private_uses_still_exist() -> None:
    assert [n for n in KNOWN_PRIVATE_USES if not private_uses(n)] == []


def third_party_private_imports() -> dict[str, list[str]]:
    """Private names of third-party packages imported by ckptfs (DCP, DTensor internals...):
    out of scope of the rule above, listed for the compat module (ckptfs.torch_compat)."""
    out: dict[str, list[str]] = {}
    for name in modules():
        for imp in imports_of(name):
            if imp.module.startswith("ckptfs") or not imp.module:
                continue
            hits = [f"{imp.module}.{n}" for n in imp.names if is_private(n)]
            if any(is_private(p) for p in imp.module.split(".")):
                hits.append(imp.module + (f" ({', '.join(imp.names)})" if imp.names else ""))
            if hits:
                out.setdefault(name, []).extend(hits)
    return out


# -- the storage interface is declared -----------------------------------------------------------

#: Names under which code holds a storage: a ``getattr``/``hasattr`` on one of them is a probe.
STORAGE_NAMES = ("storage", "inner", "parent", "st")
#: Members of the fsspec adapter that are not part of the interface.
ADAPTER_MEMBERS = ("fs", "full", "spec")
#: Modules that may use the adapter's own members, with the reason.
ADAPTER_USERS = {
    "ckptfs.cli.doctor": "the doctor tests the fsspec library itself (create-only writes, "
    "ranged reads, multipart behaviour) through the adapter it opens, below the interface",
    "ckptfs.bench.latest": "the benchmark counts the HTTP requests of the s3fs client of the "
    "adapter it built (botocore events)",
    "ckptfs.bench.remote_verify": "the benchmark counts the HTTP requests and bytes read of "
    "the s3fs / gcsfs client of the adapter it built",
    "ckptfs.bench.incremental": "the benchmark counts the HTTP requests and uploaded bytes of "
    "the s3fs client of the adapter it built (botocore events)",
}


def _is_storage_name(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else (
        node.attr if isinstance(node, ast.Attribute) else "")
    return name.lstrip("_") in STORAGE_NAMES or name.lower().endswith("storage")


def storage_probes(name: str) -> list[str]:
    out = []
    in_storage = name.startswith("ckptfs.storage.")
    for node in ast.walk(tree_of(name)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        item.name == "__getattr__":
                    out.append(f"line {item.lineno}: class {node.name} forwards with __getattr__")
        if in_storage:
            continue
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and _is_storage_name(node.args[0])):
            out.append(f"line {node.lineno}: {node.func.id}() on a storage")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for c in classes:
                if isinstance(c, ast.Name) and c.id.endswith("Storage") and c.id != "Storage":
                    out.append(f"line {node.lineno}: {node.func.id}(..., {c.id})")
        if (isinstance(node, ast.Attribute) and node.attr in ADAPTER_MEMBERS
                and name not in ADAPTER_USERS
                and not (isinstance(node.value, ast.Name) and node.value.id in ("torch", "np"))):
            out.append(f"line {node.lineno}: .{node.attr} (an fsspec adapter member)")
    return out


@pytest.mark.parametrize("name", list(modules()))
def test_no_storage_probe_outside_storage(name: str) -> None:
    """Every optional storage capability is a declared protocol asked with ``supports()``
    (ckptfs/storage/base.py).  A ``getattr``/``hasattr`` probe, a type test of a concrete
    storage or a reach into the fsspec adapter (``.fs``) is silently false through a wrapper,
    and the check it guards goes with it (a wrapper once turned the symlink refusal off this way);
    ``__getattr__`` forwarding hides a member a wrapper forgot.  Wrappers delegate explicitly
    (``StorageWrapper``).  A module-level ``__getattr__`` (lazy attributes, PEP 562) forwards
    no storage and is allowed."""
    assert storage_probes(name) == [], f"{name} reaches around the storage interface"


def test_adapter_users_still_need_it() -> None:
    for name in ADAPTER_USERS:
        assert any(isinstance(n, ast.Attribute) and n.attr in ADAPTER_MEMBERS
                   for n in ast.walk(tree_of(name))), f"{name} no longer needs its entry"


# -- one place creates commit markers ------------------------------------------------------------

MARKER_OWNERS = {"ckptfs.protocol.commit", "ckptfs.format.manifest"}
#: Modules that build markers outside the commit, with the reason.
MARKER_BUILDERS = {
    "ckptfs.testing.reliability.hostile": "plants hostile checkpoints with valid markers on "
    "purpose (the attacker's view), through the backdoor, never through the commit",
    "ckptfs.testing.reliability.hostile_v3": "plants hostile incremental (v3) checkpoints with "
    "valid markers on purpose, as hostile does for v1 and v2",
    "ckptfs.bench.latest": "populates up to 10,000 committed checkpoints by raw writes to time "
    "resolving the latest among them (one real save on top)",
}


def marker_constructions(name: str) -> list[int]:
    """Lines where the ``Marker`` class is used as a value (called, or aliased to be called
    later), not only read from (``Marker.from_bytes``) or named in an annotation."""
    tree = tree_of(name)
    skip: set[int] = set()
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations += [a.annotation for a in [*node.args.args, *node.args.kwonlyargs,
                                                   *node.args.posonlyargs] if a.annotation]
            annotations += [node.returns] if node.returns else []
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, ast.Attribute):
            annotations.append(node.value)  # Marker.from_bytes
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "isinstance":
            annotations += node.args[1:]
        for a in annotations:
            skip |= {id(n) for n in ast.walk(a)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id == "Marker" and isinstance(n.ctx, ast.Load)
            and id(n) not in skip]


@pytest.mark.parametrize("name", list(modules()))
def test_markers_are_created_by_the_commit(name: str) -> None:
    """The marker is the commit: only the commit object creates one, after every reader limit
    was checked and with the ambiguous outcomes handled once.  Another
    module that builds one is a second commit path."""
    if name in MARKER_OWNERS | MARKER_BUILDERS.keys():
        return
    assert marker_constructions(name) == [], f"{name} builds a commit marker"


def test_marker_builders_still_need_it() -> None:
    for name in MARKER_BUILDERS:
        assert marker_constructions(name), f"{name} no longer builds markers: drop its entry"


# -- messages between ranks: JSON through the group, never pickle ------------------------------

#: torch.distributed's object collectives: each pickles on the sender and unpickles on every
#: receiver.
OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "gather_object",
                                "scatter_object_list", "broadcast_object", "send_object_list",
                                "recv_object_list"})
GROUP_MODULE = "ckptfs.protocol.group"


def uses_of(name: str, members: frozenset[str]) -> list[str]:
    """``line: member`` for each use of one of ``members`` in module ``name``: an attribute
    (``dist.new_group``), a name, or an import of it (``from torch.distributed import ...``)."""
    found = []
    for node in ast.walk(tree_of(name)):
        if isinstance(node, ast.Attribute) and node.attr in members:
            found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, ast.Name) and node.id in members:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in members]
    return found


@pytest.mark.parametrize("name", list(modules()))
def test_no_pickle_between_ranks(name: str) -> None:
    """Messages between ranks are JSON documents through ``ckptfs.protocol.group``, never
    pickle: loading a checkpoint never unpickles, and neither does a rank what another rank
    sent (a pickle runs code on the receiver, and an object collective also hides what
    crosses: a dataclass sent as a pickle has no schema).  A payload with structure is sent as
    its ``to_doc()``."""
    assert uses_of(name, OBJECT_COLLECTIVES) == [], (
        f"{name} uses a pickling object collective: send a JSON document with "
        "ckptfs.protocol.group (Group.broadcast / all_gather)")


#: torch.distributed's collectives that move a payload from rank to rank: a message between
#: ranks.  (A reduction, ``all_reduce``, is arithmetic, not a message.)
MESSAGE_COLLECTIVES = frozenset({"all_gather", "all_gather_into_tensor", "broadcast", "gather",
                                 "scatter", "send", "recv", "isend", "irecv"})


def dist_uses(name: str, members: frozenset[str]) -> list[str]:
    """``line: member`` for each use of torch.distributed's ``members`` in module ``name``:
    ``dist.x`` / ``torch.distributed.x`` (not a method of the same name, ``group.broadcast``),
    or an import of it (``from torch.distributed import x``)."""
    found = []
    for node in ast.walk(tree_of(name)):
        if isinstance(node, ast.Attribute) and node.attr in members and (
                (isinstance(node.value, ast.Name) and node.value.id == "dist")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "distributed")):
            found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in members]
    return found


@pytest.mark.parametrize("name", list(modules()))
def test_messages_between_ranks_go_through_the_group(name: str) -> None:
    """One way to send a message between ranks, ``ckptfs.protocol.group``: a module that packs
    its own payload into tensors for ``dist.all_gather``/``broadcast`` has its own encoding,
    its own size exchange and its own choice of process group and device (the RNG gather once
    gathered msgpack in CUDA tensors on the default NCCL group); through the group it is a
    JSON document on ckptfs's gloo group."""
    if name == GROUP_MODULE:
        assert dist_uses(name, MESSAGE_COLLECTIVES), "the group no longer sends messages"
        return
    assert dist_uses(name, MESSAGE_COLLECTIVES) == [], (
        f"{name} sends a message between ranks itself: send a JSON document with "
        "ckptfs.protocol.group (Group.broadcast / all_gather)")


#: Modules that import ``pickle``, and why: none of them sends anything between ranks.
PICKLE_IMPORTERS = {
    "ckptfs.testing.reliability.hostile": "plants pickles in checkpoints to show that no load "
                                          "unpickles them",
    "ckptfs.testing.reliability.hostile_v2": "the same, for the sharded layout",
    "ckptfs.bench.scale": "measures what DCP's own object collectives pickle, to compare with "
                          "ckptfs's JSON",
    "ckptfs.bench.scale_load": "measures DCP's pickled load plans, to compare with the JSON "
                               "of ckptfs's load rounds",
}


@pytest.mark.parametrize("name", list(modules()))
def test_pickle_only_where_it_is_tested_or_measured(name: str) -> None:
    """No pickle between ranks (nor in a checkpoint): ``pickle`` is imported only where it is
    what is tested or measured (hostile checkpoints that plant pickles to prove they are never
    loaded; the benchmark of DCP's pickled plans)."""
    imported = [node.lineno for node in ast.walk(tree_of(name))
                if (isinstance(node, ast.Import) and any(a.name == "pickle" for a in node.names))
                or (isinstance(node, ast.ImportFrom) and node.module == "pickle")]
    if name in PICKLE_IMPORTERS:
        assert imported, f"{name} no longer imports pickle: drop its PICKLE_IMPORTERS entry"
        return
    assert imported == [], (f"{name} imports pickle (line(s) {imported}): messages between "
                            "ranks are JSON through ckptfs.protocol.group")


@pytest.mark.parametrize("name", list(modules()))
def test_dedicated_groups_come_from_the_group_factory(name: str) -> None:
    """ckptfs's own process groups are created in one place, ``group.gloo_group``: every one
    is gloo, bounded by its timeout (its creation included), and a rank that never joins is
    named from the liveness keys, instead of each caller doing a part of that."""
    if name == GROUP_MODULE:
        assert uses_of(name, frozenset({"new_group"})), "the factory no longer creates groups"
        return
    assert uses_of(name, frozenset({"new_group"})) == [], (
        f"{name} creates a process group: use ckptfs.protocol.group.gloo_group")


# -- module size, as a smell -------------------------------------------------------------------

#: The project's standard (no module over 1,000 lines; the largest today ~950): a module beyond
#: it has probably grown a second concern.  Files are split by concept, not by budget; a module
#: that is one concept and larger goes in the allowlist with its reason.
MAX_LINES = 1000
LARGE_MODULES: dict[str, str] = {}


@pytest.mark.parametrize("name", list(modules()))
def test_module_size_smell(name: str) -> None:
    """Size is not a design rule; a module far above the others usually holds two concepts."""
    lines = len(modules()[name].read_text().splitlines())
    if name in LARGE_MODULES:
        return
    assert lines <= MAX_LINES, (f"{name} has {lines} lines: split it by concept "
                                "(docs/architecture.md), or allowlist it with the reason")


def test_large_modules_are_still_large() -> None:
    for name in LARGE_MODULES:
        assert len(modules()[name].read_text().splitlines()) > MAX_LINES, name


#: A tracker reference: the word issue (any case, or issues) then a number, after a space,
#: a hyphen or "#".
TRACKER_REFERENCE = re.compile(r"\bissues?[ -]#?\d+", re.IGNORECASE)


def test_no_tracker_numbers_in_code_tests_or_docs() -> None:
    """Docstrings, comments and docs speak to a reader of the project: an internal tracker
    number tells them nothing (the tracker is not shipped) and goes stale;
    say what the thing is, or link the page that explains it.  CHANGELOG.md is history and may
    name them."""
    root = PKG.parent
    files = [*PKG.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "docs").glob("*.md")]
    found = [f"{path.relative_to(root)}:{n}: {line.strip()[:100]}"
             for path in files if path.name != "CHANGELOG.md"
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if TRACKER_REFERENCE.search(line)]
    assert found == []


# -- the world size is a value, a format version a set of features ---------------------------

#: A module named for one cell of the world-size matrix, beside the concept's own module.
TWIN_MODULE = re.compile(r"_(sharded|single|collective|distributed)$")


@pytest.mark.parametrize("name", list(modules()))
def test_no_twin_module_per_world_size(name: str) -> None:
    """The world size is a value (``protocol/group.py``'s ``Group``: a world of one or a
    process group), not a second module.  A ``<concept>_sharded`` module beside ``<concept>``
    (as ``replication_sharded``, ``tiers_sharded`` and ``async_sharded`` were) carries its own
    copy of every guarantee of the concept, and the copies drift: each held a weaker guarantee
    than its twin.  The sharded format's own parts are named ``sharded_<part>``."""
    leaf = name.rsplit(".", 1)[-1]
    assert not TWIN_MODULE.search(leaf), (
        f"{name} is a twin module for one world size: drive the concept's one module with a "
        "Group (ckptfs.protocol.group) instead")


#: Names of the manifest model (``format/manifest.py``): what a class test would name.
MANIFEST_CLASSES = re.compile(r"\w*Manifest$")


def version_tests(name: str) -> list[str]:
    """Where module ``name`` compares a ``format_version`` or tests a manifest's class."""
    found = []
    for node in ast.walk(tree_of(name)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "format_version" for s in sides):
                found.append(f"{node.lineno}: a format_version compared")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            classes = node.args[1]
            names = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            for n in names:
                ident = n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                if MANIFEST_CLASSES.fullmatch(ident):
                    found.append(f"{node.lineno}: isinstance(..., {ident})")
    return found


@pytest.mark.parametrize("name", [n for n in modules() if not n.startswith("ckptfs.format")])
def test_no_version_or_manifest_class_test_outside_format(name: str) -> None:
    """A format version is a set of features (``format/versions.py``'s table): code above the
    format asks a manifest for a feature (``features(m)``, ``is_sharded``, ``references_of``),
    never compares its version number or tests its class.  A test by version is written once
    per version and misses the next one that has the same feature (formats v3 and v4 share
    references; a reader that asked "is it v3?" refused or mis-read v4)."""
    assert version_tests(name) == [], (
        f"{name} tests a format version or a manifest class: ask the manifest's features "
        "(ckptfs.format.versions.features)")


# -- one verified chunk reader --------------------------------------------------------------------

CHUNK_READER = "ckptfs.protocol.chunks"
#: Protocol functions that read part of a checkpoint's file other than through the chunk reader,
#: with the reason.
RANGED_READERS = {
    ("ckptfs.protocol.reader", "read_header"): "a format v1 tensor file has no chunk digests: "
    "its safetensors header is read (length, then header) and bound-checked, and its digest "
    "is the whole file's, checked when the file is loaded or verified",
}


def ranged_reads(name: str) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of each call of ``read_range`` (the storage helper or a
    storage's method) in module ``name``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == "read_range") or \
                        (isinstance(f, ast.Attribute) and f.attr == "read_range"):
                    found.append((function, child.lineno))
            visit(child, inner)

    visit(tree_of(name), "<module>")
    return found


@pytest.mark.parametrize("name", [n for n in modules() if n.startswith("ckptfs.protocol.")])
def test_chunks_are_read_by_the_chunk_reader(name: str) -> None:
    """Every protocol module reads stored chunks through the one verified chunk reader
    (``protocol/chunks.py``): a ranged read of a run of whole chunks, each checked against the
    digest its manifest binds, with one wording for a missing file, a short read and a chunk
    that differs, naming the file, the step and whose bytes they are.  A second reader (the
    v3 references, the reuse checks and a copy's materialized references each had one) drifts:
    it forgets the short-read check, lets ``FileNotFoundError`` through untyped, or names the
    file differently.  So no protocol module but the chunk reader calls ``read_range``, except
    the functions of ``RANGED_READERS``, which read no chunks."""
    if name == CHUNK_READER:
        assert ranged_reads(name), "the chunk reader no longer reads ranges"
        return
    stray = [f"line {line}: {function}" for function, line in ranged_reads(name)
             if (name, function) not in RANGED_READERS]
    assert stray == [], (f"{name} reads ranges of a checkpoint's file itself: read chunks "
                         "through ckptfs.protocol.chunks (read_run, read_chunk, chunk_pieces)")


def test_ranged_readers_still_read_ranges() -> None:
    for name, function in RANGED_READERS:
        assert any(f == function for f, _ in ranged_reads(name)), (
            f"{name}.{function} no longer calls read_range: drop its entry")
#: The one store class; its subclasses may only construct it (over other tiers) and name it.
STORE_CLASS = ("ckptfs.protocol.store", "CheckpointStore")
STORE_CONSTRUCTION = {"__init__", "__repr__"}


def class_defs() -> Iterator[tuple[str, ast.ClassDef]]:
    for name in modules():
        for node in ast.walk(tree_of(name)):
            if isinstance(node, ast.ClassDef):
                yield name, node


def members(cls: ast.ClassDef) -> set[str]:
    """The names a class body defines: methods and properties (a property's setter too)."""
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def store_subclasses() -> list[tuple[str, ast.ClassDef]]:
    """Every class in ``ckptfs/`` that derives from the store class, directly or through
    another such class (bases matched by name)."""
    names = {STORE_CLASS[1]}
    found: dict[tuple[str, str], ast.ClassDef] = {}
    grew = True
    while grew:
        grew = False
        for module, cls in class_defs():
            if (module, cls.name) == STORE_CLASS or (module, cls.name) in found:
                continue
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                     for b in cls.bases}
            if bases & names:
                found[(module, cls.name)] = cls
                names.add(cls.name)
                grew = True
    return [(module, cls) for (module, _), cls in sorted(found.items())]


def test_store_subclasses_override_no_store_method() -> None:
    """A store is a store over its tiers (``protocol/store.py``'s ``Tiers``: a plain store's
    own storage, or a two-tier store's local and remote tiers with the replicator), not a
    subclass overriding the store's methods.  Each operation of ``CheckpointStore`` (save,
    delete, the reads across tiers, close) is written once and asks its tiers where the cases
    differ, so a fix or a guarantee added to one is every store's: when ``TieredStore``
    overrode them, each override carried its own copy of the store's rules (which errors, in
    which order, what a collective read waits for) and the copies drifted.  A subclass may
    only construct the store over other tiers (``__init__``, ``__repr__``) and add accessors
    of its own."""
    store_methods = members(next(cls for module, cls in class_defs()
                                 if (module, cls.name) == STORE_CLASS))
    assert "save" in store_methods and "load" in store_methods  # the rule still sees them
    subclasses = store_subclasses()
    assert any(cls.name == "TieredStore" for _, cls in subclasses)  # the rule still sees it
    overrides = {f"{module}.{cls.name}": sorted((members(cls) & store_methods)
                                                 - STORE_CONSTRUCTION)
                 for module, cls in subclasses}
    assert {k: v for k, v in overrides.items() if v} == {}, (
        "a CheckpointStore subclass overrides store methods: give the store's one method the "
        "answer it needs from its tiers (ckptfs.protocol.store.Tiers) instead")
