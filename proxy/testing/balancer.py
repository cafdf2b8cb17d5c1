"""A plain L4 load balancer on loopback, as in front of several gateway replicas: each new
connection goes to the next replica in turn and its bytes are piped both ways untouched (no
HTTP awareness, so consecutive requests of one client that open connections of their own
reach different replicas). Used by the replica tests and `prefixgate bench --scenario agent`."""
from __future__ import annotations

import asyncio
import itertools


class TCPBalancer:
    """A plain L4 balancer on a loopback port: each new connection goes to the next of
    `ports` in turn, its bytes piped both ways untouched."""

    def __init__(self, ports: list[int]):
        self.ports = ports
        self.turn = itertools.count()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> TCPBalancer:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _client(self, reader, writer) -> None:
        port = self.ports[next(self.turn) % len(self.ports)]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
