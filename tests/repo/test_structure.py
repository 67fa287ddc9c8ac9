"""The lessons are copies by design: what they share stays identical, each is short, each step a small diff"""

import ast
import difflib
import json
import re
import subprocess

import pytest
from helpers import EXAMPLES, PROGRAMS, REPO, SITES, TORCHRUN_LESSONS

pytestmark = pytest.mark.quick

STEPS = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode"]
ALL = [*STEPS, "multigpu_accelerate", "multigpu_ray", "multigpu_dataparallel", "multigpu_torchft"]
# Every lesson, comments and docstrings included, reads in five minutes: about 170 lines, torchft a few
# more for its own launcher. The bounds are today's sizes, which only go down.
MAX_LINES = dict(zip(ALL, [137, 169, 174, 178, 174, 168, 149, 183], strict=True))
# Changed lines (added + removed) allowed between a step and the one it builds on: nearly all of them are
# the lesson.
DIFF_BOUND = {
    ("single_gpu", "multigpu"): 58,  # the group, the sampler, DDP, a held port, two refusals
    ("multigpu", "multigpu_torchrun"): 65,  # torchrun's environment, its summary for refusals, Ctrl-C in each
    ("multigpu_torchrun", "multinode"): 25,  # the nodes' snapshot check and where each rank runs
    ("multigpu_torchrun", "multigpu_accelerate"): 60,  # Accelerator in place of the group and DDP
    ("multigpu_torchrun", "multigpu_ray"): 70,  # the Ray driver, in place of torchrun's refusals and Ctrl-C
    ("single_gpu", "multigpu_dataparallel"): 25,  # DataParallel and its refusal without 2 GPUs
    # a Manager, its optimizer, gradients averaged through it, epochs counted in committed steps, its
    # shutdown (left to the interpreter's exit, it aborted 1 run in 12 under load) and four arguments, less
    # torchrun's process group and refusals
    ("multigpu_torchrun", "multigpu_torchft"): 110,
}
# The functions below each lesson's "Below: the same in every lesson" line, identical in every copy, and
# at most SHARED_LINES lines in all: what every step needs that is not its lesson.
SHARED = ["get_args", "load_train_objs", "save_snapshot", "load_snapshot"]
SHARED_LINES = 60
# in the lessons torchrun starts with several processes: how a refusal ends, with torchrun's summary or not
SHARED_TORCHRUN = ["refuse", "__main__"]
# What the lessons no longer teach: the speed options live in the GPT trainer (examples/gpt/).
LEFT_OUT = ["no_sync", "comm_hook", "bucket_cap_mb", "static_graph", "bfloat16", "channels_last", "sha256"]


def source(name):
    return (EXAMPLES / f"{name}.py").read_text()


def functions(name):
    """Each top-level function's source by name, and the `if __name__ == "__main__":` block as "__main__"."""
    text = source(name)
    tree = ast.parse(text)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            found["__main__"] = ast.get_source_segment(text, node)
    return found


def changed_lines(before, after):
    """What `make diff` shows (diff -u): the added and removed lines."""
    paths = [EXAMPLES / f"{name}.py" for name in (before, after)]
    diff = subprocess.run(["diff", "-U0", *paths], capture_output=True, text=True, check=False).stdout
    return [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_sizes_and_diffs_are_within_their_bounds():
    sizes = {name: len(source(name).splitlines()) for name in ALL}
    diffs = {pair: len(changed_lines(*pair)) for pair in DIFF_BOUND}
    print("\nlines:", ", ".join(f"{name} {count}" for name, count in sizes.items()))
    print("make diff:", ", ".join(f"{a} -> {b} {count}" for (a, b), count in diffs.items()))
    assert all(count <= MAX_LINES[name] for name, count in sizes.items()), sizes
    for pair, count in diffs.items():
        assert count <= DIFF_BOUND[pair], f"{pair[0]} -> {pair[1]}: {count} changed lines"


@pytest.mark.parametrize("function", SHARED + SHARED_TORCHRUN)
def test_shared_functions_are_identical(function):
    names = ALL if function in SHARED else TORCHRUN_LESSONS
    copies = {name: functions(name).get(function) for name in names}
    assert all(copies.values()), f"{function} missing from {[n for n, c in copies.items() if not c]}"
    reference_name, reference = next(iter(copies.items()))
    for name, text in copies.items():
        diff = "".join(
            difflib.unified_diff(reference.splitlines(True), text.splitlines(True), reference_name, name)
        )
        assert not diff, f"{function} drifted; make every copy the same:\n{diff}"


def test_the_shared_part_comes_after_the_lesson():
    for name in ALL:
        names = list(functions(name))
        assert names.index("get_args") > names.index("main"), name


def test_the_shared_part_is_small():
    text = source("single_gpu")
    lines = sum(len(functions("single_gpu")[name].splitlines()) for name in SHARED)
    assert lines <= SHARED_LINES, lines
    assert text.count("\n\n\n# Below: the same in every lesson") == 1


@pytest.mark.parametrize("name", ALL)
def test_lessons_read_like_the_tutorial(name):
    """Short lines, one statement a line: no walrus, no conditional expression deciding what runs."""
    lines = source(name).splitlines()
    filled = [line for line in lines if line.strip()]
    assert sum(map(len, filled)) / len(filled) <= 60
    assert sum(len(line) >= 100 for line in lines) <= 0.05 * len(lines)
    tree = ast.parse(source(name))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.NamedExpr)]
    assert "time.sleep" not in source(name)
    # a conditional expression only picks a value: neither branch calls anything (sys.exit, sleep)
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp):
            branches = [*ast.walk(node.body), *ast.walk(node.orelse)]
            assert not [n for n in branches if isinstance(n, ast.Call)], ast.unparse(node)


