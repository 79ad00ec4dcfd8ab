"""The import rules of docs/architecture.md, checked on the source: every module's imports are read
with `ast` (nothing is imported, so lazy imports inside functions and TYPE_CHECKING blocks count too).

- the kernel `fedper` (folder fedper/) imports no role;
- `fedper.models` imports only the kernel;
- `fedper.export` and `fedper.emulate` import only the kernel and `fedper.models`;
- `fedper.edge` and `fedper.coordinator` import only the kernel, never each other;
- only the umbrella CLI `fedper.cli` (folder cli/) may import every role;
- within the coordinator, an aggregation strategy (coordinator/strategies/) imports neither the engine
  nor the service (nor the CLI that runs them): it sees the engine only through `strategies.base.Fleet`;
- the agent's engine (edge/engine.py) does no I/O: it imports no training backend, no MQTT client and
  nothing that reads or writes files or runs processes (the state directory's writer included), and calls
  no file method; its jobs are done by edge/agent.py.
- the coordinator's engine (coordinator/engine.py) and its parts (machine, rounds, registry, intake, invitations,
  inputs, announcements, records) do no I/O either and read no clock: they import no MQTT client, not the state
  directory's `Store`, the shell that carries out their effects (coordinator/durable.py) nor `time`, and call
  no file method.
- the clocked fleet (emulate/async_fleet.py, emulate/clock.py) drives the emulator's Fleet through its public
  methods alone: it reaches into no other object's private members and builds no FleetState of its own.

Folders map to packages through pyproject.toml's [tool.setuptools.package-dir].
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Set
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "fedper"
ROLES = ("fedper.models", "fedper.export", "fedper.edge", "fedper.coordinator", "fedper.emulate", "fedper.cli")
ALLOWED = {
    KERNEL: {KERNEL},
    "fedper.models": {KERNEL, "fedper.models"},
    "fedper.export": {KERNEL, "fedper.models", "fedper.export"},
    "fedper.emulate": {KERNEL, "fedper.models", "fedper.emulate"},
    "fedper.edge": {KERNEL, "fedper.edge"},
    "fedper.coordinator": {KERNEL, "fedper.coordinator"},
    "fedper.cli": {KERNEL, *ROLES},
}
# (module, layer it may import although its own layer may not), each one documented in
# docs/architecture.md: the agent's optional PyTorch backend builds the network from the manifest
# with fedper.models, lazily, so that a device training with ORT never loads it.
EXCEPTIONS = {("fedper.edge.torch_backend", "fedper.models")}
# Modules under a package may not import these (modules of the same layer, or I/O of any kind).
FORBIDDEN = {
    "fedper.coordinator.strategies": ("fedper.coordinator.engine", "fedper.coordinator.service",
                                      "fedper.coordinator.cli"),
    "fedper.edge.engine": ("fedper.edge.agent", "fedper.edge.backend", "fedper.edge.ort_backend",
                           "fedper.edge.ort_import", "fedper.edge.torch_backend", "fedper.edge.service",
                           "fedper.edge.cli", "fedper.edge.state",
                           "fedper.edge.eligibility", "fedper.mqtt", "fedper.checkpoint", "fedper.data", "paho",
                           "onnxruntime", "torch", "os", "io", "pathlib", "shutil", "subprocess", "tempfile", "socket"),
}
# the coordinator's engine and the parts it is made of (docs/architecture.md): no I/O, no clock
COORDINATOR_PURE = tuple(f"fedper.coordinator.{name}" for name in ("engine", "machine", "rounds", "registry",
                                                                    "intake", "inputs", "invitations",
                                                                    "announcements", "records"))
FORBIDDEN |= {module: ("fedper.coordinator.store.Store", "fedper.coordinator.durable", "fedper.coordinator.service",
                       "fedper.coordinator.cli", "fedper.coordinator.web", "fedper.coordinator.broker", "fedper.mqtt",
                       "fedper.checkpoint", "paho", "time", "os", "io", "pathlib", "shutil", "subprocess", "tempfile",
                       "socket") for module in COORDINATOR_PURE}
PURE = ("fedper.edge.engine", *COORDINATOR_PURE)  # modules that may call no file method either
FILE_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "rename", "touch",
              "rmdir"}


def layer(module: str) -> str | None:
    """The layer a dotted module name belongs to; None for anything outside the `fedper` namespace."""
    if module != KERNEL and not module.startswith(KERNEL + "."):
        return None
    return next((role for role in ROLES if module == role or module.startswith(role + ".")), KERNEL)


def package_dirs(root: Path) -> dict[str, Path]:
    """Package name -> folder, as the wheel installs them."""
    with (root / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in mapping.items()}


def modules(root: Path) -> dict[str, Path]:
    """Every installed module's dotted name -> its source file."""
    found: dict[str, Path] = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) for every import in the file, relative imports resolved.

    `from a.b import c` yields a.b.c, which is the module a.b.c when c is one and otherwise lies
    in the same layer as a.b, so that `from fedper import models` counts as importing fedper.models."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names += [(base if alias.name == "*" else f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden(module: str, name: str) -> bool:
    """Whether `name` is a module (or lies in one) that `module`'s package may not import (FORBIDDEN)."""
    return any(within(module, package) and any(within(name, target) for target in targets)
               for package, targets in FORBIDDEN.items())


