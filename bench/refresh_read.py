"""Read-bound baseline of the refresher benchmark: read a dataset's source into Arrow, nothing else.

Same source class, driver and chunking as ``refresh run`` (``refresh.sources.open_source``), so the
difference between the two is what diffing, publishing and committing cost.

``python -m bench.refresh_read --config CFG DATASET`` prints one JSON line: rows, seconds (the read),
bytes, cpu (CPU seconds of the whole process, every thread, imports included) and the reader.
"""

from __future__ import annotations

import argparse
import json
import time

from refresh.config import load_config
from refresh.sources import open_source


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refresh_read")
    p.add_argument("--config", required=True)
    p.add_argument("dataset")
    args = p.parse_args(argv)
    ds = load_config(args.config).dataset(args.dataset)
    t0 = time.monotonic()
    source = open_source(ds)
    table = source.read()
    seconds = time.monotonic() - t0
    print(json.dumps({"rows": table.num_rows, "seconds": round(seconds, 3), "bytes": table.nbytes,
                      "cpu": round(time.process_time(), 3), "reader": getattr(source, "reader", None)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
