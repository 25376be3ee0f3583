"""Kafka clients and helpers shared by both parts: one place builds every producer, consumer and
admin client (the tuning of each role lives in :data:`PRODUCERS` and :data:`CONSUMERS`), topic
creation, and reading a topic to its end.

librdkafka's own log lines (a reconnect attempt to a broker that is down: about 20 a second per
client) go through Python logging, to :data:`LIBRDKAFKA_LOG` unless a client's settings name another
``logger``, with a line that repeats logged once per :data:`REPEAT_WINDOW` with its count
(:class:`refstream.logs.RepeatSuppressor`). confluent-kafka delivers them when the client is polled:
producers and consumers are polled by their owners (they must be, for deliveries and records); admin
clients, whose results come on a thread of their own, are polled here, once a second, by a daemon
thread that also logs the counts of the windows that have passed.

Reading "to the end" never trusts ListOffsets alone: some Kafka-protocol brokers report the base
offset of the last record batch + 1 as the end. We consume with ``enable.partition.eof`` and stop at
the EOF event, which comes from the high watermark in Fetch responses (right on every broker).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from refstream.errors import TransientError
from refstream.logs import RepeatSuppressor
from refstream.retry import RetryPolicy

__all__ = [
    "CONSUMERS",
    "PRODUCERS",
    "LIBRDKAFKA_LOG",
    "REPEAT_WINDOW",
    "ClientCache",
    "ConsumerRole",
    "Preset",
    "ProducerRole",
    "SERIAL_TXNS_ENV",
    "SERIAL_TXN_ENDS_ENV",
    "admin",
    "consumer",
    "end_offsets",
    "ensure_topic",
    "offset_of",
    "partition_of",
    "partitions_of",
    "producer",
    "read_to_end",
    "shared_consumer",
    "topic_of",
    "transaction_end",
]

log = logging.getLogger(__name__)

#: Where librdkafka's own log lines go, at the level librdkafka gives them (an error is an ERROR).
LIBRDKAFKA_LOG = logging.getLogger("librdkafka")
#: A librdkafka line repeated within this many seconds is logged once, then once per window with its count.
REPEAT_WINDOW = 60.0
_PUMP_EVERY = 1.0   # seconds between two polls of the admin clients (and checks of the windows)

#: Names a lock file that, when set, every transaction's end on this machine holds (``commit``,
#: ``abort``, and ``init_transactions``, which aborts a fenced predecessor, of every producer that
#: :func:`producer` builds): see :func:`transaction_end`.
SERIAL_TXN_ENDS_ENV = "REFSTREAM_KAFKA_SERIAL_TXN_ENDS"
#: Names a lock file that, when set, every transaction on this machine holds from its
#: ``begin_transaction`` until its end, so that no transaction is open while another ends (the
#: processes of one test run, against the embedded broker): see :class:`_OpenTransactions`.
SERIAL_TXNS_ENV = "REFSTREAM_KAFKA_SERIAL_TXNS"
#: How long a transaction waits for the machine's other transactions before it fails.
SERIAL_TXNS_WAIT = 300.0

_suppressors: dict[str, RepeatSuppressor] = {}          # by the name of the logger they front
_polled: weakref.WeakSet[AdminClient] = weakref.WeakSet()
_pump_lock = threading.Lock()
_pump_pid: int | None = None
_pump_stop = threading.Event()


def _with_logger(conf: dict[str, Any]) -> dict[str, Any]:
    """``conf`` with librdkafka's log lines sent to Python logging (its ``logger``, or
    :data:`LIBRDKAFKA_LOG`) through the :class:`RepeatSuppressor` of that logger."""
    target = conf.get("logger") or LIBRDKAFKA_LOG
    if isinstance(target, logging.Logger):
        with _pump_lock:
            suppressor = _suppressors.get(target.name)
            if suppressor is None:
                suppressor = _suppressors[target.name] = RepeatSuppressor(target, REPEAT_WINDOW)
        conf["logger"] = suppressor
    _start_pump()
    return conf


def _start_pump() -> None:
    """Start this process's log pump, once (a forked child starts its own)."""
    global _pump_pid
    with _pump_lock:
        if _pump_pid == os.getpid():
            return
        _pump_pid = os.getpid()
    threading.Thread(target=_pump, name="librdkafka-log", daemon=True).start()


