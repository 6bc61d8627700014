#!/bin/bash
# deploy/docker/engine-test.sh [WORK]: docker compose on a real Docker engine (`make engine-test`).
#
# Starts an engine where none runs (engine.sh: docker.io installed with apt-get where missing;
# shared with other runs, stopped by the last), makes `docker compose` (compose_setup), builds the
# image with no network (build.sh: wheelhouse, debootstrap base, BuildKit), then runs compose
# projects two or three at a time, each its own project name and run folder, so that every group
# also checks that runs at once are isolated.  Every run is `up --attach server --exit-code-from
# server` (the shape `fedhop compose` prints: the server's output, and its status; compose watches
# only that container, so another one's death ends nothing):
#   star + mtls            the README's shared-token quick try (FEDHOP_SECURITY=shared-token,
#                          FEDHOP_CLIENT_PROCESSES=auto, 3 replicas: config.toml must record 3
#                          processes; the mode announced in one line), and the command `fedhop compose`
#                          prints, run as printed (per-node credentials made by another user, uid 4242,
#                          keys 0600; FEDHOP_UID=4242): once run.db has a round, from inside a client
#                          container the server's port is called in plaintext, over TLS without a
#                          client key, and with the client's own key (only the last may reach the
#                          service), then one of the three client containers is killed (SIGKILL): the
#                          run must complete with status 0, the dead node's log in RUN/logs/, every
#                          file owned by uid 4242 and the run folder removable by that user;
#   hierarchical + sequential   the two profiles with edges (shared-token quick try);
#   crash + badconfig + refused + upedges   client replicas that fail at start (no restart, no
#                          hang: the run ends with a non-zero status within CRASH_LIMIT seconds), a bad
#                          config through deploy/docker/up.sh (per-node credentials; exit status 2, one
#                          line from the server's role), `docker compose up` with no security mode
#                          (refused: exit 2, one line naming `fedhop compose`, no process started), and
#                          up.sh with FEDHOP_EDGES=2 (hierarchical over per-node mutual TLS: up.sh
#                          starts the edges' profile itself; each edge's log in RUN/logs/).
# A completed scenario must exit 0 (the server's status), leave on the host a complete run.db (no
# -wal file), a summary with the agreed ledger and the accuracy floor, a config.toml whose
# clients.processes is the number of client replicas that wrote a ledger, each node's log in
# RUN/logs/, and nothing new in the checkout.  Then everything is torn down: containers, networks,
# the daemon it started (by PID) and that daemon's iptables chains.  WORK (default a fresh temp dir)
# gets the runs, logs and results.json.  FEDHOP_ENGINE_SCENARIOS picks some (e.g. "mtls crash").
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
    for name in star mtls hierarchical sequential crash badconfig refused upedges; do
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

wanted=" ${FEDHOP_ENGINE_SCENARIOS:-star mtls hierarchical sequential crash badconfig refused upedges} "
USER_ID=4242         # the user who made the credentials and ran `fedhop compose` (mtls)

# scenario NAME PROFILE FLOOR REPLICAS [VAR=VALUE ...]: `up --attach server --exit-code-from server`
# in its own project, its output (the server's) in WORK/NAME.log, every container's in
# WORK/NAME.all.log; the run folder is WORK/runs-NAME/PROJECT/NAME on the host
scenario() {
    local name=$1 profile=$2 floor=$3 replicas=$4
    shift 4
    local runs="$work/runs-$name" project="$prefix-$name" status=0 t=$(date +%s) files=(-f docker-compose.yml)
    mkdir -p "$runs/$project" && chown 10001:10001 "$runs/$project"
    [ "$name" = crash ] && files+=(-f "$work/crash.yml")
    local run=(env -u FEDHOP_SECURITY -u FEDHOP_INSECURE -u FEDHOP_CERTS_DIR -u FEDHOP_MTLS -u FEDHOP_UID
               -u FEDHOP_GID FEDHOP_RUNS_SRC="$runs" FEDHOP_RUN_NAME="$name" FEDHOP_SETTLE=2
               FEDHOP_CLIENT_REPLICAS="$replicas" "$@" docker compose "${files[@]}" -p "$project"
               ${profile:+--profile "$profile"})
    say "scenario $name: docker compose -p $project up --attach server --exit-code-from server (profile '${profile:-none}', $replicas client replicas)"
    "${run[@]}" up --attach server --exit-code-from server >"$work/$name.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) $replicas" >"$work/$name.status"
    "${run[@]}" logs --no-color >"$work/$name.all.log" 2>&1 || true
    compose -p "$project" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
}

