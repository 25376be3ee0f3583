"""The operator part of the demo: change reference data the way people do, and show when each change
reaches the enriched output.

Every step registers what the enriched output should show, makes the change, then waits for it
while sending a few probe events for the device concerned (the simulator spreads its events over
thousands of devices; probes make the wait measure the pipeline, not the dice).
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer

from demo.graphs import cause_label, utc_hms
from demo.seed import DEVICES_TABLE, MODELS, MODELS_TABLE, SITES, device, engine, read_csv, write_sites
from demo.simulate import make_event, now_iso
from demo.tail import EnrichedTail, Event, Expectation


class ChangeNotSeen(RuntimeError):
    """A change did not reach the enriched output in time."""


class Stopped(Exception):  # noqa: N818 - control flow, not an error
    """The demo was asked to stop (Ctrl-C, SIGTERM, --duration)."""


def stamp(monotonic: float | None = None) -> str:
    """Wall-clock ``HH:MM:SS`` of now, or of an earlier ``time.monotonic()`` reading."""
    now = datetime.now()
    if monotonic is not None:
        now -= timedelta(seconds=max(0.0, time.monotonic() - monotonic))
    return now.strftime("%H:%M:%S")


_line_open = False


def say(text: str, end: str = "\n") -> None:
    """Print a line of the demo's story; a new ``[time]`` line first ends one left open."""
    global _line_open
    if _line_open and text.startswith("["):
        print(flush=True)
    print(text, end=end, flush=True)
    _line_open = not end.endswith("\n")


@dataclass
class Results:
    latencies: list[tuple[str, float]] = field(default_factory=list)


#: The device the operator's changes are about (``device(SUBJECT)``); the demo follows its state.
SUBJECT = 17
#: The device the operator deletes.
GONE = 42
#: How far back the backdated change of a model's name goes at most (not before the model's version
#: it replaces): within the models join's correction horizon (``corrections:`` in the demo's enrich.yaml).
BACKDATE = timedelta(minutes=2)


def device_state(event: Event) -> str:
    """The device's running state an enriched event carries (the ``state:`` section of the demo's
    enrich.yaml): its event count and temperature mean, and the risk score the ``calls:`` section's
    call returned for it (demo/risk.py)."""
    state = event.get("state")
    if not state:
        return "late: no device state" if event.get("_late") else "no device state"
    mean = state.get("temperature_mean")
    risk = state.get("risk_score")
    shown = "-" if risk is None else f"{risk:.1f} ({state.get('risk_level')})"
    return f"events {state['events']}, temperature mean {'-' if mean is None else f'{mean:.1f}'}, risk {shown}"


def matched(event: Event, dataset: str, witness: str) -> bool:
    """Whether ``event`` found a row of ``dataset`` (the job's ``_<dataset>_matched`` flag, or a
    non-null column of that dataset when the flag is absent)."""
    flag = event.get(f"_{dataset}_matched")
    return bool(flag) if flag is not None else event.get(witness) is not None


