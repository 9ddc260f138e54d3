"""Where the daemon listens and the client finds it: every form `OLLAMA_HOST` takes.

config.py reads CORRAL_HOST with `parse_host`; the settings carry the `HostAddr`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORT = 11434


@dataclass(frozen=True)
class HostAddr:
    """Where the daemon listens, or where the client finds it."""

    scheme: str
    host: str
    port: int
    path: str = ""

    def base_url(self) -> str:
        """URL a client uses: wildcard bind addresses mean the local machine."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    def is_loopback(self) -> bool:
        if self.host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_host(value: str) -> HostAddr:
    """Parse every form OLLAMA_HOST accepts: host, host:port, :port, [v6]:port, URLs."""
    value = value.strip()
    scheme, default_port = "http", DEFAULT_PORT
    path = ""
    if "://" in value:
        parts = urlsplit(value)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme {scheme!r}")
        default_port = 443 if scheme == "https" else 80
        value, path = parts.netloc, parts.path.rstrip("/")
    elif value and "." in value and ":" not in value and not _looks_like_ip(value):
        # A bare domain such as "ollama.com" is a remote TLS endpoint.
        if value not in ("localhost",) and not value.startswith("127."):
            scheme, default_port = "https", 443
    host, port = _split_host_port(value, default_port)
    if not host:
        host = "127.0.0.1"
    return HostAddr(scheme, host, port, path)


def _looks_like_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


def _split_host_port(value: str, default_port: int) -> tuple[str, int]:
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError("unclosed '[' in host")
        host, rest = value[1:end], value[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    elif value.count(":") > 1:
        host, port_text = value, ""  # bare IPv6
    else:
        host, port_text = value, ""
    port = default_port
    if port_text:
        # Ollama: an invalid port falls back to the default rather than failing.
        if port_text.isdigit() and 0 <= int(port_text) <= 65535:
            port = int(port_text)
    return host, port
