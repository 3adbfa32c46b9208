"""The documentation site: it builds with ``mkdocs build --strict`` (a broken link, a public
name without a docstring or without an API entry fails it), and its coverage check finds
what is missing. Skipped cleanly without the ``dev`` extra's mkdocs packages."""

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
HOOK = REPO / "docs" / "hooks" / "api_coverage.py"

pytest.importorskip("mkdocs", reason="the documentation tools come with the dev extra")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")


def _hook():
    spec = importlib.util.spec_from_file_location("api_coverage", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring_and_an_entry():
    assert list(_hook().problems(REPO / "docs" / "api")) == []


def test_the_check_names_what_is_missing(tmp_path):
    (tmp_path / "api.md").write_text("::: attnlab.ModelConfig\n\n::: attnlab.no_such_name\n")
    found = list(_hook().problems(tmp_path))
    assert "api.md: '::: attnlab.no_such_name' names nothing importable" in found
    assert "attnlab.generate has no '::: ' entry under docs/api/" in found
    assert "attnlab.ops.MaskSpec has no '::: ' entry under docs/api/" in found
    assert not any(line.startswith("attnlab.ModelConfig ") for line in found)


def test_the_shapes_page_lists_every_letter_of_the_key():
    import re

    from attnlab import dims

    letters = re.findall(r"^([A-Z])  +\S", dims.__doc__, re.M)
    page = (REPO / "docs" / "concepts" / "shapes.md").read_text()
    assert len(letters) > 10
    assert [x for x in letters if f"| `{x}` |" not in page] == []


def _build(config_file, site_dir):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(config_file), site_dir=str(site_dir), strict=True))


def test_site_builds_strict(tmp_path):
    _build(REPO / "mkdocs.yml", tmp_path / "site")
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "attnlab.generate" in api and "attnlab.ModelConfig" in api
    assert (tmp_path / "site" / "concepts" / "kv_cache" / "index.html").exists()
    # every API page renders its entries (a page of directives that resolve nothing is empty)
    for page in sorted((REPO / "docs" / "api").glob("*.md")):
        html = tmp_path / "site" / "api" / ("" if page.stem == "index" else page.stem)
        rendered = (html / "index.html").read_text()
        assert rendered.count('class="doc doc-heading"') >= 5, page.name


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The site's own link validation, on a page that links to nothing."""
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md)\n")
    import yaml

    validation = yaml.safe_load((REPO / "mkdocs.yml").read_text())["validation"]
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "validation": validation}))
    with pytest.raises(Abort):
        _build(config, tmp_path / "site")
