"""What a build's RUN steps reach: the egress proxy under the build's network policy, the download caches
of its environment, the host's package index settings and CA bundle, and named failures.

A builder has a network namespace of its own with only loopback; its ``127.0.0.1:3128`` is the egress
proxy (``egress.py``), which lets it reach the package registries (``registries``, the default of every
build) or any host but the host's own services (``open``). ``apt-get``, ``pip``, ``npm``, ``curl`` and
``git`` find the proxy through the usual variables (``egress.proxy_env``).

Download caches are per environment (``images_root()/build-cache/env-<key>``: apt's archive directory,
pip's and npm's caches): a rebuild of an environment downloads no package it already has, and no build
can plant a file in another environment's cache. The host's CA bundle (TLS to the registries may pass a
proxy only the host trusts) is mounted read-only. All of it is mounted in the builder only, never in the image.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlparse

from albatross.cache import images_root
from albatross.sandbox import egress
from albatross.sandbox.base import ExecResult
from albatross.sandbox.bootstrap import host_mirror
from albatross.sandbox.build import Builder, EnvBuildError
from albatross.sandbox.dockerfile import Instruction, Run
from albatross.sandbox.layers import DiskGuard
from albatross.sandbox.ubuntu import ubuntu_mirror

PIP_CACHE = "/var/cache/albatross-pip"
NPM_CACHE = "/var/cache/albatross-npm"
APT_CACHE = "/var/cache/apt/archives"
CA_DIR = "/var/cache/albatross-ca"  # the host's CA bundle, read-only for builds
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
           "GIT_SSL_CAINFO", "npm_config_cafile")
NETWORK_VAR = "ALBATROSS_NETWORK"  # set where the sandbox has a network: the offline toolkit hands over to real tools
MAX_DOWNLOAD_BYTES = 8 << 30  # ADD <url>: at most this much


class BuildCaches:
    """The download caches of one environment, locked while a builder uses them (apt locks its archive
    directory; two builds of one environment in two processes take turns, or the second goes without)."""

    def __init__(self, env_key: str) -> None:
        root = images_root() / "build-cache"
        here = root / f"env-{env_key}"
        self._lock_file: IO[str] | None = None
        self.binds: list[tuple[str, str, bool]] = []  # (host directory, path in the builder, read-only)
        self.env: dict[str, str] = {NETWORK_VAR: "1", **host_package_indexes()}
        here.mkdir(parents=True, exist_ok=True)
        handle = open(root / f"env-{env_key}.lock", "w")  # noqa: SIM115 - released in release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_file = handle
        except OSError:
            handle.close()
        if self._lock_file is not None:
            for name, inside in (("apt", APT_CACHE), ("pip", PIP_CACHE), ("npm", NPM_CACHE)):
                (here / name / ("partial" if name == "apt" else "")).mkdir(parents=True, exist_ok=True)
                self.binds.append((str(here / name), inside, False))
            self.env.update({"PIP_CACHE_DIR": PIP_CACHE, "npm_config_cache": NPM_CACHE})
        trust = host_trust()
        self.binds += trust.binds
        self.env.update(trust.env)

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


@dataclass(frozen=True)
class Trust:
    """The host's CA bundle as a sandbox with a network gets it: a read-only bind and the variables
    that point the usual tools at it."""

    binds: list[tuple[str, str, bool]]
    env: dict[str, str]


def host_trust() -> Trust:
    ca = _ca_dir(images_root() / "build-cache")
    if ca is None:
        return Trust([], {})
    return Trust([(str(ca), CA_DIR, True)], {var: f"{CA_DIR}/ca-certificates.crt" for var in CA_VARS})


def _ca_dir(root: Path) -> Path | None:
    """A directory holding the host's CA bundle as ``ca-certificates.crt`` (kept equal to the host's)."""
    bundle = host_ca_bundle()
    if bundle is None:
        return None
    ca = root / "ca"
    ca.mkdir(parents=True, exist_ok=True)
    target = ca / "ca-certificates.crt"
    if not target.is_file() or target.read_bytes() != bundle:
        tmp = ca / f".tmp-{os.getpid()}-{threading.get_ident()}"
        tmp.write_bytes(bundle)
        tmp.rename(target)
    return ca


def host_ca_bundle() -> bytes | None:
    """The host's CA bundle (``$SSL_CERT_FILE``, else Debian's), or None."""
    for path in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        with contextlib.suppress(OSError):
            if path:
                return Path(path).read_bytes()
    return None


def host_package_indexes() -> dict[str, str]:
    """The host's pip and npm index settings that a build can use (http(s) URLs only: a ``file://`` index
    or ``find-links`` directory of the host is not in the image)."""
    import configparser

    found: dict[str, str] = {}
    parser = configparser.ConfigParser()
    parser.read([Path("/etc/pip.conf"), Path.home() / ".config/pip/pip.conf", Path.home() / ".pip/pip.conf"])
    for option, var in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                        ("trusted-host", "PIP_TRUSTED_HOST")):
        value = os.environ.get(var) or parser.get("global", option, fallback="") or ""
        if var != "PIP_TRUSTED_HOST":
            value = " ".join(u for u in value.split() if u.startswith(("http://", "https://")))
        if value:
            found[var] = value
    npmrc = Path.home() / ".npmrc"
    with contextlib.suppress(OSError):
        for line in npmrc.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "registry" and value.strip().startswith(("http://", "https://")):
                found["npm_config_registry"] = value.strip()
    return found


def registry_hosts(configured: Iterable[str]) -> list[str]:
    """The registries a build may reach: ``configured`` plus the hosts of the Debian mirror and the pip and
    npm indexes this machine's own settings name (bases and builds use them)."""
    hosts = [h.strip().lower() for h in configured if h.strip()]
    urls = [host_mirror(), ubuntu_mirror(), *" ".join(host_package_indexes().get(v, "") for v in
                                     ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "npm_config_registry")).split()]
    for url in urls:
        host = (urlparse(url).hostname or "").lower()
        if host and host not in hosts:
            hosts.append(host)
    return hosts


