"""Shell shims of the offline toolkit: the network tools that task scripts call, served locally.

Each value is a whole script; ``offline.py`` writes them under ``<toolkit>/bin`` (``lib/`` and ``pybin/``
for the helpers). The shims find the toolkit from their own path, so a fresh copy can be put anywhere
(an adapted image has one at ``/usr/local/lib/albatross-offline``; verification brings its own). A request
that only the network could satisfy prints one ``albatross-offline: needs the network: ...`` line on
stderr (the gates look for it) and fails.
"""

from __future__ import annotations

TOOLKIT_PATH = "/usr/local/lib/albatross-offline"
NEEDS_NETWORK = "albatross-offline: needs the network:"
PIP_ZIP = "pip.zip"  # the toolkit's pip, in lib/ (``toolkit_pip`` below runs it)

COMMON = r"""# albatross offline toolkit: helpers sourced by every shim (which sets _self to its real path)
TK=${_self%/bin/*}
note() { printf 'albatross-offline: %s\n' "$*" >&2; }
needs_network() { printf 'albatross-offline: needs the network: %s\n' "$*" >&2; }
real_tool() {  # the first $1 on PATH that is not one of ours
  local d IFS=:
  for d in $PATH; do
    case "$d" in */albatross-offline*|"$HOME/.local/bin") continue ;; esac
    if [ -x "$d/$1" ] && [ ! -d "$d/$1" ]; then printf '%s\n' "$d/$1"; return 0; fi
  done
  return 1
}
python_bin() { real_tool python3 || real_tool python; }
safe_python() {  # the toolkit's own checks: never from the working directory, where a module could stand in
  ( cd "$TK/lib" && PYTHONSAFEPATH=1 "$@" )
}
with_build_network() {  # the sandbox has a network (a build, or a network policy): the real tool, if any
  [ -n "${ALBATROSS_NETWORK:-}" ] || return 0
  local real; real=$(real_tool "$1") || return 0
  shift; exec "$real" "$@"
}
missing_dists() {  # $1: "toolkit" or "system"; prints the requirements that are not installed
  local where=$1 py; shift
  py=$(python_bin) || { printf '%s\n' "$@"; return 0; }
  local pp=${PYTHONPATH:-}
  if [ "$where" = toolkit ]; then pp="$TK/site${pp:+:$pp}"; fi
  PYTHONPATH="$pp" safe_python "$py" - "$@" <<'PY'
import re
import sys
from importlib import metadata

EMULATED = {"pytest-json-ctrf", "pytest_json_ctrf"}  # the toolkit's pytest plugin provides --ctrf
for req in sys.argv[1:]:
    name = re.split(r"[\s\[<>=!~;@]", req.strip(), maxsplit=1)[0]
    if not name or name.lower() in EMULATED:
        continue
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(req)
PY
}
link_toolkit_site() {  # make the toolkit's packages importable by the environment's python for good
  local py site
  py=$(python_bin) || return 0
  site=$(safe_python "$py" -c 'import site, sys, sysconfig
paths = [sysconfig.get_paths()["purelib"]] if sys.prefix != sys.base_prefix else site.getsitepackages()
print(paths[0] if paths else "")' 2>/dev/null)
  if [ -n "$site" ] && mkdir -p "$site" 2>/dev/null; then
    printf '%s\n' "$TK/site" > "$site/albatross-offline.pth"
  fi
}
run_pytest() {
  local py
  py=$(python_bin) || { needs_network "pytest (there is no python3 in the environment)"; exit 127; }
  if ! PYTHONPATH="$TK/site" safe_python "$py" -c 'import pytest' 2>/dev/null; then
    needs_network "pytest (the offline toolkit has no pytest: install pytest where albatross runs)"
    exit 127
  fi
  export PATH="$TK/pybin:$PATH" PYTHONPATH="$TK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
  exec "$py" "$TK/lib/pytest_main.py" -p albatross_pytest "$@"  # as the pytest command: the cwd is not on sys.path
}
toolkit_pip() {  # pip (the toolkit's copy) for the environment's python, from the registries the policy allows
  local py; py=$(python_bin) || return 1
  PYTHONPATH="$TK/lib/pip.zip" safe_python "$py" -m pip --disable-pip-version-check --no-input "$@" >&2
}
check_requirements() {  # satisfied from the environment or the toolkit; with a network, what is missing is
  [ $# -eq 0 ] && return 0  # installed for this command only (a directory of its own, as uvx's environment)
  local missing dir
  missing=$(missing_dists toolkit "$@")
  if [ -n "$missing" ] && [ -n "${ALBATROSS_NETWORK:-}" ]; then
    dir=$(mktemp -d "${TMPDIR:-/tmp}/albatross-with-XXXXXX") && \
      note "installing $(printf '%s ' $missing)from the package registries for this command" && \
      toolkit_pip install --quiet --no-warn-script-location --target "$dir" $missing && {
        export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" PATH="$dir/bin:$PATH"; return 0; }
  fi
  if [ -n "$missing" ]; then
    needs_network "install $(printf '%s ' $missing)(not installed locally)"
    return 1
  fi
  note "already installed locally (no network): $*"
}
install_requirements() {  # as check_requirements, and the environment's python then imports them; with a
  local missing  # network, what is missing is installed into the environment's python, as pip would
  missing=$(missing_dists toolkit "$@")
  if [ -n "$missing" ] && [ -n "${ALBATROSS_NETWORK:-}" ]; then
    note "installing $(printf '%s ' $missing)from the package registries"
    toolkit_pip install --quiet --no-warn-script-location --break-system-packages $missing || return 1
    return 0
  fi
  check_requirements "$@" || return 1
  if [ $# -gt 0 ] && [ -n "$(missing_dists system "$@")" ]; then link_toolkit_site; fi
}
"""

