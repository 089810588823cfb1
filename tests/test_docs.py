"""The manual stays true: the configuration page is what its generator renders from ``Recover``, the
README stays short and links every page of docs/, and no relative link in them points nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from titan_recover.tools import config_doc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
OTHER_PAGES = (ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md")
"""Linked from the README beside the manual; their links are checked too."""
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def links(path: Path) -> list[str]:
    """The targets of a Markdown file's links and images, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def relative_targets(path: Path) -> list[tuple[str, Path]]:
    """Each relative link of ``path`` with the file it points at (its #fragment dropped)."""
    found = []
    for target in links(path):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        found.append((target, (path.parent / target.split("#", 1)[0]).resolve()))
    return found


def test_the_configuration_page_is_generated_from_the_recover_dataclass() -> None:
    page = config_doc.PAGE
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: run {config_doc.COMMAND}"
    assert page.read_text() == config_doc.render(), (
        f"{page.relative_to(ROOT)} is stale (the Recover dataclass changed): run {config_doc.COMMAND}"
    )


def test_every_recover_field_has_an_entry() -> None:
    text = config_doc.PAGE.read_text()
    keys = config_doc.read_keys()
    assert len(keys) >= 28
    assert [k.name for k in keys if f"### `{k.name}`" not in text] == []


def test_a_field_without_a_docstring_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "config.py"
    source.write_text('class Recover:\n    enable: bool = False\n    policy: str = \'balanced\'\n    """Doc."""\n')
    with pytest.raises(ValueError, match="Recover.enable has no docstring"):
        config_doc.read_keys(source)


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail into docs/"


def test_the_readme_links_every_page_of_the_manual() -> None:
    linked = {target for _, target in relative_targets(README)}
    missing = [p.name for p in pages() if p.resolve() not in linked]
    assert pages() and missing == [], f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("path", [README, *OTHER_PAGES, *pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_that_exist(path: Path) -> None:
    broken = [target for target, file in relative_targets(path) if not file.exists()]
    assert broken == [], f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_each_page_starts_with_a_title() -> None:
    untitled = [p.name for p in pages() if not p.read_text().startswith("# ")]
    assert untitled == [], f"docs pages that do not start with a '# Title' line: {untitled}"


ARCHITECTURE = DOCS / "architecture.md"
PACKAGE = ROOT / "titan_recover"
SUBPACKAGE_HEADING = re.compile(r"^### `([\w/]+)/`")
MODULE_NAME = re.compile(r"`([\w/]+\.py)`")


def architecture_modules() -> set[Path]:
    """Each ``.py`` file architecture.md names: under a ``### `sub/``` heading a bare or relative name is
    that subpackage's (or, failing that, the package's top level: ``recipes.py`` beside the rank's entry
    point), elsewhere the package's; a name that starts with a folder of the repository is the repository's."""
    named: set[Path] = set()
    here = PACKAGE
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("#"):
            heading = SUBPACKAGE_HEADING.match(line)
            here = PACKAGE / heading.group(1) if heading else PACKAGE
        for name in MODULE_NAME.findall(line):
            if "/" in name and (ROOT / name.split("/")[0]).is_dir():
                named.add(ROOT / name)
            else:
                named.add(next((p for p in (here / name, PACKAGE / name) if p.exists()), here / name))
    return named


def test_the_architecture_page_names_every_module() -> None:
    modules = {p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(p.relative_to(ROOT).as_posix() for p in modules - architecture_modules())
    assert missing == [], f"modules docs/architecture.md does not list (add each to its subpackage's table): {missing}"


def test_every_module_the_architecture_page_names_exists() -> None:
    gone = sorted(p.relative_to(ROOT).as_posix() for p in architecture_modules() if not p.exists())
    assert gone == [], f"docs/architecture.md names files that do not exist: {gone}"
