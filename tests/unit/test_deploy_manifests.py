"""The Kubernetes manifests under deploy/ against the Kubernetes schemas, offline.

- Core kinds (Deployment, Service, ...): kubernetes-validate's bundled schemas of the
  newest Kubernetes it ships and of K8S_OLDEST, strict (unknown fields fail).
- Custom resources (RayService, ScaledObject): the OpenAPI v3 schemas of their published
  CRDs, with jsonschema. The schemas are in tests/data/k8s_schemas/, extracted from
  github.com/ray-project/kuberay v1.7.0 (59d663aeec13760646da3db9c1cf8cfe883e30b7)
  ray-operator/config/crd/bases/ray.io_rayservices.yaml and github.com/kedacore/keda v2.20.2
  (68a5b5028f35b22d50597c69819ab32c4e92f21a) config/crd/bases/keda.sh_scaledobjects.yaml;
  see the README there. Closed when loaded: see closed_schema.
- What the manifests run: the RayService's Serve config (import path, `llmserve serve`
  options through the conversion app_builder makes) and the Deployment's command line,
  through llmserve.cli.serve_configs.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = ROOT / "tests" / "data" / "k8s_schemas"

# The newest Kubernetes whose schemas the installed kubernetes-validate ships, and the
# oldest one the manifests claim to work on.
K8S_LATEST = kubernetes_validate.latest_version()
K8S_OLDEST = "1.29"

CRD_SCHEMAS = {
    ("ray.io/v1", "RayService"): "rayservice-ray.io-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}
APP_IMPORT_PATH = "llmserve.ray_serve.launcher:app_builder"
# RFC 1123 subdomain: what Kubernetes requires of most object names.
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _load_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        with path.open() as f:
            for i, doc in enumerate(yaml.safe_load_all(f)):
                if doc is not None:
                    docs.append((f"{path.relative_to(DEPLOY)}#{i}", doc))
    return docs


DOCUMENTS = _load_documents()


def _docs(kind: str | None = None, custom: bool | None = None) -> list[Any]:
    """pytest params (id: file#index Kind/name) of the documents of a kind, or of the
    custom (CRD-defined) or core kinds."""
    out = []
    for where, doc in DOCUMENTS:
        is_custom = (doc.get("apiVersion"), doc.get("kind")) in CRD_SCHEMAS
        if (kind is None or doc.get("kind") == kind) and custom in (None, is_custom):
            name = (doc.get("metadata") or {}).get("name")
            out.append(pytest.param(doc, id=f"{where} {doc.get('kind')}/{name}"))
    return out


# -- schemas -------------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
               "else", "contains", "propertyNames")


def closed_schema(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and neither says what other fields may hold (``additionalProperties``)
    nor keeps unknown ones (``x-kubernetes-preserve-unknown-fields``).

    Why: a structural CRD schema is closed by convention, not by keyword. The API server
    prunes fields it does not list, and `kubectl apply` (strict server-side field
    validation) rejects them; JSON Schema treats such objects as open, so without this a
    misspelt field (`replica:`, `metdata:`) would pass here and silently vanish in the
    cluster. The walk follows the schema's structure: keys of ``properties`` are field
    names (a field may be called "properties"), never keywords."""
    if not isinstance(schema, dict):
        return schema  # true/false schemas
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_schema(sub) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            out[key] = closed_schema(schema[key])
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[api_version, kind]).read_text())
    schema = closed_schema(schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate_custom(doc: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError: the best match, with its path."""
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise error


def validate_metadata(doc: dict[str, Any]) -> None:
    """What a CRD's schema leaves open (``metadata: {type: object}``): a valid name, string
    maps of labels and annotations, no other fields than a manifest should set."""
    meta = doc.get("metadata")
    assert isinstance(meta, dict), "no metadata"
    name = meta.get("name")
    assert isinstance(name, str) and len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name), (
        f"metadata.name {name!r} is not a DNS subdomain name")
    assert set(meta) <= {"name", "namespace", "labels", "annotations"}, sorted(meta)
    for field in ("labels", "annotations"):
        values = meta.get(field, {})
        assert isinstance(values, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in values.items()), (
            f"metadata.{field} must map strings to strings: {values!r}")


# -- every document ------------------------------------------------------------------------

def test_deploy_has_the_manifests():
    kinds = sorted(f"{doc['apiVersion']} {doc['kind']}" for _, doc in DOCUMENTS)
    assert kinds == ["apps/v1 Deployment", "keda.sh/v1alpha1 ScaledObject",
                     "ray.io/v1 RayService", "ray.io/v1 RayService", "v1 Service"]
    plain = [(doc["kind"], doc["metadata"]["name"]) for where, doc in DOCUMENTS
             if where.startswith("plain/")]
    assert len(set(plain)) == len(plain), f"two objects of one kind and name: {plain}"


@pytest.mark.parametrize("version", sorted({K8S_OLDEST, K8S_LATEST}))
@pytest.mark.parametrize("doc", _docs(custom=False))
def test_core_kind_is_valid(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)
    validate_metadata(doc)


@pytest.mark.parametrize("doc", _docs(custom=True))
def test_custom_resource_is_valid(doc):
    validate_custom(doc)
    validate_metadata(doc)


def test_crd_schemas_are_closed_only_where_kubernetes_closes_them():
    schema = closed_schema(json.loads((SCHEMAS / CRD_SCHEMAS["ray.io/v1", "RayService"])
                                      .read_text()))
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False
    # maps keep their value schema; objects without listed fields stay open
    head = spec["properties"]["rayClusterConfig"]["properties"]["headGroupSpec"]
    assert head["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in schema["properties"]["metadata"]
    assert closed_schema({"type": "object", "properties": {"a": {"type": "object"}},
                          "x-kubernetes-preserve-unknown-fields": True}) == {
        "type": "object", "properties": {"a": {"type": "object"}},
        "x-kubernetes-preserve-unknown-fields": True}
    # a field named like a keyword is a field
    assert closed_schema({"type": "object", "properties": {"properties": {"type": "string"}}}
                         )["properties"] == {"properties": {"type": "string"}}


# -- what the manifests run ----------------------------------------------------------------

def app_argv(args: dict[str, Any]) -> list[str]:
    """The `llmserve serve` command line of a Serve application's ``args``, as
    llmserve.ray_serve.launcher.app_builder builds it."""
    from llmserve.ray_serve.launcher import serve_argv

    return serve_argv(args)


@cache
def serve_options() -> frozenset[str]:
    """The option names `llmserve serve` takes, exactly (argparse would also take any
    unambiguous prefix, so a misspelt name could parse as another option)."""
    from llmserve.cli import _build_parser

    [sub] = [a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return frozenset(sub.choices["serve"]._option_string_actions)


def assert_exact_options(argv: list[str]) -> None:
    unknown = [a for a in argv if a.startswith("--") and a not in serve_options()]
    assert not unknown, f"not `llmserve serve` options: {unknown}"


def _serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert isinstance(config, dict), "serveConfigV2 is not a YAML mapping"
    return config


def _containers(rayservice: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict]]:
    """(group, container, group spec) of the head and each worker group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"]),
              *((g["groupName"], g) for g in cluster.get("workerGroupSpecs", []))]
    return [(name, c, group) for name, group in groups for c in group["template"]["spec"]
            ["containers"]]


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("doc", _docs("RayService"))
def test_rayservice_serve_config(doc, monkeypatch):
    from llmserve.cli import serve_configs
    from llmserve.models.names import DEFAULT_MODEL, NAMED_MODELS

    config = _serve_config(doc)
    try:
        from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema
    except ImportError:
        pass
    else:  # Ray's own check (types, import path form), and no field Ray would ignore
        ServeDeploySchema.model_validate(config)
        assert set(config) <= set(ServeDeploySchema.model_fields), sorted(config)
        for app in config["applications"]:
            assert set(app) <= set(ServeApplicationSchema.model_fields), sorted(app)
    [app] = config["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == (
        "llmserve", "/", APP_IMPORT_PATH)
    module_name, attribute = app["import_path"].split(":")
    # (the launcher imports Ray only inside its functions)
    launcher = importlib.import_module(module_name)
    assert callable(getattr(launcher, attribute))

    args = app["args"]
    assert isinstance(args, dict), "args must map `llmserve serve` options to values"
    assert_exact_options(app_argv(args))
    engine_config, server_config, ray_config = serve_configs(app_argv(args))
    assert engine_config.model.model in NAMED_MODELS or engine_config.model.model == (
        DEFAULT_MODEL)
    assert ray_config is not None, "no replicas, no min-replicas: not a Ray Serve app"
    # app_builder itself, short of building the Ray application, gets the same configs.
    monkeypatch.setattr(launcher, "build_application", lambda *configs: configs)
    assert getattr(launcher, attribute)(args) == (engine_config, server_config, ray_config)
    # The kubelet's probes and the Service's clients do not send a loopback Host header.
    assert server_config.allowed_hosts is None, "set allowed-hosts: '*'"

    # Serve's proxy listens where the Service and the probes look.
    assert config["http_options"]["port"] == 8000
    ports = doc["spec"]["serveService"]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in ports] == [("serve", 8000)]
    containers = _containers(doc)
    for group, container, _ in containers:
        assert {"name": "serve", "containerPort": 8000} in container["ports"], group
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in (8000, "serve"), group
        # KubeRay deploys the Serve config only once the head Pod is Ready: a probe of the
        # app there would never pass (and a liveness one would restart the cluster's GCS).
        if group == "head":
            assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(container)
        else:
            assert container["readinessProbe"]["httpGet"]["path"] == "/ready", group

    # The worker groups can place the replicas, at their largest.
    most = ray_config.max_replicas if ray_config.autoscaling else ray_config.replicas
    capacity = sum(_cpus(c["resources"]["limits"]["cpu"]) * g["maxReplicas"]
                   for name, c, g in containers if name != "head")
    assert capacity >= most * ray_config.cpus_per_replica
    assert doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"][
        "num-cpus"] == "0"


