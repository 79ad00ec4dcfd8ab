"""Issue 26, item 9: no secret on a command line. The units pass no --password; the broker password comes
from a systemd credential or a file (fedper.mqtt.broker_password). tests/test_deploy.py runs the real
coordinator and agent that way through Mosquitto."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedper.mqtt import broker_password, make_client

# the units of fedper commands; fedper-websockify.service only relays bytes and holds no MQTT credential
UNITS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "systemd").glob("fedper-[!w]*.service"))


def exec_start(unit: Path) -> str:
    """The unit's ExecStart, continuation lines joined (as systemd reads it)."""
    text = unit.read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    return line


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_units_pass_no_password_on_the_command_line_and_load_it_as_a_credential(unit: Path) -> None:
    command = exec_start(unit)
    assert "--password" not in command and not re.search(r"PASSWORD|SECRET|TOKEN", command), command
    assert "LoadCredential=mqtt-password:/etc/fedper/mqtt-password" in unit.read_text().splitlines()


def test_the_password_comes_from_the_argument_a_file_or_the_systemd_credential(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDPER_MQTT_PASSWORD_FILE", raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert broker_password(None) is None and broker_password("given") == "given"
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert broker_password(None) is None  # a credentials directory without ours: none
    (credentials / "mqtt-password").write_text("from-systemd\n")
    assert broker_password(None) == "from-systemd"
    (tmp_path / "file").write_text("from-file\nignored\n")
    monkeypatch.setenv("FEDPER_MQTT_PASSWORD_FILE", str(tmp_path / "file"))
    assert broker_password(None) == "from-file" and broker_password("given") == "given"
    client = make_client("dev-a", username="dev-a")
    assert client._password == b"from-file"  # what paho sends in CONNECT
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="empty"):
        broker_password(None)
    monkeypatch.setenv("FEDPER_MQTT_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read"):
        broker_password(None)
