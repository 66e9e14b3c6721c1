"""Execute the teaching notebooks and render them, with outputs, to HTML (`make notebooks`).

    python -m dblock.notebooks_render                      # every notebooks/*.ipynb -> notebooks/_build/*.html
    python -m dblock.notebooks_render --only 03 --timeout 300

The stored notebooks keep their outputs stripped (so diffs stay readable and nothing stale is ever shown); this
renders freshly executed copies for reading without Jupyter. The tests execute the same notebooks with the same
function (`execute`), so what renders is what the test suite checks.

Kernel: every notebook runs in a `python3` kernel whose interpreter is *this* Python (`sys.executable`), whatever
kernels the user has installed: `kernel_env` writes a throwaway kernel spec and puts it first on `JUPYTER_PATH`.
That is what makes `make test` / `make notebooks` work on a clean machine with nothing registered.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS_DIR = os.path.join(ROOT, "notebooks")
BUILD_DIR = os.path.join(NOTEBOOKS_DIR, "_build")
KERNEL_NAME = "python3"          # the name the notebooks' metadata asks for
DEFAULT_TIMEOUT = 300            # seconds per notebook (the tests use a tighter budget)


def notebooks(directory: str = NOTEBOOKS_DIR) -> list:
    """The notebooks to run, in name order (NN_title.ipynb)."""
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".ipynb"))


@contextlib.contextmanager
def kernel_env(python: str = sys.executable):
    """A `python3` kernel spec that runs `python`, first on JUPYTER_PATH for the duration of the block.

    jupyter_client looks up kernel specs on JUPYTER_PATH before the user's and the environment's own directories,
    so a user-level `python3` kernel of another interpreter cannot shadow the one whose packages (dblock, torch)
    the notebooks need. The kernel is told to use one intra-op thread as well (OMP_NUM_THREADS), matching the
    `torch.set_num_threads(1)` every notebook starts with.
    """
    tmp = tempfile.mkdtemp(prefix="dblock-kernel-")
    spec_dir = os.path.join(tmp, "kernels", KERNEL_NAME)
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": f"Python 3 ({python})", "language": "python",
                   "env": {"OMP_NUM_THREADS": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}},
                  f)
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = tmp + (os.pathsep + old if old else "")
    try:
        yield tmp
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
        shutil.rmtree(tmp, ignore_errors=True)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_text(exc: BaseException, last: int = 12) -> str:
    """The tail of a notebook error (nbclient's message: the failing cell and its traceback), without colours."""
    lines = _ANSI.sub("", str(exc)).strip().splitlines() or [type(exc).__name__]
    return "\n".join(lines[-last:])


def execute(path: str, timeout: int = DEFAULT_TIMEOUT):
    """Run a notebook top to bottom in a fresh kernel (working directory: the notebook's folder).

    Returns (executed notebook, seconds). Raises nbclient's CellExecutionError (its message holds the failing
    cell and traceback) on the first error, and nbclient's timeout error when one cell runs past `timeout`.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    with kernel_env():
        client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME,
                                resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
        client.execute()
    return nb, time.perf_counter() - t0


def to_html(nb, out_path: str, title: Optional[str] = None) -> str:
    """Write an executed notebook as a standalone HTML page (figures embedded)."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter()
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title or ""}})
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(body)
    return out_path


def _title(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def write_index(entries: list, out_dir: str) -> str:
    """notebooks/_build/index.html: one link per rendered notebook."""
    items = "\n".join(f'  <li><a href="{os.path.basename(html)}">{title}</a> ({name}, executed in {secs:.0f} s)</li>'
                      for name, title, html, secs in entries)
    path = os.path.join(out_dir, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write("<!doctype html>\n<html><head><meta charset='utf-8'><title>dblock notebooks</title></head>\n"
                f"<body>\n<h1>dblock teaching notebooks</h1>\n<ul>\n{items}\n</ul>\n</body></html>\n")
    return path


def render(paths: list, out_dir: str = BUILD_DIR, timeout: int = DEFAULT_TIMEOUT, say=print):
    """Execute and render each notebook. Returns (rendered, failed): [(name, title, html path, seconds)] and
    [(name, message)]; a failing notebook does not stop the others."""
    entries, failed = [], []
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        say(f"notebooks: executing {name} ...")
        try:
            nb, secs = execute(path, timeout)
        except Exception as e:  # nbclient's message carries the failing cell and its traceback
            failed.append((name, error_text(e)))
            say(f"notebooks: {name} FAILED ({type(e).__name__})")
            continue
        title = _title(nb, name)
        html = to_html(nb, os.path.join(out_dir, name + ".html"), title)
        say(f"notebooks: {name} ran in {secs:.1f} s -> {os.path.relpath(html)}")
        entries.append((name, title, html, secs))
    if entries:
        write_index(entries, out_dir)
    return entries, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dblock.notebooks_render",
                                 description="Execute the teaching notebooks and render them with outputs to HTML.")
    ap.add_argument("--only", nargs="*", default=None,
                    help="render only notebooks whose file name contains one of these strings (e.g. 01 epoch)")
    ap.add_argument("--notebooks", default=NOTEBOOKS_DIR, help="folder holding the .ipynb files")
    ap.add_argument("--out", default=BUILD_DIR, help="folder for the HTML pages (default notebooks/_build)")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="seconds allowed per cell")
    args = ap.parse_args(argv)
    paths = notebooks(args.notebooks)
    if args.only:
        paths = [p for p in paths if any(k in os.path.basename(p) for k in args.only)]
    if not paths:
        print(f"notebooks: nothing to render in {args.notebooks}" + (f" matching {args.only}" if args.only else ""),
              file=sys.stderr)
        return 2
    entries, failed = render(paths, args.out, args.timeout)
    if entries:
        print(f"notebooks: {len(entries)} rendered to {os.path.relpath(args.out)}/ (index.html)")
    for name, msg in failed:
        print(f"notebooks: {name} FAILED:\n{msg}", file=sys.stderr)
    if failed:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
