#!/usr/bin/env bash
# One Secret per node, fedhop-node-NODE, from a `fedhop certs` folder: ca.pem, NODE.pem, NODE.key and
# NODE.cred (the node's own per-node credential: its calls carry tokens only it can sign); never ca.key,
# issuer.key or another node's files.  A folder made before `fedhop certs` wrote credentials has no
# NODE.cred: then cluster.secret (the shared token, which every holder can mint any node's token with).
#   deploy/k8s/node-secrets.sh ./certs server client-proc0 client-proc1 | kubectl apply -f -
# Prints the manifests (kubectl create --dry-run=client); needs no cluster.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 CERTS_DIR NODE..." >&2; exit 2; }
certs=$1; shift
for n in "$@"; do
    for f in ca.pem "$n.pem" "$n.key"; do
        [ -f "$certs/$f" ] || { echo "node-secrets: $certs/$f is missing (fedhop certs $certs --nodes ...)" >&2; exit 2; }
    done
    extra=()
    if [ -f "$certs/$n.cred" ]; then
        extra=(--from-file="$certs/$n.cred")
    elif [ -f "$certs/cluster.secret" ]; then
        extra=(--from-file="$certs/cluster.secret")
    fi
    echo "---"
    kubectl create secret generic "fedhop-node-$n" --dry-run=client -o yaml \
        --from-file="$certs/ca.pem" --from-file="$certs/$n.pem" --from-file="$certs/$n.key" "${extra[@]}"
done
