"""The fast MySQL reader: rows of an unbuffered PyMySQL text result, read straight off the
connection's stream and split into one Arrow binary array per column.

PyMySQL spends most of a large read in per-row and per-value Python calls. Here Python only walks
the packet headers (one step per row, with PyMySQL's checks: sequence numbers, error and EOF
packets), and numpy finds every value of a chunk column by column and gathers its bytes into an
Arrow binary array; :class:`refresh.sources.sqltypes.TextConverter` then validates and casts each
column. The PyMySQL internals this needs are reached through :func:`refstream.compat.pymysql_stream`;
when they are not there, :meth:`ColumnReader.attach` returns None and the cursor's ``fetchmany``
reads the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pymysql.err

from refstream.compat import PyMySQLStream, pymysql_stream

__all__ = ["ColumnReader", "Columns", "gather"]


class Columns:
    """One chunk of a MySQL text result as one Arrow binary array per column (raw value bytes)."""

    __slots__ = ("arrays", "num_rows")

    def __init__(self, arrays: list[pa.Array], num_rows: int) -> None:
        self.arrays, self.num_rows = arrays, num_rows

    def __len__(self) -> int:
        return self.num_rows


class ColumnReader:
    """Reads the rows of one unbuffered result; :meth:`fetch` replaces the cursor's ``fetchmany``."""

    def __init__(self, stream: PyMySQLStream) -> None:
        self.stream = stream
        self.ncols = stream.ncols

    @classmethod
    def attach(cls, cur: Any) -> Callable[[int], Columns | list[Any]] | None:
        """The ``fetch`` of a reader of ``cur``'s result (an executed text ``SSCursor``), or None when
        PyMySQL's internals are not the expected ones (use ``cur.fetchmany`` then)."""
        stream = pymysql_stream(cur)
        return None if stream is None else cls(stream).fetch

    def _lost(self, detail: str = "") -> pymysql.err.OperationalError:
        self.stream.force_close()
        return pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query" + detail)

    def _io(self, fn: Callable[[int], bytes], n: int) -> bytes:
        while True:
            try:
                return fn(n)
            except InterruptedError:
                continue
            except OSError as exc:
                raise self._lost(f" ({exc})") from None
            except BaseException:
                self.stream.force_close()
                raise

    def _read_exactly(self, n: int) -> bytes:
        data = self._io(self.stream.read, n)
        if len(data) < n:
            raise self._lost()
        return data

    def _packet(self) -> bytes:
        """One whole logical packet, read the slow way (it straddles the read buffer, or is >= 16 MB)."""
        stream = self.stream
        parts = []
        while True:
            header = self._read_exactly(4)
            length = header[0] | header[1] << 8 | header[2] << 16
            if header[3] != stream.seq:
                raise self._lost(" (packet sequence number wrong)")
            stream.seq = (stream.seq + 1) % 256
            parts.append(self._read_exactly(length))
            if length < 0xFFFFFF:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _end(self, payload: bytes) -> bool:
        """Handle a packet that is not a row: True at the end of the result, raises on an error."""
        first = payload[0] if payload else -1
        if first == 0xFE and len(payload) < 9:  # EOF: the result is complete
            self.stream.end(payload)
            return True
        if first == 0xFF:  # an error packet: the query failed part of the way through
            self.stream.fail(payload)
        return False

    def fetch(self, size: int) -> Columns | list[Any]:
        """Up to ``size`` rows as :class:`Columns`; ``[]`` at the end of the result."""
        stream = self.stream
        if not stream.active:
            return []
        peek, read = stream.peek, stream.read
        out = bytearray()          # the chunk's row payloads (packet headers between them)
        starts: list[int] = []     # per row: offset of its payload in ``out`` and of its end
        ends: list[int] = []
        while len(starts) < size:
            # Walk the complete packets already in the read buffer without copying them one by one.
            block = self._io(peek, 1)
            if not block:
                raise self._lost()
            avail, p, seq = len(block), 0, stream.seq
            base = len(out)
            room = size - len(starts)
            done = False
            while room and p + 5 <= avail:
                length = block[p] | block[p + 1] << 8 | block[p + 2] << 16
                end = p + 4 + length
                if end > avail or length == 0xFFFFFF or length == 0:
                    break
                if block[p + 3] != seq:
                    self._io(read, p)
                    raise self._lost(" (packet sequence number wrong)")
                first = block[p + 4]
                if first == 0xFE and length < 9 or first == 0xFF:
                    done = True
                    break
                seq = (seq + 1) & 0xFF
                starts.append(base + p + 4)
                ends.append(base + end)
                p = end
                room -= 1
            if p:
                out += block[:p]
                self._io(read, p)  # from the buffer: no system call
                stream.seq = seq
            if not room:
                break
            if done or p == 0:
                # Not a row, or a packet the buffer does not hold whole: read it the slow way.
                payload = self._packet()
                if self._end(payload):
                    break
                starts.append(len(out))
                out += payload
                ends.append(len(out))
        if not starts:
            return []
        return Columns(self._split(out, starts, ends), len(starts))

    def _split(self, out: bytearray, starts: list[int], ends: list[int]) -> list[pa.Array]:
        """Every value of every row in ``out`` as one binary array per column (NULL stays NULL)."""
        buf = np.frombuffer(out, np.uint8)
        end = np.array(ends, np.int64)
        pos = np.array(starts, np.int64)
        arrays = []
        for _ in range(self.ncols):
            if (pos >= end).any():
                raise self._malformed()
            n = buf[pos].astype(np.int64)
            hdr = np.ones_like(n)
            null = None
            big = np.flatnonzero(n >= 251)
            if len(big):
                code = n[big]
                width = np.select([code == 252, code == 253, code == 254], [2, 3, 8], 0)
                if (code == 255).any() or (pos[big] + 1 + width > end[big]).any():
                    raise self._malformed()
                at = pos[big] + 1
                length = np.zeros(len(big), np.int64)
                for k in range(8):  # little-endian length of 2, 3 or 8 bytes
                    has = width > k
                    length[has] |= buf[at[has] + k].astype(np.int64) << (8 * k)
                n[big] = length
                hdr[big] += width
                is_null = code == 251
                if is_null.any():
                    null = np.zeros(len(n), bool)
                    null[big[is_null]] = True
            start = pos + hdr
            pos = start + n
            arrays.append(gather(buf, start, n, null))
        if not np.array_equal(pos, end):
            raise self._malformed()
        return arrays

    def _malformed(self) -> pymysql.err.InternalError:
        self.stream.force_close()
        return pymysql.err.InternalError("malformed row packet in a MySQL result")


def gather(buf: np.ndarray, start: np.ndarray, length: np.ndarray, null: np.ndarray | None) -> pa.Array:
    """The byte ranges ``[start, start + length)`` of ``buf`` as one Arrow binary array."""
    offsets = np.zeros(len(length) + 1, np.int64)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    # Index of every byte to copy: each range's start shifted by where it lands in the output.
    data = buf[np.repeat(start - offsets[:-1], length) + np.arange(total, dtype=np.int64)]
    t, otype = (pa.binary(), np.int32) if total < 2**31 else (pa.large_binary(), np.int64)
    validity = None
    if null is not None:
        validity = pa.py_buffer(np.packbits(~null, bitorder="little"))
    return pa.Array.from_buffers(t, len(length), [validity, pa.py_buffer(offsets.astype(otype)),
                                                  pa.py_buffer(data)], null_count=0 if null is None else int(null.sum()))
