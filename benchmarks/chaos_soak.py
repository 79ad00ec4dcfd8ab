"""Chaos soak: scripted devices and real agents through Mosquitto under many faults at once, checked independently.

benchmarks/chaos_check.py proves the invariants from what the parties logged and published.

    python benchmarks/chaos_soak.py [--minutes 30] [--calm-minutes M] [--modes sync,async,dp,secure] [--devices 24]
                                    [--out runs/chaos] [--quick]

Each mode runs twice: without faults (--calm-minutes, by default as long), then under the nemesis, which at random
intervals (a few seconds) and together: kills the coordinator with SIGKILL and restarts it on the same
state directory (after each kill every state file must still read); restarts the broker (no persistence:
the devices re-register); kills a process of 4 devices with SIGKILL (often mid-upload) and starts it
again; steps the coordinator's wall clock by up to a minute either way (libfaketime, when installed);
makes ~20 % of the devices leave and rejoin, some of them dropping their socket halfway through an
upload; and every seventh device talks through its own TCP proxy, which at times holds every byte for
3-12 s or resets its connections. Each fault is a line of faults.jsonl with its time.

Most devices are scripted (fleet_scale.py's minimal MQTT client) on a real export, MobileNet-v1 at width
1/16: invited, a device sends the export's base + 0.01 N(0, 1) for the shared layers, seeded by (device,
round), and first writes its own copy of it (a safetensors file per update, with n_samples and round in its
metadata) under sent/; its head tensor, which must never leave it, goes to heads/. A few are real agents
(`fedper-agent` processes on real digits and that export, --keep-updates: each keeps its own copy of every
round's update in its state directory, agents/<name>/updates/); the nemesis kills them with SIGKILL too
(every state file of theirs must read afterwards), and half of them talk through a cut-prone proxy. A capture
client subscribed to `#` writes every message it sees to capture.bin (reconnecting after each broker restart).

Modes (AGENTS: the real agents of each): sync (rounds with selection), async (FedBuff versions, K = 4 of 8
training) and dp (sync rounds with central DP, z = 0.01 so that the checker sees each update above the noise),
each with 2 real agents among the scripted devices; secure (--secure-aggregation: SecAgg+ is the agents'
protocol, so the fleet is 6 real agents and no scripted device). The quick form runs its two modes side by side;
its async has no agent: it runs on a hand-made export of 4,096 zeros while the real export is made (about 20 s
on a loaded machine)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fleet_scale
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_scale import MiniMqtt, manifest_of, start_mosquitto
from helpers.identities import write_identity, write_root  # fleet_scale put tests/ on the path
from helpers.processes import CLASSES, agent_args, write_device_data
from helpers.toy_export import write_toy_export
from safetensors.numpy import save_file

from fedper.artifacts import BASE_FILE
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared
from fedper.ports import free_port
from fedper.wire import Invitation, Register, RoundInfo, Topics, UpdateMeta, chunk

FLEET = "chaos"
TOPICS = Topics(FLEET)
QUICK_FLOATS = 4096  # the quick form's async runs on a hand-made export of this size, zeros, and without agents
# The quick form's nemesis seed: its first four faults are a broker restart, a device group's and (sync) an agent's
# SIGKILL or (async) a clock jump, and a coordinator SIGKILL, all within 30 s (the full soak's seed drew no broker
# restart there: sync killed an agent and the coordinator twice, async the coordinator four times)
NEMESIS, QUICK_NEMESIS = "nemesis", "quick2379"
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"  # Debian's faketime (make faketime)
GROUP = 4  # scripted devices per process: a SIGKILL takes a group
CHUNK = 4096  # several chunks per update, so an upload can break halfway
SYNC = ("--clients-per-round", "6", "--over-select", "1.3", "--min-clients", "3", "--round-timeout", "4")
SECURE_CLIP = 20.0  # --clip-norm under secure aggregation (recorded in soak.json for the checker)
MODES = {  # the coordinator's options per mode
    "sync": SYNC,
    "async": ("--mode", "async", "--clients-per-round", "8", "--buffer-size", "4", "--max-staleness", "6",
              "--round-timeout", "4"),
    # z small on purpose: the checker must see each update's clipped delta (at most C / m) above the noise (z C / m);
    # an agent's delta is about 1 (its scaled share 2 noise_std at z = 0.1, too close to the noise to be told apart)
    "dp": (*SYNC, "--clip-norm", "5", "--dp-noise-multiplier", "0.01"),
    # a fleet of 6 halves its suspects into groups of 3: --secagg-min-group 4 could never split it
    "secure": ("--clients-per-round", "6", "--min-clients", "3", "--round-timeout", "10", "--secure-aggregation",
               "--clip-norm", str(SECURE_CLIP), "--secagg-stage-timeout", "3", "--secagg-min-group", "2"),
}
AGENTS = {"sync": 2, "async": 2, "dp": 2, "secure": 6}  # real fedper-agent processes per mode, beside the scripted
AGENT_WIDTH = 0.0625  # MobileNet-v1 at its narrowest (every layer at 8 channels): 18,264 shared floats
SCRIPTED_SPREAD = 0.01  # a scripted update is the export's base + this x N(0, 1): a model the agents can still train


def update_of(manifest: Manifest, device: str, round_: int, base: dict[str, np.ndarray]
              ) -> tuple[int, dict[str, np.ndarray]]:
    """What `device` sends for `round_`: (n_samples, shared tensors), the same on every resend: the export's `base`
    + SCRIPTED_SPREAD x N(0, 1) (a model the real agents can still train)."""
    index = int(device.removeprefix("dev-"))
    rng = np.random.default_rng([index, round_])
    spread = np.float32(SCRIPTED_SPREAD)
    return samples_of(index), {t.name: base[t.name] + spread * rng.normal(size=t.shape).astype(np.float32)
                               for t in manifest.shared_tensors}


def samples_of(index: int) -> int:
    """A device's n_samples (registered, and claimed by each of its updates)."""
    return 1 + index % 4


