"""bench/ as a newcomer meets it: `python -m bench.run NAME` reaches every benchmark, each one has its
section and command in docs/benchmarks.md, the diagnostic tools under bench/tools/ run on their own,
and every `bench.` import (benchmarks, tools, tests) names a module and a name that exist.

Nothing here imports a benchmark: they pull in Spark, MariaDB drivers and the broker."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import run

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks.md"


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin, f"no module {name}"
    return Path(spec.origin)


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _bench_imports() -> Iterator[tuple[str, int, str, str | None]]:
    """(file, line, module, imported name or None) of every import of a ``bench`` module."""
    for path in sorted([*(ROOT / "bench").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = path.relative_to(ROOT).as_posix()
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "bench":
                        yield where, node.lineno, a.name, None
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] == "bench":
                    for a in node.names:
                        yield where, node.lineno, node.module, a.name


def test_every_bench_import_resolves() -> None:
    missing = []
    for where, line, module, name in _bench_imports():
        if importlib.util.find_spec(module) is None:
            missing.append(f"{where}:{line}: no module {module}")
            continue
        if name is None:
            continue
        path = _module_file(module)
        if path.name == "__init__.py":  # from a package: a submodule (the packages define nothing else)
            found = importlib.util.find_spec(f"{module}.{name}") is not None
        else:
            found = name in _top_level_names(path)
        if not found:
            missing.append(f"{where}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("name", sorted(run.BENCHMARKS))
def test_every_benchmark_has_a_main_and_a_command_in_the_docs(name: str) -> None:
    assert "main" in _top_level_names(_module_file(run.BENCHMARKS[name][0]))
    text = DOCS.read_text(encoding="utf-8")
    assert f"bench.run {name} " in text or f'ARGS="{name} ' in text, f"docs/benchmarks.md quotes no command of {name}"


def test_every_tool_has_a_main_and_is_listed() -> None:
    tools = sorted(p.stem for p in (ROOT / "bench" / "tools").glob("*.py") if p.stem != "__init__")
    assert tools
    listed = (ROOT / "bench" / "tools" / "__init__.py").read_text(encoding="utf-8")
    for tool in tools:
        assert "main" in _top_level_names(_module_file(f"bench.tools.{tool}")), tool
        assert f"``{tool}``" in listed, f"bench/tools/__init__.py does not list {tool}"
        assert f"bench.tools.{tool}" not in {m for m, _ in run.BENCHMARKS.values()}


def test_the_dispatcher_lists_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in run.BENCHMARKS) and "bench.tools" in out
    assert run.main([]) == 2
    assert run.main(["no-such-benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_benchmarks_md_resolve() -> None:
    text = DOCS.read_text(encoding="utf-8")
    anchors = {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}
    links = [("docs/benchmarks.md", a) for a in re.findall(r"\]\(#([\w\-]+)\)", text)]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        links += [(path.relative_to(ROOT).as_posix(), a)
                  for a in re.findall(r"benchmarks\.md#([\w\-]+)", path.read_text(encoding="utf-8"))]
    broken = [f"{where}: #{anchor}" for where, anchor in links if anchor not in anchors]
    assert not broken, "links to missing sections of docs/benchmarks.md:\n" + "\n".join(broken)
