"""The docs site builds in strict mode, offline, with API pages read from the docstrings; a broken
link between pages or to a repository file fails the build (mkdocs.yml, docs/hooks.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
# Any network access (a theme's fonts, an inventory of another project's docs) fails the build.
OFFLINE = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], capture_output=True, text=True, env=OFFLINE, timeout=300)


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def test_the_docs_site_builds_in_strict_mode_with_api_pages_from_the_docstrings(tmp_path):
    site = tmp_path / "site"
    done = build(ROOT / "mkdocs.yml", site)
    assert done.returncode == 0, done.stderr
    home = text(site / "index.html")
    assert "QK normalization" in home and 'href="guide/' in home  # the README, its links into docs/ made site links
    assert "cdnjs" not in home  # nothing the page loads comes from the network
    mla = text(site / "api" / "layers" / "index.html")
    assert "absorbed" in mla and ":func:" not in mla and ":class:" not in mla  # docstrings, roles as code
    assert "mla_decode_with_kvcache" in text(site / "api" / "decode" / "index.html")
    assert "apply_latent_attention" in text(site / "api" / "interop" / "index.html")
    # A repository file a page links to is part of the site.
    assert (site / "repo" / "benchmarks" / "results" / "bench_decode_cpu.json").is_file()


def docs_copy(tmp_path: Path) -> Path:
    """mkdocs.yml, README, docs/ and the files they link to, in a scratch repository, without the API
    pages (mkdocstrings) so that a build takes about a second."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", repo / "docs", ignore=shutil.ignore_patterns("api"))
    shutil.copy(ROOT / "README.md", repo / "README.md")
    def scripts(folder, names):  # the benchmark scripts and their runs; results (with their scripts) stay
        if "results" in Path(folder).relative_to(ROOT / "benchmarks").parts:
            return []
        return [n for n in names if n.endswith(".py") or n in ("gpu", "runs")]
    shutil.copytree(ROOT / "benchmarks", repo / "benchmarks", ignore=scripts)
    for name in ("pyproject.toml", "mkdocs.yml"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / ".ci", repo / ".ci", ignore=shutil.ignore_patterns("venv*"))
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["plugins"] = ["search"]
    config["nav"] = [item for item in config["nav"] if "API" not in item]
    (repo / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return repo


@pytest.mark.parametrize("link, error", [("[the cache](cahce.md)", "cahce.md"),
                                         ("[a section](cache.md#no-such-section)", "no-such-section"),
                                         ("[results](../benchmarks/results/no_such_file.json)", "no_such_file.json")])
def test_a_broken_link_fails_the_build(tmp_path, link, error):
    repo = docs_copy(tmp_path)
    guide = repo / "docs" / "guide.md"
    guide.write_text(text(guide) + f"\nSee {link}.\n")
    done = build(repo / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and error in done.stderr, done.stderr
