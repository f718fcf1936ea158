"""deploy/kubernetes/ keeps its promises: every manifest parses and is listed, the probes
reach the gateway's HTTP settings, termination outlasts the drain, the pods run non-root
on a read-only root file system, the ConfigMap's gateway.toml loads, and no secret value
is written anywhere. (No cluster here: `kubectl kustomize` renders the set when kubectl
is installed; kubeconform is not, so the schemas themselves are not checked.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Settings, load_settings

K8S = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
SECRET_NAME = re.compile(r"(TOKEN|API_KEY|SECRET|PASSWORD)$")


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every YAML file of the folder (kustomization included), by file name."""
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
        assert docs, f"{path.name} is empty"
        found[path.name] = docs
    return found


def resource(kind: str) -> dict[str, Any]:
    (doc,) = [d for docs in manifests().values() for d in docs if d.get("kind") == kind]
    return doc


def pod_spec(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = resource(kind)["spec"]["template"]["spec"]
    return spec


def container(kind: str) -> dict[str, Any]:
    (only,) = pod_spec(kind)["containers"]
    assert isinstance(only, dict)
    return only


def settings_of(kind: str, tmp_path: Path) -> Settings:
    """The settings a pod of `kind` runs with: its environment, the ConfigMap's
    gateway.toml, and stand-ins for the secret files and secret references."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {}
    for item in container(kind)["env"]:
        if "valueFrom" in item:
            env[item["name"]] = "stand-in-secret-value"
        elif item["name"].endswith("_FILE"):
            stand_in = tmp_path / Path(item["value"]).name
            stand_in.write_text("stand-in-secret-value\n")
            env[item["name"]] = str(stand_in)
        else:
            env[item["name"]] = item["value"]
    assert env["GATEWAY_CONFIG"] == "/etc/gateway/gateway.toml"
    env["GATEWAY_CONFIG"] = str(K8S / "gateway.toml")
    env["GATEWAY_WORKSPACE"] = str(tmp_path / "ws")
    return load_settings(None, environ=env)


def test_every_manifest_parses_and_the_kustomization_lists_them_all() -> None:
    found = manifests()
    (kustomization,) = found.pop("kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization["resources"]) == set(found)
    for name, docs in found.items():
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], name
    generated = kustomization["configMapGenerator"][0]
    assert generated["name"] == "chat-gateway-config"
    assert generated["files"] == ["gateway.toml"]
    kinds = sorted(d["kind"] for docs in found.values() for d in docs)
    assert kinds == sorted(
        ["Namespace", "ServiceAccount", "Job", "Deployment", "Service", "PodDisruptionBudget"]
    )


def test_the_configmaps_gateway_toml_loads_and_names_the_shared_backends(tmp_path: Path) -> None:
    settings = settings_of("Deployment", tmp_path)
    assert settings.storage.url and settings.storage.url.startswith("postgresql://")
    assert settings.storage.migrate == "never"  # the Job migrates, once
    assert settings.cache.url and settings.cache.url.startswith("redis://")
    assert settings.http.host == "0.0.0.0"
    assert settings.llm.api_key is not None and settings.http.token is not None


def test_probes_reach_the_gateways_http_port_and_paths(tmp_path: Path) -> None:
    settings = settings_of("Deployment", tmp_path)
    gateway = container("Deployment")
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": settings.http.port}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["startupProbe"]["httpGet"]["path"] == "/healthz"
    service = resource("Service")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_termination_outlasts_the_prestop_and_the_drain(tmp_path: Path) -> None:
    settings = settings_of("Deployment", tmp_path)
    pre_stop = container("Deployment")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec("Deployment")["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + settings.dispatch.drain_grace_seconds


def test_three_replicas_with_a_disruption_budget_and_a_matching_service() -> None:
    deployment = resource("Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert resource("Service")["spec"]["selector"].items() <= labels.items()
    pdb = resource("PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] == 1


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_pods_run_non_root_on_a_read_only_root_with_resources(kind: str, tmp_path: Path) -> None:
    pod = pod_spec(kind)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    main = container(kind)
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert main["resources"]["requests"]["memory"] and main["resources"]["limits"]["memory"]
    # What the gateway writes is on a volume: the workspace and /tmp.
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert "/tmp" in mounts
    workspace = settings_of(kind, tmp_path / kind)
    env = {e["name"]: e.get("value") for e in main["env"]}
    if kind == "Deployment":
        assert env["GATEWAY_WORKSPACE"] in mounts
    else:
        assert env["GATEWAY_WORKSPACE"].startswith("/tmp/")
    assert workspace.storage.url


def test_the_migration_job_runs_gateway_db_migrate_with_the_same_settings(
    tmp_path: Path,
) -> None:
    job = container("Job")
    assert [*job["command"], *job["args"]] == ["gateway", "db", "migrate"]
    assert pod_spec("Job")["restartPolicy"] == "Never"
    assert job["image"] == container("Deployment")["image"]
    assert (
        settings_of("Job", tmp_path / "job").storage.url
        == settings_of("Deployment", tmp_path / "dep").storage.url
    )


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_no_secret_value_is_written_inline(kind: str) -> None:
    for name, docs in manifests().items():
        for doc in docs:
            assert doc.get("kind") != "Secret", f"{name}: a Secret with values is not shipped"
    main = container(kind)
    volumes = {v["name"]: v for v in pod_spec(kind)["volumes"]}
    secret_dirs = [m["mountPath"] for m in main["volumeMounts"] if "secret" in volumes[m["name"]]]
    for item in main["env"]:
        name = item["name"]
        if name.endswith("_FILE"):
            assert any(item["value"].startswith(d + "/") for d in secret_dirs), name
        elif SECRET_NAME.search(name):
            assert "value" not in item, f"{name} is written inline"
            assert item["valueFrom"]["secretKeyRef"]["name"] == "chat-gateway"
    toml = (K8S / "gateway.toml").read_text(encoding="utf-8")
    assert not re.search(r"://[^/@\s]+:[^/@\s]+@", toml), "a password in a URL"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_set_with_the_generated_configmap() -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["gateway.toml"] == (K8S / "gateway.toml").read_text(encoding="utf-8")
    hashed = config["metadata"]["name"]
    assert hashed.startswith("chat-gateway-config-")
    for kind in ("Deployment", "Job"):
        (doc,) = [d for d in docs if d["kind"] == kind]
        assert doc["metadata"]["namespace"] == "chat-gateway"
        volumes = doc["spec"]["template"]["spec"]["volumes"]
        assert {"name": hashed} in [v.get("configMap") for v in volumes]
