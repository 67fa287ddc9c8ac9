#!/usr/bin/env bash
# In the image build (Dockerfile): install the pins of the named groups of requirements.txt into
# $VIRTUAL_ENV and compile their bytecode there, so that no process compiles (or writes) anything at start.
#   install-pins.sh GROUP...     requirements.txt and pins.py are beside this script
# LEAVE_OUT: packages of those groups not to install (space-separated). The lock lists every dependency, so
# uv installs exactly its lines (--no-deps): a package left out is not pulled back in by another's needs.
# uv comes from the same lock into a throwaway environment, removed with the files beside this script.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
tool=$(mktemp -d)
trap 'rm -rf "$tool" "$here"' EXIT

python3 -m venv "$tool"
"$tool/bin/pip" install -q "$(grep '^uv==' "$here/requirements.txt")"
read -ra leave_out <<<"${LEAVE_OUT:-}"
python3 "$here/pins.py" select --lock "$here/requirements.txt" "$@" --leave-out "${leave_out[@]}" >"$tool/pins.txt"
"$tool/bin/uv" pip install --no-deps --python "$VIRTUAL_ENV/bin/python" -r "$tool/pins.txt"
# compileall writes only what is missing or stale: a later stage adds the bytecode of its packages alone
site=$("$VIRTUAL_ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Some packages ship templates or test data named *.py that are not this Python's source (torch's
# testing/_internal/py312_intrinsics.py): left as they are, quietly (uv's --compile-bytecode skips them
# alike); any other failure is shown.
if ! "$VIRTUAL_ENV/bin/python" -m compileall -q -j 0 "$site" >"$tool/compile.log"; then
  grep -q '^\*\*\* Error compiling' "$tool/compile.log" || tail -n 5 "$tool/compile.log"
fi
