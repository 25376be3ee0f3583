"""``--version`` of the demo's commands: the installed distribution's version."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import pytest

import demo.broker
import demo.cli
import demo.simulate


@pytest.mark.parametrize(("main", "prog"), [(demo.cli.main, "python -m demo"),
                                            (demo.simulate.main, "python -m demo.simulate"),
                                            (demo.broker.main, "python -m demo.broker")])
def test_version(main: Callable[[list[str]], int], prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {importlib.metadata.version('refstream')}"