# the command `fedhop compose` prints, as printed, with 3 client processes; mTLS probed from inside
# a client container and one client container killed once run.db has a round (mtls_watch)
mtls() {
    local certs="$work/certs" nodes="$work/nodes" runs="$work/runs-mtls" project="$prefix-mtls" status=0 t=$(date +%s)
    local files=(-f docker-compose.yml -f "$work/nodes/compose.yml")
    "$py" -m fedhop.deploy.cli.cli certs "$certs" --nodes server,client-proc0,client-proc1,client-proc2 >/dev/null
    FEDHOP_UID=$USER_ID FEDHOP_GID=$USER_ID FEDHOP_RUNS_SRC="$runs" \
        "$py" -m fedhop.deploy.cli.cli compose "$certs" --clients 3 --out "$nodes" >"$work/mtls.printed"
    chown -R "$USER_ID:$USER_ID" "$certs" "$nodes"
    mkdir -p "$runs" && chown "$USER_ID:$USER_ID" "$runs"     # the user's; PROJECT/ is made by the engine, as root
    local printed
    printed=$(sed -n 2p "$work/mtls.printed")
    say "scenario mtls: $printed"
    mtls_watch "$runs/$project/mtls/run.db" "$project" >"$work/mtls.watch" 2>&1 &
    local watcher=$!
    env -u FEDHOP_SECURITY -u FEDHOP_INSECURE -u FEDHOP_CERTS_DIR -u FEDHOP_MTLS -u FEDHOP_UID -u FEDHOP_GID \
        COMPOSE_PROJECT_NAME="$project" FEDHOP_RUNS_SRC="$runs" FEDHOP_RUN_NAME=mtls FEDHOP_SET="run.rounds=200" \
        bash -c "$printed" >"$work/mtls.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) 3" >"$work/mtls.status"
    wait "$watcher" || true
    local run=(env FEDHOP_RUNS_SRC="$runs" docker compose "${files[@]}" -p "$project")
    "${run[@]}" logs --no-color >"$work/mtls.all.log" 2>&1 || true
    "${run[@]}" ps -a --format '{{.Name}} {{.ExitCode}}' >"$work/mtls.containers" 2>/dev/null || true
    # what a client container (client-proc1, entrypoint run as in the run) can find: key files and CA/secret files
    "${run[@]}" run --rm --no-deps -T --user 0 --entrypoint sh client-proc1 -c 'fedhop-entrypoint true && find / \( -path /proc -o -path /sys -o -path /usr -o -path /opt/fedhop/lib \) -prune -o -type f \( -name "*.key" -o -name "*.cred" -o -name "ca.*" -o -name cluster.secret \) -print' \
        >"$work/mtls.creds" 2>"$work/mtls.creds.err" || echo "exit $?" >>"$work/mtls.creds.err"
    compose -p "$project" --profile hierarchical down --remove-orphans >/dev/null 2>&1 || true
}

# mtls_watch RUN_DB PROJECT: once RUN_DB has a round row (the run is under way), the probes from
# inside client-proc0, then SIGKILL to client-proc2's container; prints one JSON line
mtls_watch() {
    local db=$1 project=$2 rows=0 t=$(date +%s)
    while [ $(( $(date +%s) - t )) -lt 600 ]; do
        rows=$("$py" -c 'import sqlite3, sys
try:
    with sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=5) as db:
        print(db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])
