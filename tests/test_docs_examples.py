"""The documentation's examples run as written.

A ``python`` block of a page under ``docs/`` that follows the line
``<!-- runs in tests/test_docs_examples.py -->`` runs here, in the repository's folder (as
a reader runs it from a checkout), each page's blocks in order in one namespace, with
temporary files under pytest's temporary directory.
"""

import pathlib
import re
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = "<!-- runs in tests/test_docs_examples.py -->"
BLOCK = re.compile(re.escape(MARK) + r"\n```python\n(.*?)```", re.S)
PAGES = sorted(p for p in DOCS.rglob("*.md") if MARK in p.read_text())


def blocks(page: pathlib.Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_every_marked_block_is_a_python_block():
    assert PAGES
    for page in PAGES:
        text = page.read_text()
        assert len(blocks(page)) == text.count(MARK), f"{page}: a mark not before ```python"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks(page)):
        exec(compile(code, f"{page.relative_to(REPO)} block {i}", "exec"), namespace)  # noqa: S102


def test_a_metric_file_named_with_import_is_logged(tmp_path, monkeypatch, capsys):
    """The step-metrics guide: its metric class saved as ``my_metric.py``, then its
    ``attnlab train --import`` command as written (the experiment found in the checkout)."""
    import json
    import shlex

    from attnlab.cli import main

    page = (DOCS / "guides" / "step_metrics.md").read_text()
    metric = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class " in b)
    (tmp_path / "my_metric.py").write_text(metric)
    command = page.split("<!-- command runs in tests/test_docs_examples.py -->\n```bash\n")[1]
    command = command.split("```")[0].replace("\\\n", " ")
    argv = shlex.split(command.replace("experiments/", f"{REPO}/experiments/"))
    assert argv[:2] == ["attnlab", "train"] and "--import" in argv
    monkeypatch.chdir(tmp_path)
    argv += ["--no-progress", "--config.eval.sample_tokens=0", "--config.train.steps=2"]
    assert main(argv[1:]) == 0
    rows = (tmp_path / "runs" / "logit_rms" / "metrics.jsonl").read_text().splitlines()
    assert all("logit_rms" in json.loads(r) for r in rows if "train_loss" in r)
    saved = json.loads((tmp_path / "runs" / "logit_rms" / "config.json").read_text())
    assert str(tmp_path / "my_metric.py") in json.dumps(saved)  # eval and sample import it
    capsys.readouterr()
    assert main(["eval", "--workdir", str(tmp_path / "runs" / "logit_rms")]) == 0