APT_GET = r"""#!/bin/bash
# albatross offline shim: apt-get / apt. update is skipped; install succeeds when every package is
# already installed on the local base (or is curl / wget, which the toolkit stands in for: the uv
# installer is served locally, other downloads need the network), else it needs the network.
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
tool=$(basename "$0")
with_build_network "$tool" "$@"
sub="" ; pkgs=() ; skip=0
for a in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$a" in
    -o|-t|-c|--option|--target-release|--config-file) skip=1 ;;
    -*) ;;
    *) if [ -z "$sub" ]; then sub=$a; else pkgs+=("$a"); fi ;;
  esac
done
case "$sub" in
  update|upgrade|dist-upgrade|full-upgrade)
    note "$tool $sub skipped (no network; the local base's packages are used)"; exit 0 ;;
  install)
    missing=()
    for p in "${pkgs[@]}"; do
      case "$p" in */*|*.deb) exec "$(real_tool "$tool")" "$@" ;; esac
      name=${p%%=*}; name=${name%%:*}
      case "$name" in curl|wget) [ -x "$TK/bin/$name" ] && continue ;; esac  # the toolkit's stands in
      status=$(dpkg-query -W -f='${Status}' "$name" 2>/dev/null)
      case "$status" in *"ok installed"*) ;; *) missing+=("$name") ;; esac
    done
    if [ ${#missing[@]} -gt 0 ]; then
      needs_network "$tool install ${missing[*]} (not installed on the local base)"; exit 100
    fi
    note "$tool install: already installed on the local base: ${pkgs[*]}"; exit 0 ;;
esac
real=$(real_tool "$tool") || { needs_network "$tool $sub ($tool is not installed)"; exit 100; }
exec "$real" "$@"
"""

PIP = r"""#!/bin/bash
# albatross offline shim: pip / pip3. install succeeds when every requirement is installed locally
# (the toolkit's pytest counts), else it needs the network; other commands go to the real pip.
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
with_build_network "$(basename "$0")" "$@"
sub="" ; reqs=() ; files=() ; skip=0 ; want_file=0 ; local_path=0
for a in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  if [ "$want_file" = 1 ]; then files+=("$a"); want_file=0; continue; fi
  case "$a" in
    -r|--requirement) want_file=1 ;;
    --requirement=*) files+=("${a#*=}") ;;
    -e|--editable) local_path=1 ;;
    -i|--index-url|--extra-index-url|-f|--find-links|-c|--constraint|-t|--target|--prefix|--root|\
    --platform|--python-version|--implementation|--abi|--cache-dir|--src|--progress-bar|\
    --root-user-action|--log|--proxy|--retries|--timeout|--trusted-host|--upgrade-strategy|\
    --only-binary|--no-binary) skip=1 ;;
    -*) ;;
    *) if [ -z "$sub" ]; then sub=$a; else reqs+=("$a"); fi ;;
  esac
done
real_pip() {
  local p; p=$(real_tool "$(basename "$0")") || p=$(real_tool pip3) || p=$(real_tool pip)
  if [ -n "$p" ]; then exec "$p" "$@"; fi
  exec "$(python_bin)" -m pip "$@"
}
[ "$sub" = install ] || real_pip "$@"
for f in "${files[@]}"; do
  while IFS= read -r line; do
    line=${line%%#*}; line=$(printf '%s' "$line" | tr -d '[:space:]')
    case "$line" in ""|-*) ;; *) reqs+=("$line") ;; esac
  done < "$f"
done
for r in "${reqs[@]}"; do case "$r" in */*|*.whl|*.tar.gz|*.zip|.) local_path=1 ;; esac; done
[ "$local_path" = 1 ] && real_pip "$@"
install_requirements "${reqs[@]}" || exit 1
"""

