"""The teaching notebooks: stored with outputs stripped, and executed top to bottom so they cannot rot.

Each notebook runs in a fresh `python3` kernel on this interpreter (`dblock.notebooks_render.kernel_env`), exactly
as `make notebooks` runs it, and must finish without a cell error within NOTEBOOK_BUDGET_S. A notebook that needs a
bundled model which is not there fails up front, naming the model (it is never skipped).
"""
from __future__ import annotations

import os
import re

import nbformat
import pytest

from dblock import notebooks_render as nr
from dblock.weights_path import CHECKPOINTS_DIR

EXPECTED = ["01_block_diffusion.ipynb", "02_epoch_two_clocks.ipynb", "03_one_block_ahead.ipynb",
            "04_capacity_planning.ipynb"]
NOTEBOOK_BUDGET_S = 150      # whole notebook, on a shared 2-core CI machine (the target: < 90 s on a CPU)
CELL_TIMEOUT_S = 150
PATHS = [os.path.join(nr.NOTEBOOKS_DIR, n) for n in EXPECTED]


def _read(path):
    return nbformat.read(path, as_version=4)


def _code(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def test_the_four_notebooks_exist():
    assert sorted(os.path.basename(p) for p in nr.notebooks()) == EXPECTED


@pytest.mark.parametrize("path", PATHS, ids=EXPECTED)
def test_stored_without_outputs(path):
    nb = _read(path)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{os.path.basename(path)}: code cells {dirty} carry outputs or execution counts; " \
                      "store notebooks stripped (outputs only in notebooks/_build via `make notebooks`)"
    assert nb.metadata.get("kernelspec", {}).get("name") == nr.KERNEL_NAME


@pytest.mark.parametrize("path", PATHS, ids=EXPECTED)
def test_shape_single_thread_and_library(path):
    """First code cell pins torch to one thread; the notebook drives the library (imports dblock) and teaches in
    markdown (a title and at least as many markdown cells as a third of the code cells)."""
    nb = _read(path)
    code = _code(nb)
    assert "torch.set_num_threads(1)" in code[0].source, "the first code cell must call torch.set_num_threads(1)"
    src = "\n".join(c.source for c in code)
    assert re.search(r"^\s*(import dblock|from dblock[.\w]* import)", src, re.M), "the notebook must import dblock"
    md = [c for c in nb.cells if c.cell_type == "markdown"]
    assert md and md[0].source.startswith("# "), "the first cell is a markdown title"
    assert 3 * len(md) >= len(code)


def _bundled_models(nb) -> set:
    """Names passed to dblock.load("...") that are not paths: bundled checkpoints the notebook needs."""
    names = set()
    for c in _code(nb):
        for m in re.finditer(r"dblock\.load\(\s*[\"']([^\"']+)[\"']", c.source):
            if os.sep not in m[1] and "/" not in m[1]:
                names.add(m[1])
    return names


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=EXPECTED)
def test_executes_top_to_bottom(path):
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    name = os.path.basename(path)
    nb = _read(path)
    missing = sorted(m for m in _bundled_models(nb)
                     if not os.path.isfile(os.path.join(CHECKPOINTS_DIR, m, "config.json")))
    if missing:
        pytest.fail(f"{name} needs the bundled model(s) {', '.join(missing)}, missing from {CHECKPOINTS_DIR} "
                    f"(train it with `dblock train-tiny` and place it there)", pytrace=False)
    try:
        _, secs = nr.execute(path, timeout=CELL_TIMEOUT_S)
    except (CellExecutionError, CellTimeoutError) as e:
        pytest.fail(f"{name}: a cell failed:\n{nr.error_text(e, last=40)}", pytrace=False)
    print(f"{name}: executed in {secs:.1f} s")
    assert secs < NOTEBOOK_BUDGET_S, f"{name} took {secs:.0f} s (budget {NOTEBOOK_BUDGET_S} s)"


def test_render_writes_html(tmp_path):
    """`make notebooks` path: execute + nbconvert to HTML (+ index), on a two-cell notebook in a temporary folder."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": nr.KERNEL_NAME, "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Tiny\nA title."),
                nbformat.v4.new_code_cell("import sys, dblock\nprint('kernel python:', sys.executable)")]
    src = tmp_path / "nbs"
    src.mkdir()
    nbformat.write(nb, str(src / "00_tiny.ipynb"))
    out = tmp_path / "build"
    assert nr.main(["--notebooks", str(src), "--out", str(out), "--timeout", "120"]) == 0
    html = (out / "00_tiny.html").read_text(encoding="utf-8")
    import sys
    assert "kernel python:" in html and sys.executable in html     # executed, with this interpreter's kernel
    assert "00_tiny.html" in (out / "index.html").read_text(encoding="utf-8")
    assert nr.main(["--notebooks", str(src), "--out", str(out), "--only", "nothing-matches"]) == 2
