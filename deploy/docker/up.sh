#!/bin/bash
# deploy/docker/up.sh [docker compose up options]: one command from a checkout to a finished run
# on a Docker engine, with no network needed by the build (`make compose-up`).
#
# An engine (the running one, else docker.io started here, installed with apt-get where missing;
# see engine.sh) and `docker compose` (compose_setup), the image built offline (build.sh), then
#   docker compose -p PROJECT up --abort-on-container-exit --exit-code-from server [options]
# and its exit status, which is the server's: 0 for a completed run.
#
# PROJECT is $COMPOSE_PROJECT_NAME, else fedhop-<UTC time>-<pid>: a project of its own per run,
# so that runs at once never share containers, network or run folder.  The run folder is on the
# host, ./runs-compose/PROJECT/<run name>/ ($FEDHOP_RUNS_SRC/PROJECT/...), made here so that its
# files belong to whoever runs this.  At the end the project's containers and network are removed
# (`compose down`; nothing of the run is in them) and a daemon started here is stopped, unless
# another run still uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/docker/engine.sh
project=${COMPOSE_PROJECT_NAME:-fedhop-$(date -u +%Y%m%d-%H%M%S)-$$}
export COMPOSE_PROJECT_NAME=$project
runs=${FEDHOP_RUNS_SRC:-runs-compose}/$project
mkdir -p "$runs"
down() {
    compose -p "$project" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
    engine_down
}
trap down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
compose_setup
engine_up
# one build at a time on this engine (runs started together share the image)
lockdir=$FEDHOP_CACHE
mkdir -p "$lockdir" 2>/dev/null && [ -w "$lockdir" ] || lockdir=${TMPDIR:-/tmp}
exec {build_lock}>>"$lockdir/build.lock"
flock -x "$build_lock"
deploy/docker/build.sh
exec {build_lock}>&-
status=0
say "compose project $project: run folder $runs"
compose -p "$project" up --abort-on-container-exit --exit-code-from server "$@" || status=$?
current=$(cat "$runs/current" 2>/dev/null || true)
say "docker compose up exited with status $status; the run: $runs/${current:-<none announced>}"
exit "$status"
