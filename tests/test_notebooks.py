"""The notebooks are code: each runs top to bottom on its tiny settings, and each paired
``.ipynb`` holds exactly the cells of its percent-format ``.py`` source, without outputs.

Notebooks run in a fresh kernel of the interpreter running the tests (ipykernel's own
``python3`` spec, not whatever kernel a user registered), in ``notebooks/``, with
``ATTNLAB_NOTEBOOK_TINY=1``, the Agg backend, rank promotion raising (as in ``conftest.py``)
and ``TMPDIR`` under pytest's temporary directory. A failing ``assert`` in a cell fails the
test. Tiny runs are dominated by XLA compilation, so the kernel compiles at backend
optimisation level 0 (the same programs, less optimised: about a third less time).
"""

import os
import pathlib
import time

import jupytext
import nbformat
import pytest
from tiers import cases

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9]*.py"))
CELL_TIMEOUT_S = 600


def _kernel_manager():
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    # No kernel directories: only the native python3 spec remains, which ipykernel builds
    # from sys.executable, so the kernel sees this environment's attnlab.
    specs = KernelSpecManager(kernel_dirs=[])
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)


def test_every_notebook_has_a_source():
    assert SOURCES, f"no notebooks found in {NOTEBOOKS}"
    stems = {p.stem for p in SOURCES}
    orphans = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb") if p.stem not in stems)
    assert not orphans, f"{orphans} have no percent-format .py source beside them"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_ipynb_is_in_sync_and_stripped(source):
    paired = source.with_suffix(".ipynb")
    fix = f"run: jupytext --sync {source.relative_to(REPO)}"
    assert paired.exists(), f"{paired.name} is missing; {fix}"
    expected = jupytext.read(source)
    stored = nbformat.read(paired, as_version=4)
    nbformat.validate(stored)
    cells = lambda nb: [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]
    assert cells(stored) == cells(expected), f"{paired.name} differs from {source.name}; {fix}"
    for i, cell in enumerate(stored.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{paired.name} cell {i} stores outputs; strip them"
            assert cell.execution_count is None, f"{paired.name} cell {i} has an execution count"


# Notebooks whose tiny form outgrows the fast tier, with the test that keeps their calls in it.
SLOW = {
    NOTEBOOKS / "09_model_surgery.py": "trains four tiny runs and times decoding (80 s of CPU); "
    "tests/test_surgery_run.py keeps surgery runs and freezing in the fast tier",
    NOTEBOOKS / "11_attention_transfer.py": "trains a tiny teacher, exports it and runs three "
    "tiny stages with decode timing; tests/test_lora.py and test_distill.py keep LoRA and the "
    "objectives in the fast tier",
    NOTEBOOKS / "10_look_inside.py": "trains a copying model and a QK-normed twin and compiles "
    "about ten probed programs (15 s of CPU cold); tests/test_inspect.py and test_patch.py keep "
    "capture and patching in the fast tier",
}


@pytest.mark.parametrize("source", cases(SOURCES, slow=SLOW), ids=lambda p: p.stem)
def test_notebook_runs_on_tiny_settings(source, monkeypatch, tmp_path):
    _execute(source, monkeypatch, tmp_path)


@pytest.mark.slow(reason="runs notebook 06 a second time (40 s of CPU), without ../shared")
def test_the_attention_maps_notebook_runs_without_the_shared_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_SHARED", str(tmp_path / "absent"))
    nb = _execute(NOTEBOOKS / "06_attention_maps.py", monkeypatch, tmp_path)
    said = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "training on the embedded corpus instead" in said
    assert "skipping the pretrained checkpoint part" in said


def _execute(source, monkeypatch, tmp_path):
    """Runs the notebook ``source`` on its tiny settings in a kernel of its own, shut down
    after it; the executed notebook."""
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient

    monkeypatch.setenv("ATTNLAB_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' work directories land here
    monkeypatch.setenv("JAX_NUMPY_RANK_PROMOTION", "raise")  # as strict as conftest.py
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_backend_optimization_level=0".strip())
    nb = jupytext.read(source)
    km = _kernel_manager()
    client = NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
    finally:  # a client given its kernel manager leaves the kernel running: it would hold
        # its memory (0.4-0.7 GB) and threads for the rest of the session
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
    print(f"{source.name}: {time.perf_counter() - start:.1f} s")
    return nb
