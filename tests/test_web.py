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


def test_the_pages_schema_is_generated_from_fedper_wire(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "web" / "make_schema.py"), str(tmp_path / "schema.js")], check=True,
                   capture_output=True)
    stale = "web/src/schema.js is stale: rerun web/make_schema.py"
    assert filecmp.cmp(tmp_path / "schema.js", ROOT / "web" / "src" / "schema.js", shallow=False), stale


DECODE_ALL = """
import { readFileSync } from 'node:fs';
import { decodeMessage } from './src/wire.js';
const cases = JSON.parse(readFileSync(process.argv[1]));
const verdicts = cases.map(([kind, text]) => {
  try { return decodeMessage(kind, new TextEncoder().encode(text)) && 'ok'; } catch (e) { return e.code ?? e.message; }
});
console.log(JSON.stringify(verdicts));
"""
VALID = {
    "Register": {"n_samples": 120, "base_digest": "d" * 64, "software": "x/1"},
    "RoundInfo": {"round": 2, "rounds": 3, "state": "open", "deadline": 1.9e9, "blob_id": "r2", "size": 10,
                  "sha256": "a" * 64, "count": 1, "base_digest": "d", "selection": "invited",
                  "next_selection_at": 1.9e9, "secagg_session": 1, "max_staleness": 2},
    "Invitation": {"round": 1},
    "ErrorMessage": {"code": "late_update", "message": "m", "round": 1},
    "UpdateMeta": {"round": 1, "n_samples": 1, "base_digest": "d", "metrics": {"accuracy": 0.5}, "codec": "fp32"},
}
CANDIDATES = ["-1", "0", "1", "1.0", "1.5", "9007199254740991", "9007199254740992", "1e400", "null", "true",
              '"open"', '"finished"', '"all"', '"invited"', '"r 1"', '"' + "a" * 64 + '"', '"' + "A" * 64 + '"',
              '"' + "x" * 256 + '"', '"' + "x" * 257 + '"', '"' + "x" * 4097 + '"', "{}", '{"a b":1}',
              '{"loss":1e16}', "{" + ",".join(f'"m{i}":1' for i in range(17)) + "}", "[]"]


@needs_node
def test_the_page_accepts_and_refuses_every_message_field_as_fedper_wire_does(tmp_path):
    """Each field of each message the page reads, set to values at and beyond its bounds (and left out): the page's
    verdict is Python's, so the generated schema carries every bound."""
    from fedper.wire import WireError, messages

    cases = []
    for kind, body in VALID.items():
        for name in body:
            cases.append((kind, json.dumps({"v": 1, **{k: v for k, v in body.items() if k != name}})))
            for value in CANDIDATES:
                rest = json.dumps({k: v for k, v in body.items() if k != name})[1:-1]
                cases.append((kind, f'{{"v":1,{rest},"{name}":{value}}}'))
    python = []
    for kind, text in cases:
        try:
            python.append(getattr(messages, kind).decode(text.encode()) and "ok")
        except WireError as e:
            python.append(e.code)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    page = json.loads(node(DECODE_ALL, str(tmp_path / "cases.json")))
    differ = [(c, p, w) for c, p, w in zip(cases, python, page, strict=True) if p != w]
    assert not differ, differ[:5]
    assert 0 < python.count("ok") < len(cases) - 100  # both verdicts are exercised
