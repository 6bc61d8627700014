"""The protocol's cryptography, every primitive from the `cryptography` package.

- key agreement: X25519 (Bonawitz et al. 2017 use Diffie-Hellman over an elliptic curve, KA.agree);
- key derivation: HKDF-SHA256 over the shared point, with a label per use (encryption or mask seed)
  and the round's context, so one agreed point gives independent keys;
- authenticated encryption of the share blobs: AES-256-GCM with a random 96-bit nonce (AE.enc);
- the mask PRG: the AES-256-CTR keystream of a 32-byte seed, read as little-endian uint64 and
  reduced mod R = 2^bits (R divides 2^64, so the reduction of uniform words is exactly uniform)."""
from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32     # an X25519 public or private key, a derived key, a seed
NONCE_BYTES = 12   # AES-GCM nonce
TAG_BYTES = 16     # AES-GCM tag
ENCRYPTION_LABEL = b"fedhop secagg share encryption"
MASK_LABEL = b"fedhop secagg pairwise mask"

_RAW = serialization.Encoding.Raw


def new_private_key() -> X25519PrivateKey:
    """A fresh key from the OS's CSPRNG (never from the run's seed: a seeded key is a known key)."""
    return X25519PrivateKey.generate()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)


def agree(private: X25519PrivateKey, public_raw: bytes, label: bytes, context: bytes) -> bytes:
    """The 32-byte key of one pair for one use: HKDF-SHA256(X25519(private, public), info=label|context).
    Symmetric: agree(a, B) == agree(b, A)."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(public_raw))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=label + b"|" + context).derive(shared)


def random_seed() -> bytes:
    """A self-mask seed b_u: 32 bytes from the OS's CSPRNG."""
    return os.urandom(KEY_BYTES)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """nonce || AES-256-GCM(plaintext) || tag: len(plaintext) + 28 bytes."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, blob: bytes, associated: bytes) -> bytes:
    """The plaintext of `encrypt`'s blob; cryptography.exceptions.InvalidTag for a wrong key or a changed blob."""
    return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], associated)


def prg_words(seed: bytes, count: int) -> np.ndarray:
    """`count` uniform uint64 words: the AES-256-CTR keystream of `seed` (a fresh key per stream,
    so the all-zero counter block is safe)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor()
    stream = encryptor.update(b"\0" * (8 * count)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


def prg_mod(seed: bytes, count: int, bits: int) -> np.ndarray:
    """`count` uniform integers in Z_R, R = 2^bits, as uint64."""
    return prg_words(seed, count) & modulus_mask(bits)


def modulus_mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)
