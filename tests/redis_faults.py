"""Fault injection against a real redis-server: replies lost after Redis applied a write
(ReplyCuttingProxy), and a restart whose AOF lacks writes Redis had acknowledged (AofTail)."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from asyncrl_run.redis_server import EmbeddedRedis


class AofTail:
    """What an appendfsync-everysec server loses in a host crash: `mark()` copies the AOF as it is now (the
    server runs with `always`, so the copy holds every acknowledged write); `lose()` SIGKILLs the server,
    puts the copy back and restarts it there: every write acknowledged after the mark is gone."""

    def __init__(self, server: EmbeddedRedis, workdir: Path) -> None:
        self.server = server
        self.copy = workdir / "aof-mark"

    def _aof_paths(self, root: Path) -> list[Path]:
        return list(root.glob("appendonly*"))

    def mark(self) -> None:
        shutil.rmtree(self.copy, ignore_errors=True)
        self.copy.mkdir(parents=True)
        for path in self._aof_paths(self.server.data_dir):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, self.copy / path.name)

    def lose(self) -> None:
        self.server.kill()
        for path in self._aof_paths(self.server.data_dir):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in self._aof_paths(self.copy):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, self.server.data_dir / path.name)
        self.server.revive()


class ReplyCuttingProxy:
    """A loopback TCP relay to Redis. Once armed, it forwards the next `command` (EXEC, EVALSHA), lets
    Redis run it, and closes the client's connection before the reply: the write is applied, the
    client sees a reset."""

    def __init__(self, upstream_port: int, command: bytes) -> None:
        self.upstream_port = upstream_port
        self.command = b"$%d\r\n%s\r\n" % (len(command), command)
        self.armed = False
        self.cuts = 0
        self.server: asyncio.Server
        self.relays: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.relays.add(asyncio.current_task())
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def replies() -> None:
            while data := await up_r.read(1 << 16):
                client_w.write(data)
                await client_w.drain()

        back = asyncio.create_task(replies())
        tail = b""
        try:
            while data := await client_r.read(1 << 16):
                if self.armed and self.command in tail + data:
                    self.armed, self.cuts = False, self.cuts + 1
                    back.cancel()
                    up_w.write(data)
                    await up_w.drain()
                    await asyncio.sleep(0.2)  # Redis runs the transaction; its reply goes nowhere
                    break
                up_w.write(data)
                await up_w.drain()
                tail = data[-len(self.command):]
        finally:
            back.cancel()
            for writer in (client_w, up_w):
                writer.close()

    @classmethod
    @asynccontextmanager
    async def serving(cls, upstream_port: int, command: bytes) -> AsyncIterator["ReplyCuttingProxy"]:
        proxy = cls(upstream_port, command)
        proxy.server = await asyncio.start_server(proxy._relay, "127.0.0.1", 0)
        try:
            yield proxy
        finally:
            proxy.server.close()
            for relay in proxy.relays:
                relay.cancel()
            await asyncio.gather(*proxy.relays, return_exceptions=True)
