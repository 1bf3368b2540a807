"""Messages between the host and the zygote or a holder, over Unix stream sockets.

A message is an 8-byte header (JSON length, payload length), the JSON, then the payload. File
descriptors ride along with the header (SCM_RIGHTS).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterable
from typing import Any


def send(sock: socket.socket, msg: dict[str, Any], payload: bytes = b"", fds: Iterable[int] = ()) -> None:
    body = json.dumps(msg).encode()
    head = struct.pack("!II", len(body), len(payload))
    fds = list(fds)
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(body + payload)
    else:
        sock.sendall(head + body + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the socket")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 4)
    if not head:
        raise EOFError("peer closed the socket")
    for fd in fds:
        os.set_inheritable(fd, False)
    head += _recv_exact(sock, 8 - len(head))
    body_len, payload_len = struct.unpack("!II", head)
    data = _recv_exact(sock, body_len + payload_len)
    return json.loads(data[:body_len]), data[body_len:], fds
