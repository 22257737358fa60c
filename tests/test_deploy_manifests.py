"""deploy/: the example job YAMLs load, and the cluster files agree with the jobs they run.

A manifest that asks for 4 GPUs per pod for a tp=8 job, or 32 CPUs for 8
workers of 8 CPUs each, is only found out on a rented GPU cluster. These tests
find it out here: they parse the KubeRay and `ray up` files and check the
fields that matter against the job config (GPUs per node versus
`parallel.tp`, Ray resources per worker versus `scaling.*_per_worker`, worker
counts versus `scaling.*_workers`, the entrypoint, token authentication and a
dashboard that is not exposed).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from elastic.cli import main as cli_main
from elastic.config import JobConfig, load_config
from elastic.planning import choose_layout
from strategies.planner import Hardware

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))
GPU_EXAMPLES = ("gpu-single-node.yaml", "multi-node-3d.yaml")
OBJECT_STORES = ("s3://", "gs://", "gcs://", "az://", "abfs://")
TOKEN_SECRET_KEY = "auth_token"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kuberay(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted((DEPLOY / "kuberay").glob("*.yaml")) for d in _docs(p) if d.get("kind") == kind]


def _cluster_specs() -> list[tuple[str, dict]]:
    """Every RayCluster spec in deploy/kuberay: standalone ones and those embedded in a RayJob."""
    out = [(f"{p.name}:{d['metadata']['name']}", d["spec"]) for p, d in _kuberay("RayCluster")]
    out += [(f"{p.name}:{d['metadata']['name']}", d["spec"]["rayClusterSpec"]) for p, d in _kuberay("RayJob")]
    return out


def _entrypoint_config(entrypoint: str) -> tuple[Path, JobConfig]:
    """The job config an `elastic run FILE [--set K=V]...` entrypoint runs, with its overrides applied."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["elastic", "run"], f"entrypoint must be `elastic run JOB.yaml`: {entrypoint!r}"
    path, rest, overrides = ROOT / argv[2], argv[3:], []
    while rest:
        flag, value, *rest = rest
        assert flag == "--set", f"unexpected entrypoint argument {flag!r}"
        overrides.append(value)
    assert path.is_file(), f"entrypoint names {argv[2]}, which does not exist"
    return path, load_config(path, overrides)


def _gpus(resources: dict) -> int:
    return int(resources.get("nvidia.com/gpu", 0))


