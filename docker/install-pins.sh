#!/usr/bin/env bash
# In the image build (Dockerfile): install the pins of one dependency group, pins/GROUP.txt, into
# $VIRTUAL_ENV and compile their bytecode there, so that no process compiles (or writes) anything at start.
#   install-pins.sh GROUP        the files of pins/ (made by `make pins`) are beside this script
# LEAVE_OUT: packages of that group not to install (space-separated). The pins list every dependency, so
# uv installs exactly their lines (--no-deps): a package left out is not pulled back in by another's needs.
# uv comes from pins/dev.txt, its hashes checked, into a throwaway environment, removed with the files beside
# this script.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
pins=$here/$1.txt
tool=$(mktemp -d)
trap 'rm -rf "$tool" "$here"' EXIT
[ -f "$pins" ] || { echo "install-pins.sh: no group $1 in pins/" >&2; exit 2; }

# one package's pin and its hash lines
block() { awk -v name="$1" 'tolower($0) ~ "^" name "==" { p = 1 } p { print } p && !/\\$/ { p = 0 }' "$2"; }

python3 -m venv "$tool"
block uv "$here/dev.txt" >"$tool/uv.txt"
"$tool/bin/pip" install -q --require-hashes -r "$tool/uv.txt"
: >"$tool/leave-out.txt"
for name in ${LEAVE_OUT:-}; do
  grep -qi "^$name==" "$pins" || { echo "install-pins.sh: LEAVE_OUT $name: not pinned in $1" >&2; exit 2; }
  echo "$name" >>"$tool/leave-out.txt"
done
"$tool/bin/uv" pip install --no-deps --excludes "$tool/leave-out.txt" --python "$VIRTUAL_ENV/bin/python" \
  -r "$pins"
# compileall writes only what is missing or stale: a later stage adds the bytecode of its packages alone
site=$("$VIRTUAL_ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Some packages ship templates or test data named *.py that are not this Python's source (torch's
# testing/_internal/py312_intrinsics.py): left as they are, quietly (uv's --compile-bytecode skips them
# alike); any other failure is shown.
if ! "$VIRTUAL_ENV/bin/python" -m compileall -q -j 0 "$site" >"$tool/compile.log"; then
  grep -q '^\*\*\* Error compiling' "$tool/compile.log" || tail -n 5 "$tool/compile.log"
fi
