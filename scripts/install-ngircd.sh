#!/usr/bin/env bash
# Install Debian's ngIRCd for the IRC channel's tests (tests/ngircd_server.py runs a private
# instance of it per test, never the system service). Idempotent: does nothing when ngIRCd
# is there. Never fails the caller: the tests then skip, or fail under CI=true, saying how
# to install it.
set -u

if command -v ngircd >/dev/null 2>&1 || [ -x /usr/sbin/ngircd ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-ngircd: no apt-get here; install ngIRCd by hand"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  SUDO="sudo -n"
fi
echo "install-ngircd: installing ngircd"
export DEBIAN_FRONTEND=noninteractive
# The package's service is not started where policy-rc.d forbids it (containers); the
# tests start their own instance either way.
$SUDO apt-get update -qq >/dev/null 2>&1 || true
$SUDO apt-get install -y -q ngircd >/dev/null 2>&1 \
  || echo "install-ngircd: apt-get install ngircd failed"
# Where the package did start the system service (a machine with systemd), stop it: the
# tests need none, and it would listen on 6667 for nothing.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now ngircd >/dev/null 2>&1 || true
fi
exit 0
