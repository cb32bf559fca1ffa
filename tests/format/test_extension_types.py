"""Safe extension types (docs/protocol.md, section 2.3.1): numpy, pathlib, sets, Enum members,
dataclasses, argparse.Namespace and torch.device stored without pickle, restored only through
types registered in the loading process."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptCheckpointError, ExtensionTypeError, UnsupportedValueError
from ckptfs.format import extensions
from ckptfs.format.layout import StepPaths
from ckptfs.format.serialize import build_tree, decode_state_doc, plan_state

SPEC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


class Color(enum.Enum):
    RED = "r"
    BLUE = "b"


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass
class Opt:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    out: pathlib.Path = pathlib.Path("runs")
    color: Color = Color.RED
    seen: int = dataclasses.field(default=0, init=False)


@dataclasses.dataclass(frozen=True)
class Key:
    name: str


class Celsius:
    def __init__(self, degrees: float) -> None:
        self.degrees = degrees

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Celsius) and other.degrees == self.degrees


@pytest.fixture(autouse=True)
def _registered() -> Any:
    for cls in (Color, Perm, Opt):
        ckptfs.register_type(cls)
    ckptfs.register_type(Celsius, lambda c: c.degrees, Celsius, name="tests.Celsius")
    yield
    for cls in (Color, Perm, Opt, Key):
        extensions.unregister_type(f"{__name__}.{cls.__qualname__}")
    extensions.unregister_type("tests.Celsius")


def roundtrip(value: Any, url: str = "memory://ext-roundtrip") -> Any:
    store = ckptfs.open(url)
    for s in store.steps():
        store.delete(s)
    store.save(1, {"v": value})
    return ckptfs.open(url).load(1)["v"]


BUILTINS = [
    pathlib.Path("a/b.txt"), pathlib.PurePosixPath("/x/y"), pathlib.PureWindowsPath(r"C:\t\u"),
    {3, 1, 2}, frozenset({"a", "b"}), set(), torch.device("cpu"), torch.device("cuda", 1),
    argparse.Namespace(lr=0.1, name="x", path=pathlib.Path("p")),
    np.float32(1.5), np.float64(-0.0), np.int64(-7), np.uint8(200), np.bool_(True),
    np.complex128(1 + 2j), np.str_("héllo"), np.bytes_(b"\x00a"), np.datetime64("2024-01-02"),
]


@pytest.mark.parametrize("value", BUILTINS, ids=lambda v: type(v).__name__)
def test_builtin_roundtrip(value: Any) -> None:
    out = roundtrip(value)
    assert type(out) is type(value)
    assert out == value or (isinstance(value, float) and str(out) == str(value))


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(6, dtype=">i4"),  # big-endian
    np.arange(12.0).reshape(3, 4)[:, ::-2],                                    # strided view
    np.array(True), np.zeros((0, 3), dtype=np.int16), np.array([1 + 2j, 3j]),  # complex128
    np.array(["ab", "c"]), np.array([b"xy", b""]), np.array(["2024-01-01"], dtype="M8[D]"),
    np.array([1, 2], dtype="m8[s]"), np.arange(4, dtype=np.uint64), np.float16([0.5, 2]),
]


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_numpy_array_roundtrip(arr: np.ndarray) -> None:
    out = roundtrip(arr)
    assert type(out) is np.ndarray
    assert out.shape == arr.shape
    assert out.dtype == arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else (
        out.dtype == arr.dtype)
    assert np.array_equal(out, arr)


def test_numpy_data_lives_in_safetensors(tmp_path: Path) -> None:
    """Array bytes are tensors (hashed and streamed like any tensor), not msgpack blobs."""
    store = ckptfs.open(str(tmp_path))
    arr = np.arange(100_000, dtype=np.float32)
    info = store.save(1, {"a": arr, "s": np.array(["x" * 100] * 100)})
    state_size = info.manifest.file("state.msgpack").size
    assert state_size < 2000
    from safetensors import safe_open
    path = tmp_path / StepPaths(1).file(info.attempt, "tensors-00000.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["a/data", "s/data"]
        assert torch.equal(f.get_tensor("a/data"), torch.from_numpy(arr))


def test_enum_flag_dataclass_custom() -> None:
    opt = Opt(0.01, out=pathlib.Path("/ckpt"), color=Color.BLUE)
    opt.seen = 5
    value = {"opt": opt, "perm": Perm.R | Perm.W, Color.RED: "enum key", "c": Celsius(21.5),
             "nested": [{"s": {Color.BLUE}}]}
    out = roundtrip(value)
    assert out == value
    assert type(out["opt"]) is Opt and out["opt"].seen == 5
    assert isinstance(out["opt"].out, pathlib.Path) and out["opt"].color is Color.BLUE
    assert out["perm"] is Perm.R | Perm.W or out["perm"] == Perm.R | Perm.W
    assert list(out)[2] is Color.RED


def test_numpy_and_mapped_tensors_with_map_location() -> None:
    store = ckptfs.open("memory://ext-map")
    store.save(1, {"a": np.arange(3.0), "t": torch.ones(2)})
    out = store.load(1, map_location="cpu")
    assert isinstance(out["a"], np.ndarray) and np.array_equal(out["a"], np.arange(3.0))


# -- registry semantics -------------------------------------------------------------------------


def test_register_returns_class_and_is_idempotent() -> None:
    assert ckptfs.register_type(Key) is Key
    assert ckptfs.register_type(Key) is Key  # same class, same name: fine
    assert extensions.registered_types()[f"{__name__}.Key"] is Key
    assert roundtrip([Key("a")]) == [Key("a")]


def test_dataclass_as_key_refused_naming_path() -> None:
    ckptfs.register_type(Key)
    with pytest.raises(UnsupportedValueError, match="m/<key>"):
        plan_state({"m": {Key("a"): 1}})


def test_name_conflicts_and_replace() -> None:
    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(ExtensionTypeError, match="already registered"):
        ckptfs.register_type(Other, name=f"{__name__}.Opt")
    with pytest.raises(ExtensionTypeError, match="one type name"):
        ckptfs.register_type(Opt, name="another.name")
    ckptfs.register_type(Other, name=f"{__name__}.Opt", replace=True)  # a redefinition
    assert extensions.registered_types()[f"{__name__}.Opt"] is Other
    assert extensions.encoder_for(Opt(1.0)) is None


@pytest.mark.parametrize("bad,match", [
    ((int, str, int), "natively"), ((dict, dict, dict), "natively"),
    ((Celsius, None, None), "Enum and dataclass"), ((Celsius, str, None), "both encode"),
    ((Celsius, str, float), "type name"),
])
def test_registration_errors(bad: tuple[Any, Any, Any], match: str) -> None:
    cls, enc, dec = bad
    kw = {"name": "bad name!"} if match == "type name" else {}
    with pytest.raises(ExtensionTypeError, match=match):
        ckptfs.register_type(cls, enc, dec, **kw)
    assert issubclass(ExtensionTypeError, TypeError)


def test_subclass_is_not_its_registered_base() -> None:
    class MyPath(type(pathlib.Path())):  # type: ignore[misc]
        pass

    with pytest.raises(UnsupportedValueError, match=r"v.*register_type"):
        plan_state({"v": MyPath("x")})
    with pytest.raises(UnsupportedValueError, match=r"'v'.*register_type"):
        plan_state({"v": np.ma.masked_array([1, 2])})


# -- refused before writing, naming the key path and the fix -------------------------------------


@dataclasses.dataclass
class Unregistered:
    a: int


class Mood(enum.Enum):
    OK = 1


@pytest.mark.parametrize("value,path,fix", [
    ({"cfg": {"x": Unregistered(1)}}, "cfg/x", r"register_type\(Unregistered\)"),
    ({"m": [Mood.OK]}, "m/0", r"register_type\(Mood\)"),
    ({"o": object()}, "o", r"register_type\(object, encode, decode\)"),
    ({"a": np.array([object()], dtype=object)}, "a", "object"),
    ({"a": np.zeros(2, dtype="i4,f8")}, "a", "structured"),
    ({"o": Opt(lr=object())}, "o/lr", "register_type"),  # type: ignore[arg-type]
])
def test_refused_before_writing(value: dict[str, Any], path: str, fix: str) -> None:
    store = ckptfs.open("memory://ext-refused")
    with pytest.raises(UnsupportedValueError) as ei:
        store.save(1, value)
    msg = str(ei.value)
    assert f"'{path}'" in msg and re.search(fix, msg), msg
    assert store.all_steps() == []


def test_failing_encoder_is_typed() -> None:
    class Boom:
        pass

    def enc(_: Any) -> Any:
        raise RuntimeError("nope")

    ckptfs.register_type(Boom, enc, lambda v: Boom(), name="tests.Boom")
    try:
        with pytest.raises(UnsupportedValueError, match=r"tests\.Boom.*'k'.*nope"):
            plan_state({"k": Boom()})
        ckptfs.register_type(Boom, lambda b: b, lambda v: Boom(), name="tests.Boom")
        with pytest.raises(UnsupportedValueError, match="the value itself"):
            plan_state({"k": Boom()})
    finally:
        extensions.unregister_type("tests.Boom")


# -- hostile and foreign files: nothing executes --------------------------------------------------


def _decode(tree: Any, tensors: list[torch.Tensor] | None = None) -> Any:
    blob = msgpack.packb({"schema": "ckptfs.state", "format_version": 1, "tree": tree,
                          "tensors": []}, use_bin_type=True)
    t, _ = decode_state_doc(blob, where="s")
    return build_tree(t, tensors or [], where="s")


def test_unregistered_name_is_typed_error_naming_key_path() -> None:
    tree = ["d", [["model", ["d", [["cfg", ["x", ["os.system", "echo pwned"]]]]]]]]
    with pytest.raises(ExtensionTypeError) as ei:
        _decode(tree)
    msg = str(ei.value)
    assert "model/cfg" in msg and "'os.system'" in msg and "register_type" in msg
    assert not isinstance(ei.value, CorruptCheckpointError)  # allow_rollback never skips it
    with extensions.unregistered_as_dict():
        out = _decode(tree)
    assert out == {"model": {"cfg": {"__ckptfs_type__": "os.system", "value": "echo pwned"}}}


def test_hostile_file_runs_nothing(tmp_path: Path) -> None:
    """A checkpoint naming importable callables (os.system, builtins.eval, a module whose
    import has side effects) in every position: the load fails typed, and nothing ran."""
    marker = tmp_path / "ran"
    mod = tmp_path / "evil_mod.py"
    mod.write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    names = ["os.system", "builtins.eval", "evil_mod.x", "subprocess.Popen", "posix.system"]
    root = tmp_path / "run"
    for i, name in enumerate(names):
        _save_raw_tree(root, i + 1, ["d", [["v", ["x", [name, f"touch {marker}"]]]]])
    script = textwrap.dedent(f"""
        import sys, ckptfs
        sys.path.insert(0, {str(tmp_path)!r})
        store = ckptfs.open({str(root)!r})
        for step in store.steps():
            try:
                store.load(step)
            except ckptfs.ExtensionTypeError as exc:
                print("TYPED", step, "evil_mod" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.count("TYPED") == len(names), done.stdout + done.stderr
    assert "True" not in done.stdout
    assert not marker.exists()


def _save_raw_tree(root: Path, step: int, tree: Any) -> None:
    """Commit a checkpoint whose state.msgpack holds ``tree`` as written by another tool."""
    store = ckptfs.open(str(root))
    info = store.save(step, {"placeholder": 0})
    attempt = root / StepPaths(step).attempt_dir(info.attempt)
    import hashlib

    from ckptfs.format.hashing import digest_bytes
    from ckptfs.format.manifest import FileEntry, Manifest, Marker
    blob = msgpack.packb({"schema": "ckptfs.state", "format_version": 1, "tree": tree,
                          "tensors": []}, use_bin_type=True)
    (attempt / "state.msgpack").write_bytes(blob)
    m = info.manifest
    files = tuple(FileEntry(f.path, len(blob), digest_bytes(f.algorithm, blob))
                  if f.path == "state.msgpack" else f for f in m.files)
    mbytes = Manifest(m.step, m.attempt, files, m.created, m.hash_algorithm,
                      m.metadata).to_bytes()
    (attempt / "MANIFEST.json").write_bytes(mbytes)
    mk = info.marker
    marker = Marker(step, info.attempt, "sha256:" + hashlib.sha256(mbytes).hexdigest(),
                    len(mbytes), mk.created, mk.writer)
    (root / StepPaths(step).marker).write_bytes(marker.to_bytes())


@pytest.mark.parametrize("payload", [
    ["numpy.ndarray", ["d", [["dtype", "O"], ["shape", ["l", [1]]], ["data", ["T", 0]]]]],
    ["numpy.ndarray", ["d", [["dtype", "i4,O"], ["shape", ["l", [1]]], ["data", ["T", 0]]]]],
    ["numpy.ndarray", ["d", [["dtype", "<f4"], ["shape", ["l", [99]]], ["data", ["T", 0]]]]],
    ["numpy.ndarray", ["d", [["dtype", "(2,)f4"], ["shape", ["l", [1]]], ["data", ["T", 0]]]]],
    ["numpy.generic", ["t", ["<f8", b"\x00"]]],
    ["numpy.generic", ["t", ["V8", b"\x00" * 8]]],
    ["builtins.set", ["t", [1, 1]]],
    ["builtins.set", ["t", [["l", [1]]]]],
    ["torch.device", "cuda:0; import os"],
    ["pathlib.Path", 3],
    ["argparse.Namespace", ["d", [[1, 2]]]],
    ["bad name!", 1],
    "not a pair",
])
def test_malformed_payloads_are_corrupt(payload: Any) -> None:
    with pytest.raises(CorruptCheckpointError) as ei:
        _decode(["d", [["k", ["d", [["v", ["x", payload]]]]]]], [torch.zeros(4)])
    assert "k/v" in str(ei.value), str(ei.value)


def test_decoder_refusal_is_typed() -> None:
    with pytest.raises(ExtensionTypeError, match=r"k.*no member 'GREEN'"):
        _decode(["d", [["k", ["x", [f"{__name__}.Color", "GREEN"]]]]])
    with pytest.raises(ExtensionTypeError, match=r"unknown: \['zzz'\]"):
        _decode(["d", [["k", ["x", [f"{__name__}.Opt", ["d", [["lr", 1.0], ["zzz", 1]]]]]]]])


def test_unregistered_on_load_through_store() -> None:
    store = ckptfs.open("memory://ext-unreg")
    store.save(1, {"a": {"c": Color.RED}})
    store.save(2, {"a": {"c": Color.BLUE}})
    extensions.unregister_type(Color)
    for kw in ({}, {"allow_rollback": True}):
        with pytest.raises(ExtensionTypeError, match=r"a/c.*not registered"):
            store.load(**kw)  # type: ignore[arg-type]
    ckptfs.register_type(Color)
    assert store.load()["a"]["c"] is Color.BLUE


def test_depth_counts_extension_payloads() -> None:
    value: Any = 0
    for _ in range(200):
        value = argparse.Namespace(v=value)  # each: an x node + its d payload = 2 levels
    with pytest.raises(UnsupportedValueError, match="deeper than"):
        plan_state({"v": value})


def test_by_hand_checker_accepts_extension_values(tmp_path: Path) -> None:
    m = re.search(r"<!-- by-hand-checker -->\s*```python\n(.*?)```", SPEC.read_text(), re.S)
    assert m
    script = tmp_path / "check.py"
    script.write_text(m.group(1))
    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, {"a": np.arange(4.0), "s": {1, 2}, Color.RED: [pathlib.Path("x")],
                   "o": Opt(0.1), "w": torch.ones(2)})
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 tensors" in done.stdout
    doc = json.dumps(msgpack.unpackb((tmp_path / "run" / StepPaths(1).file(
        store.info(1).attempt, "state.msgpack")).read_bytes(), raw=False), default=repr)
    assert '"x"' in doc and "numpy.ndarray" in doc
