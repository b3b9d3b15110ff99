"""Images a request points at, fetched and decoded safely (on the tokenize lanes, never the event loop).

- ``data:`` URIs are always accepted (base64 or percent-encoded).
- ``http(s)`` URLs are fetched with a size, time and redirect limit. The host is resolved first and
  every address it resolves to must be public (no private, loopback, link-local (169.254.169.254),
  multicast or reserved address), checked again on each redirect; the connection goes to the
  address that was checked, so a second DNS answer cannot swap in another (DNS rebinding).
  ``--allowed-media-domains`` narrows the hosts further (vLLM's flag).
- ``file://`` paths only under ``--allowed-local-media-path``, resolved (no ``..`` or links out).
- A body that is not an image is a 400, one over ``--max-image-bytes`` a 413: each in the dialect's shape.
"""

from __future__ import annotations

import base64
import http.client
import io
import ipaddress
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import InvalidRequest, TooLarge

MAX_PIXELS = 64 << 20  # decoded pixels: a small file can decompress to a huge image (a "decompression bomb")


@dataclass(slots=True)
class MediaRules:
    """The gateway's fetching rules (flags in gateway/config.py)."""

    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3
    max_images: int = 8
    allowed_domains: tuple[str, ...] = ()  # empty: any public host
    local_root: str | None = None  # file:// paths under this directory; None: no local files
    allow_private: bool = False  # tests' loopback servers only: never in production


def load_image(url: str, rules: MediaRules, param: str) -> Any:  # a PIL RGB image
    """The image ``url`` names, decoded to RGB; a 400 (413 when too large) naming ``param`` otherwise."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_uri(url, rules, param)
    elif scheme in ("http", "https"):
        data = _fetch(url, rules, param)
    elif scheme == "file":
        data = _local(url, rules, param)
    else:
        raise InvalidRequest(f"`{param}` must be a data: URI or an http(s) URL; got scheme {scheme!r}", param=param)
    return decode(data, param)


def decode(data: bytes, param: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_PIXELS:
                raise TooLarge(
                    f"`{param}`: the image has {image.width}x{image.height} pixels, over {MAX_PIXELS}", param=param
                )
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"`{param}` is not an image this server can decode ({exc})", param=param) from None


def _data_uri(url: str, rules: MediaRules, param: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep:
        raise InvalidRequest(f"`{param}` is a data: URI without a comma before its data", param=param)
    if len(body) * 3 // 4 > rules.max_bytes:
        raise TooLarge(f"`{param}` holds more than {rules.max_bytes} bytes", param=param)
    if head.endswith(";base64"):
        try:
            return base64.b64decode(body, validate=False)
        except ValueError as exc:
            raise InvalidRequest(f"`{param}` is not valid base64 ({exc})", param=param) from None
    return urllib.parse.unquote_to_bytes(body)


def _local(url: str, rules: MediaRules, param: str) -> bytes:
    if rules.local_root is None:
        raise InvalidRequest(f"`{param}`: local files are not allowed (--allowed-local-media-path)", param=param)
    root = Path(rules.local_root).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise InvalidRequest(f"`{param}`: no file under the allowed media directory at {path}", param=param)
    if path.stat().st_size > rules.max_bytes:
        raise TooLarge(f"`{param}`: the file is over {rules.max_bytes} bytes", param=param)
    return path.read_bytes()


def check_address(address: str, rules: MediaRules, host: str, param: str) -> None:
    """Refuse an address that is not public: loopback, private, link-local (the cloud metadata
    service, 169.254.169.254), multicast, reserved or unspecified."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global and not rules.allow_private:
        raise InvalidRequest(f"`{param}`: {host} resolves to {ip}, which is not a public address", param=param)


def _resolve(host: str, port: int, rules: MediaRules, param: str) -> str:
    """The address to connect to, after checking every address the host resolves to."""
    if rules.allowed_domains and host.lower().rstrip(".") not in rules.allowed_domains:
        raise InvalidRequest(f"`{param}`: {host} is not among the allowed media domains", param=param)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidRequest(f"`{param}`: cannot resolve {host} ({exc})", param=param) from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        check_address(address, rules, host, param)
    return addresses[0]


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the checked address, with the certificate checked against the host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _fetch(url: str, rules: MediaRules, param: str) -> bytes:
    for _ in range(rules.max_redirects + 1):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"`{param}`: cannot fetch {url!r}", param=param)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = _resolve(parts.hostname, port, rules, param)
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = _PinnedHTTPS(parts.hostname, address, port, rules.timeout_s)
        else:
            conn = http.client.HTTPConnection(address, port, timeout=rules.timeout_s)
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", path, headers={"Host": parts.netloc, "Accept": "image/*"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                url = urllib.parse.urljoin(url, response.getheader("Location"))
                continue
            if response.status != 200:
                raise InvalidRequest(f"`{param}`: fetching the image gave HTTP {response.status}", param=param)
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > rules.max_bytes:
                raise TooLarge(f"`{param}`: the image is over {rules.max_bytes} bytes", param=param)
            data = response.read(rules.max_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise InvalidRequest(f"`{param}`: fetching the image failed ({exc})", param=param) from None
        finally:
            conn.close()
        if len(data) > rules.max_bytes:
            raise TooLarge(f"`{param}`: the image is over {rules.max_bytes} bytes", param=param)
        return data
    raise InvalidRequest(f"`{param}`: more than {rules.max_redirects} redirects", param=param)
