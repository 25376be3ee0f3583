"""The driver's bootstrap of a broadcast dimension, step by step.

    .venv/bin/python -m bench.tools.dimension_bootstrap --rows 1000000 --repeat 2

Publishes ``--rows`` device rows (``bench.enrich_data.publish_devices``) to an embedded broker (or
``--bootstrap``), then per round builds a fresh ``ChangelogFollower`` and ``DimensionState``, as the
job's ``Dimensions.bootstrap`` does, and prints the wall and CPU seconds of ``read_to_end``,
``apply`` and ``compact``. Run it under ``py-spy record`` to see inside each step.
"""

from __future__ import annotations

import argparse
import time
import uuid
from contextlib import ExitStack

from bench import enrich_data as data
from bench.common import broker_settings
from enrich.dimension.changelog import ChangelogFollower
from enrich.dimension.store import DimensionState


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools.dimension_bootstrap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    args = ap.parse_args(argv)
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        topic = f"ref.devices-{uuid.uuid4().hex[:8]}"
        print(f"published {args.rows:,} device rows in {data.publish_devices(settings, topic, args.rows):.1f} s",
              flush=True)
        for r in range(args.repeat):
            marks = [(time.monotonic(), time.process_time())]
            feed = ChangelogFollower(settings, topic)
            try:
                records = feed.read_to_end(60)
                marks.append((time.monotonic(), time.process_time()))
                state = DimensionState("devices")
                state.apply(records)
                marks.append((time.monotonic(), time.process_time()))
                state.compact()
                marks.append((time.monotonic(), time.process_time()))
            finally:
                feed.close()
            steps = ", ".join(f"{name} {marks[i + 1][0] - marks[i][0]:.2f} s (CPU {marks[i + 1][1] - marks[i][1]:.2f} s)"
                              for i, name in enumerate(("read_to_end", "apply", "compact")))
            print(f"[{r + 1}/{args.repeat}] {len(state):,} rows: {steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
