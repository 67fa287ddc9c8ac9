"""The Kubernetes manifests (k8s/), checked by harness/k8s_check.py as a cluster would check them, and tied to
the compose run: the same command, environment and snapshot volume. No cluster runs here. The TrainJob
checks need the Kubeflow Trainer CRDs (shared/k8s beside the repository, or K8S_CRD_DIR) and skip without
them, unless REQUIRE_K8S_CRDS=1. Budget: about 20 s."""

import re
import shutil
from pathlib import Path

import k8s_check
import pytest
import yaml
from helpers import REPO, need

K8S = REPO / "k8s"
BASES = ("trainjob", "gpt", "job")  # each also with GPUs: k8s/BASE-gpu
COMPOSE = {"trainjob": (), "gpt": ("gpt.yaml",), "job": ()}  # compose/compose.yaml plus these files
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def crds():
    folder = k8s_check.crd_dir()
    need(
        folder,
        "no Kubeflow Trainer CRDs: shared/k8s beside the repository, or K8S_CRD_DIR",
        "REQUIRE_K8S_CRDS",
    )
    return k8s_check.load_crds(folder)


def rendered(name, root=K8S):
    objects, error = k8s_check.render(root / name)
    assert error is None, error
    return {obj["kind"]: obj for obj in objects}


def test_every_built_in_object_is_valid():
    problems, notes = k8s_check.check_tree(K8S, None)
    assert not problems, "\n".join(problems)
    assert len([n for n in notes if "NOT CHECKED" not in n]) == 2 * len(BASES), notes


def test_every_object_is_valid_with_the_crds(crds):
    problems, notes = k8s_check.check_tree(K8S, crds)
    assert not problems, "\n".join(problems)
    assert not [n for n in notes if "NOT CHECKED" in n]
    trainjobs = [n for n in notes if "TrainJob/" in n]
    assert len(trainjobs) == 4, notes  # multinode and GPT, CPU and GPU


