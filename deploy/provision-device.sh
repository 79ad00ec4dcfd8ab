#!/usr/bin/env bash
# Give a device (or the coordinator) broker credentials: provision-device.sh DEVICE_ID [PASSWD_FILE]
# Prints the password once; store it on the device (e.g. in the agent's systemd environment file).
# Rotating: run it again for the same id, then `systemctl reload mosquitto` (SIGHUP re-reads the file).
# Revoking: mosquitto_passwd -D PASSWD_FILE DEVICE_ID, then reload.
set -euo pipefail
id=${1:?usage: provision-device.sh DEVICE_ID [PASSWD_FILE]}
passwd_file=${2:-/etc/mosquitto/fedper/passwd}
if ! [[ $id =~ ^[A-Za-z0-9_.-]{1,64}$ ]]; then
  echo "device id must match [A-Za-z0-9_.-]{1,64} (it is also a topic level): $id" >&2
  exit 2
fi
command -v mosquitto_passwd >/dev/null || { echo "mosquitto_passwd not found: apt-get install mosquitto" >&2; exit 2; }
password=$(head -c 24 /dev/urandom | base64 | tr -d '/+=' | head -c 32)
[ -f "$passwd_file" ] || { install -m 600 /dev/null "$passwd_file"; }
mosquitto_passwd -b "$passwd_file" "$id" "$password"
echo "FEDPER_USERNAME=$id"
echo "FEDPER_PASSWORD=$password"
