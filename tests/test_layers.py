"""Imports point down only (docs/architecture.md, "Where things live"): demo -> refresh, enrich ->
refstream, and refresh and enrich never import each other.

Every import counts, at any depth: a late import inside a function couples the layers as much as
one at the top of the module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "refstream": frozenset(),
    "refresh": frozenset({"refstream"}),
    "enrich": frozenset({"refstream"}),
    "demo": frozenset({"refresh", "enrich", "refstream"}),
}
PROJECT = frozenset(ALLOWED) | {"bench", "tests"}


def _package_of(path: Path, root: Path) -> list[str]:
    """Dotted package of a module file as parts: refresh/sources/sql.py -> [refresh, sources]."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]  # a package's __init__ and its modules resolve relative imports alike


def _imported(tree: ast.AST, package: list[str]) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the tree, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                yield node.lineno, ".".join([*base, node.module] if node.module else base)
            elif node.module:
                yield node.lineno, node.module
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in {"__import__", "import_module"}))):
            yield node.lineno, node.args[0].value


def layer_violations(root: Path) -> list[str]:
    """One line per import that points up or across, as ``file:line: package imports module``."""
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for line, module in _imported(tree, _package_of(path, root)):
                top = module.split(".")[0]
                if top in PROJECT and top != package and top not in allowed:
                    found.append(f"{path.relative_to(root).as_posix()}:{line}: {package} imports {module}")
    return found


