"""Bytes on the wire per device per round, fp32 and with the opt-in update codecs, and their accuracy cost.

Per device and round: the base model comes down (the shared tensors, fp32) and the update goes
up (the shared tensors through fedper.compression's codec, BatchNorm statistics exact:
fedper.payload.encode_shared), both as safetensors blobs cut into protocol v1 chunk frames
(fedper.wire.chunk, 63 KiB chunks); MQTT's own few bytes per publish are not counted. The
accuracy cost: the emulator on digits (real images) with every client's shared tensors encoded
and decoded as the wire does before aggregation, same seeds for every codec. The paired update
error: every codec applied to the same updates of the fp32 runs, so codecs are compared on
identical rounds (the --quick run measures only this, on one seed).

    python benchmarks/wire.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from common import main, table, write_json

from fedper.compression import CODECS
from fedper.models import build_model, describe, exported_state
from fedper.payload import decode_shared, encode_shared
from fedper.wire import UpdateMeta, chunk

MODELS = (("mobilenet_v1", 1.0), ("resnet34", 1.0))
KPS = (1, 2, 3, 4)


def shared_tensors(arch: str, width: float, kp: int) -> tuple[Any, dict[str, np.ndarray]]:
    net = build_model(arch, 10, width, 32)
    manifest = describe(net, architecture=arch, kp=kp, algorithm="fedper", input_size=32, width=width)
    state = exported_state(net)
    return manifest, {n: state[n].detach().numpy() for n in manifest.names(shared=True)}


def framed_bytes(blob: bytes, meta: dict[str, Any]) -> int:
    return sum(len(frame) for frame in chunk(blob, blob_id="r1-device-0001", meta=meta))


def sizes(models=MODELS, kps=KPS) -> list[dict[str, Any]]:
    rows = []
    for arch, width in models:
        for kp in kps:
            manifest, tensors = shared_tensors(arch, width, kp)
            meta = {k: v for k, v in json.loads(UpdateMeta(1, 500, manifest.base_digest).encode()).items() if k != "v"}
            down = framed_bytes(encode_shared(manifest, tensors), {"round": 1})
            for codec in CODECS:
                blob = encode_shared(manifest, tensors, codec, base=tensors)  # a delta's size does not depend on it
                up = framed_bytes(blob, {**meta, "codec": codec})
                rows.append({"model": arch, "width": width, "kp": kp, "codec": codec, "shared_params":
                             sum(v.size for v in tensors.values()), "update_blob": len(blob), "up": up,
                             "down": down, "framing_overhead": up / len(blob) - 1, "total": up + down})
    return rows


ACCURACY_SETUP = ("digits at 16x16, 5 clients x 4 classes, MobileNet-v1 w0.25, FedPer K_P=2, 1 local epoch, B=32, "
                  "lr 0.05, momentum 0.9")


JITTER = "fp32 + 2^-24 jitter"  # the control: float32 round-off-sized noise on every trainable value


def update_error(previous: dict[str, np.ndarray], exact: dict[str, np.ndarray], coded: dict[str, np.ndarray]) -> float:
    """|coded aggregate - exact aggregate| / |exact aggregate - previous model| over the given tensors:
    the codec's error as a fraction of the round's own step (0 for fp32)."""
    error = sum(float(np.square(coded[n] - exact[n]).sum()) for n in exact)
    step = sum(float(np.square(exact[n] - previous[n]).sum()) for n in exact)
    return float(np.sqrt(error / step))


def accuracy_cost(rounds: int, seeds: tuple[int, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per codec applied to every update, over several run seeds: the final mean client accuracy, and
    each round's update error (`update_error` of the n_j-weighted mean of what the clients sent
    against the mean of what they trained, trainable shared tensors). The control row multiplies every
    trainable value of every update by (1 + 2^-24 N(0, 1)): what float32 round-off alone does to
    these runs, so a codec's cost can be told from run-to-run chaos. Also the paired update errors
    (`paired_update_errors`) of the fp32 runs."""
    rows, paired = [], {codec: [] for codec in PROBED}
    for codec in ("fp32", JITTER, *CODECS[1:]):
        finals, histories, errors = [], [], []
        for seed in seeds:
            history = []
            for metrics in run_fleet(seed, rounds, codec, errors, paired if codec == "fp32" else {}):
                history.append(metrics["mean_accuracy"])
            finals.append(history[-1])
            histories.append(history)
        rows.append({"codec": codec, "rounds": rounds, "seeds": list(seeds), "final_accuracy": finals,
                     "mean_accuracy": float(np.mean(finals)), "histories": histories, "update_errors": errors,
                     "update_error_median": float(np.median(errors)),
                     "update_error_p90": float(np.percentile(errors, 90))})
    reference = rows[0]
    for row in rows:
        row["delta_vs_fp32"] = row["mean_accuracy"] - reference["mean_accuracy"]
        row["delta_per_seed"] = [a - b for a, b in zip(row["final_accuracy"], reference["final_accuracy"], strict=True)]
    return rows, paired_rows(paired, rounds, seeds)


PROBED = (JITTER, *CODECS[1:])  # what the paired measurement applies to each fp32 round's updates


def paired_update_errors(rounds: int, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each codec's update error on the very updates of fp32 runs: one trajectory per seed, every
    codec applied to each round's client updates, so the codecs differ only in their rounding."""
    paired: dict[str, list[float]] = {codec: [] for codec in PROBED}
    for seed in seeds:
        for _ in run_fleet(seed, rounds, "fp32", [], paired):
            pass
    return paired_rows(paired, rounds, seeds)


def paired_rows(paired: dict[str, list[float]], rounds: int, seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"codec": codec, "rounds": rounds, "seeds": list(seeds), "update_errors": errors,
             "update_error_median": float(np.median(errors)), "update_error_p90": float(np.percentile(errors, 90))}
            for codec, errors in paired.items()]