@pytest.mark.parametrize("name", ALL)
def test_lessons_teach_only_the_lesson(name):
    text = source(name)
    assert not [word for word in LEFT_OUT if word in text]
    imports = set(re.findall(r"^(?:from|import) (\w+)", text, re.M))  # at the top: needed on every run
    allowed = {
        "argparse",
        "difflib",
        "json",
        "os",
        "socket",
        "sys",
        "time",
        "datetime",
        "torch",
        "accelerate",
        "torchft",
    }
    assert imports <= allowed
    later = set(re.findall(r"^[ \t]+(?:from|import) (\w+)", text, re.M))
    # ray in its driver, after its log setting
    assert later <= {"ray"}


def test_make_help_lists_every_target_once_by_group_within_100_characters():
    """`make help`: the lessons first, then the GPT, Docker, the engines, diagnostics, benchmarks, tests;
    every target the Makefile describes ("## ") once, none under "Other:"; no line over 100 characters and
    no unexpanded make variable. Mutation: a new described target left out of HELP_GROUPS: it appears
    under "Other:" and this fails."""
    repo = EXAMPLES.parent
    out = subprocess.run(["make", "-s", "help"], cwd=repo, capture_output=True, text=True, check=True).stdout
    lines = out.rstrip("\n").split("\n")
    groups = [line for line in lines if not line.startswith(" ")]
    expected = ["Lessons:", "GPT:", "Docker:", "Engines:", "Diagnostics:", "Benchmarks:", "Tests and upkeep:"]
    assert groups == expected, groups
    described = re.findall(r"^([a-zA-Z0-9_-]+):.*## ", (repo / "Makefile").read_text(), re.M)
    listed = re.findall(r"^  make (\S+)", out, re.M)
    assert sorted(listed) == sorted(described) and len(set(listed)) == len(listed), (listed, described)
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    assert "$(" not in out, out


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ("EPOCH=20", "EPOCH"),
        ("EPOCHS=20 RUN_S=x", "RUN_S"),
        ("EPOCHS=20 NPROC=4 ARGS=x FT_ARGS=x RDZV_PORT=1", ""),
    ],
)
def test_a_misspelt_make_variable_stops_make_before_any_work(given, refused):
    """`make torchrun EPOCH=20` would train 10 epochs without a word: make stops at once (exit status 2),
    naming it; the variables the targets read pass (OMP_NUM_THREADS: read by a recipe's shell as $${...}).
    Mutation: the check left out -> exit 0, fails."""
    proc = subprocess.run(
        ["make", "-n", "torchrun", *given.split()], cwd=EXAMPLES.parent, capture_output=True, text=True
    )
    if refused:
        assert proc.returncode == 2, proc.stdout[-2000:]
        assert f"*** {refused}: no target reads it (a typo?); make help lists the variables" in proc.stderr
    else:
        assert proc.returncode == 0 and not proc.stderr, proc.stderr


def imported(path):
    """The names of the modules a Python file imports, at any depth."""
    nodes = list(ast.walk(ast.parse(path.read_text())))
    names = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    froms = [node for node in nodes if isinstance(node, ast.ImportFrom)]
    # `from parallel import apply` imports the module parallel.apply (where there is one)
    return names | {node.module for node in froms} | {f"{n.module}.{a.name}" for n in froms for a in n.names}


