#!/bin/bash
# deploy/docker/engine-test.sh [WORK]: docker compose on a real Docker engine (`make engine-test`).
#
# Starts an engine where none runs (engine.sh: docker.io installed with apt-get where missing),
# builds the image with no network (build.sh: wheelhouse, debootstrap base, BuildKit), then runs
# the compose project four times: star, the hierarchical profile, the sequential (Fed-CHS)
# profile, and star with mutual TLS from `fedhop certs` made by another user (keys 0600, owned by
# uid 4242).  Each run must exit 0 (the server's status), leave a complete run.db (no -wal file),
# a summary with the agreed ledger and the accuracy floor below, and nothing new in the checkout.
# Then everything is torn down: containers, networks, the daemon it started (by PID) and that
# daemon's iptables chains.  WORK (default a fresh temp dir) gets the runs, logs and results.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
work=${1:-$(mktemp -d /tmp/fedhop-engine-test.XXXXXX)}
mkdir -p "$work"
py=${FEDHOP_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
source deploy/docker/engine.sh
project=fedhop-engine-test

cleanup() {
    compose -p "$project" --profile hierarchical down -v --remove-orphans >/dev/null 2>&1 || true
    engine_down
}
trap cleanup EXIT

checkout_before=$(git status --porcelain --untracked-files=all 2>/dev/null || true)
t0=$(date +%s)
engine_up
deploy/docker/build.sh 2>"$work/build.log" || { tail -40 "$work/build.log" >&2; exit 1; }
tail -1 "$work/build.log" >&2
t_build=$(( $(date +%s) - t0 ))

# FEDHOP_ENGINE_SCENARIOS picks some (e.g. "mtls"); all four by default
wanted=" ${FEDHOP_ENGINE_SCENARIOS:-star hierarchical sequential mtls} "

# scenario NAME PROFILE FLOOR REPLICAS [VAR=VALUE ...]: one `compose up` on its own run folder
scenario() {
    local name=$1 profile=$2 floor=$3 replicas=$4
    shift 4
    [[ $wanted == *" $name "* ]] || return 0
    local runs="$work/runs-$name" status=0 t=$(date +%s)
    mkdir -p "$runs" && chown 10001:10001 "$runs"
    say "scenario $name: compose up (profile '${profile:-none}', $replicas client replicas)"
    env FEDHOP_RUNS_SRC="$runs" FEDHOP_RUN_NAME="$name" FEDHOP_SETTLE=2 FEDHOP_CLIENT_REPLICAS="$replicas" "$@" \
        bash -c 'source deploy/docker/engine.sh; compose -p "$0" ${1:+--profile "$1"} up --abort-on-container-exit --exit-code-from server' \
        "$project" "$profile" >"$work/$name.log" 2>&1 || status=$?
    compose -p "$project" --profile hierarchical down -v --remove-orphans >/dev/null 2>&1 || true
    "$py" - "$work" "$name" "$status" "$floor" "$(( $(date +%s) - t ))" <<'PY'
import json, sqlite3, sys
from pathlib import Path
work, name, status, floor, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
run = work / f"runs-{name}" / name
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
wal_left = (run / "run.db-wal").exists()    # before opening: a reader of a WAL database makes one
messages = 0
if (run / "run.db").exists():
    with sqlite3.connect(f"file:{run / 'run.db'}?mode=ro", uri=True) as db:
        messages = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
row = {"scenario": name, "exit_status": status, "seconds": seconds, "status": summary.get("status"),
       "topology": summary.get("topology"), "accuracy": summary.get("final", {}).get("test_accuracy"),
       "ledger_ok": summary.get("ledger_agreement", {}).get("ok"), "messages_in_run_db": messages,
       "wal_left": wal_left, "floor": floor,
       "mtls": "mtls = true" in (run / "config.toml").read_text() if (run / "config.toml").exists() else None}
row["ok"] = (status == 0 and row["status"] == "completed" and row["ledger_ok"] is True and messages > 0
             and not row["wal_left"] and (row["accuracy"] or 0) >= floor)
with open(work / "results.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
}

rm -f "$work/results.jsonl"
scenario star "" 0.85 4 FEDHOP_SET="run.rounds=10"
scenario hierarchical hierarchical 0.85 2 FEDHOP_CONFIG=/app/examples/hierfavg_digits.toml \
    FEDHOP_SET="run.rounds=10 topology.edges=2"
scenario sequential sequential 0.85 2 FEDHOP_CONFIG=/app/examples/fedchs_digits.toml \
    FEDHOP_SET="run.rounds=10 topology.edges=2"
# mutual TLS with certificates another user made: keys 0600 owned by uid 4242, mounted read-only
certs="$work/certs"
"$py" -m fedhop.deploy.cli certs "$certs" --nodes server,client-proc0,client-proc1 >/dev/null
chown -R 4242:4242 "$certs"
scenario mtls "" 0.85 2 FEDHOP_SET="run.rounds=10" FEDHOP_CERTS_SRC="$certs" FEDHOP_CERTS_DIR=/certs \
    FEDHOP_INSECURE=0 FEDHOP_MTLS=1

checkout_after=$(git status --porcelain --untracked-files=all 2>/dev/null || true)
"$py" - "$work" "$t_build" "$(( $(date +%s) - t0 ))" "$([ "$checkout_before" = "$checkout_after" ] && echo 1 || echo 0)" "$wanted" <<'PY'
import json, sys
from pathlib import Path
work, build_s, total_s, clean = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
mtls = next((r for r in rows if r["scenario"] == "mtls"), {})
wanted = sys.argv[5].split()
result = {"scenarios": rows, "engine_and_build_seconds": build_s, "total_seconds": total_s,
          "checkout_unchanged": clean, "ok": all(r["ok"] for r in rows) and [r["scenario"] for r in rows] == wanted
          and clean and mtls.get("mtls", True) is True}
(work / "results.json").write_text(json.dumps(result, indent=2))
print(json.dumps({k: v for k, v in result.items() if k != "scenarios"}))
sys.exit(0 if result["ok"] else 1)
PY
