"""Values in the job's store that only holders of the job secret can write.

torch's TCPStore takes no credentials: anyone who reaches its port reads,
writes and lists every key. Most keys only say where to dial (a channel's
endpoints, gloo's addresses), and whoever answers there must still prove the
secret (:mod:`hetpipe.comm.handshake`). A value that *decides* what a rank
does is different: before issue 32, a process that was not a rank wrote the
job's verdict key with status 3 and every rank printed its invented line and
exited 3 within 2.4 s; with status 0, both ranks exited 0 at step 7 of 40
and the launcher waited for ever.

So such a value is sealed: stored as ``{"body": <JSON text>, "mac": <hex>}``
where the MAC is HMAC-SHA256, under a key derived from the job secret for
this purpose alone (HKDF-SHA256, RFC 5869: the handshake's HMACs use the
secret itself, so a value here can never stand for a handshake proof or the
other way round), over the key's name, the job's attempt and the body. A
value copied under another key, or from another attempt of the same job,
fails its seal. What the seal does not stop: someone who reaches the store
can still delete or overwrite keys (gloo's included) and so stop the job -
but only with a line that says so, never with a status or cause of their
choosing; and with a secret reused from job to job, a value recorded in one
job's store could be replayed in another's at the same key and attempt
(hetpipe's own launchers draw a fresh secret per job unless one is set).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

from hetpipe.errors import HetpipeError

_SALT = b"hetpipe job secret"
_PURPOSE = b"hetpipe control-plane store values, version 1"
_LABEL = b"hetpipe sealed store value v1"


class Unsealed(ValueError):
    """A value that is not a sealed value of this job, key and attempt (the message says how)."""


def derive_key(secret: str) -> bytes:
    """The sealing key: HKDF-SHA256 of the job secret, for this purpose only (one 32-byte block)."""
    prk = hmac.new(_SALT, secret.encode(), hashlib.sha256).digest()
    return hmac.new(prk, _PURPOSE + b"\x01", hashlib.sha256).digest()


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class Seal:
    """Seals and opens this job's values for one attempt (``secret``: the job secret)."""

    def __init__(self, secret: str, attempt: int) -> None:
        self._key = derive_key(secret)
        self.attempt = attempt

    def _mac(self, key: str, body: str) -> str:
        message = b"".join(_field(part) for part in (_LABEL, str(self.attempt).encode(), key.encode(),
                                                      body.encode()))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def seal(self, key: str, body: dict[str, Any]) -> str:
        """The stored form of ``body`` under ``key`` (the key's name below the attempt's namespace)."""
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": text, "mac": self._mac(key, text)})

    def open(self, key: str, raw: bytes) -> dict[str, Any]:
        """The body ``raw`` holds if it was sealed by this job for ``key`` and this attempt;
        :class:`Unsealed` otherwise."""
        try:
            outer = json.loads(raw.decode())
            text, mac = outer["body"], outer["mac"]
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            raise Unsealed("it is not a sealed value") from None
        if not isinstance(text, str) or not isinstance(mac, str):
            raise Unsealed("it is not a sealed value")
        if not hmac.compare_digest(mac.encode(), self._mac(key, text).encode()):
            raise Unsealed("its seal does not match the job secret, this key and this attempt")
        try:
            body = json.loads(text)
        except ValueError:
            raise Unsealed("its body is not JSON") from None
        if not isinstance(body, dict):
            raise Unsealed("its body is not an object")
        return body

    def seal_text(self, key: str, text: str) -> str:
        """:meth:`seal` for a value that is text already (a JSON document, a nonce)."""
        return self.seal(key, {"text": text})

    def open_text(self, key: str, raw: bytes) -> str:
        """The text :meth:`seal_text` sealed under ``key``; :class:`Unsealed` otherwise."""
        text = self.open(key, raw).get("text")
        if not isinstance(text, str):
            raise Unsealed("it is not sealed text")
        return text


class ForgedStoreValue(HetpipeError):
    """A value in the job's store that decides what a rank does, not sealed by this job."""

    def __init__(self, what: str, key: str, why: Unsealed) -> None:
        super().__init__(f"{what} ({key}) in the job's store is not this job's: {why}; a process outside the "
                         "job wrote it (anyone who reaches the store's port can), so the job stops rather "
                         "than act on it")
