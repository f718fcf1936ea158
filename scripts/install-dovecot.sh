#!/usr/bin/env bash
# Install Debian's Dovecot IMAP server for the email channel's tests (tests/dovecot_server.py
# runs a private instance of it per test, never the system service). Idempotent: does
# nothing when Dovecot is there. Never fails the caller: the tests then skip, or fail
# under CI=true, saying how to install it.
set -u

if command -v dovecot >/dev/null 2>&1 || [ -x /usr/sbin/dovecot ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-dovecot: no apt-get here; install Dovecot's IMAP server by hand"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  SUDO="sudo -n"
fi
echo "install-dovecot: installing dovecot-imapd"
export DEBIAN_FRONTEND=noninteractive
# The package's service is not started where policy-rc.d forbids it (containers); the
# tests start their own instance either way.
$SUDO apt-get update -qq >/dev/null 2>&1 || true
$SUDO apt-get install -y -q dovecot-imapd >/dev/null 2>&1 \
  || echo "install-dovecot: apt-get install dovecot-imapd failed"
# Where the package did start the system service (a machine with systemd), stop it: the
# tests need none, and it would listen on 143 and 993 for nothing.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now dovecot >/dev/null 2>&1 || true
fi
exit 0
