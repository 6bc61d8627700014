#!/bin/bash
# deploy/docker/engine-test.sh [WORK]: docker compose on a real Docker engine (`make engine-test`).
#
# Starts an engine where none runs (engine.sh: docker.io installed with apt-get where missing;
# shared with other runs, stopped by the last), makes `docker compose` (compose_setup), builds the
# image with no network (build.sh: wheelhouse, debootstrap base, BuildKit), then runs compose
# projects two at a time, each its own project name and run folder, so that every pair also
# checks that runs at once are isolated:
#   star + mtls            the README's `docker compose up ...` as written (FEDHOP_CLIENT_PROCESSES=auto,
#                          3 replicas: config.toml must record 3 processes), and mutual TLS from
#                          `fedhop certs` made by another user (keys 0600, owned by uid 4242);
#   hierarchical + sequential   the two profiles with edges;
#   crash + badconfig      client replicas that fail at start (no restart, no hang: compose ends with a
#                          non-zero status within CRASH_LIMIT seconds), and a bad config through
#                          deploy/docker/up.sh (exit status 2, one line from the server's role).
# A completed scenario must exit 0 (the server's status), leave on the host a complete run.db (no
# -wal file), a summary with the agreed ledger and the accuracy floor, a config.toml whose
# clients.processes is the number of client replicas that wrote a ledger, and nothing new in the
# checkout.  Then everything is torn down: containers, networks, the daemon it started (by PID)
# and that daemon's iptables chains.  WORK (default a fresh temp dir) gets the runs, logs and
# results.json.  FEDHOP_ENGINE_SCENARIOS picks some (e.g. "mtls crash").
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-$(mktemp -d /tmp/fedhop-engine-test.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
py=${FEDHOP_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export FEDHOP_PYTHON=$py
source deploy/docker/engine.sh
prefix=fedhop-engine-test-$$
CRASH_LIMIT=${FEDHOP_CRASH_LIMIT:-180}

cleanup() {
    local name
    for name in star mtls hierarchical sequential crash badconfig; do
        compose -p "$prefix-$name" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
    done
    engine_down
}
trap cleanup EXIT

checkout_before=$(git status --porcelain --untracked-files=all 2>/dev/null; ls wheelhouse build runs 2>/dev/null || true)
t0=$(date +%s)
compose_setup
engine_up
deploy/docker/build.sh 2>"$work/build.log" || { tail -40 "$work/build.log" >&2; exit 1; }
tail -1 "$work/build.log" >&2
t_build=$(( $(date +%s) - t0 ))

wanted=" ${FEDHOP_ENGINE_SCENARIOS:-star mtls hierarchical sequential crash badconfig} "

# scenario NAME PROFILE FLOOR REPLICAS [VAR=VALUE ...]: one `docker compose up` as the README has
# it, in its own project; the run folder is WORK/runs-NAME/PROJECT/NAME on the host
scenario() {
    local name=$1 profile=$2 floor=$3 replicas=$4
    shift 4
    local runs="$work/runs-$name" project="$prefix-$name" status=0 t=$(date +%s) extra=()
    mkdir -p "$runs/$project" && chown 10001:10001 "$runs/$project"
    [ "$name" = crash ] && extra=(-f docker-compose.yml -f "$work/crash.yml")
    [ "$name" = mtls ] && extra=(-f docker-compose.yml -f "$work/nodes/compose.yml")
    say "scenario $name: docker compose -p $project up (profile '${profile:-none}', $replicas client replicas)"
    env FEDHOP_RUNS_SRC="$runs" FEDHOP_RUN_NAME="$name" FEDHOP_SETTLE=2 FEDHOP_CLIENT_REPLICAS="$replicas" "$@" \
        docker compose "${extra[@]}" -p "$project" ${profile:+--profile "$profile"} \
        up --abort-on-container-exit --exit-code-from server >"$work/$name.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) $replicas" >"$work/$name.status"
    compose -p "$project" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
}

# the bad config through `make compose-up`'s script: its status is the server role's, 2
badconfig() {
    local status=0 t=$(date +%s)
    say "scenario badconfig: deploy/docker/up.sh with FEDHOP_SET=run.rounds=abc"
    env COMPOSE_PROJECT_NAME="$prefix-badconfig" FEDHOP_RUNS_SRC="$work/runs-badconfig" \
        FEDHOP_SET="run.rounds=abc" deploy/docker/up.sh >"$work/badconfig.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) 2" >"$work/badconfig.status"
}

# pair A B: the wanted ones of A and B at the same time
pair() {
    local pids=() name
    for name in "$1" "$2"; do
        [[ $wanted == *" $name "* ]] || continue
        case "$name" in
        star) scenario star "" 0.85 3 FEDHOP_SET="run.rounds=10" FEDHOP_CLIENT_PROCESSES=auto & ;;
        mtls)
            # per-node credentials (`fedhop compose`): client-0 and client-1 are services of their own,
            # each mounting ca.pem and its own pair only; then, from inside a client-1 container
            # (entrypoint run as in the scenario), every key file and CA/secret file it can find
            local certs="$work/certs"
            "$py" -m fedhop.deploy.cli certs "$certs" --nodes server,client-proc0,client-proc1 >/dev/null
            "$py" -m fedhop.deploy.cli compose "$certs" --clients 2 --out "$work/nodes" >/dev/null
            chown -R 4242:4242 "$certs" "$work/nodes"
            ( scenario mtls "" 0.85 2 FEDHOP_SET="run.rounds=10" FEDHOP_CERTS_DIR=/certs \
                FEDHOP_INSECURE=0 FEDHOP_MTLS=1
              env FEDHOP_RUNS_SRC="$work/runs-mtls" FEDHOP_CERTS_DIR=/certs docker compose \
                  -f docker-compose.yml -f "$work/nodes/compose.yml" -p "$prefix-mtls" run --rm --no-deps -T \
                  --user 0 --entrypoint sh client-1 -c 'fedhop-entrypoint true && find / \( -path /proc -o -path /sys -o -path /usr -o -path /opt/fedhop/lib \) -prune -o -type f \( -name "*.key" -o -name "*.cred" -o -name "ca.*" -o -name cluster.secret \) -print' \
                  >"$work/mtls.creds" 2>"$work/mtls.creds.err" || echo "exit $?" >>"$work/mtls.creds.err"
              compose -p "$prefix-mtls" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true ) &
            ;;
        hierarchical) scenario hierarchical hierarchical 0.85 2 FEDHOP_CONFIG=/app/examples/hierfavg_digits.toml \
                          FEDHOP_SET="run.rounds=10 topology.edges=2" & ;;
        sequential) scenario sequential sequential 0.85 2 FEDHOP_CONFIG=/app/examples/fedchs_digits.toml \
                        FEDHOP_SET="run.rounds=10 topology.edges=2" & ;;
        crash)
            # client replicas that fail at start (a slot outside the layout), after the server has started
            printf 'services:\n  client:\n    environment:\n      FEDHOP_SLOT: "99"\n' >"$work/crash.yml"
            scenario crash "" 0 2 FEDHOP_SET="run.rounds=10" &
            ;;
        badconfig) badconfig & ;;
        esac
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || true; done
}

