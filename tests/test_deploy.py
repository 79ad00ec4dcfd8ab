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
from concurrent.futures import ThreadPoolExecutor
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
    shutil.copy(DEPLOY / "mosquitto" / "acl", folder / "acl")
    # two fleets on one broker: lab (its coordinator, dev-a/b/c) and farm (its coordinator, dev-x/y)
    for *role, user, fleet in (("--coordinator", "coordinator", "lab"), ("dev-a", "lab"), ("dev-b", "lab"),
                               ("dev-c", "lab"), ("--coordinator", "coordinator-farm", "farm"), ("dev-x", "farm"),
                               ("dev-y", "farm")):
        out = subprocess.run([str(DEPLOY / "provision-device.sh"), *role, user, fleet, str(folder / "passwd"),
                              str(folder / "acl")], check=True, capture_output=True, text=True).stdout
        passwords[user] = dict(line.split("=", 1) for line in out.split())["FEDPER_PASSWORD"]
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
    yield {"port": port, "ca": folder / "ca.crt", "passwords": passwords, "log": folder / "mosquitto.log",
           "acl": folder / "acl"}
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
    # Mosquitto delivers to a subscriber in the order it took the messages: once this one is in, so is the forged
    dev_a.publish(f"{FLEET}/update/dev-a", b"after", qos=1).wait_for_publish(2)
    settle(coordinator_inbox, 2)  # a forged one would come before "after": then "after" is not among these
    assert coordinator_inbox == [(f"{FLEET}/update/dev-a", b"mine"), (f"{FLEET}/update/dev-a", b"after")]
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
    # Mosquitto delivers to a subscriber in the order it took the messages: once this one is in, so is the rest
    coordinator.publish(f"{FLEET}/error/dev-b", b"after", qos=1).wait_for_publish(2)
    settle(b_inbox, 3)  # one not meant for dev-b would come before "after": then "after" is not among these
    assert sorted(b_inbox) == [(f"{FLEET}/error/dev-b", b"after"), (f"{FLEET}/error/dev-b", b"for b"),
                               (f"{FLEET}/round", b"round 1")]
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
    files = [str(tmp_path / "passwd"), str(tmp_path / "acl")]
    for args, complaint in ((["dev/+", "lab", *files], "device id must match"),
                            (["dev-a", "lab/#", *files], "fleet must match"), (["dev-a"], "usage")):
        result = subprocess.run([str(DEPLOY / "provision-device.sh"), *args], capture_output=True, text=True)
        assert result.returncode != 0 and complaint in result.stderr, (args, result.stderr)
        assert not (tmp_path / "passwd").exists() and not (tmp_path / "acl").exists()


def test_provisioning_again_replaces_the_block_and_can_move_a_device(tmp_path) -> None:
    """Rotation leaves one block per id (dev-1 is not dev-10's prefix); a move rebinds it to the new fleet."""
    acl = tmp_path / "acl"
    for user, fleet in (("dev-1", "lab"), ("dev-10", "lab"), ("dev-1", "lab"), ("dev-1", "farm")):
        subprocess.run([str(DEPLOY / "provision-device.sh"), user, fleet, str(tmp_path / "passwd"), str(acl)],
                       check=True, capture_output=True)
    text = acl.read_text()
    assert text.count("user dev-1\n") == 1 and text.count("user dev-10\n") == 1
    assert "topic write fedper/v1/farm/update/dev-1\n" in text and "fedper/v1/lab/update/dev-1\n" not in text
    assert "+" not in text and "%" not in text  # no wildcard fleet, no pattern shared by all users


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
        broker, tmp_path: Path, tiny_artifacts: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real coordinator and a real agent (user name = device id, as deploy/README.md says)
    finish a 2-round run over TLS through the shipped configuration, while dev-c keeps connecting
    with their client ids: neither loses its broker, the coordinator's state never says
    `offline`, and both of the agent's updates are folded. Neither has its password on its command
    line (issue 26): the coordinator reads it from a credentials directory, as the unit's LoadCredential
    gives it, the agent from FEDPER_MQTT_PASSWORD_FILE."""
    url, ca = f"mqtts://127.0.0.1:{broker['port']}", str(broker["ca"])
    pw = broker["passwords"]
    state_dir = tmp_path / "coordinator"
    (tmp_path / "credentials").mkdir()
    (tmp_path / "credentials" / "mqtt-password").write_text(pw["coordinator"] + "\n")
    (tmp_path / "dev-a.password").write_text(pw["dev-a"])
    monkeypatch.delenv("FEDPER_MQTT_PASSWORD", raising=False)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "credentials"))
    coordinator = processes.start("coordinator", *coordinator_args(
        tiny_artifacts, url, state_dir, "lab", 2, 1, 60, "--username", "coordinator", "--tls-ca", ca))
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    monkeypatch.setenv("FEDPER_MQTT_PASSWORD_FILE", str(tmp_path / "dev-a.password"))
    data = write_device_data(tmp_path / "a.npz", (0, 1), 40)
    agent = processes.start("dev-a", *agent_args(tiny_artifacts, data, url, "lab", "dev-a", tmp_path / "dev-a",
                                                "--username", "dev-a", "--tls-ca", ca))
    for proc, user in ((coordinator, "coordinator"), (agent, "dev-a")):
        assert pw[user].encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
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


def mosquitto_client(tool: str, broker, user: str, *args: str, seconds: float = 10) -> subprocess.CompletedProcess:
    """mosquitto_pub / mosquitto_sub (third-party clients) logged in as `user` over the broker's TLS."""
    return subprocess.run([tool, "-h", "127.0.0.1", "-p", str(broker["port"]), "--cafile", str(broker["ca"]),
                           "-u", user, "-P", broker["passwords"][user], "-V", "mqttv5", *args],
                          capture_output=True, text=True, timeout=seconds)


