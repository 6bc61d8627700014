#!/bin/sh
# The image's entrypoint: choose the security mode, then run the command as an unprivileged user.
#
# Security (docker compose: docker-compose.yml always passes FEDHOP_SECURITY, empty unless chosen).
# Per-node credentials are the default and plaintext is never silent:
#   FEDHOP_SECURITY=mtls          mutual TLS with the node's own folder at /certs (ca.pem, NODE.pem,
#                                 NODE.key, NODE.cred): what the override of `fedhop compose` sets;
#   FEDHOP_SECURITY=shared-token  plaintext gRPC and one run token shared by every container: a
#                                 one-host quick try, announced in one line by the server's container;
#   unset security, no certificates: refused with one line naming `fedhop compose`, exit 2.
# The older spelling FEDHOP_INSECURE=0 FEDHOP_CERTS_DIR=/certs [FEDHOP_MTLS=1] still selects TLS, and
# FEDHOP_INSECURE=1 alone counts as shared-token (announced the same way).  Where FEDHOP_SECURITY is
# not set at all (Kubernetes: deploy/k8s sets the FEDHOP_INSECURE/CERTS_DIR/MTLS variables itself),
# nothing is decided here.
#
# The user: TLS keys from `fedhop certs` are mode 0600 and owned by whoever made them, so the
# container's user cannot read them where they are mounted (FEDHOP_CERTS_DIR, read-only).  Started as
# root (docker compose), this copies that directory to /run/fedhop-certs, owned by the user the
# command will run as with the keys 0600, points FEDHOP_CERTS_DIR there and drops to that user:
#   FEDHOP_UID[:FEDHOP_GID] when set and not 0 (`fedhop compose` and deploy/docker/up.sh set the
#   invoking user's), so the run's files belong to whoever started compose; the run folder
#   ($FEDHOP_RUNS, /runs, a host folder) is handed to that user when root owns it (the engine made it);
#   else the owner of the run folder when that is not root;
#   else the unprivileged fedhop (uid 10001), which is handed the root-owned run folder.
# Started as a non-root user already (Kubernetes with runAsUser 10001 and the Secret's fsGroup), it
# runs the command as it is, after checking that every key is readable, so a wrong mode is one clear
# line instead of a traceback.
set -eu
say() { echo "fedhop-entrypoint: $*" >&2; }

# the server's container is the one that announces the run's security mode (one line, not one per container)
is_server=0
case " $* " in *" fedhop.deploy.launch.role server "*) is_server=1 ;; esac

if [ -n "${FEDHOP_SECURITY+set}" ]; then
    case "${FEDHOP_SECURITY}" in
    mtls)
        export FEDHOP_INSECURE=0 FEDHOP_MTLS=1 FEDHOP_CERTS_DIR="${FEDHOP_CERTS_DIR:-/certs}"
        if [ ! -f "$FEDHOP_CERTS_DIR/ca.pem" ]; then
            say "FEDHOP_SECURITY=mtls but $FEDHOP_CERTS_DIR holds no ca.pem: mount this node's folder from \`fedhop compose\` there (its override does)"
            exit 2
        fi
        ;;
    shared-token)
        export FEDHOP_INSECURE=1 FEDHOP_MTLS=0 FEDHOP_CERTS_DIR=
        ;;
    "")
        if [ "${FEDHOP_INSECURE:-}" = 0 ] && [ -n "${FEDHOP_CERTS_DIR:-}" ]; then
            FEDHOP_SECURITY=tls
        elif [ "${FEDHOP_INSECURE:-}" = 1 ] || [ "${FEDHOP_INSECURE:-}" = true ]; then
            FEDHOP_SECURITY=shared-token
            export FEDHOP_MTLS=0 FEDHOP_CERTS_DIR=
        else
            say "no security mode: make per-node credentials (fedhop certs ./certs --nodes server,client-proc0,client-proc1 && fedhop compose ./certs --clients 2) and run the command it prints, or set FEDHOP_SECURITY=shared-token for a one-host quick try"
            exit 2
        fi
        ;;
    *)
        say "FEDHOP_SECURITY=$FEDHOP_SECURITY: use mtls (the override of \`fedhop compose\`) or shared-token (a one-host quick try)"
        exit 2
        ;;
    esac
    export FEDHOP_SECURITY
    if [ "$FEDHOP_SECURITY" = shared-token ] && [ "$is_server" = 1 ]; then
        say "SHARED-TOKEN MODE: plaintext gRPC and one run token every container holds (any of them can speak for any node); a one-host quick try only. Per-node mutual TLS: fedhop certs + fedhop compose"
    fi
fi

run_as=10001
copy=/run/fedhop-certs
if [ "$(id -u)" = 0 ]; then
    runs=${FEDHOP_RUNS:-/runs}
    uid=${FEDHOP_UID:-}
    case "$uid" in ''|0) uid= ;; *[!0-9]*) say "FEDHOP_UID=$uid: a numeric user id"; exit 2 ;; esac
    if [ -n "$uid" ]; then
        run_as=$uid
        run_group=${FEDHOP_GID:-$uid}
        case "$run_group" in ''|*[!0-9]*) say "FEDHOP_GID=$run_group: a numeric group id"; exit 2 ;; esac
        if [ -d "$runs" ] && [ "$(stat -c %u "$runs")" = 0 ]; then
            chown "$run_as:$run_group" "$runs"
        fi
    elif [ -d "$runs" ]; then
        owner=$(stat -c %u "$runs")
        if [ "$owner" = 0 ]; then
            chown "$run_as:$run_as" "$runs"
        else
            run_as=$owner
            run_group=$(stat -c %g "$runs")
        fi
    fi
    # a user the image does not know: no home of its own
    getent passwd "$run_as" >/dev/null || export HOME=/tmp
    if [ -n "${FEDHOP_CERTS_DIR:-}" ]; then
        if [ ! -d "$FEDHOP_CERTS_DIR" ]; then
            say "FEDHOP_CERTS_DIR=$FEDHOP_CERTS_DIR is not a directory (mount the output of 'fedhop certs' there)"
            exit 2
        fi
        rm -rf "$copy"
        mkdir -m 0700 "$copy"
        cp -R "$FEDHOP_CERTS_DIR"/. "$copy"/
        chown -R "$run_as:${run_group:-$run_as}" "$copy"
        chmod -R u+rwX,go-rwx "$copy"
        export FEDHOP_CERTS_DIR="$copy"
    fi
    exec setpriv --reuid="$run_as" --regid="${run_group:-$run_as}" --clear-groups --no-new-privs -- "$@"
fi
if [ -n "${FEDHOP_CERTS_DIR:-}" ]; then
    for key in "$FEDHOP_CERTS_DIR"/*.key; do
        if [ -e "$key" ] && [ ! -r "$key" ]; then
            say "$key is not readable by uid $(id -u); give the container a copy it can read (Kubernetes: the Secret volume's defaultMode 0440 with fsGroup $run_as)"
            exit 2
        fi
    done
fi
exec "$@"
