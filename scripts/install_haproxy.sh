#!/bin/sh
# HAProxy for the replicas test (tests/server/test_replicas.py runs a real haproxy on
# docker/haproxy.cfg), from Debian's package when this machine has apt-get and we are root (CI,
# containers); elsewhere a note says how to get it. The test fails, not skips, without it.
set -e
if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing haproxy (Debian package) for the replicas test"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Only the binary is needed: no service is started (the test runs its own haproxy).
    apt-get install -y -qq --no-install-recommends haproxy >/dev/null
else
    echo "note: haproxy not found: tests/server/test_replicas.py will fail" \
        "(run scripts/install_haproxy.sh as root on Debian, or install haproxy by hand)" >&2
fi
