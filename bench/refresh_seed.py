"""Seed a dataset's committed state without publishing it (large refresher benchmarks).

``python -m bench.refresh_seed --config CFG DATASET`` runs one ordinary ``refresh run`` of DATASET
(read, check, diff, commit) whose publisher creates the topic but sends nothing: the state then
holds the table's snapshot as if it had been published, so the next run diffs against it. Publishing
every row first would only measure the bootstrap, which at 10M rows takes longer than the benchmark.
Prints one JSON line: rows, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from refresh.config import load_config
from refresh.publish import Publisher
from refresh.runner import Refresher


class _Unpublished(Publisher):
    """Creates the topic and accepts change sets without producing them (the messages are never
    even encoded)."""

    def prepare(self, topic: str, partitions: int = 1, config: Mapping[str, str] | None = None) -> list[int]:
        # The topic is created (empty): the state records its end offsets, and the next run, finding
        # it, diffs instead of republishing a dataset whose topic is missing.
        return super().prepare(topic, partitions, config)

    def publish(self, topic: str, messages: Iterable[Any], **_: Any) -> int:
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refresh_seed")
    p.add_argument("--config", required=True)
    p.add_argument("dataset")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    result = Refresher(load_config(args.config), publisher_factory=_Unpublished, progress=False).run(args.dataset)
    print(json.dumps({"rows": result.rows, "seconds": round(time.monotonic() - t0, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
