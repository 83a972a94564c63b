"""DESIGN.md's layering rule, enforced: api → ragcache → blend, index; demo only via public APIs."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"blend": 0, "index": 0, "ragcache": 1, "api": 2}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_imports_only_point_down():
    bad = []
    for pkg, rank in RANK.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for mod in _imports(f):
                top = mod.split(".")[0]
                if top in RANK and top != pkg and RANK[top] >= rank:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_demo_code_uses_only_public_packages():
    for f in (ROOT / "demo").rglob("*.py"):
        assert all(m.split(".")[0] != "tests" for m in _imports(f)), f
