"""The documentation site (mkdocs.yml over docs/) builds with warnings as errors: CI's link check.

mkdocs.yml's `validation:` makes a link to a missing page, an anchor no heading of the target has,
an absolute link, and a page left out of the nav (or a nav entry without a page) each a warning,
and `--strict` fails the build on any warning.  The build runs as CI runs it, in a subprocess,
into a temporary folder (never into the checkout)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
mkdocs = pytest.importorskip("mkdocs", reason="mkdocs is not installed (the dev extra: pip install -e '.[dev]')")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed (the dev extra)")
yaml = pytest.importorskip("yaml")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _nav_pages(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _config() -> dict:
    # mkdocs.yml has no YAML tags (!ENV, !relative), so the plain loader reads it
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_site_builds_strict_with_every_nav_page(tmp_path):
    site = tmp_path / "site"
    done = _build(ROOT / "mkdocs.yml", site)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not re.search(r"^(WARNING|ERROR)", done.stderr, re.M), done.stderr
    pages = _nav_pages(_config()["nav"])
    assert len(pages) >= 30
    for page in pages:
        html = site / re.sub(r"\.md$", ".html", page)
        assert html.is_file() and html.stat().st_size > 1000, page
    # every Markdown file of docs/ is in the nav (the build warns otherwise; this names the file)
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), (on_disk - set(pages), set(pages) - on_disk)
    # the reference pages are the generated ones, rendered: every CLI command and config section
    cli = (site / "cli.html").read_text()
    assert 'id="fedhop-run"' in cli and 'id="fedhop-data-fetch"' in cli
    assert 'id="run"' in (site / "config.html").read_text()
    api = (site / "api-reference.html").read_text()
    assert "RunResult" in api and "RunFailed" in api and "load" in api


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The same config over a copy of docs/ with one bad link, then one bad anchor: exit 1, naming it."""
    for bad, named in (("[gone](no-such-page.md)", "no-such-page.md"),
                       ("[gone](config.md#no-such-heading)", "no-such-heading")):
        docs = tmp_path / "docs"
        if docs.exists():
            shutil.rmtree(docs)
        shutil.copytree(ROOT / "docs", docs)
        (docs / "index.md").write_text((docs / "index.md").read_text() + f"\n{bad}\n")
        config = _config()
        config["docs_dir"] = str(docs)
        for plugin in config["plugins"]:   # the API reference reads the source folders from the checkout
            if isinstance(plugin, dict) and "mkdocstrings" in plugin:
                plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
        (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
        done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert done.returncode != 0 and named in done.stderr, done.stderr


def test_readme_is_short_and_leads_into_the_site():
    """The README says what fedhop is, how to install it, run it, find and compare results, and
    links into the site for the rest; every page it links is a page of the site's nav."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    assert "make test" in readme and ".venv/bin/python -m pytest -q" in readme   # the test command .ci/run runs
    for command in ("fedhop examples copy", "fedhop run ", "fedhop report "):
        assert command in readme, command
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    nav = set(_nav_pages(_config()["nav"]))
    assert len(set(links)) >= 20
    for link in links:
        assert (ROOT / link).is_file() and link.removeprefix("docs/") in nav, link
    for page in nav:   # every tutorial and every reference page is one click from the README
        if page.startswith("tutorials/") or page in ("config.md", "cli.md", "api-reference.md", "run-folder.md"):
            assert f"docs/{page}" in links, page
