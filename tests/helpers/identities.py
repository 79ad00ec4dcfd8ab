"""Secure-aggregation identities for tests: device identities certified by a test's fleet root, saved in the
layout deploy/provision-identity.sh writes (tests/test_secagg_identity.py checks that the script's files load
the same way), and the root's public key file the coordinator takes."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedper.secagg import Identity


def write_root(path: Path, root: Ed25519PrivateKey) -> Path:
    """The root's public key as PEM (what the coordinator's --secagg-identity-root and each device pin)."""
    path.write_bytes(root.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def write_identity(directory: Path, root: Ed25519PrivateKey, fleet: str, device: str) -> Path:
    """A fresh identity for `device`, certified by `root`, as a device's --identity directory."""
    return Identity.issue(root, fleet, device).save(directory)
