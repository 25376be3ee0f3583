"""The configuration reference (docs/configuration.md) against the real loaders: every key
`refresh.config` and `enrich.config` accept is documented, nothing documented is refused, and the
defaults it states are the ones the loaders apply; and the docs' relative links resolve.

The accepted keys are recorded by watching which keys the loaders ask their ``Section`` for while
loading configs that take every branch (SQL, file and incremental datasets; each output kind)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from enrich.config import EnrichConfig
from enrich.config import load as load_enrich
from refresh.config import FileSourceConfig, RefreshConfig, SqlSourceConfig, load_config
from refstream.config import Section, parse_duration

ROOT = Path(__file__).resolve().parents[1]

CONFIG_DOC = ROOT / "docs" / "configuration.md"

REFRESH_YAML = """\
kafka: {bootstrap_servers: "127.0.0.1:9", client.id: readme-test}
metrics: {port: 9108, host: 127.0.0.1}
state_dir: var/refresh
retry: {attempts: 3, initial: 1s, maximum: 5s}
datasets:
  plain:
    source: {url: "sqlite://", table: t}
    key: id
  inc:
    source: {url: "sqlite://", query: "SELECT 1 AS id, 2 AS u", chunk_rows: 10}
    key: [id]
    mode: incremental
    incremental: {column: u, lag: 1s, reconcile: {every: 1h}}
    schedule: {cron: "*/5 * * * *"}
    topic: t.inc
    partitions: 2
    allow_empty: true
    max_delete_fraction: 0.5
  inc2:
    source: {url: "sqlite://", table: t}
    key: id
    mode: incremental
    incremental: {column: u, reconcile_every: 2h}
    schedule: {every: 10s}
  file:
    source: {path: data/x.csv, format: csv, types: {id: string}, stable_for: 2s, stable_timeout: 30s}
    key: id
    watch: true
"""

ENRICH_YAML = """\
kafka: {bootstrap_servers: "127.0.0.1:9", client.id: readme-test}
metrics: {port: 9109, host: 127.0.0.1}
events: {topic: ev, schema: "device_id STRING", starting_offsets: earliest, required: [device_id],
         source: python}
joins:
  - {dataset: devices, topic: ref.devices, on: device_id, columns: [a], how: inner, prefix: "d_"}
  - {dataset: sites, on: {site: site_id}, strategy: broadcast}
output: %s
state: {key: device_id, timestamp: ts, ttl: 2h, watermark: 1m, buckets: 8, aggregates: {t: [last, mean]}}
dead_letter_topic: dlq
checkpoint: var/ck
trigger: 2s
max_events_per_batch: 10
bootstrap_timeout: 5s
spark: {spark.driver.memory: 2g}
calls:
  - {name: a, url: "http://127.0.0.1:9/a", response: {x: DOUBLE}}
  - {name: b, url: "http://127.0.0.1:9/b", method: GET, body: {v: "{a.x}"}, response: {y: STRING}, refresh: 10m,
     timeout: 1s, retries: {attempts: 2, backoff: 10ms}, concurrency: 8, on_error: dead_letter, needs: [a]}
rollups:
  - {name: d_1m, by: [device_id], window: 1m, metrics: {t: [mean, p95]}, correct_for: 1h, fill: true, idle_finalize: 2m,
     output: {parquet: {path: var/d_1m}, kafka: {topic: d_1m},
              database: {url: "postgresql://u@127.0.0.1:9/db", table: d_1m, statement_timeout: 5s}}}
gaps: {expected_every: 30s, after: 2, idle_after: 1m,
       output: {kafka: {topic: gaps}, database: {url: "postgresql://u@127.0.0.1:9/db", table: gaps, statement_timeout: 5s}}}
"""
OUTPUTS = ("{kafka: {topic: out, transactional_id: tx}}", "{parquet: {path: var/out}}", "{console: {rows: 5}}",
           "{database: {url: 'postgresql://u@h/d', table: t, write: state}, kafka: {topic: out}}")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Every key path the loaders ask for, present in the file or not."""
    keys: set[str] = set()
    raw = Section.raw

    def spy(self: Section, name: str, default: Any = ...) -> Any:
        keys.add(self.key(name))
        return raw(self, name, default)

    monkeypatch.setattr(Section, "raw", spy)
    yield keys


