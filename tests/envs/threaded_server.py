"""A real uvicorn server on 127.0.0.1 in a thread of its own, usable from any event loop or process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn
from fastapi import FastAPI


class ThreadedServer:
    def __init__(self, app: FastAPI, port: int = 0):
        self.app = app
        self.port = port
        self.url = ""
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "ThreadedServer":
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, access_log=False,
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
