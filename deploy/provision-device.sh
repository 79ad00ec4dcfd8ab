#!/usr/bin/env bash
# Give a device (or a fleet's coordinator or monitor) broker credentials bound to ONE fleet:
#   provision-device.sh [--coordinator | --monitor] ID FLEET [PASSWD_FILE [ACL_FILE]]
# Writes the password (printed once: store it on the device, e.g. in its systemd credentials file) and
# the ID's block in the ACL, which names FLEET in every topic: a credential of fleet A can neither read
# nor write fleet B's topics on a shared broker. A device writes only its own topics; --coordinator reads
# and writes everything of FLEET; --monitor reads everything of FLEET. Rotating (or moving the ID to
# another fleet): run it again, then `systemctl reload mosquitto` (SIGHUP re-reads both files).
# Revoking: mosquitto_passwd -D PASSWD_FILE ID, delete the ID's block from the ACL, then reload.
# A phone (the web agent) is a device like any other; with FEDPER_WEB_URL=https://HOST/ set, the script also prints
# FEDPER_WEB_LINK, the page's URL with the id and password in its fragment, which the page reads and a server never sees.
set -euo pipefail
usage="usage: provision-device.sh [--coordinator | --monitor] ID FLEET [PASSWD_FILE [ACL_FILE]]"
role=device
case ${1:-} in
  --coordinator) role=coordinator; shift ;;
  --monitor) role=monitor; shift ;;
esac
id=${1:?$usage}
fleet=${2:?$usage}
passwd_file=${3:-/etc/mosquitto/fedper/passwd}
acl_file=${4:-/etc/mosquitto/fedper/acl}
for name in "device id:$id" "fleet:$fleet"; do
  if ! [[ ${name#*:} =~ ^[A-Za-z0-9_.-]{1,64}$ ]]; then
    echo "${name%%:*} must match [A-Za-z0-9_.-]{1,64} (it is also a topic level): ${name#*:}" >&2
    exit 2
  fi
done
command -v mosquitto_passwd >/dev/null || { echo "mosquitto_passwd not found: apt-get install mosquitto" >&2; exit 2; }
base="fedper/v1/$fleet"
case $role in
  coordinator) topics=("readwrite $base/#") ;;
  monitor) topics=("read $base/#") ;;
  *) topics=("write $base/register/$id" "write $base/presence/$id" "write $base/update/$id"
             "write $base/secagg/$id" "read $base/error/$id" "read $base/invite/$id" "read $base/relay/$id"
             "read $base/round" "read $base/state" "read $base/model/#") ;;
esac
password=$(head -c 24 /dev/urandom | base64 | tr -d '/+=' | head -c 32)
[ -f "$passwd_file" ] || install -m 600 /dev/null "$passwd_file"
[ -f "$acl_file" ] || install -m 600 /dev/null "$acl_file"
# The ID's previous block (if any) goes, so a rotation or a move leaves exactly one; then the new one.
quoted=${id//./\\.}
block=$(mktemp)
trap 'rm -f "$block"' EXIT
sed "/^# >>> $quoted\$/,/^# <<< $quoted\$/d" "$acl_file" >"$block"
{
  echo "# >>> $id"
  echo "user $id"
  printf 'topic %s\n' "${topics[@]}"
  echo "# <<< $id"
} >>"$block"
cat "$block" >"$acl_file"  # in place: the file keeps its owner and mode
mosquitto_passwd -b "$passwd_file" "$id" "$password"
echo "FEDPER_USERNAME=$id"
echo "FEDPER_PASSWORD=$password"
if [ "$role" = device ] && [ -n "${FEDPER_WEB_URL:-}" ]; then
  echo "FEDPER_WEB_LINK=${FEDPER_WEB_URL%%#*}#device=$id&password=$password"
fi
