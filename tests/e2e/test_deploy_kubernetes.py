"""deploy/kubernetes/*.yaml against the schemas of named Kubernetes versions and of their CRDs.

Kubernetes' own kinds (ConfigMap, Job, and the pod and Job templates inside the custom
resources) are validated with kubernetes-validate, which bundles Kubernetes' JSON schemas
(no network), in strict mode: an unknown field is an error, as with ``kubectl apply``'s
default strict field validation. The custom resources' own fields are validated against the
models their projects publish: the PyTorchJob (kubeflow.org/v1) with the Kubeflow training
SDK's, the JobSet (jobset.x-k8s.io/v1alpha2) with the Kubeflow trainer API's (it carries
JobSet's v1alpha2 types); unknown fields are refused there too.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from spotrun.supervisor import EXIT_FENCED
from spotrun.supervisor.config_file import load_run_config
from tests.support.paths import REPO

ROOT = REPO
KUBERNETES = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests are for: the Job's podReplacementPolicy is on by default
#: from 1.29 (and 1.28's schemas refuse a podFailurePolicy rule without onPodConditions).
OLDEST_KUBERNETES = "1.29"
#: The oldest and the newest version whose schemas the installed kubernetes-validate bundles.
KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, ".".join(latest_version().split(".")[:2]))
#: What the configs read from the environment, as a user would set it.
EXAMPLE_ENV = {"SPOTRUN_BUCKET": "my-bucket"}
#: Kinds that kubernetes-validate cannot know (custom resources), checked against their models.
CUSTOM_KINDS = {("kubeflow.org/v1", "PyTorchJob"), ("jobset.x-k8s.io/v1alpha2", "JobSet")}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _kinds(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in _docs(KUBERNETES / name)}


def _tool(name: str) -> str:
    return f"{name} {importlib.metadata.version(name)}"


def _validate_kubernetes(obj: dict, version: str) -> str:
    """kubernetes-validate in strict mode; returns the schema version it used."""
    try:
        return kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise AssertionError(
            f"{_tool('kubernetes-validate')}, Kubernetes {version}: {obj['kind']} {where}: {exc.message}"
        ) from None


def _embedded_kubernetes_objects(doc: dict) -> list[dict]:
    """The Kubernetes objects inside a custom resource, as whole objects kubernetes-validate
    knows: the metadata (as a ConfigMap's), the PyTorchJob's pod templates (as PodTemplates),
    the JobSet's Job templates (as Jobs)."""
    objects = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}]
    if doc["kind"] == "PyTorchJob":
        for spec in doc["spec"]["pytorchReplicaSpecs"].values():
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "template"},
                    "template": spec["template"],
                }
            )
    else:
        for replicated in doc["spec"]["replicatedJobs"]:
            template = replicated["template"]
            objects.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": template.get("metadata", {"name": replicated["name"]}),
                    "spec": template["spec"],
                }
            )
    return objects


# --- the custom resources' own schemas, from their published models ------------------------


def _closed(schema: dict) -> dict:
    """``schema`` with unknown fields refused in every object that lists its fields."""
    if "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema


def _kubeflow_training_schema(type_name: str) -> dict:
    """JSON schema of a Kubeflow training SDK model (OpenAPI generator classes: ``openapi_types``
    and ``attribute_map``). Kubernetes' own types inside are left open: they are validated by
    kubernetes-validate (:func:`_embedded_kubernetes_objects`)."""
    import kubeflow.training.models as models

    scalars = {
        "str": {"type": "string"},
        "int": {"type": "integer"},
        "bool": {"type": "boolean"},
        "object": {},
        "datetime": {"type": "string"},
    }
    if type_name in scalars:
        return scalars[type_name]
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        return {"type": "array", "items": _kubeflow_training_schema(match[1])}
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        return {"type": "object", "additionalProperties": _kubeflow_training_schema(match[1])}
    if not type_name.startswith("KubeflowOrg"):
        return {}  # a Kubernetes type (V1PodTemplateSpec, V1ObjectMeta)
    model = getattr(models, type_name)
    return _closed(
        {
            "type": "object",
            "properties": {
                model.attribute_map[attr]: _kubeflow_training_schema(kind) for attr, kind in model.openapi_types.items()
            },
        }
    )