def _cpus(quantity: str | int) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _slots(cpus: float, gpus: int, cfg: JobConfig) -> int:
    """Workers a node holds, as elastic.worker_group counts them: CPU-bound and GPU-bound."""
    s = cfg.scaling
    return min(int(cpus // s.cpus_per_worker), int(gpus // s.gpus_per_worker))


def _check_node_fits_job(where: str, cpus: float, gpus: int, cfg: JobConfig) -> int:
    """One worker per GPU, whole TP groups per node, enough CPUs: returns the workers per node."""
    s, tp = cfg.scaling, cfg.parallel.tp
    assert s.gpus_per_worker == 1, f"{cfg.name}: one worker per GPU means scaling.gpus_per_worker: 1"
    assert gpus > 0 and gpus % tp == 0, f"{where}: {gpus} GPUs per node cannot hold whole TP groups of {tp}"
    assert _slots(cpus, gpus, cfg) == gpus, (
        f"{where}: {cpus:g} CPUs host only {int(cpus // s.cpus_per_worker)} workers of {s.cpus_per_worker:g} CPUs, "
        f"the node has {gpus} GPUs")
    return gpus


def _check_token_env(where: str, container: dict) -> None:
    env = {e["name"]: e for e in container.get("env", [])}
    assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE=token missing"
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    assert ref.get("name") and ref.get("key") == TOKEN_SECRET_KEY, f"{where}: RAY_AUTH_TOKEN must come from a Secret"
    assert "value" not in env["RAY_AUTH_TOKEN"], f"{where}: the token itself must not be in the manifest"


# --------------------------------------------------------------------------- job YAMLs
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_job_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name == path.stem, "the job name should match the file, so runs/<name> is easy to find"


def test_gpu_examples_exist_and_use_gpus_and_object_storage() -> None:
    for name in GPU_EXAMPLES:
        cfg = load_config(DEPLOY / "examples" / name)
        assert cfg.device in ("cuda", "auto") and cfg.scaling.gpus_per_worker == 1
        assert cfg.checkpoint.uri.startswith(OBJECT_STORES), f"{name}: nodes come and go; checkpoints belong on object storage"
        assert not any(spec.startswith("node:") for spec in cfg.fault.inject), "node faults need the embedded cluster"
    single, three_d = (load_config(DEPLOY / "examples" / n) for n in GPU_EXAMPLES)
    assert single.scaling.num_workers == 8 and single.parallel.tp in (4, 8)
    assert (three_d.parallel.pp, three_d.parallel.tp) == (2, 8) and three_d.scaling.num_workers == 32


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_layouts_fit_8_gpu_nodes_at_full_and_minimum_size(name: str) -> None:
    """The planner keeps the configured tp and pp at num_workers and at min_workers, and the model fits 80 GB GPUs."""
    cfg = load_config(DEPLOY / "examples" / name)
    for world in (cfg.scaling.num_workers, cfg.scaling.min_workers):
        layout, reason = choose_layout(world, cfg, hardware=Hardware(gpus=world, gpus_per_node=8, gpu_mem_bytes=80e9))
        assert layout.world_size == world, reason
        assert (layout.tp, layout.pp) == (cfg.parallel.tp, cfg.parallel.pp), reason
        if cfg.parallel.dp_shard > 0 and world == cfg.scaling.num_workers:
            assert layout.dp_shard == cfg.parallel.dp_shard, reason


# The planner's step times are estimates (no overlap of communication and compute, no
# kernel efficiency): layouts closer than this are a tie, and their rank means nothing.
PLANNER_TIE = 1.05


def _planned(name: str, gpus: int, capsys: pytest.CaptureFixture) -> list[dict]:
    """Every layout `elastic plan --config deploy/examples/NAME --gpus N --json` ranks, best first."""
    capsys.readouterr()
    assert cli_main(["plan", "--config", str(DEPLOY / "examples" / name), "--gpus", str(gpus), "--json", "--top", "1000"]) == 0
    return json.loads(capsys.readouterr().out)["layouts"]


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_layout_is_one_the_planner_would_choose(name: str, capsys: pytest.CaptureFixture) -> None:
    """What the example runs, at its full size and after shrinking to min_workers, is within PLANNER_TIE of
    the best layout `elastic plan --config` finds for it (the examples' headers say so)."""
    cfg = load_config(DEPLOY / "examples" / name)
    for world in (cfg.scaling.num_workers, cfg.scaling.min_workers):
        layout, _ = choose_layout(world, cfg, hardware=Hardware(gpus=world, gpus_per_node=8, gpu_mem_bytes=80e9))
        entries = [e for e in _planned(name, world, capsys) if e["fits"]]
        (ours,) = [e for e in entries if e["layout"] == layout.as_dict()]
        best = entries[0]
        assert ours["step_s"] <= PLANNER_TIE * best["step_s"], (
            f"{name} runs {layout} on {world} GPUs, estimated {ours['step_s']:.3g} s a step; `elastic plan --config` "
            f"ranks it {entries.index(ours) + 1} of {len(entries)}, its best {best['layout']} takes {best['step_s']:.3g} s")


# --------------------------------------------------------------------------- KubeRay
def test_kuberay_has_a_rayjob_and_a_raycluster() -> None:
    assert _kuberay("RayJob") and _kuberay("RayCluster")


@pytest.mark.parametrize("name, spec", _cluster_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_cluster_spec_token_auth_and_private_dashboard(name: str, spec: dict) -> None:
    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", f"{name}: the head service must stay inside the cluster"
    assert str(head["rayStartParams"].get("num-gpus", "0")) == "0", f"{name}: no training worker on the head"
    assert head["rayStartParams"].get("dashboard-host") in (None, "127.0.0.1")
    groups = [head] + spec["workerGroupSpecs"]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            _check_token_env(f"{name}:{container['name']}", container)
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1, f"{name}: head and workers must run the same image, got {images}"


def _worker_groups(spec: dict) -> list[tuple[str, dict, float, int]]:
    """(group name, group, Ray CPUs, GPUs) of each worker group; rayStartParams must agree with the pod's limits."""
    out = []
    for group in spec["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        gpus, params = _gpus(limits), group["rayStartParams"]
        assert int(params.get("num-gpus", gpus)) == gpus, f"{group['groupName']}: num-gpus differs from the GPU limit"
        cpus = _cpus(params.get("num-cpus", limits["cpu"]))
        assert cpus <= _cpus(limits["cpu"]), f"{group['groupName']}: Ray is told of more CPUs than the pod has"
        out.append((group["groupName"], group, cpus, gpus))
    return out


@pytest.mark.parametrize("path, job", _kuberay("RayJob"), ids=lambda v: v.name if isinstance(v, Path) else "")
def test_rayjob_runs_an_example_on_one_tp_group_per_pod(path: Path, job: dict) -> None:
    spec = job["spec"]
    job_yaml, cfg = _entrypoint_config(spec["entrypoint"])
    assert job_yaml.parent == DEPLOY / "examples"
    assert spec["shutdownAfterJobFinishes"] is True
    total = 0
    for group_name, group, cpus, gpus in _worker_groups(spec["rayClusterSpec"]):
        per_pod = _check_node_fits_job(f"{path.name}:{group_name}", cpus, gpus, cfg)
        assert gpus == cfg.parallel.tp, f"{group_name}: a pod is one TP group: {gpus} GPUs for tp={cfg.parallel.tp}"
        assert group["minReplicas"] * per_pod >= cfg.scaling.min_workers
        assert group["maxReplicas"] * per_pod >= cfg.scaling.upper
        total += group["replicas"] * per_pod
    assert total == cfg.scaling.num_workers, f"{path.name}: the pods hold {total} workers, the job starts {cfg.scaling.num_workers}"

    submitter = spec["submitterPodTemplate"]["spec"]["containers"][0]
    _check_token_env(f"{path.name}:submitter", submitter)
    assert "command" not in submitter, "KubeRay supplies the submit command from spec.entrypoint"

    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    workdir = re.search(r"^WORKDIR\s+(\S+)", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert runtime_env["working_dir"] == workdir, "the job's working dir is the project as built into the image"
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    run_root = Path(cfg.run_root)
    if run_root.is_absolute():
        mounts = [m["mountPath"] for m in head.get("volumeMounts", [])]
        assert str(run_root) in mounts, f"run_root {run_root} must be a volume on the head, or the report dies with the pod"


@pytest.mark.parametrize("path, cluster", _kuberay("RayCluster"), ids=lambda v: v.name if isinstance(v, Path) else "")
def test_raycluster_fits_the_jobs_it_is_sized_for(path: Path, cluster: dict) -> None:
    jobs = cluster["metadata"]["annotations"]["elastic/job-configs"].split()
    assert jobs, "name the job configs this cluster is sized for"
    for job in jobs:
        cfg = load_config(ROOT / job)
        capacity = 0
        for group_name, group, cpus, gpus in _worker_groups(cluster["spec"]):
            per_pod = _check_node_fits_job(f"{path.name}:{group_name} for {job}", cpus, gpus, cfg)
            capacity += group["maxReplicas"] * per_pod
        assert capacity >= cfg.scaling.upper, f"{path.name}: room for {capacity} workers, {job} grows to {cfg.scaling.upper}"


# --------------------------------------------------------------------------- KubeRay CRD schemas
# The CRDs' v1 schemas of every KubeRay release from 1.1.0 to 1.7.0, cut down to what
# the manifests use (tests/data/kuberay/vendor_crds.py says how and from where).
CRD_DATA = json.loads((ROOT / "tests" / "data" / "kuberay" / "crd_schemas.json").read_text())
CHECKED_TAGS = list(CRD_DATA["versions"])
# Root metadata is not in the CRD schema: the API server validates ObjectMeta itself.
# These are the fields a manifest writes; anything else there is a mistake here.
_OBJECT_META = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _closed(schema: dict) -> dict:
    """A CRD schema as Kubernetes applies it: an object's unknown fields are an error, not silently pruned.

    Kubernetes drops every field a structural schema does not list, unless the
    object says `x-kubernetes-preserve-unknown-fields` (no KubeRay CRD does) or
    is a map (`additionalProperties`). A field the vendoring cut out
    (`x-pruned`) fails too, so that a manifest cannot use a field whose schema
    this test does not hold.
    """
    if schema.get("x-pruned"):
        return {"not": {}, "x-pruned": True}
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            out[keyword] = _closed(schema[keyword])
    for keyword in ("anyOf", "allOf", "oneOf"):
        if keyword in schema:
            out[keyword] = [_closed(sub) for sub in schema[keyword]]
    if schema.get("type") == "object" and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


_CLOSED_DEFS = {key: _closed(sub) for key, sub in CRD_DATA["$defs"].items()}


def _crd_problems(manifest: dict, tag: str) -> list[str]:
    """What the API server of KubeRay `tag` would reject or silently drop in `manifest`, one line each."""
    import jsonschema

    root = dict(_CLOSED_DEFS[CRD_DATA["versions"][tag][manifest["kind"]].rsplit("/", 1)[1]])
    root["properties"] = {**root["properties"], "metadata": _OBJECT_META}
    validator = jsonschema.Draft7Validator({**root, "$defs": _CLOSED_DEFS})
    problems = []
    for error in validator.iter_errors(manifest):
        if error.schema.get("x-pruned"):
            problems.append(f"{error.json_path}: set in the manifest but cut from tests/data/kuberay/crd_schemas.json; "
                            "run tests/data/kuberay/vendor_crds.py")
        else:
            problems.append(f"{error.json_path}: {error.message}")
    return problems


def _version(tag: str) -> tuple[int, ...]:
    return tuple(int(n) for n in tag.lstrip("v").split("."))


_KUBERAY_MANIFESTS = _kuberay("RayJob") + _kuberay("RayCluster")


@pytest.mark.parametrize("path, manifest", _KUBERAY_MANIFESTS, ids=lambda v: v.name if isinstance(v, Path) else "")
def test_kuberay_manifest_fits_the_crds_of_the_versions_it_claims(path: Path, manifest: dict) -> None:
    """The header's `KubeRay >= X` and `checked against ... A to B` are exactly what the CRD schemas say.

    Every checked release from X on accepts the manifest as it is (no unknown
    field, every type right), the release before X does not (so X is not too
    high either), and A..B is the range this test checks.
    """
    header = path.read_text().split("\napiVersion:")[0]
    claim = re.search(r"KubeRay >= (\d+\.\d+)", header)
    checked = re.search(r"CRDs of KubeRay (\S+) to (\S+) \(tests/test_deploy_manifests.py\)", header)
    assert claim and checked, f"{path.name}: the header must say `KubeRay >= X` and which CRDs it was checked against"
    assert (checked.group(1), checked.group(2)) == (CHECKED_TAGS[0].lstrip("v"), CHECKED_TAGS[-1].lstrip("v"))
    minimum = _version(claim.group(1))
    for tag in CHECKED_TAGS:
        problems = _crd_problems(manifest, tag)
        if _version(tag)[:2] >= minimum:
            assert not problems, f"{path.name} on KubeRay {tag}:\n" + "\n".join(problems)
    below = [t for t in CHECKED_TAGS if _version(t)[:2] < minimum]
    if below:
        assert _crd_problems(manifest, below[-1]), f"{path.name} also fits KubeRay {below[-1]}: claim >= {'.'.join(below[-1].lstrip('v').split('.')[:2])}"


def test_crd_check_rejects_unknown_and_mistyped_fields() -> None:
    """The check is closed down to the Pod template: a misspelt field or a wrong type anywhere is reported by path."""
    (_, job), = _kuberay("RayJob")
    job = json.loads(json.dumps(job))
    job["spec"]["backoffLimmit"] = 0
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    worker["rayStartParams"]["num-gpus"] = 8                      # Ray start params are strings
    worker["template"]["spec"]["hostNetwork"] = True              # a real field, cut from the vendored schema
    problems = "\n".join(_crd_problems(job, CHECKED_TAGS[-1]))
    assert "$.spec: Additional properties are not allowed ('backoffLimmit' was unexpected)" in problems
    assert "$.spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0]: Additional properties" in problems
    assert "'imagePullPolicyy' was unexpected" in problems
    assert "$.spec.rayClusterSpec.workerGroupSpecs[0].rayStartParams['num-gpus']: 8 is not of type 'string'" in problems
    assert "$.spec.rayClusterSpec.workerGroupSpecs[0].template.spec.hostNetwork: set in the manifest but cut" in problems
    assert len(problems.splitlines()) == 4, problems


def test_networkpolicy_keeps_every_ray_pod_inside_the_cluster() -> None:
    # Workers too: their ranks' gloo/NCCL ports and the rendezvous store have no authentication.
    (_, policy), = _kuberay("NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}
    assert "Ingress" in policy["spec"]["policyTypes"]
    assert "ipBlock" not in json.dumps(policy), "no address range may reach the head"


# --------------------------------------------------------------------------- ray up
def test_ray_up_file_is_valid_and_sized_for_its_job() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    config = yaml.safe_load((DEPLOY / "ray-up.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)

    cfg = load_config(ROOT / config["metadata"]["elastic_job"])
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["resources"]
    assert head.get("GPU", 0) == 0 and head.get("CPU", 0) == 0, "the head runs the driver, never a worker"
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    low = high = 0
    for name, node in workers.items():
        per_node = _check_node_fits_job(f"ray-up.yaml:{name}", node["resources"]["CPU"], node["resources"]["GPU"], cfg)
        assert node["resources"]["GPU"] == cfg.parallel.tp, f"{name}: a node is one TP group"
        low += node.get("min_workers", 0) * per_node
        high += node.get("max_workers", 0) * per_node
    assert low >= cfg.scaling.num_workers, f"the cluster starts with room for {low} workers, the job starts {cfg.scaling.num_workers}"
    assert high >= cfg.scaling.upper

    head_start = " ".join(config["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head_start and "--head" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert all("RAY_AUTH_MODE=token" in c for c in config["worker_start_ray_commands"] if c.startswith(("RAY", "ray start")))
    assert "--env RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert any(m.endswith(".ray/auth_token") for m in config["file_mounts"]), "every node needs the token"


# --------------------------------------------------------------------------- the dashboard is never public
ALL_INTERFACES = ".".join(["0"] * 4)  # spelled out so this file itself holds no such bind
_PUBLIC_DASHBOARD = re.compile(r"dashboard[-_]host[\"']?\s*[=:,]\s*[\"']?" + re.escape(ALL_INTERFACES))


def test_nothing_binds_the_dashboard_to_all_interfaces() -> None:
    """No file that a test, the demo or a cluster file starts binds the dashboard (or anything) publicly."""
    files = [ROOT / "Makefile", *DEPLOY.rglob("*")]
    for folder in ("elastic", "tests", "bench", "strategies", "storage"):
        files += (ROOT / folder).rglob("*.py")
    offenders = [str(f.relative_to(ROOT)) for f in files
                 if f.is_file() and f.suffix in ("", ".py", ".yaml", ".yml", ".sh") and _PUBLIC_DASHBOARD.search(f.read_text(errors="ignore"))]
    assert not offenders, f"dashboard bound to all interfaces in {offenders}"
    for path in DEPLOY.rglob("*.yaml"):
        assert ALL_INTERFACES not in path.read_text(), f"{path.relative_to(ROOT)} binds something to all interfaces"
