"""Per-dataset status: committed state + last run + next scheduled run (written by the daemon)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from refresh.config import Mode, RefreshConfig
from refresh.stores.abc import RunKind, RunOutcome
from refresh.stores.files import FileStateStore
from refstream.config import format_duration

__all__ = ["NEXT_RUNS", "StatusRow", "format_status", "read_next_runs", "read_status", "unhealthy"]

log = logging.getLogger(__name__)

NEXT_RUNS = "_daemon/next_runs.json"


def read_next_runs(config: RefreshConfig) -> dict[str, str]:
    p = config.state_dir / NEXT_RUNS
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("unreadable %s: %s", p, exc)
        return {}
    return {str(k): str(v) for k, v in obj.items()} if isinstance(obj, dict) else {}


class StatusRow(TypedDict):
    """One dataset in ``refresh status --json``."""

    dataset: str
    topic: str
    mode: Mode
    source: str
    schedule: dict[str, Any] | None
    watch: bool
    version: int
    rows: int
    watermark: Any
    last_reconcile: str | None
    # Every change of the source valid at or before this time is in the changelog (the completeness
    # the last successful run published; contract time text), None before the first.
    complete_as_of: str | None
    last_run: str | None
    last_result: RunOutcome | None
    last_error: str | None
    last_kind: RunKind | None
    last_reason: str | None        # why the last run was a republish
    last_seconds: float | None
    last_changes: dict[str, int] | None
    last_published: int | None
    last_success: str | None
    consecutive_failures: int
    next_run: str | None
    max_age: float | None          # seconds; `status --check` fails when the last success is older


def read_status(config: RefreshConfig) -> list[StatusRow]:
    """One JSON-serialisable row per configured dataset, in config order."""
    store = FileStateStore(config.state_dir)
    next_runs = read_next_runs(config)
    out: list[StatusRow] = []
    for name, ds in config.datasets.items():
        state = store.load(name)
        st = store.read_status(name)
        last = st.last_run.result if st.last_run else None
        out.append({
            "dataset": name, "topic": ds.topic, "mode": ds.mode,
            "source": ds.source.describe(),
            "schedule": ({"every": ds.schedule.every.total_seconds()} if ds.schedule.every else
                         {"cron": ds.schedule.cron} if ds.schedule.cron else None),
            "watch": ds.watch,
            "version": state.version, "rows": state.rows,
            "watermark": state.watermark, "last_reconcile": state.last_reconcile,
            "complete_as_of": state.complete_as_of,
            "last_run": st.last_run.finished if st.last_run else None,
            "last_result": last.outcome if last else None,
            "last_error": last.error if last else None, "last_kind": last.kind if last else None,
            "last_reason": last.reason if last else None,
            "last_seconds": last.seconds if last else None,
            "last_changes": {"inserts": last.inserts, "updates": last.updates, "deletes": last.deletes}
            if last else None,
            "last_published": last.published if last else None,
            "last_success": st.last_success.finished if st.last_success else None,
            "consecutive_failures": st.consecutive_failures,
            "next_run": next_runs.get(name),
            "max_age": ds.max_age.total_seconds() if ds.max_age is not None else None,
        })
    return out


def unhealthy(rows: list[StatusRow], *, max_age: float | None = None, now: datetime | None = None) -> list[str]:
    """What ``refresh status --check`` reports: datasets never published, whose last run failed or
    was refused (an interrupted run is not a failure), or whose last successful run is older than
    ``max_age`` seconds (default: each dataset's ``max_age``)."""
    now = now or datetime.now(UTC)
    out = []
    for r in rows:
        if r["last_result"] in ("failed", "refused"):
            out.append(f"dataset {r['dataset']}: last run {r['last_result']}: {r['last_error']}")
        elif not r["version"]:
            out.append(f"dataset {r['dataset']}: never published")
        limit = max_age if max_age is not None else r["max_age"]
        if limit is None:
            continue
        if r["last_success"] is None:
            if r["version"]:  # never published is reported above
                out.append(f"dataset {r['dataset']}: no successful run recorded (max age {format_duration(timedelta(seconds=limit))})")
            continue
        age = (now - _aware(datetime.fromisoformat(r["last_success"]))).total_seconds()
        if age > limit:
            out.append(f"dataset {r['dataset']}: last successful run {format_duration(timedelta(seconds=round(age)))} "
                       f"ago, older than {format_duration(timedelta(seconds=limit))}")
    return out


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def format_status(rows: list[StatusRow]) -> str:
    """A human table of :func:`read_status`."""
    head = ["DATASET", "MODE", "VERSION", "ROWS", "LAST RUN", "RESULT", "CHANGES +/~/-", "PUBLISHED",
            "COMPLETE AS OF", "WATERMARK", "NEXT RUN"]
    table = [head]
    for r in rows:
        ch = r["last_changes"]
        result = r["last_result"] or "-"
        table.append([
            r["dataset"], r["mode"], str(r["version"]), str(r["rows"]), _short(r["last_run"]), result,
            f"{ch['inserts']}/{ch['updates']}/{ch['deletes']}" if ch else "-",
            str(r["last_published"]) if r["last_published"] is not None else "-", _short(r["complete_as_of"]),
            str(r["watermark"]) if r["watermark"] is not None else "-", _short(r["next_run"]),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    for r in rows:
        if r["last_result"] in ("failed", "refused"):
            lines.append(f"{r['dataset']}: last error: {r['last_error']}")
        elif r["last_kind"] == "republish":
            lines.append(f"{r['dataset']}: last run republished everything: {r['last_reason']}")
    return "\n".join(lines)


def _short(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"