UVX = r"""#!/bin/bash
# albatross offline shim: uvx (uv tool run). pytest runs with the toolkit's pytest and the environment's
# python; any other tool must already be installed locally.
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
withs=() ; from=""
while [ $# -gt 0 ]; do
  case "$1" in
    -w|--with) withs+=("$2"); shift 2 ;;
    --with=*) withs+=("${1#*=}"); shift ;;
    --from) from=$2; shift 2 ;;
    --from=*) from=${1#*=}; shift ;;
    -p|--python|--with-requirements|--with-editable|--index-url|--extra-index-url|--default-index|\
    -i|--cache-dir|--directory|--project|--python-preference|--color|--index|--constraints|\
    --overrides|--build-constraints) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { note "uvx: no command given"; exit 2; }
tool=$1; shift
check_requirements "${withs[@]}" ${from:+"$from"} || exit 1
case "${tool%%[=@<>]*}" in
  pytest|py.test) run_pytest "$@" ;;
esac
real=$(real_tool "${tool%%[=@<>]*}") || { needs_network "uvx $tool (not installed locally)"; exit 1; }
exec "$real" "$@"
"""

UV = r"""#!/bin/bash
# albatross offline shim: uv. venv, pip install, run and tool run work with what is installed locally
# (with a network, the image's own uv where it has one).
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
with_build_network uv "$@"
sub=$1; [ $# -gt 0 ] && shift
case "$sub" in
  --version|-V|version|self) echo "uv 0.0.0 (albatross offline shim)"; exit 0 ;;
  venv)
    dir=".venv" ; skip=0
    for a in "$@"; do
      if [ "$skip" = 1 ]; then skip=0; continue; fi
      case "$a" in -p|--python|--prompt|--index-url) skip=1 ;; -*) ;; *) dir=$a ;; esac
    done
    py=$(python_bin) || { needs_network "uv venv (no python3 in the environment)"; exit 1; }
    "$py" -m venv --system-site-packages --without-pip "$dir" || exit 1
    for site in "$dir"/lib/python*/site-packages; do printf '%s\n' "$TK/site" > "$site/albatross-offline.pth"; done
    note "uv venv $dir: a local virtual environment (no network)"; exit 0 ;;
  pip)
    sub2=$1; [ $# -gt 0 ] && shift
    if [ "$sub2" = install ]; then
      reqs=() ; skip=0
      for a in "$@"; do
        if [ "$skip" = 1 ]; then skip=0; continue; fi
        case "$a" in -r|-i|-p|--python|--index-url|-c|--constraint|--extra-index-url) skip=1 ;; -*) ;; *) reqs+=("$a") ;; esac
      done
      install_requirements "${reqs[@]}" || exit 1; exit 0
    fi
    exec "$TK/bin/pip" "$sub2" "$@" ;;
  run)
    withs=()
    while [ $# -gt 0 ]; do
      case "$1" in
        -w|--with) withs+=("$2"); shift 2 ;;
        --with=*) withs+=("${1#*=}"); shift ;;
        -p|--python|--directory|--project|--index-url|--extra-index-url|--env-file|--group|--extra) shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
      esac
    done
    check_requirements "${withs[@]}" || exit 1
    [ $# -gt 0 ] || { note "uv run: no command given"; exit 2; }
    case "$1" in
      pytest|py.test) shift; run_pytest "$@" ;;
      python|python3) shift; export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TK/site"; exec "$(python_bin)" "$@" ;;
    esac
    exec "$@" ;;
  tool)
    sub2=$1; [ $# -gt 0 ] && shift
    case "$sub2" in
      run) exec "$TK/bin/uvx" "$@" ;;
      install) install_requirements "$@" || exit 1; exit 0 ;;
    esac ;;
esac
needs_network "uv $sub (resolving or downloading packages)"
exit 1
"""

