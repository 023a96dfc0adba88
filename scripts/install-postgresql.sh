#!/usr/bin/env bash
# Debian's PostgreSQL server, for the team-scale test (tests/test_team.py), which starts a throw-away
# cluster of its own on loopback. Does nothing when the server's programs are already installed.
set -euo pipefail
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
echo "installing Debian's postgresql for the team-scale test" >&2
$sudo apt-get update -qq
# the package's own cluster is not needed: the test makes one in a temporary folder
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql >/dev/null
