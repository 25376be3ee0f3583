"""The vectorised lookup join on real Spark (local), with dimensions shipped by broadcast."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from enrich.config import JoinConfig, JoinHow
from enrich.dimension.abc import Record
from enrich.dimension.ship import Shipper
from enrich.dimension.store import DimensionState
from enrich.joins import resolve
from enrich.query import apply_joins
from refstream import contract
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError

DEVICES = DatasetSchema("devices", ("device_id",), (
    Column("device_id", "string"), Column("site_id", "int64"), Column("price", "decimal(12,3)"),
    Column("installed", "timestamp"), Column("seen", "timestamp_tz"), Column("owner", "string")))
SITES = DatasetSchema("sites", ("site_id", "zone"), (
    Column("site_id", "int64"), Column("zone", "string"), Column("site_name", "string")))


def state(schema: DatasetSchema, msgs: list[contract.Message], offset: int = 0,
          s: DimensionState | None = None) -> DimensionState:
    s = s or DimensionState(schema.dataset)
    s.apply([Record(0, offset + i, m.key, m.value, m.headers) for i, m in enumerate(msgs)])
    return s


def join_cfg(dataset: str, on: dict[str, str | None], columns: list[str] | None = None, how: JoinHow = "left",
             prefix: str = "") -> JoinConfig:
    return JoinConfig(dataset=dataset, topic=f"ref.{dataset}", on=tuple(on.items()),
                      columns=tuple(columns) if columns else None, how=how, prefix=prefix)


@pytest.fixture
def dims() -> dict[str, DimensionState]:
    devices = state(DEVICES, [contract.schema_message(DEVICES), *contract.upsert_messages(DEVICES, [
        {"device_id": "d1", "site_id": 1, "price": Decimal("10.125"), "installed": datetime(2024, 1, 2, 3, 4, 5, 6),
         "seen": datetime(2024, 5, 1, 12, tzinfo=UTC), "owner": "ann"},
        {"device_id": "d2", "site_id": 2, "price": None, "installed": None, "seen": None, "owner": "bob"},
        {"device_id": "d3", "site_id": 9, "price": Decimal("1"), "installed": None, "seen": None, "owner": "cy"},
    ], 1)])
    devices.compact()
    sites = state(SITES, [contract.schema_message(SITES), *contract.upsert_messages(SITES, [
        {"site_id": 1, "zone": "eu", "site_name": "Paris"}, {"site_id": 2, "zone": "eu", "site_name": "Oslo"},
        {"site_id": 2, "zone": "us", "site_name": "Austin"}], 1)])
    return {"devices": devices, "sites": sites}


def run(spark: SparkSession, dims: dict[str, DimensionState], joins: list[JoinConfig], events: list[tuple],
        shipper: Shipper | None = None) -> list[dict]:
    shipper = shipper or Shipper(spark.sparkContext)
    df = spark.createDataFrame(events, "device_id STRING, zone STRING, n INT")
    specs, out = resolve(joins, {k: v.schema for k, v in dims.items()}, df.schema)
    shipped = {k: shipper.ship(v.snapshot()) for k, v in dims.items()}
    return sorted((r.asDict() for r in apply_joins(df.repartition(2), specs, out, shipped).collect()),
                  key=lambda r: r["n"])


def test_left_join_keeps_types_and_flags_unmatched(spark: SparkSession, dims: dict[str, DimensionState]) -> None:
    got = run(spark, dims, [join_cfg("devices", {"device_id": None})],
              [("d1", "eu", 1), ("zz", "eu", 2), (None, "eu", 3), ("d2", "eu", 4)])
    assert got[0] == {"device_id": "d1", "zone": "eu", "n": 1, "site_id": 1, "price": Decimal("10.125"),
                      "installed": datetime(2024, 1, 2, 3, 4, 5, 6),
                      "seen": datetime(2024, 5, 1, 12), "owner": "ann", "_devices_matched": True}
    assert got[1]["_devices_matched"] is False and got[1]["owner"] is None and got[1]["site_id"] is None
    assert got[2]["_devices_matched"] is False
    assert got[3]["owner"] == "bob" and got[3]["price"] is None and got[3]["_devices_matched"] is True


def test_output_schema_types(spark: SparkSession, dims: dict[str, DimensionState]) -> None:
    df = spark.createDataFrame([], "device_id STRING")
    _, out = resolve([join_cfg("devices", {"device_id": None})], {"devices": dims["devices"].schema}, df.schema)
    types = {f.name: f.dataType.simpleString() for f in out.fields}
    assert types == {"device_id": "string", "site_id": "bigint", "price": "decimal(12,3)",
                     "installed": "timestamp_ntz", "seen": "timestamp", "owner": "string",
                     "_devices_matched": "boolean"}


def test_chained_composite_and_inner(spark: SparkSession, dims: dict[str, DimensionState]) -> None:
    joins = [join_cfg("devices", {"device_id": None}, ["site_id", "owner"]),
             join_cfg("sites", {"site_id": "site_id", "zone": "zone"}, ["site_name"], how="inner")]
    got = run(spark, dims, joins, [("d1", "eu", 1), ("d2", "us", 2), ("d2", "eu", 3), ("d3", "eu", 4),
                                   ("nope", "eu", 5)])
    assert [(r["n"], r["owner"], r["site_name"]) for r in got] == [(1, "ann", "Paris"), (2, "bob", "Austin"),
                                                                   (3, "bob", "Oslo")]
    assert all(r["_sites_matched"] for r in got)


def test_overlay_updates_deletes_and_reinserts_without_new_base(spark: SparkSession,
                                                                 dims: dict[str, DimensionState]) -> None:
    shipper = Shipper(spark.sparkContext)
    joins = [join_cfg("devices", {"device_id": None}, ["owner"])]
    events = [("d1", "eu", 1), ("d2", "eu", 2), ("d3", "eu", 3), ("d4", "eu", 4)]
    before = run(spark, dims, joins, events, shipper)
    assert [r["owner"] for r in before] == ["ann", "bob", "cy", None]
    shipped_bytes = shipper.bytes_shipped
    row = {"device_id": "d1", "site_id": 1, "price": None, "installed": None, "seen": None}
    state(DEVICES, [*contract.upsert_messages(DEVICES, [{**row, "owner": "zed"}], 2),
                    *contract.delete_messages(DEVICES, [{"device_id": "d2"}], 2),
                    *contract.delete_messages(DEVICES, [{"device_id": "d3"}], 2),
                    *contract.upsert_messages(DEVICES, [{**row, "device_id": "d3", "owner": "new"},
                                                        {**row, "device_id": "d4", "owner": "four"}], 2)],
          100, dims["devices"])
    after = run(spark, dims, joins, events, shipper)
    assert [(r["owner"], r["_devices_matched"]) for r in after] == [("zed", True), (None, False), ("new", True),
                                                                     ("four", True)]
    # Only the small overlay went out, not a new devices base.
    snap = dims["devices"].snapshot()
    assert snap.overlay is not None and snap.overlay.num_rows == 4
    assert 0 < shipper.bytes_shipped - shipped_bytes < 4_000


def test_plan_errors_name_the_join(spark: SparkSession, dims: dict[str, DimensionState]) -> None:
    df = spark.createDataFrame([], "device_id STRING, site_id BIGINT")
    schemas = {k: v.schema for k, v in dims.items()}
    with pytest.raises(ConfigError, match=r"joins\[0\] \(sites\): on: names 1 column"):
        resolve([join_cfg("sites", {"site_id": None})], schemas, df.schema)
    with pytest.raises(ConfigError, match=r"joins\[1\] \(devices\): on: column 'owner_id' is neither"):
        resolve([join_cfg("devices", {"device_id": None}, ["owner"], prefix="a_"),
              join_cfg("devices", {"owner_id": "device_id"})], schemas, df.schema)
    with pytest.raises(ConfigError, match=r"column 'site_id' already exists"):
        resolve([join_cfg("devices", {"device_id": None}, ["site_id"])], schemas, df.schema)
    with pytest.raises(ConfigError, match=r"columns: \['colour'\] not in the published schema"):
        resolve([join_cfg("devices", {"device_id": None}, ["colour"])], schemas, df.schema)


def test_lookup_finds_int_and_string_keys_and_misses() -> None:
    from enrich.joins import Lookup, _key_values

    ints = Lookup(pa.table({"k": pa.array([30, 10, 20], pa.int64()), "v": ["c", "a", "b"]}), ["k"])
    values, nulls = _key_values([pa.array([10, None, 20, 99, 30], pa.int64())])
    found = ints.find(values)
    found[nulls] = -1
    assert found.tolist() == [1, -1, 2, -1, 0]
    strs = Lookup(pa.table({"k": ["x", "y"], "v": [1, 2]}), ["k"])
    values, nulls = _key_values([pa.array(["y", None, "z", "x"])])
    found = strs.find(values)
    found[nulls] = -1
    assert found.tolist() == [1, -1, -1, 0]


def test_an_inner_join_retracts_a_correction_it_finds_no_row_for(spark: SparkSession,
                                                                  dims: dict[str, DimensionState]) -> None:
    """With corrections (the rows carry _kind and _retracted): an event without a match is dropped, a
    correction without one goes on, retracted; a matched correction is not."""
    shipper = Shipper(spark.sparkContext)
    df = spark.createDataFrame([("d1", "eu", 1, "event", False), ("nope", "eu", 2, "event", False),
                                ("nope", "eu", 3, "correction", False), ("d1", "eu", 4, "correction", False)],
                               "device_id STRING, zone STRING, n INT, _kind STRING, _retracted BOOLEAN")
    specs, out = resolve([join_cfg("devices", {"device_id": None}, ["owner"], how="inner")],
                         {k: v.schema for k, v in dims.items()}, df.schema)
    shipped = {k: shipper.ship(v.snapshot()) for k, v in dims.items()}
    got = sorted((r.asDict() for r in apply_joins(df, specs, out, shipped).collect()), key=lambda r: r["n"])
    assert [(r["n"], r["owner"], r["_devices_matched"], r["_retracted"]) for r in got] == [
        (1, "ann", True, False), (3, None, False, True), (4, "ann", True, False)]
