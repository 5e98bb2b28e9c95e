"""The monitoring configuration under docker/: Prometheus scrape config, rules, rule unit tests, Grafana dashboard.

promtool validates the Prometheus files and runs the rule unit tests. A throwaway Prometheus on loopback
(no scrape targets) loads the shipped rules and parses every dashboard query; each query and each rule
may name only the metrics the service defines (service/ground/metrics.py), the series the rules record, and `up`.
The dashboard shows every metric docs/architecture.md lists. The rules judge each model apart: their unit
tests must have a case of several models where only one model's alert fires.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from service_fixtures import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.rules.yml"))
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
GRAFANA_DIR = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "vitserve.json"
DATASOURCE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER = GRAFANA_DIR / "provisioning" / "dashboards" / "vitserve.yml"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None or PROMETHEUS is None,
    reason="promtool/prometheus not installed: apt-get install prometheus (Debian's package; .ci/run installs it)")

HISTOGRAM_SUFFIXES = ("", "_bucket", "_sum", "_count")
# Grafana's variables, replaced by something Prometheus accepts before a query is sent to it.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$endpoint": ".*",
                     "$model": ".*"}
# The alerts that judge each model on its own (label `model`), and the one about a model version.
PER_MODEL_ALERTS = ("VitserveLatencyObjectiveBreached", "VitserveHighErrorRatio", "VitserveQueueSaturated")
MODEL_VERSION_ALERT = "VitserveModelVersionNotReady"
LOAD_FAILED_ALERT = "VitserveModelLoadFailed"
DRIFT_ALERT = "VitserveInputDrift"  # per model, over the OOD score's histogram (docker/prometheus/tests/drift.test.yml)
DEGRADED_ALERT = "VitserveDegradedUnderLoad"  # per model, answers load made cheaper (docker/prometheus/tests/budgets.test.yml)


def documented_metrics() -> set[str]:
    """Every exposed name the architecture contract allows: its metric list, prefixed, with histogram suffixes."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = re.search(r"all prefixed `vitserve_`:(.*?)(?:\n\S|\n\n|\Z)", text, re.S)
    assert section, "docs/architecture.md lost its metric list"
    bases = {"vitserve_" + m for m in re.findall(r"`([a-z_]+)(?:\{[^}`]*\})?`", section.group(1))}
    return {base + suffix for base in bases for suffix in HISTOGRAM_SUFFIXES}


def defined_metrics() -> set[str]:
    """Every name the service exposes: its metric families (defined once, in service/ground/metrics.py) with the
    suffixes of their samples."""
    from vitserve.service.ground.metrics import ServiceMetrics
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": HISTOGRAM_SUFFIXES}
    return {family.name + suffix for family in ServiceMetrics().registry.collect() for suffix in suffixes[family.type]}


