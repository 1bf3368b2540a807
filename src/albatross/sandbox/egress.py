"""Network policies of builds and attempts, and the egress proxy that enforces ``registries`` and ``open``.

``none``: loopback only (an attempt's own network namespace, nothing else). ``registries``: the package
registries of a host list (PyPI, the Debian archive, npm by default; ``[sandbox] registries``), over
HTTP(S) through this proxy, and nothing else. ``open``: any host of the internet through the proxy, but
never the host's own services (its loopback, link-local and private addresses). Either way a sandbox
has no route anywhere: its network namespace holds only loopback, and on its ``127.0.0.1:3128`` sits a
listening socket that albatross made inside that namespace and hands to this proxy, which accepts on it
from the host side and connects out from the host's namespace, after checking the destination.

The proxy speaks HTTP ``CONNECT host:port`` (HTTPS and any TLS: the tunnel is end to end) and plain
HTTP in absolute form (``GET http://host/path``: one request per connection, forwarded with
``Connection: close``). A refused request gets ``403 Blocked by network policy`` and is recorded for its
sandbox (``refused(tag)``), so a build step that failed for want of a host can say which. Destinations
are resolved once and the checked address is the one connected to, so a name cannot be re-resolved to a
host address in between.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from albatross.sandbox.base import NETWORK_POLICIES as POLICIES  # narrowest first

log = logging.getLogger(__name__)
NONE, REGISTRIES, OPEN = POLICIES
PROXY_PORT = 3128  # where the proxy listens inside a sandbox (its own 127.0.0.1)
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
REGISTRY_PORTS = (80, 443)
MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 600.0
MAX_CONNECTIONS = 64  # open connections per sandbox; more are closed at once
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
Address = tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]  # a socket address (getaddrinfo's)
SockAddr = tuple[socket.AddressFamily, Address]  # where to connect: the family and its address


def check_policy(policy: str, what: str = "network policy") -> str:
    """``policy`` if it is one of ``POLICIES``, else ``ValueError`` naming them."""
    if policy not in POLICIES:
        raise ValueError(f"{what} must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def narrowest(*policies: str) -> str:
    """The most restrictive of ``policies``."""
    return min(policies, key=POLICIES.index)


def build_policy(attempt: str) -> str:
    """What a build of an environment may reach: the package registries (a Dockerfile's ``apt-get
    install`` and ``pip install``, as a Docker build does), or anything when attempts are ``open``."""
    return OPEN if attempt == OPEN else REGISTRIES


def proxy_env(policy: str) -> dict[str, str]:
    """The variables that send pip, apt, npm, curl, git and uv through the proxy ({} for ``none``)."""
    if policy == NONE:
        return {}
    local = "localhost,127.0.0.1,::1"
    return {"http_proxy": PROXY_URL, "https_proxy": PROXY_URL, "HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL,
            "no_proxy": local, "NO_PROXY": local, "npm_config_proxy": PROXY_URL, "npm_config_https_proxy": PROXY_URL}


def listen_socket() -> socket.socket:
    """The proxy's listening socket of a sandbox, made in the caller's network namespace (the sandbox's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", PROXY_PORT))
    sock.listen(128)
    return sock


# ---- checking a destination ----------------------------------------------------------------------------


class Refused(Exception):
    """The policy does not allow this destination; the message says why."""


def host_matches(host: str, patterns: Iterable[str]) -> bool:
    """``host`` is one of ``patterns`` (exact names; ``*.example.org`` or ``.example.org``: its subdomains)."""
    for pattern in patterns:
        pattern = pattern.strip().lower().rstrip(".")
        if pattern.startswith(("*.", ".")):
            suffix = pattern.lstrip("*")
            if host.endswith(suffix) and len(host) > len(suffix):
                return True
        elif host == pattern:
            return True
    return False


def forbidden_address(address: str, policy: str) -> str:
    """Why ``address`` may not be reached under ``policy`` ("" when it may): the host's loopback and
    link-local addresses never; private and shared addresses only where ``registries`` names the host."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for test, why in ((ip.is_loopback, "loopback"), (ip.is_unspecified, "unspecified"),
                      (ip.is_link_local, "link-local"), (ip.is_multicast, "multicast"), (ip.is_reserved, "reserved")):
        if test:
            return f"a {why} address"
    if policy == OPEN and (ip.is_private or (ip.version == 4 and ip in _CGNAT)):
        return "a private address"
    return ""


def resolve(host: str, port: int, policy: str, registries: Iterable[str]) -> list[SockAddr]:
    """The socket addresses ``host:port`` may be reached at under ``policy``, or ``Refused``."""
    if policy == NONE:
        raise Refused("the network policy is none")
    if not 0 < port < 65536:
        raise Refused(f"port {port}")
    if policy == REGISTRIES:
        if not host_matches(host, registries):
            raise Refused("not a package registry of the list")
        if port not in REGISTRY_PORTS:
            raise Refused(f"port {port} (registries are reached on 80 and 443)")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as err:
        raise Refused(f"cannot resolve it ({err})") from None
    for _family, _type, _proto, _name, sockaddr in found:
        why = forbidden_address(str(sockaddr[0]), policy)
        if why:
            raise Refused(f"it resolves to {sockaddr[0]}, {why}")
    return [(family, sockaddr) for family, _t, _p, _n, sockaddr in found]


def split_authority(authority: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` or ``[v6]:port`` (``Refused`` when malformed)."""
    host, _, port = authority.rpartition(":")
    if not host or not port.isdigit():
        raise Refused(f"malformed target {authority[:100]!r}")
    return normal_host(host), int(port)


def normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c in host for c in "@/\\ \t"):
        raise Refused(f"malformed host {host[:100]!r}")
    return host


# ---- the proxy -------------------------------------------------------------------------------------------


@dataclass
class _Sandbox:
    policy: str
    listener: socket.socket
    refused: list[str] = field(default_factory=list)
    open: int = 0


class EgressProxy:
    """The host-side proxy of every sandbox of a backend (a thread that accepts, one per connection)."""

    def __init__(self, registries: Iterable[str]) -> None:
        self.registries = [r.strip().lower() for r in registries if r.strip()]
        self._lock = threading.Lock()
        self._sandboxes: dict[str, _Sandbox] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="egress-proxy", daemon=True)
        self._thread.start()

    # ---- sandboxes ----------------------------------------------------------------------------------
    def serve(self, listener: socket.socket, policy: str, tag: str) -> None:
        """Accept on ``listener`` (a listening socket, made in a sandbox's network namespace; the proxy
        owns it from now on) for the sandbox ``tag`` under ``policy``."""
        check_policy(policy)
        listener.setblocking(False)
        with self._lock:
            if self._closed:
                listener.close()
                return
            old = self._sandboxes.pop(tag, None)
            self._sandboxes[tag] = _Sandbox(policy, listener)
        if old is not None:
            self._drop(old)
        self._selector.register(listener, selectors.EVENT_READ, tag)
        self._wake()

    def forget(self, tag: str) -> None:
        """Stop accepting for ``tag`` and close its listening socket (its open connections end by themselves)."""
        with self._lock:
            sandbox = self._sandboxes.pop(tag, None)
        if sandbox is not None:
            self._drop(sandbox)

    def refused(self, tag: str) -> list[str]:
        """The hosts refused to ``tag`` so far, first refused first."""
        with self._lock:
            sandbox = self._sandboxes.get(tag)
            return list(sandbox.refused) if sandbox is not None else []

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sandboxes, self._sandboxes = list(self._sandboxes.values()), {}
        for sandbox in sandboxes:
            self._drop(sandbox)
        self._wake()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._wake_r.close()
            self._wake_w.close()

    def _drop(self, sandbox: _Sandbox) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sandbox.listener)
        with contextlib.suppress(OSError):
            sandbox.listener.close()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ---- accepting ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            for key, _events in self._selector.select(timeout=1.0):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                self._accept(key.fileobj, key.data)  # type: ignore[arg-type]
        with contextlib.suppress(OSError):
            self._selector.close()

    def _accept(self, listener: socket.socket, tag: str) -> None:
        while True:
            try:
                conn, _addr = listener.accept()
            except (BlockingIOError, OSError):
                return
            with self._lock:
                sandbox = self._sandboxes.get(tag)
                if sandbox is None or sandbox.open >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                sandbox.open += 1
            threading.Thread(target=self._handle, args=(conn, tag, sandbox), name="egress-conn", daemon=True).start()

    def _handle(self, conn: socket.socket, tag: str, sandbox: _Sandbox) -> None:
        try:
            conn.setblocking(True)
            _Connection(self, conn, sandbox).run()
        except Exception as err:  # noqa: BLE001 - a broken connection never takes the proxy down
            log.debug("egress proxy: %s: %s", tag, err)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                sandbox.open -= 1

    def note_refused(self, sandbox: _Sandbox, host: str) -> None:
        with self._lock:
            if host not in sandbox.refused and len(sandbox.refused) < 50:
                sandbox.refused.append(host)


class _Connection:
    """One client connection: read the request head, check it, then tunnel or forward."""

    def __init__(self, proxy: EgressProxy, conn: socket.socket, sandbox: _Sandbox) -> None:
        self.proxy, self.conn, self.sandbox = proxy, conn, sandbox

    def run(self) -> None:
        head, rest = self._read_head()
        if head is None:
            return
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].decode("latin-1").split(" ")
        except ValueError:
            self._reply(400, "Bad Request", "malformed request line")
            return
        try:
            if method.upper() == "CONNECT":
                host, port = split_authority(target)
                upstream = self._open(host, port)
                self.conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
            else:
                host, port, path = self._absolute(target)
                upstream = self._open(host, port)
                upstream.sendall(_forwarded(method, path, version, lines[1:], host, port) + rest)
        except Refused:
            return
        with upstream:
            _relay(self.conn, upstream)

    def _read_head(self) -> tuple[bytes | None, bytes]:
        self.conn.settimeout(HEAD_TIMEOUT_S)
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > MAX_HEAD_BYTES:
                self._reply(431, "Request Header Fields Too Large", "request head too large")
                return None, b""
            try:
                chunk = self.conn.recv(8192)
            except OSError:
                return None, b""
            if not chunk:
                return None, b""
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        self.conn.settimeout(None)
        return head, rest

    def _absolute(self, target: str) -> tuple[str, int, str]:
        """(host, port, origin-form path) of an absolute ``http://`` request target."""
        parts = urlsplit(target)
        if parts.scheme.lower() != "http" or not parts.netloc:
            self._reply(400, "Bad Request", "a proxy request needs an absolute http:// URL (HTTPS goes by CONNECT)")
            raise Refused("not an absolute http URL")
        if "@" in parts.netloc:
            self._refuse(parts.netloc, "a user name in the URL")
        try:
            host = normal_host(parts.hostname or "")
            port = parts.port or 80
        except (Refused, ValueError) as err:
            self._refuse(parts.netloc, str(err))
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return host, port, path

    def _open(self, host: str, port: int) -> socket.socket:
        try:
            addresses = resolve(host, port, self.sandbox.policy, self.proxy.registries)
        except Refused as err:
            self._refuse(f"{host}:{port}", str(err), host)
        last: OSError | None = None
        for family, sockaddr in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                sock.connect(sockaddr)
                sock.settimeout(None)
                return sock
            except OSError as err:
                sock.close()
                last = err
        self._reply(502, "Bad Gateway", f"cannot connect to {host}:{port}: {last}")
        raise Refused(f"cannot connect to {host}:{port}")

    def _refuse(self, target: str, why: str, host: str | None = None) -> None:
        self.proxy.note_refused(self.sandbox, host or target)
        self._reply(403, "Blocked by network policy",
                    f"albatross egress proxy: {target} is not allowed by network policy {self.sandbox.policy} "
                    f"({why})")
        raise Refused(why)

    def _reply(self, code: int, reason: str, text: str) -> None:
        body = (text + "\n").encode()
        head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        with contextlib.suppress(OSError):
            self.conn.sendall(head + body)


_HOP_BY_HOP = {b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization", b"host", b"te",
               b"upgrade"}


def _forwarded(method: str, path: str, version: str, headers: list[bytes], host: str, port: int) -> bytes:
    """The request as the origin server gets it: origin-form, the URL's Host, one request per connection."""
    kept = [h for h in headers if h and h.split(b":", 1)[0].strip().lower() not in _HOP_BY_HOP]
    authority = host if port == 80 else f"{host}:{port}"
    if ":" in host:
        authority = f"[{host}]" if port == 80 else f"[{host}]:{port}"
    lines = [f"{method} {path} {version}".encode("latin-1"), f"Host: {authority}".encode(), *kept,
             b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have finished (or nothing moved for ``IDLE_TIMEOUT_S``)."""
    selector = selectors.DefaultSelector()
    ends = {a.fileno(): (a, b), b.fileno(): (b, a)}  # descriptor -> (the socket, its peer)
    for sock, _peer in ends.values():
        selector.register(sock, selectors.EVENT_READ)
    open_ends = 2
    last = time.monotonic()
    try:
        while open_ends and time.monotonic() - last < IDLE_TIMEOUT_S:
            for key, _ in selector.select(timeout=5.0):
                sock, peer = ends[key.fd]
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                last = time.monotonic()
                if data:
                    try:
                        peer.sendall(data)
                    except OSError:
                        return
                    continue
                selector.unregister(sock)
                open_ends -= 1
                with contextlib.suppress(OSError):
                    peer.shutdown(socket.SHUT_WR)
    finally:
        selector.close()
