"""The Kubernetes manifests (deploy/kubernetes, deploy/ray/rayservice.yaml) and docker-compose.yml, checked
without a cluster or a container.

Built-in kinds against the Kubernetes API's own schemas for a pinned version (kubernetes-validate ships them),
strict: a field the API does not know fails. Custom resources (the Prometheus Operator's PodMonitor, KServe's
ServingRuntime and InferenceService, KubeRay's RayService) against the openAPIV3Schema of their published
CRDs carried in deploy/kubernetes/schemas, made strict the way kubeconform does it. The overlays are rendered
by `kubectl kustomize` where kubectl is installed; the files the overlays are made of are checked either way.
Then what schemas cannot see: probes on routes the app has, ports that agree, a grace period that fits the
drain, the HPA asking for metrics the adapter serves and the service defines, selectors that select, every
VITSERVE_* variable a setting the server has, the model repository mounted read-only with its key from a Secret.
"""
from __future__ import annotations

import copy
import gzip
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
SCHEMAS = KUBE / "schemas"
# The oldest Kubernetes still supported upstream when this was written; every field used here is GA in it.
KUBERNETES_VERSION = "1.33.0"
CRD_FILES = {"monitoring.coreos.com": ["monitoring.coreos.com_podmonitors.yaml"],
             "serving.kserve.io": ["serving.kserve.io_servingruntimes.yaml.gz",
                                   "serving.kserve.io_inferenceservices.yaml.gz"],
             "ray.io": ["ray.io_rayservices.yaml.gz"]}
RENDERED = ["overlays/cpu", "overlays/gpu", "overlays/repository", "kserve"]
REPOSITORY = KUBE / "components" / "repository"
# Every file a user applies, alone or through an overlay (patches are partial: rendered only)
PLAIN_FILES = [*sorted((KUBE / "base").glob("[!k]*.yaml")), KUBE / "kserve" / "servingruntime.yaml",
               KUBE / "kserve" / "servingruntime-grpc.yaml",
               KUBE / "kserve" / "inferenceservice.yaml", REPO / "deploy" / "ray" / "rayservice.yaml",
               REPOSITORY / "persistentvolumeclaim.yaml", REPOSITORY / "admin-key.example.yaml"]
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="rendering the overlays needs kubectl (its built-in kustomize)")


def render(directory: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / directory)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict JSON schema of that served version, from the carried CRDs."""
    schemas = {}
    for group, files in CRD_FILES.items():
        for name in files:
            path = SCHEMAS / name
            text = gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz") else path.read_text()
            crd = yaml.load(text, Loader=yaml.CSafeLoader)  # libyaml: 1.0 s for the four CRDs, 6.5 s in pure Python
            assert crd["spec"]["group"] == group
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    key = (f"{group}/{version['name']}", crd["spec"]["names"]["kind"])
                    schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


@cache
def crd_validator(key: tuple[str, str]):
    """`jsonschema.validate` checks the schema itself on every call; the CRDs' schemas are checked once."""
    schema = crd_schemas()[key]
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def strict(schema):
    """The schema with unknown fields refused wherever it lists the known ones (kubeconform's --strict): an
    object with `properties` and neither `additionalProperties` nor x-kubernetes-preserve-unknown-fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate(doc: dict) -> None:
    """Raises when the document is not valid for its kind: the API's schema, or its CRD's."""
    key = (doc["apiVersion"], doc["kind"])
    if key[0].split("/")[0] in CRD_FILES:
        assert key in crd_schemas(), f"{key} is not a served version of the carried CRDs"
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
        crd_validator(key).validate(body)
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                     KUBERNETES_VERSION, strict=True)  # the metadata, as the API checks it
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = {}
    for doc in docs:
        assert doc["kind"] not in kinds, f"two {doc['kind']}s"
        kinds[doc["kind"]] = doc
    return kinds


# --- schemas ---

@pytest.mark.parametrize("path", PLAIN_FILES, ids=lambda p: str(p.relative_to(REPO)))
@pytest.mark.slow
def test_every_file_a_user_applies_is_valid_for_its_kind(path):
    docs = load(path)
    assert docs
    for doc in docs:
        validate(doc)


@needs_kubectl
@pytest.mark.parametrize("directory", RENDERED)
def test_each_rendered_overlay_is_valid_for_the_pinned_kubernetes(directory):
    docs = render(directory)
    expected = {"overlays/cpu": {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                 "PodMonitor"},
                "kserve": {"ServingRuntime", "InferenceService"}}
    assert {d["kind"] for d in docs} == expected.get(directory, expected["overlays/cpu"])
    for doc in docs:
        validate(doc)


def test_the_validators_refuse_a_misspelt_field():
    deployment = by_kind(load(KUBE / "base" / "deployment.yaml"))["Deployment"]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    service = by_kind(load(KUBE / "kserve" / "inferenceservice.yaml"))["InferenceService"]
    broken = copy.deepcopy(service)
    broken["spec"]["predictor"]["model"]["protocolVersions"] = ["v2"]  # the ServingRuntime's spelling
    with pytest.raises(jsonschema.ValidationError, match="protocolVersions"):
        validate(broken)
    rayservice = load(REPO / "deploy" / "ray" / "rayservice.yaml")[0]
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="imag"):
        validate(broken)
    podmonitor = by_kind(load(KUBE / "base" / "podmonitor.yaml"))["PodMonitor"]
    broken = copy.deepcopy(podmonitor)
    broken["apiVersion"] = "monitoring.coreos.com/v2"
    with pytest.raises(AssertionError, match="not a served version"):
        validate(broken)


# --- what schemas cannot see ---

@pytest.fixture(scope="module")
def base() -> dict[str, dict]:
    return {doc["kind"]: doc for path in PLAIN_FILES[:5] for doc in load(path)}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env(deployment: dict) -> dict[str, str | dict]:
    """Each variable's value, or where it comes from (its valueFrom) when it has none."""
    return {e["name"]: e["value"] if "value" in e else e["valueFrom"] for e in container(deployment)["env"]}


