"""deploy/: the Kubernetes manifests (Kustomize base and overlays) and the Compose file.

Offline checks, all of them able to fail:
- every rendered manifest against the Kubernetes 1.30 schemas of kubernetes-validate in strict mode (an unknown field
  fails), and compose.yaml against the Compose Specification's schema that check-jsonschema vendors;
- the properties deployment needs (GPU, probes on /healthz at the metrics port, grace period above
  --shutdown-timeout-s, read-only Secrets with restrictive modes, scrape annotations, fleet size, security contexts);
- whom the NetworkPolicies admit, by a small model of their semantics: Prometheus alone to the metrics ports, anyone
  to the trajectory and weights ports (kubernetes-validate checks their schema, not that);
- every flag the manifests hand to impala-async exists in its argparse parser, after the manifests' own shell
  wrappers ran (with a stub impala-async that prints its argv);
- the key-copying init containers, run on a directory laid out as the kubelet lays out a Secret volume, produce key
  directories that impala_async.ops.auth loads.

Overlays are rendered by tools/k8s_render.py, a small Kustomize subset (resources, strategic-merge patches merging lists
by name, JSON 6902 add/replace/remove, replicas) that refuses anything else; where kubectl is installed, its
`kubectl kustomize` output must equal this rendering.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (pip install -e '.[deploy]')")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
VARIANTS = {
    "base": K8S / "base",
    "small": K8S / "overlays" / "small",
    "large": K8S / "overlays" / "large",
    "cpu": K8S / "overlays" / "cpu",
}
K8S_VERSION = "1.30.0"  # the version validated against (kubernetes-validate >= 1.30 bundles it), and its newest below
METRICS_PORT = 9481
FLEET_ACTORS_RANGE = (20, 50)  # the source article's actors per learner
IMAGE_UID = 1000  # the Dockerfile's user
SHELL_COMMAND = ["/bin/sh", "-c"]


# The Kustomize subset that renders the overlays lives in tools/k8s_render.py (tools/prove_containers.sh plays its
# output with podman).
_spec = importlib.util.spec_from_file_location("k8s_render", ROOT / "tools" / "k8s_render.py")
k8s_render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(k8s_render)
render, _one, _expand = k8s_render.render, k8s_render.one, k8s_render.expand


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in VARIANTS.items()}


# ------------------------------------------------------------------------------------------------ small helpers
def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _pod(docs: list[dict], name: str) -> dict:
    return _one(docs, "Deployment", name)["spec"]["template"]


def _container(docs: list[dict], deployment: str, name: str, init: bool = False) -> dict:
    spec = _pod(docs, deployment)["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def _run_argv(command: list[str], args: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """What impala-async receives when ``command + args`` run: the manifests' shell wrappers run for real, with a
    stub impala-async first on PATH that prints its argv."""
    assert command[:2] == SHELL_COMMAND, command
    stub_dir = tmp_path / "stub-bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "impala-async"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done\n')
    stub.chmod(0o755)
    full_env = {"PATH": f"{stub_dir}:/usr/bin:/bin", **env}
    out = subprocess.run([*command, *args], env=full_env, capture_output=True, timeout=10)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().split("\0")[:-1]


def _container_argv(container: dict, tmp_path: Path, **env_overrides: str) -> list[str]:
    env = {**_env(container), **env_overrides}
    return _run_argv(
        [_expand(c, env) for c in container["command"]], [_expand(a, env) for a in container["args"]], env, tmp_path
    )


def _subparser(command: str) -> argparse.ArgumentParser:
    from impala_async import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flag_problems(argv: list[str]) -> list[str]:
    """Why ``impala-async ARGV`` would not parse: flags that are not exactly options of the subcommand (argparse
    would take a prefix; a manifest should not), and the parser's own error."""
    command, rest = argv[0], list(argv[1:])
    sub = _subparser(command)
    known = {o for a in sub._actions for o in a.option_strings}
    problems = [f"{command}: unknown flag {tok}" for tok in rest if tok.startswith("--") and tok not in known]
    from impala_async import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            _, extra = cli.build_parser().parse_known_args([command, *rest])
            problems += [f"{command}: not parsed: {tok}" for tok in extra]
        except SystemExit:
            problems.append(f"{command}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


# ------------------------------------------------------------------------------------------- schema validation
def _by_name(node):
    """``node`` with lists of named items sorted by name: Kustomize moves the items a patch touches to the front, an
    order that means nothing here (no variable refers to another, and each pod has one container)."""
    if isinstance(node, dict):
        return {k: _by_name(v) for k, v in node.items()}
    if isinstance(node, list):
        items = [_by_name(x) for x in node]
        return (
            sorted(items, key=lambda x: x["name"]) if all(isinstance(x, dict) and "name" in x for x in items) else items
        )
    return node


@pytest.mark.process
def test_renderer_matches_kubectl_kustomize(rendered):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: overlays checked with this test's Kustomize subset only")
    for name, path in VARIANTS.items():
        out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        theirs = {(d["kind"], d["metadata"]["name"]): _by_name(d) for d in yaml.safe_load_all(out.stdout)}
        ours = {(d["kind"], d["metadata"]["name"]): _by_name(d) for d in rendered[name]}
        assert theirs == ours, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_strictly(rendered, variant):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[deploy]' for kubernetes-validate")
    kinds = sorted(d["kind"] for d in rendered[variant])
    assert kinds == ["Deployment", "Deployment", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "Service"]
    for version in sorted({K8S_VERSION, kv.latest_version()}):
        for doc in rendered[variant]:
            assert kv.validate(doc, version, strict=True) == kv.utils.major_minor(version)


def test_strict_validation_catches_a_typo(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[deploy]' for kubernetes-validate")
    learner = copy.deepcopy(_one(rendered["base"], "Deployment", "impala-learner"))
    probe = learner["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    with pytest.raises(kv.ValidationError, match="httpGett"):
        kv.validate(learner, K8S_VERSION, strict=True)
    learner = copy.deepcopy(_one(rendered["base"], "Deployment", "impala-learner"))
    learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60s"  # an integer field
    with pytest.raises(kv.ValidationError, match="'60s' is not of type 'integer'"):
        kv.validate(learner, K8S_VERSION, strict=True)


# --------------------------------------------------------------------------------------- what the issue demands
@pytest.mark.process
@pytest.mark.parametrize("variant", VARIANTS)
def test_learner(rendered, variant, tmp_path):
    docs = rendered[variant]
    deployment = _one(docs, "Deployment", "impala-learner")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]
    learner = _container(docs, "impala-learner", "learner")
    argv = _container_argv(learner, tmp_path)
    assert argv[0] == "learner"
    assert _flag(argv, "--listen") == "tcp://0.0.0.0:5555" and _flag(argv, "--publish") == "tcp://0.0.0.0:5556"
    assert _flag(argv, "--curve-keys").startswith("/keys/")
    resources = learner["resources"]
    if variant == "cpu":  # no GPU anywhere in it
        assert _flag(argv, "--device") == "cpu" and "tolerations" not in pod["spec"]
        assert not any("gpu" in k for k in {**resources["requests"], **resources["limits"]})
    else:
        assert _flag(argv, "--device") == "cuda"
        assert int(resources["requests"]["nvidia.com/gpu"]) == int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert (_flag(argv, "--metrics-host"), int(_flag(argv, "--metrics-port"))) == ("0.0.0.0", METRICS_PORT)
    # /metrics answers to the Service's name (a Prometheus that scrapes it by name sends it as Host).
    allowed = _flag(argv, "--metrics-allowed-hosts").split(",")
    assert _one(docs, "Service", "impala-learner")["metadata"]["name"] in allowed

    ports = {p["name"]: p["containerPort"] for p in learner["ports"]}
    assert ports == {"trajectories": 5555, "weights": 5556, "metrics": METRICS_PORT}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = learner[kind]["httpGet"]
        assert get["path"] == "/healthz" and ports.get(get["port"], get["port"]) == METRICS_PORT, kind

    assert pod["spec"]["terminationGracePeriodSeconds"] > float(_flag(argv, "--shutdown-timeout-s"))
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }

    # The run directory is on the PVC.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next(m for m in learner["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]])
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert _one(docs, "PersistentVolumeClaim", claim)
    assert Path(_flag(argv, "--logdir")).is_relative_to(mount["mountPath"])

    service = _one(docs, "Service", "impala-learner")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["port"]: ports[p["targetPort"]] for p in service["spec"]["ports"]} == {
        5555: 5555,
        5556: 5556,
        METRICS_PORT: METRICS_PORT,
    }


