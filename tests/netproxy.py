"""A TCP port relayed to a real server on 127.0.0.1, for tests of a server that goes away and
comes back on the same address: until :meth:`TcpRelay.start` (and after :meth:`TcpRelay.stop`) a
connection is refused, and open ones are cut at the stop."""

from __future__ import annotations

import socket
import threading

from demo.broker import free_port


class TcpRelay:
    """A TCP port relayed to another address, opened and closed at will: a database that goes away
    (connections refused, open ones cut) and comes back on the same address."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def start(self) -> TcpRelay:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(16)
        self._listener = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return self

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass
        self._conns.clear()