def test_probes_ask_routes_the_app_really_has(base):
    from vitserve.service.app import create_app
    from vitserve.service.ground.settings import Settings
    app = create_app(Settings(model_path=REPO / "models" / "vit-fmnist" / "model.onnx"))  # routes only: no lifespan
    routes = set(app.openapi()["paths"])
    c = container(base["Deployment"])
    assert c["readinessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {"/v2/health/ready", "/v2/health/live", "/metrics"} <= routes
    assert base["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def test_ports_agree_from_the_service_to_the_process(base):
    c = container(base["Deployment"])
    port, grpc = c["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8000) and env(base["Deployment"])["VITSERVE_PORT"] == "8000"
    assert (grpc["name"], grpc["containerPort"]) == ("grpc", 8001)
    assert env(base["Deployment"])["VITSERVE_GRPC_PORT"] == "8001"
    assert [p["targetPort"] for p in base["Service"]["spec"]["ports"]] == ["http", "grpc"]
    assert {c[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"http"}
    assert base["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_the_grace_period_fits_the_pause_and_the_drain(base):
    from vitserve.service.cli import DRAIN_MARGIN_S
    pod = base["Deployment"]["spec"]["template"]["spec"]
    pause = int(container(base["Deployment"])["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(env(base["Deployment"])["VITSERVE_DRAIN_TIMEOUT_S"])
    # preStop, then SIGTERM: the drain, uvicorn's own timeout a margin later, and time to exit
    assert pause + drain + DRAIN_MARGIN_S + 5 <= pod["terminationGracePeriodSeconds"] == 45
    assert (pause, drain) == (5, 30.0)


def test_the_selectors_select_the_pods(base):
    deployment = base["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [deployment["spec"]["selector"]["matchLabels"], base["Service"]["spec"]["selector"],
                 base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                 base["PodMonitor"]["spec"]["selector"]["matchLabels"]]
    for selector in selectors:
        assert selector.items() <= pod_labels.items()
    assert base["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}


def test_the_hpa_asks_for_what_the_adapter_serves_from_series_the_service_defines(base):
    from vitserve.service.ground.metrics import ServiceMetrics
    # from the families, not their samples: a metric with model and version labels has none until a model runs
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}
    defined = {family.name + suffix for family in ServiceMetrics().registry.collect()
               for suffix in suffixes.get(family.type, [""])}
    rules = yaml.safe_load((KUBE / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    served = {}
    for rule in rules:
        series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
        assert series in defined, series
        assert re.fullmatch(rule["name"]["matches"], series)
        served[rule["name"]["as"]] = series
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # what the PodMonitor's scrape adds
    asked = {m["pods"]["metric"]["name"] for m in base["HorizontalPodAutoscaler"]["spec"]["metrics"]}
    assert asked == set(served) == {"vitserve_requests_in_flight", "vitserve_queue_depth"}


def test_the_pods_run_as_the_images_user_without_privileges(base):
    user = re.search(r"^USER (\d+):(\d+)$", (REPO / "docker" / "Dockerfile.cpu").read_text(), re.M)
    assert re.search(r"^USER (\d+):(\d+)$", (REPO / "docker" / "Dockerfile.gpu").read_text(), re.M).groups() \
        == user.groups()
    pod = base["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == user.groups()
    context = container(base["Deployment"])["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"] for m in container(base["Deployment"])["volumeMounts"]}
    assert mounts == {"/tmp", "/dev/shm"}  # the only places a read-only server writes


@needs_kubectl
@pytest.mark.parametrize("overlay, image, gpus, providers", [("overlays/cpu", "vitserve:cpu", None, "cpu"),
                                                             ("overlays/gpu", "vitserve:gpu", "1", "cuda,cpu")])
def test_each_overlay_sizes_the_server_to_its_cpu_limit(overlay, image, gpus, providers):
    deployment = by_kind(render(overlay))["Deployment"]
    c = container(deployment)
    assert c["image"] == image
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits.get("nvidia.com/gpu") == requests.get("nvidia.com/gpu") == gpus
    variables = env(deployment)
    # one HTTP worker and one ORT thread per core of the limit: the server would otherwise count the node's
    assert variables["VITSERVE_WORKERS"] == variables["VITSERVE_INTRA_OP_THREADS"] == limits["cpu"]
    assert variables["VITSERVE_PROVIDERS"] == providers
    assert len(c["env"]) == len(variables)  # the overlay replaced the base's values, did not add twins


def test_kserve_runs_the_vitserve_image_over_the_v2_protocol():
    runtime = load(KUBE / "kserve" / "servingruntime.yaml")[0]
    service = load(KUBE / "kserve" / "inferenceservice.yaml")[0]
    model = service["spec"]["predictor"]["model"]
    assert (model["runtime"], model["protocolVersion"]) == (runtime["metadata"]["name"], "v2")
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    (c,) = runtime["spec"]["containers"]
    assert c["name"] == "kserve-container" and c["image"].startswith("vitserve:")
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert service["metadata"]["name"] == "vit-fmnist"  # the artifact's name: /v2/models/vit-fmnist/infer


def test_kserve_grpc_runtime_exposes_the_grpc_port_as_h2c():
    """Knative routes one port per container; the gRPC runtime's is the server's gRPC port, named h2c."""
    runtime = load(KUBE / "kserve" / "servingruntime-grpc.yaml")[0]
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"]
    (c,) = runtime["spec"]["containers"]
    variables = {v["name"]: v["value"] for v in c["env"]}
    assert c["ports"] == [{"name": "h2c", "containerPort": int(variables["VITSERVE_GRPC_PORT"]), "protocol": "TCP"}]
    assert variables["VITSERVE_GRPC_PORT"] != variables["VITSERVE_PORT"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": int(variables["VITSERVE_PORT"])}
    http = load(KUBE / "kserve" / "servingruntime.yaml")[0]["spec"]["containers"][0]
    assert {v["name"]: v["value"] for v in http["env"]}["VITSERVE_GRPC_PORT"] == "0"


# --- the model repository ---

def setting_names() -> set[str]:
    from vitserve.service.ground.settings import Settings
    return {f"VITSERVE_{name.upper()}" for name in Settings.model_fields}


@needs_kubectl
@pytest.mark.parametrize("directory", ["overlays/cpu", "overlays/gpu", "overlays/repository"])
def test_every_variable_the_pods_get_is_a_setting_of_the_server(directory):
    # the settings ignore variables they do not know: a misspelt name would be dropped without a word
    assert set(env(by_kind(render(directory))["Deployment"])) <= setting_names()


@needs_kubectl
def test_the_repository_overlay_serves_a_read_only_volume_with_the_admin_key_of_a_secret():
    deployment = by_kind(render("overlays/repository"))["Deployment"]
    c, pod = container(deployment), deployment["spec"]["template"]["spec"]
    variables = env(deployment)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert variables["VITSERVE_MODEL_REPOSITORY"] == mount["mountPath"]
    assert (variables["VITSERVE_MODEL_CONTROL_MODE"], variables["VITSERVE_REPOSITORY_POLL_SECS"]) == ("poll", "15")
    assert {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")} == {"/tmp", "/dev/shm"}

    claim = load(REPOSITORY / "persistentvolumeclaim.yaml")[0]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # pods on any node read while a writer adds versions

    secret = load(REPOSITORY / "admin-key.example.yaml")[0]
    (key,) = secret["stringData"]
    assert variables["VITSERVE_ADMIN_KEY"] == {"secretKeyRef": {"name": secret["metadata"]["name"], "key": key}}
    assert "REPLACE-ME" in secret["stringData"][key]  # an example, never a key someone could leave in place


@needs_kubectl
def test_the_repository_component_changes_nothing_else():
    added = {"VITSERVE_MODEL_REPOSITORY", "VITSERVE_MODEL_CONTROL_MODE", "VITSERVE_REPOSITORY_POLL_SECS",
             "VITSERVE_ADMIN_KEY"}
    with_repository = by_kind(render("overlays/repository"))
    without = by_kind(render("overlays/cpu"))
    assert with_repository.keys() == without.keys()  # neither the claim nor the Secret: they outlive the overlay
    deployment = copy.deepcopy(with_repository["Deployment"])
    c, pod = container(deployment), deployment["spec"]["template"]["spec"]
    c["env"] = [e for e in c["env"] if e["name"] not in added]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "models"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "models"]
    assert deployment == without["Deployment"]
    assert {k: v for k, v in with_repository.items() if k != "Deployment"} == \
        {k: v for k, v in without.items() if k != "Deployment"}


def test_the_deployment_docs_call_routes_the_app_has():
    from vitserve.service.app import create_app
    from vitserve.service.ground.settings import Settings
    app = create_app(Settings(model_path=REPO / "models" / "vit-fmnist" / "model.onnx"))  # routes only
    routes = set(app.openapi()["paths"])
    text = (REPO / "docs" / "deployment-repository.md").read_text()
    called = {re.sub(r"/models/[^/]+/", "/models/{name}/", path)
              for path in re.findall(r"/v2/repository/(?:index|models/[\w.$-]+/(?:load|unload))", text)}
    assert called == {"/v2/repository/index", "/v2/repository/models/{name}/load",
                      "/v2/repository/models/{name}/unload"}
    assert called <= routes


# --- docker compose ---

class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (`!reset`, `!override`), read as their plain values."""


def untagged(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node)


for tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(tag, untagged)


def compose_server(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), ComposeLoader)["services"]["vitserve"]


# OpenTelemetry's own variables, read by its SDK (service/ground/tracing.py), pass through compose too
OTEL_VARIABLES = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME"}


def test_compose_passes_only_settings_the_server_has():
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        assert set(compose_server(name)["environment"]) <= setting_names() | OTEL_VARIABLES, name


def test_compose_serves_the_bundled_model_unless_a_repository_is_asked_for():
    server = compose_server("docker-compose.yml")
    variables = server["environment"]
    image_model = re.search(r"^\s+VITSERVE_MODEL_PATH=(\S+)", (REPO / "docker" / "Dockerfile.cpu").read_text(),
                            re.M).group(1)
    assert variables["VITSERVE_MODEL_PATH"] == f"${{VITSERVE_MODEL_PATH:-{image_model}}}"
    # Without a value compose passes a variable from the environment or leaves it unset; a default of "" would
    # be a repository at the working directory, or an empty admin key.
    for name in ("VITSERVE_MODEL_REPOSITORY", "VITSERVE_MODEL_CONTROL_MODE", "VITSERVE_LOAD_MODELS",
                 "VITSERVE_ADMIN_KEY", "VITSERVE_API_KEY"):
        assert variables[name] is None, name
    assert variables["VITSERVE_REPOSITORY_POLL_SECS"] == "${VITSERVE_REPOSITORY_POLL_SECS:-15}"
    assert "${VITSERVE_MODELS_DIR:-./models}:/models:ro" in server["volumes"]