FETCH = r"""#!/bin/bash
# albatross offline shim: curl / wget. The uv installer is served from the toolkit; anything else goes
# to the real tool, and a failure to resolve or connect is reported as needing the network.
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
tool=$(basename "$0")
url="" ; out="" ; next_out=0 ; remote_name=0
for a in "$@"; do
  if [ "$next_out" = 1 ]; then out=$a; next_out=0; continue; fi
  case "$a" in
    http://*|https://*|ftp://*) url=$a ;;
    -o|--output|--output-document) next_out=1 ;;
    --output=*|--output-document=*) out=${a#*=} ;;
    -O|--remote-name) if [ "$tool" = wget ]; then next_out=1; else remote_name=1; fi ;;
    -*O)  [ "$tool" = wget ] && next_out=1 ;;
    -*O?*) [ "$tool" = wget ] && out=${a#*O} ;;
  esac
done
[ "$remote_name" = 1 ] && out=${url##*/}
[ "$tool" = wget ] && [ -z "$out" ] && out=${url##*/}
case "$url" in
  *astral.sh/uv*|*github.com/astral-sh/uv/*)
    note "served the uv installer from the offline toolkit (no network): $url"
    if [ -n "$out" ] && [ "$out" != - ]; then exec > "$out"; fi
    sed "s#@TOOLKIT@#$TK#g" "$TK/lib/uv-install.sh"
    exit 0 ;;
esac
real=$(real_tool "$tool") || { needs_network "$tool $url ($tool is not installed)"; exit 127; }
"$real" "$@"
rc=$?
if [ "$tool" = curl ] && { [ "$rc" = 5 ] || [ "$rc" = 6 ] || [ "$rc" = 7 ]; }; then needs_network "curl $url"; fi
if [ "$tool" = wget ] && [ "$rc" = 4 ]; then needs_network "wget $url"; fi
exit $rc
"""

PYTEST = r"""#!/bin/bash
# albatross offline shim: pytest, from the environment's python (its own pytest if it has one).
_self=$(readlink -f "$0"); . "${_self%/bin/*}/lib/common.sh"
py=$(python_bin) && safe_python "$py" -c 'import pytest' 2>/dev/null && {
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$TK/site" PATH="$TK/pybin:$PATH"
  exec "$py" "$TK/lib/pytest_main.py" -p albatross_pytest "$@"
}
run_pytest "$@"
"""

PYTHON_ALIAS = r"""#!/bin/sh
# albatross: `python` is python3 (as in the python images)
exec python3 "$@"
"""

UV_INSTALLER = r"""#!/bin/sh
# albatross offline toolkit: stands in for the uv installer (no download)
mkdir -p "$HOME/.local/bin"
ln -sf @TOOLKIT@/bin/uv "$HOME/.local/bin/uv"
ln -sf @TOOLKIT@/bin/uvx "$HOME/.local/bin/uvx"
cat > "$HOME/.local/bin/env" <<'EOF'
case ":${PATH}:" in *:"$HOME/.local/bin":*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac
EOF
echo "albatross-offline: uv shims installed in $HOME/.local/bin (no network)"
"""

BIN: dict[str, str] = {
    "apt-get": APT_GET,
    "apt": APT_GET,
    "pip": PIP,
    "pip3": PIP,
    "uv": UV,
    "uvx": UVX,
    "curl": FETCH,
    "wget": FETCH,
    "pytest": PYTEST,
}
# pytest started as its console script is: a module in the working directory cannot stand in for pytest
PYTEST_MAIN = "import sys\n\nimport pytest\n\nsys.exit(pytest.main())\n"
LIB: dict[str, str] = {"common.sh": COMMON, "uv-install.sh": UV_INSTALLER, "pytest_main.py": PYTEST_MAIN}
PYBIN: dict[str, str] = {"python": PYTHON_ALIAS}
