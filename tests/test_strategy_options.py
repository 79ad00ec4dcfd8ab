"""Every option of every config group reaches the code that uses it (issue 38: `--mode async` once built FedBuff
without --max-weight-ratio, and no test noticed).

Each run's settings are set to values other than their defaults; its groups are then replaced by copies that
record which of their fields are read, and the engine is built, started and driven through registration, an
update and a deadline. Every field of every group the run's strategy declares, and of the engine's own groups,
must have been read by then, except those a mode leaves out by design (listed with their reason); and each field
of every group must be read by some mode.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from pathlib import Path

import pytest
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import GROUPS, Config, Group
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Store
from fedper.coordinator.strategies import strategy_class
from fedper.payload import encode_shared
from fedper.selection import new_seed
from fedper.wire import Register, Topics, UpdateMeta, chunk

MANIFEST = tiny_manifest()
TOPICS = Topics("lab")
ENGINE_GROUPS = ("rounds", "selection", "quotas", "training")  # read by the engine itself, whatever the strategy
COMMON = {"rounds": 3, "min_clients": 2, "round_timeout": 7.5, "chunk_size": 64, "state_interval": 0.25,
          "clients_per_round": 2, "answer_timeout": 3.5, "aggregator": "mean", "clip_norm": 5.0,
          "max_weight_ratio": 12.5, "max_samples_per_device": 5000, "max_uploads_per_device": 3,
          "max_uploads_per_round": 9, "max_upload_bytes_per_device": 1 << 22, "max_reassembly_bytes": 1 << 24,
          "max_messages_per_second": 500.0, "max_open_blobs": 32, "lr": 0.05, "lr_milestones": "1", "lr_decay": 0.5,
          "local_epochs": 2, "batch_size": 16}
DP = {"dp_noise_multiplier": 0.9, "dp_delta": 2e-5, "dp_target_epsilon": 1e9, "dp_budget_action": "warn"}
ASYNC = {"mode": "async", "buffer_size": 2, "max_staleness": 5, "staleness": "hinge", "staleness_exponent": 0.7,
         "staleness_hinge": 1, "server_lr": 0.9}
SECURE = {"secure_aggregation": True, "secagg_stage_timeout": 11.0, "secagg_degree": 4, "secagg_min_group": 3}
MODES = {
    "mean": {**COMMON, "over_select": 1.5, "selection_seed": 12345},
    "central-dp": {**COMMON, **DP, "over_select": 1.5, "selection_seed": new_seed(), "dp_adaptive_clipping": 0.4},
    "async": {**COMMON, **ASYNC, "selection_seed": 12345},
    "async-dp": {**COMMON, **ASYNC, **DP, "selection_seed": new_seed()},
    "secure": {**COMMON, **SECURE, "over_select": 1.5, "selection_seed": 12345},
    "secure-dp": {**COMMON, **SECURE, **DP, "over_select": 1.5, "selection_seed": new_seed()},
}
LEFT_OUT = {  # (mode, group, field): why the mode does not read it
    ("async-dp", "aggregation", "max_weight_ratio"): "DP's weights are uniform: no n_j to cap",
    ("secure", "aggregation", "aggregator"): "a secure sum is a mean (config.py refuses another)",
    ("secure", "aggregation", "max_weight_ratio"): "the masked inputs are summed n_j-weighted, uncapped",
    ("secure-dp", "aggregation", "aggregator"): "a secure sum is a mean (config.py refuses another)",
    ("secure-dp", "aggregation", "max_weight_ratio"): "the masked inputs are summed n_j-weighted, uncapped",
} | {(mode, "privacy", field): "DP is off without --dp-noise-multiplier (config.py refuses the budget and "
                                "adaptive clipping without it)"
     for mode in ("async", "secure") for field in ("delta", "target_epsilon", "budget_action", "adaptive_quantile")}


def recording(group: Group, name: str, reads: set[tuple[str, str]]) -> Group:
    """A copy of `group` that adds (group name, field) to `reads` whenever a field of it is read."""
    names = {f.name for f in fields(group)}

    class Recorded(type(group)):  # type: ignore[misc, valid-type]
        def __getattribute__(self, attribute: str) -> object:
            if attribute in names:
                reads.add((name, attribute))
            return super().__getattribute__(attribute)

    recorded = copy.copy(group)
    object.__setattr__(recorded, "__class__", Recorded)
    return recorded


def reads_of(mode: str, tmp_path: Path) -> tuple[set[tuple[str, str]], tuple[str, ...]]:
    """The fields the engine and the strategy of `mode` read once built, started and driven; and the groups
    the strategy declares."""
    options = dict(MODES[mode])
    if "secure_aggregation" in options:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from helpers.identities import write_root

        options["secagg_identity_root"] = str(write_root(tmp_path / "root.pub", Ed25519PrivateKey.generate()))
    config = Config.of(**options)  # its checks read every field: recording starts after them
    reads: set[tuple[str, str]] = set()
    for name in GROUPS:
        object.__setattr__(config, name, recording(getattr(config, name), name, reads))
    c = Coordinator(MANIFEST, tiny_tensors(), TOPICS, config, Store(tmp_path / mode))
    c.start(0.0)
    for device, n in (("a", 10), ("b", 30)):
        c.handle(TOPICS.register(device), Register(n, MANIFEST.base_digest, "test/1").encode(), 0.1)
        c.handle(TOPICS.presence(device), b"online", 0.1)
    c.tick(1.0)
    for device, n in (("a", 10), ("b", 30)):
        meta = UpdateMeta(1, n, MANIFEST.base_digest, {"accuracy": 0.5}, "fp32").to_dict()
        for frame in chunk(encode_shared(MANIFEST, tiny_tensors()), 40, "u", meta):
            c.handle(TOPICS.update(device), frame, 1.5)
    c.tick(9.0)
    assert c.counters["accepted"] or mode.startswith("secure"), "the update reached the strategy"
    return reads, strategy_class(config).groups


@pytest.mark.parametrize("mode", MODES)
def test_every_option_of_the_groups_in_play_is_read(mode: str, tmp_path: Path) -> None:
    if mode.startswith("secure"):
        pytest.importorskip("cryptography", reason="secure aggregation needs the privacy extra")
    reads, declared = reads_of(mode, tmp_path)
    in_play = {(name, f.name) for name in {*ENGINE_GROUPS, *declared} for f in fields(GROUPS[name])}
    left_out = {(group, field) for (m, group, field) in LEFT_OUT if m == mode}
    assert sorted(in_play - left_out - reads) == []
    assert left_out <= in_play - reads, "an option listed as left out is read: remove it from LEFT_OUT"


def test_every_option_of_every_group_is_read_by_some_mode(tmp_path: Path) -> None:
    pytest.importorskip("cryptography", reason="secure aggregation needs the privacy extra")
    reads: set[tuple[str, str]] = set()
    for mode in MODES:
        reads |= reads_of(mode, tmp_path)[0]
    assert sorted({(name, f.name) for name, group in GROUPS.items() for f in fields(group)} - reads) == []
