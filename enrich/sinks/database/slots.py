"""One task's write: its slot's rows and fence row in ONE database transaction.

The fence row ``(query_id, slot, batch_id)`` is inserted first: when it is there already (the slot
committed this batch before: a replay, a task re-run), nothing is written. An attempt that runs
while another attempt of the same slot holds its fence row uncommitted waits on the primary key,
and writes nothing once that one commits (or writes the slot if it rolled back)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import KIND, KIND_CORRECTION
from enrich.sinks.database.connect import connect, fence_insert, replace_held, transient, upsert
from enrich.sinks.database.refuse import refused
from enrich.sinks.database.tables import TableSpec
from refstream.errors import RefstreamError

log = logging.getLogger(__name__)

__all__ = ["write_slot"]


def write_rows(spec: TableSpec, query_id: str, batch_id: int, rows: pa.Table,
               what: str) -> tuple[int | None, pa.Table, list[str]]:
    """The driver's rows of a batch (slot 0) written as :func:`write_slot` on a connection of its
    own. What the database would refuse (a key longer than MariaDB's key column, a NUL in PostgreSQL
    text) is left out, logged naming ``what``, not a statement that fails every retry and restart;
    returned with the reasons, for the caller to dead-letter (the same on a replay). Returns the
    rows written (None: a replay), the rows left out and why."""
    why = refused(rows, spec.dialect, spec.key)
    left, reasons = rows.slice(0, 0), []
    if why.null_count < len(why):
        left, reasons = rows.filter(pc.is_valid(why)), pc.drop_null(why).to_pylist()
        log.warning("batch %d: %s: %d row(s) not written to %s, the database would refuse them (first: %s)",
                    batch_id, what, left.num_rows, spec.table, reasons[0])
        rows = rows.filter(pc.is_null(why))
    conn = connect(spec.url, spec.dialect, spec.timeout)
    try:
        return write_slot(conn, spec, query_id, 0, batch_id, rows), left, reasons
    finally:
        conn.close()


def write_slot(conn: Any, spec: TableSpec, query_id: str, slot: int, batch_id: int, rows: pa.Table, *,
               written: Callable[[], None] | None = None) -> int | None:
    """Write ``rows`` (the table's columns, unique by its key) and the slot's fence row in one
    transaction on ``conn``; the number of rows written, or None when the fence row was there (a
    replay: nothing written). ``written`` is called after the rows went in, before the commit
    (the tests' kill hook). Database errors are raised as the job's transient or terminal errors.
    With ``spec.identity``, the corrections among ``rows`` replace, after the others went in, only
    the rows that hold their events (and count only those)."""
    what = f"batch {batch_id} slot {slot}: writing {spec.table}"
    fixes, replaced = None, 0
    if spec.identity and rows.num_rows:
        fix = pc.fill_null(pc.equal(rows.column(KIND), KIND_CORRECTION), False)
        fixes, rows = rows.filter(fix), rows.filter(pc.invert(fix))
    try:
        with conn.cursor() as cur:
            if not fence_insert(cur, spec.dialect, spec.fence, query_id, slot, batch_id):
                conn.rollback()
                log.info("batch %d slot %d: committed to %s before; skipped", batch_id, slot, spec.table)
                return None
            upsert(cur, spec.dialect, spec.table, rows, spec.key)
            if fixes is not None and fixes.num_rows:
                replaced = replace_held(cur, spec.dialect, spec.table, fixes, spec.key, spec.identity)
        if written is not None:
            written()
        conn.commit()
    except RefstreamError:
        _rollback(conn)
        raise
    except Exception as exc:  # noqa: BLE001 - the drivers' errors, classified by transient()
        _rollback(conn)
        raise transient(exc, what) from exc
    return rows.num_rows + replaced


def _rollback(conn: Any) -> None:
    try:
        conn.rollback()
    except Exception as exc:  # noqa: BLE001 - the connection may be gone; the transaction with it
        log.warning("rollback failed: %s", exc)
