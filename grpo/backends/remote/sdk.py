"""Which SDK a remote backend uses, where it finds its key and endpoint, and its path scheme.

MinT's SDK (``mindlab-toolkit``, ``import mint``) is the Tinker SDK plus a patch that lets
MinT's ``sk-`` keys through and a default endpoint; its clients and types *are* Tinker's
(``mint.ServiceClient is tinker.ServiceClient``). So one implementation serves both, and the
two differ only in the facts collected here.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from grpo.checks import ConfigError


class RemoteConfigError(ConfigError):
    """A remote backend is misconfigured: SDK missing, no API key, bad endpoint or path."""


@dataclass(frozen=True)
class SdkSpec:
    name: str  # backend.name: mint | tinker
    module: str  # what to import
    package: str  # what to pip install
    extra: str  # grpo's optional extra
    key_var: str
    url_var: str
    default_url: str
    scheme: str  # checkpoint path scheme shown to users

    def import_sdk(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ImportError as err:
            raise RemoteConfigError(
                f"backend={self.name} needs the {self.package} package (import {self.module}), which "
                f"is not installed: pip install -e '.[{self.extra}]' in your grpo checkout. Or run with backend=local."
            ) from err

    def api_key(self, explicit: str | None) -> str:
        """The API key, or a RemoteConfigError naming the variable to set."""
        key = explicit or os.environ.get(self.key_var, "")
        if key:
            return key
        if self.name == "tinker" and (os.environ.get("TINKER_CREDENTIAL_CMD") or _tinker_login_exists()):
            return ""  # the SDK finds the credential itself
        raise RemoteConfigError(
            f"backend={self.name} needs an API key and none was found: set the {self.key_var} "
            f"environment variable (or backend.api_key=...)."
            + (" `tinker auth login` or TINKER_CREDENTIAL_CMD work too." if self.name == "tinker" else "")
        )

    def base_url(self, explicit: str | None) -> str:
        url = (explicit or os.environ.get(self.url_var) or self.default_url).rstrip("/")
        if not url.startswith(("http://", "https://")) or "://" not in url or not url.split("://", 1)[1]:
            source = "backend.base_url" if explicit else self.url_var
            raise RemoteConfigError(f"{source}={url!r} is not an http(s) URL; e.g. {self.default_url}")
        return url

    # ---------------------------------------------------------------- checkpoint paths

    def to_sdk_path(self, path: str) -> str:
        """A user's ``mint://`` or ``tinker://`` path as the SDK wants it (``tinker://``)."""
        path = str(path)
        for scheme in ("tinker://", "mint://"):
            if path.startswith(scheme):
                return "tinker://" + path[len(scheme):]
        raise RemoteConfigError(
            f"backend={self.name} loads weights by the {self.scheme}:// (or tinker://) path that "
            f"save_state / save_weights_for_sampler returned; {path!r} is not one. A directory "
            "written by backend=local lives on this machine and cannot be loaded by the service."
        )

    def from_sdk_path(self, path: str) -> str:
        """An SDK path in this backend's scheme (``mint://`` for MinT)."""
        path = str(path)
        if self.scheme != "tinker" and path.startswith("tinker://"):
            return f"{self.scheme}://" + path[len("tinker://"):]
        return path


def _tinker_login_exists() -> bool:
    # Tinker SDK >= 0.3x stores `tinker auth login` keys here.
    return Path("~/.tinker/credentials.json").expanduser().exists()


SDKS: dict[str, SdkSpec] = {
    "mint": SdkSpec(name="mint", module="mint", package="mindlab-toolkit", extra="mint",
                    key_var="MINT_API_KEY", url_var="MINT_BASE_URL",
                    default_url="https://mint.macaron.xin", scheme="mint"),
    "tinker": SdkSpec(name="tinker", module="tinker", package="tinker", extra="tinker",
                      key_var="TINKER_API_KEY", url_var="TINKER_BASE_URL",
                      default_url="https://tinker.thinkingmachines.dev/services/tinker-prod",
                      scheme="tinker"),
}


def get_spec(name: str) -> SdkSpec:
    if name not in SDKS:
        raise RemoteConfigError(f"remote sdk={name!r} is invalid; valid: {', '.join(SDKS)}")
    return SDKS[name]
