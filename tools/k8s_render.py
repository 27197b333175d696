#!/usr/bin/env python3
"""Render deploy/k8s overlays with a small Kustomize subset, and adapt them for `podman kube play` where asked.

    python tools/k8s_render.py deploy/k8s/overlays/cpu                      # the manifests, as kubectl kustomize
    python tools/k8s_render.py deploy/k8s/overlays/cpu --podman --image localhost/impala-async:latest \\
        --service-ip impala-learner=10.89.5.10 --secret-dir impala-learner-key=/tmp/secrets/learner-key ... \\
        --only Deployment/impala-learner,PersistentVolumeClaim/impala-runs

The subset: ``resources``, strategic-merge ``patches`` (lists of containers, initContainers, env and volumes merged
by name), JSON 6902 patches (add, replace, remove) and ``replicas``; anything else is refused rather than rendered
differently from Kustomize (tests/test_deploy.py holds it to `kubectl kustomize` where kubectl is installed).

``--podman`` does, on the rendered manifests, what the kubelet and the cluster would and podman 4.3's `kube play`
does not (each change is printed on stderr):
- ``$(VAR)`` in command and args expanded from the container's env, ``$$`` made ``$`` (the kubelet's expansion);
- a Service's name resolves to a fixed address (``--service-ip NAME=IP``, the role of its ClusterIP) through
  ``hostAliases`` in every pod; Services themselves are not played, nor NetworkPolicies (podman enforces none);
- a Deployment of N > 1 replicas becomes N Deployments of one, NAME, NAME-2, ... (podman plays one pod of each);
- a Secret volume becomes a read-only hostPath directory (``--secret-dir NAME=PATH``) holding the Secret's files as
  the kubelet presents them: podman 4.3 mounts a Secret's ``data`` still base64-encoded and ignores ``stringData``;
- emptyDir volumes are named after their pod (podman 4.3 makes a named volume of each, shared by every pod that
  names one alike), containerPorts are dropped (podman 4.3 publishes them on the host, where two pods' 9481 clash)
  and probes name their port by number;
- init containers run at every start of their pod, as the kubelet runs them (podman's ``always``: with its default,
  ``once``, podman 4.3 tries to remove one that has exited but not yet been reaped, and fails the pod);
- the image ``impala-async:latest`` becomes ``--image`` (what ``kustomize edit set image`` does in a real overlay).
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "replicas"}
MERGED_BY_NAME = {"containers", "initContainers", "env", "volumes"}  # strategic-merge lists keyed by name
IMAGE = "impala-async:latest"
NOT_PLAYED = ("Service", "NetworkPolicy")
INIT_TYPE = "io.podman.annotations.init.container.type"  # "once" (the default) races: podman 4.3 removes it running


def smp(base, patch, key: str = ""):
    """Strategic merge patch as Kustomize applies it, for the cases this subset supports (else it raises)."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch) or None in patch.values():
            raise NotImplementedError(f"{key}: $patch directives and null deletions are not in this subset")
        out = dict(base) if isinstance(base, dict) else {}
        for k, v in patch.items():
            out[k] = smp(out[k], v, k) if k in out else v
        return out
    if isinstance(patch, list) and any(isinstance(x, dict) for x in patch):
        if key not in MERGED_BY_NAME:
            raise NotImplementedError(f"{key}: this subset merges lists by name only ({sorted(MERGED_BY_NAME)})")
        out = [dict(x) for x in base]
        for item in patch:
            names = [x["name"] for x in out]
            if item["name"] in names:
                out[names.index(item["name"])] = smp(out[names.index(item["name"])], item)
            else:
                out.append(item)
        return out
    return patch  # scalars and lists of scalars (args, command) are replaced


def json6902(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        if op["op"] not in ("add", "replace", "remove"):
            raise NotImplementedError(f"JSON patch op {op['op']} is not in this subset")
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            if op["op"] == "remove":
                del node[int(last)]
            elif last == "-":
                node.append(op["value"])
            elif op["op"] == "add":
                node.insert(int(last), op["value"])
            else:
                node[int(last)] = op["value"]
        else:
            if op["op"] != "add" and last not in node:
                raise KeyError(f"{op['op']} of missing {op['path']}")
            if op["op"] == "remove":
                del node[last]
            else:
                node[last] = op["value"]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"expected one {kind} {name}, found {len(found)}")
    return found[0]


