"""The README transcript's line shapes (demo/transcript.py), without running the demo."""

from __future__ import annotations

from demo.transcript import shape


def test_a_devices_state_has_one_shape_whatever_its_values() -> None:
    base = "[03:12:09] INSERT devices d-5001 model_id m-4 site_id s-14 ... seen in enriched output at 03:12:14, " \
           "after 4.7 s ({})"
    states = ["events 1, temperature mean 10.5, risk 1.4 (low)", "events 1, temperature mean -3.2, risk -",
              "events 12, temperature mean -, risk 33.8 (high)", "no device state", "late: no device state"]
    assert len({shape(base.format(s)) for s in states}) == 1
    assert shape("d-17 -> model 'Meter M5', site 'Paris Nord' (FR-IDF)") == "d-9 -> model '…', site '…' (CC-X)"


def test_other_differences_keep_their_shape() -> None:
    assert shape("[03:13:36] stopped enrichment job") != shape("[03:13:36] stopped enrichment job (exit code 1)")
