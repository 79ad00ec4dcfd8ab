"""state.json as earlier releases wrote it, rebuilt by hand from the current record (coordinator/store.py),
so that tests can show a state directory of an earlier release resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def earlier_layout(state: dict[str, Any], inline_registry: dict[str, Any] | None = None,
                   state_dir: Path | None = None) -> dict[str, Any]:
    """Version 1 (before the versioned record): no `version`, the strategy's part at the top level (`partial`,
    `updates`, DP's state under `dp`), each kept update in a file of its own (copied out of its slot in
    `state_dir`). With `inline_registry`, version 0: the registrations inline (`registered`) and no registry
    file named."""
    old = {key: value for key, value in state.items() if key not in ("version", "strategy")}
    part = state["strategy"]
    updates = {}
    for device, slot in part.get("updates", {}).items():
        assert state_dir is not None, "kept updates live in slot files: pass state_dir"
        name = f"update-r{state['round']['number']}-{device}.safetensors"
        (state_dir / name).write_bytes((state_dir / slot["file"]).read_bytes()[:slot["size"]])
        updates[device] = name
    old.update(partial=part.get("partial"), updates=updates)
    if part["privacy"] is not None:
        old["dp"] = part["privacy"]
    if inline_registry is not None:
        del old["registry"]
        old["registered"] = inline_registry
    return old


def rewrite_as_earlier(state_dir: Path) -> None:
    """Replace the state directory's state.json by its version-1 layout."""
    path = state_dir / "state.json"
    path.write_text(json.dumps(earlier_layout(json.loads(path.read_text()), state_dir=state_dir)))
