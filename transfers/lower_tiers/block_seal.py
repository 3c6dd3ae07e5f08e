"""A tier's deployment secret applied to blocks: a keyed MAC over header and
payload, or AES-256-GCM over the payload with the header as associated data.

A checksum tells an accident from a good block; only a key tells a forgery.
Whoever can write a shared directory or store could otherwise write KV that
every replica serves. With a secret, a block is served only if it was sealed
by a holder of the secret (or of the previous one, during a rotation); one
that fails is `BlockFileError("forged")`, recomputed and counted apart from
corruption.

The MAC is keyed BLAKE3 (the `blake3` package): 2.9 GB/s on one core of this
project's machine at 256 KiB-2 MiB, against 1.45 GB/s for HMAC-SHA-256 with
the CPU's SHA extensions and 0.5 GB/s for keyed BLAKE2b (bench/history/2026-11-28.md).
Encryption is `cryptography`'s AES-GCM (3.2 GB/s at 2 MiB), whose tag
authenticates the same fields, so an encrypted block carries no second MAC.
Each block is encrypted under a key of its own, derived from a random 16-byte
salt the header carries (in the 16 bytes of the tag field GCM leaves free), as
XAES-256-GCM does, with a random 12-byte nonce: two blocks share key and
nonce only if 224 random bits agree, so n blocks under one secret repeat one
with a chance under n^2 / 2^225 (2^-97 at 2^64 blocks), where one key with
random 96-bit nonces reaches NIST's 2^-32 at 2^32 blocks (7.5 hours at 10
GB/s of 64 KiB blocks). Such blocks name the key by an id of their own
(`subkeyed_id`), so a build that predates them counts them foreign, not
forged; blocks encrypted the earlier way (one key per secret) are still read.

Subkeys are derived from the secret with BLAKE3's key derivation, one context
per use, so the MAC key, the cipher key and the chain's naming key never meet.
A block names the key that sealed it by an 8-byte id: a block sealed with a
key this reader does not hold (another deployment, or a fleet mid-rotation)
is "foreign", not "forged".
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvledger.transfers.lower_tiers.block_errors import BlockFileError

SECRET_BYTES_MIN = 16
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 32
GCM_TAG_BYTES = 16
SALT_BYTES = TAG_BYTES - GCM_TAG_BYTES  # an encrypted block's subkey salt, after its GCM tag

_CONTEXT = "kvledger 2026-11 tier secret: "


KEY_MATERIAL_BYTES = 32
STRETCH = {"n": 1 << 15, "r": 8, "p": 1}  # scrypt: about 0.1 s and 32 MiB, once a secret at start
_STRETCH_SALT = b"kvledger 2026-12 tier secret, stretched"


def key_material(text: bytes) -> tuple[bytes, bool]:
    """A secret's text as the key it seals with, and whether it was stretched: 32 random bytes or
    more written as hex or base64 (`openssl rand -hex 32`, `openssl rand -base64 32`) are used as
    they decode; any other text (a passphrase) is stretched once with scrypt, so that each guess
    at it costs a guesser as much (a block's key id, derived from the key, would otherwise let one
    test guesses offline at hash speed)."""
    stripped = text.strip()
    for decode in (_hex, _base64):
        raw = decode(stripped)
        if raw is not None and len(raw) >= KEY_MATERIAL_BYTES:
            return raw, False
    return hashlib.scrypt(text, salt=_STRETCH_SALT, dklen=KEY_MATERIAL_BYTES, maxmem=1 << 26, **STRETCH), True


def _hex(text: bytes) -> bytes | None:
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def _base64(text: bytes) -> bytes | None:
    for alphabet in (None, b"-_"):
        try:
            return base64.b64decode(text, altchars=alphabet, validate=True)
        except (binascii.Error, ValueError):
            continue
    return None


@contextlib.contextmanager
def checked_before_seal(seal: BlockSeal | None, header: bytes | bytearray) -> Iterator[None]:
    """The checks a reader makes before opening a block's seal: with a secret, their failure
    is `unverified`'s."""
    try:
        yield
    except BlockFileError as error:
        if seal is None:
            raise
        raise unverified(error, header) from None


