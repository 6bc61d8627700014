#!/usr/bin/env bash
# One Secret per node, fedhop-node-NODE, from a `fedhop certs` folder: ca.pem, NODE.pem, NODE.key and
# NODE.cred when the folder has it (the node's own per-node credential); never ca.key, issuer.key,
# cluster.secret (the shared token, with which every holder could mint any node's token) or another
# node's files.  The pods run mutual TLS: NODE.pem / NODE.key are the node's identity.
#   fedhop certs ./certs --nodes server,client-proc0..1
#   deploy/k8s/node-secrets.sh ./certs server client-proc0 client-proc1 | kubectl apply -f -
# Prints the manifests (kubectl create --dry-run=client); needs no cluster.  A reserved name (ca,
# issuer, cluster, fedhop-node, register: their files are the cluster's own) is refused, exit 2.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 CERTS_DIR NODE..." >&2; exit 2; }
certs=$1; shift
for n in "$@"; do
    case "$(printf '%s' "$n" | tr '[:upper:]' '[:lower:]')" in
        ca|issuer|cluster|fedhop-node|register|"")
            echo "node-secrets: '$n' is a reserved name, not a node id (its files are the cluster's own)" >&2; exit 2;;
    esac
    case "$n" in
        */*|.*) echo "node-secrets: '$n' is not a node id" >&2; exit 2;;
    esac
    for f in ca.pem "$n.pem" "$n.key"; do
        [ -f "$certs/$f" ] || { echo "node-secrets: $certs/$f is missing (fedhop certs $certs --nodes ...)" >&2; exit 2; }
    done
    extra=()
    if [ -f "$certs/$n.cred" ]; then
        extra=(--from-file="$certs/$n.cred")
    fi
    echo "---"
    kubectl create secret generic "fedhop-node-$n" --dry-run=client -o yaml \
        --from-file="$certs/ca.pem" --from-file="$certs/$n.pem" --from-file="$certs/$n.key" ${extra[@]+"${extra[@]}"}
done