class Operator:
    """Runs the scripted changes against the database, the CSV file and the refresher CLI."""

    def __init__(self, *, db_url: str, sites_csv: Path, tail: EnrichedTail, producer: Producer,
                 events_topic: str, refresh_cmd: Sequence[str], timeout: float,
                 stop: threading.Event, check: Callable[[], None], devices: int) -> None:
        self.engine = engine(db_url)
        self.sites_csv = sites_csv
        self.tail, self.producer, self.events_topic = tail, producer, events_topic
        self.refresh_cmd = list(refresh_cmd)
        self.timeout, self.stop, self.check = timeout, stop, check
        self.devices = devices
        self.results = Results()
        self._seq = 10**9  # probe sequence numbers, far from the simulator's

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------------------- the script

    def run(self) -> Results:
        d = device(SUBJECT)
        self.update_device_site(d.device_id)
        self.update_model_and_force_run(d.device_id)
        self.edit_site_name(d.device_id)
        self.delete_device(device(GONE).device_id)
        self.insert_device(self.devices + 1)
        self.backdate_model_and_reconcile()
        return self.results

    def update_device_site(self, dev: str) -> None:
        old = self._scalar(f"SELECT site_id FROM {DEVICES_TABLE} WHERE device_id = :d", d=dev)
        new = _next_site(old)
        name = dict((s, n) for s, n, _ in self._sites())[new]
        exp = self.tail.expect(f"{dev} at {new}",
                               lambda e: e.get("device_id") == dev and e.get("site_id") == new
                               and e.get("site_name") == name)
        self._change(f"UPDATE {DEVICES_TABLE} {dev} site_id {old} -> {new}", exp, [dev], lambda: self._exec(
            f"UPDATE {DEVICES_TABLE} SET site_id = :s WHERE device_id = :d", s=new, d=dev))

    def update_model_and_force_run(self, dev: str) -> None:
        """An UPDATE that the daemon would only pick up at its hourly run, then a forced `refresh run`;
        the latency shown is from the forced run to the enriched output."""
        model = self._scalar(f"SELECT model_id FROM {DEVICES_TABLE} WHERE device_id = :d", d=dev)
        old = self._scalar(f"SELECT model_name FROM {MODELS_TABLE} WHERE model_id = :m", m=model)
        new = f"{old.split(' rev ')[0]} rev {chr(ord('B') + int(time.time()) % 20)}"
        touch = "" if self.engine.dialect.name in ("mysql", "mariadb") else \
            ", last_update = CURRENT_TIMESTAMP"  # MySQL's ON UPDATE column moves it by itself
        self._exec(f"UPDATE {MODELS_TABLE} SET model_name = :n{touch} WHERE model_id = :m", n=new, m=model)
        say(f"[{stamp()}] UPDATE {MODELS_TABLE} {model} model_name {old!r} -> {new!r} "
            "(incremental on last_update; the daemon's next run is an hour away)")
        exp = self.tail.expect(f"{dev} with model {new}",
                               lambda e: e.get("device_id") == dev and e.get("model_name") == new)

        self._change(f"refresh run {MODELS_TABLE}", exp, [dev], self._force_run)

    def _force_run(self, *flags: str) -> None:
        """``refresh run models`` (with ``flags``), as the operator types it."""
        t0 = time.monotonic()
        res = subprocess.run([*self.refresh_cmd, "run", MODELS_TABLE, *flags], capture_output=True, text=True,
                             timeout=self.timeout)
        if res.returncode != 0:
            if self.stop.is_set():
                raise Stopped  # Ctrl-C in the terminal reached `refresh run` too: not a failure
            lines = (res.stderr or res.stdout).strip().splitlines()
            raise ChangeNotSeen(f"`refresh run {' '.join([MODELS_TABLE, *flags])}` exited with code "
                                f"{res.returncode}: {lines[-1] if lines else ''}")
        say(f"exit 0 after {time.monotonic() - t0:.1f} s ...", end=" ")

    def backdate_model_and_reconcile(self) -> None:
        """A model renamed as of :data:`BACKDATE` ago (its ``last_update`` set back, as when a data-entry
        error is fixed): the events of its devices written since then carry the old name. The
        incremental run's window starts after that time, so the operator forces a reconcile; the
        job's models join (``as_of`` with ``corrections``) writes those events again, as corrections.
        Another model than the subject device's, whose own rename (the second step) would otherwise
        take over from its later ``valid_from``."""
        subject = device(SUBJECT).model_id
        model = next(m for m, *_ in MODELS if m != subject)
        dev = next(d.device_id for d in map(device, range(1, self.devices + 1)) if d.model_id == model and d.device_id
                   != device(GONE).device_id)
        old = self._scalar(f"SELECT model_name FROM {MODELS_TABLE} WHERE model_id = :m", m=model)
        new = f"{old.split(' rev ')[0]} rev {chr(ord('B') + int(time.time()) % 20)}"
        # Back by BACKDATE, but after the version it replaces: a version valid before that one would
        # only hold until it (the history goes by valid_from), correcting nothing after it.
        was = datetime.fromisoformat(str(self._scalar(f"SELECT last_update FROM {MODELS_TABLE} WHERE model_id = :m",
                                                      m=model))).replace(tzinfo=UTC)
        since = max(datetime.now(UTC).replace(microsecond=0) - BACKDATE, was.replace(microsecond=0) + timedelta(seconds=1))
        self._exec(f"UPDATE {MODELS_TABLE} SET model_name = :n, last_update = :t WHERE model_id = :m",
                   n=new, t=since.strftime("%Y-%m-%d %H:%M:%S"), m=model)  # UTC, as the sessions are
        say(f"[{stamp()}] UPDATE {MODELS_TABLE} {model} model_name {old!r} -> {new!r} as of "
            f"{since:%H:%M:%S} UTC (a backdated last_update: the events since then were written "
            f"with {old!r})")
        exp = self.tail.expect(f"a correction of an event of {model}",
                               lambda e: e.get("_kind") == "correction" and e.get("model_id") == model
                               and e.get("model_name") == new)
        self._change(f"refresh run {MODELS_TABLE} --reconcile", exp, [dev], lambda: self._force_run("--reconcile"),
                     note=lambda e: f"a correction of {e.get('device_id')}'s event of {utc_hms(e.get('ts'))}, "
                                    f"revision {e.get('_revision')}, cause {cause_label(e.get('_cause'))}")

    def edit_site_name(self, dev: str) -> None:
        site = self._scalar(f"SELECT site_id FROM {DEVICES_TABLE} WHERE device_id = :d", d=dev)
        rows = self._sites()
        old = next(n for s, n, _ in rows if s == site)
        new = f"{old.split(' (')[0]} ({'East' if '(West)' in old else 'West'})"
        exp = self.tail.expect(f"{dev} at {new}",
                               lambda e: e.get("device_id") == dev and e.get("site_name") == new)
        edited = [[s, new if s == site else n, r] for s, n, r in rows]
        self._change(f"EDIT {self.sites_csv.name} {site} site_name {old!r} -> {new!r}", exp, [dev],
                     lambda: write_sites(self.sites_csv, edited))

    def delete_device(self, dev: str) -> None:
        exp = self.tail.expect(f"{dev} unmatched",
                               lambda e: e.get("device_id") == dev and not matched(e, "devices", "model_id"))
        self._change(f"DELETE {DEVICES_TABLE} {dev}", exp, [dev], lambda: self._exec(
            f"DELETE FROM {DEVICES_TABLE} WHERE device_id = :d", d=dev), note="now unmatched")

    def insert_device(self, n: int) -> None:
        d = device(n)
        exp = self.tail.expect(f"{d.device_id} matched",
                               lambda e: e.get("device_id") == d.device_id and e.get("model_id") == d.model_id
                               and e.get("site_name") is not None)
        self._change(f"INSERT {DEVICES_TABLE} {d.device_id} model_id {d.model_id} site_id {d.site_id}", exp,
                     [d.device_id], lambda: self._exec(
                         f"INSERT INTO {DEVICES_TABLE} (device_id, model_id, site_id, owner, installed_on) "
                         "VALUES (:device_id, :model_id, :site_id, :owner, :installed_on)", **d.__dict__))

    # ------------------------------------------------------------------------------------ helpers

    def _change(self, what: str, exp: Expectation, probe: Sequence[str], action: Callable[[], None],
                note: str | Callable[[Event], str] = "") -> None:
        say(f"[{stamp()}] {what} ...", end=" ")
        exp.mark_started()
        action()
        latency = self._wait(exp, probe)
        if latency is None:
            if self.stop.is_set():
                raise Stopped
            raise ChangeNotSeen(f"{what} did not show up in the enriched output within {self.timeout:.0f} s")
        # The device's running state as the event that showed the change carries it.
        shown = note(exp.event or {}) if callable(note) else note
        extra = f" ({'; '.join(x for x in (shown, device_state(exp.event or {})) if x)})"
        say(f"seen in enriched output at {stamp(exp.seen_at)}, after {latency:.1f} s{extra}")
        self.results.latencies.append((what, latency))

    def _wait(self, exp: Expectation, probe: Sequence[str]) -> float | None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            self.check()
            for dev in probe:
                self._seq += 1
                self.producer.produce(self.events_topic, make_event(dev, now_iso(), self._seq, _RNG),
                                      dev.encode())
            self.producer.poll(0)
            latency = exp.wait(0.25, self.stop)
            if latency is not None:
                return latency
            if self.tail.error is not None:
                raise ChangeNotSeen(f"reading the enriched output failed: {self.tail.error}")
        return None

    def _exec(self, sql: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(sql), params)

    def _scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar_one()

    def _sites(self) -> list[list[str]]:
        return read_csv(self.sites_csv)


def _next_site(current: str) -> str:
    ids = [s for s, _, _ in SITES]
    return ids[(ids.index(current) + 4) % len(ids)] if current in ids else ids[0]


_RNG = random.Random(0)  # probe values do not matter; their device does
