#!/bin/sh
# A stand-in for the python:3.11-slim base image, built from Debian packages with debootstrap,
# for hosts that cannot pull from a container registry (make test-docker uses it then).
#
#   docker/make_base.sh [TAG]        (default TAG: mtplx-base:bookworm; needs root)
#
# Debian bookworm's python3 is 3.11, like the default base. The Debian mirror is the one this
# host's apt uses (override with DEBIAN_MIRROR / DEBIAN_SECURITY_MIRROR). The host's CA bundle
# is added to the image's trust store (HOST_CA_BUNDLE; empty to skip), so pip inside
# `docker build` can reach the package index through a TLS-intercepting proxy.
set -eu

TAG=${1:-mtplx-base:bookworm}
SUITE=${SUITE:-bookworm}
HOST_CA_BUNDLE=${HOST_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}

# The first http(s) URI of the host's apt sources whose path ends in $1 (debian, debian-security).
host_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
        2>/dev/null | grep -v '^[[:space:]]*#' | grep -oE "https?://[^[:space:]]+/$1/?" \
        | head -n 1 | sed 's:/$::'
}
MIRROR=${DEBIAN_MIRROR:-$(host_mirror debian)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-$(host_mirror debian-security)}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}

if [ "$(id -u)" != 0 ]; then
    echo "make_base.sh: debootstrap needs root" >&2
    exit 1
fi
command -v debootstrap >/dev/null || {
    echo "make_base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2
    exit 1
}

ROOTFS=$(mktemp -d /var/tmp/mtplx-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT INT TERM

echo "make_base.sh: debootstrap $SUITE from $MIRROR into $ROOTFS"
# passwd: useradd for the image's non-root user (python:3.11-slim has it too).
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    "$SUITE" "$ROOTFS" "$MIRROR"

cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
if [ -n "$HOST_CA_BUNDLE" ] && [ -f "$HOST_CA_BUNDLE" ]; then
    cp "$HOST_CA_BUNDLE" "$ROOTFS/usr/local/share/ca-certificates/host-ca-bundle.crt"
    chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/tmp/* \
    "$ROOTFS"/var/log/*.log

tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
echo "make_base.sh: built $TAG"
