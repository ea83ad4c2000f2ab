"""age encryption of an exported checkpoint (``save_weights_external(age_encryption_recipients=...)``).

The service encrypts an external-weights export to the given age recipients, so that only their
holders can read the files it hands out; tinker_cookbook.weights.download relies on that to fetch a
training checkpoint (it generates a key, exports to it, downloads and decrypts). grpo does the same:
each file becomes ``<name>.age``, encrypted to every recipient, with the ``pyrage`` package (the
library the cookbook itself decrypts with), imported only when a recipient is given.
"""

from __future__ import annotations

from pathlib import Path

AGE_SUFFIX = ".age"


def encrypt_dir(folder: Path, recipients: list[str]) -> None:
    """Replace every file under ``folder`` by its age-encrypted ``<name>.age``."""
    try:
        import pyrage
    except ImportError:
        raise ValueError("age_encryption_recipients needs the 'pyrage' package (pip install pyrage); "
                         "or leave it None for plain files") from None
    keys = []
    for recipient in recipients:
        try:
            keys.append(pyrage.x25519.Recipient.from_str(str(recipient)))
        except pyrage.RecipientError as err:
            raise ValueError(f"age_encryption_recipients: {recipient!r} is not an age X25519 public key "
                             f"(age1...): {err}") from None
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(file), str(file) + AGE_SUFFIX, keys)
        file.unlink()