def _jobset_schema() -> dict:
    """JSON schema of the JobSet from the Kubeflow trainer API's pydantic models of JobSet's
    v1alpha2 types. Kubernetes' own types inside are left open (validated by kubernetes-validate)."""
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    schema = JobsetV1alpha2JobSet.model_json_schema(by_alias=True)
    for name, definition in schema["$defs"].items():
        schema["$defs"][name] = {} if name.startswith("IoK8s") else _closed(definition)
    return _closed(schema)


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, tuple[dict, str]]:
    """``{kind: (JSON schema, "package version")}`` of the custom resources (made once: a few seconds)."""
    return {
        "PyTorchJob": (_kubeflow_training_schema("KubeflowOrgV1PyTorchJob"), _tool("kubeflow-training")),
        "JobSet": (_jobset_schema(), _tool("kubeflow-trainer-api")),
    }


def _validate_custom(doc: dict, crd_schemas: dict[str, tuple[dict, str]]) -> str:
    """Validate a custom resource's own fields against its model; returns the model package."""
    schema, tool = crd_schemas[doc["kind"]]
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, f"{tool}: {doc['kind']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
    )
    return tool


# --- tests -------------------------------------------------------------------------------

MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS, ids=lambda v: f"k8s-{v}")
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_for_kubernetes_version(path, version, record_property):
    tool = _tool("kubernetes-validate")
    record_property("tool", f"{tool}, Kubernetes {version} schemas (strict)")
    checked = []
    for doc in _docs(path):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            objects = _embedded_kubernetes_objects(doc)
        else:
            objects = [doc]
        for obj in objects:
            used = _validate_kubernetes(obj, version)
            assert used == version, f"{tool} has no schemas of Kubernetes {version} (it used {used})"
            checked.append(obj["kind"])
    print(f"{path.name}: {', '.join(checked)} valid with {tool}, Kubernetes {version} schemas (strict)")


@pytest.mark.parametrize(
    "path",
    [p for p in MANIFESTS if any((d["apiVersion"], d["kind"]) in CUSTOM_KINDS for d in _docs(p))],
    ids=lambda p: p.name,
)
def test_custom_resource_is_valid_for_its_crd_models(path, crd_schemas, record_property):
    for doc in _docs(path):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            tool = _validate_custom(doc, crd_schemas)
            record_property("tool", tool)
            print(f"{path.name}: {doc['kind']} valid with {tool}")