def unverified(error: BlockFileError, header: bytes | bytearray) -> BlockFileError:
    """With a secret, a block at one of its keyed names that fails a check made before its seal
    (a header or payload checksum, a length, a header field) fails to verify: it is counted as
    forged, so a tamperer cannot make a change read as corruption or another block by breaking
    a checksum or a field as well; what failed stays in the detail. Left as they are: a header
    of zeros (a pack's key removed: nothing there), and an I/O error."""
    if error.reason not in ("corrupt", "truncated", "foreign") or not any(header[:64]):
        return error
    return BlockFileError("forged", error.path, f"fails verification before its seal ({error.reason}: "
                          f"{error.detail})")


def derive(secret: bytes, use: str, size: int = 32) -> bytes:
    """A subkey of `secret` for one `use` ("mac", "cipher", "names", "key id")."""
    return blake3.blake3(secret, derive_key_context=_CONTEXT + use).digest(size)


@attrs.frozen
class SealFields:
    """What a sealed header carries besides the plain header's fields."""

    key_id: bytes
    nonce: bytes  # zeros for a MAC-only seal
    tag: bytes  # TAG_BYTES: the MAC, or the GCM tag and zeros
    encrypted: bool


_AAD = struct.Struct("<16sQ?8s12sH")  # namespace, payload bytes, encrypted, key id, nonce, key length


def _associated(namespace: bytes, key: bytes, nbytes: int, key_id: bytes, nonce: bytes, encrypted: bool) -> bytes:
    return _AAD.pack(namespace, nbytes, encrypted, key_id, nonce, len(key)) + key


class _Key:
    """One secret's subkeys."""

    def __init__(self, secret: bytes) -> None:
        self.key_id = derive(secret, "key id", KEY_ID_BYTES)  # MAC-sealed blocks, and those encrypted before
        self.subkeyed_id = derive(secret, "key id, a key per block", KEY_ID_BYTES)  # encrypted, a key per block
        self.mac = derive(secret, "mac")
        self.cipher = algorithms.AES(derive(secret, "cipher"))  # read only: blocks encrypted before 0.3.0
        self._per_block = derive(secret, "cipher, a key per block")

    def block_cipher(self, salt: bytes) -> algorithms.AES:
        """The key of the block whose salt is `salt`."""
        return algorithms.AES(blake3.blake3(salt, key=self._per_block).digest(32))


