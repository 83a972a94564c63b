"""DESIGN.md's layering rule, enforced: api → ragcache → blend, index, and inside ragcache one rule per room;
demo/ only through the public API. Each rule is checked against a file that breaks it, so none holds vacuously."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"blend": 0, "index": 0, "ragcache": 1, "api": 2}

# ragcache's rooms (a folder, or a module at the top) and the rooms each may import besides itself; every room
# may import blend and index. Arrows point down this table's order, so there is no circle.
BASE = {"config", "errors", "meta", "database"}
ROOMS: dict[str, set[str]] = {
    "config": set(),
    "errors": set(),
    "meta": {"errors"},
    "database": {"errors", "meta"},
    "store": BASE,
    "corpus": BASE,
    "lead": BASE,
    "parts": BASE | {"store", "lead"},
    "evaluation": BASE | {"store", "corpus", "lead"},
    "serving": BASE | {"store", "corpus"},
    "jobs": BASE | {"store", "corpus", "parts"},
    "cache_admin": BASE | {"corpus"},
    "service": BASE | {"store", "corpus", "parts", "serving", "jobs", "cache_admin"},
    "__init__": {"config", "service"},
    "bench": BASE | {"store", "corpus", "parts", "evaluation", "serving", "jobs", "service"},
    "demo": BASE | {"store", "corpus", "parts", "evaluation", "jobs", "service"},
    "commands": BASE | {"store", "corpus", "parts", "evaluation", "serving", "jobs", "service", "bench", "demo"},
    "cli": set(),  # filled below: the command reaches every room
}
ROOMS["cli"] = set(ROOMS) - {"cli", "__init__"}
FOLDERS = [room for room in ROOMS if (ROOT / "ragcache" / room).is_dir()]
PUBLIC = {"ragcache": {"RagCache", "Settings"}}  # what demo/ may import of ours


def imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every module `path` imports, relative imports resolved to absolute names (`from . import x` → pkg.x)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:
                out += [f"{mod}.{a.name}" for a in node.names]
            else:
                out.append(mod)
                out += [f"{mod}.{a.name}" for a in node.names if (root / mod.replace(".", "/") / a.name).is_dir()
                        or (root / mod.replace(".", "/") / f"{a.name}.py").is_file()]
    return out


def room_of(module: str) -> str | None:
    """`ragcache.serving.scheduler` → `serving`; `ragcache` itself → `__init__`; None outside ragcache."""
    parts = module.split(".")
    if parts[0] != "ragcache":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def package_violations(root: Path) -> list[str]:
    bad = []
    for pkg, rank in RANK.items():
        for f in (root / pkg).rglob("*.py"):
            for mod in imports(f, root):
                top = mod.split(".")[0]
                if top in RANK and top != pkg and RANK[top] >= rank:
                    bad.append(f"{f.relative_to(root)} imports {mod}")
    return bad


def room_violations(root: Path) -> list[str]:
    bad = []
    for f in (root / "ragcache").rglob("*.py"):
        room = room_of(".".join(f.relative_to(root).with_suffix("").parts))
        if room not in ROOMS:
            bad.append(f"{f.relative_to(root)} is in no room of the layering rule: add it to ROOMS")
            continue
        for mod in imports(f, root):
            other = room_of(mod)
            if other is not None and other != room and other not in ROOMS[room]:
                bad.append(f"{f.relative_to(root)} ({room}) imports {mod} ({other})")
    return bad


def demo_violations(root: Path) -> list[str]:
    bad = []
    for f in (root / "demo").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in PUBLIC and node.level == 0:
                bad += [f"{f.relative_to(root)} imports {node.module}.{a.name}" for a in node.names
                        if a.name not in PUBLIC[node.module]]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                bad += [f"{f.relative_to(root)} imports {n}" for n in names
                        if n.split(".")[0] in {*RANK, "tests"} or (isinstance(node, ast.ImportFrom) and node.level)]
    return bad


def test_imports_only_point_down():
    assert not package_violations(ROOT), package_violations(ROOT)


def test_each_room_imports_only_the_rooms_below_it():
    assert not room_violations(ROOT), room_violations(ROOT)


def test_each_folder_says_its_role_and_what_it_may_import():
    for room in FOLDERS:
        doc = ast.get_docstring(ast.parse((ROOT / "ragcache" / room / "__init__.py").read_text())) or ""
        line = next((ln for ln in doc.splitlines() if ln.startswith("May import:")), None)
        assert line is not None, f"ragcache/{room}/__init__.py: no 'May import:' line in its docstring"
        rooms = re.sub(r"\(.*?\)", "", line.removeprefix("May import:"))  # "(and blend, index)" is a remark
        said = {w.strip(" .`") for w in rooms.split(",")} - {""}
        assert said == ROOMS[room], f"ragcache/{room}: the docstring says {sorted(said)}, the rule {sorted(ROOMS[room])}"


def test_demo_code_uses_only_the_public_api():
    assert list((ROOT / "demo").rglob("*.py")), "demo/ holds no code: nothing for this rule to check"
    assert not demo_violations(ROOT), demo_violations(ROOT)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_every_rule_fails_on_a_file_that_breaks_it(tmp_path):
    root = _tree(tmp_path, {
        "blend/x.py": "from ragcache.config import Settings\n",  # a package importing upward
        "ragcache/__init__.py": "", "ragcache/config.py": "", "ragcache/service.py": "",
        "ragcache/store/__init__.py": "", "ragcache/store/tier.py": "from ..service import RagCache\n",
        "ragcache/corpus/__init__.py": "", "ragcache/corpus/ingest.py": "from .. import service\n",
        "ragcache/stray.py": "",  # a module no rule covers
        "demo/run.py": "from ragcache.serving.scheduler import Scheduler\nimport blend\n"
                       "from ragcache import RagCache, Parts\n",
    })
    assert package_violations(root) == ["blend/x.py imports ragcache.config"]
    assert sorted(room_violations(root)) == [
        "ragcache/corpus/ingest.py (corpus) imports ragcache.service (service)",
        "ragcache/store/tier.py (store) imports ragcache.service (service)",
        "ragcache/stray.py is in no room of the layering rule: add it to ROOMS"]
    assert sorted(demo_violations(root)) == ["demo/run.py imports blend", "demo/run.py imports ragcache.Parts",
                                             "demo/run.py imports ragcache.serving.scheduler"]
