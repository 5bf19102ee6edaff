"""The channel between the engine process and a front-end process: a unix socket.

Each direction carries frames: a 4-byte length and a pickled list of messages
(tuples whose first item names the kind). Messages sent in one turn of the event
loop leave as one frame, so that a batch's answers to one front end cost one
write and one read, not one per stream. Pickle is safe here: both ends are this
service's own processes, and the socket lies in a directory only its user opens.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable

_HEADER = struct.Struct("<I")

Message = tuple
Handler = Callable[[Message], None]


class Link:
    """One end of a connection; `run()` hands every message received to `on_message`."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_message: Handler
    ) -> None:
        self._reader, self._writer = reader, writer
        self.on_message = on_message
        self._outbox: list[Message] = []

    @classmethod
    async def connect(cls, path: str, on_message: Handler) -> Link:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, on_message)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, message: Message) -> None:
        """Queues a message; the loop's next turn writes everything queued as one frame."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if self.closed:
            return
        payload = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_HEADER.pack(len(payload)) + payload)

    async def run(self) -> None:
        """Reads until the other end closes (or this one is closed)."""
        try:
            while True:
                (size,) = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
                for message in pickle.loads(await self._reader.readexactly(size)):
                    self.on_message(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        self._writer.close()
