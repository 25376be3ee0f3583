"""``enrich compile-pyspark``: PySpark's bytecode written into the ``pyspark.zip`` Spark puts first
on the path of every Python process it starts.

Spark starts Python with ``$SPARK_HOME/python/lib/pyspark.zip`` ahead of everything else on its
``PYTHONPATH``: the executors' daemon, and on the driver the processes a query starts for itself (the
streaming source's runner, the data sources' planners, the state step's runner). That zip holds
sources only, and Python cannot write bytecode into a zip, so each of those processes compiles the
PySpark modules it imports again: about 0.7 CPU seconds on a quiet core against 0.3 with bytecode.
A driver-started process must connect back to the JVM within 10 seconds (a limit Spark hard-codes),
and on a loaded machine the compile alone has taken longer, failing the query.

The zip is rewritten with a ``.pyc`` beside each ``.py``, for the interpreter running this; zipimport
prefers them and falls back to the source for another interpreter's. They are hash-based and
unchecked, as Spark's zip is replaced whole (a reinstall, which leaves none until this runs again),
never edited in place (``zip -u`` would keep the old bytecode). PySpark's own tests are left out. Run
it once per install, on every machine whose Spark starts Python, while no job runs there: a process
that already read the zip's directory would read the new file at the old offsets.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from refstream.atomic import write_atomic
from refstream.errors import ConfigError

__all__ = ["Compiled", "compile_zip", "spark_zip"]

# The marker: a zip carrying bytecode for this interpreter holds this file with its magic number.
_MARK = "pyspark/__init__.pyc"


@dataclass(frozen=True)
class Compiled:
    path: Path
    modules: int  # the .pyc files written; 0 when the zip already had this interpreter's
    before: int  # bytes
    after: int

    def line(self) -> str:
        if not self.modules:
            return f"{self.path}: already holds this Python's bytecode"
        return (f"{self.path}: bytecode for {self.modules} modules written "
                f"({self.before / 1e6:.1f} MB -> {self.after / 1e6:.1f} MB)")


def spark_zip(spark_home: str | None = None) -> Path:
    """The ``pyspark.zip`` of ``spark_home``, else of ``$SPARK_HOME``, else of the installed PySpark."""
    if spark_home is None:
        spark_home = os.environ.get("SPARK_HOME")
    if spark_home is None:  # a pip-installed PySpark is its own Spark home
        import pyspark

        spark_home = str(Path(pyspark.__file__).parent)
    path = Path(spark_home) / "python" / "lib" / "pyspark.zip"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: --spark-home must name a Spark installation "
                          "(the directory holding bin/ and python/)")
    return path


def _has_bytecode(zf: zipfile.ZipFile) -> bool:
    try:
        return zf.read(_MARK)[:4] == importlib.util.MAGIC_NUMBER
    except KeyError:
        return False


def _compiles(name: str) -> bool:
    return name.endswith(".py") and "/tests/" not in name and "/testing/" not in name


def _pyc(name: str, source: bytes) -> bytes:
    # PEP 552's hash-based pyc, unchecked (flags 0b01): the magic number, the flags, the source's
    # hash, the marshalled code.
    with warnings.catch_warnings():  # a module's SyntaxWarnings are PySpark's to fix, not the operator's
        warnings.simplefilter("ignore")
        # optimize=0: asserts and docstrings kept whatever -O this runs with; every interpreter reads these.
        code = compile(source, name, "exec", dont_inherit=True, optimize=0)
    return (importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little") + importlib.util.source_hash(source)
            + marshal.dumps(code))


def compile_zip(path: Path) -> Compiled:
    """Rewrite ``path`` with bytecode beside its sources; nothing when it has this interpreter's."""
    stat = path.stat()
    before = stat.st_size
    try:
        with zipfile.ZipFile(path) as zin:
            if _has_bytecode(zin):
                return Compiled(path, 0, before, before)
            entries = [(info, zin.read(info)) for info in zin.infolist() if not info.filename.endswith(".pyc")]
    except zipfile.BadZipFile as exc:  # left as it is: reinstall PySpark
        raise ConfigError(f"{path}: not a readable zip ({exc}); reinstall PySpark, then run this again") from exc
    modules = 0
    # The name the code objects carry, as zipimport gives a module it compiles from the zip itself:
    # tracebacks show it, and PySpark tells its own frames from the user's by it.
    origin = path.resolve()

    def write(f: BinaryIO) -> None:
        nonlocal modules
        # The replacement keeps the zip's mode: a temporary file is 0600, and a Spark worker running
        # as another user (an image's) must still read it.
        os.fchmod(f.fileno(), stat.st_mode & 0o7777)
        if os.geteuid() == 0:  # and, run by root (an image's build), its owner
            os.fchown(f.fileno(), stat.st_uid, stat.st_gid)
        # Stored, not deflated: zipimport then reads each module without decompressing it.
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zout:
            for info, data in entries:
                zout.writestr(info, data)
                if not _compiles(info.filename):
                    continue
                pyc = zipfile.ZipInfo(info.filename + "c", info.date_time)
                pyc.external_attr = info.external_attr  # its source's permissions, for whoever unzips it
                zout.writestr(pyc, _pyc(f"{origin}/{info.filename}", data))
                modules += 1

    write_atomic(path, write)
    return Compiled(path, modules, before, path.stat().st_size)
