"""A loopback TCP proxy that drips a server's replies: a slow or stalled remote tier."""

import socket
import threading


class DripProxy:
    """A loopback TCP proxy to `port` that passes requests at once and answers one byte per `interval` s."""

    def __init__(self, port: int, interval: float = 1.0):
        self.port_to, self.interval, self.stop = port, interval, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port_to))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.interval), daemon=True).start()

    def _pipe(self, src, dst, interval):
        try:
            while not self.stop.is_set():
                data = src.recv(65536)
                if not data:
                    return
                for i in range(0, len(data), 1 if interval else len(data)):
                    dst.sendall(data[i:i + 1] if interval else data)
                    if self.stop.wait(interval):
                        return
        except OSError:
            return

    def close(self):
        self.stop.set()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass
