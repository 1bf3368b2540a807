"""The egress proxy of the ``registries`` network policy: an HTTP(S) CONNECT and plain-HTTP forward proxy on
the host side that lets a sandbox reach only the package registries of its list, and never a service of
the host. Here its listening socket is an ordinary one of the test (in a sandbox it lives in the attempt's
network namespace); every request that names a host outside the list, however it is spelled, is refused."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from albatross.sandbox.egress import EgressProxy

REGISTRIES = ["pypi.org", "files.pythonhosted.org", "deb.debian.org", "registry.npmjs.org"]


class _Host(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "6")
        self.end_headers()
        self.wfile.write(b"secret")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def host_service() -> Iterator[int]:
    """A service of the host on 127.0.0.1 and ::1's wildcard (every address): its port."""
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def proxy() -> Iterator[EgressProxy]:
    proxy = EgressProxy(REGISTRIES)
    yield proxy
    proxy.close()


def endpoint(proxy: EgressProxy, policy: str, tag: str) -> int:
    """A listening socket handed to the proxy for ``policy`` (as a sandbox's would be): its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    proxy.serve(listener, policy, tag)
    return port


def ask(port: int, request: bytes) -> str:
    """The proxy's answer to ``request``: its status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0].decode(errors="replace")


def refused(status: str) -> bool:
    return status.split()[1:2] == ["403"] or status.split()[1:2] == ["400"]


REFUSED_CONNECT = ["example.com:443", "github.com:443", "pypi.org.evil.example:443", "evilpypi.org:443",
                   "pypi.org:22", "deb.debian.org:8080", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}",
                   "127.1:{port}", "0.0.0.0:{port}", "169.254.169.254:80", "2130706433:{port}"]


@pytest.mark.parametrize("target", REFUSED_CONNECT)
def test_registries_proxy_refuses_connect_outside_its_list(proxy: EgressProxy, host_service: int, target: str) -> None:
    port = endpoint(proxy, "registries", f"connect-{target}")
    status = ask(port, f"CONNECT {target.format(port=host_service)} HTTP/1.1\r\n\r\n".encode())
    assert refused(status), status


REFUSED_GET = [
    "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "GET http://127.0.0.1:{port}/a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "GET http://pypi.org@127.0.0.1:{port}/b HTTP/1.1\r\nHost: pypi.org\r\n\r\n",
    "GET /c HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n",
    "GET http://localhost:{port}/d HTTP/1.0\r\n\r\n",
    "GET http://deb.debian.org:{port}/e HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n",
]


@pytest.mark.parametrize("request_text", REFUSED_GET)
def test_registries_proxy_refuses_plain_http_outside_its_list(proxy: EgressProxy, host_service: int,
                                                              request_text: str) -> None:
    port = endpoint(proxy, "registries", f"get-{request_text[:30]}")
    status = ask(port, request_text.format(port=host_service).encode())
    assert refused(status), status
    assert not _Host.hits, _Host.hits  # the host's service never saw a request


@pytest.mark.parametrize("target", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}",
                                    "169.254.169.254:80", "10.0.0.1:80"])
def test_open_proxy_still_refuses_the_host_and_private_addresses(proxy: EgressProxy, host_service: int,
                                                                 target: str) -> None:
    port = endpoint(proxy, "open", f"open-{target}")
    status = ask(port, f"CONNECT {target.format(port=host_service)} HTTP/1.1\r\n\r\n".encode())
    assert refused(status), status


def test_refusals_are_recorded_per_sandbox(proxy: EgressProxy) -> None:
    port = endpoint(proxy, "registries", "recorded")
    ask(port, b"CONNECT github.com:443 HTTP/1.1\r\n\r\n")
    assert proxy.refused("recorded") == ["github.com"]


def test_registries_proxy_tunnels_to_a_registry(proxy: EgressProxy) -> None:
    """The allowed case, for real: a TLS handshake with pypi.org through the tunnel."""
    import ssl

    port = endpoint(proxy, "registries", "allowed")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
        assert head.split()[1] == b"200", head
        with ssl.create_default_context().wrap_socket(s, server_hostname="pypi.org") as tls:
            tls.sendall(b"HEAD /simple/ HTTP/1.1\r\nHost: pypi.org\r\nConnection: close\r\n\r\n")
            assert tls.recv(64).startswith(b"HTTP/1.1 ")


def test_forgetting_a_sandbox_closes_its_listener(proxy: EgressProxy) -> None:
    port = endpoint(proxy, "registries", "forgotten")
    proxy.forget("forgotten")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