# ---- ADD <url> -------------------------------------------------------------------------------------------


def download(url: str, policy: str, registries: list[str], out: IO[bytes], where: str) -> None:
    """ADD of a URL, downloaded by albatross (as Docker's daemon does) under the build's network policy:
    the destination is checked as the egress proxy checks it (never a service of the host) and the
    address checked is the one connected to. Writes the body to ``out``; ``EnvBuildError`` otherwise."""
    import http.client
    import ssl

    parts = urlparse(url)
    host = (parts.hostname or "").lower()
    https = parts.scheme.lower() == "https"
    port = parts.port or (443 if https else 80)
    try:
        addresses = egress.resolve(host, port, policy, registries)
    except egress.Refused as err:
        raise EnvBuildError(f"{where}: ADD {url}: needs {host}, which the network policy {policy} does not "
                            f"allow ({err})") from None
    family, sockaddr = addresses[0]
    conn: http.client.HTTPConnection
    if https:
        conn = http.client.HTTPSConnection(host, port, timeout=60, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.sock = _connected(family, sockaddr, host if https else None)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Host": parts.netloc.rpartition("@")[2], "User-Agent": "albatross-build"})
        response = conn.getresponse()
        if response.status != 200:
            raise EnvBuildError(f"{where}: ADD {url}: the server answered {response.status} {response.reason}")
        total = 0
        while chunk := response.read(1 << 20):
            total += len(chunk)
            if total > MAX_DOWNLOAD_BYTES:
                raise EnvBuildError(f"{where}: ADD {url}: larger than {MAX_DOWNLOAD_BYTES >> 30} GiB")
            out.write(chunk)
    except OSError as err:
        raise EnvBuildError(f"{where}: ADD {url}: needs {host}: {err}") from None
    finally:
        conn.close()


def _connected(family: int, sockaddr: egress.Address, tls_host: str | None) -> socket.socket:
    import ssl

    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(sockaddr)
    if tls_host is not None:
        return ssl.create_default_context().wrap_socket(sock, server_hostname=tls_host)
    return sock


# ---- named failures ----------------------------------------------------------------------------------------

# What a RUN's output says when it needed a host it could not reach (the host is group 1).
_UNREACHABLE = [re.compile(p) for p in (
    r"Could not resolve host:? '?([\w.-]+\.[a-z]{2,})",
    r"Failed to connect to ([\w.-]+\.[a-z]{2,}) port",
    r"unable to access '\w+://(?:[^@/']*@)?([\w.-]+)",
    r"Could not resolve '([\w.-]+)'",
    r"host='([\w.-]+)', port=\d+\).*(?:NameResolution|NewConnectionError|ConnectTimeout|Max retries)",
    r"Resolving ([\w.-]+\.[a-z]{2,})[ .(].*failed",
    r"unable to resolve host address .([\w.-]+)",
    r"getaddrinfo (?:ENOTFOUND|EAI_AGAIN) ([\w.-]+)",
    r"dial tcp: lookup ([\w.-]+)",
)]
_RESOLVER_ERRORS = ("Name or service not known", "Temporary failure in name resolution", "No address associated",
                    "Network is unreachable", "Connection timed out", "nodename nor servname")
_URL_HOST = re.compile(r"(?:\b[a-z+]+://(?:[^@/\s'\"]*@)?|\bgit@)([\w-]+(?:\.[\w-]+)+)")


def needed_host(output: str, command: str = "") -> str | None:
    """The host a failed RUN tried to reach and could not, or None: named by a resolver or connection
    error in its output, else (the error names none) the first URL's host in the command."""
    for line in output.splitlines():
        for pattern in _UNREACHABLE:
            match = pattern.search(line)
            if match:
                return match.group(1)
    if any(marker in output for marker in _RESOLVER_ERRORS):
        match = _URL_HOST.search(command)
        if match:
            return match.group(1)
    return None


class Deadline:
    """The end of a build's ``build_timeout_sec``: every step gets what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def elapsed(self) -> float:
        return self.seconds - (self.end - time.monotonic())

    def left(self, where: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise EnvBuildError(f"{where}: RUN timed out: the build took longer than build_timeout_sec "
                                f"{self.seconds:g} s")
        return left


class StoppableBuilder(Builder, Protocol):
    """A builder whose running step can be stopped (``LocalAttempt``)."""

    def interrupt(self) -> None: ...


class BuildRunner:
    """The builder as ``apply_dockerfile`` sees it: RUN steps get the proxy's and the caches' variables and
    what is left of the build's time; a RUN that failed for want of a host is an ``EnvBuildError`` naming
    it (a host the proxy refused, or one a tool could not resolve)."""

    def __init__(self, builder: StoppableBuilder, instructions: list[Instruction], env_dir: Path, env: dict[str, str],
                 deadline: Deadline, refused: Callable[[], list[str]], policy: str, guard: DiskGuard | None = None
                 ) -> None:
        """``guard``: a ``layers.DiskGuard`` (a step is refused, or stopped, when the disk gets too full;
        the builder's ``interrupt()`` stops it)."""
        self._builder, self._env_dir, self._env = builder, env_dir, env
        self._deadline, self._refused, self._policy = deadline, refused, policy
        self._guard = guard
        self._lines = {_command_text(i.command): i.line for i in instructions if isinstance(i, Run)}

    def mkdirs(self, sandbox_path: str) -> None:
        self._builder.mkdirs(sandbox_path)

    def put_tar(self, data: bytes) -> None:
        self._builder.put_tar(data)

    def put_stream(self, write: Callable[[IO[bytes]], None]) -> None:
        self._builder.put_stream(write)

    def run_argv(self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
                 ) -> ExecResult:
        where = self._where(argv)
        left = self._deadline.left(where)
        before = len(self._refused())
        timeout = left if timeout_s is None else min(timeout_s, left)
        if self._guard is None:
            result = self._builder.run_argv(argv, {**self._env, **env}, cwd, timeout)
        else:
            if self._guard.problem():
                raise EnvBuildError(f"{where}: {self._guard.problem()}")
            with self._guard.watching(self._builder.interrupt) as full:
                result = self._builder.run_argv(argv, {**self._env, **env}, cwd, timeout)
            if full:
                raise EnvBuildError(f"{where}: RUN stopped: {full[0]}")
        if result.exit_code == 0:
            return result
        refused = self._refused()[before:]
        if result.timed_out and timeout >= left - 0.5:
            raise EnvBuildError(f"{where}: RUN timed out: the build took longer than build_timeout_sec "
                                f"{self._deadline.seconds:g} s")
        lines = result.output.strip().splitlines() or [""]
        if refused:
            evidence = next((ln for ln in lines if refused[0] in ln), lines[-1]).strip()[:200]
            raise EnvBuildError(f"{where}: RUN needs {refused[0]}, which the network policy {self._policy} does "
                                f"not allow (not allowed by the network policy; {evidence})")
        host = needed_host(result.output, " ".join(argv))
        if host is not None:
            evidence = next((ln for ln in lines if host in ln), lines[-1]).strip()[:200]
            raise EnvBuildError(f"{where}: RUN needs {host}, which the build cannot reach ({evidence})")
        return result

    def _where(self, argv: list[str]) -> str:
        text = " ".join(argv)
        line = next((n for command, n in self._lines.items() if command and command in text), 0)
        return f"{self._env_dir / 'Dockerfile'}" + (f":{line}" if line else "")


def _command_text(command: str | tuple[str, ...] | list[str]) -> str:
    return command if isinstance(command, str) else " ".join(command)
