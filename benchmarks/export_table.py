"""Export time and artifact sizes for MobileNet-v1 and ResNet-34 at K_P 1..4 (32x32) and K_P 1 (224x224).

Algorithm fedper-ft, so each export has an `all` and a `head` set; 10 classes, width 1.0; a warm-up
export first, so imports and first calls are not timed.

    python benchmarks/export_table.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from common import main, table, write_json

from fedper.export.exporter import export_artifacts

MB = 1e6


def measure(work: Path, model: str, kp: int, input_size: int, algorithm: str) -> dict:
    out = work / f"{model}-{input_size}-kp{kp}"
    start = time.perf_counter()
    manifest = export_artifacts(out, model=model, kp=kp, num_classes=10, input_size=input_size, algorithm=algorithm)
    seconds = time.perf_counter() - start
    sizes = {name: (out / name).stat().st_size for name in manifest.files}
    sets = {kind: sum(s for name, s in sizes.items() if name.startswith(folder + "/")) / MB
            for kind, folder in manifest.artifact_sets.items()}
    params = {role: sum(math.prod(t.shape) for t in manifest.tensors if t.role == role and t.trainable)
              for role in ("base", "head")}
    return {
        "model": model, "input_size": input_size, "kp": kp, "algorithm": algorithm, "export_s": seconds,
        "base_params": params["base"], "head_params": params["head"],
        "inference_mb": sizes["inference.onnx"] / MB, "base_safetensors_mb": sizes["base.safetensors"] / MB,
        "set_mb": sets, "total_mb": sum(sizes.values()) / MB,
    }


def run(out: Path, quick: bool = False) -> str:
    algorithm = "fedper-ft"
    models = ("mobilenet_v1",) if quick else ("mobilenet_v1", "resnet34")
    configs = [(model, kp, 32) for model in models for kp in ((1,) if quick else (1, 2, 3, 4))]
    if not quick:
        configs += [(model, 1, 224) for model in models]
    with tempfile.TemporaryDirectory() as tmp:
        export_artifacts(Path(tmp) / "warmup", model="mobilenet_v1", kp=1, num_classes=10, input_size=32,
                         width=0.25, algorithm=algorithm)  # imports and first-call costs out of the timings
        rows = [measure(Path(tmp), model, kp, size, algorithm) for model, kp, size in configs]
    write_json(out, "export_table", {"rows": rows})
    kinds = list(rows[0]["set_mb"])
    header = ["model", "input", "K_P", "base params", "head params", "export s", "inference MB", "base wire MB",
              *[f"set '{k}' MB" for k in kinds], "total MB"]
    cells = [[r["model"], r["input_size"], r["kp"], f"{r['base_params']:,}", f"{r['head_params']:,}",
              f"{r['export_s']:.1f}", f"{r['inference_mb']:.1f}", f"{r['base_safetensors_mb']:.1f}",
              *[f"{r['set_mb'][k]:.1f}" for k in kinds], f"{r['total_mb']:.1f}"] for r in rows]
    return f"export with --algorithm {algorithm}, 10 classes, width 1.0\n\n" + table(header, cells)


if __name__ == "__main__":
    main(run, __doc__, quick="MobileNet-v1 at K_P=1, 32x32 only")
