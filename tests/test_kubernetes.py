"""The Kubernetes manifests of deploy/kubernetes/, checked offline: every object against the
Kubernetes API's schemas (kubernetes-validate, strict: an unknown field is an error), the
LeaderWorkerSet against its schema vendored in deploy/kubernetes/schemas/ (its pod templates
against the Kubernetes PodTemplateSpec), and against moeserve itself: each container's command
parses with moeserve's own command line, the ports, probes, Services, Secrets and volumes
refer to what exists, and the node layout matches the GPUs each pod asks for."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"  # the oldest release the manifests use fields of (grpc probes: 1.27; sizeLimit ...)
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
# What LeaderWorkerSet sets in every container of a group (its controller), and a pod address
LWS_ENV = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "moeserve-0.moeserve.default", "POD_IP": "10.0.1.7"}


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(ROOT.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(ROOT)), doc))
    return out


def lws_schema() -> dict:
    return json.loads((ROOT / "schemas" / "leaderworkerset-v1.schema.json").read_text())


def validate(doc: dict) -> None:
    """Raise when ``doc`` breaks its schema (jsonschema's or kubernetes-validate's error)."""
    if (doc.get("apiVersion"), doc.get("kind")) == LWS:
        jsonschema.validate(doc, lws_schema())
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": lwt[key]}
                kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in documents() if d["kind"] == kind]


def pod_templates() -> list[tuple[str, dict, dict]]:
    """(name, pod template, the labels its pods carry) of every workload; a name ending in
    "node0" runs node 0 (the front end, the balancer, the admin API)."""
    out = []
    for doc in by_kind("LeaderWorkerSet"):
        name = doc["metadata"]["name"]
        lwt = doc["spec"]["leaderWorkerTemplate"]
        common = {"leaderworkerset.sigs.k8s.io/name": name}
        for key, index, role in (("leaderTemplate", "0", "node0"), ("workerTemplate", "1", "node")):
            t = lwt[key]
            labels = {**t["metadata"].get("labels", {}), **common, "leaderworkerset.sigs.k8s.io/worker-index": index}
            out.append((f"{name} {role}", t, labels))
    for doc in by_kind("Deployment"):
        t = doc["spec"]["template"]
        out.append((f"{doc['metadata']['name']} node0", t, t["metadata"]["labels"]))
    return out


def expand(arg: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion of a command argument."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def moeserve_args(container: dict, node_rank: int = 0):
    """The container's command as moeserve parses it, on node ``node_rank`` of its group."""
    from moeserve.cli import build_parser

    cmd = container["command"]
    assert cmd[0] == "moeserve"
    env = {**LWS_ENV, "LWS_WORKER_INDEX": str(node_rank)}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return build_parser().parse_args([expand(a, env) for a in cmd[1:]])


def node_of(name: str) -> int:
    return 0 if name.endswith("node0") else 1


def local_ranks(args) -> int:
    world = args.routers if args.colocated else args.routers + args.workers
    return world // args.nnodes


# -- the schemas ---------------------------------------------------------------------------


def test_every_manifest_is_valid_against_the_kubernetes_and_leaderworkerset_schemas():
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"LeaderWorkerSet", "Deployment", "Service", "Secret", "PersistentVolumeClaim", "ConfigMap"} <= kinds
    for path, doc in docs:
        try:
            validate(doc)
        except Exception as e:  # pragma: no cover - the message is the point
            pytest.fail(f"{path}: {doc['kind']} {doc['metadata'].get('name')}: {e}")


