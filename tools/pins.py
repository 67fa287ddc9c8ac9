"""The pin groups: tools/requirements.in lists direct dependencies under `# group: NAME` lines;
requirements.txt is their one lock, every pin under the first group that needs it (runtime, ray, then dev).

    python tools/pins.py compile                 re-resolve requirements.txt (`make pins`; needs uv)
    python tools/pins.py select runtime ray      print the pins of these groups (what the image installs)
    python tools/pins.py select runtime --leave-out triton      ... all but these packages

compile resolves all the groups together, then each run of groups from the first (runtime; runtime + ray)
constrained to that lock, so that every group gets the same versions as `make env` installs. select uses
only the standard library: it runs on the image's bare python3.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE, LOCK = ROOT / "tools" / "requirements.in", ROOT / "requirements.txt"
GROUP_RE = re.compile(r"^# group: (\w+)")
HEADER = """\
# One lock of exact pins for Python 3.11 and 3.12, made by `make pins` (tools/pins.py) from
# tools/requirements.in. Each pin is under the first group that needs it; `make env` installs them all, the
# image the runtime group (`python tools/pins.py select runtime`), its ray stage runtime and ray.
"""


def groups(text):
    """{group: [lines]} in the order of the text; the lines are requirements (source) or pins (lock)."""
    found, name = {}, None
    for line in text.splitlines():
        if match := GROUP_RE.match(line):
            name = match.group(1)
            found[name] = []
        elif line.strip() and not line.startswith("#"):
            if name is None:
                raise ValueError(f"{line!r} comes before any '# group: NAME' line")
            found[name].append(line.strip())
    return found


def resolve(requirements, uv, constraints=None, prefer=None):
    """The pins uv resolves for these requirement lines, for Python 3.11 and 3.12 at once; prefer: a lock
    whose versions are kept where they still fit (uv reads its output file so)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, out = os.path.join(tmp, "requirements.in"), os.path.join(tmp, "requirements.txt")
        Path(source).write_text("\n".join(requirements) + "\n")
        if prefer and prefer.exists():
            Path(out).write_text(prefer.read_text())
        cmd = [uv, "pip", "compile", "-q", "--universal", "--python-version", "3.11", "--no-header"]
        cmd += ["--no-annotate", source, "-o", out, *(["-c", constraints] if constraints else [])]
        subprocess.run(cmd, check=True)
        return [line for line in Path(out).read_text().splitlines() if line and not line.startswith("#")]


def compile_lock(uv, source=SOURCE, lock=LOCK):
    wanted = groups(source.read_text())
    names = list(wanted)
    everything = resolve([r for name in names for r in wanted[name]], uv, prefer=lock)
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "lock.txt")
        Path(full).write_text("\n".join(everything) + "\n")
        text, seen = HEADER, set()
        for i, name in enumerate(names):
            last = i == len(names) - 1
            pins = everything if last else resolve([r for n in names[: i + 1] for r in wanted[n]], uv, full)
            text += f"# group: {name}\n" + "".join(f"{pin}\n" for pin in pins if pin not in seen)
            seen.update(pins)
    lock.write_text(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("compile", help="re-resolve requirements.txt from tools/requirements.in")
    make.add_argument("--uv", default="uv", help="the uv command (default: uv)")
    pick = sub.add_parser("select", help="print the pins of these groups")
    pick.add_argument("groups", nargs="+", metavar="GROUP")
    pick.add_argument("--lock", type=Path, default=LOCK, help="default: requirements.txt")
    pick.add_argument("--leave-out", nargs="*", default=[], metavar="NAME", help="packages to leave out")
    args = parser.parse_args(argv)
    if args.command == "compile":
        return compile_lock(args.uv)
    pins = groups(args.lock.read_text())
    unknown = [name for name in args.groups if name not in pins]
    if unknown:
        pick.error(f"no group {', '.join(unknown)} in {args.lock}; groups: {', '.join(pins)}")
    chosen = [pin for name in args.groups for pin in pins[name]]
    names = {re.split(r"[=<>!~; \[]", pin, maxsplit=1)[0].lower(): pin for pin in chosen}
    missing = [name for name in args.leave_out if name.lower() not in names]
    if missing:
        pick.error(f"--leave-out {', '.join(missing)}: not pinned in {', '.join(args.groups)}")
    left_out = {names[name.lower()] for name in args.leave_out}
    print("\n".join(pin for pin in chosen if pin not in left_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