def config_table(heading: str) -> dict[str, str]:
    """docs/configuration.md key -> default cell, from the table under the heading that contains ``heading``."""
    text = CONFIG_DOC.read_text(encoding="utf-8")
    m = re.search(rf"^##[^\n]*{re.escape(heading)}[^\n]*\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    assert m, f"docs/configuration.md has no section about {heading}"
    out: dict[str, str] = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("key", "") or set(cells[0]) <= {"-"}:
            continue
        for key in re.findall(r"`([^`]+)`", cells[0]):
            out[key] = cells[1]
    assert out, f"no configuration table under {heading}"
    return out


def leaves(keys: set[str]) -> set[str]:
    """Drop containers: keys under which other keys were read."""
    return {k for k in keys if not any(o.startswith(k + ".") or o.startswith(k + "[") for o in keys if o != k)}


def refresh_form(key: str) -> str:
    """A recorded key in the reference's notation (dataset entries as ``.source.url`` etc.)."""
    key = re.sub(r"^kafka\.(?!bootstrap_servers$).+", "kafka.<librdkafka setting>", key)
    m = re.match(r"^datasets\.([^.]+)(\..*)?$", key)
    if m:
        key = m.group(2) or "datasets.<name>"
    return re.sub(r"^\.source\.types\..+", ".source.types", key)


def enrich_form(key: str) -> str:
    key = re.sub(r"^kafka\.(?!bootstrap_servers$).+", "kafka.<librdkafka setting>", key)
    key = re.sub(r"^spark\..+", "spark.<setting>", key)
    key = re.sub(r"^state\.aggregates\..+", "state.aggregates", key)
    key = re.sub(r"^calls\[\d+\]\.response\..+", "calls[].response", key)
    key = re.sub(r"^rollups\[\d+\]\.metrics\..+", "rollups[].metrics", key)
    if key in ("joins", "calls", "rollups"):
        return key + "[]"
    return re.sub(r"^(joins|calls|rollups)\[\d+\]", r"\1[]", key)


def load_all_refresh(tmp_path: Path) -> RefreshConfig:
    p = tmp_path / "refresh.yaml"
    p.write_text(REFRESH_YAML)
    return load_config(p)


def load_all_enrich(tmp_path: Path) -> list[EnrichConfig]:
    out = []
    for i, output in enumerate(OUTPUTS):
        p = tmp_path / f"enrich{i}.yaml"
        p.write_text(ENRICH_YAML % output)
        out.append(load_enrich(p))
    return out


@pytest.mark.parametrize("which", ["refresh", "enrich"])
def test_the_reference_documents_every_key_the_loaders_accept(which: str, recorded: set[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if which == "refresh":
        load_all_refresh(tmp_path)
        form: Callable[[str], str] = refresh_form
    else:
        load_all_enrich(tmp_path)
        form = enrich_form
    accepted = {form(k) for k in recorded}
    documented = set(config_table(f"conf/{which}.yaml"))
    missing = leaves(accepted) - documented
    assert not missing, f"conf/{which}.yaml keys the loader accepts but docs/configuration.md does not list: {sorted(missing)}"
    unknown = documented - accepted
    assert not unknown, f"docs/configuration.md lists conf/{which}.yaml keys the loader does not read: {sorted(unknown)}"


def matches(cell: str, actual: Any) -> bool:
    """Whether a reference default cell (``\\`30s\\```, ``none``, ``\\`[]\\```...) says ``actual``."""
    text = cell.strip().strip("`")
    if actual is None:
        return text == "none"
    if isinstance(actual, bool):
        return text == str(actual).lower()
    if isinstance(actual, timedelta):
        return parse_duration(text) == actual
    if isinstance(actual, float):
        return float(text) == actual
    if isinstance(actual, int):
        return text.replace(",", "").isdigit() and int(text.replace(",", "")) == actual
    if isinstance(actual, Path):
        return Path(text).resolve() == actual.resolve()
    if isinstance(actual, tuple):
        return yaml.safe_load(text) == list(actual)
    return (yaml.safe_load(text) if text.startswith('"') else text) == actual


def test_the_reference_defaults_are_the_loaders_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "refresh.yaml"
    p.write_text('kafka: {bootstrap_servers: "127.0.0.1:9"}\n'
                 'datasets:\n  dd:\n    source: {url: "sqlite://", table: t}\n    key: id\n'
                 '  ii:\n    source: {url: "sqlite://", table: t}\n    key: id\n    mode: incremental\n'
                 '    incremental: {column: u}\n'
                 '  ff:\n    source: {path: x.csv}\n    key: id\n')
    r = load_config(p)
    d, i, f = r.datasets["dd"], r.datasets["ii"], r.datasets["ff"].source
    assert isinstance(f, FileSourceConfig) and isinstance(d.source, SqlSourceConfig)
    refresh_actual: dict[str, Any] = {
        "state_dir": r.state_dir, "retry.attempts": r.retry.attempts,
        "retry.initial": timedelta(seconds=r.retry.initial), "retry.maximum": timedelta(seconds=r.retry.maximum),
        ".source.chunk_rows": d.source.chunk_rows, ".mode": d.mode, ".incremental.lag": i.incremental.lag,
        ".incremental.reconcile.every": i.incremental.reconcile_every, ".watch": d.watch,
        ".schedule.every": d.schedule.every, ".schedule.cron": d.schedule.cron,
        ".topic": d.topic.replace("dd", "<name>"), ".partitions": d.partitions, ".allow_empty": d.allow_empty,
        ".max_delete_fraction": d.max_delete_fraction, ".source.stable_for": f.stable_for,
        ".source.stable_timeout": f.stable_timeout, ".incremental.numeric_lag": i.incremental.numeric_lag,
        ".source.connect_timeout": d.source.connect_timeout, ".source.read_timeout": d.source.read_timeout,
        ".source.statement_timeout": d.source.statement_timeout, ".source.reader": d.source.reader,
        ".source.read_partitions": d.source.read_partitions,
    }
    e = tmp_path / "enrich.yaml"
    e.write_text('kafka: {bootstrap_servers: "127.0.0.1:9"}\nevents: {topic: ev, schema: "a STRING"}\n'
                 "joins: [{dataset: dd, on: a}]\noutput: {console: {}}\ndead_letter_topic: dlq\n"
                 "checkpoint: ck\nstate: {key: a, timestamp: ts}\n")
    c = load_enrich(e)
    assert c.state is not None
    bare = tmp_path / "bare.yaml"
    bare.write_text(e.read_text().replace("joins: [{dataset: dd, on: a}]\n", ""))
    enrich_actual: dict[str, Any] = {
        "events.starting_offsets": c.events.starting_offsets, "events.required": c.events.required,
        "events.source": c.events.source, "joins[]": load_enrich(bare).joins, "joins[].topic":
        c.joins[0].topic.replace("dd", "<dataset>"), "joins[].how": c.joins[0].how,
        "joins[].prefix": c.joins[0].prefix, "joins[].strategy": c.joins[0].strategy,
        "state.ttl": c.state.ttl, "state.watermark": c.state.watermark, "state.buckets": c.state.buckets,
        "output.console.rows": c.output.rows, "trigger": c.trigger,
        "max_events_per_batch": c.max_events_per_batch, "bootstrap_timeout": c.bootstrap_timeout,
        "calls[]": c.calls,
    }
    for heading, actual in (("conf/refresh.yaml", refresh_actual), ("conf/enrich.yaml", enrich_actual)):
        table = config_table(heading)
        wrong = {k: (table.get(k), v) for k, v in actual.items() if k not in table or not matches(table[k], v)}
        assert not wrong, f"docs/configuration.md defaults of {heading} differ from the loader's (docs, loader): {wrong}"


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_point_at_files_that_exist(doc: str) -> None:
    path = ROOT / doc
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    local = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert local or doc != "README.md", f"{doc} links nowhere"
    missing = [link for link in local if not (path.parent / link).exists()]
    assert not missing, f"{doc} links to missing files: {missing}"


def _operations_commands() -> list[str]:
    """Every ``enrich ...`` and ``refresh ...`` command docs/operations.md shows in a code span, with
    its placeholders filled in (``[X ...]`` -> X, N -> 2)."""
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    out = []
    for span in re.findall(r"`((?:enrich|refresh) [^`]+)`", text):
        line = " ".join(span.split()).replace(" ...]", "]").replace("[", "").replace("]", "")
        out.append(re.sub(r"\bN\b", "2", line.replace("spark://...", "spark://host:7077")))
    return out


@pytest.mark.parametrize("command", _operations_commands())
def test_the_operations_guides_commands_are_commands_the_clis_take(command: str) -> None:
    """Each command the operations guide gives parses with its CLI's parser as written: a renamed
    or removed subcommand or option fails here."""
    from enrich.cli import parser as enrich_parser
    from refresh.cli import build_parser as refresh_parser

    prog, *argv = command.split()
    p = enrich_parser() if prog == "enrich" else refresh_parser()
    try:
        p.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"docs/operations.md: `{command}` is refused by the {prog} CLI (exit {exc.code})")
