"""The rooms' layers (docs/architecture.md, "Dependency rules"), as `import-linter` contracts in pyproject.toml.

`lint-imports` must keep every contract (imports inside functions count), with no ignore list; the layer table of
docs/architecture.md must be the layers contract; every room says what it is for; model files never import
torch.distributed (which `import-linter` cannot name: it sees an external package only by its top-level name).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):
    pytest.skip("import-linter 2.17 (the test extra installs it from Python 3.11 on) and tomllib need Python >= 3.11",
                allow_module_level=True)

import tomllib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dblock"


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def _layers_contract() -> dict:
    contracts = [c for c in _config()["contracts"] if c["type"] == "layers"]
    assert len(contracts) == 1, "pyproject.toml should hold exactly one layers contract"
    return contracts[0]


def _split_layer(text: str) -> list[str]:
    return sorted(part.strip() for part in re.split(r"[|:]", text))


def test_lint_imports_keeps_every_contract():
    script = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    cmd = [script] if os.path.isfile(script) else [
        sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                              "sys.exit(lint_imports_command())"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([*cmd, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, "lint-imports found broken contracts:\n" + out[-6000:]
    n = len(_config()["contracts"])
    assert f"Contracts: {n} kept, 0 broken." in out, out[-3000:]


def test_contracts_have_no_ignore_list_and_the_layers_name_every_room():
    cfg = _config()
    assert cfg["root_package"] == "dblock"
    for c in cfg["contracts"]:
        assert "ignore_imports" not in c, f"contract {c['name']!r} has an ignore list"
        assert "unmatched_ignore_imports_alerting" not in c
    layers = _layers_contract()
    assert layers["containers"] == ["dblock"] and layers.get("exhaustive") is True
    listed = {m for layer in layers["layers"] for m in _split_layer(layer)}
    rooms = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    rooms |= {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert listed == rooms, f"not in the layers: {sorted(rooms - listed)}; not a room: {sorted(listed - rooms)}"


def _doc_layers() -> list[list[str]]:
    """The layer table of docs/architecture.md as a list of layers (each a sorted list of rooms)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("| layer | rooms |")
    layers = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cell = re.split(r"(?<!\\)\|", line)[2]
        for group in re.split(r"[,;]", cell):
            names = [n.rstrip("/") for n in re.findall(r"`([^`]+)`", group)]
            if names:
                layers.append(sorted(names))
    return layers


def test_the_docs_layer_table_is_the_layers_contract():
    contract = [_split_layer(layer) for layer in _layers_contract()["layers"]]
    assert _doc_layers() == contract, "docs/architecture.md's layer table and pyproject.toml's layers differ"


def test_every_room_says_what_it_is_for():
    missing = [p.parent.name for p in sorted(PKG.glob("*/__init__.py"))
               if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert not missing, f"rooms whose __init__.py has no docstring: {missing}"


def test_model_files_never_import_torch_distributed():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("dblock", include_external_packages=True, cache_dir=None)
    model_rooms = ("dblock.reference", "dblock.kernels", "dblock.config", "dblock.gemma_config", "dblock.families",
                   "dblock.weights", "dblock.weights_read", "dblock.weights_write", "dblock.decoding",
                   "dblock.simulator")
    bad = []
    for mod in sorted(graph.modules):
        if not mod.startswith(model_rooms) or "torch" not in graph.find_modules_directly_imported_by(mod):
            continue
        for d in graph.get_import_details(importer=mod, imported="torch"):
            if "torch.distributed" in d["line_contents"] or "import distributed" in d["line_contents"]:
                bad.append(f"{mod} l.{d['line_number']}: {d['line_contents']}")
    assert not bad, "model files importing torch.distributed:\n" + "\n".join(bad)
