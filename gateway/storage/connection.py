"""redis-py's connections, sending each command in the calling task.

redis-py 7 sends a command through ``asyncio.wait_for`` once ``socket_timeout`` is set
(fairgate sets it: a frozen Redis must not hang a request): on Python 3.11 that is a task
of its own per command, a turn of the event loop before the bytes leave, and the
cancellation it may swallow (``gateway/core/waits.py``). :class:`SendInPlace` writes in
the calling task under ``asyncio.timeout`` instead: the same limit, the same errors, and
the same connection torn down after a timeout, a socket error or a cancellation. A
connection's first send (it connects first) and reading a reply are redis-py's own (the
reply is already read under ``asyncio.timeout``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class SendInPlace(AbstractConnection):
    """``send_packed_command`` of redis-py 7.x without its ``wait_for``."""

    async def send_packed_command(self, command: bytes | str | Iterable[bytes],
                                  check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout or not self.is_connected:  # connecting first: redis-py's way
            return await super().send_packed_command(command, check_health)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            async with asyncio.timeout(timeout):
                self._writer.writelines(command)  # type: ignore[union-attr]
                await self._writer.drain()  # type: ignore[union-attr]
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            err_no, errmsg = ("UNKNOWN", e.args[0]) if len(e.args) == 1 else e.args[:2]
            raise RedisConnectionError(
                f"Error {err_no} while writing to socket. {errmsg}.") from e
        except BaseException:
            # a send cut short leaves the connection unusable: redis-py's rule
            await self.disconnect(nowait=True)
            raise


class InPlaceConnection(SendInPlace, Connection):
    pass


class InPlaceSSLConnection(SendInPlace, SSLConnection):
    pass


class InPlaceUnixConnection(SendInPlace, UnixDomainSocketConnection):
    pass


class InPlaceSentinelConnection(SendInPlace, SentinelManagedConnection):
    pass


class InPlaceSentinelSSLConnection(SendInPlace, SentinelManagedSSLConnection):
    pass


IN_PLACE: dict[type[Any], type[Any]] = {
    Connection: InPlaceConnection, SSLConnection: InPlaceSSLConnection,
    UnixDomainSocketConnection: InPlaceUnixConnection}