def _pump() -> None:
    while not _pump_stop.wait(_PUMP_EVERY):
        _pump_once()


def _pump_once() -> None:
    for client in list(_polled):
        try:
            client.poll(0)
        except Exception:  # noqa: BLE001 - a client being let go: its lines go with it
            pass
    for suppressor in list(_suppressors.values()):
        suppressor.flush()


def _after_fork_in_child() -> None:
    # The parent's clients and pump thread do not survive a fork; a lock held there at the fork
    # would never be released here.
    global _pump_lock, _pump_pid, _polled
    _pump_lock, _pump_pid, _polled = threading.Lock(), None, weakref.WeakSet()
    _suppressors.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register  # registered before _close_shared, so it runs after it: closing logs too
def _flush_logs_at_exit() -> None:
    _pump_stop.set()
    _pump_once()
    for suppressor in list(_suppressors.values()):
        suppressor.flush(everything=True)


@dataclass(frozen=True)
class Preset:
    """librdkafka settings of one client role: ``defaults`` give way to the caller's settings,
    ``forced`` do not (the role's correctness depends on them)."""

    defaults: Mapping[str, Any]
    forced: Mapping[str, Any] = field(default_factory=dict)

    def conf(self, settings: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.defaults, **settings, **overrides, **self.forced}


ProducerRole = Literal["plain", "publisher", "transactional", "bulk"]
#: The job's transactions' timeout (``transaction.timeout.ms`` of the ``transactional`` role).
TRANSACTION_TIMEOUT_MS = 600_000
ConsumerRole = Literal["reader", "probe", "fetch"]

PRODUCERS: dict[str, Preset] = {
    # Settings as given (small one-off producers).
    "plain": Preset({}),
    # The refresher's publisher: every change acknowledged by all replicas, never duplicated; each
    # run's change set is one transaction (``transactional.id`` comes from the caller).
    "publisher": Preset({
        "acks": "all",
        "linger.ms": "20",
        "compression.type": "lz4",
        # Same partition for the same key as Java clients (murmur2), so any producer of a key agrees.
        "partitioner": "murmur2_random",
        # Bounded: a broker that stays away fails the run instead of blocking it forever.
        "message.timeout.ms": "60000",
        "queue.buffering.max.messages": "200000",
        # Room for a bootstrap of millions of rows in one transaction; within Kafka's default
        # transaction.max.timeout.ms (15 min). A crashed run's open transaction is aborted sooner:
        # the next run's init_transactions (same transactional.id) fences and aborts it.
        "transaction.timeout.ms": "600000",
    }, forced={"enable.idempotence": "true"}),  # retries must not duplicate
    # The job's exactly-once micro-batch writer (``transactional.id`` comes from the caller).
    "transactional": Preset({
        "linger.ms": 20, "batch.size": 1 << 20, "compression.type": "lz4",
        # Set, not librdkafka's 60 s: a task's write window can be longer (the first batch of a large
        # partitioned dimension, a cold restart), and a transaction past it is aborted by the broker
        # and the task fenced. Within Kafka's default transaction.max.timeout.ms (15 min); a killed
        # task's open transaction is aborted sooner by the same slot's next init_transactions.
        "transaction.timeout.ms": str(TRANSACTION_TIMEOUT_MS),
        # Room for a whole micro-batch in the local queue: no stalls on a full queue mid-batch.
        "queue.buffering.max.messages": 1_000_000,
        # Java clients' partitioner: a key lands where Spark's Kafka sink would put it.
        "partitioner": "murmur2_random",
    }, forced={"enable.idempotence": True}),
    # Loading many records as fast as the broker takes them (simulator, benchmarks).
    "bulk": Preset({
        "linger.ms": 20, "batch.size": 1 << 20, "compression.type": "lz4",
        "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 1 << 20,
    }),
}

