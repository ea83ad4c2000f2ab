"""Download URLs of checkpoint files that the server serves itself (``external_weights_urls``).

In-process, ``get_external_weights_urls`` answers ``file://`` URLs: the caller is on the machine
and the store is its own. Over HTTP those would tell any client where the store lies on the
server's disk. The server answers instead ``<server>/api/v1/checkpoint_files/<tinker path
parts>/<file>?expires=<unix time>&sig=<hmac>``: what the SDK's signed storage URLs are, a URL
that is its own credential, so ``urllib.request.urlretrieve`` (tinker_cookbook.weights.download)
fetches it without the API key. The signature covers the checkpoint, the file and the expiry, with
a secret drawn when the server starts: a URL cannot be edited into another file or a later expiry,
and none outlives the server process.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import quote

FILES_ROUTE = "/checkpoint_files"
LIFETIME_S = 3600  # the cookbook asks again when its URLs have expired


class FileSigner:
    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def _sig(self, tinker_path: str, rel: str, expires: int) -> str:
        message = f"{tinker_path}\n{rel}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def url(self, base: str, tinker_path: str, rel: str, expires: int) -> str:
        """``base`` is the server's API root (``http://host:port/api/v1``)."""
        parts = "/".join(quote(p, safe="") for p in tinker_path.removeprefix("tinker://").split("/"))
        return (f"{base}{FILES_ROUTE}/{parts}/{quote(rel, safe='/')}"
                f"?expires={expires}&sig={self._sig(tinker_path, rel, expires)}")

    def valid(self, tinker_path: str, rel: str, expires: str, sig: str) -> bool:
        if not expires.isdigit() or int(expires) < time.time():
            return False
        return hmac.compare_digest(self._sig(tinker_path, rel, int(expires)), sig)


def expiry() -> int:
    return int(time.time()) + LIFETIME_S
