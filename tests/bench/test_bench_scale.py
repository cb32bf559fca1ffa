"""``ckptfs bench scale``: the simulator of sharded saves and loads at many ranks is checked
against a real gloo save of the same shapes (``dcp.msgpack`` equal to the byte), and its table
has the figures the scale work is measured by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfs.bench import scale, scale_report
from ckptfs.bench.cli import main as bench_main


def test_state_is_the_70b_layer_slice() -> None:
    state = scale.leaves(scale.Spec())
    assert sum(leaf.kind == "dtensor" for leaf in state) == 36
    assert sum(leaf.kind == "tensor" for leaf in state) == 12
    assert sum(leaf.kind == "value" for leaf in state) == 13
    shapes = dict((n, s) for n, s, _ in scale.param_shapes(scale.Spec()))
    assert shapes["layers.0.attention.wk.weight"] == (1024, 8192)
    assert shapes["layers.0.feed_forward.w2.weight"] == (8192, 28672)


def test_uneven_and_empty_shards_tile_the_tensor() -> None:
    # wk's 1,024 rows over 4,096 ranks: 1,024 ranks hold one row, the rest none (DTensor's cut).
    cuts = [scale.local_chunk((1024, 8192), 0, 4096, r) for r in range(4096)]
    assert sum(s[0] for _, s in cuts) == 1024
    assert cuts[1023] == ([1023, 0], [1, 8192]) and cuts[1024] == ([1024, 0], [0, 8192])


@pytest.mark.parametrize("mesh", ["fsdp"])
def test_simulator_equals_a_real_two_rank_save(mesh: str) -> None:
    """The same shapes saved by a real 2-rank gloo job through ckptfs's writer: the
    simulated ``dcp.msgpack`` is the same bytes (attempt name and root aside), the manifest
    lists the same files with the same chunks and is as long."""
    check = scale.real_check(scale.Spec(mesh=mesh, shrink=64), 2, timeout=240)
    assert check["dcp_msgpack_equal"], check
    assert check["manifest_layout_equal"], check
    assert check["real"]["dcp_msgpack_bytes"] == check["sim"]["dcp_msgpack_bytes"]
    assert check["real"]["manifest_bytes"] == check["sim"]["manifest_bytes"]
    assert check["real"]["coordinator_s"] > 0 and check["sim"]["coordinator_s"] > 0


def test_table_has_the_columns_and_the_growth() -> None:
    rows = scale.run_scale([8, 16], ["fsdp", "hsdp"], shrink=64, reps=1, collect=False)
    text = scale_report.table(rows)
    for column in ("coordinator s", "metadata MB", "read MB/loading rank", "load s/rank",
                   "broadcast MB", "plans MB", "growth in W"):
        assert column in text
    by = {(r["mesh"], r["world"]): r for r in rows}
    for r in rows:
        ours, theirs = r["ckptfs"], r["dcp"]
        assert ours["metadata_bytes"] == ours["dcp_msgpack_bytes"] + ours["manifest_bytes"]
        assert ours["read_per_rank_bytes"] == ours["metadata_bytes"] + ours["marker_bytes"]
        assert theirs["metadata_bytes"] > 0 and ours["coordinator_s"] > 0
    # FSDP's chunk lists grow with the ranks; HSDP's (shard groups of 8) do not past 8: only
    # the deduplicated replicas' rank files differ.
    fsdp = [by["fsdp", w]["ckptfs"]["dcp_msgpack_bytes"] for w in (8, 16)]
    hsdp = [by["hsdp", w]["ckptfs"]["dcp_msgpack_bytes"] for w in (8, 16)]
    assert fsdp[1] > 1.5 * fsdp[0]
    assert hsdp[1] == pytest.approx(hsdp[0], rel=0.05)
    # format v5 (metadata_layout="per-rank") beside them: what one loading rank reads
    loads = scale_report.load_table(rows)
    assert "v2 / v5 / DCP" in loads and "| 16 |" in loads
    for r in rows:
        v5 = r["v5"]
        assert v5["read_per_rank_bytes"] == v5["decoded_per_rank_bytes"] > v5["manifest_bytes"]
        assert v5["load_per_rank_s"] > 0 and v5["coordinator_s"] > 0
    g = scale_report.growth(rows)["fsdp"]["ckptfs/metadata_bytes"]
    assert g is not None and 0.5 < g < 1.2


def test_slope() -> None:
    assert scale_report.slope([1, 10, 100], [3, 30, 300]) == pytest.approx(1.0)
    assert scale_report.slope([1, 10], [5, 500]) == pytest.approx(2.0)
    assert scale_report.slope([8], [1.0]) is None


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    assert bench_main(["scale", "--worlds", "2,4", "--mesh", "tp", "--json", str(out),
                       "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert [r["world"] for r in doc["rows"]] == [2, 4] and doc["meshes"] == ["tp"]
    assert "growth" in doc and "| 2 |" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot, a PNG
