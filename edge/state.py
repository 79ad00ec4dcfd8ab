"""The device's state directory: what must survive a kill, a reboot or a full disk.

    split.json          the fixed train/test split of the local data (indices into the samples in load
                        order, chosen once with a seed, with a fingerprint of the data): a restart never
                        moves a test image into training
    device.safetensors  a checkpoint (fedper.checkpoint) of the last completed round: the head (and its
                        BatchNorm statistics) and the update sent, with round, base_digest, n_samples,
                        metrics and the local tensors' names in its JSON metadata
    updates/r<k>.safetensors  with --keep-updates only: round k's update as sent (before clipping, masking or
                        compression), with round, base_digest and n_samples, for audits (benchmarks/chaos_check.py)
    final.json          after the last round: the accuracy and loss of the model the device serves
    served.safetensors  that model: the final base and the device's head (FedBABU: fine-tuned)
    personal.onnx, personal.json  the model served in the last round (after the last: the final one) as an
                        ONNX inference model plain onnxruntime runs, and its classes and preprocessing
                        (edge/personal.py)

Every file is replaced atomically (fedper.checkpoint): a kill or a full disk leaves the previous version
whole. Only the agent's jobs write here (edge/agent.py), never the engine. A device.safetensors of the
format before the checkpoint (separate metadata strings) is read once and rewritten.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from fedper import checkpoint
from fedper.checkpoint import PRIVATE
from fedper.edge.engine import Saved
from fedper.manifest import Manifest

SPLIT_FILE = "split.json"
TENSORS_FILE = "device.safetensors"
FINAL_FILE = "final.json"  # the served model's accuracy after the last round, for people and scripts
SERVED_FILE = "served.safetensors"  # the model final.json measured
UPDATES_DIR = "updates"  # --keep-updates: every round's update, r<round>.safetensors
TEST_FRACTION = 0.2

log = logging.getLogger("fedper.edge")


class StateError(RuntimeError):
    """The state directory cannot be read or written; the message says what to do."""


@contextmanager
def _saving(path: Path) -> Iterator[None]:
    """A failure to write `path` explained in the agent's terms, as a StateError."""
    try:
        yield
    except OSError as e:
        hint = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise StateError(f"cannot save {path}{hint}: {e.strerror or e}; the previous state is kept") from e


def data_fingerprint(x: np.ndarray, y: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(x).tobytes())
    h.update(np.ascontiguousarray(y, dtype=np.int64).tobytes())
    return "sha256:" + h.hexdigest()


class DeviceState:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        try:
            tightened = checkpoint.private_dir(self.dir)  # 700, files 600: the head and the update are the device's
        except OSError as e:
            raise StateError(f"cannot create the state directory {self.dir}: {e.strerror or e}") from e
        if tightened:
            log.warning("%s", checkpoint.tightened_line(self.dir, tightened))

    def split(self, x: np.ndarray, y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(train indices, test indices): read from split.json, or chosen now (stratified, seeded) and stored."""
        from fedper.data import split_train_test

        path = self.dir / SPLIT_FILE
        fingerprint = data_fingerprint(x, y)
        if path.exists():
            try:
                stored = checkpoint.read_json(path)
                train, test = np.asarray(stored["train"], np.int64), np.asarray(stored["test"], np.int64)
                stored_fingerprint = stored["fingerprint"]
            except (OSError, ValueError, KeyError) as e:
                raise StateError(f"{path} is unreadable ({e}); remove it to choose a new split") from None
            if stored_fingerprint != fingerprint:
                raise StateError(
                    f"the local data changed since {path} fixed the train/test split; restore the data, or remove "
                    f"{path} to split again (earlier test images may then be trained on)"
                )
            return train, test
        [(train, test)] = split_train_test([np.arange(len(y))], y, test_fraction=TEST_FRACTION, seed=seed)
        body = {"seed": seed, "n": len(y), "fingerprint": fingerprint, "train": train.tolist(), "test": test.tolist()}
        with _saving(path):
            checkpoint.write_json(path, body, mode=PRIVATE)
        return train, test

    saving = staticmethod(_saving)  # a write under the state directory that fails says so as a StateError

    def save(self, saved: Saved) -> None:
        meta = {"round": saved.round, "base_digest": saved.base_digest, "n_samples": saved.n_samples,
                "metrics": saved.metrics, "local": sorted(saved.local)}
        path = self.dir / TENSORS_FILE
        with _saving(path):
            checkpoint.write_checkpoint(path, {**saved.update, **saved.local}, meta, PRIVATE)

    def keep_update(self, saved: Saved) -> None:
        """A copy of this round's update beside the checkpoint (which keeps only the last round's)."""
        path = self.dir / UPDATES_DIR / f"r{saved.round}.safetensors"
        meta = {"round": saved.round, "base_digest": saved.base_digest, "n_samples": saved.n_samples}
        with _saving(path):
            path.parent.mkdir(mode=0o700, exist_ok=True)
            checkpoint.write_checkpoint(path, saved.update, meta, PRIVATE)

    def save_served(self, tensors: Mapping[str, np.ndarray], record: dict[str, Any]) -> None:
        """The model the device serves after the last round, then final.json, its accuracy on it."""
        served, final = self.dir / SERVED_FILE, self.dir / FINAL_FILE
        with _saving(served):
            checkpoint.write_checkpoint(served, tensors, record, PRIVATE)
        with _saving(final):
            checkpoint.atomic_write(final, json.dumps(record).encode(), PRIVATE)

    def load(self, manifest: Manifest) -> Saved | None:
        """The last completed round's state, or None for a fresh device. A state from another export
        (another base_digest) is refused rather than mixed in."""
        path = self.dir / TENSORS_FILE
        if not path.exists():
            return None
        try:
            tensors, meta = checkpoint.read_checkpoint(path)
            legacy = not meta
            if legacy:
                meta = _legacy_meta(path)
            local_names = meta["local"]
            saved = Saved(
                round=int(meta["round"]), base_digest=meta["base_digest"], n_samples=int(meta["n_samples"]),
                local={n: tensors[n] for n in local_names},
                update={n: v for n, v in tensors.items() if n not in local_names},
                metrics={k: float(v) for k, v in meta["metrics"].items()},
            )
        except (OSError, SafetensorError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"{path} is unreadable ({e}); remove it to start this device afresh") from None
        if saved.base_digest != manifest.base_digest:
            raise StateError(
                f"{path} belongs to another export (base_digest {saved.base_digest}, the artifacts have "
                f"{manifest.base_digest}); use another --state-dir or remove it"
            )
        expected = set(manifest.names(shared=False))
        if set(saved.local) != expected:
            raise StateError(f"{path} does not hold this model's device-local tensors; remove it to start afresh")
        if legacy:
            self.save(saved)
            log.warning("%s: rewritten in the checkpoint format (its round %d kept)", path, saved.round)
        return saved


def _legacy_meta(path: Path) -> dict[str, Any]:
    """The fields of a device.safetensors written before the checkpoint format: separate safetensors
    metadata strings, with metrics and the local names JSON-encoded in theirs."""
    with safe_open(str(path), framework="np") as f:
        old = f.metadata() or {}
    return {"round": int(old["round"]), "base_digest": old["base_digest"], "n_samples": int(old["n_samples"]),
            "metrics": json.loads(old["metrics"]), "local": json.loads(old["local"])}