# Every consumer here assigns partitions itself and tracks offsets itself: it never joins its
# (random) group nor commits, reads only committed records and needs the EOF event to see an end.
_NO_GROUP = {"enable.auto.commit": False, "enable.partition.eof": True}
_COMMITTED = {"isolation.level": "read_committed", "auto.offset.reset": "earliest"}

CONSUMERS: dict[str, Preset] = {
    # Reading a topic (to its end, or tailing it).
    "reader": Preset({**_NO_GROUP, **_COMMITTED}),
    # The driver's end-offset probe: one small fetch per partition and an early EOF.
    "probe": Preset({**_NO_GROUP, **_COMMITTED}, forced={
        "enable.partition.eof": True, "fetch.wait.max.ms": 20, "fetch.queue.backoff.ms": 0,
        "fetch.max.bytes": 4 << 20}),
    # Executors reading offset ranges: large fetches, short waits.
    "fetch": Preset({**_COMMITTED, "fetch.wait.max.ms": 100, "fetch.queue.backoff.ms": 10,
                     "max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 64 << 20},
                    forced=_NO_GROUP),
}

_GROUP_PREFIX = {"reader": "refstream", "probe": "refstream-probe", "fetch": "refstream-source"}


def producer(settings: Mapping[str, Any], *, role: ProducerRole = "plain", **overrides: Any) -> Producer:
    """A new producer for ``role`` (see :data:`PRODUCERS`); ``overrides`` (librdkafka names, pass
    dotted ones as ``**{"linger.ms": 5}``) win over ``settings``, the role's forced settings win over both."""
    return _Producer(_with_logger(PRODUCERS[role].conf(settings, overrides)))


class _Producer(Producer):
    """Every producer built here: its transactions end under :func:`transaction_end`
    (``init_transactions`` ends the unfinished transaction of a producer it fences), and, where
    ``$REFSTREAM_KAFKA_SERIAL_TXNS`` is set, each is open under :data:`_OPEN` from its begin to its end."""

    _holds = False  # whether this producer's open transaction holds _OPEN

    def init_transactions(self, *args: Any) -> None:
        with _OPEN.held(), transaction_end():
            super().init_transactions(*args)

    def begin_transaction(self) -> None:
        if not self._holds:
            _OPEN.acquire()
            self._holds = True
        try:
            super().begin_transaction()
        except BaseException:
            self._let_go()
            raise

    def commit_transaction(self, *args: Any) -> None:
        try:
            with transaction_end():
                super().commit_transaction(*args)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and err.retriable()):  # a retried commit stays open
                self._let_go()
            raise
        self._let_go()

    def abort_transaction(self, *args: Any) -> None:
        try:
            with transaction_end():
                super().abort_transaction(*args)
        finally:
            self._let_go()

    def close(self, *args: Any) -> Any:
        self._let_go()
        return super().close(*args)

    def __del__(self) -> None:
        self._let_go()  # dropped with its transaction open (a failed task, a test's zombie)

    def _let_go(self) -> None:
        if self._holds:
            self._holds = False
            _OPEN.release()