def save_atomic(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A device killed with SIGKILL leaves its copy whole or absent (written aside, then renamed)."""
    aside = path.with_name(path.name + ".part")
    save_file(tensors, str(aside), metadata=metadata)
    os.replace(aside, path)


def log_fault(path: Path, kind: str, **detail: Any) -> None:
    """One line per fault; O_APPEND keeps the devices' and the nemesis' lines whole."""
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "kind": kind, **detail}) + "\n")


# ------------------------------------------------------------ the scripted devices


class Blackhole:
    """A device's own TCP proxy to the broker: cut() holds every byte both ways for a while, the sockets
    staying open, as a network that drops packets would (then TCP delivers what was held)."""

    def __init__(self, port: int) -> None:
        self.port, self.cut_until = port, 0.0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None

    async def start(self, listen: int = 0) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", listen)
        return self.server.sockets[0].getsockname()[1]

    def cut(self, seconds: float) -> None:
        self.cut_until = time.monotonic() + seconds

    def close(self) -> None:
        """The network goes at once: both sides of every proxied connection reset."""
        for writer in list(self.writers):
            writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                while time.monotonic() < self.cut_until:
                    await asyncio.sleep(0.1)
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        with contextlib.suppress(asyncio.CancelledError):  # the fleet's loop ends: nothing to report
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        self.writers -= {writer, up_writer}


async def device_life(index: int, port: int, out: Path, faulty: bool, base: dict[str, np.ndarray],
                      stop: asyncio.Event) -> None:
    """Connect, register, answer invitations; reconnect after the broker goes; leave and rejoin at times;
    some devices (every seventh) talk through a proxy whose network the nemesis cuts for 3-12 s at times."""
    if faulty and index % 7 == 3:
        proxy = Blackhole(port)
        port = await proxy.start()
        asyncio.create_task(cut_network(proxy, out, f"dev-{index:03d}", stop))  # noqa: RUF006 (lives as long)
    manifest, name = Manifest.load(out / "export"), f"dev-{index:03d}"
    head = {t.name: np.random.default_rng(index).normal(size=t.shape).astype(np.float32)
            for t in manifest.tensors if not t.shared}
    save_atomic(head, out / "heads" / f"{name}.safetensors")
    rng = random.Random(index)
    while not stop.is_set():
        left = await connection(Device(index, name, manifest, out, faulty, rng, base), port, stop)
        if not stop.is_set():
            await asyncio.sleep(rng.uniform(0.5, 3.0) if left else 0.3)


async def cut_network(proxy: Blackhole, out: Path, name: str, stop: asyncio.Event) -> None:
    rng = random.Random(name)
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(10, 30))
        if rng.random() < 0.5:
            seconds = rng.uniform(3, 12)
            log_fault(out / "faults.jsonl", "network_cut", device=name, seconds=round(seconds, 1))
            proxy.cut(seconds)
        else:
            log_fault(out / "faults.jsonl", "network_reset", device=name)
            proxy.close()


@dataclass
class Device:
    index: int
    name: str
    manifest: Manifest
    out: Path
    faulty: bool
    rng: random.Random
    base: dict[str, np.ndarray]  # the export's base, which scripted updates stay near
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


async def connection(device: Device, port: int, stop: asyncio.Event) -> bool:
    """One connection of a device, until the broker goes or the device leaves (then True)."""
    name, manifest, rng = device.name, device.manifest, device.rng
    state = {"open": 0, "invited": 0, "answered": 0}
    gone = asyncio.Event()
    client = MiniMqtt(name)

    async def answer(round_: int) -> None:
        await asyncio.sleep(rng.uniform(0.1, 1.0))
        n, tensors = update_of(manifest, name, round_, device.base)
        path = device.out / "sent" / f"{name}-r{round_}-{time.time_ns()}.safetensors"
        save_atomic(tensors, path, {"n_samples": str(n), "round": str(round_), "device": name})
        frames = chunk(encode_shared(manifest, tensors), CHUNK, f"r{round_}-{name}",
                       UpdateMeta(round_, n, manifest.base_digest, {}).to_dict())
        cut = device.faulty and rng.random() < 0.1
        for i, frame in enumerate(frames):
            if cut and i == len(frames) // 2:
                log_fault(device.out / "faults.jsonl", "device_drop_mid_upload", device=name, round=round_)
                client.abort()
                gone.set()
                return
            _quiet(client.publish(TOPICS.update(name), frame))

    def on_message(topic: str, payload: bytes) -> None:
        if not payload:
            return
        if topic == TOPICS.round:
            info = RoundInfo.decode(payload)
            state["open"] = info.round if info.state == "open" else 0
        elif "/invite/" in topic:
            state["invited"] = Invitation.decode(payload).round
        else:
            return
        if state["invited"] == state["open"] > state["answered"]:
            state["answered"] = state["open"]
            task = asyncio.create_task(answer(state["open"]))
            device.tasks.add(task)
            task.add_done_callback(device.tasks.discard)

    client.on_message = on_message
    try:
        await client.connect("127.0.0.1", port, will=(TOPICS.presence(name), b"offline"))
        await client.subscribe([TOPICS.round, TOPICS.invite(name), TOPICS.error(name)])
        register = Register(samples_of(device.index), manifest.base_digest, "chaos/1").encode()
        _quiet(client.publish(TOPICS.register(name), register, retain=True))
        _quiet(client.publish(TOPICS.presence(name), b"online", retain=True))
    except (OSError, ConnectionError, asyncio.IncompleteReadError):
        await asyncio.sleep(0.5)
        return False
    leaves = device.faulty and device.index % 5 == 0  # a fifth of the fleet leaves and rejoins
    leave_at = time.monotonic() + rng.uniform(5, 30) if leaves else float("inf")
    try:
        while not (stop.is_set() or client.closed.is_set() or gone.is_set()):
            await asyncio.sleep(0.2)
            if time.monotonic() > leave_at:
                log_fault(device.out / "faults.jsonl", "device_leave", device=name)
                return True
        return False
    finally:
        client.abort()


def _quiet(ack: asyncio.Future[None] | None) -> None:
    """A PUBACK nobody awaits: a lost connection is the soak's business, not an unretrieved exception."""
    if ack is not None:
        ack.add_done_callback(lambda f: f.cancelled() or f.exception())


def devices_main(indices: list[int], port: int, out: str, faulty: bool) -> None:
    """One process for a group of scripted devices (so that SIGKILL takes a few at once); SIGTERM ends it."""
    export = Path(out) / "export"
    base = decode_shared(Manifest.load(export), (export / BASE_FILE).read_bytes())

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await asyncio.gather(*(device_life(i, port, Path(out), faulty, base, stop) for i in indices))

    asyncio.run(run())


# ------------------------------------------------------------ the real agents


def export_for_agents(folder: str) -> None:
    """The real export every mode runs on and the agents train (fedper-export's code), made once per soak (in a
    process of its own) and copied into each run."""
    if not (Path(folder) / "manifest.json").exists():
        from fedper.export.exporter import export_artifacts

        export_artifacts(Path(folder), model="mobilenet_v1", kp=1, num_classes=len(CLASSES), input_size=32,
                         width=AGENT_WIDTH, classes=CLASSES)


def prepare_agents(out: Path, count: int, secure: bool) -> list[str]:
    """Each agent's real digits (two classes, 20 images: 16 train) and, under secure aggregation, its identity
    certified by the run's fleet root (whose public key the coordinator gets: out/fleet-root.pub)."""
    names = [f"agent-{j}" for j in range(count)]
    (out / "agents").mkdir(parents=True, exist_ok=True)
    root = Ed25519PrivateKey.generate()
    write_root(out / "fleet-root.pub", root)
    for j, name in enumerate(names):
        write_device_data(out / "agents" / f"{name}.npz", (j % 4, (j + 1) % 4), 20)
        if secure:
            write_identity(out / "agents" / f"{name}-identity", root, FLEET, name)
    return names


def start_agent(out: Path, name: str, port: int, secure: bool) -> subprocess.Popen[bytes]:
    """`fedper-agent` on the run's export, resuming from its state directory; its log in agents/<name>.log."""
    agents = out / "agents"
    extra = ["--secure-aggregation", "--identity", str(agents / f"{name}-identity")] if secure else []
    with open(agents / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, *agent_args(out / "export", agents / f"{name}.npz", f"mqtt://127.0.0.1:{port}", FLEET,
                                         name, agents / name, "--backend", "ort", "--chunk-size", str(4 * CHUNK),
                                         "--reconnect-spread", "2", "--keep-updates", *extra)],
            stdout=log, stderr=subprocess.STDOUT)


