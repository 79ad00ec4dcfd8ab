"""Secure-aggregation identities as deploy/provision-identity.sh makes them (OpenSSL, no Python): the files load
with fedper.secagg.Identity and sign adverts that a coordinator holding only the root's public key accepts; a
certificate from another root, of another key or tampered is refused at load; bad names and a second root are
refused by the script; a device without an identity takes no part (it says why)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fedper.secagg import CERTIFICATE_FILE, DeviceKeys, Identity, IdentityError, advert_problem, load_root

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "provision-identity.sh"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def provision(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_the_script_makes_identities_the_kernel_loads_and_the_root_verifies(tmp_path: Path) -> None:
    root = tmp_path / "root.key"
    assert provision("--root", root).returncode == 0
    assert provision("--root", root).returncode == 2  # never over an existing root
    assert oct(root.stat().st_mode & 0o777) == "0o600"
    assert provision(root, "jetson-07", "lab", tmp_path / "dev").returncode == 0
    identity = Identity.load(tmp_path / "dev")
    assert (identity.name, identity.fleet) == ("jetson-07", "lab")
    assert oct((tmp_path / "dev" / "identity.pem").stat().st_mode & 0o777) == "0o600"
    advert = DeviceKeys.generate().advert(identity, round=1, session=5)
    coordinator_root = load_root(Path(f"{root}.pub"))
    assert advert_problem(advert, "jetson-07", "lab", coordinator_root) == ""
    assert advert_problem(advert, "jetson-08", "lab", coordinator_root)  # the certificate names the device
    assert advert_problem(advert, "jetson-07", "farm", coordinator_root)  # and the fleet

    other = tmp_path / "other.key"
    provision("--root", other)
    provision(other, "jetson-07", "lab", tmp_path / "foreign")
    shutil.copy(tmp_path / "dev" / "fleet-root.pub", tmp_path / "foreign" / "fleet-root.pub")
    with pytest.raises(IdentityError, match="not signed by the root"):
        Identity.load(tmp_path / "foreign")  # certified by another root than the one it pins
    shutil.copy(tmp_path / "foreign" / "identity.pem", tmp_path / "dev" / "identity.pem")
    with pytest.raises(IdentityError, match="does not certify"):
        Identity.load(tmp_path / "dev")  # another key than the certified one
    cert = json.loads((tmp_path / "foreign" / CERTIFICATE_FILE).read_text())
    (tmp_path / "foreign" / CERTIFICATE_FILE).write_text(json.dumps({**cert, "device": "jetson-08"}))
    with pytest.raises(IdentityError):
        Identity.load(tmp_path / "foreign")
    with pytest.raises(IdentityError, match="cannot read"):
        Identity.load(tmp_path / "missing")


def test_the_script_refuses_names_that_are_not_topic_levels(tmp_path: Path) -> None:
    provision("--root", tmp_path / "root.key")
    for device, fleet in (("a/b", "lab"), ("dev", "l+b"), ("", "lab")):
        result = provision(tmp_path / "root.key", device, fleet, tmp_path / "out")
        assert result.returncode == 2, result.stderr
    assert not (tmp_path / "out").exists()