def render(directory: Path) -> list[dict]:
    """The manifests of the Kustomization in ``directory``, rendered by this subset."""
    directory = Path(directory)
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise NotImplementedError(f"{directory}: {sorted(unknown)} not supported by this renderer")
    docs: list[dict] = []
    for resource in k.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        if not set(patch) <= {"path", "patch", "target"}:
            raise NotImplementedError(f"{directory}: patch keys {sorted(patch)}")
        body = yaml.safe_load((directory / patch["path"]).read_text() if "path" in patch else patch["patch"])
        if isinstance(body, list):
            json6902(one(docs, patch["target"]["kind"], patch["target"]["name"]), body)
        else:
            target = one(docs, body["kind"], body["metadata"]["name"])
            docs[docs.index(target)] = smp(target, body)
    for replicas in k.get("replicas", []):
        one(docs, "Deployment", replicas["name"])["spec"]["replicas"] = replicas["count"]
    return docs


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args: $$ is a literal $, an undefined $(X) stays as it is."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def for_podman(docs: list[dict], image: str, service_ips: dict, secret_dirs: dict, note=print) -> list[dict]:
    """The manifests as the kubelet and the cluster would run them, for podman 4.3's `kube play` (module doc)."""
    out = []
    for doc in copy.deepcopy(docs):
        if doc["kind"] in NOT_PLAYED:
            note(f"not played: {doc['kind']} {doc['metadata']['name']}")
            continue
        if doc["kind"] in ("Deployment", "Pod"):
            doc["metadata"].setdefault("annotations", {})[INIT_TYPE] = "always"  # read there, not in the template
            pod = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
            adapt_pod(doc["metadata"]["name"], pod, image, service_ips, secret_dirs, note)
        out += replicas_as_copies(doc, note) if doc["kind"] == "Deployment" else [doc]
    return out


def adapt_pod(name: str, pod: dict, image: str, service_ips: dict, secret_dirs: dict, note) -> None:
    renamed = {}
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            secret = volume.pop("secret")["secretName"]
            if secret not in secret_dirs:
                raise LookupError(f"{name}: no --secret-dir for Secret {secret}")
            volume["hostPath"] = {"path": secret_dirs[secret], "type": "Directory"}
        elif "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{name}-{volume['name']}"
    for container in pod.get("initContainers", []) + pod.get("containers", []):
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        for key in ("command", "args"):
            if key in container:
                container[key] = [expand(str(v), env) for v in container[key]]
        if container.get("image") == IMAGE:
            container["image"] = image
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
        ports = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in container and "httpGet" in container[probe]:
                get = container[probe]["httpGet"]
                get["port"] = ports.get(get["port"], get["port"])
    if service_ips:
        pod["hostAliases"] = [{"ip": ip, "hostnames": [host]} for host, ip in service_ips.items()]
    note(
        f"{name}: $(VAR) expanded; hostAliases {service_ips}; Secrets from {sorted(secret_dirs)} as hostPath; "
        f"emptyDirs {sorted(renamed.values())}; containerPorts dropped; image {image}"
    )


def replicas_as_copies(deployment: dict, note) -> list[dict]:
    n, name = deployment["spec"].get("replicas", 1), deployment["metadata"]["name"]
    copies = []
    for i in range(n):
        one_pod = copy.deepcopy(deployment)
        one_pod["spec"]["replicas"] = 1
        one_pod["metadata"]["name"] = name if i == 0 else f"{name}-{i + 1}"
        copies.append(one_pod)
    if n > 1:
        note(f"{name}: {n} replicas as {n} Deployments of one pod")
    return copies


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="a Kustomization directory (deploy/k8s/overlays/...)")
    p.add_argument("--podman", action="store_true", help="adapt for podman kube play (see the module's doc)")
    p.add_argument("--image", default=IMAGE, help=f"the image in place of {IMAGE} (with --podman)")
    p.add_argument("--service-ip", action="append", default=[], metavar="NAME=IP", help="a Service name's address")
    p.add_argument("--secret-dir", action="append", default=[], metavar="NAME=PATH", help="a Secret's files")
    p.add_argument("--only", default="", help="KIND/NAME,... to print (default: all)")
    args = p.parse_args(argv)
    docs = render(args.directory)
    if args.podman:
        ips = dict(s.split("=", 1) for s in args.service_ip)
        dirs = dict(s.split("=", 1) for s in args.secret_dir)
        docs = for_podman(docs, args.image, ips, dirs, note=lambda m: print(m, file=sys.stderr))
    if args.only:
        wanted = set(args.only.split(","))
        docs = [d for d in docs if f"{d['kind']}/{d['metadata']['name']}" in wanted]
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