@pytest.mark.process
def test_learner_resumes_when_its_run_directory_has_a_checkpoint(rendered, tmp_path):
    learner = _container(rendered["base"], "impala-learner", "learner")
    logdir = tmp_path / "runs" / "learner"
    argv = _container_argv(learner, tmp_path, LOGDIR=str(logdir))  # no directory yet: a first start
    assert "--resume" not in argv and _flag(argv, "--logdir") == str(logdir)
    logdir.mkdir(parents=True)
    (logdir / ".checkpoint-000000000100.tmp").write_bytes(b"")  # a killed writer's leftover is no checkpoint
    assert "--resume" not in _container_argv(learner, tmp_path, LOGDIR=str(logdir))
    (logdir / "checkpoint-000000000100.pt.bad").write_bytes(b"")  # set aside by the learner: resume, and stop there
    argv = _container_argv(learner, tmp_path, LOGDIR=str(logdir))
    assert _flag(argv, "--resume") == str(logdir) and _flag(argv, "--logdir") == str(logdir)
    assert flag_problems(argv) == []


@pytest.mark.process
@pytest.mark.parametrize("variant", VARIANTS)
def test_actor_fleet(rendered, variant, tmp_path):
    docs = rendered[variant]
    actors = _one(docs, "Deployment", "impala-actors")
    container = _container(docs, "impala-actors", "actor")
    argv = _container_argv(container, tmp_path)
    assert argv[0] == "actor"
    per_pod = int(_flag(argv, "--num-actors"))
    fleet = actors["spec"]["replicas"] * per_pod
    if variant not in ("small", "cpu"):  # for trying it out
        assert FLEET_ACTORS_RANGE[0] <= fleet <= FLEET_ACTORS_RANGE[1], (variant, fleet)
    # One core per actor process, requested and limited.
    resources = container["resources"]
    assert float(resources["requests"]["cpu"]) == float(resources["limits"]["cpu"]) == per_pod
    assert "memory" in resources["requests"] and "memory" in resources["limits"]
    # Pointed at the learner's Service ports, with keys.
    service = _one(docs, "Service", "impala-learner")
    by_name = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert _flag(argv, "--learner") == f"tcp://impala-learner:{by_name['trajectories']}"
    assert _flag(argv, "--weights") == f"tcp://impala-learner:{by_name['weights']}"
    assert _flag(argv, "--curve-keys").startswith("/keys/")
    assert int(_flag(argv, "--seed")) >= 0  # drawn per pod by the wrapper
    assert int(_flag(argv, "--metrics-port")) == METRICS_PORT
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": METRICS_PORT}
    assert actors["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)


@pytest.mark.process
def test_actor_pods_draw_different_seeds(rendered, tmp_path):
    container = _container(rendered["base"], "impala-actors", "actor")
    seeds = {_flag(_container_argv(container, tmp_path), "--seed") for _ in range(3)}
    assert len(seeds) == 3


@pytest.mark.parametrize("variant", VARIANTS)
def test_security_contexts(rendered, variant):
    for deployment in ("impala-learner", "impala-actors"):
        spec = _pod(rendered[variant], deployment)["spec"]
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == IMAGE_UID
        assert spec["automountServiceAccountToken"] is False
        for c in spec["initContainers"] + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert sc.get("runAsUser", IMAGE_UID) == IMAGE_UID and not sc.get("privileged"), c["name"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_secrets_are_read_only_with_restrictive_modes(rendered, variant):
    for deployment in ("impala-learner", "impala-actors"):
        spec = _pod(rendered[variant], deployment)["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        secrets = {n for n, v in volumes.items() if "secret" in v}
        assert secrets, deployment
        for name in secrets:
            modes = [volumes[name]["secret"]["defaultMode"]]
            modes += [item["mode"] for item in volumes[name]["secret"].get("items", []) if "mode" in item]
            for mode in modes:  # nobody writes them, others cannot read them
                assert mode & 0o222 == 0 and mode & 0o007 == 0, (deployment, name, oct(mode))
        for c in spec["initContainers"] + spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] in secrets:
                    assert m.get("readOnly") is True, (deployment, c["name"], m)
                    assert c in spec["initContainers"], "only the keys init container reads the Secrets"
        # The copies: memory-backed, mounted read-only where impala-async runs.
        (main,) = spec["containers"]
        (keys,) = [m for m in main["volumeMounts"] if m["mountPath"] == "/keys"]
        assert keys["readOnly"] is True and volumes[keys["name"]]["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------------------------------------- NetworkPolicy
# What kubernetes-validate checks of a NetworkPolicy: its schema (field names, types, unknown fields in strict mode).
# What it cannot: whom the policy admits. That is evaluated here by a small model of networking.k8s.io/v1's semantics
# (below). Neither can check that the cluster's network plugin enforces policies at all, that Prometheus really
# carries the label, or what the plugin does with the node's own traffic (the kubelet's probes): README and the
# manifest's comments say so.
NAMESPACE = {"kubernetes.io/metadata.name": "impala"}  # where the manifests are applied (any namespace: the same)
PROMETHEUS = ({"app.kubernetes.io/name": "prometheus"}, {"kubernetes.io/metadata.name": "monitoring"})
ANY_POD = ({"app": "web"}, NAMESPACE)  # a pod of the same namespace that is none of these


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels; {} selects everything). matchExpressions is not in this model: it fails."""
    assert set(selector) <= {"matchLabels"}, f"not in this model: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, pod: dict, ns: dict) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"not in this model: {peer}"  # ipBlock: no pod's
    in_namespace = _selects(peer["namespaceSelector"], ns) if "namespaceSelector" in peer else ns == NAMESPACE
    return in_namespace and _selects(peer.get("podSelector", {}), pod)


def _port_admits(rule_port: dict, port: int, named: dict[str, int]) -> bool:
    assert rule_port.get("protocol", "TCP") == "TCP" and "endPort" not in rule_port, rule_port
    return named.get(rule_port["port"], rule_port["port"]) == port


def admits(docs: list[dict], deployment: str, port: int, source: tuple[dict, dict]) -> bool:
    """Whether a TCP connection from a pod with labels ``source`` = (pod labels, its namespace's labels) to ``port`` of
    ``deployment``'s pods is admitted by the NetworkPolicies of ``docs``: by every policy when none selects the pod
    for Ingress; else when a rule of one of those admits it (its ``ports``, none: every port; its ``from``, none:
    every source)."""
    pod = _pod(docs, deployment)
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    policies = [
        d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and _selects(d["spec"]["podSelector"], pod["metadata"]["labels"])
    ]
    if not policies:
        return True
    return any(
        ("ports" not in rule or any(_port_admits(p, port, named) for p in rule["ports"]))
        and ("from" not in rule or any(_peer_admits(peer, *source) for peer in rule["from"]))
        for policy in policies
        for rule in policy.get("ingress", [])
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_prometheus_reaches_the_metrics_ports(rendered, variant):
    docs = rendered[variant]
    actor = (_pod(docs, "impala-actors")["metadata"]["labels"], NAMESPACE)
    learner = (_pod(docs, "impala-learner")["metadata"]["labels"], NAMESPACE)
    for deployment in ("impala-learner", "impala-actors"):
        assert admits(docs, deployment, METRICS_PORT, PROMETHEUS), deployment
        for source in (actor, learner, ANY_POD, ({"app.kubernetes.io/name": "prometheus-not"}, NAMESPACE)):
            assert not admits(docs, deployment, METRICS_PORT, source), (deployment, source)
        assert not admits(docs, deployment, 22, PROMETHEUS), deployment
    # The learner's trajectory and weights ports stay open to every source (actors in or outside the cluster).
    for port in (5555, 5556):
        for source in (actor, ANY_POD, PROMETHEUS):
            assert admits(docs, "impala-learner", port, source), (port, source)
        assert not admits(docs, "impala-actors", port, ANY_POD)  # actor pods listen on nothing but metrics
    # Every port a container of theirs declares is named by a rule (a policy that forgot one would cut it off).
    for deployment in ("impala-learner", "impala-actors"):
        for c in _pod(docs, deployment)["spec"]["containers"]:
            for p in c["ports"]:
                assert admits(docs, deployment, p["containerPort"], PROMETHEUS if p["name"] == "metrics" else ANY_POD)


def test_the_policy_model_can_fail(rendered):
    """Without the policies everything is admitted; with the metrics rule's `from` dropped, any pod is."""
    docs = copy.deepcopy(rendered["base"])
    without = [d for d in docs if d["kind"] != "NetworkPolicy"]
    assert admits(without, "impala-learner", METRICS_PORT, ANY_POD)
    (metrics_rule,) = [r for r in _one(docs, "NetworkPolicy", "impala-learner")["spec"]["ingress"] if "from" in r]
    del metrics_rule["from"]
    assert admits(docs, "impala-learner", METRICS_PORT, ANY_POD)
    assert not admits(docs, "impala-actors", METRICS_PORT, ANY_POD)


# ---------------------------------------------------------------------------------- keys: Secret volume -> auth
def _secret_volume(path: Path, files: dict[str, bytes], mode: int) -> None:
    """Lay ``files`` out as the kubelet does in a Secret volume: a timestamped directory, ``..data`` linking to it,
    and for each key a symbolic link ``NAME -> ..data/NAME``."""
    stamp = path / "..2030_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    for name, data in files.items():
        (stamp / name).write_bytes(data)
        (stamp / name).chmod(mode)
    (path / "..data").symlink_to(stamp.name)
    for name in files:
        (path / name).symlink_to(f"..data/{name}")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """The three Secrets as README's kubectl commands make them from keygen's output."""
    from impala_async.ops import auth

    gen = tmp_path_factory.mktemp("keygen")
    auth.keygen(gen / "learner", "learner")
    auth.keygen(gen / "actor", "actor")
    return {
        "impala-learner-key": {"learner.key_secret": (gen / "learner" / "learner.key_secret").read_bytes()},
        "impala-allowed-actors": {"k8s-actors.key": (gen / "actor" / "actor.key").read_bytes()},
        "impala-actor-key": {
            "actor.key_secret": (gen / "actor" / "actor.key_secret").read_bytes(),
            "learner.key": (gen / "learner" / "learner.key").read_bytes(),
        },
    }


def _run_keys_init(docs: list[dict], deployment: str, root: Path, secrets: dict) -> Path:
    """Run the keys init container's script against Secret volumes laid out under ``root`` (absolute paths of the
    manifest are taken under ``root``); return where the main container's --curve-keys then points."""
    spec = _pod(docs, deployment)["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    init = next(c for c in spec["initContainers"] if c["name"] == "keys")
    for m in init["volumeMounts"]:
        where = root / m["mountPath"].lstrip("/")
        if "secret" in volumes[m["name"]]:
            secret = volumes[m["name"]]["secret"]
            assert "items" not in secret  # every key of the Secret, as kubectl create secret --from-file makes it
            _secret_volume(where, secrets[secret["secretName"]], secret["defaultMode"])
        else:
            where.mkdir(parents=True)
            where.chmod(0o777)  # an emptyDir's mode
    env = {k: str(root / v.lstrip("/")) if v.startswith("/") else v for k, v in _env(init).items()}
    assert init["command"][:2] == SHELL_COMMAND
    out = subprocess.run(
        init["command"], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=10
    )
    assert out.returncode == 0, out.stderr
    (main,) = spec["containers"]
    curve_keys = main["args"][main["args"].index("--curve-keys") + 1]
    assert curve_keys == _env(init)["KEY_DIR"], "the init container fills the directory the main container uses"
    return root / curve_keys.lstrip("/")


@pytest.mark.process
def test_copied_keys_pass_the_learner_and_actor_checks(rendered, secrets, tmp_path):
    from impala_async.ops import auth

    learner_dir = _run_keys_init(rendered["base"], "impala-learner", tmp_path / "learner-pod", secrets)
    keys = auth.load_learner_keys(learner_dir)
    assert sorted(keys.allowed.values()) == ["k8s-actors"]
    actor_dir = _run_keys_init(rendered["base"], "impala-actors", tmp_path / "actor-pod", secrets)
    actor = auth.load_actor_keys(actor_dir)
    assert actor.server_public == keys.public and actor.public in keys.allowed
    for path in [*learner_dir.rglob("*"), *actor_dir.rglob("*")]:
        assert not path.is_symlink()
        assert path.stat().st_mode & 0o777 == {".key_secret": 0o600, ".key": 0o644}.get(path.suffix, 0o700), path


def test_a_secret_volume_as_it_is_mounted_is_refused(secrets, tmp_path):
    """Why the keys are copied: its files are symbolic links into ..data/ (and, in a cluster, owned by root)."""
    from impala_async.ops import auth

    _secret_volume(tmp_path / "actor", secrets["impala-actor-key"], 0o400)
    (tmp_path / "actor").chmod(0o755)
    with pytest.raises(auth.UnsafeKeyFileError, match="symbolic link"):
        auth.load_actor_keys(tmp_path / "actor")


# -------------------------------------------------------------------------------------- flags exist in the CLI
def _all_argvs(rendered, tmp_path) -> dict[str, list[str]]:
    argvs = {}
    for variant, docs in rendered.items():
        argvs[f"{variant}/learner"] = _container_argv(_container(docs, "impala-learner", "learner"), tmp_path)
        argvs[f"{variant}/actor"] = _container_argv(_container(docs, "impala-actors", "actor"), tmp_path)
    argvs["compose/learner"] = _compose_argv(_compose(), tmp_path)
    return argvs


@pytest.mark.process
def test_every_flag_exists(rendered, tmp_path):
    for where, argv in _all_argvs(rendered, tmp_path).items():
        assert flag_problems(argv) == [], where


@pytest.mark.process
def test_a_flag_that_does_not_exist_fails(rendered, tmp_path):
    learner = copy.deepcopy(_container(rendered["base"], "impala-learner", "learner"))
    learner["args"][learner["args"].index("--shutdown-timeout-s")] = "--shutdown-timeout-secs"
    assert flag_problems(_container_argv(learner, tmp_path)) == [
        "learner: unknown flag --shutdown-timeout-secs",
        "learner: not parsed: --shutdown-timeout-secs",
        "learner: not parsed: 30",
    ]
    learner["args"][learner["args"].index("--shutdown-timeout-secs")] = "--shutdown-timeout"  # a prefix
    assert flag_problems(_container_argv(learner, tmp_path)) == ["learner: unknown flag --shutdown-timeout"]
    actor = copy.deepcopy(_container(rendered["base"], "impala-actors", "actor"))
    actor["env"] = [{"name": "IMPALA_NUM_ACTORS", "value": "eight"}, {"name": "IMPALA_ENVS_PER_ACTOR", "value": "1"}]
    (problem,) = flag_problems(_container_argv(actor, tmp_path))
    assert "invalid int value: 'eight'" in problem


@pytest.mark.process
def test_metrics_flags_exist(rendered, tmp_path):
    for where, argv in _all_argvs(rendered, tmp_path).items():
        assert flag_problems(argv) == [], where
    check = _compose()["services"]["learner"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "impala-async", "healthcheck"] and flag_problems(check[2:]) == []


# ------------------------------------------------------------------------------------------------------ compose
def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _interpolate(value, env: dict[str, str]):
    """Compose's interpolation, the forms compose.yaml uses: $$, ${VAR}, ${VAR:-default}; others fail the test."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(1) is None:
            raise AssertionError(f"interpolation form not handled here: {value!r}")
        return env.get(m.group(1)) or (m.group(2) or "")

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$(?=[A-Za-z_{])", one, value)


def _compose_argv(compose: dict, tmp_path: Path, runs: Path | None = None, **env: str) -> list[str]:
    """What impala-async receives in the learner service, with the variables ``env`` set for Compose and, if
    ``runs`` is given, the runs volume's /data/runs taken as ``runs``."""
    learner = _interpolate(compose["services"]["learner"], env)
    if runs is not None:
        learner = json.loads(json.dumps(learner).replace('"/data/runs/', f'"{runs}/'))
    return _run_argv(learner["entrypoint"], learner["command"], learner["environment"], tmp_path)


def test_compose_validates_against_the_compose_spec():
    pytest.importorskip("check_jsonschema", reason="pip install -e '.[deploy]' for the vendored compose-spec.json")
    jsonschema = pytest.importorskip("jsonschema")
    from importlib.resources import files

    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    compose = _compose()
    assert [e.message for e in validator.iter_errors(compose)] == []
    compose["services"]["learner"]["stop_grace_periode"] = compose["services"]["learner"].pop("stop_grace_period")
    assert any("stop_grace_periode" in e.message for e in validator.iter_errors(compose))


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", duration)
    assert m, duration
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


@pytest.mark.process
def test_compose(tmp_path):
    compose = _compose()
    learner = compose["services"]["learner"]
    argv = _compose_argv(compose, tmp_path)
    assert argv[0] == "train" and _flag(argv, "--device") == "cuda" and "--resume" not in argv
    assert learner["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert _seconds(learner["stop_grace_period"]) > float(_flag(argv, "--shutdown-timeout-s"))
    assert learner["user"] == f"{IMAGE_UID}:{IMAGE_UID}" and learner["read_only"] is True
    assert learner["ports"] == [f"127.0.0.1:{METRICS_PORT}:{METRICS_PORT}"]  # the host's loopback only
    check = learner["healthcheck"]["test"]
    assert check[:3] == ["CMD", "impala-async", "healthcheck"] and int(_flag(check, "--metrics-port")) == METRICS_PORT
    assert (_flag(argv, "--metrics-host"), int(_flag(argv, "--metrics-port"))) == ("0.0.0.0", METRICS_PORT)

    # IMPALA_RUN names the run: a new one starts, one with a checkpoint resumes.
    runs = tmp_path / "runs"
    argv = _compose_argv(compose, tmp_path, runs, IMPALA_RUN="pong", IMPALA_ENV_ID="ALE/Pong-v5")
    assert "--resume" not in argv and _flag(argv, "--logdir") == str(runs / "pong")
    (runs / "pong").mkdir(parents=True)
    (runs / "pong" / "checkpoint-000000000100.pt").write_bytes(b"")
    argv = _compose_argv(compose, tmp_path, runs, IMPALA_RUN="pong", IMPALA_ENV_ID="ALE/Pong-v5")
    assert _flag(argv, "--resume") == _flag(argv, "--logdir") == str(runs / "pong")
    assert _flag(argv, "--env") == "ALE/Pong-v5" and flag_problems(argv) == []

    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]  # optional: only with --profile monitoring
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    (host_path,) = [v.split(":")[0] for v in prometheus["volumes"] if ":/etc/prometheus/prometheus.yml" in v]
    config = yaml.safe_load((DEPLOY / host_path).read_text())  # relative to the Compose file's directory
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"learner:{METRICS_PORT}"]}]
    # Prometheus sends its target's name as Host: the learner must answer to it (else 421, and no metrics).
    argv = _compose_argv(compose, tmp_path)
    (target,) = job["static_configs"][0]["targets"]
    assert target.rsplit(":", 1)[0] in _flag(argv, "--metrics-allowed-hosts").split(",")


@pytest.mark.process
def test_compose_cpu_override(tmp_path):
    """compose.cpu.yaml: compose.yaml's learner with --device cpu and no GPU reservation, nothing else changed."""

    class ComposeLoader(yaml.SafeLoader):
        pass

    ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")
    override = yaml.load((DEPLOY / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)
    (learner,) = override["services"].values()
    assert set(learner) == {"command", "deploy"} and learner["deploy"] == "!reset"
    base = _compose()
    cpu = _compose_argv({"services": {"learner": {**base["services"]["learner"], **learner}}}, tmp_path)
    gpu = _compose_argv(base, tmp_path)
    assert _flag(cpu, "--device") == "cpu" and _flag(gpu, "--device") == "cuda"
    assert [a for a in cpu if a != "cpu"] == [a for a in gpu if a != "cuda"] and flag_problems(cpu) == []


def test_deploy_extra_lists_the_validators():
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", r)[0].lower() for r in extras["deploy"]}
    assert {"kubernetes-validate", "check-jsonschema", "pyyaml"} <= names
    readme = (ROOT / "README.md").read_text()
    command = readme.split("<!-- test-command", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert re.search(r"\.\[[^\]]*\bdeploy\b[^\]]*\]", command), command


def test_no_stray_env_prefix(rendered):
    """Variables the manifests define must not shadow the program's own IMPALA_ASYNC_* (and service links are off,
    which would define <SERVICE>_PORT variables)."""
    for docs in rendered.values():
        for deployment in ("impala-learner", "impala-actors"):
            spec = _pod(docs, deployment)["spec"]
            assert spec["enableServiceLinks"] is False
            for c in spec["initContainers"] + spec["containers"]:
                assert not [n for n in _env(c) if n.startswith("IMPALA_ASYNC_")], c["name"]


@pytest.mark.process
def test_what_podman_kube_play_is_given(rendered):
    """tools/k8s_render.py --podman: what the kubelet and the cluster would do, done on the manifests (podman 4.3's
    kube play expands no $(VAR), has no Services, plays one replica, mounts Secrets base64-encoded and publishes
    containerPorts on the host)."""
    notes = []
    secrets = {n: f"/s/{n}" for n in ("impala-learner-key", "impala-allowed-actors", "impala-actor-key")}
    ips = {"impala-learner": "10.89.5.10"}
    docs = k8s_render.for_podman(rendered["cpu"], "localhost/x:1", ips, secrets, notes.append)
    assert {d["kind"] for d in docs} == {"Deployment", "PersistentVolumeClaim"}
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    assert names == ["impala-learner", "impala-actors", "impala-actors-2"]  # replicas 2: two pods of one
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert all(d["spec"]["replicas"] == 1 for d in deployments)
    assert all(d["metadata"]["annotations"][k8s_render.INIT_TYPE] == "always" for d in deployments)
    assert "not played: Service impala-learner" in notes
    actor = _container(docs, "impala-actors", "actor")
    assert actor["image"] == "localhost/x:1" and "$(" not in " ".join(actor["args"])
    assert actor["args"][actor["args"].index("--num-actors") + 1] == "1"
    assert "$$" not in actor["command"][2] and '--seed "$(od' in actor["command"][2]  # $$ is the shell's $ again
    assert "ports" not in actor and actor["livenessProbe"]["httpGet"]["port"] == METRICS_PORT
    pod = _pod(docs, "impala-actors")["spec"]
    assert pod["hostAliases"] == [{"ip": "10.89.5.10", "hostnames": ["impala-learner"]}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["actor-key"]["hostPath"] == {"path": "/s/impala-actor-key", "type": "Directory"}
    assert "impala-actors-keys" in volumes and "emptyDir" in volumes["impala-actors-keys"]
    mounts = {m["name"] for c in pod["initContainers"] + pod["containers"] for m in c["volumeMounts"]}
    assert mounts <= set(volumes), mounts - set(volumes)
    assert "$(" in " ".join(_container(rendered["cpu"], "impala-actors", "actor")["args"])  # the input is untouched
    with pytest.raises(LookupError, match="no --secret-dir for Secret impala-learner-key"):
        k8s_render.for_podman(rendered["cpu"], "x", ips, {}, notes.append)
    doc = {"a": [1, 2], "b": {"c/d": 1}}
    k8s_render.json6902(doc, [{"op": "remove", "path": "/a/0"}, {"op": "remove", "path": "/b/c~1d"}])
    assert doc == {"a": [2], "b": {}}
