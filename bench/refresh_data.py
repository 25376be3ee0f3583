"""Benchmark data for the refresher: a 10-column MariaDB table of mixed types, loaded fast, and the
"1% of rows changed" mutation applied between two refreshes.

Rows are generated column-wise with numpy/pyarrow, written as one CSV and loaded with
``LOAD DATA LOCAL INFILE`` (about 10x faster than multi-row INSERTs).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pymysql
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

COLUMNS_DDL = """
    id BIGINT NOT NULL PRIMARY KEY,
    name VARCHAR(64) NOT NULL,
    price DECIMAL(12,2) NOT NULL,
    updated_at DATETIME NOT NULL,
    born DATE NOT NULL,
    score DOUBLE NOT NULL,
    active TINYINT(1) NOT NULL,
    notes TEXT NOT NULL,
    qty INT NULL,
    category VARCHAR(16) NULL
"""
COLUMN_NAMES = ["id", "name", "price", "updated_at", "born", "score", "active", "notes", "qty", "category"]
_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
          "tau upsilon phi chi psi omega straße café naïve 東京 данные").split()
_CATEGORIES = ["sensor", "gateway", "meter", "camera", "tracker", "hub", "relay", "beacon"]


@dataclass(frozen=True)
class Mutation:
    updates: int
    inserts: int
    deletes: int

    @property
    def total(self) -> int:
        return self.updates + self.inserts + self.deletes


def connect(url: str, database: str | None = None) -> pymysql.connections.Connection:
    u = make_url(url)
    return pymysql.connect(host=u.host or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
                           password=u.password or "", database=database or u.database, charset="utf8mb4",
                           local_infile=True, autocommit=True)


def generate(first_id: int, n: int, rng: np.random.Generator) -> pa.Table:
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    ids_str = pc.cast(pa.array(ids), pa.string())
    names = pc.binary_join_element_wise("item-", ids_str, "-ä", "")
    cents = rng.integers(100, 10_000_000, n)
    price = pc.cast(pa.array(cents // 100), pa.string())
    frac = pc.utf8_lpad(pc.cast(pa.array(cents % 100), pa.string()), 2, "0")
    price = pc.binary_join_element_wise(price, frac, ".")
    base = np.datetime64("2020-01-01T00:00:00")
    updated = base + rng.integers(0, 5 * 365 * 86400, n).astype("timedelta64[s]")
    born = np.datetime64("1970-01-01") + rng.integers(0, 20_000, n).astype("timedelta64[D]")
    pool = pa.array([" ".join(rng.choice(_WORDS, size=rng.integers(3, 20))) for _ in range(4096)])
    notes = pool.take(pa.array(rng.integers(0, len(pool), n)))
    qty_mask = rng.random(n) < 0.1
    qty = pa.array(rng.integers(0, 1000, n), mask=qty_mask)
    cat_mask = rng.random(n) < 0.2
    category = pa.array(np.array(_CATEGORIES)[rng.integers(0, len(_CATEGORIES), n)], mask=cat_mask)
    return pa.table({
        "id": ids, "name": names, "price": price,
        "updated_at": pa.array(updated.astype("datetime64[s]")), "born": pa.array(born.astype("datetime64[D]")),
        "score": rng.normal(50, 20, n), "active": rng.integers(0, 2, n).astype(np.int8), "notes": notes,
        "qty": qty, "category": category,
    })


def load(conn: pymysql.connections.Connection, table: str, rows: int, *, seed: int = 7,
         chunk: int = 1_000_000) -> float:
    """(Re)create ``table`` with ``rows`` rows; returns seconds taken."""
    t0 = time.monotonic()
    rng = np.random.default_rng(seed)
    with conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS `{table}`")
        cur.execute(f"CREATE TABLE `{table}` ({COLUMNS_DDL}) ENGINE=InnoDB CHARACTER SET utf8mb4")
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            _load_chunk(cur, table, generate(start + 1, n, rng))
            log.info("loaded %d/%d rows into %s", start + n, rows, table)
        cur.execute(f"ANALYZE TABLE `{table}`")
    return time.monotonic() - t0


def _load_chunk(cur: pymysql.cursors.Cursor, table: str, t: pa.Table) -> None:
    fd, path = tempfile.mkstemp(suffix=".csv", prefix="refresh-bench-")
    os.close(fd)
    try:
        # Empty fields become NULL through NULLIF in the SET clause (the CSV writer has no NULL marker).
        pacsv.write_csv(t, path, pacsv.WriteOptions(include_header=False, quoting_style="none",
                                                    delimiter="\t"))
        cols = ", ".join("@" + c if c in ("qty", "category") else c for c in COLUMN_NAMES)
        cur.execute(
            f"LOAD DATA LOCAL INFILE %s INTO TABLE `{table}` CHARACTER SET utf8mb4 "
            f"FIELDS TERMINATED BY '\\t' LINES TERMINATED BY '\\n' ({cols}) "
            f"SET qty = NULLIF(@qty, ''), category = NULLIF(@category, '')", (path,))
    finally:
        os.unlink(path)


def mutate(conn: pymysql.connections.Connection, table: str, fraction: float, seed: int) -> Mutation:
    """Change ``fraction`` of the rows: 80% of it updates (various columns, some to NULL), 10% deletes,
    10% inserts of new keys. Distinct keys throughout, so the expected change counts are exact."""
    rng = np.random.default_rng(seed)
    with conn.cursor() as cur:
        cur.execute(f"SELECT MIN(id), MAX(id), COUNT(*) FROM `{table}`")
        lo, hi, count = cur.fetchone()
        total = max(3, int(count * fraction))
        n_upd, n_del = int(total * 0.8), total // 10
        n_ins = total - n_upd - n_del
        picked: set[int] = set()
        ids: list[int] = []
        while len(ids) < n_upd + n_del:  # ids may have gaps after earlier deletes: check they exist
            cand = [int(x) for x in rng.integers(lo, hi + 1, (n_upd + n_del) * 2) if int(x) not in picked]
            cur.execute(f"SELECT id FROM `{table}` WHERE id IN ({','.join(map(str, cand))})")
            for (i,) in cur.fetchall():
                if i not in picked and len(ids) < n_upd + n_del:
                    picked.add(i)
                    ids.append(i)
        upd, dele = ids[:n_upd], ids[n_upd:]
        groups = np.array_split(np.array(upd), 4)
        sets = ["price = price + 1.01", "notes = CONCAT(notes, ' edited'), updated_at = updated_at + "
                "INTERVAL 1 SECOND", "qty = IF(qty IS NULL, 1, NULL), active = 1 - active",
                "category = 'changed', score = score * 1.5 + 1"]
        for g, s in zip(groups, sets, strict=True):
            for part in np.array_split(g, max(1, len(g) // 5000 + 1)):
                if len(part):
                    cur.execute(f"UPDATE `{table}` SET {s} WHERE id IN ({','.join(map(str, part))})")
        for part in np.array_split(np.array(dele), max(1, len(dele) // 5000 + 1)):
            if len(part):
                cur.execute(f"DELETE FROM `{table}` WHERE id IN ({','.join(map(str, part))})")
        cur.execute(f"SELECT COALESCE(MAX(id), 0) FROM `{table}`")
        (top,) = cur.fetchone()
        _load_chunk(cur, table, generate(int(top) + 1, n_ins, rng))
    return Mutation(n_upd, n_ins, n_del)
