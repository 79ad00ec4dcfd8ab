"""Secure-aggregation identities for tests: a fleet root key and device identities, written in the layout
deploy/provision-identity.sh writes (identity.pem, identity.cert, fleet-root.pub; tests/test_secagg_identity.py
checks that the script's files load the same way)."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedper.secagg import CERTIFICATE_FILE, IDENTITY_KEY_FILE, ROOT_FILE, Identity


def write_root(path: Path, root: Ed25519PrivateKey) -> Path:
    """The root's public key as PEM (what the coordinator's --secagg-identity-root and each device pin)."""
    path.write_bytes(root.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def write_identity(directory: Path, root: Ed25519PrivateKey, fleet: str, device: str) -> Path:
    """A fresh identity for `device`, certified by `root`, as a device's --identity directory."""
    identity = Identity.issue(root, fleet, device)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / IDENTITY_KEY_FILE).write_bytes(identity.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / CERTIFICATE_FILE).write_bytes(identity.certificate.to_json())
    write_root(directory / ROOT_FILE, root)
    return directory