def test_rayservice_autoscaling_variant_autoscales():
    [doc] = [doc for where, doc in DOCUMENTS if where.startswith("kuberay/")
             and "min-replicas" in _serve_config(doc)["applications"][0]["args"]]
    from llmserve.cli import serve_configs

    args = _serve_config(doc)["applications"][0]["args"]
    _, _, ray_config = serve_configs(app_argv(args))
    assert ray_config.autoscaling
    assert doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("doc", _docs("Deployment"))
def test_deployment_command_line(doc):
    from llmserve.cli import serve_configs

    pod = doc["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[0] == "serve"
    assert_exact_options(args[1:])
    _, server_config, ray_config = serve_configs(args[1:])
    assert ray_config is None
    assert server_config.host == "0.0.0.0" and server_config.allowed_hosts is None
    assert not server_config.use_database
    assert [p["containerPort"] for p in container["ports"]] == [server_config.port]
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(server_config.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    probes = {name: container[name]["httpGet"]["path"]
              for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": "/health", "readinessProbe": "/ready",
                      "livenessProbe": "/health"}
    # The drain fits in the grace period, after the preStop pause.
    pause = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pause + server_config.shutdown_timeout


def test_plain_objects_refer_to_each_other():
    [deployment] = [p.values[0] for p in _docs("Deployment")]
    [service] = [p.values[0] for p in _docs("Service")]
    [scaled] = [p.values[0] for p in _docs("ScaledObject")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]
                  ["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == (
        "Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the ScaledObject owns the replica count"
    # the CRD's CEL rule, which jsonschema does not evaluate
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == "sum(llmserve:num_requests_waiting)"
    from llmserve.server.metrics import __file__ as metrics_source

    assert "llmserve:num_requests_waiting" in Path(metrics_source).read_text()


# -- the checks can fail -------------------------------------------------------------------

def _first(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(doc for _, doc in DOCUMENTS if doc["kind"] == kind))


def test_a_deployment_with_an_unknown_field_is_rejected():
    doc = _first("Deployment")
    probe = doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGet"]["paht"] = probe["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(doc, K8S_LATEST, strict=True)


def test_a_service_with_a_wrong_type_is_rejected():
    doc = _first("Service")
    doc["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_LATEST, strict=True)


def test_a_scaledobject_with_an_unknown_trigger_field_is_rejected():
    doc = _first("ScaledObject")
    trigger = doc["spec"]["triggers"][0]
    trigger["threshold"] = trigger["metadata"].pop("threshold")  # beside metadata, not in it
    with pytest.raises(jsonschema.ValidationError, match="threshold") as e:
        validate_custom(doc)
    assert list(e.value.absolute_path) == ["spec", "triggers", 0]


def test_a_scaledobject_with_a_number_in_trigger_metadata_is_rejected():
    doc = _first("ScaledObject")
    doc["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(doc)


def test_a_rayservice_with_an_unknown_field_is_rejected():
    doc = _first("RayService")
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_custom(doc)
    doc = _first("RayService")
    container = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]
    container["resources"]["limits"]["cpu"] = "two"  # not a quantity
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(doc)


def test_bad_metadata_is_rejected():
    doc = _first("RayService")
    doc["metadata"]["name"] = "LLMServe_1"
    with pytest.raises(AssertionError, match="DNS subdomain"):
        validate_metadata(doc)


def test_bad_serve_options_are_rejected():
    from llmserve.cli import serve_configs

    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        serve_configs(app_argv({"replcas": 2}))
    with pytest.raises(AssertionError, match="--replica"):  # argparse would take it
        assert_exact_options(app_argv({"replica": 2, "no_database": True}))
    with pytest.raises(SystemExit):  # argparse: invalid choice
        serve_configs(app_argv({"replicas": 2, "router": "random"}))
    with pytest.raises(ValueError, match="max-replicas"):
        serve_configs(app_argv({"min-replicas": 4, "max-replicas": 2}))