def test_fleets_on_one_broker_stay_apart(broker) -> None:
    """Issue 26: with `+` at the fleet level a device of one fleet read another's round and model and
    registered there. Credentials are now bound to a fleet (provision-device.sh writes the ACL): farm's
    devices, with mosquitto_sub on `#` and the lab's topics, get only farm's retained round, state and model
    chunk, and what they publish under lab's topics reaches nobody, while farm's coordinator gets their
    registration; lab's device likewise sees only lab, and each coordinator only its own fleet."""
    fleets = {"lab": "coordinator", "farm": "coordinator-farm"}
    coordinators = {fleet: connect(broker, user) for fleet, user in fleets.items()}
    retained = [f"fedper/v1/{fleet}/{leaf}" for fleet in fleets for leaf in ("round", "state", "model/r1/0")]
    try:
        for fleet, (client, _, rc) in coordinators.items():
            assert not rc.is_failure
            client.subscribe("fedper/v1/#", qos=1)  # a coordinator too gets only its own fleet
            for topic in retained:
                if topic.startswith(f"fedper/v1/{fleet}/"):
                    client.publish(topic, f"{fleet} says".encode(), qos=1, retain=True).wait_for_publish(5)
        listeners = (("dev-x", "farm", "lab"), ("dev-a", "lab", "farm"))

        def listen(listener: tuple[str, str, str]) -> subprocess.CompletedProcess:
            user, _, other = listener
            return mosquitto_client("mosquitto_sub", broker, user, "-F", "%t", "-q", "1", "-W", "2", "-t", "#",
                                    "-t", f"fedper/v1/{other}/#", "-t", f"fedper/v1/{other}/round",
                                    "-t", f"fedper/v1/{other}/model/#", "-t", "fedper/v1/+/state")

        with ThreadPoolExecutor(len(listeners)) as pool:  # each listens 2 s: side by side
            heard_by = list(pool.map(listen, listeners))
        for (_, own, _), heard in zip(listeners, heard_by, strict=True):
            assert "not authori" not in heard.stderr.lower() and "error" not in heard.stderr.lower(), heard.stderr
            topics = set(heard.stdout.splitlines())  # the topics only: earlier tests left binary model chunks
            assert {t for t in retained if t.startswith(f"fedper/v1/{own}/")} <= topics, heard
            assert all(t.startswith(f"fedper/v1/{own}/") for t in topics), heard
        for topic in ("register/dev-y", "presence/dev-y", "update/dev-y", "secagg/dev-y"):
            for fleet in fleets:
                sent = mosquitto_client("mosquitto_pub", broker, "dev-y", "-q", "1", "-t", f"fedper/v1/{fleet}/{topic}",
                                        "-m", f"dev-y to {fleet}")
                assert fleet != "farm" or sent.returncode == 0, sent.stderr
        time.sleep(1.0)  # for what must not arrive: whatever would reach either coordinator has by now
        for fleet, (_, inbox, _) in coordinators.items():
            heard = {topic for topic, _ in inbox}
            assert heard and all(topic.startswith(f"fedper/v1/{fleet}/") for topic in heard), (fleet, heard)
        assert not [m for m in coordinators["lab"][1] if m[1] == b"dev-y to lab"]  # farm's device reached no one
        farm_heard = {(t, p) for t, p in coordinators["farm"][1]}
        assert {(f"fedper/v1/farm/{leaf}", b"dev-y to farm") for leaf in
                ("register/dev-y", "presence/dev-y", "update/dev-y", "secagg/dev-y")} <= farm_heard
    finally:
        for fleet, (client, _, _) in coordinators.items():
            for topic in retained:
                if topic.startswith(f"fedper/v1/{fleet}/"):
                    client.publish(topic, b"", qos=1, retain=True).wait_for_publish(5)
            client.loop_stop()
            client.disconnect()
