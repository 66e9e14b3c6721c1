"""The design docs under docs/ and the references to them.

Code, tests, notebooks and the top-level Markdown files cite the design docs as `docs/<name>.md`, optionally with a
section: `docs/algorithms.md §4` or `docs/algorithms.md §4.3`. Every cited file must exist and every cited section
must be a heading of that file (`## 4. ...`, `### 4.3 ...`). Nothing may cite the external contract the docs
replaced, or an issue number. docs/architecture.md must name every room (subpackage directory) of dblock/.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
THIS = Path(__file__).resolve()

SCAN_DIRS = ("dblock", "tests", "notebooks", "benchmarks")
SCAN_FILES = ("README.md", "BENCHMARKS.md", "SIMULATOR.md")
BINARY_SUFFIXES = {".safetensors", ".pt", ".bin", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".npz", ".npy", ".pyc",
                   ".so", ".gz", ".zip", ".whl"}
SKIP_DIRS = {"__pycache__", ".git", ".venv", "_build", ".ipynb_checkpoints", ".pytest_cache"}

REF = re.compile(r"docs/([A-Za-z0-9_-]+)\.md(?: §(\d+)(?:\.(\d+))?)?")
FORBIDDEN = [
    ("the old spec's sections", re.compile(r"SPEC\s§")),
    # the notes outside the repository, spelled so that this file does not cite them itself
    ("a path outside the repository", re.compile("shared" + r"/(SPEC|papers|reference)")),
    ("issue number", re.compile(r"\bissue (item )?[0-9]+")),
]

# The numbered scheme code cites (`docs/algorithms.md §N` / `§N.M`); kept stable.
ALGORITHMS_HEADINGS = [
    "## 1. Model families",
    "## 2. Step rules",
    "### 2.1 Threshold rule",
    "### 2.2 Fixed-k low-confidence rule",
    "### 2.3 Entropy-bound rule",
    "## 3. Schedules",
    "## 4. Epoch: the optimized executor",
    "### 4.1 Block plan",
    "### 4.2 Expert Atlas",
    "### 4.3 Liveness-Shard Parallelism",
    "### 4.4 FreshLane dispatch",
    "### 4.5 Configurations",
    "## 5. Equivalence",
    "## 6. Cost model",
]


def _tracked_paths() -> list[Path]:
    """Tracked files under the scanned directories plus the top-level Markdown files (git ls-files; os.walk when
    git or the repository is unavailable), and the docs themselves."""
    paths: list[Path] = []
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *SCAN_DIRS, *SCAN_FILES], cwd=ROOT,
                             capture_output=True, timeout=60)
        ok = out.returncode == 0 and out.stdout
    except (OSError, subprocess.SubprocessError):
        ok = False
    if ok:
        paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    else:
        for d in SCAN_DIRS:
            for dirpath, dirnames, filenames in os.walk(ROOT / d):
                dirnames[:] = [n for n in dirnames if n not in SKIP_DIRS and not n.startswith(".")]
                paths += [Path(dirpath) / f for f in filenames]
        paths += [ROOT / f for f in SCAN_FILES]
    paths += sorted(DOCS.glob("*.md"))
    seen, out_paths = set(), []
    for p in paths:
        rp = p.resolve()
        if rp == THIS or rp in seen or not rp.is_file() or rp.suffix.lower() in BINARY_SUFFIXES:
            continue
        seen.add(rp)
        out_paths.append(rp)
    return out_paths


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if path.suffix == ".ipynb":          # notebooks saved with ensure_ascii escape the section sign
        text = text.replace("\\u00a7", "§")
    return text


def _texts() -> list[tuple[str, str]]:
    out = []
    for p in _tracked_paths():
        t = _text(p)
        if t is not None:
            out.append((str(p.relative_to(ROOT)), t))
    return out


def _headings(doc: Path) -> list[str]:
    lines, fence = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6}\s", line):
            lines.append(line.rstrip())
    return lines


def _has_section(headings: list[str], major: str, minor: str | None) -> bool:
    if minor is None:
        pat = re.compile(rf"^#{{1,6}}\s+{major}\.(\s|$)")
    else:
        pat = re.compile(rf"^#{{1,6}}\s+{major}\.{minor}(\.|\s|$)")
    return any(pat.match(h) for h in headings)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_doc_references_resolve():
    texts = _texts()
    assert texts, "found no files to scan"
    heading_cache: dict = {}
    refs, problems = 0, []
    for rel, text in texts:
        for m in REF.finditer(text):
            refs += 1
            name, major, minor = m.group(1), m.group(2), m.group(3)
            doc = DOCS / f"{name}.md"
            where = f"{rel}:{_line_of(text, m.start())}: {m.group(0)!r}"
            if not doc.is_file():
                problems.append(f"{where}: docs/{name}.md does not exist")
                continue
            if major is None:
                continue
            if doc not in heading_cache:
                heading_cache[doc] = _headings(doc)
            if not _has_section(heading_cache[doc], major, minor):
                sec = major if minor is None else f"{major}.{minor}"
                problems.append(f"{where}: docs/{name}.md has no heading numbered {sec}")
    assert refs > 0, "no docs/<name>.md reference found anywhere: the scan is broken"
    assert not problems, "unresolved doc references:\n" + "\n".join(problems)


def test_no_external_contract_or_issue_references():
    problems = []
    for rel, text in _texts():
        for label, pat in FORBIDDEN:
            for m in pat.finditer(text):
                problems.append(f"{rel}:{_line_of(text, m.start())}: {label}: {m.group(0)!r}")
    assert not problems, "references to material outside the repository:\n" + "\n".join(problems)


def _subpackage_dirs() -> list[str]:
    """Directories directly under dblock/ that hold tracked files (or, without git, any non-hidden ones)."""
    names: set[str] = set()
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "dblock"], cwd=ROOT, capture_output=True, timeout=60)
        if out.returncode == 0 and out.stdout:
            for p in out.stdout.decode().split("\0"):
                parts = Path(p).parts
                if len(parts) > 2 and parts[0] == "dblock" and (ROOT / "dblock" / parts[1]).is_dir():
                    names.add(parts[1])
    except (OSError, subprocess.SubprocessError):
        pass
    if not names:
        for entry in os.scandir(ROOT / "dblock"):
            if entry.is_dir() and entry.name not in SKIP_DIRS and not entry.name.startswith((".", "_")):
                names.add(entry.name)
    return sorted(n for n in names if n not in SKIP_DIRS)


def test_architecture_names_every_subpackage():
    arch = DOCS / "architecture.md"
    assert arch.is_file(), "docs/architecture.md is missing"
    text = arch.read_text(encoding="utf-8")
    dirs = _subpackage_dirs()
    assert dirs, "found no subpackage directories under dblock/"
    missing = [d for d in dirs if f"{d}/" not in text]
    assert not missing, f"docs/architecture.md does not name these dblock/ rooms: {', '.join(missing)}"


def test_algorithms_keeps_its_numbered_scheme():
    doc = DOCS / "algorithms.md"
    assert doc.is_file(), "docs/algorithms.md is missing"
    headings = _headings(doc)
    missing = [h for h in ALGORITHMS_HEADINGS if h not in headings]
    assert not missing, "docs/algorithms.md lost headings that code cites: " + "; ".join(missing)