except sqlite3.Error:
    print(0)' "$db" 2>/dev/null || echo 0)
        [ "${rows:-0}" -ge 1 ] && break
        sleep 0.2
    done
    local probes
    probes=$(docker exec "$project-client-proc0-1" python -c '
import grpc, json
d = "/run/fedhop-certs"
ca, key, cert = (open(f"{d}/{name}", "rb").read() for name in ("ca.pem", "client-proc0.key", "client-proc0.pem"))
def call(creds):
    ch = grpc.secure_channel("server:7000", creds) if creds else grpc.insecure_channel("server:7000")
    try:
        ch.unary_unary("/fedhop.Fedhop/Heartbeat")(b"", timeout=20)
        return "OK"
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {(exc.details() or str())[:200]}"
    finally:
        ch.close()
print(json.dumps({"plaintext": call(None), "tls_without_key": call(grpc.ssl_channel_credentials(ca)),
                  "tls_with_own_key": call(grpc.ssl_channel_credentials(ca, key, cert))}))' 2>&1 | tail -1)
    docker kill -s KILL "$project-client-proc2-1" >/dev/null 2>&1 || true
    "$py" -c 'import json, sys
try:
    probes = json.loads(sys.argv[2])
except ValueError:
    probes = {"error": sys.argv[2]}
print(json.dumps({"rounds_before_kill": int(sys.argv[1]), "probes": probes}))' "${rows:-0}" "$probes"
}

# the bad config through `make compose-up`'s script: its status is the server role's, 2
badconfig() {
    local status=0 t=$(date +%s)
    say "scenario badconfig: deploy/docker/up.sh with FEDHOP_SET=run.rounds=abc"
    env -u FEDHOP_SECURITY COMPOSE_PROJECT_NAME="$prefix-badconfig" FEDHOP_RUNS_SRC="$work/runs-badconfig" \
        FEDHOP_SET="run.rounds=abc" deploy/docker/up.sh >"$work/badconfig.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) 2" >"$work/badconfig.status"
}

# hierarchical FedAvg through `make compose-up`'s script with 2 edges and 2 client processes, per-node
# mutual TLS; COMPOSE_PROFILES unset, so up.sh must start the edges' profile itself
upedges() {
    local status=0 t=$(date +%s) runs="$work/runs-upedges"
    say "scenario upedges: deploy/docker/up.sh with FEDHOP_EDGES=2"
    mkdir -p "$runs"
    env -u FEDHOP_SECURITY -u COMPOSE_PROFILES COMPOSE_PROJECT_NAME="$prefix-upedges" FEDHOP_RUNS_SRC="$runs" \
        FEDHOP_RUN_NAME=upedges FEDHOP_EDGES=2 FEDHOP_CLIENT_REPLICAS=2 FEDHOP_CONFIG=/app/examples/hierfavg_digits.toml \
        FEDHOP_SET="run.rounds=10 topology.edges=2" deploy/docker/up.sh >"$work/upedges.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - t )) 2" >"$work/upedges.status"
}

# group A B ...: the wanted ones of A, B, ... at the same time
group() {
    local pids=() name
    for name in "$@"; do
        [[ $wanted == *" $name "* ]] || continue
        case "$name" in
        star) scenario star "" 0.85 3 FEDHOP_SECURITY=shared-token FEDHOP_SET="run.rounds=10" FEDHOP_CLIENT_PROCESSES=auto & ;;
        mtls) mtls & ;;
        hierarchical) scenario hierarchical hierarchical 0.85 2 FEDHOP_SECURITY=shared-token \
                          FEDHOP_CONFIG=/app/examples/hierfavg_digits.toml FEDHOP_SET="run.rounds=10 topology.edges=2" & ;;
        sequential) scenario sequential sequential 0.85 2 FEDHOP_SECURITY=shared-token \
                        FEDHOP_CONFIG=/app/examples/fedchs_digits.toml FEDHOP_SET="run.rounds=10 topology.edges=2" & ;;
        crash)
            # client replicas that fail at start (a slot outside the layout), after the server has started;
            # the server then waits FEDHOP_REGISTER_TIMEOUT for their registrations and fails
            printf 'services:\n  client:\n    environment:\n      FEDHOP_SLOT: "99"\n' >"$work/crash.yml"
            scenario crash "" 0 2 FEDHOP_SECURITY=shared-token FEDHOP_REGISTER_TIMEOUT=40 FEDHOP_SET="run.rounds=10" &
            ;;
        badconfig) badconfig & ;;
        refused) scenario refused "" 0 2 FEDHOP_SET="run.rounds=10" & ;;   # no security mode named
        upedges) upedges & ;;
        esac
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || true; done
}