def wait_connected(out: Path, names: list[str], timeout: float = 120.0) -> None:
    """Until every agent's log says it connected to the broker, or `timeout` seconds (said, and the run goes on)."""
    deadline = time.monotonic() + timeout
    while not all("\nconnected\n" in (out / "agents" / f"{name}.log").read_text(errors="replace") for name in names):
        if time.monotonic() > deadline:
            print(f"the agents did not all connect within {timeout:.0f} s (see {out / 'agents'}/*.log): going on")
            return
        time.sleep(0.5)


def proxies_main(agents: list[tuple[str, int]], port: int, out: str) -> None:
    """The networks of some agents: for each (name, port it connects to), a Blackhole proxy to the broker on that
    port, held or reset at times."""
    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        for name, listen in agents:
            proxy = Blackhole(port)
            await proxy.start(listen)
            asyncio.create_task(cut_network(proxy, Path(out), name, stop))  # noqa: RUF006 (lives as long)
        await stop.wait()

    asyncio.run(run())


# ------------------------------------------------------------ the capture client


def capture_main(port: int, out: str) -> None:
    """Every message on `#` as (length-prefixed topic, payload) records in capture.bin, reconnecting."""
    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        with open(Path(out) / "capture.bin", "ab") as sink:
            def on_message(topic: str, payload: bytes) -> None:
                raw = topic.encode()
                sink.write(struct.pack("!HI", len(raw), len(payload)) + raw + payload)
                sink.flush()

            while not stop.is_set():
                client = MiniMqtt("chaos-capture", on_message)
                try:
                    await client.connect("127.0.0.1", port)
                    await client.subscribe(["#"])
                except (OSError, ConnectionError, asyncio.IncompleteReadError):
                    await asyncio.sleep(0.2)
                    continue
                while not (stop.is_set() or client.closed.is_set()):
                    await asyncio.sleep(0.1)
                client.abort()

    asyncio.run(run())


