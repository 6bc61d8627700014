#!/bin/bash
# deploy/docker/up.sh [--scale client=N] [docker compose up options]: one command from a checkout to a finished run
# on a Docker engine, with no network needed by the build (`make compose-up`).
#
# An engine (the running one, else docker.io started here, installed with apt-get where missing;
# see engine.sh) and `docker compose` (compose_setup), the image built offline (build.sh), per-node
# credentials (`fedhop certs` + `fedhop compose`: each container holds only its own key, mutual TLS),
# then the command `fedhop compose` prints,
#   docker compose -f docker-compose.yml -f NODES/compose.yml -p PROJECT up --attach server --exit-code-from server [options]
# which shows the server's output.  Its exit status is the server's: 0 for a completed run; a client
# container that dies costs its clients only (compose watches only the attached server).
#
# --scale client=N or FEDHOP_CLIENT_REPLICAS (default 2) client processes, FEDHOP_EDGES (default 0) edges:
# with edges, COMPOSE_PROFILES defaults to hierarchical (the profile docker-compose.yml starts its
# edge services in; sequential starts the same ones).
# FEDHOP_SECURITY=shared-token skips the credentials: plaintext with one shared run token, a one-host
# quick try (announced in one line).  The credentials live in a temporary folder outside the run
# folder (no container mounts another's) and are removed at the end.
#
# PROJECT is $COMPOSE_PROJECT_NAME, else fedhop-<UTC time>-<pid>: a project of its own per run,
# so that runs at once never share containers, network or run folder.  The run folder is on the
# host, ./runs-compose/PROJECT/<run name>/ ($FEDHOP_RUNS_SRC/PROJECT/...), made here, and the
# processes run as the invoking user (FEDHOP_UID/FEDHOP_GID: $SUDO_UID under sudo, else this
# user), so its files belong to whoever ran this.  At the end the project's containers and network
# are removed (`compose down`; each node's log is in RUN/logs/) and a daemon started here is
# stopped, unless another run still uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/docker/engine.sh
project=${COMPOSE_PROJECT_NAME:-fedhop-$(date -u +%Y%m%d-%H%M%S)-$$}
export COMPOSE_PROJECT_NAME=$project
export FEDHOP_UID=${FEDHOP_UID:-${SUDO_UID:-$(id -u)}} FEDHOP_GID=${FEDHOP_GID:-${SUDO_GID:-$(id -g)}}
runs=${FEDHOP_RUNS_SRC:-runs-compose}/$project
mkdir -p "$runs"
if [ "$(id -u)" = 0 ]; then
    chown "$FEDHOP_UID:$FEDHOP_GID" "$runs"
    [ -n "${FEDHOP_RUNS_SRC:-}" ] || chown "$FEDHOP_UID:$FEDHOP_GID" runs-compose
fi
py=${FEDHOP_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
clients=${FEDHOP_CLIENT_REPLICAS:-2}
edges=${FEDHOP_EDGES:-0}
# `--scale client=N` (make compose-up passes 4) is the number of client processes: with per-node
# credentials each is a service of its own, so it becomes `fedhop compose --clients N`
up_args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --scale) if [[ ${2:-} == client=* ]]; then clients=${2#client=}; shift 2; continue; fi ;;
    --scale=client=*) clients=${1#--scale=client=}; shift; continue ;;
    esac
    up_args+=("$1")
    shift
done
[[ $clients =~ ^[1-9][0-9]*$ ]] || die "client processes: $clients (--scale client=N or FEDHOP_CLIENT_REPLICAS, N >= 1)"
[[ $edges =~ ^[0-9]+$ ]] || die "FEDHOP_EDGES=$edges: the number of edge servers (0 or more)"
if [ "$edges" -gt 0 ] && [ -z "${COMPOSE_PROFILES:-}" ]; then
    # docker-compose.yml puts the edge services in the hierarchical and sequential profiles: either starts them
    export COMPOSE_PROFILES=hierarchical
fi
export FEDHOP_CLIENT_REPLICAS=$clients
nodes_dir=""
files=(-f docker-compose.yml)
down() {
    compose "${files[@]}" -p "$project" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
    [ -z "$nodes_dir" ] || rm -rf "$nodes_dir"
    engine_down
}
trap down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ "${FEDHOP_SECURITY:-}" = shared-token ]; then
    say "FEDHOP_SECURITY=shared-token: plaintext with one shared run token (a one-host quick try), no per-node credentials"
else
    nodes_dir=$(mktemp -d "${TMPDIR:-/tmp}/fedhop-compose-nodes.XXXXXX")
    list=server
    for ((e = 0; e < edges; e++)); do list+=",edge-$e"; done
    for ((k = 0; k < clients; k++)); do list+=",client-proc$k"; done
    "$py" -m fedhop.deploy.cli.cli certs "$nodes_dir/certs" --nodes "$list" >/dev/null
    "$py" -m fedhop.deploy.cli.cli compose "$nodes_dir/certs" --clients "$clients" --edges "$edges" \
        --out "$nodes_dir/nodes" --file docker-compose.yml >/dev/null
    say "per-node credentials (mutual TLS): server, $edges edges, $clients client processes (client-proc0..$((clients - 1)))"
    files+=(-f "$nodes_dir/nodes/compose.yml")
fi
compose_setup
engine_up
# one build at a time on this engine (runs started together share the image)
lockdir=$FEDHOP_CACHE
mkdir -p "$lockdir" 2>/dev/null && [ -w "$lockdir" ] || lockdir=${TMPDIR:-/tmp}
exec {build_lock}>>"$lockdir/build.lock"
flock -n "$build_lock" || { say "waiting for another run's image build to finish ($lockdir/build.lock)"; flock -x "$build_lock"; }
deploy/docker/build.sh
exec {build_lock}>&-
status=0
say "compose project $project: run folder $runs"
compose "${files[@]}" -p "$project" up --attach server --exit-code-from server ${up_args[@]+"${up_args[@]}"} || status=$?
current=$(cat "$runs/current" 2>/dev/null || true)
if [ "$status" = 0 ]; then
    # compose v2 ends every --exit-code-from run so, a completed one too (deploy/launch/compose.py up_command)
    say "run completed (exit status 0): compose's \"Aborting on container exit...\" above is it stopping the client containers after the server's end"
fi
say "the server's container exited with status $status; the run: $runs/${current:-<none announced>} (each node's log in its logs/)"
exit "$status"