group star mtls
group hierarchical sequential
group crash badconfig refused upedges

checkout_after=$(git status --porcelain --untracked-files=all 2>/dev/null; ls wheelhouse build runs 2>/dev/null || true)
"$py" - "$work" "$t_build" "$(( $(date +%s) - t0 ))" "$([ "$checkout_before" = "$checkout_after" ] && echo 1 || echo 0)" \
    "$wanted" "$prefix" "$CRASH_LIMIT" "$USER_ID" <<'PY'
import json, os, sqlite3, subprocess, sys, tomllib
from pathlib import Path
work, build_s, total_s, clean = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
wanted, prefix, crash_limit, user_id = sys.argv[5].split(), sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
FLOOR = 0.85
SHARED = "SHARED-TOKEN MODE"
rows = []
for name in wanted:
    status, seconds, replicas = map(int, (work / f"{name}.status").read_text().split())
    log = (work / f"{name}.log").read_text(errors="replace")
    row = {"scenario": name, "exit_status": status, "seconds": seconds}
    every = log + ((work / f"{name}.all.log").read_text(errors="replace") if (work / f"{name}.all.log").exists() else "")
    if name == "crash":      # clients failing at start: the run fails (no registrations), no restart loop, no hang
        row["ok"] = status != 0 and seconds <= crash_limit and "FEDHOP_SLOT='99'" in every and "Traceback" not in every
        rows.append(row)
        continue
    if name == "badconfig":  # one line naming the key, status 2 through up.sh
        lines = [ln for ln in log.splitlines() if "fedhop.deploy.launch.role server:" in ln]
        row["error_line"] = lines[0].split("|", 1)[-1].strip() if lines else None
        row["ok"] = status == 2 and len(lines) == 1 and "run.rounds" in lines[0] and "Traceback" not in log
        rows.append(row)
        continue
    if name == "refused":    # no security mode named: one line naming `fedhop compose`, nothing started
        lines = [ln for ln in log.splitlines() if ln.startswith("server-1") and "fedhop-entrypoint:" in ln]
        row["server_lines"] = [ln.split("|", 1)[-1].strip() for ln in lines]
        row["ok"] = (status == 2 and len(lines) == 1 and "no security mode" in lines[0] and "fedhop compose" in lines[0]
                     and "role-" not in every and "Traceback" not in every
                     and not list((work / "runs-refused").rglob("run.db")))
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
    logs = sorted(p.stem for p in (run / "logs").glob("*.log")) if run.is_dir() else []
    row.update({"status": summary.get("status"), "topology": summary.get("topology"),
                "accuracy": summary.get("final", {}).get("test_accuracy"),
                "rounds_completed": summary.get("rounds_completed"),
                "ledger_ok": summary.get("ledger_agreement", {}).get("ok"), "messages_in_run_db": messages,
                "wal_left": wal_left, "floor": FLOOR, "run_dir": str(run), "logs": logs,
                "recorded_processes": config.get("clients", {}).get("processes"), "client_ledgers": len(ledgers),
                "mtls": config.get("security", {}).get("mtls"),
                "insecure": config.get("security", {}).get("insecure"),
                "shared_token_announced": sum(SHARED in ln for ln in log.splitlines())})
    row["ok"] = (status == 0 and row["status"] == "completed" and row["ledger_ok"] is True and messages > 0
                 and not wal_left and (row["accuracy"] or 0) >= FLOOR
                 and row["recorded_processes"] == row["client_ledgers"] == replicas     # the config is what ran
                 and "server" in logs and set(ledgers) <= set(logs))                     # every node's log kept
    if name == "upedges":    # up.sh: per-node mutual TLS, the edges started and logged
        row["ok"] = (row["ok"] and row["mtls"] is True and row["insecure"] is not True
                     and row["shared_token_announced"] == 0 and row["topology"] == "hierarchical"
                     and {"edge-0", "edge-1"} <= set(logs))
    elif name != "mtls":     # the quick try: plaintext with a shared token, said once (by the server's container)
        row["ok"] = row["ok"] and row["insecure"] is True and row["shared_token_announced"] == 1
    rows.append(row)
