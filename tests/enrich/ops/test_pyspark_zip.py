"""``enrich compile-pyspark``: bytecode written beside each module of a zip, used by an interpreter
that imports from it, and nothing rewritten when it is there already."""

from __future__ import annotations

import importlib.util
import json
import marshal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from enrich import cli
from enrich.ops.pyspark_zip import compile_zip, spark_zip
from tests.timing import bound

SOURCES = {
    "pyspark/__init__.py": "NAME = 'pyspark'\n",
    "pyspark/sql/__init__.py": "",
    "pyspark/sql/mod.py": "VALUE = 42\n",
    "pyspark/sql/tests/__init__.py": "",
    "pyspark/sql/tests/test_mod.py": "X = 1 is 1\n",  # a SyntaxWarning, and a test module: left as source
    "pyspark/data.txt": "not python",
}


def make_zip(path: Path, extra: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in SOURCES.items():
            zf.writestr(name, text)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return path


def imported_from(zip_path: Path, *modules: str) -> dict[str, str]:
    code = ("import importlib, json, sys; "
            "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))")
    out = subprocess.run([sys.executable, "-c", code, *modules], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(zip_path), "PYTHONDONTWRITEBYTECODE": "1"}, timeout=bound(60))
    return json.loads(out.stdout)


def test_each_module_gets_its_bytecode_and_the_rest_is_kept(tmp_path):
    z = make_zip(tmp_path / "pyspark.zip")
    done = compile_zip(z)
    assert done.modules == 3 and done.after > done.before
    with zipfile.ZipFile(z) as zf:
        names = set(zf.namelist())
        assert names == set(SOURCES) | {"pyspark/__init__.pyc", "pyspark/sql/__init__.pyc", "pyspark/sql/mod.pyc"}
        assert all(zf.read(n) == t.encode() for n, t in SOURCES.items())
        assert zf.read("pyspark/sql/mod.pyc")[:4] == importlib.util.MAGIC_NUMBER


def test_the_rewritten_zip_keeps_its_mode(tmp_path):
    z = make_zip(tmp_path / "pyspark.zip")
    z.chmod(0o644)
    compile_zip(z)
    assert z.stat().st_mode & 0o777 == 0o644


def test_a_zip_with_this_pythons_bytecode_is_left_alone(tmp_path):
    z = make_zip(tmp_path / "pyspark.zip")
    compile_zip(z)
    stat = z.stat()
    again = compile_zip(z)
    assert again.modules == 0 and "already holds" in again.line()
    assert (z.stat().st_mtime_ns, z.stat().st_ino) == (stat.st_mtime_ns, stat.st_ino)


def test_another_pythons_bytecode_is_replaced(tmp_path):
    stale = b"\x00\x00\r\n" + bytes(12) + b"stale"
    z = make_zip(tmp_path / "pyspark.zip", {"pyspark/__init__.pyc": stale, "pyspark/sql/mod.pyc": stale})
    assert compile_zip(z).modules == 3
    with zipfile.ZipFile(z) as zf:
        assert [i.filename for i in zf.infolist()].count("pyspark/sql/mod.pyc") == 1
        assert zf.read("pyspark/sql/mod.pyc")[:4] == importlib.util.MAGIC_NUMBER


@pytest.mark.integration
def test_an_interpreter_importing_from_the_zip_loads_the_bytecode(tmp_path):
    z = make_zip(tmp_path / "pyspark.zip")
    before = imported_from(z, "pyspark.sql.mod")
    assert before["pyspark.sql.mod"].endswith("pyspark/sql/mod.py")
    compile_zip(z)
    after = imported_from(z, "pyspark", "pyspark.sql.mod", "pyspark.sql.tests.test_mod")
    assert after["pyspark"].endswith("pyspark.zip/pyspark/__init__.pyc")
    assert after["pyspark.sql.mod"].endswith("pyspark.zip/pyspark/sql/mod.pyc")
    assert after["pyspark.sql.tests.test_mod"].endswith("test_mod.py")


def test_the_bytecode_keeps_asserts_and_names_its_file_in_the_zip(tmp_path):
    z = make_zip(tmp_path / "pyspark.zip", {"pyspark/checks.py": b"assert False, 'kept'\n"})
    # compiled with -O: the asserts are kept all the same, since every interpreter reads the bytecode
    subprocess.run([sys.executable, "-O", "-c", "import sys; from pathlib import Path; "
                    "from enrich.ops.pyspark_zip import compile_zip; compile_zip(Path(sys.argv[1]))", str(z)],
                   check=True, timeout=bound(60))
    with zipfile.ZipFile(z) as zf:
        code = marshal.loads(zf.read("pyspark/checks.pyc")[16:])
        assert zf.getinfo("pyspark/checks.pyc").external_attr == zf.getinfo("pyspark/checks.py").external_attr
    # named as zipimport names a module it compiles from the zip: tracebacks show where it is
    assert code.co_filename == f"{z.resolve()}/pyspark/checks.py"
    with pytest.raises(AssertionError, match="kept"):
        exec(code, {})


def test_the_zip_is_found_under_spark_home_and_a_missing_one_is_named(tmp_path, monkeypatch, capsys):
    home = tmp_path / "spark"
    (home / "python" / "lib").mkdir(parents=True)
    z = make_zip(home / "python" / "lib" / "pyspark.zip")
    monkeypatch.setenv("SPARK_HOME", str(home))
    assert spark_zip() == z
    assert cli.main(["compile-pyspark"]) == 0
    assert "bytecode for 3 modules written" in capsys.readouterr().out
    assert cli.main(["compile-pyspark", "--spark-home", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "none" / "python" / "lib" / "pyspark.zip") in err


def test_without_a_spark_home_the_installed_pysparks_zip_is_taken(monkeypatch):
    import pyspark

    monkeypatch.delenv("SPARK_HOME", raising=False)
    assert spark_zip() == Path(pyspark.__file__).parent / "python" / "lib" / "pyspark.zip"


def test_a_damaged_zip_is_named_and_left_as_it_is(tmp_path, capsys):
    home = tmp_path / "spark"
    (home / "python" / "lib").mkdir(parents=True)
    z = home / "python" / "lib" / "pyspark.zip"
    z.write_bytes(b"not a zip\x00")
    assert cli.main(["compile-pyspark", "--spark-home", str(home)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{z}: not a readable zip" in err
    assert z.read_bytes() == b"not a zip\x00" and [p.name for p in z.parent.iterdir()] == ["pyspark.zip"]