# ------------------------------------------------------------ the coordinator and the nemesis


def start_coordinator(out: Path, port: int, mode_args: tuple[str, ...], clock: bool) -> subprocess.Popen[bytes]:
    """The coordinator's process; with `clock`, under libfaketime, its wall clock offset by what out/clock says
    (read at every call: FAKETIME_NO_CACHE), its monotonic clock left alone, as an NTP step would."""
    log = open(out / "coordinator.log", "ab")  # noqa: SIM115 (the child holds it)
    env, launch = dict(os.environ), ["-m", "fedper.coordinator.cli"]
    if clock:  # libfaketime 0.9.10 fails clock_nanosleep (time.sleep: EINVAL, paho's reconnect wait) when only
        # the wall clock is faked; select's relative timeout is unaffected, so time.sleep waits in select here
        launch = ["-c", "import select, sys, time; time.sleep = lambda s: select.select([], [], [], s) and None; "
                  "from fedper.coordinator.cli import main; sys.exit(main())"]
        env |= {"LD_PRELOAD": FAKETIME, "FAKETIME_TIMESTAMP_FILE": str(out / "clock"), "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_FORCE_MONOTONIC_FIX": "1"}
    return subprocess.Popen(
        [sys.executable, *launch, "--artifacts", str(out / "export"), "--fleet", FLEET,
         "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", "100000", "--state-dir", str(out / "state"),
         "--chunk-size", str(CHUNK), *mode_args], stdout=log, stderr=subprocess.STDOUT, env=env)


