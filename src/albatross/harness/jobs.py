"""Background jobs of an attempt: the ``job`` helper, a bash script installed into every attempt.

One implementation serves both action formats: a ``bash_block`` agent runs ``job start CMD`` itself,
and the JSON tools ``job_start`` / ``job_list`` / ``job_log`` / ``job_wait`` / ``job_kill`` run the same
script. State lives in the sandbox (``$ALBATROSS_DIR/jobs/<id>/{cmd,pid,log,rc}``), so jobs survive
across turns; each job runs in its own session (``setsid``), so a command timeout never kills it, and it
dies with the attempt (the sandbox's pid namespace, or ``job kill all`` on unisolated backends).
"""

from __future__ import annotations

import shlex

JOB_USAGE = """\
job start CMD...      run CMD in the background, print its job id
job list              every job: id, state, command
job log ID [BYTES]    the last BYTES (default 2000) of the job's output so far
job wait ID [SECS]    wait up to SECS (default 10) for the job to end, then show its state and log tail
job kill ID|all       kill a job (its whole process group)"""

JOB_SCRIPT = r"""#!/bin/bash
# job: background jobs of this attempt (albatross harness).
root="${0%/bin/job}"
dir="$root/jobs"
die() { echo "job: $*" >&2; exit 2; }
state() {  # ID -> running | exited N | killed
  local d="$dir/$1"
  if [ -f "$d/killed" ]; then echo killed
  elif [ -f "$d/rc" ]; then echo "exited $(<"$d/rc")"
  elif kill -0 "$(<"$d/pid")" 2>/dev/null; then echo running
  else echo "exited ?"; fi
}
need() { [[ "$1" =~ ^[0-9]+$ ]] && [ -d "$dir/$1" ] || die "no job ${1:-(missing id)}; see: job list"; }
tail_log() {  # ID BYTES
  local log="$dir/$1/log" size
  size=$(wc -c < "$log")
  if [ "$size" -gt "$2" ]; then
    echo "[job $1: last $2 of $size bytes; full log: $log]"
    tail -c "$2" "$log"
  else
    cat "$log"
  fi
}
case "$1" in
  start)
    shift; [ $# -gt 0 ] || die "usage: job start COMMAND"
    mkdir -p "$dir"; id=1
    while ! mkdir "$dir/$id" 2>/dev/null; do id=$((id + 1)); done
    printf '%s\n' "$*" > "$dir/$id/cmd"
    launch=(); command -v setsid >/dev/null && launch=(setsid)
    "${launch[@]}" bash -c 'trap "echo \$? > \"$1/rc\"" EXIT; source "$2" 2>/dev/null; eval "$(<"$1/cmd")"' \
      job "$dir/$id" "$root/functions" > "$dir/$id/log" 2>&1 < /dev/null &
    echo $! > "$dir/$id/pid"
    echo "job $id started: $*"
    ;;
  list)
    [ -n "$(ls -A "$dir" 2>/dev/null)" ] || { echo "no jobs"; exit 0; }
    for d in $(ls "$dir" | sort -n); do
      printf '%s\t%s\t%s\n' "$d" "$(state "$d")" "$(head -c 80 "$dir/$d/cmd" | head -n 1)"
    done
    ;;
  log)
    need "$2"; echo "[job $2: $(state "$2")]"; tail_log "$2" "${3:-2000}"
    ;;
  wait)
    need "$2"; secs="${3:-10}"; [[ "$secs" =~ ^[0-9]+$ ]] || die "SECS must be a whole number"
    end=$((SECONDS + secs))
    while [ "$(state "$2")" = running ] && [ $SECONDS -lt $end ]; do sleep 0.1; done
    echo "[job $2: $(state "$2")]"; tail_log "$2" "${4:-2000}"
    ;;
  kill)
    if [ "$2" = all ]; then ids=$(ls "$dir" 2>/dev/null); else need "$2"; ids=$2; fi
    for id in $ids; do
      [ "$(state "$id")" = running ] || continue
      pid=$(<"$dir/$id/pid"); touch "$dir/$id/killed"
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
      echo "job $id killed"
    done
    ;;
  *)
    echo "usage:"
    cat <<'USAGE'
JOB_USAGE_PLACEHOLDER
USAGE
    [ -z "$1" ] || [ "$1" = help ] || exit 2
    ;;
esac
""".replace("JOB_USAGE_PLACEHOLDER", JOB_USAGE)


def job_command(script: str, sub: str, *args: str | int) -> str:
    """The shell line that runs ``job SUB ARGS`` with the helper at ``script``."""
    return " ".join([shlex.quote(script), sub, *(shlex.quote(str(a)) for a in args)])
