#!/bin/sh
# Chromium and chromedriver for the chat page's browser tests
# (tests/server/test_chat_page_browser.py), from Debian's packages when this machine has
# apt-get and we are root (CI, containers); elsewhere a note says how to get them.
set -e
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium and chromium-driver (Debian packages) for the browser tests"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium chromium-driver >/dev/null
else
    echo "note: chromium / chromedriver not found: the chat page's browser tests are skipped" \
        "(run scripts/install_browser.sh as root on Debian, or install both by hand)" >&2
fi
