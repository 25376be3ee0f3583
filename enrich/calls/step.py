"""One bucket's calls in one micro-batch, inside the state step, after the state update.

Each device's events are gone through in event-time order (ties by Kafka partition and offset, as
the engine applies them); at each event every call runs in ``needs`` order when its ``refresh``
asks for it: no result yet (or the last call failed), the result older than the duration, or every
event. A device's calls are sequential; different devices' run concurrently (``concurrency`` per
call). Devices none of whose calls is due are not gone through in Python: their events carry the
stored results.

The results are kept per device in the bucket's call table (one row per device: per call whether
its last call succeeded, the event time it was made at, its fields), stored next to the device
table and dropped with the device when its state expires.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from enrich.calls import client
from enrich.calls.client import CallFailed, Outcome
from enrich.calls.config import CallConfig
from enrich.calls.fields import ARROW
from enrich.calls.record import read_record, write_record
from enrich.calls.template import STATE, Ref
from enrich.checkpoint import CheckpointLayout

__all__ = ["FAILED", "STARTED_PROPERTY", "BucketCalls", "CallStep", "KEY", "read_tallies"]

log = logging.getLogger(__name__)

KEY = "_key"
#: Spark's local properties of a micro-batch's jobs: the query's id (kept in its checkpoint, the same
#: across restarts) and the batch id.
QUERY_ID, BATCH_ID = "sql.streaming.queryId", "streaming.sql.batchId"
#: The local property the driver sets at a micro-batch's start (its wall clock, seconds since the
#: epoch): the calls' ``budget`` runs from it, whichever task and worker makes them.
STARTED_PROPERTY = "refstream.calls.started"
#: A tally's label suffix of a call's failures (not a result of ``refstream_enrich_calls_total``).
FAILED = "!failed"


@dataclass(frozen=True)
class BucketCalls:
    """:meth:`CallStep.run`'s result: per result column its values per event (input order); per
    event the dead-letter reason (None: none); the bucket's new call table (None: unchanged);
    counts by ``(call, result)``; per call that failed, how often and its first error."""

    columns: dict[str, pa.Array]
    reasons: list[str | None]
    table: pa.Table | None
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)

    def tally(self) -> dict[str, Any]:
        """What the bucket reports to the driver (the job's ``KeyedTallies`` accumulator):
        ``"<call>|<result>"`` -> n, and ``"<call>|!failed"`` -> ``[n, first error]``."""
        out: dict[str, Any] = {f"{c}|{r}": n for (c, r), n in self.counts.items()}
        out.update({f"{c}|{FAILED}": [n, first] for c, (n, first) in self.errors.items()})
        return out


@dataclass(frozen=True)
class CallStep:
    """The calls of a pipeline as the state step runs them; picklable. ``key_type``: the device
    key's Arrow type; ``checkpoint``: the checkpoint's root (the executors record responses there)."""

    calls: tuple[CallConfig, ...]
    key_type: pa.DataType
    checkpoint: str

    def schema(self) -> pa.Schema:
        """The call table's schema: the key, then per call ``<name>__ok``, ``<name>__at`` (event
        time, microseconds) and its result fields."""
        fields = [pa.field(KEY, self.key_type, False)]
        for c in self.calls:
            fields += [pa.field(f"{c.name}__ok", pa.bool_()), pa.field(f"{c.name}__at", pa.int64())]
            fields += [pa.field(col, ARROW[t]) for col, (_, t) in zip(c.columns, c.response, strict=True)]
        return pa.schema(fields)

    def conform(self, table: pa.Table) -> pa.Table:
        """A stored call table in :meth:`schema`: the calls configured may have changed since it was
        stored (``calls:`` added, a call added or removed, a response field added or retyped). A
        call with a column missing or of another type starts over (all its columns null: made again
        at the device's next event); columns of calls no longer configured are dropped."""
        schema = self.schema()
        if table.schema == schema:
            return table
        have = {f.name: f.type for f in table.schema}
        cols = [table.column(KEY).cast(self.key_type)]
        for c in self.calls:
            names = [f"{c.name}__ok", f"{c.name}__at", *c.columns]
            kept = all(have.get(n) == schema.field(n).type for n in names)
            cols += [table.column(n) if kept else pa.nulls(table.num_rows, schema.field(n).type) for n in names]
        return pa.Table.from_arrays(cols, schema=schema)

    def result_columns(self) -> list[tuple[str, pa.DataType]]:
        return [(col, ARROW[t]) for c in self.calls for col, (_, t) in zip(c.columns, c.response, strict=True)]

    def event_columns(self) -> set[str]:
        """The event columns the templates read."""
        return {r.name for c in self.calls for r in c.body.refs() if r.scope is None}

    def stale(self, table: pa.Table, devices: Mapping[str, pa.Array | pa.ChunkedArray]) -> pa.Table:
        """The call table with the results of ``devices[name]`` (per call, the devices whose events a
        late reference version corrected in a column its template reads) taken as not made: each is
        made again at the device's next event, whatever its ``refresh`` (a call made at every event
        is anyway), as are the calls that need it. The new call has the batch's Idempotency-Key."""
        marked = {c.name: pa.array([], self.key_type) for c in self.calls}
        for name, keys in devices.items():
            marked[name] = pa.concat_arrays([marked[name], pa.array(keys).cast(self.key_type)])
        for c in self.calls:  # in needs order: a call that needs a stale one is stale for its devices too
            for n in c.needs:
                marked[c.name] = pa.concat_arrays([marked[c.name], marked[n]])
        for c in self.calls:
            if c.every_event or not len(marked[c.name]):
                continue
            hit = pc.is_in(table.column(KEY), value_set=marked[c.name])
            i = table.schema.get_field_index(f"{c.name}__ok")
            table = table.set_column(i, table.schema.field(i), pc.if_else(hit, False, table.column(i)))
        return table

    def keep(self, table: pa.Table | None, devices: pa.Array | pa.ChunkedArray) -> pa.Table | None:
        """The call table without the devices not in ``devices`` (the keys of the device table):
        their state expired. None when nothing was dropped."""
        if table is None or not table.num_rows:
            return None
        keep = pc.is_in(table.column(KEY), value_set=devices)
        return None if pc.all(keep).as_py() else table.filter(keep)

    def run(self, bucket: int, table: pa.Table, key: str, ts_us: np.ndarray, state: pa.StructArray,
            stored: pa.Table | None, ids: tuple[str, int] | None = None,
            start: float | None = None) -> BucketCalls:
        """The calls of one bucket's events ``table`` (in output order; ``key`` its device column,
        ``ts_us`` the event times, ``state`` each event's state struct, null where not applied:
        late events and dead letters make no call), given the stored call table (expired devices
        already dropped). ``ids``: the query id and batch id (default: Spark's local properties);
        ``start``: the batch's start on ``time.monotonic()`` (default: :data:`STARTED_PROPERTY`,
        else now), which the calls' budgets run from."""
        if start is None:
            start = _start(ids is None)
        query, batch = ids if ids is not None else _ids()
        n = table.num_rows
        if stored is None:
            stored = self.schema().empty_table()
        applied = state.is_valid().to_numpy(zero_copy_only=False) if n else np.zeros(0, bool)
        keys = table.column(key).combine_chunks()
        found = pc.index_in(keys, value_set=stored.column(KEY).combine_chunks()).fill_null(-1)
        at = found.to_numpy(zero_copy_only=False).astype(np.int64)
        due = np.zeros(n, dtype=bool)
        for c in self.calls:
            if c.every_event:
                due |= applied
                continue
            ok = np.zeros(n, dtype=bool)
            when = np.zeros(n, dtype=np.int64)
            if stored.num_rows:
                pick = pa.array(at, mask=at < 0)
                ok = stored.column(f"{c.name}__ok").take(pick).fill_null(False).to_numpy(zero_copy_only=False)
                when = stored.column(f"{c.name}__at").take(pick).fill_null(0).to_numpy(zero_copy_only=False)
            stale = ~ok
            if c.refresh is not None:
                stale |= ts_us - when > int(c.refresh.total_seconds() * 1_000_000)
            due |= applied & stale
        go = np.flatnonzero(applied & pc.is_in(keys, value_set=keys.filter(pa.array(due))).to_numpy(
            zero_copy_only=False)) if due.any() else np.zeros(0, dtype=np.int64)
        cols = [(col, typ) for col, typ in self.result_columns()]
        if not len(go):
            pick = pa.array(at, mask=(at < 0) | ~applied)
            columns = {col: stored.column(col).take(pick) for col, _ in cols}
            return BucketCalls(columns, [None] * n, None)
        # The devices gone through, each one's events in application order.
        sub = pa.table({"k": keys.take(pa.array(go)), "t": pa.array(ts_us[go]),
                        **{t: table.column(t).combine_chunks().take(pa.array(go)) for t in ("_partition", "_offset")
                           if t in table.column_names}})
        order = go[pc.sort_indices(sub, [(c, "ascending") for c in sub.column_names]).to_numpy()]
        wanted = self.event_columns()
        state_names = [f.name for f in state.type]
        wanted_state = {r.name for c in self.calls for r in c.body.refs() if r.scope == STATE} & set(state_names)
        rows = pa.array(order)
        ev = {c: table.column(c).take(rows).to_pylist() for c in sorted(wanted)}
        st = {s: state.field(s).take(rows).to_pylist() for s in sorted(wanted_state)}
        dev = keys.take(rows).to_pylist()
        ts = ts_us[order].tolist()
        seeds = (stored.take(pa.array(at[order], mask=at[order] < 0)).to_pylist() if stored.num_rows else None)
        record = CheckpointLayout(Path(self.checkpoint)).call_record(batch, bucket)
        recorded = read_record(record)
        run = _Run(self, recorded, f"{query}-{batch}-", start)
        groups: list[tuple[int, int]] = []
        start = 0
        for i in range(1, len(order) + 1):
            if i == len(order) or dev[i] != dev[start]:
                groups.append((start, i))
                start = i
        per_event: list[dict[str, Any]] = [{} for _ in order]
        reasons: list[str | None] = [None] * len(order)
        finals: list[dict[str, Any]] = []

        async def device(lo: int, hi: int) -> None:
            seed = seeds[lo] if seeds is not None and at[order[lo]] >= 0 else None
            cur: dict[str, Any] = dict(seed) if seed is not None else {KEY: dev[lo]}
            made: dict[str, int] = {}
            for i in range(lo, hi):
                for c in self.calls:
                    okc, when = cur.get(f"{c.name}__ok"), cur.get(f"{c.name}__at")
                    if not (okc and not c.every_event and (c.refresh is None
                                                           or ts[i] - when <= c.refresh.total_seconds() * 1e6)):
                        if not all(cur.get(f"{n}__ok") for n in c.needs):
                            _set(cur, c, False, ts[i], None)   # its needs failed: not made, fields null
                            continue
                        nth = made.get(c.name, 0)
                        made[c.name] = nth + 1
                        body = c.body.render(functools.partial(_value, i=i, ev=ev, st=st, cur=cur))
                        # Quoted: the key goes into a header, which a device id's control character would break.
                        outcome = await run.call(c, body, f"{quote(str(dev[lo]), safe='')}-{c.name}-{nth}")
                        _set(cur, c, outcome.result == "ok", ts[i], outcome.values)
                        if outcome.result != "ok":
                            run.failed(c, dev[lo], outcome)
                            # A data error fails again on every replay: never the batch, a dead letter instead.
                            if (c.on_error == "dead_letter" or (c.on_error == "fail" and outcome.data)) \
                                    and reasons[i] is None:
                                reasons[i] = f"call {c.name} failed: {outcome.error}"
                    per_event[i].update({col: cur.get(col) for col in c.columns})
            finals.append(cur)

        async def everything() -> None:
            await asyncio.gather(*(device(lo, hi) for lo, hi in groups))

        client.run(everything())
        if run.fatal is not None:
            raise CallFailed(run.fatal)
        if run.fresh:
            kept = write_record(record, run.fresh)
            if any(kept[k].to_json() != o.to_json() for k, o in run.fresh.items()):
                # Another attempt of this bucket recorded first: go again with what it recorded.
                return self.run(bucket, table, key, ts_us, state, stored, (query, batch), start)
        run.log_errors(bucket)
        # The events gone through take their values from per_event; the others the stored ones.
        sel = np.where((at >= 0) & applied, at, -1)
        sel[order] = stored.num_rows + np.arange(len(order))
        pick = pa.array(sel, mask=sel < 0)
        columns = {}
        for col, typ in cols:
            mine = pa.array([e.get(col) for e in per_event], typ)
            columns[col] = pa.concat_arrays([stored.column(col).combine_chunks().cast(typ), mine]).take(pick)
        out_reasons: list[str | None] = [None] * n
        for j, r in zip(order.tolist(), reasons, strict=True):
            out_reasons[j] = r
        touched = pa.Table.from_pylist(sorted(finals, key=lambda r: r[KEY]), schema=self.schema())
        untouched = stored.filter(pc.invert(pc.is_in(stored.column(KEY), value_set=touched.column(KEY))))
        new = pa.concat_tables([untouched, touched]).combine_chunks()
        return BucketCalls(columns, out_reasons, new, run.counts, run.errors)


def _set(cur: dict[str, Any], c: CallConfig, ok: bool, ts: int, values: Mapping[str, Any] | None) -> None:
    cur[f"{c.name}__ok"], cur[f"{c.name}__at"] = ok, ts
    for (f, _), col in zip(c.response, c.columns, strict=True):
        cur[col] = values.get(f) if values is not None and ok else None


def _value(ref: Ref, i: int, ev: Mapping[str, list[Any]], st: Mapping[str, list[Any]], cur: Mapping[str, Any]) -> Any:
    if ref.scope is None:
        return ev[ref.name][i]
    if ref.scope == STATE:
        return st[ref.name][i] if ref.name in st else cur.get(ref.name)
    return cur.get(f"{ref.scope}_{ref.name}")


class _Run:
    """One bucket's calls: recorded outcomes reused, new ones made and kept, counts, failures."""

    def __init__(self, step: CallStep, recorded: dict[str, Outcome], prefix: str, start: float) -> None:
        self.recorded, self.prefix = recorded, prefix
        self.deadlines = {c.name: start + c.budget.total_seconds() for c in step.calls}
        self.fresh: dict[str, Outcome] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.errors: dict[str, tuple[int, str]] = {}
        self.fatal: str | None = None
        self.limits = {c.name: asyncio.Semaphore(c.concurrency) for c in step.calls}

    def count(self, call: str, result: str, n: int = 1) -> None:
        if n:
            self.counts[(call, result)] = self.counts.get((call, result), 0) + n

    async def call(self, c: CallConfig, body: Any, key: str) -> Outcome:
        # The request's digest ends the key: a template, URL or header changed between a crash and
        # the replay is another request, so it never reuses the response recorded for the first.
        key = f"{self.prefix}{key}-{request_digest(c, body)}"
        got = self.recorded.get(key)
        if got is not None:
            self.count(c.name, "replayed")
            return got
        async with self.limits[c.name]:
            outcome = await client.client().call(c, body, key, self.deadlines[c.name])
        self.fresh[key] = outcome
        self.count(c.name, outcome.result)
        self.count(c.name, "retried", max(0, outcome.tries - 1))
        return outcome

    def failed(self, c: CallConfig, device: Any, outcome: Outcome) -> None:
        n, first = self.errors.get(c.name, (0, f"device {device}: {outcome.error}"))
        self.errors[c.name] = (n + 1, first)
        if c.on_error == "fail" and not outcome.data and self.fatal is None:
            self.fatal = f"call {c.name} failed for device {device}: {outcome.error}"

    def log_errors(self, bucket: int) -> None:
        for name, (n, first) in self.errors.items():
            log.warning("call %s failed %d time(s) in bucket %d (first: %s)", name, n, bucket, first)


#: Headers that say who asks, not what is asked: a rotated token leaves the request's key alone.
_CREDENTIALS = frozenset({"authorization", "proxy-authorization", "cookie"})


def request_digest(c: CallConfig, body: Any) -> str:
    """16 hex digits of SHA-256 over what a call sends: method, URL, rendered body, its headers but
    the credentials (:data:`_CREDENTIALS`)."""
    headers = sorted((k.lower(), v) for k, v in c.headers if k.lower() not in _CREDENTIALS)
    text = json.dumps([c.method, c.url, body, headers], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _start(in_spark: bool) -> float:
    """The batch's start on this process's ``time.monotonic()``: from the driver's
    :data:`STARTED_PROPERTY` inside a task (clocks apart by less than a batch), else now."""
    now = time.monotonic()
    if not in_spark:
        return now
    from pyspark import TaskContext

    ctx = TaskContext.get()
    raw = ctx.getLocalProperty(STARTED_PROPERTY) if ctx is not None else None
    if raw is None:
        return now
    return now - max(0.0, time.time() - float(raw))


def _ids() -> tuple[str, int]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    query = ctx.getLocalProperty(QUERY_ID) if ctx is not None else None
    batch = ctx.getLocalProperty(BATCH_ID) if ctx is not None else None
    if query is None or batch is None:
        raise RuntimeError("calls run inside a streaming query's micro-batch (no query or batch id)")
    return query, int(batch)


def read_tallies(tallies: Mapping[int, Mapping[str, Any]]) -> tuple[dict[tuple[str, str], int],
                                                                     dict[str, tuple[int, str]]]:
    """The buckets' tallies (:meth:`BucketCalls.tally`, keyed by bucket) summed: counts by ``(call,
    result)``, and per failing call its failures and the first error of the lowest bucket."""
    counts: dict[tuple[str, str], int] = {}
    failures: dict[str, tuple[int, str]] = {}
    for bucket in sorted(tallies):
        for label, v in tallies[bucket].items():
            call, result = label.rsplit("|", 1)
            if result == FAILED:
                n, first = failures.get(call, (0, str(v[1])))
                failures[call] = (n + int(v[0]), first)
            else:
                counts[(call, result)] = counts.get((call, result), 0) + int(v)
    return counts, failures
