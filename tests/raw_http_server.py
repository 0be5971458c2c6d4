"""A raw TCP server that answers HTTP requests with crafted bytes, misbehaving on purpose:
shared by the tests of runtime/http_client (tests/gateway) and of the load generator's
requests over it (tests/benchmark)."""

import asyncio


class Cut(bytes):
    """A reply after which the server closes the connection (mid-body, if it is cut)."""


class RawServer:
    """Answers each request on a connection with the next of `replies`: bytes, a Cut, None
    to close the connection without answering, "hang", or a list of byte pieces written
    10 ms apart (so each arrives in its own read; judged as their concatenation), which
    may end with "hang": after the pieces, nothing more until the client gives up."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof_seen = asyncio.Event()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply == "hang":
                    await reader.read()          # until the client gives up
                    self.eof_seen.set()
                    return
                if reply is None:
                    break
                pieces = reply if isinstance(reply, list) else [reply]
                for i, piece in enumerate(pieces):
                    if piece == "hang":
                        await reader.read()
                        self.eof_seen.set()
                        return
                    if i:
                        await asyncio.sleep(0.01)
                    writer.write(piece)
                    await writer.drain()
                if isinstance(reply, list):
                    reply = b"".join(reply)
                if isinstance(reply, Cut) or b"connection: close" in reply.lower() or \
                        b"content-length" not in \
                        reply.lower() and b"chunked" not in reply.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


def chunked(*parts, end=True):
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for p in parts:
        out += b"%x\r\n%s\r\n" % (len(p), p)
    return out + (b"0\r\n\r\n" if end else b"")