def test_the_gpt_package_imports_without_a_circle():
    """Each module of examples/gpt and its families can be read after the ones it imports: the package's own
    imports form no circle (data.py reads what prepare.py writes; prepare.py does not import data.py), and
    config.py reads the mesh (parallel/mesh.py) without the rest of parallel/, nor the model or the trainer.
    Mutation: config.py's `from parallel.mesh import` as `from parallel import` -> fails."""
    package = EXAMPLES / "gpt"
    paths = {".".join(p.relative_to(package).with_suffix("").parts): p for p in package.rglob("*.py")}
    paths = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    imports = {name: imported(path) & set(paths) for name, path in paths.items()}
    floors = {}
    while len(floors) < len(paths):
        ready = {name for name in set(paths) - set(floors) if imports[name] <= set(floors)}
        assert ready, {name: sorted(imports[name] - set(floors)) for name in set(paths) - set(floors)}
        floors |= {name: 1 + max((floors[i] for i in imports[name]), default=0) for name in ready}
    print(
        "\nfloors:",
        ", ".join(f"{name} {floor}" for name, floor in sorted(floors.items(), key=lambda x: x[1])),
    )
    below = set()
    todo = ["config"]
    while todo:
        below |= imports[todo[0]] - below
        todo = todo[1:] + sorted(imports[todo[0]])
    assert not below & {"parallel", "parallel.apply", "model", "trainer"}, sorted(below)


def test_nothing_under_examples_imports_from_tools():
    """examples/ is what users copy: a file there may start tools/why_hung.py, never import it, so that a
    copied example needs nothing beside it but what its docstring names."""
    tools = {path.stem for path in (EXAMPLES.parent / "tools").glob("*.py")}
    for path in EXAMPLES.rglob("*.py"):
        assert not imported(path) & tools, path


def test_no_function_of_the_gpt_package_is_over_60_lines():
    """Each function of examples/gpt and its families reads on one screen: 60 lines at most, docstring
    included."""
    for path in (EXAMPLES / "gpt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 60, f"{path.name}: {node.name}"


def test_the_gpt_package_keeps_its_lines_under_100_characters():
    """At most 5% of the lines of examples/gpt reach 100 characters (nanoGPT's train.py and model.py: 3 to
    6%): its docstrings and comments are wrapped below that, the code mostly. Mutation: the docstrings as
    they were wrapped at 110 (8.7% of the lines) -> fails."""
    lines = [line for path in (EXAMPLES / "gpt").rglob("*.py") for line in path.read_text().splitlines()]
    long = [line for line in lines if len(line) >= 100]
    assert len(long) <= 0.05 * len(lines), f"{len(long)} of {len(lines)} lines"


# The recipe (examples/recipe.py) and its accelerate twin: not steps of the tutorial (their own data, model
# and arguments), but written as the lessons are, refusing as the torchrun lessons refuse.
RECIPES = ["recipe", "recipe_accelerate"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipes_read_like_the_lessons_and_refuse_as_they_do(name):
    """At most 300 lines, a mean of at most 64 characters a line (60 before the anchors' schedule, clipping,
    step snapshots, log lines and --compile came in), under 10% of lines of 100 or more, no walrus, no
    assignment to parser.error; refuse() and the __main__ block identical to multigpu_torchrun.py's, so
    that a refusal is said once under torchrun. Mutation: a line added to recipe.py's refuse() -> it
    drifted, this fails."""
    lines = source(name).splitlines()
    filled = [line for line in lines if line.strip()]
    assert len(lines) <= 300, len(lines)
    assert sum(map(len, filled)) / len(filled) <= 64
    assert "parser.error =" not in source(name)
    assert sum(len(line) >= 100 for line in lines) <= 0.1 * len(lines)
    assert not [node for node in ast.walk(ast.parse(source(name))) if isinstance(node, ast.NamedExpr)]
    for function in SHARED_TORCHRUN:
        assert functions(name)[function] == functions("multigpu_torchrun")[function], function


def test_every_program_the_tests_start_has_its_line_in_the_index():
    """tests/programs/README.md names every script and sitecustomize folder there, and nothing else.
    Mutation: a program added without its line (or a line left for a program gone): fails naming it."""
    files = {p.name for p in PROGRAMS.glob("*.py")} | {f"sites/{p.name}/" for p in SITES.iterdir()}
    listed = set(re.findall(r"^\| `([^`]+)` \|", (PROGRAMS / "README.md").read_text(), re.M))
    assert listed == files, (sorted(files - listed), sorted(listed - files))


def test_a_test_over_a_minute_in_the_record_says_why():
    """Every test that took 60 s or more in the record of a whole run (tests/costs.json) says why in its
    docstring, in a sentence that opens "Over a minute". Mutation: one of those sentences removed: fails,
    naming the test."""
    record = json.loads((REPO / "tests" / "costs.json").read_text())["tests"]
    silent = []
    for test, seconds in record.items():
        path, name = test.split("::")[0], test.split("::")[-1].split("[")[0]
        if seconds < 60 or not (REPO / "tests" / path).exists():
            continue
        tree = ast.parse((REPO / "tests" / path).read_text())
        found = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name]
        if found and "Over a minute" not in (ast.get_docstring(found[0]) or ""):
            silent.append(f"{test}: {seconds} s")
    assert not silent, silent
