#!/bin/sh
# valkey-server, valkey-cli and valkey-benchmark for the Valkey tier's tests and
# benchmarks: Valkey 8.0 from Debian bookworm-backports (bookworm itself has
# only Redis 7.0, which the tests use instead when this cannot run).
set -eu
if command -v valkey-server >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
. /etc/os-release
LIST=/etc/apt/sources.list.d/kvledger-backports.sources
if [ "${VERSION_CODENAME:-}" = "bookworm" ] && [ ! -e "$LIST" ]; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' | $SUDO tee "$LIST" >/dev/null
fi
$SUDO apt-get update -qq
if [ "${VERSION_CODENAME:-}" = "bookworm" ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports valkey-server valkey-tools
else
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq valkey-server valkey-tools
fi
# The package starts a system server on 6379; the tests start their own on free ports.
$SUDO service valkey-server stop >/dev/null 2>&1 || true