def run_fleet(seed: int, rounds: int, codec: str, errors: list[float],
              paired: dict[str, list[float]]) -> Any:
    """The emulator run of the accuracy setup, its clients sending through `codec`: each round's
    metrics in turn; each round's update error appended to `errors`, and to `paired[c]` that of
    codec c applied to the same updates."""
    import torch

    from fedper.aggregation import WeightedMean
    from fedper.emulate.data import DataConfig, load_fleet_data
    from fedper.emulate.fleet import Fleet, FleetConfig

    def through(manifest, codec: str, tensors, base, noise) -> dict[str, np.ndarray]:
        """The tensors as the coordinator gets them from a device sending through `codec`."""
        if codec == JITTER:
            return {n: (v * (1 + 2**-24 * noise.standard_normal(v.shape))).astype(v.dtype)
                    if manifest.spec(n).trainable else v for n, v in tensors.items()}
        return decode_shared(manifest, encode_shared(manifest, tensors, codec, base), codec, base)

    class CompressedFleet(Fleet):
        """A fleet whose clients send their shared tensors through a codec, as a device would."""

        def _train(self, state, members, on_step=None):  # the per-client hook: (shared, local) trained
            noise = np.random.default_rng([state.seed, state.round])
            trainable = [n for n in self.shared_names if self.manifest.spec(n).trainable]
            base = {n: v.cpu().numpy() for n, v in state.shared.items()}  # the round's model, as devices hold it
            exact, coded = WeightedMean(), {c: WeightedMean() for c in {codec, *paired}}
            for j, (shared, local) in zip(members, super()._train(state, members, on_step), strict=True):
                tensors = {n: v.cpu().numpy() for n, v in shared.items()}
                exact.add({n: tensors[n] for n in trainable}, self.data.n_train[j])
                for c, mean in coded.items():
                    back = through(self.manifest, c, tensors, base, noise)
                    mean.add({n: back[n] for n in trainable}, self.data.n_train[j])
                    if c == codec:
                        sent = back
                yield {n: torch.from_numpy(sent[n]).to(v.device) for n, v in shared.items()}, local
            previous = {n: base[n].astype(np.float64) for n in trainable}
            result = exact.result(np.float64)
            for c, mean in coded.items():
                error = update_error(previous, result, mean.result(np.float64))
                for sink in ([errors] if c == codec else []) + ([paired[c]] if c in paired else []):
                    sink.append(error)

    data = load_fleet_data(DataConfig(dataset="digits", clients=5, classes_per_client=4, input_size=16, seed=seed))
    config = FleetConfig(model="mobilenet_v1", width=0.25, algorithm="fedper", kp=2, local_epochs=1,
                         batch_size=32, lr=0.05, momentum=0.9, seed=seed, engine="sequential")
    fleet = CompressedFleet(config, data)
    state = fleet.init()
    for _ in range(rounds):
        state, metrics = fleet.run_round(state)
        yield metrics


def run(out: Path, quick: bool = False) -> str:
    rows = sizes(MODELS[:1], (1,)) if quick else sizes()
    if quick:
        accuracy, paired = [], paired_update_errors(rounds=15, seeds=(0,))
    else:
        accuracy, paired = accuracy_cost(rounds=15, seeds=(0, 1, 2, 3, 4))
    write_json(out, "wire", {"sizes": rows, "accuracy": accuracy, "paired_update_errors": paired,
                             "accuracy_setup": ACCURACY_SETUP})
    text = table(["model", "K_P", "codec", "shared values", "up MB", "down MB (fp32)", "framing overhead",
                  "MB per device per round", "up vs fp32"],
                 [[r["model"], r["kp"], r["codec"], f"{r['shared_params']:,}", r["up"] / 1e6, r["down"] / 1e6,
                   f"{r['framing_overhead']:.2%}", r["total"] / 1e6,
                   r["up"] / next(s["up"] for s in rows if (s["model"], s["kp"], s["codec"]) ==
                                  (r["model"], r["kp"], "fp32"))] for r in rows])
    if accuracy:
        text += f"\n\naccuracy cost ({ACCURACY_SETUP}, {accuracy[0]['rounds']} rounds, seeds {accuracy[0]['seeds']}):\n"
        text += table(["codec", "update error / round's step (median, 90th pct)", "final mean accuracy (mean of seeds)",
                       "vs fp32", "per seed", "vs fp32 per seed"],
                      [[r["codec"], f"{r['update_error_median']:.2e}, {r['update_error_p90']:.2e}", r["mean_accuracy"],
                        f"{r['delta_vs_fp32']:+.4f}", " ".join(f"{a:.3f}" for a in r["final_accuracy"]),
                        " ".join(f"{d:+.3f}" for d in r["delta_per_seed"])] for r in accuracy])
    text += (f"\n\npaired update error (every codec on the same updates of the fp32 runs; {ACCURACY_SETUP}, "
             f"{paired[0]['rounds']} rounds, seeds {paired[0]['seeds']}):\n")
    text += table(["codec", "update error / round's step: median", "90th percentile", "max"],
                  [[r["codec"], f"{r['update_error_median']:.2e}", f"{r['update_error_p90']:.2e}",
                    f"{max(r['update_errors']):.2e}"] for r in paired])
    return text


if __name__ == "__main__":
    main(run, __doc__, quick="MobileNet-v1 at K_P=1 only; no accuracy runs, the paired update errors on one seed")