class _OpenTransactions:
    """A shim for the embedded test broker (Tansu 0.6.0): the machine-wide lock named by
    ``$REFSTREAM_KAFKA_SERIAL_TXNS`` (if set), held while this process has a transaction open.

    That broker commits a transaction that ends while another one is open on a partition they share
    only when a later end finds it, and some later ends miss it: one whose overlap it was only
    through a third transaction, or a newer epoch of an id whose older epoch also waits. The
    partition's last stable offset then stays at it, and read_committed readers see nothing past it,
    until another transaction on that partition ends; after a job's last batch, for good. With no
    two processes' transactions open at once, every end completes at once. The transactions of one
    process share the hold (a test's producer may keep one open while the same process goes on),
    so a process's transactions are not serialised among themselves. Apache Kafka has no such
    behaviour: leave the variable unset there (the default) and this does nothing."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._count = 0
        self._file: Any = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._mutex, self._count, self._file = threading.Lock(), 0, None  # the parent's hold is not the child's

    def acquire(self) -> None:
        path = os.environ.get(SERIAL_TXNS_ENV)
        with self._mutex:
            if path and self._count == 0:
                f = open(path, "a+b")  # noqa: SIM115 - held until the last release
                deadline = time.monotonic() + SERIAL_TXNS_WAIT
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            f.close()
                            raise TimeoutError(
                                f"another process kept a Kafka transaction open for {SERIAL_TXNS_WAIT:.0f}s "
                                f"(lock {path}, ${SERIAL_TXNS_ENV}; held by {_holder(path)})") from None
                        time.sleep(0.005)
                self._file = f
                # Who holds it, for the error of a process that waits too long; never worth failing for.
                try:
                    f.truncate(0)
                    f.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}: "
                            f"{' '.join(sys.argv)[:300]}".encode("utf-8", "replace"))
                    f.flush()
                except OSError:
                    pass
            self._count += 1

    def release(self) -> None:
        with self._mutex:
            self._count -= 1
            if self._count == 0 and self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.truncate(0)  # no holder now: not the last one's name
                fcntl.flock(self._file, fcntl.LOCK_UN)
                self._file.close()
                self._file = None

    @contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


def _holder(path: str) -> str:
    """What the process holding the lock at ``path`` wrote of itself when it took it."""
    try:
        with open(path, "rb") as f:
            return f.read(400).decode("utf-8", "replace").strip() or "a process that did not say"
    except OSError as exc:
        return f"unknown ({exc})"


_OPEN = _OpenTransactions()


def consumer(settings: Mapping[str, Any], *, role: ConsumerRole = "reader", **overrides: Any) -> Consumer:
    """A new consumer for ``role`` (see :data:`CONSUMERS`) that never joins its group: the caller
    assigns partitions and tracks offsets."""
    conf = {"group.id": f"{_GROUP_PREFIX[role]}-{uuid.uuid4().hex[:12]}", **CONSUMERS[role].conf(settings, overrides)}
    return Consumer(_with_logger(conf))


C = TypeVar("C")


class ClientCache(Generic[C]):
    """At most ``size`` long-lived clients keyed by their settings, per process (a librdkafka client
    does not survive a fork); the least recently used one is let go when a new one is needed."""

    def __init__(self, make: Callable[[Mapping[str, Any]], C], *, size: int = 4,
                 close: Callable[[C], None] | None = None) -> None:
        self._make = make
        self._size = size
        self._close = close
        self._clients: OrderedDict[tuple[Any, ...], C] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, settings: Mapping[str, Any]) -> C:
        key = (os.getpid(), *sorted((str(k), str(v)) for k, v in settings.items()))
        with self._lock:
            client = self._clients.get(key)
            if client is not None:
                self._clients.move_to_end(key)
                return client
        client = self._make(settings)
        with self._lock:
            if key in self._clients:  # another thread was quicker
                return self._clients[key]
            self._clients[key] = client
            stale = [self._clients.popitem(last=False)[1] for _ in range(len(self._clients) - self._size)]
        for c in stale:
            self._release(c)
        return client

    def _release(self, client: C) -> None:
        if self._close is not None:
            try:
                self._close(client)
            except Exception:  # noqa: BLE001 - letting go of a client, nothing left to report to
                pass

    def discard(self, bootstrap: str) -> None:
        """Let go of the clients whose ``bootstrap.servers`` is ``bootstrap`` (a broker that stopped)."""
        with self._lock:
            keys = [k for k in self._clients if ("bootstrap.servers", bootstrap) in k[1:]]
            clients = [self._clients.pop(k) for k in keys]
        for c in clients:
            self._release(c)

    def clear(self) -> None:
        """Let go of every client (at exit, or in tests)."""
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            self._release(c)


def _new_admin(settings: Mapping[str, Any]) -> AdminClient:
    client = AdminClient(_with_logger(dict(settings)))
    with _pump_lock:
        _polled.add(client)  # nobody else polls an admin client: the pump serves its log lines
    return client


_ADMINS: ClientCache[AdminClient] = ClientCache(_new_admin)


def admin(settings: Mapping[str, Any], *, cached: bool = True) -> AdminClient:
    """An admin client for ``settings``; cached ones are shared (admin clients are thread-safe), so
    checking a topic does not open new broker connections each time. ``cached=False`` for a
    throw-away client, e.g. probing a broker that is still starting."""
    return _ADMINS.get(settings) if cached else _new_admin(settings)


_SHARED: dict[str, ClientCache[Consumer]] = {}


def shared_consumer(settings: Mapping[str, Any], *, role: ConsumerRole) -> Consumer:
    """A long-lived consumer for ``role`` and ``settings``, reused by every caller in this process
    (e.g. one per Spark Python worker, re-assigned per task); closed at exit."""
    cache = _SHARED.get(role)
    if cache is None:
        cache = _SHARED.setdefault(role, ClientCache(lambda s: consumer(s, role=role), close=Consumer.close))
    return cache.get(settings)


@contextmanager
def transaction_end() -> Iterator[None]:
    """Hold the machine-wide lock named by ``$REFSTREAM_KAFKA_SERIAL_TXN_ENDS`` (if set) while a
    transaction ends, so that no two end at once.

    A shim for the embedded test broker (Tansu 0.6.0, which sets the variable: ``demo.broker``): when
    two transactions that wrote to one partition end at the same moment, it can mark one finished
    before that one's last marker is written, and from then on leaves every later transaction on the
    partition half-committed while answering its commit with success; the partition's last stable
    offset stops there for good and read_committed readers see nothing after it. Apache Kafka has no
    such race: leave the variable unset there (the default) and this does nothing. A process that
    dies holding the lock (``flock``) lets go of it with its file descriptors."""
    path = os.environ.get(SERIAL_TXN_ENDS_ENV)
    if not path:
        yield
        return
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def forget(bootstrap: str) -> None:
    """Let go of this process's cached clients of the broker at ``bootstrap`` (one that has stopped
    for good): otherwise they would try to reconnect, and log that they cannot, for as long as the
    process lives."""
    _ADMINS.discard(bootstrap)
    for cache in list(_SHARED.values()):
        cache.discard(bootstrap)


@atexit.register
def _close_shared() -> None:
    for cache in list(_SHARED.values()):
        cache.clear()


def ensure_topic(settings: Mapping[str, str], topic: str, *, partitions: int = 1,
                 config: Mapping[str, str] | None = None, timeout: float = 15.0) -> bool:
    """Create ``topic`` if missing; returns True when it was created. Broker errors are transient."""
    client = admin(settings)
    try:
        md = client.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TransientError(f"cannot reach Kafka at {settings.get('bootstrap.servers')}: {exc}") from None
    if topic in md.topics and md.topics[topic].error is None:
        return False
    futures = client.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                                             config=dict(config or {}))], operation_timeout=timeout)
    try:
        futures[topic].result(timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise TransientError(f"cannot create topic {topic}: {exc}") from None
    log.info("created topic %s (%d partitions, %s)", topic, partitions, dict(config or {}))
    _wait_for_metadata(client, topic, timeout)
    return True


def _wait_for_metadata(client: AdminClient, topic: str, timeout: float) -> None:
    for _ in RetryPolicy.every(0.1).until(timeout):
        md = client.list_topics(topic, timeout=timeout)
        t = md.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return


def partitions_of(settings: Mapping[str, str], topic: str, timeout: float = 10.0) -> list[int]:
    """Partitions of ``topic``, [] when it does not exist. Asks for all topics' metadata: a request
    naming the topic makes some brokers (Tansu, Kafka with auto.create.topics.enable) create it with
    the broker's defaults, so a reader polling early would create the writer's topic wrongly."""
    try:
        md = admin(settings).list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TransientError(f"cannot reach Kafka: {exc}") from None
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        return []
    return sorted(t.partitions)


def read_to_end(settings: Mapping[str, str], topic: str, start: Mapping[int, int] | None = None,
                *, batch: int = 5000, timeout: float = 30.0) -> Iterator[Message]:
    """Yield every record of ``topic`` from ``start`` (partition -> offset; default: beginning) until
    each partition reports EOF, with every record written before the read began. Raises
    :class:`TransientError` if the end is not reached in ``timeout`` seconds without progress."""
    parts = partitions_of(settings, topic)
    if not parts:
        return
    c = consumer(settings)
    try:
        c.assign([TopicPartition(topic, p, (start or {}).get(p, OFFSET_BEGINNING)) for p in parts])
        pending = set(parts)
        last_progress, began_ms = time.monotonic(), int(time.time() * 1000)
        while pending:
            msgs = c.consume(batch, timeout=0.2)
            if not msgs and time.monotonic() - last_progress > timeout:
                raise TransientError(f"no progress reading {topic} partitions {sorted(pending)} "
                                     f"for {timeout:.0f}s")
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(partition_of(m))
                        continue
                    if err.retriable() or err.code() == KafkaError._TRANSPORT:
                        raise TransientError(f"reading {topic}: {err}")
                    raise KafkaException(err)
                last_progress = time.monotonic()
                # A partition that reported EOF and then gives more is read on (the test broker
                # reports EOF early), unless the record was written after this read began: a
                # producer that keeps writing (a daemon's heartbeats) would keep the read going forever.
                ts_type, ts = m.timestamp()
                if ts_type == TIMESTAMP_NOT_AVAILABLE or ts < began_ms:
                    pending.add(partition_of(m))
                yield m
    finally:
        c.close()


def partition_of(m: Message) -> int:
    """The partition of a consumed message (librdkafka types it ``int | None`` for messages not yet
    produced; a consumed one always has it)."""
    p = m.partition()
    assert p is not None
    return p


def offset_of(m: Message) -> int:
    """The offset of a consumed message (see :func:`partition_of`)."""
    o = m.offset()
    assert o is not None
    return o


def topic_of(m: Message) -> str:
    """The topic of a consumed message (see :func:`partition_of`)."""
    t = m.topic()
    assert t is not None
    return t


def end_offsets(settings: Mapping[str, str], topic: str, *, timeout: float = 10.0,
                committed: bool = False) -> dict[int, int] | None:
    """The end offset of each partition of ``topic`` as the broker's ListOffsets reports it, None when
    the topic does not exist: one metadata and one ListOffsets request. Some brokers report the base
    offset of the last record batch + 1 rather than the true end (see the module docstring), so compare
    the result only with what this same call returned earlier, never with produced offsets.
    ``committed``: the last stable offset instead, what ``read_committed`` readers can read up to
    (committed records and transaction markers), which moves only when a transaction ends."""
    parts = partitions_of(settings, topic, timeout=timeout)
    if not parts:
        return None
    client = admin(settings)
    level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
    try:
        futures = client.list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in parts},
                                      isolation_level=level, request_timeout=timeout)
        return {tp.partition: f.result().offset for tp, f in futures.items()}
    except KafkaException as exc:
        raise TransientError(f"cannot read the end offsets of {topic}: {exc}") from None
