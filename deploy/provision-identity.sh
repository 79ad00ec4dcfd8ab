#!/usr/bin/env bash
# Secure-aggregation identities (docs/privacy.md, "Identities"): each device holds an Ed25519 key certified by
# its fleet's root key; it signs its advertised keys and the survivor set with it, so a coordinator can neither
# forge a device nor substitute its keys.
#   provision-identity.sh --root ROOT_KEY
#       creates the fleet's root key ROOT_KEY (mode 600) and its public key ROOT_KEY.pub
#   provision-identity.sh ROOT_KEY ID FLEET OUT_DIR
#       a fresh identity for device ID of FLEET in OUT_DIR: identity.pem (its private key, mode 600),
#       identity.cert (the root's certificate of its public key) and fleet-root.pub (the root's public key, which
#       the device pins). Copy OUT_DIR to the device and start its agent with --identity OUT_DIR. Running it again
#       replaces the device's key (the old certificate stays valid: to revoke, make a new root for the fleet).
# Keep ROOT_KEY on the operator's machine, never on the coordinator's: whoever holds it can certify devices. The
# coordinator gets ROOT_KEY.pub only (fedper-coordinator --secagg-identity-root ROOT_KEY.pub). Needs OpenSSL 3.
set -euo pipefail
usage="usage: provision-identity.sh --root ROOT_KEY | provision-identity.sh ROOT_KEY ID FLEET OUT_DIR"
command -v openssl >/dev/null || { echo "openssl not found: apt-get install openssl" >&2; exit 2; }
umask 077
if [ "${1:-}" = "--root" ]; then
  [ $# -eq 2 ] || { echo "$usage" >&2; exit 2; }
  root=$2
  [ -e "$root" ] && { echo "$root exists: a new root would invalidate every device's certificate" >&2; exit 2; }
  openssl genpkey -algorithm ed25519 -out "$root"
  openssl pkey -in "$root" -pubout -out "$root.pub"
  echo "root key: $root (keep it offline); public key for the coordinator: $root.pub"
  exit 0
fi
[ $# -eq 4 ] || { echo "$usage" >&2; exit 2; }
root=$1 id=$2 fleet=$3 out=$4
for name in "device id:$id" "fleet:$fleet"; do
  if ! [[ ${name#*:} =~ ^[A-Za-z0-9_.-]{1,64}$ ]]; then
    echo "${name%%:*} must match [A-Za-z0-9_.-]{1,64} (it is also a topic level): ${name#*:}" >&2
    exit 2
  fi
done
[ -r "$root" ] || { echo "cannot read the root key $root" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
openssl genpkey -algorithm ed25519 -out "$work/identity.pem"
openssl pkey -in "$work/identity.pem" -pubout -outform DER | tail -c 32 >"$work/public"
# What the root signs (fedper.secagg.certificate_message): the context, fleet, id and key, NUL-separated.
printf 'fedper-identity/1\0%s\0%s\0' "$fleet" "$id" >"$work/message"
cat "$work/public" >>"$work/message"
openssl pkeyutl -sign -rawin -inkey "$root" -in "$work/message" -out "$work/signature"
public=$(openssl base64 -A -in "$work/public")
signature=$(openssl base64 -A -in "$work/signature")
printf '{"fleet": "%s", "device": "%s", "public": "%s", "signature": "%s"}\n' "$fleet" "$id" "$public" "$signature" \
  >"$work/identity.cert"
openssl pkey -in "$root" -pubout -out "$work/fleet-root.pub"
install -m 600 "$work/identity.pem" "$out/identity.pem"
install -m 644 "$work/identity.cert" "$out/identity.cert"
install -m 644 "$work/fleet-root.pub" "$out/fleet-root.pub"
echo "identity of $id in fleet $fleet: $out (copy it to the device; fedper-agent --identity $out)"