_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_SELECTORS_AND_RANGES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIERS = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*(\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    text = _STRINGS.sub('""', expr)
    text = _SELECTORS_AND_RANGES.sub(" ", text)
    text = _GROUPINGS.sub(" ", text)
    return {m[1] for m in _IDENTIFIERS.finditer(text) if not m[2] and m[1].lower() not in _KEYWORDS}


def to_promql(grafana_expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        grafana_expr = grafana_expr.replace("${" + variable[1:] + "}", value).replace(variable, value)
    assert "$" not in grafana_expr, f"unknown Grafana variable in {grafana_expr}"
    return grafana_expr


def dashboard_panels() -> list[dict]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [p for p in panels if p["type"] != "row"] + [q for p in panels for q in p.get("panels", [])]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and for the templating variables' label_values()."""
    queries = [(p["title"], t["expr"]) for p in dashboard_panels() for t in p["targets"]]
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["query"]["query"])
        assert inner, f"variable {variable['name']}: expected label_values(selector, label)"
        queries.append((f"variable {variable['name']}", inner.group(1)))
    return queries


def run_promtool(*args: str) -> str:
    result = subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    print(f"$ promtool {' '.join(args)}\n{output}")
    assert result.returncode == 0, output
    return output


def api_get(base_url: str, path: str, **params: str) -> dict:
    """GET a Prometheus API path; an error answer (400 on a parse error) comes back as its JSON body."""
    url = f"{base_url}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"{}") | {"http_status": err.code}


@contextmanager
def running_prometheus(config: dict, workdir: Path, ready_timeout_s: float = 30):
    """A real Prometheus on a free 127.0.0.1 port with `config`, storing under `workdir`; yields its URL.
    Always stopped (SIGTERM, then SIGKILL after 10 s). Also used by test_prometheus_integration.py."""
    config_path = workdir / "prometheus.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    url = f"http://127.0.0.1:{free_port()}"
    log_path = workdir / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address={url.removeprefix('http://')}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                assert proc.poll() is None, f"Prometheus exited:\n{log_path.read_text()}"
                try:
                    urllib.request.urlopen(f"{url}/-/ready", timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"Prometheus not ready after {ready_timeout_s} s"
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A throwaway Prometheus with the shipped rule files and no scrape targets."""
    config = {"global": {"evaluation_interval": "1s"}, "rule_files": [str(p) for p in RULE_FILES]}
    with running_prometheus(config, tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@pytest.fixture(scope="module")
def loaded_rules(prometheus) -> list[dict]:
    groups = api_get(prometheus, "/api/v1/rules")["data"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


# --- promtool -------------------------------------------------------------------------------------------

@needs_promtool
def test_prometheus_config_is_valid_and_finds_the_rule_files():
    output = run_promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in output
    assert len(RULE_FILES) == 2


@needs_promtool
def test_rule_files_are_valid():
    output = run_promtool("check", "rules", *map(str, RULE_FILES))
    assert output.count("SUCCESS") == len(RULE_FILES)


@needs_promtool
@pytest.mark.slow
def test_rule_unit_tests_pass():
    assert {p.name for p in RULE_TESTS} >= {"latency.test.yml", "errors.test.yml", "availability.test.yml",
                                            "objectives.test.yml"}
    output = run_promtool("test", "rules", *map(str, RULE_TESTS))
    assert output.count("SUCCESS") == len(RULE_TESTS)
    assert "FAILED" not in output


@needs_promtool
def test_rule_unit_tests_cover_every_alert(loaded_rules):
    """Each alert has a case where it fires (exp_alerts with labels) in the rule unit tests."""
    alerts = {r["name"] for r in loaded_rules if r["type"] == "alerting"}
    assert alerts == {*PER_MODEL_ALERTS, "VitserveTargetDown", "VitserveNotReady", MODEL_VERSION_ALERT,
                      LOAD_FAILED_ALERT, DRIFT_ALERT, DEGRADED_ALERT}
    tests_text = "\n".join(p.read_text() for p in RULE_TESTS)
    for alert in alerts:
        fired = re.search(rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels:", tests_text)
        silent = re.search(rf"alertname: {alert}\n\s+exp_alerts: \[\]", tests_text)
        assert fired and silent, f"{alert}: needs a test where it fires and one where it stays silent"


@needs_promtool
def test_rules_record_per_model_series_beside_the_all_model_ones(loaded_rules):
    """The series from before models were labelled keep their names; per-model ones sit beside them; only
    readiness keeps `version`, so the count of recorded series follows models, not versions."""
    recorded = {r["name"]: r["query"] for r in loaded_rules if r["type"] == "recording"}
    all_models = {"vitserve:request_duration_seconds_bucket:rate5m", "vitserve:request_duration_seconds:p50_5m",
                  "vitserve:request_duration_seconds:p90_5m", "vitserve:request_duration_seconds:p99_5m",
                  "vitserve:requests:rate5m", "vitserve:images:rate5m", "vitserve:requests_rejected:rate5m",
                  "vitserve:request_errors:ratio_rate5m", "vitserve:requests_throttled:ratio_rate5m"}
    per_model = {"vitserve:model_request_duration_seconds:p50_5m", "vitserve:model_request_duration_seconds:p90_5m",
                 "vitserve:model_request_duration_seconds:p99_5m", "vitserve:model_images:rate5m",
                 "vitserve:model_request_errors:ratio_rate5m", "vitserve:model_queue_depth:sum",
                 "vitserve:model_ready:min", "vitserve:endpoint_model_request_duration_seconds:p99_5m",
                 "vitserve:endpoint_model_request_errors:ratio_rate5m",
                 "vitserve:endpoint_model_requests_throttled:ratio_rate5m"}
    assert all_models | per_model <= set(recorded)
    for name, query in recorded.items():
        groupings = re.findall(r"\b(by|without)\s*\(([^)]*)\)", query)
        assert all(kind == "by" for kind, _ in groupings), f"{name}: `without` would keep labels added later"
        kept = {label.strip() for _, labels in groupings for label in labels.split(",")}
        assert ("version" in kept) == (name == "vitserve:model_ready:min"), name
        if name.startswith(("vitserve:model_", "vitserve:endpoint_model_")) and groupings:
            assert "model" in kept, name
    alerts = {r["name"]: r["query"] for r in loaded_rules if r["type"] == "alerting"}
    for alert in PER_MODEL_ALERTS:
        assert "vitserve:endpoint_model_" in alerts[alert], alert


def test_rule_unit_tests_fire_for_one_model_of_several():
    """For each alert about models, a unit test with several models where it fires for some of them only."""
    cases = [case for path in RULE_TESTS for case in yaml.safe_load(path.read_text())["tests"]]
    for alert in (*PER_MODEL_ALERTS, MODEL_VERSION_ALERT):
        fired_for_some = False
        for case in cases:
            models = {m for series in case["input_series"] for m in re.findall(r'\bmodel="([^"]+)"', series["series"])}
            for check in case.get("alert_rule_test", []):
                if check["alertname"] == alert:
                    fired = {a["exp_labels"].get("model") for a in check.get("exp_alerts") or []} - {None}
                    fired_for_some |= bool(fired) and len(fired) < len(models)
        assert fired_for_some, f"{alert}: no unit test where it fires for some of several models only"


# --- what the rules and the dashboard may name ----------------------------------------------------------

def test_series_names_finds_metrics_and_ignores_functions_labels_and_keywords():
    expr = ('histogram_quantile(0.99, sum by (le, endpoint) (rate(a_bucket{status=~"2..", x="b_total"}[5m])))'
            ' > on() group_left() ns:objective or vector(1e3) * up offset 5m unless c_count')
    assert series_names(expr) == {"a_bucket", "ns:objective", "up", "c_count"}


def test_every_documented_metric_is_defined_by_the_service():
    documented_bases = {n for n in documented_metrics() if not n.endswith(HISTOGRAM_SUFFIXES[1:])}
    assert documented_bases - defined_metrics() == set()


@needs_promtool
def test_rules_name_only_defined_metrics(loaded_rules):
    recorded = {r["name"] for r in loaded_rules if r["type"] == "recording"}
    allowed = defined_metrics() | recorded | {"up"}
    for rule in loaded_rules:
        assert rule["health"] != "err", rule
        unknown = series_names(rule["query"]) - allowed
        assert not unknown, f"rule {rule['name']} names {unknown}, not defined in service/ground/metrics.py nor recorded"


@needs_promtool
def test_dashboard_queries_parse_and_name_only_defined_metrics(prometheus, loaded_rules):
    recorded = {r["name"] for r in loaded_rules if r["type"] == "recording"}
    allowed = defined_metrics() | recorded | {"up"}
    queries = dashboard_queries()
    assert len(queries) >= 30
    for title, expr in queries:
        answer = api_get(prometheus, "/api/v1/query", query=to_promql(expr))
        assert answer.get("status") == "success", f"panel {title!r}: {expr}\n{answer}"
        unknown = series_names(expr) - allowed
        assert not unknown, f"panel {title!r} names {unknown}, not defined in service/ground/metrics.py nor recorded"


def test_dashboard_shows_every_documented_metric_and_three_latency_quantiles():
    queries = [expr for _, expr in dashboard_queries()]
    used = {name.removesuffix(s) for e in queries for name in series_names(e) for s in HISTOGRAM_SUFFIXES
            if s and name.endswith(s)} | {name for e in queries for name in series_names(e)}
    documented_bases = {n for n in documented_metrics() if not n.endswith(HISTOGRAM_SUFFIXES[1:])}
    assert documented_bases - used == set()
    latency = [e for e in queries if "vitserve_request_duration_seconds_bucket" in e]
    for quantile in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile},") for e in latency), quantile


# --- Grafana --------------------------------------------------------------------------------------------

def test_dashboard_panels_use_the_provisioned_datasource_and_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    uid = re.search(r"^\s+uid:\s*(\S+)", DATASOURCE.read_text(), re.M).group(1)
    assert re.search(r"^\s+url:\s*http://prometheus:9090\s*$", DATASOURCE.read_text(), re.M)
    assert dashboard["uid"] == "vitserve" and dashboard.get("id") is None
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & cell, f"panel {p['title']!r} overlaps another"
        cells |= cell
    for p in dashboard_panels():
        assert p["targets"], p["title"]
        assert {p["datasource"]["uid"]} | {t["datasource"]["uid"] for t in p["targets"]} == {uid}, p["title"]


def test_dashboard_filters_by_model_and_shows_each_version_readiness():
    dashboard = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
    assert variable["query"]["query"] == 'label_values(vitserve_model_ready{job="vitserve"}, model)'
    assert variable["multi"] is True and variable["includeAll"] is True
    # Every query of a per-model metric or recorded series follows the variable.
    per_model = re.compile(r"vitserve_(queue_wait|preprocess|inference|postprocess)_seconds|vitserve_batch_size|"
                           r"vitserve_images_total|vitserve_queue_depth|vitserve_model_ready|"
                           r"vitserve:(endpoint_)?model_")
    for title, expr in dashboard_queries():
        if per_model.search(expr) and not title.startswith("variable"):
            assert 'model=~"$model"' in expr, f"panel {title!r}: {expr}"
    # The latency, throughput and queue panels draw one line per model.
    legends = {p["title"]: [t["legendFormat"] for t in p["targets"]] for p in dashboard_panels()}
    for title in ("Request latency p50 / p90 / p99 by model (2xx)", "Images and ONNX Runtime calls / s by model",
                  "Mean batch size by model", "Requests / s by model, endpoint and status"):
        assert all("{{model}}" in legend for legend in legends[title]), title
    assert "{{model}}" in legends["Queue depth by model, and requests in flight"][0]
    ready = next(p for p in dashboard_panels() if p["title"] == "Model versions ready")
    assert re.fullmatch(r"min by \(model, version\) \(max by \(instance, model, version\) "
                        r'\(vitserve_model_ready\{job="vitserve", model=~"\$model"\}\)\)', ready["targets"][0]["expr"])


def test_dashboard_provider_points_at_the_dashboards_mount():
    text = DASHBOARD_PROVIDER.read_text()
    assert re.search(r"^\s+path:\s*/var/lib/grafana/dashboards\s*$", text, re.M)
    assert re.search(r"^\s+type:\s*file\s*$", text, re.M)
