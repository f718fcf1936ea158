"""What the webhook mode checks before it reads an event: Feishu's request signature and its
encryption ("Encrypt Key"), as the open platform documents them (docs/feishu.md, "Webhook
mode"; lark-oapi's `EventDispatcherHandler` does the same).

- Signature: ``X-Lark-Signature`` is the hex SHA-256 of ``timestamp + nonce + encrypt_key``
  (the ``X-Lark-Request-Timestamp`` and ``X-Lark-Request-Nonce`` headers) followed by the
  raw body. Feishu signs every event request when an Encrypt Key is set.
- Encryption: the body is ``{"encrypt": "<base64>"}``; the base64 decodes to a 16-byte IV
  and AES-256-CBC ciphertext (PKCS#7 padding) under the key SHA-256(encrypt_key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

TIMESTAMP_HEADER = "X-Lark-Request-Timestamp"
NONCE_HEADER = "X-Lark-Request-Nonce"
SIGNATURE_HEADER = "X-Lark-Signature"


class NotDecryptable(ValueError):
    """An ``encrypt`` value that the Encrypt Key does not open."""


def signature(timestamp: str, nonce: str, encrypt_key: str, body: bytes) -> str:
    """The ``X-Lark-Signature`` Feishu sends with `body`."""
    return hashlib.sha256((timestamp + nonce + encrypt_key).encode() + body).hexdigest()


def signature_valid(timestamp: str, nonce: str, given: str, encrypt_key: str, body: bytes) -> bool:
    """Whether `given` is the body's signature (compared in constant time)."""
    wanted = signature(timestamp, nonce, encrypt_key, body)
    return hmac.compare_digest(wanted.encode(), given.strip().lower().encode())


def decrypt(encrypted: str, encrypt_key: str) -> bytes:
    """The plaintext of an ``encrypt`` value; NotDecryptable when it is not one."""
    try:
        raw = base64.b64decode(encrypted, validate=True)
    except (binascii.Error, ValueError):
        raise NotDecryptable("not base64") from None
    if len(raw) < 32 or len(raw) % 16:
        raise NotDecryptable("not a whole number of AES blocks")
    key = hashlib.sha256(encrypt_key.encode()).digest()
    decryptor = Cipher(algorithms.AES(key), modes.CBC(raw[:16])).decryptor()
    padded = decryptor.update(raw[16:]) + decryptor.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    try:
        return unpadder.update(padded) + unpadder.finalize()
    except ValueError:
        raise NotDecryptable("bad padding: another Encrypt Key?") from None
