"""Per-dataset status: committed state + last run + next scheduled run (written by the daemon)."""

from __future__ import annotations

import json
import logging
from typing import Any

from refresh.config import RefreshConfig
from refresh.stores.files import FileStateStore

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


def read_status(config: RefreshConfig) -> list[dict[str, Any]]:
    """One JSON-serialisable dict per configured dataset, in config order."""
    store = FileStateStore(config.state_dir)
    next_runs = read_next_runs(config)
    out = []
    for name, ds in config.datasets.items():
        state = store.load(name)
        st = store.read_status(name)
        last = st.get("last_run") or {}
        success = st.get("last_success") or {}
        out.append({
            "dataset": name, "topic": ds.topic, "mode": ds.mode,
            "source": ds.source.describe(),
            "schedule": ({"every": ds.schedule.every.total_seconds()} if ds.schedule.every else
                         {"cron": ds.schedule.cron} if ds.schedule.cron else None),
            "watch": ds.watch,
            "version": state.version, "rows": state.rows,
            "watermark": state.watermark, "last_reconcile": state.last_reconcile,
            "last_run": last.get("finished"), "last_result": ("ok" if last.get("ok") else
                                                               "interrupted" if last.get("interrupted") else "failed")
            if last else None,
            "last_error": last.get("error"), "last_kind": last.get("kind"),
            "last_seconds": last.get("seconds"),
            "last_changes": {k: last.get(k, 0) for k in ("inserts", "updates", "deletes")} if last else None,
            "last_published": last.get("published") if last else None,
            "last_success": success.get("finished"),
            "consecutive_failures": st.get("consecutive_failures", 0),
            "next_run": next_runs.get(name),
        })
    return out


def unhealthy(rows: list[dict[str, Any]]) -> list[str]:
    """What ``refresh status --check`` reports: datasets never published, or whose last run failed
    (an interrupted run is not a failure)."""
    out = []
    for r in rows:
        if r["last_result"] == "failed":
            out.append(f"dataset {r['dataset']}: last run failed: {r['last_error']}")
        elif not r["version"]:
            out.append(f"dataset {r['dataset']}: never published")
    return out


def format_status(rows: list[dict[str, Any]]) -> str:
    """A human table of :func:`read_status`."""
    head = ["DATASET", "MODE", "VERSION", "ROWS", "LAST RUN", "RESULT", "CHANGES +/~/-", "PUBLISHED",
            "WATERMARK", "NEXT RUN"]
    table = [head]
    for r in rows:
        ch = r["last_changes"]
        result = r["last_result"] or "-"
        table.append([
            r["dataset"], r["mode"], str(r["version"]), str(r["rows"]), _short(r["last_run"]), result,
            f"{ch['inserts']}/{ch['updates']}/{ch['deletes']}" if ch else "-",
            str(r["last_published"]) if r["last_published"] is not None else "-",
            str(r["watermark"]) if r["watermark"] is not None else "-", _short(r["next_run"]),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    for r in rows:
        if r["last_result"] == "failed":
            lines.append(f"{r['dataset']}: last error: {r['last_error']}")
    return "\n".join(lines)


def _short(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"