mtls = next((r for r in rows if r["scenario"] == "mtls"), {})
if mtls:
    # what a client container (client-proc1) holds: its own key and credential and the CA's certificate
    found = sorted(set((work / "mtls.creds").read_text().split())) if (work / "mtls.creds").exists() else []
    mtls["client_1_sees"] = found
    names = {p.rsplit("/", 1)[-1] for p in found}
    creds_ok = ({"/certs/client-proc1.key", "/run/fedhop-certs/client-proc1.key"} <= set(found)
                and not names & {"ca.key", "issuer.key", "cluster.secret"}
                and {n for n in names if n.endswith(".key")} == {"client-proc1.key"}
                and {n for n in names if n.endswith(".cred")} == {"client-proc1.cred"})
    # from inside client-proc0 while the run was under way: plaintext and TLS without a client key refused,
    # its own key reaches the service; then client-proc2's container killed
    lines = (work / "mtls.watch").read_text().strip().splitlines() if (work / "mtls.watch").exists() else []
    watch = json.loads(lines[-1]) if lines else {}
    mtls.update(watch)
    probes = watch.get("probes", {})
    refused = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    probes_ok = (str(probes.get("plaintext")).startswith(refused) and str(probes.get("tls_without_key")).startswith(refused)
                 and not str(probes.get("tls_with_own_key", "UNAVAILABLE")).startswith(refused))
    containers = dict(ln.rsplit(" ", 1) for ln in (work / "mtls.containers").read_text().splitlines()
                      if " " in ln) if (work / "mtls.containers").exists() else {}
    mtls["containers"] = containers
    names_ok = set(containers) == {f"{prefix}-mtls-{s}-1" for s in ("server", "client-proc0", "client-proc1",
                                                                      "client-proc2")}
    killed_ok = (containers.get(f"{prefix}-mtls-client-proc2-1") == "137"
                 and 1 <= watch.get("rounds_before_kill", 0) < (mtls.get("rounds_completed") or 0))
    run = Path(mtls["run_dir"])
    dead_log = run / "logs" / "client-proc2.log"
    mtls["dead_node_log_bytes"] = dead_log.stat().st_size if dead_log.exists() else 0
    project_dir = run.parent
    owners = {p.stat().st_uid for p in [project_dir, *project_dir.rglob("*")]}
    mtls["owners"] = sorted(owners)
    mtls["model_mode"] = oct((run / "model.safetensors").stat().st_mode & 0o777) if (run / "model.safetensors").exists() else None
    mtls["ok"] = (mtls["ok"] and creds_ok and probes_ok and names_ok and killed_ok and mtls["mtls"] is True
                  and mtls["insecure"] is not True and mtls["shared_token_announced"] == 0
                  and mtls["dead_node_log_bytes"] > 0 and owners == {user_id})
    mtls["removable_by_user"] = None
    if mtls["ok"]:
        # the user who started it removes the project's run folder: moved first (with its parent, the
        # user's folder) under a folder anyone may enter, as WORK may be private to root (pytest's tmp_path)
        import shutil, tempfile
        with tempfile.TemporaryDirectory(prefix="fedhop-engine-rm-") as open_dir:
            os.chmod(open_dir, 0o755)
            moved = Path(shutil.move(str(project_dir.parent), open_dir)) / project_dir.name
            rm = subprocess.run(["setpriv", f"--reuid={user_id}", f"--regid={user_id}", "--clear-groups", "rm", "-rf",
                                 str(moved)], capture_output=True, text=True)
            mtls["removable_by_user"] = rm.returncode == 0 and not moved.exists()
            mtls["rm_stderr"] = rm.stderr[-300:]
        mtls["ok"] = mtls["removable_by_user"]
    mtls["checks"] = {"creds": creds_ok, "probes": probes_ok, "names": names_ok, "killed_mid_run": killed_ok}
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
