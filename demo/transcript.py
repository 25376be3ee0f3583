"""The README's demo transcript: ``python -m demo.transcript`` (``make readme-demo``) runs the demo
as a user would (``--duration 150``, the default work directory) and writes what it printed into
README.md between the transcript's markers; :func:`shape` is what a line looks like whatever the
run's numbers, times, names and ports, so a test can check the README's lines against a run of the
current code (tests/demo/test_demo.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BEGIN, END = "<!-- demo transcript: make readme-demo -->", "<!-- end of demo transcript -->"
#: The README's transcript is at most this many lines (the demo's periodic progress lines are cut).
MAX_LINES = 40

_SHAPES = [
    (re.compile(r"'[^']*'"), "'…'"),                     # names from the sample data
    (re.compile(r"\b[A-Z]{2}-[A-Z]+\b"), "CC-X"),         # site codes
    # A device's state as an enriched event carries it (demo.scenario.device_state): a mean may be
    # negative, none yet, or the event late.
    (re.compile(r"events \d+, temperature mean (?:-|-?\d+\.\d+), risk (?:-|\d+\.\d+ \((?:low|high)\))"
                r"|(?:late: )?no device state"), "STATE"),
    (re.compile(r"\d+"), "9"),                            # counts, times, pids, ports, latencies
]


def shape(line: str, workdir: str = "var/demo") -> str:
    """``line`` with what differs from run to run replaced by placeholders (``workdir``: the run's
    work directory, shown as the default one)."""
    line = line.rstrip().replace(workdir, "var/demo")
    for rx, to in _SHAPES:
        line = rx.sub(to, line)
    return line


def trimmed(lines: list[str]) -> list[str]:
    """The run's lines as the README shows them: at most :data:`MAX_LINES`, the progress lines
    ("... enriched events so far") after the first two left out."""
    out, progress = [], 0
    for line in lines:
        if "enriched events so far" in line:
            progress += 1
            if progress > 2:
                continue
        out.append(line.rstrip())
    return out[:MAX_LINES]


def readme_lines(readme: Path) -> list[str]:
    """The transcript's lines in ``readme`` (between the markers, inside its code fence)."""
    text = readme.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    return [line for line in block.strip().splitlines() if not line.startswith("```")]


def write(readme: Path, lines: list[str]) -> None:
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n```\n" + "\n".join(lines) + f"\n```\n{END}{tail}", encoding="utf-8")


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "demo", "--duration", "150"], cwd=root, capture_output=True,
                          text=True)
    if done.returncode != 0:
        print(f"demo.transcript: the demo exited {done.returncode}; README.md left as it was\n{done.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    lines = trimmed(done.stdout.splitlines())
    write(root / "README.md", lines)
    print(f"demo.transcript: README.md's transcript rewritten ({len(lines)} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