def violations(root: Path, exceptions: Set[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per import that breaks a rule: file:line, the importing module and what it imports."""
    broken = []
    for module, path in modules(root).items():
        own = layer(module)
        for name, line in imported_names(module, path):
            if forbidden(module, name):
                broken.append(f"{path.relative_to(root)}:{line}: {module} imports {name}, which it may not")
                continue
            target = layer(name)
            if target is None or target in ALLOWED[own] or (module, target) in exceptions:
                continue
            broken.append(f"{path.relative_to(root)}:{line}: {module} ({own}) imports {name} ({target})")
    return broken


def file_calls(root: Path) -> list[str]:
    """One line per call of `open` or of a file method (Path's read_text, write_bytes, ...) in a PURE module."""
    found = []
    for module, path in modules(root).items():
        if not any(within(module, pure) for pure in PURE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in FILE_CALLS and not strategy_hook(node.func):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {module} calls {name}()")
    return found


def strategy_hook(func: ast.expr) -> bool:
    """`self.strategy.open(...)`: the aggregation strategy's hook that opens a round, not a file."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and func.value.attr == "strategy"


def test_every_layer_is_a_folder_of_the_wheel() -> None:
    found = modules(ROOT)
    assert set(package_dirs(ROOT)) >= {KERNEL, *ROLES}
    for name in (KERNEL, *ROLES):
        assert any(layer(m) == name for m in found), f"no module of {name} found"


def test_the_tree_keeps_the_import_rules() -> None:
    assert violations(ROOT, EXCEPTIONS) == []


def test_the_agents_engine_does_no_io() -> None:
    """No file method in its source; importing it loads no MQTT client, backend runtime or state writer."""
    assert file_calls(ROOT) == []
    loaded = ("paho", "onnxruntime", "torch", "fedper.mqtt", "fedper.checkpoint", "fedper.edge.state",
              "fedper.edge.backend", "fedper.edge.eligibility")
    code = (f"import sys, fedper.edge.engine; print(sorted(m for m in sys.modules if m.startswith({loaded!r}) "
            "and m.split('.')[0] in ('paho', 'onnxruntime', 'torch', 'fedper')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_the_coordinators_engine_loads_no_mqtt_client_nor_its_shell() -> None:
    """Its effects are carried out by coordinator/durable.py, its messages published by coordinator/service.py."""
    loaded = ("paho", "fedper.mqtt", "fedper.coordinator.durable", "fedper.coordinator.service")
    code = f"import sys, fedper.coordinator.engine; print(sorted(m for m in sys.modules if m.startswith({loaded!r})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_every_exception_is_still_needed() -> None:
    """An exception the code no longer needs is removed here and in docs/architecture.md."""
    found = modules(ROOT)
    for module, target in EXCEPTIONS:
        assert module in found, f"{module} no longer exists"
        assert any(layer(n) == target for n, _ in imported_names(module, found[module])), (module, target)


PYPROJECT = """
[tool.setuptools.package-dir]
"fedper" = "fedper"
"fedper.cli" = "cli"
"fedper.models" = "models"
"fedper.export" = "export"
"fedper.edge" = "edge"
"fedper.coordinator" = "coordinator"
"fedper.emulate" = "emulate"
"""


@pytest.mark.parametrize(
    ("file", "source", "broken"),
    [
        ("fedper/wire.py", "from fedper.edge import engine\n", "fedper.wire (fedper) imports fedper.edge.engine"),
        ("fedper/data/x.py", "from fedper import models\n", "fedper.data.x (fedper) imports fedper.models"),
        ("fedper/x.py", "import fedper.cli\n", "imports fedper.cli (fedper.cli)"),
        ("models/x.py", "from fedper.export.cli import app\n", "imports fedper.export.cli.app (fedper.export)"),
        ("export/x.py", "from fedper.emulate import fleet\n", "imports fedper.emulate.fleet (fedper.emulate)"),
        ("emulate/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedper.edge.engine import E\n",
         "emulate/x.py:3: fedper.emulate.x (fedper.emulate) imports fedper.edge.engine.E (fedper.edge)"),
        ("edge/x.py", "def f():\n    from fedper.coordinator.engine import Coordinator\n",
         "edge/x.py:2: fedper.edge.x (fedper.edge) imports fedper.coordinator.engine.Coordinator"),
        ("coordinator/x.py", "from ..edge import service\n", "imports fedper.edge.service (fedper.edge)"),
        ("coordinator/sub/__init__.py", "from ...models import split\n", "imports fedper.models.split"),
        ("coordinator/strategies/x.py", "from fedper.coordinator.engine import Coordinator\n",
         "fedper.coordinator.strategies.x imports fedper.coordinator.engine.Coordinator, which it may not"),
        ("coordinator/strategies/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from ..service import run_service\n", "imports fedper.coordinator.service.run_service"),
        ("coordinator/strategies/x.py", "def f():\n    import fedper.coordinator.cli\n",
         "imports fedper.coordinator.cli"),
        ("coordinator/strategies/x.py", "from fedper.coordinator.store import Store\nfrom .base import Strategy\n",
         None),
        ("coordinator/engines.py", "from fedper.coordinator.engine import Coordinator\n", None),
        ("edge/x.py", "import numpy\nfrom fedper.manifest import Manifest\nfrom . import state\n", None),
        ("edge/engine.py", "from fedper.edge.state import DeviceState\n",
         "fedper.edge.engine imports fedper.edge.state.DeviceState, which it may not"),
        ("edge/engine.py", "def f():\n    from .ort_backend import OrtBackend\n", "imports fedper.edge.ort_backend"),
        ("edge/engine.py", "import paho.mqtt.client as mqtt\n", "imports paho.mqtt.client, which it may not"),
        ("edge/engine.py", "from pathlib import Path\n", "imports pathlib.Path, which it may not"),
        ("edge/engine.py", "from fedper.wire import Outgoing\nfrom .secure_round import SecureParticipant\n", None),
        ("coordinator/engine.py", "from fedper.coordinator.store import RoundRecord, Store\n",
         "fedper.coordinator.engine imports fedper.coordinator.store.Store, which it may not"),
        ("coordinator/engine.py", "import time\n", "fedper.coordinator.engine imports time, which it may not"),
        ("coordinator/engine.py", "from .durable import Coordinator\n", "imports fedper.coordinator.durable"),
        ("coordinator/engine.py", "from fedper.coordinator.store import RoundRecord\nfrom .effects import Outbox\n",
         None),
        ("export/x.py", "from fedper.models import build_model\nfrom .graph import rewrite\n", None),
        ("emulate/x.py", "from fedper.models.split import split\nfrom fedper.data import load_digits\n", None),
        ("cli/x.py", "".join(f"import {role}\n" for role in ROLES), None),
    ],
)
def test_checker_on_synthetic_sources(tmp_path: Path, file: str, source: str, broken: str | None) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = violations(tmp_path)
    if broken is None:
        assert found == []
    else:
        assert len(found) == 1 and broken in found[0], found


@pytest.mark.parametrize(("source", "found"), [
    ("data = open('x').read()\n", "edge/engine.py:1: fedper.edge.engine calls open()"),
    ("def f(path):\n    path.write_bytes(b'')\n", "edge/engine.py:2: fedper.edge.engine calls write_bytes()"),
    ("state = 'open'\nwords = state.split()\n", None),
    ("def f(self):\n    self.strategy.open(2, {}, False)\n", None),
    ("def f(self):\n    self.store.open()\n", "edge/engine.py:2: fedper.edge.engine calls open()"),
])
def test_file_calls_are_found_in_the_engines_alone(tmp_path: Path, source: str, found: str | None) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    for folder, name in (("edge", "engine.py"), ("edge", "agent.py"), ("coordinator", "engine.py"),
                         ("coordinator", "durable.py")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text(source)
    expected = [found, found.replace("edge", "coordinator")] if found else []
    assert sorted(file_calls(tmp_path)) == sorted(expected)


def test_checker_finds_a_broken_rule_in_a_copy_of_the_tree(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for folder in {path.relative_to(ROOT).parts[0] for path in package_dirs(ROOT).values()}:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path, EXCEPTIONS) == []
    edge_cli = tmp_path / "edge" / "cli.py"
    edge_cli.write_text(edge_cli.read_text() + "\nfrom fedper.coordinator.engine import Coordinator\n")
    (found,) = violations(tmp_path, EXCEPTIONS)
    assert found.startswith("edge/cli.py:") and "imports fedper.coordinator.engine.Coordinator" in found
    edge_cli.write_text(edge_cli.read_text().rpartition("\nfrom fedper.coordinator")[0])
    mean = tmp_path / "coordinator" / "strategies" / "mean.py"
    mean.write_text(mean.read_text() + "\nfrom fedper.coordinator.service import run_service\n")
    (found,) = violations(tmp_path, EXCEPTIONS)
    assert found.startswith("coordinator/strategies/mean.py:") and "fedper.coordinator.service.run_service" in found


# The clocked fleet (emulate/async_fleet.py, emulate/clock.py) drives Fleet through its public interface alone:
# no private member of another object, no FleetState of its own making (a "view" whose round is not a round).
CLOCKED = ("async_fleet.py", "clock.py")


def private_reaches(source: str) -> list[tuple[str, int]]:
    """(name, line) of every `x._name` whose x is not the module's own `self`, and of every use of FleetState."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.Name) and node.id == "FleetState":
            found.append((node.id, node.lineno))
    return found


def test_the_clocked_fleet_uses_only_fleets_public_interface() -> None:
    folder = package_dirs(ROOT)["fedper.emulate"]
    for name in CLOCKED:
        assert private_reaches((folder / name).read_text()) == [], name


@pytest.mark.parametrize(("source", "found"), [
    ("self.fleet._train(view, [j])", [("_train", 1)]),
    ("fleet._evaluate(v, 0, False)", [("_evaluate", 1)]),
    ("view = FleetState(0, {}, [])", [("FleetState", 1)]),
    ("self._torch(m); self.fleet.train_clients(s, l, [j], 0, 0); x.__class__", []),
])
def test_private_reaches_are_found(source: str, found: list[tuple[str, int]]) -> None:
    assert private_reaches(source) == found
