#!/usr/bin/env bash
# Debian's Chromium, for the browser test (tests/test_browser.py). Playwright drives this browser and
# never downloads one of its own. Does nothing when chromium is already installed.
set -euo pipefail
command -v chromium >/dev/null && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
echo "installing Debian's chromium for the browser test" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