def test_imports_point_down_only() -> None:
    violations = layer_violations(ROOT)
    assert not violations, "imports against the layering (docs/architecture.md):\n" + "\n".join(violations)


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` (path relative to ``root`` -> text) under ``root``: a project to check."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_every_layer_is_checked() -> None:
    assert all((ROOT / package / "__init__.py").is_file() for package in ALLOWED)


def test_the_check_finds_upward_and_sideways_imports(tmp_path: Path) -> None:
    files = {
        "refstream/__init__.py": "",
        "refstream/codec.py": "import json\n\ndef late():\n    from enrich.job import run\n",
        "refresh/__init__.py": "from refstream import contract\n",
        "refresh/sources/__init__.py": "from ...demo import cli\n",
        "refresh/sources/sql.py": "from .. import diff\nfrom refstream.kafka import admin\nimport enrich.config\n",
        "enrich/__init__.py": "import importlib\nimportlib.import_module('refresh.cli')\n",
        "demo/__init__.py": "import refresh, enrich, refstream\nimport tests.conftest\n",
    }
    write_tree(tmp_path, files)

    assert layer_violations(tmp_path) == [
        "refstream/codec.py:4: refstream imports enrich.job",
        "refresh/sources/__init__.py:1: refresh imports demo",
        "refresh/sources/sql.py:3: refresh imports enrich.config",
        "enrich/__init__.py:2: enrich imports refresh.cli",
        "demo/__init__.py:2: demo imports tests.conftest",
    ]


# Inside enrich/: modules of pure logic that the executors and the fast tests use without a JVM import
# no pyspark; driver modules reach the executors' code only through the modules that plan it.
PURE = ("enrich/columns.py", "enrich/ipc.py", "enrich/state/engine.py", "enrich/state/hashing.py",
        "enrich/packed.py")
EXECUTOR_ONLY = ("enrich.state.processor", "enrich.sinks.kafka.tasks", "enrich.source.fetch", "enrich.worker")
DRIVER = ("enrich/job.py", "enrich/pipeline.py", "enrich/checkpoint.py", "enrich/validate.py", "enrich/cli.py",
          "enrich/config.py", "enrich/session.py", "enrich/ops")


def enrich_violations(root: Path) -> list[str]:
    """Imports against the two rules above, as ``file:line: what``."""
    found = []
    for path in sorted((root / "enrich").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in _imported(tree, _package_of(path, root)):
            if rel in PURE and module.split(".")[0] == "pyspark":
                found.append(f"{rel}:{line}: pure module imports {module}")
            if rel.startswith(DRIVER) and module in EXECUTOR_ONLY:
                found.append(f"{rel}:{line}: driver module imports {module}")
    return found


def test_pure_modules_import_no_spark_and_the_driver_no_executor_module() -> None:
    violations = enrich_violations(ROOT)
    assert not violations, "\n".join(violations)


def test_the_enrich_rules_find_what_they_forbid(tmp_path: Path) -> None:
    files = {"enrich/state/engine.py": "import pyspark.sql\n",
             "enrich/ops/device.py": "from enrich.state.processor import DeviceStateProcessor\n",
             "enrich/job.py": "from enrich.state import stream\n"}
    write_tree(tmp_path, files)
    assert enrich_violations(tmp_path) == [
        "enrich/ops/device.py:1: driver module imports enrich.state.processor",
        "enrich/state/engine.py:1: pure module imports pyspark.sql"]


def test_internal_column_names_have_one_home() -> None:
    """A string constant that names an internal column is defined in enrich/columns.py only."""
    import enrich.columns as columns

    names = {v for k, v in vars(columns).items() if k.isupper() and isinstance(v, str)}
    found = []
    for path in sorted((ROOT / "enrich").rglob("*.py")):
        if path.name == "columns.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value in names:
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {node.value.value!r}")
    assert not found, "\n".join(found)


# Inside enrich/: its units (subpackages and top-level modules) in layers, lowest first. A unit
# imports units of lower layers only, so the graph has no cycle and a new stage has one place to go:
# the query (enrich/query.py) wires the stages below it and nothing below imports it. A unit must
# be placed here before it can be imported.
ENRICH_LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"columns", "ipc", "accumulators", "worker", "session", "daemon", "failures"},  # import nothing of enrich
    {"packed", "events", "dimension", "checkpoint", "rollups", "gaps"},
    {"source", "origin"},
    {"calls", "metrics"},
    {"config"},
    {"joins", "sinks"},                # the joins: broadcast (the package), as-of, partitioned
    {"state"},                          # the keyed step, with the partitioned joins and the calls in it
    {"pipeline"},                       # the plan
    {"query", "validate", "ops"},       # the running query; the offline tools over a plan or a checkpoint
    {"job"},
    {"cli"},
    {"__init__", "__main__"},
))


def _unit(parts: list[str], units: set[str]) -> str:
    """The unit of enrich an absolute module name's parts (``[enrich, ...]``) fall in."""
    return parts[1] if len(parts) > 1 and parts[1] in units else "__init__"


def _imported_units(tree: ast.AST, package: list[str], units: set[str]) -> Iterator[tuple[int, str]]:
    """(line, unit) of every import of enrich in the tree; ``from enrich import x`` imports unit x."""
    from_enrich = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                    if node.level else (node.module or "").split("."))
            if base == ["enrich"]:
                from_enrich[node.lineno] = [a.name if a.name in units else "__init__" for a in node.names]
    for line, module in _imported(tree, package):
        parts = module.split(".")
        if parts[0] != "enrich":
            continue
        if module == "enrich" and line in from_enrich:
            yield from ((line, unit) for unit in from_enrich[line])
        else:
            yield line, _unit(parts, units)


def enrich_layer_violations(root: Path) -> list[str]:
    """One line per import inside enrich/ that does not point to a lower layer of :data:`ENRICH_LAYERS`,
    as ``file:line: unit imports unit``."""
    layer_of = {u: i for i, layer in enumerate(ENRICH_LAYERS) for u in layer}
    units = set(layer_of)
    found = []
    for path in sorted((root / "enrich").rglob("*.py")):
        rel = path.relative_to(root)
        own = rel.with_suffix("").parts[1]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, unit in sorted(set(_imported_units(tree, _package_of(path, root), units))):
            if unit == own:
                continue
            if own not in layer_of or unit not in layer_of:
                found.append(f"{rel.as_posix()}:{line}: {own} imports {unit}, not in ENRICH_LAYERS")
            elif layer_of[unit] >= layer_of[own]:
                found.append(f"{rel.as_posix()}:{line}: {own} imports {unit}, "
                             f"{'the same' if layer_of[unit] == layer_of[own] else 'a higher'} layer")
    return found


def test_enrich_units_import_lower_layers_only() -> None:
    violations = enrich_layer_violations(ROOT)
    assert not violations, "imports against enrich's layers (ENRICH_LAYERS):\n" + "\n".join(violations)


def test_every_enrich_unit_has_a_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "enrich").iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    placed = set().union(*ENRICH_LAYERS)
    assert units == placed, f"not placed: {sorted(units - placed)}; gone: {sorted(placed - units)}"


def test_the_layer_check_finds_upward_imports(tmp_path: Path) -> None:
    files = {
        "enrich/__init__.py": "",
        "enrich/columns.py": "",
        "enrich/source/__init__.py": "from enrich.state import packed\n",
        "enrich/source/tick.py": "def late():\n    from ..pipeline import Pipeline\n",
        "enrich/state/stream.py": "from enrich import pipeline, columns\nfrom . import engine\n",
        "enrich/pipeline.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from enrich.query import Stream\n",
        "enrich/joins/__init__.py": "import enrich.sinks.kafka\nimport enrich.unplaced\n",
        "enrich/query.py": "from enrich import job\nfrom enrich.state.stream import Unpack\n",
    }
    write_tree(tmp_path, files)
    assert enrich_layer_violations(tmp_path) == [
        "enrich/joins/__init__.py:1: joins imports sinks, the same layer",
        "enrich/joins/__init__.py:2: joins imports __init__, a higher layer",
        "enrich/pipeline.py:3: pipeline imports query, a higher layer",
        "enrich/query.py:1: query imports job, a higher layer",
        "enrich/source/__init__.py:1: source imports state, a higher layer",
        "enrich/source/tick.py:2: source imports pipeline, a higher layer",
        "enrich/state/stream.py:1: state imports pipeline, a higher layer",
    ]


# Spark's streaming APIs of the running query: called by the module that wires it only. A sink's own
# writer (a mapInArrow that writes a batch) and the operator tools over a stopped checkpoint read
# and write through Spark themselves.
STREAMING_APIS = frozenset({"readStream", "writeStream", "foreachBatch", "transformWithStateInPandas",
                            "transformWithState", "mapInArrow", "applyInArrow", "applyInPandasWithState"})
STREAMING_ALLOWED = ("enrich/query.py", "enrich/sinks/database/sink.py", "enrich/sinks/kafka/sink.py", "enrich/ops/")


def streaming_api_uses(root: Path) -> list[str]:
    """``file:line: .api`` for every use of :data:`STREAMING_APIS` in enrich/ outside :data:`STREAMING_ALLOWED`."""
    found = []
    for path in sorted((root / "enrich").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(STREAMING_ALLOWED):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [f"{rel}:{node.lineno}: .{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in STREAMING_APIS]
    return sorted(found)


def test_only_the_query_module_calls_the_streaming_apis() -> None:
    found = streaming_api_uses(ROOT)
    assert not found, "Spark's streaming APIs outside enrich/query.py (wire the stage there):\n" + "\n".join(found)


def test_the_streaming_api_check_finds_a_call(tmp_path: Path) -> None:
    files = {"enrich/query.py": "df.mapInArrow(f, s)\n",
             "enrich/joins/__init__.py": "# mapInArrow\ndef enrich(df):\n    return df.mapInArrow(f, s)\n",
             "enrich/state/stream.py": "w = df.writeStream\nw.foreachBatch(g)\n",
             "enrich/ops/savepoint.py": "spark.read.parquet(p).mapInArrow(f, s)\n"}
    write_tree(tmp_path, files)
    assert streaming_api_uses(tmp_path) == ["enrich/joins/__init__.py:3: .mapInArrow", "enrich/state/stream.py:1: .writeStream",
                                            "enrich/state/stream.py:2: .foreachBatch"]


# The tests mirror the package tree (docs/architecture.md, "Where things live"):
# tests/enrich/<path>/test_<module>[_<aspect>].py tests enrich/<path>/<module>.py or the subpackage
# enrich/<path>/<module>/, so a module's tests are found by its name. The end-to-end tests, of the whole
# job (exactly once across kills and restarts, on a cluster, under hostile input), are in tests/e2e/.
# Module-less helpers (helpers.py, kill.py, conftest.py) are not test_*.py files and need no module.
TEST_LAYOUT_EXCEPTIONS: dict[str, str] = {
    "tests/enrich/test_zz_session_guard.py":
        "tests tests/enrich/conftest.py's shared Spark session and drops its py4j connection on purpose: "
        "it needs that session's fixture, and its name orders it after the session's other tests on a worker",
}


def misplaced_tests(root: Path, package: str = "enrich",
                    exceptions: Mapping[str, str] = TEST_LAYOUT_EXCEPTIONS) -> list[str]:
    """The test files under ``tests/<package>/`` that do not name a module or subpackage of ``<package>/``
    at the same path (``test_<module>`` or ``test_<module>_<aspect>``), as paths from ``root``."""
    found = []
    for path in sorted((root / "tests" / package).rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in exceptions:
            continue
        source = root / path.parent.relative_to(root / "tests")   # tests/enrich/x -> enrich/x
        words = path.stem.removeprefix("test_").split("_")
        names = ("_".join(words[:n]) for n in range(len(words), 0, -1))
        if not any((source / f"{name}.py").is_file() or (source / name / "__init__.py").is_file() for name in names):
            found.append(rel)
    return found


def test_enrich_tests_mirror_its_modules() -> None:
    found = misplaced_tests(ROOT)
    assert not found, ("test files that name no module of enrich/ at their path: name them "
                       "tests/enrich/<path>/test_<module>[_<aspect>].py for enrich/<path>/<module>.py "
                       "(or its subpackage), or move an end-to-end test to tests/e2e/:\n" + "\n".join(found))


def test_the_end_to_end_tests_have_their_package_and_the_exceptions_exist() -> None:
    assert (ROOT / "tests" / "e2e" / "__init__.py").is_file()
    assert list((ROOT / "tests" / "e2e").glob("test_*.py"))
    assert all((ROOT / path).is_file() for path in TEST_LAYOUT_EXCEPTIONS), "an exception names a file that is gone"


def test_the_test_layout_check_finds_tests_that_name_no_module(tmp_path: Path) -> None:
    files = {
        "enrich/__init__.py": "", "enrich/job.py": "", "enrich/state/__init__.py": "",
        "enrich/state/wait.py": "", "enrich/ops/__init__.py": "", "enrich/ops/state_db.py": "",
        "enrich/sinks/__init__.py": "", "enrich/sinks/database/__init__.py": "",
        "tests/enrich/test_job.py": "", "tests/enrich/test_job_faults.py": "",       # a module, an aspect
        "tests/enrich/state/test_wait_job.py": "", "tests/enrich/test_state_cache.py": "",  # a subpackage's
        "tests/enrich/ops/test_state_db.py": "", "tests/enrich/ops/test_state_db_read.py": "",
        "tests/enrich/sinks/test_database_kill.py": "", "tests/enrich/helpers.py": "",
        "tests/enrich/test_restart.py": "",            # no enrich/restart.py: an end-to-end test
        "tests/enrich/state/test_job.py": "",          # enrich/job.py, not enrich/state/job.py
        "tests/enrich/test_jobs.py": "",               # a prefix of a word is no module
        "tests/enrich/calls/test_step.py": "",         # no enrich/calls/
        "tests/enrich/test_zz_guard.py": "",           # an exception
    }
    write_tree(tmp_path, files)
    assert misplaced_tests(tmp_path, exceptions={"tests/enrich/test_zz_guard.py": "why"}) == [
        "tests/enrich/calls/test_step.py", "tests/enrich/state/test_job.py", "tests/enrich/test_jobs.py",
        "tests/enrich/test_restart.py"]