pair star mtls
pair hierarchical sequential
pair crash badconfig

checkout_after=$(git status --porcelain --untracked-files=all 2>/dev/null; ls wheelhouse build runs 2>/dev/null || true)
"$py" - "$work" "$t_build" "$(( $(date +%s) - t0 ))" "$([ "$checkout_before" = "$checkout_after" ] && echo 1 || echo 0)" \
    "$wanted" "$prefix" "$CRASH_LIMIT" <<'PY'
import json, sqlite3, sys, tomllib
from pathlib import Path
work, build_s, total_s, clean = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
wanted, prefix, crash_limit = sys.argv[5].split(), sys.argv[6], int(sys.argv[7])
FLOOR = 0.85
rows = []
for name in wanted:
    status, seconds, replicas = map(int, (work / f"{name}.status").read_text().split())
    log = (work / f"{name}.log").read_text(errors="replace")
    row = {"scenario": name, "exit_status": status, "seconds": seconds}
    if name == "crash":      # the failing client ends the run: no restart loop, no hang
        row["ok"] = status != 0 and seconds <= crash_limit and "FEDHOP_SLOT='99'" in log and "Traceback" not in log
        rows.append(row)
        continue
    if name == "badconfig":  # one line naming the key, status 2 through up.sh
        lines = [ln for ln in log.splitlines() if "fedhop.deploy.role server:" in ln]
        row["error_line"] = lines[0].split("|", 1)[-1].strip() if lines else None
        row["ok"] = status == 2 and len(lines) == 1 and "run.rounds" in lines[0] and "Traceback" not in log
        rows.append(row)
        continue
    run = work / f"runs-{name}" / f"{prefix}-{name}" / name
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    wal_left = (run / "run.db-wal").exists()    # before opening: a reader of a WAL database makes one
    messages = 0
    if (run / "run.db").exists():
        with sqlite3.connect(f"file:{run / 'run.db'}?mode=ro", uri=True) as db:
            messages = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    config = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").exists() else {}
    ledgers = sorted(p.stem for p in (run / "ledger").glob("client-proc*.jsonl")) if run.is_dir() else []
    row.update({"status": summary.get("status"), "topology": summary.get("topology"),
                "accuracy": summary.get("final", {}).get("test_accuracy"),
                "ledger_ok": summary.get("ledger_agreement", {}).get("ok"), "messages_in_run_db": messages,
                "wal_left": wal_left, "floor": FLOOR, "run_dir": str(run),
                "recorded_processes": config.get("clients", {}).get("processes"), "client_ledgers": len(ledgers),
                "mtls": config.get("security", {}).get("mtls")})
    row["ok"] = (status == 0 and row["status"] == "completed" and row["ledger_ok"] is True and messages > 0
                 and not wal_left and (row["accuracy"] or 0) >= FLOOR
                 and row["recorded_processes"] == row["client_ledgers"] == replicas)   # the config is what ran
    rows.append(row)
mtls = next((r for r in rows if r["scenario"] == "mtls"), {})
if mtls:     # what a client container (client-1) holds: its own key and credential and the CA's certificate
    found = sorted(set((work / "mtls.creds").read_text().split())) if (work / "mtls.creds").exists() else []
    mtls["client_1_sees"] = found
    names = {p.rsplit("/", 1)[-1] for p in found}
    mtls["ok"] = (mtls["ok"] and {"/certs/client-proc1.key", "/run/fedhop-certs/client-proc1.key"} <= set(found)
                  and not names & {"ca.key", "issuer.key", "cluster.secret"}
                  and {n for n in names if n.endswith(".key")} == {"client-proc1.key"}
                  and {n for n in names if n.endswith(".cred")} == {"client-proc1.cred"})
result = {"scenarios": rows, "engine_and_build_seconds": build_s, "total_seconds": total_s,
          "checkout_unchanged": clean,
          "ok": all(r["ok"] for r in rows) and [r["scenario"] for r in rows] == wanted
          and clean and mtls.get("mtls", True) is True}
(work / "results.json").write_text(json.dumps(result, indent=2))
print(json.dumps({k: v for k, v in result.items() if k != "scenarios"}))
for r in rows:
    print(json.dumps(r))
sys.exit(0 if result["ok"] else 1)
PY