class BlockSeal:
    """Seals with `secret`; opens what `secret` or `previous` sealed, the latter only
    before `previous_until` (seconds since the epoch, on `clock`), after which a block
    sealed with it counts as forged: whoever leaked it could have made it. Thread-safe:
    each I/O thread keeps its own scratch buffer for decryption."""

    def __init__(self, secret: bytes, *, previous: bytes | None = None, encrypt: bool = False,
                 previous_until: float | None = None, clock: Callable[[], float] = time.time,
                 require_encrypted: bool = False) -> None:
        for name, value in (("secret", secret), ("previous secret", previous)):
            if value is not None and len(value) < SECRET_BYTES_MIN:
                raise ValueError(f"a tier's {name} is {len(value)} bytes; use at least {SECRET_BYTES_MIN} "
                                 f"(for example `openssl rand -hex 32`)")
        self._current = _Key(secret)
        self._keys = {self._current.key_id: self._current, self._current.subkeyed_id: self._current}
        self._retired: dict[bytes, float] = {}  # key id -> when it stops being trusted
        if previous is not None and previous != secret:
            old = _Key(previous)
            for key_id in (old.key_id, old.subkeyed_id):
                self._keys[key_id] = old
                if previous_until is not None:
                    self._retired[key_id] = previous_until
        self._clock = clock
        self.encrypt = encrypt
        self.require_encrypted = require_encrypted  # a block sealed in plaintext is refused ("foreign")
        self._local = threading.local()

    @property
    def key_id(self) -> bytes:
        return self._current.key_id

    def trusted(self) -> dict[str, str]:
        """The key ids blocks are opened under, each with until when (for the start's log)."""
        return {key_id.hex(): (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._retired[key_id]))
                               if key_id in self._retired else "no end")
                for key_id in self._keys}

    def seal(self, namespace: bytes, key: bytes, payload: memoryview, out: memoryview | None = None) -> SealFields:
        """The fields a sealed header carries. Encrypting, the ciphertext goes to
        `out` (the payload's size; it may be the payload itself)."""
        key_ = self._current
        if not self.encrypt:
            nonce = bytes(NONCE_BYTES)
            mac = blake3.blake3(_associated(namespace, key, payload.nbytes, key_.key_id, nonce, False), key=key_.mac)
            mac.update(payload)
            return SealFields(key_.key_id, nonce, mac.digest(TAG_BYTES), False)
        if out is None or out.nbytes != payload.nbytes:
            raise ValueError("an encrypting seal needs `out`, a buffer of the payload's size")
        salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
        encryptor = Cipher(key_.block_cipher(salt), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(
            _associated(namespace, key, payload.nbytes, key_.subkeyed_id, nonce, True))
        _crypt_into(encryptor, payload, out, self._scratch())
        encryptor.finalize()
        return SealFields(key_.subkeyed_id, nonce, encryptor.tag + salt, True)

    def open(self, where: str, namespace: bytes, key: bytes, fields: SealFields, stored: memoryview) -> None:
        """Check a block read into `stored`, decrypting it in place; raise
        `BlockFileError` ("foreign": another key; "forged": a bad tag)."""
        key_ = self._keys.get(fields.key_id)
        if key_ is None:
            raise BlockFileError("foreign", where, f"sealed with key id {fields.key_id.hex()}, which this tier "
                                 f"does not hold (another deployment's secret)")
        until = self._retired.get(fields.key_id)
        if until is not None and self._clock() >= until:
            raise BlockFileError("forged", where, f"sealed with the previous secret (key id {fields.key_id.hex()}), "
                                 "whose rotation has ended (previous_secret_until): no longer trusted")
        if self.require_encrypted and not fields.encrypted:
            raise BlockFileError("foreign", where, "stored in plaintext, where this tier requires encryption "
                                 "(encrypt: \"required\")")
        associated = _associated(namespace, key, stored.nbytes, fields.key_id, fields.nonce, fields.encrypted)
        per_block = fields.key_id == key_.subkeyed_id
        if not fields.encrypted:
            if per_block:
                raise BlockFileError("forged", where, "MAC-sealed under the key id of encrypted blocks")
            mac = blake3.blake3(associated, key=key_.mac)
            mac.update(stored)
            if not hmac.compare_digest(mac.digest(TAG_BYTES), fields.tag):  # in constant time
                raise BlockFileError("forged", where, "the MAC does not match: not written by a holder of the secret")
            return
        if per_block:
            cipher = key_.block_cipher(fields.tag[GCM_TAG_BYTES:])
        elif fields.tag[GCM_TAG_BYTES:] != bytes(SALT_BYTES):
            raise BlockFileError("forged", where, "a malformed GCM tag")
        else:
            cipher = key_.cipher
        decryptor = Cipher(cipher, modes.GCM(fields.nonce, fields.tag[:GCM_TAG_BYTES])).decryptor()
        decryptor.authenticate_additional_data(associated)
        _crypt_into(decryptor, stored, stored, self._scratch())
        try:
            decryptor.finalize()
        except InvalidTag:
            raise BlockFileError("forged", where, "the GCM tag does not match: not written by a holder of the "
                                 "secret") from None

    def _scratch(self) -> memoryview:
        """This thread's buffer for one chunk of cipher output."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = memoryview(bytearray(_CHUNK + 16))
        return scratch


_CHUNK = 1 << 20


def _crypt_into(context, source: memoryview, out: memoryview, scratch: memoryview) -> None:
    """Run `context` over `source` into `out` in chunks through `scratch`, so that
    `out` may be `source` itself (OpenSSL's output needs a block of slack)."""
    for start in range(0, source.nbytes, _CHUNK):
        end = min(start + _CHUNK, source.nbytes)
        done = context.update_into(source[start:end], scratch)
        assert done == end - start, (done, end - start)
        out[start:end] = scratch[:done]