def state_readable(state_dir: Path) -> list[str]:
    """Problems with a state directory right after a kill: every JSON must parse, every tensor file load, every
    ONNX model parse (the agents' personal.onnx), in it and its subfolders."""
    import onnx
    from safetensors.numpy import load_file

    problems = []
    for path in sorted(p for p in state_dir.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".jsonl":
                lines = path.read_text().splitlines()
                for line in lines:
                    json.loads(line)
            elif path.suffix == ".safetensors":
                load_file(str(path))
            elif path.suffix == ".onnx":
                onnx.load_model(str(path), load_external_data=False)
        except Exception as error:  # any failure to read is the finding
            problems.append(f"{path.relative_to(state_dir.parent)}: {type(error).__name__}: {error}")
    return problems


def uploading(out: Path, names: list[str]) -> list[str]:
    """Those of `names` that wrote their copy of an update within the last second: likely mid-upload."""
    recent = time.time() - 1.0
    copies = [*(out / "sent").glob("*.safetensors"), *(out / "agents").glob("*/updates/*.safetensors")]
    return sorted({name for p in copies for name in names
                   if (p.parent.parent.name == name or p.name.startswith(f"{name}-r")) and p.stat().st_mtime > recent})


def spawn(target: str, *args: Any) -> subprocess.Popen[bytes]:
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import chaos_soak; chaos_soak.{target}(*{args!r})"
    return subprocess.Popen([sys.executable, "-c", code])


def run_mode(mode: str, seconds: float, devices: int, out: Path, faulty: bool, export: Path | None,
             agent_count: int, wait_for_agents: bool = True, nemesis: str = NEMESIS) -> dict[str, Any]:
    """One run of `mode` for `seconds` with `agent_count` real agents; returns what the nemesis did. Everything else
    is on disk under `out`. `export`: the real export (export_for_agents), copied into the run, or None for a
    hand-made one of QUICK_FLOATS zeros (no agents); `wait_for_agents`: the run's time starts once the agents are
    connected (else they join when they are up); `nemesis`: the seed of its draws, with the mode's name."""
    for sub in ("sent", "heads", "state"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    secure = mode == "secure"
    devices = 0 if secure else devices  # scripted devices do not speak SecAgg+
    if export is None:
        manifest = manifest_of(QUICK_FLOATS)
        write_toy_export(out / "export", manifest, {t.name: np.zeros(t.shape, np.float32) for t in manifest.tensors
                                                     if t.shared})
    else:
        shutil.copytree(export, out / "export", dirs_exist_ok=True)
    mode_args = (*MODES[mode], "--secagg-identity-root", str(out / "fleet-root.pub")) if secure else MODES[mode]
    agents = prepare_agents(out, agent_count, secure)
    port = free_port()
    broker = start_mosquitto(out, port)
    capture = spawn("capture_main", port, str(out))
    groups = [list(range(i, min(i + GROUP, devices))) for i in range(0, devices, GROUP)]
    fleet = [spawn("devices_main", group, port, str(out), faulty) for group in groups]
    agent_ports = {name: free_port() if faulty and j % 2 == 0 else port for j, name in enumerate(agents)}
    proxied = [(name, p) for name, p in agent_ports.items() if p != port]
    proxies = [spawn("proxies_main", proxied, port, str(out))] if proxied else []
    agent_procs = {name: start_agent(out, name, agent_ports[name], secure) for name in agents}
    if wait_for_agents:  # an agent takes 10-30 s to start here (onnxruntime imports torch): the run starts with it
        wait_connected(out, agents)
    clock = faulty and Path(FAKETIME).exists()
    if faulty and not clock:
        print(f"no clock jumps: {FAKETIME} missing (make faketime, or apt-get install faketime)")
    (out / "clock").write_text("+0\n")
    coordinator = start_coordinator(out, port, mode_args, clock)
    faults_path, rng = out / "faults.jsonl", random.Random(f"{nemesis}-{mode}")
    counts: dict[str, int] = {}
    unreadable: list[str] = []
    crashes: list[str] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(3.0, 10.0) if faulty else 1.0)
            if coordinator.poll() is not None:  # it died without the nemesis: a finding
                crashes.append(f"coordinator exited {coordinator.returncode} on its own")
                log_fault(faults_path, "coordinator_crash", code=coordinator.returncode)
                coordinator = start_coordinator(out, port, mode_args, clock)
            for name, proc in agent_procs.items():
                if proc.poll() is not None:  # an agent that stops on its own: a finding too
                    crashes.append(f"{name} exited {proc.returncode} on its own")
                    log_fault(faults_path, "agent_crash", device=name, code=proc.returncode)
                    agent_procs[name] = start_agent(out, name, agent_ports[name], secure)
            if not faulty:
                continue
            kind = rng.choices(["coordinator_kill", "broker_restart", "devices_kill9", "agent_kill9", "clock_jump"],
                               [3, 2, 1 if groups else 0, 2 if agents else 0, 1 if clock else 0])[0]
            counts[kind] = counts.get(kind, 0) + 1
            log_fault(faults_path, kind)
            if kind == "coordinator_kill":
                coordinator.send_signal(signal.SIGKILL)
                coordinator.wait()
                unreadable += state_readable(out / "state")
                time.sleep(rng.uniform(0.0, 1.0))
                coordinator = start_coordinator(out, port, mode_args, clock)
            elif kind == "clock_jump":  # the new offset from true time: forward or back by up to a minute
                offset = rng.randint(-60, 60)
                (out / "clock").write_text(f"{offset:+d}s\n")
                log_fault(faults_path, "clock_offset", seconds=offset)
            elif kind == "devices_kill9":
                g = rng.randrange(len(groups))
                fleet[g].send_signal(signal.SIGKILL)
                fleet[g].wait()
                log_fault(faults_path, "devices_killed", devices=groups[g],
                          uploading=uploading(out, [f"dev-{i:03d}" for i in groups[g]]))
                time.sleep(rng.uniform(0.5, 2.0))
                fleet[g] = spawn("devices_main", groups[g], port, str(out), faulty)
            elif kind == "agent_kill9":
                name = rng.choice(agents)
                agent_procs[name].send_signal(signal.SIGKILL)
                agent_procs[name].wait()
                log_fault(faults_path, "devices_killed", devices=[name], uploading=uploading(out, [name]))
                unreadable += state_readable(out / "agents" / name)
                time.sleep(rng.uniform(0.5, 2.0))
                agent_procs[name] = start_agent(out, name, agent_ports[name], secure)
            else:
                broker.terminate()
                broker.wait(10)
                time.sleep(rng.uniform(0.2, 1.5))
                broker = fleet_scale.start_broker(out / "mosquitto.conf", port)
    finally:
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        unreadable += state_readable(out / "state")
        for proc in agent_procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for name in agents:
            unreadable += state_readable(out / "agents" / name)
        for proc in (*fleet, *proxies, capture):
            proc.terminate()
            proc.wait(20)
        broker.terminate()
        broker.wait(10)
    for line in faults_path.read_text().splitlines() if faults_path.exists() else []:
        fault = json.loads(line)
        kind = fault["kind"]
        if kind.startswith("device_") or kind in ("coordinator_crash", "agent_crash", "network_cut", "network_reset"):
            counts[kind] = counts.get(kind, 0) + 1
        if kind == "devices_killed":
            counts["devices_killed_mid_upload"] = counts.get("devices_killed_mid_upload", 0) + len(fault["uploading"])
    summary = {"mode": mode, "seconds": seconds, "faulty": faulty, "faults": counts, "unreadable_state": unreadable,
               "crashes": crashes, "agents": agents, "clip_norm": SECURE_CLIP if secure else None}
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="run time per mode under faults (default 30)")
    parser.add_argument("--calm-minutes", type=float, default=None,
                        help="run time per mode without faults, the progress baseline (default: --minutes)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes among {', '.join(MODES)} "
                        "(default: all)")
    parser.add_argument("--devices", type=int, default=24, help="scripted devices (default 24; the real agents, "
                        f"{', '.join(f'{n} in {m}' for m, n in AGENTS.items())}, come on top; secure has none)")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"), help="folder for logs, captures, results")
    parser.add_argument("--quick", action="store_true",
                        help="async and sync side by side, 15 s calm + 30 s under faults each, 12 devices, the "
                             "agents joining when they are up; async scripted only, on a hand-made export of 4,096 "
                             "floats, while the real export is made (make test's form)")
    args = parser.parse_args()
    minutes, devices, modes = (0.5, 12, ["async", "sync"]) if args.quick else (args.minutes, args.devices,
                                                                       args.modes.split(","))
    calm_minutes = 0.25 if args.quick else minutes if args.calm_minutes is None else args.calm_minutes
    if min(minutes, calm_minutes) <= 0:
        parser.error("--minutes and --calm-minutes must be positive")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: {', '.join(sorted(unknown))} not in the soak (it runs: {', '.join(MODES)})")
    import chaos_check

    export = args.out / "agent-export"
    exporter = spawn("export_for_agents", str(export))  # 20 s on a loaded machine: quick async runs meanwhile

    def soak(mode: str) -> bool:
        """The mode's calm run, then its run under faults; True when the checker found a violation."""
        results = {}
        hand_made = args.quick and mode == "async"  # the quick form's async: scripted only, on a hand-made export
        if not hand_made and exporter.wait() != 0:
            raise SystemExit(f"the soak's export failed (exit {exporter.returncode})")
        for faulty in (False, True):
            folder = args.out / f"{mode}-{'faults' if faulty else 'calm'}"
            seconds = (minutes if faulty else calm_minutes) * 60
            run_mode(mode, seconds, devices, folder, faulty, None if hand_made else export,
                     0 if hand_made else AGENTS[mode], not args.quick, QUICK_NEMESIS if args.quick else NEMESIS)
            results[faulty] = chaos_check.check(folder)
        print(chaos_check.summary(mode, results[True], results[False]))
        return bool(results[True]["violations"] or results[False]["violations"])

    if args.quick:  # make test's form: both modes side by side, each on its own broker and ports (a minute, not two)
        with ThreadPoolExecutor(len(modes)) as pool:
            failed = any(list(pool.map(soak, modes)))
    else:  # one mode at a time: each mode's calm run is the baseline of its progress under faults
        failed = any([soak(mode) for mode in modes])  # a list, not a generator: every mode runs after a violation too
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
