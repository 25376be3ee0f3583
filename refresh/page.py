"""The refresher's status page: one self-contained HTML document (inline CSS and SVG, no script, no
external assets) with a row per dataset, served at ``/`` next to ``/metrics``.

It reloads itself (``<meta http-equiv="refresh">``), so a browser left open on it stays current.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime

from refresh.stores.abc import DatasetStatus, RunRecord

__all__ = ["render", "sparkline"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .2em}
p.meta{color:#666;margin:0 0 1em}
table{border-collapse:collapse}
th,td{padding:.35em .8em;border-bottom:1px solid #ddd;text-align:left;vertical-align:middle}
th{background:#f4f4f4;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.result{font-weight:600;padding:.1em .5em;border-radius:3px}
.ok{background:#dff3e0;color:#1b5e20}.failed{background:#fde0dc;color:#b71c1c}
.refused{background:#fff3cd;color:#7a5b00}.interrupted{background:#e8eaf6;color:#283593}
.never{background:#eee;color:#555}
.error{color:#b71c1c;font-size:.9em;max-width:40em}
svg{display:block}
"""


def render(datasets: Sequence[tuple[DatasetStatus, Sequence[RunRecord]]], *, now: datetime | None = None,
           reload_seconds: int = 15, title: str = "refstream refresher") -> str:
    """The page for ``datasets`` (each with its run history, oldest first)."""
    now = now or datetime.now(UTC)
    rows = "\n".join(_row(st, runs, now) for st, runs in datasets)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(reload_seconds)}">
<title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body><h1>{html.escape(title)}</h1>
<p class="meta">{len(datasets)} dataset(s) &middot; as of {now.strftime('%Y-%m-%d %H:%M:%S')} UTC &middot; reloads every {int(reload_seconds)}s</p>
<table>
<thead><tr><th>Dataset</th><th>Last run</th><th>Result</th><th>Version</th><th>Rows</th><th>Changes</th>
<th>Age</th><th>Duration (last runs)</th><th>Changes (last runs)</th></tr></thead>
<tbody>
{rows}
</tbody></table></body></html>
"""


def _row(st: DatasetStatus, runs: Sequence[RunRecord], now: datetime) -> str:
    name = html.escape(st.dataset)
    last = st.last_run
    if last is None:
        return (f'<tr id="ds-{name}"><td>{name}</td><td>never</td><td><span class="result never">never run</span></td>'
                '<td class="num">-</td><td class="num">-</td><td>-</td><td>-</td><td></td><td></td></tr>')
    r = last.result
    outcome = r.outcome
    error = f'<div class="error">{html.escape(r.error)}</div>' if r.error and outcome != "ok" else ""
    success = st.last_success
    age = _ago(now, _parse(success.finished)) if success is not None else "never succeeded"
    changes = f"+{r.inserts} ~{r.updates} -{r.deletes}"
    durations = [run.result.seconds for run in runs]
    counts = [float(run.result.inserts + run.result.updates + run.result.deletes) for run in runs]
    version = (success.result.version if success is not None else r.version)
    rows = (success.result.rows if success is not None else r.rows)
    return (f'<tr id="ds-{name}"><td>{name}</td>'
            f'<td>{_ago(now, _parse(last.finished))} ago</td>'
            f'<td><span class="result {outcome}">{outcome}</span>{error}</td>'
            f'<td class="num">{version}</td><td class="num">{rows}</td><td>{changes}</td><td>{age}</td>'
            f'<td>{sparkline(durations, f"run duration of the last {len(runs)} runs, seconds", "#1565c0")}</td>'
            f'<td>{sparkline(counts, f"changes of the last {len(runs)} runs", "#2e7d32", bars=True)}</td></tr>')


def sparkline(values: Sequence[float], label: str, color: str, *, bars: bool = False, width: int = 120,
              height: int = 28) -> str:
    """An inline SVG of ``values`` (a line, or bars), scaled to its own maximum; its title names
    the series and the values."""
    title = f"<title>{html.escape(label)}: {', '.join(_num(v) for v in values) or 'none yet'}</title>"
    if not values:
        return f'<svg width="{width}" height="{height}" role="img">{title}</svg>'
    top = max(values) or 1.0
    n = len(values)
    step = width / max(n, 1)
    if bars:
        shapes = "".join(
            f'<rect x="{i * step + 0.5:.1f}" y="{height - 1 - (v / top) * (height - 2):.1f}" '
            f'width="{max(step - 1, 1):.1f}" height="{max((v / top) * (height - 2), 0.5):.1f}" fill="{color}"/>'
            for i, v in enumerate(values))
    else:
        xs = [i * (width - 2) / max(n - 1, 1) + 1 for i in range(n)]
        pts = " ".join(f"{x:.1f},{height - 1 - (v / top) * (height - 2):.1f}" for x, v in zip(xs, values, strict=True))
        shapes = f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'
    return f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">{title}{shapes}</svg>'


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


def _parse(iso: str) -> datetime:
    t = datetime.fromisoformat(iso)
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _ago(now: datetime, then: datetime) -> str:
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"