def test_validators_refuse_unknown_and_mistyped_fields(crd_schemas):
    """The checks above can fail: a misspelt field or a wrong type in each kind is refused."""
    job = copy.deepcopy(_kinds("job.yaml")["Job"])
    job["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(AssertionError, match="terminationGracePeriodSecond"):
        _validate_kubernetes(job, OLDEST_KUBERNETES)
    jobset = copy.deepcopy(_kinds("jobset.yaml")["JobSet"])
    jobset["spec"]["failurePolicy"]["maxRestart"] = 4
    with pytest.raises(AssertionError, match="maxRestart"):
        _validate_custom(jobset, crd_schemas)
    jobset = copy.deepcopy(_kinds("jobset.yaml")["JobSet"])
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = "0"
    with pytest.raises(AssertionError, match="backoffLimit"):
        for obj in _embedded_kubernetes_objects(jobset):
            _validate_kubernetes(obj, OLDEST_KUBERNETES)
    pytorchjob = copy.deepcopy(_kinds("pytorchjob.yaml")["PyTorchJob"])
    pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 3
    with pytest.raises(AssertionError, match="replica"):
        _validate_custom(pytorchjob, crd_schemas)
    pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"] = {"replicas": "3"}
    with pytest.raises(AssertionError, match="replicas"):
        _validate_custom(pytorchjob, crd_schemas)


def test_jobset_runs_torchrun_on_every_node_with_the_leader_as_rendezvous(tmp_path):
    jobset = _kinds("jobset.yaml")["JobSet"]
    spec = jobset["spec"]
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    # One pod per node, all started together, each told its rank by its completion index.
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"] == int(env["PET_NNODES"]["value"])
    assert (
        env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    # The rendezvous host is the coordinator pod, reached through the JobSet's headless service.
    assert spec["network"]["enableDNSHostnames"] is True
    coordinator = spec["coordinator"]
    assert coordinator["replicatedJob"] == replicated["name"]
    assert coordinator.get("jobIndex", 0) < replicated["replicas"]
    assert coordinator.get("podIndex", 0) < job["parallelism"]
    assert (
        env["PET_MASTER_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['jobset.sigs.k8s.io/coordinator']"
    )
    assert int(env["PET_MASTER_PORT"]["value"]) > 0
    assert int(env["PET_NPROC_PER_NODE"]["value"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    # spotrun is the entrypoint (the image's); the command is a torchrun without --standalone.
    assert "command" not in container and container["args"][0] == "torchrun"
    assert "--standalone" not in container["args"]
    # Spot nodes, as in job.yaml.
    job_pod = _kinds("job.yaml")["Job"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == job_pod["nodeSelector"] and pod["tolerations"] == job_pod["tolerations"]
    # The config comes from the ConfigMap, the same as job.yaml's; the pod waits out its grace period.
    (config_text,) = _kinds("jobset.yaml")["ConfigMap"]["data"].values()
    assert _kinds("jobset.yaml")["ConfigMap"] == _kinds("job.yaml")["ConfigMap"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == _kinds("jobset.yaml")["ConfigMap"]["metadata"]["name"]
    (config_file := tmp_path / "config.yaml").write_text(config_text, encoding="utf-8")
    config = load_run_config(config_file, environ=EXAMPLE_ENV)
    assert pod["terminationGracePeriodSeconds"] >= config["grace_period_s"]


def _jobset_decision(jobset: dict, exit_code: int | None = None, condition: str | None = None) -> str:
    """What the JobSet does when one pod fails with ``exit_code`` (or has pod ``condition``):
    the Job's podFailurePolicy, then the JobSet's failurePolicy, evaluated as their controllers
    do (first matching rule; the Job's failure message as the Job controller writes it)."""
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    for index, rule in enumerate(job["podFailurePolicy"]["rules"]):
        on_codes = rule.get("onExitCodes")
        if (
            on_codes is not None
            and exit_code is not None
            and (exit_code in on_codes["values"]) == (on_codes["operator"] == "In")
        ):
            matched = f"Container trainer for pod default/p failed with exit code {exit_code}"
        elif condition is not None and any(c["type"] == condition for c in rule.get("onPodConditions", ())):
            matched = f"Pod default/p has condition {condition}"
        else:
            continue
        if rule["action"] == "FailJob":
            reason, message = "PodFailurePolicy", f"{matched} matching FailJob rule at index {index}"
        break
    assert job["backoffLimit"] == 0, "one failed pod must fail the Job"
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize(
    ("exit_code", "condition", "expected"),
    [
        (143, None, "RestartJobSetAndIgnoreMaxRestarts"),  # preempted and saved: progress is safe
        (None, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # the node was preempted
        (137, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),
        (142, None, "RestartJobSet"),  # preempted without a new checkpoint: counted
        (1, None, "RestartJobSet"),  # the trainer's own failure: counted
        (2, None, "FailJobSet"),  # spotrun's own error: retrying cannot help
        (EXIT_FENCED, None, "FailJobSet"),  # C20: a newer copy owns the root; a restart would fence it
    ],
)
def test_jobset_failure_policy_follows_spotrun_exit_codes(exit_code, condition, expected):
    jobset = _kinds("jobset.yaml")["JobSet"]
    assert _jobset_decision(jobset, exit_code, condition) == expected
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0
    # The old pods are gone before new ones start: never two incarnations writing checkpoints.
    assert policy["restartStrategy"] == "BlockingRecreate"
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["podReplacementPolicy"] == "Failed"


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        (143, "Ignore"),  # preempted and saved: retried without limit
        (142, "Count"),  # preempted without a new checkpoint: retried, counted
        (EXIT_FENCED, "FailJob"),  # C20: a newer copy owns the root; a retry would fence it in turn
        (1, "Count"),  # the trainer's own failure (the default)
    ],
)
def test_job_pod_failure_policy_follows_spotrun_exit_codes(exit_code, expected):
    job = _kinds("job.yaml")["Job"]["spec"]
    actions = [
        rule["action"]
        for rule in job["podFailurePolicy"]["rules"]
        if "onExitCodes" in rule
        and (exit_code in rule["onExitCodes"]["values"]) == (rule["onExitCodes"]["operator"] == "In")
    ]
    assert (actions or ["Count"])[0] == expected
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["backoffLimit"] > 0


def test_pytorchjob_retries_spotrun_preemption_codes(tmp_path):
    pytorchjob = _kinds("pytorchjob.yaml")["PyTorchJob"]
    for role, spec in pytorchjob["spec"]["pytorchReplicaSpecs"].items():
        assert spec["restartPolicy"] == "ExitCode", role  # >= 128 retried: 142 and 143 are
        pod = spec["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "configMap" in v]
        assert volume["configMap"]["name"] == _kinds("job.yaml")["ConfigMap"]["metadata"]["name"]
        (config_text,) = _kinds("job.yaml")["ConfigMap"]["data"].values()
        (config_file := tmp_path / "config.yaml").write_text(config_text, encoding="utf-8")
        assert (
            pod["terminationGracePeriodSeconds"] >= load_run_config(config_file, environ=EXAMPLE_ENV)["grace_period_s"]
        )
