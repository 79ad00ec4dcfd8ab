"""Export time and artifact sizes for MobileNet-v1 and ResNet-34 at K_P 1..4: a markdown table + JSON.

    python benchmarks/export_table.py --out runs/export_table.json [--with-224]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

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
    params = {role: sum(_numel(t.shape) for t in manifest.tensors if t.role == role and t.trainable)
              for role in ("base", "head")}
    return {
        "model": model, "input_size": input_size, "kp": kp, "algorithm": algorithm, "export_s": seconds,
        "base_params": params["base"], "head_params": params["head"],
        "inference_mb": sizes["inference.onnx"] / MB, "base_safetensors_mb": sizes["base.safetensors"] / MB,
        "set_mb": sets, "total_mb": sum(sizes.values()) / MB,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def table(rows: list[dict]) -> str:
    kinds = list(rows[0]["set_mb"])
    header = ["model", "input", "K_P", "base params", "head params", "export s", "inference MB", "base wire MB",
              *[f"set '{k}' MB" for k in kinds], "total MB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["model"], str(r["input_size"]), str(r["kp"]), f"{r['base_params']:,}", f"{r['head_params']:,}",
                 f"{r['export_s']:.1f}", f"{r['inference_mb']:.1f}", f"{r['base_safetensors_mb']:.1f}",
                 *[f"{r['set_mb'][k]:.1f}" for k in kinds], f"{r['total_mb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--algorithm", default="fedper-ft", help="decides the artifact sets (fedper-ft: all + head)")
    parser.add_argument("--with-224", action="store_true", help="also export both models at 224x224, K_P=1")
    args = parser.parse_args()
    configs = [(model, kp, 32) for model in ("mobilenet_v1", "resnet34") for kp in (1, 2, 3, 4)]
    if args.with_224:
        configs += [(model, 1, 224) for model in ("mobilenet_v1", "resnet34")]
    with tempfile.TemporaryDirectory() as tmp:
        export_artifacts(Path(tmp) / "warmup", model="mobilenet_v1", kp=1, num_classes=10, input_size=32,
                         width=0.25, algorithm=args.algorithm)  # imports and first-call costs out of the timings
        rows = [measure(Path(tmp), model, kp, size, args.algorithm) for model, kp, size in configs]
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}"
    print(f"export with --algorithm {args.algorithm}, 10 classes, width 1.0; {machine}\n")
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
