"""The web agent seen from Python: the vectors it is tested against are Python's own output, its algorithm table is
fedper.algorithms', every update codec it writes decodes in fedper.compression (the coordinator's decoder) to what
the Python agent's encoding decodes to, and fedper.web names its built page. Its own tests are web/test/ (node)."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from fedper import compression
from fedper.algorithms import ALGORITHMS
from fedper.payload import safetensors_metadata

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (the web agent's runtime)")


def node(script: str, *args: str) -> str:
    """Run an ES module script in web/ with node; its stdout."""
    done = subprocess.run([NODE, "--input-type=module", "-e", script, *args], cwd=ROOT / "web", capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_web_vectors_are_what_python_computes(tmp_path):
    subprocess.run([sys.executable, str(VECTORS / "make_web_vectors.py"), str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("rng.json", "images.json", "codecs.json"):
        assert filecmp.cmp(tmp_path / name, VECTORS / "web" / name, shallow=False), f"tests/vectors/web/{name} is stale"


@needs_node
def test_the_page_runs_the_phases_of_every_federated_algorithm():
    table = json.loads(node("import { ALGORITHMS } from './src/manifest.js'; console.log(JSON.stringify(ALGORITHMS));"))
    expected = {name: {"phases": [[p.trained, p.epochs] for p in a.phases],
                       "fineTuneHeadAtEval": a.fine_tune_head_at_eval}
                for name, a in ALGORITHMS.items() if a.federated}
    assert table == expected


ENCODE_ALL = """
import { readFileSync, writeFileSync } from 'node:fs';
import { CODECS, encodeTensors } from './src/codecs.js';
import { encodeSafetensors } from './src/safetensors.js';
const v = JSON.parse(readFileSync(process.argv[1]));
const tensors = Object.keys(v.trained).map((name) => ({
  name, shape: v.shapes[name], data: Float32Array.from(v.trained[name]) }));
const reference = new Map(Object.entries(v.reference).map(([n, x]) => [n, Float32Array.from(x)]));
for (const codec of CODECS) {
  const { arrays, metadata } = encodeTensors(tensors, codec, new Set(v.exact), reference);
  writeFileSync(`${process.argv[2]}/${codec}.safetensors`, encodeSafetensors(arrays, metadata));
}
"""


@needs_node
def test_every_codec_the_page_writes_decodes_in_python_as_the_python_encoding_does(tmp_path):
    vectors = json.loads((VECTORS / "web" / "codecs.json").read_text())
    node(ENCODE_ALL, str(VECTORS / "web" / "codecs.json"), str(tmp_path))
    shapes = vectors["shapes"]
    reference = {n: np.array(x, np.float32).reshape(shapes[n]) for n, x in vectors["reference"].items()}
    trained = {n: np.array(x, np.float32).reshape(shapes[n]) for n, x in vectors["trained"].items()}
    for codec in compression.CODECS:
        blob = (tmp_path / f"{codec}.safetensors").read_bytes()
        metadata = safetensors_metadata(blob) or {compression.CODEC_KEY: "fp32"}
        page = compression.decode(st_load(blob), metadata, reference)
        ours = compression.decode(*compression.encode(trained, codec, exact=vectors["exact"], reference=reference),
                                  reference)
        for name, value in trained.items():
            if codec == "int8-delta-rot" and name not in vectors["exact"]:
                # the rotation sums in another order than numpy: a value may land one level of the grid over
                # (1.5 scale_c at most), which the inverse rotation spreads to sqrt(n) times that in L2
                params = json.loads(metadata[compression.QUANT_KEY])[name]
                _, scales = compression._channel_params(name, params, compression.channels(value.shape))
                bound = 1.5 * scales.max() * np.sqrt(value.size)
                assert np.linalg.norm(page[name] - ours[name]) <= bound, (codec, name)
            else:
                np.testing.assert_array_equal(page[name], ours[name], err_msg=f"{codec} {name}")


def test_the_coordinator_serves_the_page_that_make_web_builds():
    import fedper
    from fedper.coordinator.web import check_root, default_root

    assert fedper.web_root() == ROOT / "web" / "dist" == default_root()
    if (ROOT / "web" / "dist" / "index.html").is_file():  # built by `make web` (npm), which `make test` runs first
        assert check_root(default_root()) == ROOT / "web" / "dist"
