#!/usr/bin/env bash
# hack/venv.sh VENV EXTRAS [TORCH_SPEC]: what `make venv` and `make unit` call.
#
# The dependencies of `.[EXTRAS]` (torch and its CUDA wheels, Ray, ...: ~4.5 GB, minutes to
# download, and this machine's egress proxy keeps pip's cache from storing any of it) are
# installed once per machine into ${TPUFT_CACHE:-~/.cache/tpuft}/venvs/<name>-<key>, keyed by
# what decides them: pyproject.toml's dependencies and the extras installed (not its tool
# settings or other extras: a linter rule must not reinstall 4.5 GB), this script and the
# arguments. VENV itself is the clone's own small venv: it sees those dependencies through one .pth file and holds only this clone,
# installed editable, so two clones on one machine never run each other's code.
# A fresh machine takes the same path; it only fills the cache first.
set -euo pipefail
venv=$1 extras=$2 torch=${3:-}
python=${PYTHON:-python3}
name=$(basename "$venv" | tr -c 'a-zA-Z0-9\n' '-' | sed 's/^-*//')
# Only the extras this venv installs: a linter or docs tool added to `lint` must not reinstall the
# 4.5 GB of the workload's venv.
requirements=$("$python" -c 'import json, sys, tomllib
d = tomllib.load(open("pyproject.toml", "rb"))
p = d["project"]
extras = {e: p.get("optional-dependencies", {}).get(e) for e in sys.argv[1].split(",")}
print(json.dumps([p.get("requires-python"), p.get("dependencies"), extras, d.get("build-system")], sort_keys=True))' "$extras")
key=$({ echo "$requirements"; cat "$0"; echo "$extras $torch"; "$python" -VV; } | sha256sum | cut -c1-16)
root=${TPUFT_CACHE:-$HOME/.cache/tpuft}/venvs
deps=$root/$name-$key
mkdir -p "$root"

exec 9>"$deps.lock"
flock 9   # a second clone building the same key waits for the first
if [ ! -f "$deps/.complete" ]; then
  echo "[venv] installing the dependencies of .[$extras] into $deps (once per machine)"
  rm -rf "$deps"
  "$python" -m venv "$deps"
  "$deps/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned, so Ray and transformers never pull another build.
  if [ -n "$torch" ]; then "$deps/bin/python" -m pip install -q "$torch"; fi
  # The project's dependencies without the project: install it, then take it out again.
  "$deps/bin/python" -m pip install -q ".[$extras]"
  "$deps/bin/python" -m pip uninstall -q -y tpufinetune-operator
  touch "$deps/.complete"
  echo "[venv] installed the dependencies of .[$extras] in ${SECONDS} s"
  # Older keys of this venv are a dependency change ago: keep the newest two, and any that a clone
  # still links to (several clones of one machine, e.g. git worktrees on different branches, each use
  # their own key: deleting one breaks that clone's venv behind its make stamp). A clone that used a
  # key is listed in its .users; a key older than this bookkeeping has none and goes after 2 days.
  for old in $(ls -1dt "$root/$name"-???????????????? 2>/dev/null | tail -n +3); do
    used=""
    if [ -f "$old.users" ]; then
      while read -r user; do grep -qsF "$old/" "$user"/lib/python3*/site-packages/_tpuft_deps.pth && used=1; done < "$old.users"
    elif [ -n "$(find "$old" -maxdepth 0 -mmin -2880)" ]; then
      used=1
    fi
    [ -n "$used" ] || rm -rf "$old" "$old.users"
  done
else
  echo "[venv] dependencies of .[$extras] from $deps"
fi
flock -u 9

rm -rf "$venv"
"$python" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
deps_site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# addsitedir (not a plain path line): the dependencies' own .pth files run too.
echo "import site; site.addsitedir('$deps_site')" > "$site/_tpuft_deps.pth"
"$venv/bin/python" -m pip install -q --upgrade pip   # the bundled one is too old for PEP 660 editables
"$venv/bin/python" -m pip install -q --no-deps -e .
grep -qsxF "$(realpath "$venv")" "$deps.users" || realpath "$venv" >> "$deps.users"   # for the pruning above
