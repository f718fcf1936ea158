"""What the callback checks and opens before it reads a message: WeCom's `msg_signature`
and its AES encryption, as the developer documentation describes them ("加解密方案说明";
the `WXBizMsgCrypt` libraries WeCom ships do the same).

- Signature: `msg_signature` is the hex SHA-1 of the callback Token, the query's
  `timestamp` and `nonce`, and the encrypted text (the GET's `echostr`, the POST's
  `<Encrypt>`), sorted as strings and joined without a separator.
- Encryption: the AES key is the base64 of the 43-character EncodingAESKey with `=`
  added (32 bytes); AES-256-CBC with the key's first 16 bytes as the IV, PKCS#7 padding
  to a multiple of 32 bytes. The plaintext is 16 random bytes, the message's length (4
  bytes, network order), the message, and the receiver id: the corp id (`ww...`) for a
  self-built app's callback. A receiver id other than the corp's is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

#: WeCom pads to a multiple of 32 bytes (PKCS#7 with a 32-byte block), not AES's 16.
PAD_BLOCK = 32


class NotDecryptable(ValueError):
    """An encrypted text that the EncodingAESKey does not open, or that was made for
    another corp."""


def aes_key(encoding_aes_key: str) -> bytes:
    """The 32-byte AES key of a 43-character EncodingAESKey; ValueError for another."""
    if len(encoding_aes_key) != 43:
        raise ValueError("an EncodingAESKey is 43 characters")
    try:
        key = base64.b64decode(encoding_aes_key + "=", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an EncodingAESKey is letters and digits") from None
    if len(key) != 32:
        raise ValueError("an EncodingAESKey decodes to 32 bytes")
    return key


def signature(token: str, timestamp: str, nonce: str, encrypted: str) -> str:
    """The `msg_signature` WeCom sends with `encrypted`."""
    return hashlib.sha1("".join(sorted((token, timestamp, nonce, encrypted))).encode()).hexdigest()


def signature_valid(token: str, timestamp: str, nonce: str, encrypted: str, given: str) -> bool:
    """Whether `given` is the signature of `encrypted` (compared in constant time)."""
    wanted = signature(token, timestamp, nonce, encrypted)
    return hmac.compare_digest(wanted.encode(), given.strip().lower().encode("utf-8", "replace"))


def decrypt(encrypted: str, key: bytes, receiver_id: str) -> bytes:
    """The message inside `encrypted`; NotDecryptable when the key does not open it, its
    padding or length is wrong, or it was made for another receiver than `receiver_id`."""
    try:
        raw = base64.b64decode(encrypted, validate=True)
    except (binascii.Error, ValueError):
        raise NotDecryptable("not base64") from None
    if not raw or len(raw) % 16:
        raise NotDecryptable("not a whole number of AES blocks")
    decryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).decryptor()
    plain = decryptor.update(raw) + decryptor.finalize()
    pad = plain[-1]
    if not 1 <= pad <= PAD_BLOCK or plain[-pad:] != bytes([pad]) * pad:
        raise NotDecryptable("bad padding: another EncodingAESKey?")
    plain = plain[:-pad]
    if len(plain) < 20:
        raise NotDecryptable("too short")
    (length,) = struct.unpack(">I", plain[16:20])
    message, receiver = plain[20 : 20 + length], plain[20 + length :]
    if len(message) != length:
        raise NotDecryptable("its length field is past its end")
    if not hmac.compare_digest(receiver, receiver_id.encode()):
        raise NotDecryptable("made for another corp id")
    return message


def encrypt(message: bytes, key: bytes, receiver_id: str) -> str:
    """`message` as WeCom encrypts it for `receiver_id` (for `gateway doctor`'s round
    trip and the channel's own tests)."""
    plain = os.urandom(16) + struct.pack(">I", len(message)) + message + receiver_id.encode()
    pad = PAD_BLOCK - len(plain) % PAD_BLOCK
    plain += bytes([pad]) * pad
    encryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return base64.b64encode(encryptor.update(plain) + encryptor.finalize()).decode()
