"""deploy/'s Mosquitto configuration, ACL and provisioning script, exercised on a real Mosquitto.

The broker runs with deploy/mosquitto/fedper.conf as shipped, only its ports and file paths
pointed at this test's temporary folder, over TLS with a CA made here by openssl. The real
coordinator and agent run through it too, while another device tries to take over their sessions.
"""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from conftest import MOSQUITTO
from helpers.processes import Processes, agent_args, coordinator_args, finish, write_device_data

from fedper.ports import free_port

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed (apt-get install mosquitto)"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed"),
]
FLEET = "fedper/v1/lab"


def make_tls(folder: Path) -> None:
    """A CA and a server certificate for 127.0.0.1, as an operator would make them."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-days", "2", "-subj", "/CN=fedper-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", *key, "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.crt")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy")
    make_tls(folder)
    passwords = {}
    for user in ("coordinator", "dev-a", "dev-b", "dev-c"):
        out = subprocess.run([str(DEPLOY / "provision-device.sh"), user, str(folder / "passwd")],
                             check=True, capture_output=True, text=True).stdout
        passwords[user] = dict(line.split("=", 1) for line in out.split())["FEDPER_PASSWORD"]
    shutil.copy(DEPLOY / "mosquitto" / "acl", folder / "acl")
    port = free_port()
    conf = []
    for line in (DEPLOY / "mosquitto" / "fedper.conf").read_text().splitlines():
        key = line.split(" ", 1)[0]
        if key in ("password_file", "acl_file", "cafile", "certfile", "keyfile"):
            line = f"{key} {folder / Path(line.split(' ', 1)[1]).name}"
        elif key == "listener":
            line = f"listener {port} 127.0.0.1"
        elif key in ("persistence", "persistence_location"):
            continue
        conf.append(line)
    conf.append(f"user {getpass.getuser()}")  # as root, Mosquitto would drop to `mosquitto` and lose the files
    conf.append(f"log_dest file {folder / 'mosquitto.log'}")  # a pipe nobody reads would block it
    (folder / "mosquitto.conf").write_text("\n".join(conf) + "\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(folder / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"mosquitto exited: {proc.stderr.read().decode()}")
            time.sleep(0.05)
    yield {"port": port, "ca": folder / "ca.crt", "passwords": passwords, "log": folder / "mosquitto.log"}
    proc.kill()
    proc.wait()


def connect(broker, user: str | None, password: str | None = None, ca: Path | None = None, client_id: str = "",
            will: tuple[str, bytes] | None = None):
    """Connected client and its inbox, or the CONNACK failure / TLS exception."""
    client_id = client_id or f"{user or 'anon'}-{time.monotonic_ns()}"
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    inbox: list[tuple[str, bytes]] = []
    client.on_message = lambda _c, _u, msg: inbox.append((msg.topic, msg.payload))
    if user:
        client.username_pw_set(user, password if password is not None else broker["passwords"][user])
    if will:
        client.will_set(*will, qos=1, retain=True)
    client.tls_set(ca_certs=str(ca if ca is not None else broker["ca"]))
    result = {}
    client.on_connect = lambda _c, _u, _f, reason, _p: result.setdefault("rc", reason)
    client.connect("127.0.0.1", broker["port"])
    client.loop_start()
    deadline = time.monotonic() + 5
    while "rc" not in result and time.monotonic() < deadline:
        time.sleep(0.02)
    return client, inbox, result.get("rc")


def settle(inbox: list, count: int, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while len(inbox) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_devices_write_only_their_own_topics(broker) -> None:
    coordinator, coordinator_inbox, rc = connect(broker, "coordinator")
    assert not rc.is_failure
    coordinator.subscribe(f"{FLEET}/update/#", qos=1)
    time.sleep(0.3)
    dev_a, _, _ = connect(broker, "dev-a")
    dev_a.publish(f"{FLEET}/update/dev-a", b"mine", qos=1).wait_for_publish(2)
    dev_a.publish(f"{FLEET}/update/dev-b", b"forged", qos=1).wait_for_publish(2)
    settle(coordinator_inbox, 2)
    assert coordinator_inbox == [(f"{FLEET}/update/dev-a", b"mine")]
    for c in (coordinator, dev_a):
        c.loop_stop()
        c.disconnect()


def test_devices_read_only_what_is_meant_for_them(broker) -> None:
    coordinator, _, _ = connect(broker, "coordinator")
    dev_b, b_inbox, _ = connect(broker, "dev-b")
    dev_b.subscribe(f"{FLEET}/#", qos=1)
    time.sleep(0.3)
    dev_a, _, _ = connect(broker, "dev-a")
    dev_a.publish(f"{FLEET}/update/dev-a", b"a's update", qos=1).wait_for_publish(2)
    coordinator.publish(f"{FLEET}/error/dev-a", b"for a", qos=1).wait_for_publish(2)
    coordinator.publish(f"{FLEET}/error/dev-b", b"for b", qos=1).wait_for_publish(2)
    coordinator.publish(f"{FLEET}/round", b"round 1", qos=1).wait_for_publish(2)
    settle(b_inbox, 2)
    time.sleep(0.3)
    assert sorted(b_inbox) == [(f"{FLEET}/error/dev-b", b"for b"), (f"{FLEET}/round", b"round 1")]
    for c in (coordinator, dev_a, dev_b):
        c.loop_stop()
        c.disconnect()


def test_unauthenticated_and_wrong_password_are_refused(broker) -> None:
    for user, password in ((None, None), ("dev-a", "not-the-password"), ("intruder", "x")):
        client, _, rc = connect(broker, user, password)
        assert rc is not None and rc.is_failure, (user, rc)
        client.loop_stop()


def test_tls_client_without_the_ca_fails(broker, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    make_tls(other)
    with pytest.raises(ssl.SSLError):
        connect(broker, "dev-a", ca=other / "ca.crt")


def test_provisioning_rejects_ids_that_are_not_topic_safe(tmp_path) -> None:
    result = subprocess.run([str(DEPLOY / "provision-device.sh"), "dev/+", str(tmp_path / "passwd")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "device id must match" in result.stderr
    assert not (tmp_path / "passwd").exists()


def test_the_broker_opens_only_the_tls_listener(broker) -> None:
    """A listener setting above the `listener` line would make Mosquitto open a default plain
    listener on 1883 (on every interface, without TLS): the shipped file must not."""
    opened = [line for line in broker["log"].read_text().splitlines() if "listen socket on port" in line]
    assert opened and all(line.endswith(f"port {broker['port']}.") for line in opened), opened


def test_a_device_cannot_take_over_another_session_by_its_client_id(broker) -> None:
    """dev-c, logged in with its own password, connects with dev-b's client id, then with the
    coordinator's (the service's `fedper-coordinator-<fleet>`, and its user name): each connection
    is accepted as dev-c's own session (use_username_as_clientid), and dev-b and the coordinator
    stay connected and working, with no last will `offline` published for either."""
    offline_state = (f"{FLEET}/state", b'{"v":1,"status":"offline"}')
    coordinator, coordinator_inbox, rc = connect(broker, "coordinator", client_id="fedper-coordinator-lab",
                                                 will=offline_state)
    assert not rc.is_failure
    dev_b, b_inbox, rc = connect(broker, "dev-b", client_id="dev-b", will=(f"{FLEET}/presence/dev-b", b"offline"))
    try:
        assert not rc.is_failure
        dropped: list[str] = []
        coordinator.on_disconnect = lambda *_: dropped.append("coordinator")
        dev_b.on_disconnect = lambda *_: dropped.append("dev-b")
        coordinator.subscribe(f"{FLEET}/#", qos=1)
        dev_b.subscribe([(f"{FLEET}/error/dev-b", 1), (f"{FLEET}/state", 1)])
        time.sleep(0.3)
        for attempt, stolen_id in enumerate(["dev-b", "fedper-coordinator-lab", "coordinator"] * 2):
            attacker, _, rc = connect(broker, "dev-c", client_id=stolen_id)
            assert rc is not None and not rc.is_failure, (stolen_id, rc)  # the broker let dev-c in, as dev-c
            time.sleep(0.3)
            attacker.disconnect()
            attacker.loop_stop()
            # both victims still connected: each receives what the other publishes now
            to_b = (f"{FLEET}/error/dev-b", f"still here {attempt}".encode())
            to_coordinator = (f"{FLEET}/update/dev-b", f"mine {attempt}".encode())
            coordinator.publish(*to_b, qos=1).wait_for_publish(10)
            dev_b.publish(*to_coordinator, qos=1).wait_for_publish(10)
            arrive(b_inbox, to_b)
            arrive(coordinator_inbox, to_coordinator)
            assert to_b in b_inbox and to_coordinator in coordinator_inbox, (stolen_id, dropped)
        time.sleep(0.3)
        assert dropped == []
        assert coordinator.is_connected() and dev_b.is_connected()
        assert (f"{FLEET}/presence/dev-b", b"offline") not in coordinator_inbox
        assert offline_state not in b_inbox
    finally:
        for c in (coordinator, dev_b):
            c.disconnect()
            c.loop_stop()


def arrive(inbox: list, message: tuple[str, bytes], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while message not in inbox and time.monotonic() < deadline:
        time.sleep(0.02)


def test_coordinator_and_agent_run_through_the_deploy_broker_while_another_device_steals_their_ids(
        broker, tmp_path: Path, tiny_artifacts: Path, processes: Processes) -> None:
    """The real coordinator and a real agent (user name = device id, as deploy/README.md says)
    finish a 2-round run over TLS through the shipped configuration, while dev-c keeps connecting
    with their client ids: neither loses its broker, the coordinator's state never says
    `offline`, and both of the agent's updates are folded."""
    url, ca = f"mqtts://127.0.0.1:{broker['port']}", str(broker["ca"])
    pw = broker["passwords"]
    state_dir = tmp_path / "coordinator"
    coordinator = processes.start("coordinator", *coordinator_args(
        tiny_artifacts, url, state_dir, "lab", 2, 1, 60, "--username", "coordinator", "--password",
        pw["coordinator"], "--tls-ca", ca))
    data = write_device_data(tmp_path / "a.npz", (0, 1), 40)
    agent = processes.start("dev-a", *agent_args(tiny_artifacts, data, url, "lab", "dev-a", tmp_path / "dev-a",
                                                "--username", "dev-a", "--password", pw["dev-a"], "--tls-ca", ca))
    observer, states_seen, _ = connect(broker, "dev-b")
    observer.subscribe(f"{FLEET}/state", qos=1)
    thefts = 0
    while coordinator.poll() is None and thefts < 200:
        for stolen_id in ("dev-a", "fedper-coordinator-lab", "coordinator"):
            attacker, _, rc = connect(broker, "dev-c", client_id=stolen_id)
            assert rc is not None and not rc.is_failure, (stolen_id, rc)
            attacker.disconnect()
            attacker.loop_stop()
            thefts += 1
        time.sleep(0.2)
    assert finish(coordinator, 120, "the coordinator", processes.log("coordinator")) == 0, processes.log("coordinator")
    assert finish(agent, 30, "the agent", processes.log("dev-a")) == 0, processes.log("dev-a")
    observer.disconnect()
    observer.loop_stop()
    assert thefts >= 3
    states = [json.loads(payload) for _, payload in states_seen if payload]
    assert states and all(s["status"] != "offline" for s in states)
    assert states[-1]["status"] == "finished"
    for name in ("coordinator", "dev-a"):
        assert "lost the broker" not in processes.log(name), processes.log(name)
    records = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in records] == [1, 1]
