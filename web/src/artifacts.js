// The export's files as the page reads them: manifest.json first, then every file it needs, each checked against
// the manifest's sha256 before use (the agent's check_artifacts), so a corrupt or stale download is refused.

import { sha256Hex } from './hash.js';
import { Manifest, ManifestError } from './manifest.js';

/** {manifest, read(path) -> checked bytes}; fetchBytes(path) gives a file of the export directory as bytes. */
export async function openArtifacts(fetchBytes) {
  const body = JSON.parse(new TextDecoder().decode(await fetchBytes('manifest.json')));
  const manifest = new Manifest(body);
  const read = async (path) => {
    const digest = manifest.files[path];
    if (!digest) throw new ManifestError(`the manifest lists no file ${path}: export with a fedper-export that writes the web agent's graphs`);
    const bytes = await fetchBytes(path);
    if (sha256Hex(bytes) !== digest) throw new ManifestError(`${path} does not match the manifest's sha256 (modified, or a stale copy)`);
    return bytes;
  };
  return { manifest, read };
}

/** fetchBytes over http: the export's files under `base` (a URL), an Error naming the file and the HTTP status. */
export function httpFiles(base) {
  return async (path) => {
    const response = await fetch(new URL(path, base));
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  };
}
