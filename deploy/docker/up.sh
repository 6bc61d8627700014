#!/bin/bash
# deploy/docker/up.sh [docker compose up options]: one command from a checkout to a finished run
# on a Docker engine, with no network needed by the build (`make compose-up`).
#
# An engine (the running one, else docker.io started here, installed with apt-get where missing;
# see engine.sh), the image built offline (build.sh), then
#   docker compose up --abort-on-container-exit --exit-code-from server [options]
# and its exit status, which is the server's: 0 for a completed run.  A daemon started here is
# stopped again, with the containers, network and volume of this project (`compose down -v`,
# after the run directory is copied to ./runs-compose/ when FEDHOP_KEEP_RUNS=1).
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/docker/engine.sh
trap engine_down EXIT
engine_up
deploy/docker/build.sh
status=0
compose up --abort-on-container-exit --exit-code-from server "$@" || status=$?
if [ "${FEDHOP_KEEP_RUNS:-0}" = 1 ]; then
    rm -rf runs-compose && compose cp server:/runs runs-compose >/dev/null && say "run directory copied to ./runs-compose"
fi
[ -z "$ENGINE_PID" ] || compose down -v --remove-orphans >/dev/null 2>&1 || true
say "docker compose up exited with status $status"
exit "$status"
