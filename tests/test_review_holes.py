"""Issue 39, item 5: the holes a hostile-device and hostile-coordinator review found, each shut by a test built
from hand-made frames (tests/helpers/frames.py) or third-party clients, expected values derived here.

- `--mode async` applies `--max-weight-ratio` as synchronous rounds do, and records `weight_cap`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from test_async_engine import copy, make, plus, records, register, send

# ---------------------------------------------------------------- the weight cap in asynchronous rounds


def test_a_device_claiming_a_million_samples_moves_an_async_version_no_more_than_the_cap(tmp_path: Path) -> None:
    """Issue 39: FedBuff was built without --max-weight-ratio, so a device registered at 1,000,000 samples among
    four of 100 moved a version 1,000,000 / 1,000,400 of the way to its poison. With the default c = 10 it weighs
    at most 10 x the registered median: its share of the step is derived here from the registered counts."""
    honest = {f"h{i}": 100 for i in range(4)}
    claims = {**honest, "evil": 1_000_000}

    def run(state: Path, **config: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
        c = make(state, rounds=2, buffer_size=5, **config)
        register(c, claims)
        v1 = copy(c.model)
        assert send(c, "evil", plus(v1, -1000.0), 1, 1_000_000) == []
        for i, device in enumerate(honest):
            assert send(c, device, plus(v1, 0.1 * (i + 1)), 1, 100) == []
        assert c.round.number == 2  # the fifth fold released version 2
        return v1, copy(c.model), records(state)[0]

    median = float(np.median(list(claims.values())))  # 100: the evil claim is one rank of five
    for name, config, evil_weight in (("capped", {}, min(1_000_000, 10 * median)),
                                      ("lifted", {"max_weight_ratio": float("inf")}, 1_000_000.0)):
        v1, v2, record = run(tmp_path / name, **config)
        for k in v1:  # float64: the step as each device's float32 tensor minus the version it trained on
            deltas = [(100.0, plus(v1, 0.1 * (i + 1))[k].astype(np.float64) - v1[k]) for i in range(4)]
            deltas.append((evil_weight, plus(v1, -1000.0)[k].astype(np.float64) - v1[k]))
            expected = v1[k] + sum(w * d for w, d in deltas) / sum(w for w, _ in deltas)
            np.testing.assert_allclose(v2[k], expected, rtol=1e-6, atol=1e-4, err_msg=(name, k))
        share = float(np.mean((v2["stem.weight"] - v1["stem.weight"]) / -1000.0))
        assert abs(share - evil_weight / (evil_weight + 400)) < 1e-3, (name, share)
        if name == "capped":
            assert share < 0.72 and record["weight_cap"] == 10 * median and record["capped"] == ["evil"]
        else:
            assert share > 0.999 and "weight_cap" not in record
    assert json.loads((tmp_path / "capped" / "metrics.jsonl").read_text().splitlines()[0])["weight_cap"] == 1000.0
