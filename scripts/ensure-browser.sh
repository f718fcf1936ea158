#!/usr/bin/env bash
# Install Debian's Chromium and its WebDriver for the admin page's browser tests, when
# they are missing (CI runs as root on a Debian machine; Selenium then drives
# /usr/bin/chromium through /usr/bin/chromedriver, nothing is downloaded at test time).
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-browser: chromium is missing; install it with: apt-get install chromium chromium-driver" >&2
  exit 0  # the browser tests then skip, or fail under CI=true, saying why
fi
echo "ensure-browser: installing chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
