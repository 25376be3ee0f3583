"""What a failed Spark job says about its cause. Spark's exception of a failed job or query carries
a Python task's traceback as text (inside a JVM error): the error a task raised is read from that
text, here only.
"""

from __future__ import annotations

import re

from refstream.errors import TransientError, one_line

__all__ = ["root_cause", "transient_cause", "transient_worker_failure"]

_TRANSIENT = "refstream.errors.TransientError: "
_OUR_ERROR = re.compile(r"(?:refstream\.errors|enrich\.calls\.client)\.\w+: (.+)")


def transient_cause(exc: BaseException) -> TransientError | None:
    """The :class:`TransientError` a task raised, when Spark's ``exc`` says one failed it (the last
    one named, its message's first line); None otherwise. A sink raises it so the job retries the
    batch."""
    text = str(exc)
    at = text.rfind(_TRANSIENT)
    if at < 0:
        return None
    return TransientError((text[at + len(_TRANSIENT):].splitlines() or [""])[0])


def root_cause(exc: BaseException) -> str:
    """One line for a failed query: the message of the refstream error that failed it, when Spark's
    exception carries one (a Python traceback inside a JVM error), else the exception's first line."""
    found = _OUR_ERROR.findall(str(exc))
    return found[-1].strip() if found else one_line(exc)


#: Spark's words for a Python process that failed for a transient reason, each with a set of words
#: that must all appear: a worker that did not connect back (seen once at a query's start, in the
#: Python data source's planning worker, under load), a state step's worker whose connection to its
#: task's state server failed (seen once in a batch under load, after another task's state server
#: had stopped on a malformed request: PySpark 4.3's StatefulProcessorApiClient), the driver's own
#: Python process failing to connect to a socket the JVM opened for it (a collect()'s results; seen
#: once in a batch's write under a fresh clone's test load, masked by PySpark as UnboundLocalError:
#: 'sockfile'; these servers accept one connection, and on a TCP port another local client could
#: take it: the job's sessions use Unix sockets since, enrich.session), and a state step's worker
#: whose state server stopped answering (seen once: the state server thread died on an internal
#: assertion; the worker's wait is bounded by state.server_timeout). The second and last are the
#: traceback's frames: whatever the error, it was raised there.
_TRANSIENT_WORKER = (
    ("a Python worker did not start", ("Python worker failed to connect back",)),
    ("a Python worker did not start", ("StatefulProcessorApiClient(", "self._client_socket.connect(")),
    ("a Python worker did not start", ("[CANNOT_OPEN_SOCKET]",)),
    ("a state step's worker got no answer from its state server within state.server_timeout",
     ("stateful_processor_api_client.py", "TimeoutError: timed out")),
)


def transient_worker_failure(exc: BaseException) -> str | None:
    """Why a failed query failed, when a Python worker did not start, a Python process (a worker,
    the driver) did not connect to the JVM, or a state step's worker got no answer from its task's
    state server: transient, and safe to retry by starting the query again from its checkpoint
    (what a restart of the job would do). None for any other failure."""
    text = str(exc)
    return next((why for why, words in _TRANSIENT_WORKER if all(w in text for w in words)), None)
