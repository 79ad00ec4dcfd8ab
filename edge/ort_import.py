"""onnxruntime and its training API without torch, which a device never uses through them.

onnxruntime-training 1.19 imports torch as it starts: `import onnxruntime` runs a build check that tries
ORTModule (torch's training wrapper), and `onnxruntime.training`'s `__init__` imports amp and optim, both
torch code. The agent needs neither: `onnxruntime.training.api` (on-device training) and InferenceSession
are the C++ runtime. That import alone cost each agent 1.9 s of CPU and 490 MiB of resident memory
(docs/performance.md, "The agent's start").

So, where torch is not loaded yet, torch is hidden while onnxruntime starts (its build check then skips
itself, as where torch is not installed), and `onnxruntime.training` becomes a bare package whose
`__init__` does not run, so `onnxruntime.training.api` loads alone. A process that already holds torch
imports both as usual. Either way torch imports normally afterwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType

TRAINING = "onnxruntime.training"


class _HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"{name} is hidden while onnxruntime starts", name=name)
        return None


def onnxruntime() -> ModuleType:
    """`onnxruntime` (ImportError where it is not installed)."""
    hide = None if "torch" in sys.modules or "onnxruntime" in sys.modules else _HideTorch()
    if hide:
        sys.meta_path.insert(0, hide)
    try:
        import onnxruntime as runtime
    finally:
        if hide:
            sys.meta_path.remove(hide)
    return runtime


def training_api() -> ModuleType:
    """`onnxruntime.training.api` (ImportError where onnxruntime has no training package)."""
    if "torch" not in sys.modules and TRAINING not in sys.modules:
        _bare_training_package()
    from onnxruntime.training import api

    return api


def _bare_training_package() -> None:
    """`onnxruntime.training` as a package whose __init__ (amp, optim: torch) has not run."""
    runtime = onnxruntime()
    spec = importlib.util.find_spec(TRAINING)
    if spec is None:
        raise ModuleNotFoundError(f"{TRAINING} is not installed (plain onnxruntime has no training API)", name=TRAINING)
    sys.modules[TRAINING] = runtime.training = importlib.util.module_from_spec(spec)
