"""All dimensions of a job, pinned per micro-batch.

``pin(batch_id)`` decides which changelog positions batch ``batch_id`` uses - the recorded ones when
the batch is a replay, the current end of every changelog otherwise (recorded before the batch runs)
- brings every dimension there and returns the shipped handles every task of the batch will use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from enrich.dimension.abc import ChangeFeed, Positions, VersionLog
from enrich.dimension.history import HistoryState, Journal
from enrich.dimension.ship import Shipped, Shipper
from enrich.dimension.store import DimensionState
from refstream import contract
from refstream.errors import ContractError, TransientError
from refstream.retry import RetryPolicy

log = logging.getLogger(__name__)

# Waiting (up to the manager's timeout) for a changelog topic to exist and for its schema record.
_OPEN_RETRY = RetryPolicy.every(1.0)
_SCHEMA_POLL = RetryPolicy.every(0.2)

T = TypeVar("T")


@dataclass
class _Dim:
    dataset: str
    columns: list[str] | None
    feed: ChangeFeed
    state: DimensionState
    shipped: Shipped | None = None
    shipped_gens: tuple[int, int] = (-1, -1)


class Dimensions:
    """Driver-side owner of every dimension: bootstrap, follow, pin, ship. The datasets in ``history``
    keep their versions that long (as-of joins: :class:`~enrich.dimension.history.HistoryState`).
    ``start``: where a checkpoint with no recorded batch bootstraps each dataset to (a fork: the
    positions its savepoint's batch read to, so that its first batch applies what came after, as the
    original job's next batch would); a dataset missing from it, to the end of its changelog."""

    def __init__(self, datasets: Mapping[str, str], columns: Mapping[str, Sequence[str] | None],
                 feed_factory: Callable[[str], ChangeFeed], versions: VersionLog, shipper: Shipper,
                 *, timeout: float = 60.0, history: Mapping[str, timedelta] | None = None,
                 journal: Iterable[str] = (), start: Mapping[str, Positions] | None = None) -> None:
        self._factory = feed_factory
        self._start = dict(start or {})
        self._history = dict(history or {})  # the as-of datasets: how far back they keep versions
        # The as-of datasets whose versions each pin reports (corrections: enrich.dimension.corrections).
        self._journal = frozenset(journal)
        unknown = self._journal - set(self._history)
        if unknown:
            raise ValueError(f"journaled dataset(s) {sorted(unknown)} keep no history")
        self._topics = dict(datasets)
        self._columns = {ds: (list(c) if c is not None else None) for ds, c in columns.items()}
        self._versions = versions
        self._shipper = shipper
        self._timeout = timeout
        self._dims: dict[str, _Dim] = {}
        self.last_pin_seconds = 0.0
        # The changelogs are read side by side: a read that found new records waits for its
        # partition-EOF, one fetch long-poll (``fetch.wait.max.ms``), and those waits overlap.
        self._pool: ThreadPoolExecutor | None = None

    def _each(self, fn: Callable[[str], T], datasets: Iterable[str]) -> list[T]:
        """``fn`` over ``datasets``, in threads when there are several; the first error is raised
        once every call has ended."""
        todo = list(datasets)
        if len(todo) <= 1:
            return [fn(ds) for ds in todo]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self._topics), thread_name_prefix="changelog")
        futures = [self._pool.submit(fn, ds) for ds in todo]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None:
                raise exc
        return [f.result() for f in futures]

    def _open(self, dataset: str) -> _Dim:
        error: TransientError | None = None
        for _ in _OPEN_RETRY.until(self._timeout):
            try:
                feed = self._factory(self._topics[dataset])
                history = self._history.get(dataset)
                state = DimensionState(dataset) if history is None else HistoryState(dataset, history)
                return _Dim(dataset, self._columns.get(dataset), feed, state)
            except TransientError as exc:
                error = exc
                log.info("dataset %s: %s; waiting", dataset, exc)
        assert error is not None
        raise error

    def bootstrap(self) -> None:
        """Build every dimension before the first batch: to the positions of the last recorded batch
        (a restart: that batch or the next one is what runs first), else to the ``start`` positions
        given, else to the end of each changelog."""
        latest = self._versions.latest()

        def one(ds: str) -> _Dim:
            t0 = time.monotonic()
            dim = self._open(ds)
            try:
                if latest is not None and ds in latest[1]:
                    self._read_recorded(dim, latest[1][ds])
                elif latest is None and ds in self._start:
                    self._read_recorded(dim, self._start[ds])
                else:
                    self._read_until_schema(dim)
            except BaseException:
                dim.feed.close()  # a retry opens it again and reads from the start
                raise
            dim.state.compact()
            log.info("dataset %s: bootstrapped %d rows from %s in %.1fs (positions %s)", ds,
                     len(dim.state), dim.feed.topic, time.monotonic() - t0, dim.feed.positions())
            return dim

        todo = [ds for ds in self._topics if ds not in self._dims]
        for ds, dim in zip(todo, self._each(one, todo), strict=True):
            self._dims[ds] = dim

    def _read_until_schema(self, dim: _Dim) -> None:
        """Read the changelog to its end, again and again until its schema record has arrived. A
        changelog too long to read in ``timeout`` is read on: its records are handed out only at its
        end, so until then the schema record it holds is not seen either."""
        while True:
            for _ in _SCHEMA_POLL.until(self._timeout):
                dim.state.apply(dim.feed.read_to_end(self._timeout))
                if dim.state.schema is not None:
                    return
                if dim.feed.pending():
                    break  # still arriving: a new timeout
            else:
                raise ContractError(f"dataset {dim.dataset}: no schema record on {dim.feed.topic} after "
                                    f"{self._timeout:.0f}s; is the refresher publishing it?")

    @property
    def shipper(self) -> Shipper:
        """What ships versions to the executors (its counters show what each batch cost)."""
        return self._shipper

    def schema(self, dataset: str) -> contract.DatasetSchema:
        s = self._dims[dataset].state.schema
        assert s is not None
        return s

    def state(self, dataset: str) -> DimensionState:
        """The driver-side state of ``dataset`` as of the last pin (for checks and tools)."""
        return self._dims[dataset].state

    def pin(self, batch_id: int, journaled: Callable[[Mapping[str, Journal], bool], None] | None = None
            ) -> dict[str, Shipped]:
        """Bring every dimension to batch ``batch_id``'s positions and ship it. ``journaled`` gets,
        for the journaled datasets, the versions this pin applied (:meth:`HistoryState.end_journal`)
        and whether the batch is a replay, before the batch's positions are recorded."""
        t0 = time.monotonic()
        self.bootstrap()
        recorded = self._versions.get(batch_id)
        if recorded is not None and any(self._behind(ds, pos) for ds, pos in recorded.items()):
            log.warning("batch %d replays positions older than the dimensions hold; rebuilding them", batch_id)
            self.close_feeds()
            self.bootstrap_to(recorded)
        def read(ds: str) -> Positions:
            dim = self._dims[ds]
            if ds in self._journal:
                assert isinstance(dim.state, HistoryState)
                dim.state.begin_journal()
            if recorded is not None and ds in recorded:
                self._read_recorded(dim, recorded[ds])
            else:
                dim.state.apply(dim.feed.read_to_end(self._timeout))
            return dim.feed.positions()

        positions = dict(zip(self._dims, self._each(read, self._dims), strict=True))
        # The journals stay open until the batch is recorded: a retried pin (a changelog that failed
        # to read, the callback) goes on with the versions an earlier attempt applied already.
        journals = {}
        for ds in self._journal:
            state = self._dims[ds].state
            assert isinstance(state, HistoryState)
            journals[ds] = state.end_journal(close=False)
        if journaled is not None:
            journaled(journals, recorded is not None)
        if recorded is None:
            now_ms = int(time.time() * 1000)  # the batch's time (enrich.state.wait): kept for its replays
            info = {ds: {"rows": dim.state.live_rows(), "version": dim.state.version,
                         "changed_ms": dim.state.changed_ms, "complete_as_of": self._complete(ds),
                         "pinned_ms": now_ms}
                    for ds, dim in self._dims.items()}
            self._versions.put(batch_id, positions, info)
        for ds in self._journal:  # recorded: the next pin journals afresh
            state = self._dims[ds].state
            assert isinstance(state, HistoryState)
            state.end_journal()
        out = {ds: self._ship(dim) for ds, dim in self._dims.items()}
        self.last_pin_seconds = time.monotonic() - t0
        return out

    def complete_as_of(self, dataset: str) -> datetime | None:
        """The time up to which ``dataset``'s state holds every change of its source, by the
        refresher's heartbeats (None until each changelog partition had one with a completeness)."""
        dim = self._dims[dataset]
        return dim.state.complete_as_of(dim.feed.positions())

    def batch_facts(self, batch_id: int, datasets: Sequence[str]) -> tuple[int, dict[str, str | None]]:
        """What :meth:`pin` recorded for ``batch_id`` before its first attempt: the batch's time
        (epoch ms) and each of ``datasets``' ``complete_as_of``; a replay gets the same. A batch
        recorded without them (by an older version) gets the time now and the completeness now."""
        info = self._versions.info(batch_id)
        times = [f["pinned_ms"] for f in info.values() if isinstance(f.get("pinned_ms"), int)]
        at = int(times[0]) if times else int(time.time() * 1000)  # type: ignore[call-overload]
        complete: dict[str, str | None] = {}
        for ds in datasets:
            facts = info.get(ds, {})
            got = facts.get("complete_as_of") if "pinned_ms" in facts else self._complete(ds)
            complete[ds] = got if isinstance(got, str) else None
        return at, complete

    def _complete(self, dataset: str) -> str | None:
        at = self.complete_as_of(dataset)
        return contract.format_time(at) if at is not None else None

    def _behind(self, ds: str, target: Positions) -> bool:
        dim = self._dims.get(ds)
        if dim is None:
            return False
        pos = dim.feed.positions()
        return any(pos.get(p, 0) > o for p, o in target.items())

    def bootstrap_to(self, positions: Mapping[str, Positions]) -> None:
        for ds in self._topics:
            dim = self._dims[ds] = self._open(ds)
            self._read_recorded(dim, positions.get(ds, {}))
            dim.state.compact()

    def _read_recorded(self, dim: _Dim, target: Positions) -> None:
        """Rebuild ``dim`` from the beginning of its changelog to the recorded positions ``target``.

        The changelog may no longer hold what was below them: compaction removes records (an older
        schema record included), and a recreated topic may end below them. The dimension is then
        rebuilt from what the topic holds - to its end where it ends short, on to the next schema
        record where none is left below - and a warning says that the replayed batch may differ
        from its first run; a restart never fails on it."""
        feed = dim.feed
        read = getattr(feed, "read_until_available", None)
        if read is None:
            dim.state.apply(feed.read_until(target, self._timeout))
            short: Positions = {}
        else:
            records, short = read(target, self._timeout)
            dim.state.apply(records)
        if short:
            log.warning("dataset %s: changelog %s ends below the recorded positions (partition: end %s, recorded "
                        "%s): rebuilt from what the topic holds; the replayed batch may differ from its first run",
                        dim.dataset, feed.topic, short, {p: target.get(p) for p in short})
        if dim.state.schema is None:
            log.warning("dataset %s: no schema record on %s below the recorded positions %s (compacted away); "
                        "reading on to the next one: the replayed batch may differ from its first run",
                        dim.dataset, feed.topic, target)
            self._read_until_schema(dim)

    def _ship(self, dim: _Dim) -> Shipped:
        gens = (dim.state.base_gen, dim.state.overlay_gen)
        if dim.shipped is None or gens != dim.shipped_gens:
            snap = dim.state.snapshot(dim.columns)
            dim.shipped = self._shipper.ship(snap)
            dim.shipped_gens = (snap.base_gen, snap.overlay_gen)
        return dim.shipped

    def close_feeds(self) -> None:
        for ds, dim in self._dims.items():
            dim.feed.close()
            self._shipper.forget(ds)
        self._dims = {}

    def close(self) -> None:
        self.close_feeds()
        self._shipper.close()
        if self._pool is not None:
            self._pool.shutdown()
