"""Sample reference data for the demo: a ``devices`` table, a ``models`` table with a ``last_update``
column (the refresher's incremental mode) and a ``sites`` CSV file (``watch: true``).

Works on any SQLAlchemy URL the refresher reads; SQLite and MySQL/MariaDB are what the demo uses.
The data is deterministic: device ``d-N`` always has the same model, site and owner, and its id is
the one the simulator (:func:`demo.simulate.device_id`) sends.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import sqlalchemy as sa

from demo.simulate import device_id
from refstream.atomic import write_bytes_atomic

DEVICES_TABLE = "devices"
MODELS_TABLE = "models"
SITE_COLUMNS = ("site_id", "site_name", "region")

SITES: tuple[tuple[str, str, str], ...] = tuple(
    (f"s-{i}", name, region) for i, (name, region) in enumerate([
        ("Lyon", "FR-ARA"), ("Grenoble", "FR-ARA"), ("Paris Nord", "FR-IDF"), ("Paris Sud", "FR-IDF"),
        ("Lille", "FR-HDF"), ("Nantes", "FR-PDL"), ("Bordeaux", "FR-NAQ"), ("Toulouse", "FR-OCC"),
        ("Marseille", "FR-PAC"), ("Nice", "FR-PAC"), ("Strasbourg", "FR-GES"), ("Rennes", "FR-BRE"),
        ("Montpellier", "FR-OCC"), ("Dijon", "FR-BFC"), ("Tours", "FR-CVL"), ("Rouen", "FR-NOR"),
        ("Clermont", "FR-ARA"), ("Metz", "FR-GES"), ("Brest", "FR-BRE"), ("Ajaccio", "FR-COR"),
    ], start=1))

# (model_id, model_name, vendor, max_temp as a DECIMAL string)
MODELS: tuple[tuple[str, str, str, str], ...] = tuple(
    (f"m-{i}", name, vendor, max_temp) for i, (name, vendor, max_temp) in enumerate([
        ("Thermo T100", "Acme", "60.0"), ("Thermo T200", "Acme", "70.0"), ("Sense S1", "Initech", "55.5"),
        ("Sense S2", "Initech", "65.5"), ("Probe P7", "Globex", "80.0"), ("Probe P9", "Globex", "85.0"),
        ("Node N3", "Umbrella", "50.0"), ("Node N4", "Umbrella", "52.5"), ("Tag G1", "Hooli", "45.0"),
        ("Tag G2", "Hooli", "47.5"), ("Meter M5", "Stark", "90.0"), ("Meter M6", "Stark", "95.0"),
    ], start=1))

_OWNERS = ("ops", "facilities", "research", "logistics", "retail", "energy")


@dataclass(frozen=True)
class Device:
    device_id: str
    model_id: str
    site_id: str
    owner: str
    installed_on: date


def device(n: int) -> Device:
    """Device number ``n`` (1-based) of the sample data."""
    return Device(device_id(n), MODELS[(n * 7) % len(MODELS)][0], SITES[(n * 13) % len(SITES)][0],
                  _OWNERS[n % len(_OWNERS)], date(2023, 1, 1) + timedelta(days=n % 700))


def _ddl(dialect: str) -> list[str]:
    if dialect in ("mysql", "mariadb"):
        ts = "DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)"
    else:  # SQLite, PostgreSQL: the operator sets last_update explicitly, as applications do
        ts = "TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP"
    return [
        f"CREATE TABLE {MODELS_TABLE} (model_id VARCHAR(16) NOT NULL PRIMARY KEY, "
        f"model_name VARCHAR(64) NOT NULL, vendor VARCHAR(64) NOT NULL, max_temp DECIMAL(5,1), "
        f"last_update {ts})",
        f"CREATE TABLE {DEVICES_TABLE} (device_id VARCHAR(32) NOT NULL PRIMARY KEY, "
        f"model_id VARCHAR(16) NOT NULL, site_id VARCHAR(16) NOT NULL, owner VARCHAR(32), "
        f"installed_on DATE)",
    ]


def engine(url: str) -> sa.Engine:
    """An engine on the demo's database whose sessions run in UTC, as the refresher's do: the
    ``last_update`` values they write (``CURRENT_TIMESTAMP``, a backdated time) are the times the
    rows are valid from, whatever the server's zone (SQLite's clock is UTC already)."""
    u = sa.engine.make_url(url)
    args: dict[str, str] = {}
    if u.get_dialect().name in ("mysql", "mariadb"):
        args["init_command"] = "SET time_zone = '+00:00'"
    elif u.get_dialect().name == "postgresql":
        args["options"] = "-c TimeZone=UTC"
    return sa.create_engine(u, connect_args=args)


def seed_database(url: str, devices: int = 5000) -> None:
    """(Re)create the ``devices`` and ``models`` tables at ``url`` and fill them.

    Drops existing tables of those names: point it at a scratch database.
    """
    db = engine(url)
    try:
        with db.begin() as conn:
            for t in (DEVICES_TABLE, MODELS_TABLE):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {t}"))
            for stmt in _ddl(db.dialect.name):
                conn.execute(sa.text(stmt))
            conn.execute(sa.text(f"INSERT INTO {MODELS_TABLE} (model_id, model_name, vendor, max_temp) "
                                 "VALUES (:m, :n, :v, :t)"),
                         [{"m": m, "n": n, "v": v, "t": t} for m, n, v, t in MODELS])
            rows = [device(n).__dict__ for n in range(1, devices + 1)]
            conn.execute(sa.text(f"INSERT INTO {DEVICES_TABLE} (device_id, model_id, site_id, owner, "
                                 "installed_on) VALUES (:device_id, :model_id, :site_id, :owner, "
                                 ":installed_on)"), rows)
    finally:
        db.dispose()


def write_csv_atomic(path: str | os.PathLike[str], header: Sequence[str],
                     rows: Sequence[Sequence[str]]) -> None:
    """Write a CSV file the way editors save: a temp file beside it, fsync, rename over."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    write_bytes_atomic(Path(path), buf.getvalue().encode("utf-8"))


def read_csv(path: str | os.PathLike[str]) -> list[list[str]]:
    """Rows of a CSV file, header excluded."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))[1:]


def write_sites(path: str | os.PathLike[str], sites: Sequence[Sequence[str]] = SITES) -> None:
    write_csv_atomic(path, SITE_COLUMNS, sites)
