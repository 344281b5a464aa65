"""The docs as a site and the README as its first page: `mkdocs build --strict` passes, every page is in the navigation,
the README stays short, keeps the Quickstart's two commands and links only to what exists. (Config keys and recipe
lines in every page: tests/orchestrator/test_config.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from tests import REPO
from tests.orchestrator.test_config import doc_pages, named_keys, readme_recipe_lines

DOCS = REPO / "docs"
README = REPO / "README.md"
QUICKSTART = [
    "bash tools/install.sh sglang && bash recipes/qwen_moe_grpo.sh engines.server=sglang",
    "bash tools/install.sh dev,sglang,slurm && python3 -m pytest",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading's text (what mkdocs and, for these headings, GitHub link to)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_every_page_is_in_the_nav_and_the_nav_names_only_pages():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))


def test_the_key_and_recipe_checks_read_every_page():
    """tests/orchestrator/test_config.py's checks (every key named exists, every recipe line loads) cover the README
    and every page."""
    assert set(doc_pages()) == {README, *DOCS.rglob("*.md")}
    where = {w for places in named_keys().values() for w in places}
    assert "docs/main-job.md" in where and any(w.startswith("docs/benchmarks/") for w in where)
    assert len(readme_recipe_lines()) >= 4


def test_the_readme_is_a_first_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert commands == QUICKSTART  # exactly the two Quickstart commands
    assert 'python3 -m pytest -m "not e2e"' in text  # the unit tier
    assert QUICKSTART[1] in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command verbatim


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    """Links to files and headings exist (mkdocs checks the pages too, where it is installed; this covers the README,
    whose links GitHub follows into docs/ and the code)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for groups in LINK.findall(text):
        target = groups[0] or groups[1]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, broken


def test_mkdocs_builds_the_site_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs comes with the dev extra")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