@pytest.mark.parametrize(
    "where, change",
    [
        ("lws", lambda d: d["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always")),
        ("lws", lambda d: d["spec"]["leaderWorkerTemplate"].update(size="2")),
        ("lws", lambda d: d["spec"].update(startupPolicy="WhenReady")),
        ("lws", lambda d: d["spec"]["leaderWorkerTemplate"].update(leaderTemplates={})),
        (
            "lws",
            lambda d: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(imag="x"),
        ),
        (
            "lws",
            lambda d: d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["ports"][0].update(
                containerPort="http"
            ),
        ),
        ("deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenessprobe={})),
        ("deployment", lambda d: d["spec"].update(replicas="one")),
    ],
)
def test_the_validation_catches_a_misspelt_field_a_wrong_type_or_a_value_outside_an_enumeration(where, change):
    """The check above is not vacuous: one typo in a copy of a manifest fails it."""
    kind = {"lws": "LeaderWorkerSet", "deployment": "Deployment"}[where]
    doc = copy.deepcopy(by_kind(kind)[0])
    validate(doc)
    change(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(doc)


# -- against moeserve ------------------------------------------------------------------------


def test_every_container_command_is_a_moeserve_command_line_that_moeserve_accepts(monkeypatch):
    """Parsed by moeserve's command line (argparse exits 2 on a flag it does not have) and
    through its node layout check (node K refuses node 0's flags, N must divide the ranks, ...)."""
    from moeserve.cli import multinode

    monkeypatch.setenv("MOESERVE_CONTROL_KEY", "ab" * 16)
    for name, template, _ in pod_templates():
        for c in template["spec"]["containers"]:
            args = moeserve_args(c, node_of(name))
            assert args.command == "up", name
            assert args.backend == "nccl" and args.enable_eplb, name
            node, key = multinode.layout(args)
            if args.nnodes > 1:
                assert node.node_rank == node_of(name) and key == bytes.fromhex("ab" * 16)
                assert args.workers_per_node == local_ranks(args)  # a placement node is a host


def test_both_pods_of_a_leaderworkerset_group_run_the_same_command_and_the_nodes_hold_every_rank():
    for doc in by_kind("LeaderWorkerSet"):
        lwt = doc["spec"]["leaderWorkerTemplate"]
        leader = lwt["leaderTemplate"]["spec"]["containers"][0]
        worker = lwt["workerTemplate"]["spec"]["containers"][0]
        i = leader["command"].index("--state-dir")  # node 0 alone keeps the placement
        assert leader["command"][:i] + leader["command"][i + 2 :] == worker["command"]
        args = moeserve_args(worker, 1)
        assert (args.nnodes, args.node_rank, args.master_port) == (lwt["size"], 1, 29500)
        assert args.master_addr == LWS_ENV["LWS_LEADER_ADDRESS"] and args.host == LWS_ENV["POD_IP"]
        gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
        assert local_ranks(args) == gpus, "one rank per GPU on every node"
        assert int(leader["resources"]["limits"]["nvidia.com/gpu"]) == gpus
        # the store's port is open on node 0, the port every node is told to reach
        assert {"name": "store", "containerPort": args.master_port} in leader["ports"]


def test_the_ports_the_flags_open_are_the_ports_the_pods_declare_and_the_probes_use():
    from moeserve.cli.up import metrics_layout

    for name, template, _ in pod_templates():
        c = template["spec"]["containers"][0]
        args = moeserve_args(c, node_of(name))
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        metrics = sorted(p for n, p in declared.items() if n.startswith("metrics-"))
        if node_of(name) == 0:  # the front end, the balancer, the admin API and node 0's ranks
            want = {"http": args.http_port, "grpc": args.port, "admin": args.admin_port, "balancer": args.balancer_port}
            for port_name, port in want.items():
                assert declared.get(port_name) == port, (name, port_name)
            layout = metrics_layout(args.metrics_port, local_ranks(args))
            assert metrics == sorted(layout.values()), name
            assert (declared["metrics-r0"], declared["metrics-bal"], declared["metrics-fe"]) == (
                layout["rank0"],
                layout["balancer"],
                layout["frontend"],
            )
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert c["startupProbe"]["httpGet"]["port"] == "http"
            assert c["livenessProbe"]["grpc"]["port"] == args.port
        else:  # node K: its ranks' metrics from --metrics-port on, in rank order
            assert metrics == [args.metrics_port + i for i in range(local_ranks(args))], name
            assert set(declared) == {n for n in declared if n.startswith("metrics-")}, name
            probe = c["livenessProbe"]["httpGet"]
            assert probe["path"] == "/metrics" and declared[probe["port"]] == args.metrics_port


def test_services_select_pods_that_exist_and_name_ports_those_pods_declare():
    templates = pod_templates()
    for svc in by_kind("Service"):
        selector = svc["spec"]["selector"]
        matched = [(n, t) for n, t, labels in templates if all(labels.get(k) == v for k, v in selector.items())]
        assert matched, f"Service {svc['metadata']['name']} selects no pod"
        for _, t in matched:
            names = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def test_secrets_claims_and_the_state_folder_are_the_ones_defined_beside_them():
    secret_keys = {(s["metadata"]["name"], k) for s in by_kind("Secret") for k in s.get("stringData", {})}
    claims = {p["metadata"]["name"] for p in by_kind("PersistentVolumeClaim")}
    for name, template, _ in pod_templates():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert (ref["name"], ref["key"]) in secret_keys, (name, e["name"])
            env = {e["name"] for e in c.get("env", [])}
            if moeserve_args(c, node_of(name)).nnodes > 1:  # every node proves the same secret
                assert "MOESERVE_CONTROL_KEY" in env, name
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            args = moeserve_args(c, node_of(name))
            assert args.model.startswith("/models/") and "/models" in mounts
            if "MOESERVE_ADMIN_TOKEN" in env:  # the pod that runs the balancer keeps its state
                state = mounts[args.state_dir]
                assert "persistentVolumeClaim" in volumes[state["name"]] and not state.get("readOnly")
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims


def test_prometheus_keeps_every_metrics_port_the_pods_declare():
    cm = by_kind("ConfigMap")[0]
    job = yaml.safe_load(cm["data"]["prometheus.yml"])["scrape_configs"][0]
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    port_rule = next(r for r in keeps if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"])
    app_rule = next(r for r in keeps if r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"])
    for name, template, _ in pod_templates():
        assert re.fullmatch(app_rule["regex"], template["metadata"]["labels"]["app.kubernetes.io/name"]), name
        ports = [p["name"] for c in template["spec"]["containers"] for p in c["ports"]]
        metrics = [p for p in ports if re.fullmatch(port_rule["regex"], p)]
        others = [p for p in ports if not re.fullmatch(port_rule["regex"], p)]
        assert metrics and not any(p.startswith("metrics") for p in others), name
