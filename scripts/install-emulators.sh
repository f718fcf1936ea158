#!/usr/bin/env bash
# Install the third-party emulators some tests run against (tests/emulators/): the Telegram
# Bot API emulator telegram-test-api, at the version its package-lock.json pins. Needs Node
# and npm (on this kind of machine already; Debian's nodejs/npm otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v npm >/dev/null 2>&1; then
  echo "install-emulators: npm is missing; installing Debian's nodejs and npm"
  apt-get update -q && apt-get install -y -q nodejs npm
fi
npm ci --prefix tests/emulators/telegram --no-audit --no-fund --loglevel=error