# (file under k8s/, text found there exactly once, its replacement, what the refusal says, needs the CRDs)
BROKEN = {
    "job misspelt": (
        "job/job.yaml",
        "  backoffLimit: 6",
        "  backoffLimt: 6",
        "'backoffLimt' was unexpected",
        0,
    ),
    "job type": ("job/job.yaml", "completions: 2", "completions: two", "spec.completions: 'two' is not", 0),
    "job misspelt in a container": (
        "job/job.yaml",
        "          args:",
        "          arg:",
        "'arg' was unexpected",
        0,
    ),
    "service misspelt": (
        "job/service.yaml",
        "publishNotReadyAddresses",
        "publishNotReadyAdresses",
        "'publishNotReadyAdresses'",
        0,
    ),
    "service type": ("job/service.yaml", "port: 29500", "port: rendezvous", "spec.ports[0].port: 'rende", 0),
    "claim misspelt": (
        "common/snapshots.yaml",
        "accessModes:",
        "accessMode:",
        "'accessMode' was unexpected",
        0,
    ),
    "claim type": (
        "common/snapshots.yaml",
        "    - ReadWriteMany",
        "    - [ReadWriteMany]",
        "spec.accessModes[0]: [",
        0,
    ),
    "gpu patch misspelt": (
        "gpu/kustomization.yaml",
        "                  limits:",
        "                  limit:",
        "'limit'",
        0,
    ),
    "trainjob misspelt": (
        "trainjob/trainjob.yaml",
        "numNodes: 2",
        "numNode: 2",
        "'numNode' was unexpected",
        1,
    ),
    "trainjob misspelt in a patch": (
        "trainjob/trainjob.yaml",
        "mountPath: /snapshots",
        "mountpath: /snapshots",
        "'mountpath' was unexpected",
        1,
    ),
    "trainjob type": (
        "trainjob/trainjob.yaml",
        "numProcPerNode: 2",
        'numProcPerNode: "2"',
        "numProcPerNode: '2' is not of type",
        1,
    ),
    "trainjob type in a patch": (
        "trainjob/trainjob.yaml",
        "fsGroup: 1000",
        "fsGroup: everyone",
        "securityContext.fsGroup: 'everyone'",
        1,
    ),
    "gpt patch misspelt": (
        "gpt/kustomization.yaml",
        "name: GPT_STEPS",
        "nmae: GPT_STEPS",
        "'nmae' was unexpected",
        1,
    ),
    "gpt patch type": (
        "gpt/kustomization.yaml",
        'value: "200"',
        "value: 200",
        "200 is not of type 'string'",
        1,
    ),
    "gpu patch type": (
        "gpu/kustomization.yaml",
        "value: 2",
        "value: [2]",
        f"resourcesPerNode.limits.{GPU}: [2]",
        1,
    ),
    # what the CRD's CEL rules and the operator's webhook refuse
    "trainjob name": ("trainjob/trainjob.yaml", "name: ddp-multinode", "name: ddp_multinode", "RFC 1035", 1),
    "operator's variable": (
        "trainjob/trainjob.yaml",
        "      - name: RDZV_ID",
        "      - name: PET_NNODES\n        value: '2'\n      - name: RDZV_ID",
        "must not set ['PET_NNODES']",
        1,
    ),
    "container not in the runtime": (
        "trainjob/trainjob.yaml",
        "- name: node\n                            volumeMounts",
        "- name: trainer\n                            volumeMounts",
        "container 'trainer' is not in job 'node'",
        1,
    ),
    "patch manager": (
        "trainjob/trainjob.yaml",
        "ddp-examples.local/volumes",
        "volumes",
        "domain-prefixed path",
        1,
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_copy_is_refused(case, tmp_path, request):
    path, old, new, says, with_crds = BROKEN[case]
    crds = request.getfixturevalue("crds") if with_crds else None
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    text = (root / path).read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    (root / path).write_text(text.replace(old, new))
    problems, _ = k8s_check.check_tree(root, crds)
    assert any(says in problem for problem in problems), "\n".join(problems) or "no problem found"


def test_a_manifest_no_kustomization_names_is_refused(tmp_path):
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    shutil.copy(root / "job" / "service.yaml", root / "job" / "extra.yaml")
    problems, _ = k8s_check.check_tree(root, None)
    assert problems == ["job/extra.yaml: not named by any kustomization.yaml, so never checked"]


def test_the_checker_exits_1_on_a_problem(tmp_path, capsys):
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    (root / "job" / "job.yaml").write_text(
        (root / "job" / "job.yaml").read_text().replace("parallelism", "paralelism")
    )
    assert k8s_check.main(["--root", str(root)]) == 1
    assert "'paralelism' was unexpected" in capsys.readouterr().err


def compose_node(extra):
    """compose/compose.yaml's node0, the extra files on top: (entrypoint, command, environment)."""
    node = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())["services"]["node0"]
    for name in extra:
        node = {**node, **yaml.safe_load((REPO / "compose" / name).read_text())["services"]["node0"]}
    return node["entrypoint"], node["command"], node["environment"]


def as_kubernetes(arg):
    """A compose argument written as in the manifests: ${NAME:-default} as $(NAME), set in the container's
    environment, and node0's rendezvous endpoint as pod 0's, in the variables the operator sets."""
    arg = re.sub(r"\$\{(\w+)(?::-[^}]*)?\}", r"$(\1)", arg)
    return arg.replace("node0:29500", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)")


def container(kind, obj):
    """(command, args, {env name: entry}, processes per pod) of the training container."""
    if kind == "TrainJob":
        trainer = obj["spec"]["trainer"]
        env = {e["name"]: e for e in trainer["env"]}
        # the operator sets these itself (checked by the webhook test above)
        env.update({name: {"name": name, "operator": True} for name in k8s_check.TORCH_RESERVED})
        return trainer["command"], trainer["args"], env, trainer["numProcPerNode"]
    (node,) = obj["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in node["env"]}
    return node["command"], node["args"], env, int(env["PET_NPROC_PER_NODE"]["value"])


def job_of(objects):
    kind = "TrainJob" if "TrainJob" in objects else "Job"
    return kind, objects[kind]


@pytest.mark.parametrize("base", BASES)
def test_the_container_runs_the_compose_command(base):
    """The same launcher, flags, script and arguments as the compose run, its variables set in the pods."""
    entrypoint, command, compose_env = compose_node(COMPOSE[base])
    kind, obj = job_of(rendered(base))
    k8s_command, k8s_args, env, _ = container(kind, obj)
    assert k8s_command == [as_kubernetes(a) for a in entrypoint]
    assert k8s_args == [as_kubernetes(a) for a in command]
    used = set(re.findall(r"\$\((\w+)\)", " ".join(k8s_command + k8s_args)))
    assert used <= set(env), f"not set in the container: {sorted(used - set(env))}"
    for name, value in compose_env.items():
        if name != "PET_NPROC_PER_NODE":  # per node in compose; below for the pods
            assert env[name].get("value") == value, name
    nnodes = int(next(a for a in k8s_command if a.startswith("--nnodes=")).split("=")[1])
    assert (
        obj["spec"]["trainer"]["numNodes"] if kind == "TrainJob" else obj["spec"]["completions"]
    ) == nnodes


def test_the_job_meets_at_pod_0s_dns_name():
    """The indexed Job's pod 0 is HOSTNAME.SUBDOMAIN = JOB-0.SERVICE, published before it is ready; restarts:
    torchrun's --max-restarts inside the pods, the Job's backoffLimit for their containers."""
    objects = rendered("job")
    job, service = objects["Job"], objects["Service"]
    pod = job["spec"]["template"]["spec"]
    _, _, env, _ = container("Job", job)
    name = job["metadata"]["name"]
    assert (
        job["spec"]["completionMode"] == "Indexed"
        and job["spec"]["parallelism"] == job["spec"]["completions"]
    )
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["PET_MASTER_ADDR"]["value"] == f"{name}-0.{service['metadata']['name']}"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert [p["port"] for p in service["spec"]["ports"]] == [int(env["PET_MASTER_PORT"]["value"])]
    assert (
        env["RDZV_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['batch.kubernetes.io/job-name']"
    )
    # a failed torchrun restarts in its pod, which keeps its address and DNS record
    assert pod["restartPolicy"] == "OnFailure"
    assert job["spec"]["backoffLimit"] == job["spec"]["completions"] * int(env["MAX_RESTARTS"]["value"])


def pod_spec(kind, obj):
    if kind == "TrainJob":
        (patch,) = obj["spec"]["runtimePatches"]
        (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert job["name"] == k8s_check.NODE
        return job["template"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


@pytest.mark.parametrize("base", BASES)
def test_sigterm_comes_early_enough_for_a_step_and_a_snapshot(base):
    # the GPT trainer needs up to --log_every steps and a save after SIGTERM (docs/fault-tolerance.md);
    # Kubernetes' default grace period, 30 s, is short of that for a step of seconds
    kind, obj = job_of(rendered(base))
    grace = pod_spec(kind, obj)["terminationGracePeriodSeconds"]
    # torchrun's own wait for its workers after it forwards SIGTERM (30 s unless set), within the grace
    wait = int(container(kind, obj)[2]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])
    assert 90 <= wait < grace, (wait, grace)


def mounts(kind, obj):
    """{mount path: volume} of the training container, volumes as the pod declares them."""
    pod = pod_spec(kind, obj)
    (node,) = pod["containers"]
    assert node["name"] == k8s_check.NODE
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in node["volumeMounts"]}


@pytest.mark.parametrize("base", BASES)
def test_every_pod_shares_the_snapshot_claim(base):
    objects = rendered(base)
    kind, obj = job_of(objects)
    _, args, _, _ = container(kind, obj)
    snapshot = next(a for a in args if a.startswith("--snapshot_path=")).split("=", 1)[1]
    volume = mounts(kind, obj)[str(Path(snapshot).parent)]
    claim = objects["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert mounts(kind, obj)["/dev/shm"]["emptyDir"]["medium"] == "Memory"  # compose's shm_size


def limits(kind, obj):
    if kind == "TrainJob":
        return obj["spec"]["trainer"]["resourcesPerNode"]["limits"]
    return obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("base", BASES)
def test_gpus_are_one_overlay_away(base):
    """BASE-gpu is BASE plus one GPU per training process, nothing else."""
    cpu, gpu = rendered(base), rendered(f"{base}-gpu")
    kind, obj = job_of(gpu)
    assert GPU not in limits(*job_of(cpu))
    assert limits(kind, obj).pop(GPU) == container(kind, obj)[3]
    assert gpu == cpu


def test_the_image_is_named_once_for_every_job(tmp_path):
    """The image set in k8s/common/kustomization.yaml, the one edit the manifests need, reaches every pod."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    common = root / "common" / "kustomization.yaml"
    text = common.read_text()
    assert text.count("newName: ddp-examples\n") == 1 and text.count("newTag: latest\n") == 1
    common.write_text(
        text.replace("newName: ddp-examples", "newName: registry.example/ml/ddp").replace("latest", "v1")
    )
    for base in BASES:
        kind, obj = job_of(rendered(f"{base}-gpu", root))
        spec = obj["spec"]
        images = (
            [spec["trainer"]["image"]]
            if kind == "TrainJob"
            else [c["image"] for c in spec["template"]["spec"]["containers"]]
        )
        assert images == ["registry.example/ml/ddp:v1"], base
