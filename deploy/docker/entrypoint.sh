#!/bin/sh
# The image's entrypoint: run the command as the unprivileged user fedhop (uid 10001).
#
# TLS keys from `fedhop certs` are mode 0600 and owned by whoever made them, so uid 10001 cannot
# read them where they are mounted (FEDHOP_CERTS_DIR, read-only).  Started as root (docker compose),
# this copies that directory to /run/fedhop-certs, owned by fedhop with the keys 0600, points
# FEDHOP_CERTS_DIR there and drops to fedhop.  Started as fedhop already (Kubernetes with
# runAsUser 10001 and the Secret's fsGroup), it runs the command as it is, after checking that
# every key is readable, so a wrong mode is one clear line instead of a traceback.
#
# The run folder ($FEDHOP_RUNS, /runs) is a host folder in docker compose (./runs-compose/<project>).
# Started as root, the command runs as the owner of that folder when it is not root, so the files
# of a run belong to whoever made the folder on the host (deploy/docker/up.sh makes it); a folder
# owned by root (made by the engine for a missing bind-mount source) is handed to uid 10001.
set -eu
run_as=10001
copy=/run/fedhop-certs
if [ "$(id -u)" = 0 ]; then
    runs=${FEDHOP_RUNS:-/runs}
    if [ -d "$runs" ]; then
        owner=$(stat -c %u "$runs")
        if [ "$owner" = 0 ]; then
            chown "$run_as:$run_as" "$runs"
        else
            run_as=$owner
            run_group=$(stat -c %g "$runs")
            # a user the image does not know: no home of its own
            getent passwd "$run_as" >/dev/null || export HOME=/tmp
        fi
    fi
    if [ -n "${FEDHOP_CERTS_DIR:-}" ]; then
        if [ ! -d "$FEDHOP_CERTS_DIR" ]; then
            echo "fedhop-entrypoint: FEDHOP_CERTS_DIR=$FEDHOP_CERTS_DIR is not a directory (mount the output of 'fedhop certs' there)" >&2
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
            echo "fedhop-entrypoint: $key is not readable by uid $(id -u); give the container a copy it can read (Kubernetes: the Secret volume's defaultMode 0440 with fsGroup $run_as)" >&2
            exit 2
        fi
    done
fi
exec "$@"
