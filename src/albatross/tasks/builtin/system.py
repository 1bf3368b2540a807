"""Families: process and job control (job_control) and multi-step investigation (find_key)."""

from __future__ import annotations

import hashlib
import random

from albatross.tasks.builtin.checks import new_instance
from albatross.tasks.builtin.families import WORDS, Family, Instance, extra_files, text


class JobControl(Family):
    """/app/{a}_server.sh appends a heartbeat line to a log every 0.2 s. Medium and hard servers need
    ``--port N``; hard leaves a stale {a}.lock that makes the server refuse to start until removed (its
    error says so). Tests: a server process runs (with the right port), {a}.pid names it, and the log
    keeps growing."""

    name = "job_control"
    keep_agent_processes = True  # its tests check the server the agent left running (verify.py)
    category = "process-management"
    instruction_template = ("Start {command} in the background so that it keeps running after you finish, "
                            "and write its process ID to {a}.pid.")
    demo_templates = (
        "./{a}_server.sh",
        "rm -f {a}.lock",
        "nohup {command} > /dev/null 2>&1 & echo $! > {a}.pid",
        "submit",
    )
    vocabulary = ("server", "port", "pid", "lock", "heartbeat")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        a, log = rng.sample(WORDS, 2)
        port = rng.randint(2000, 9999) if level else None
        command = f"./{a}_server.sh" + (f" --port {port}" if port else "")
        files = {f"{a}_server.sh": _server(a, log, port is not None)}
        if level == 2:
            files[f"{a}.lock"] = f"{rng.randint(30000, 60000)}\n"
        fields = {"a": a, "command": command}
        steps = [0, 1, 2] if level == 2 else [2]
        commands = [self.demo_templates[i].format(**fields) for i in steps]
        expected = {"server": f"{a}_server.sh", "port": str(port) if port else "", "log": f"{log}.log",
                    "pid": f"{a}.pid"}
        return new_instance(self, (a, log, port, level), difficulty, self.instruction_template.format(**fields),
                            files, commands, JOB_CHECKS, expected, solve=commands[-2:] if level == 2 else None)


def _server(a: str, log: str, needs_port: bool) -> str:
    lines = ["#!/bin/bash", f"# {a} server: appends a heartbeat line to {log}.log every 0.2 s", "cd /app || exit 1",
             f'if [ -e {a}.lock ]; then echo "{a}_server: {a}.lock exists (another server?); '
             f'remove it to start" >&2; exit 1; fi']
    if needs_port:
        lines.append(f'if [ "$1" != --port ] || [ -z "$2" ]; then echo "usage: {a}_server.sh --port PORT" >&2; '
                     "exit 2; fi")
    lines.append(f'while true; do echo "heartbeat $(date +%s%N)" >> {log}.log; sleep 0.2; done')
    return text(lines)


JOB_CHECKS = '''
import time


def servers():
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(a.endswith(EXPECTED["server"]) for a in argv) and port_ok(argv):
            found[int(pid)] = argv
    return found


def port_ok(argv):
    if not EXPECTED["port"]:
        return True
    return "--port" in argv and argv[argv.index("--port") + 1:][:1] == [EXPECTED["port"]]


@check("server_running")
def _():
    return bool(servers())


@check("pid_file_correct")
def _():
    return int(read(EXPECTED["pid"]).strip()) in servers()


@check("heartbeat")
def _():
    if not servers():
        return False
    path = os.path.join(APP, EXPECTED["log"])
    size = os.path.getsize(path) if os.path.exists(path) else -1
    for _ in range(10):
        time.sleep(0.2)
        if os.path.exists(path) and os.path.getsize(path) > max(size, 0):
            return bool(servers())
    return False
'''


class FindKey(Family):
    """/app/check.sh exits 0 for exactly one word (it compares a salted sha256, so reading it does not
    give the answer away); candidates.txt lists 4, 8 or 12 words (by difficulty; hard adds comment and
    blank lines). Tests: the answer exists and is the right word."""

    name = "find_key"
    category = "investigation"
    instruction_template = ("Exactly one word in candidates.txt makes ./check.sh exit with status 0. "
                            "Write that word to answer.txt.")
    split_templates = {
        "heldout": ("./check.sh accepts a single word from candidates.txt and rejects all others. Find it "
                    "and save it in answer.txt."),
        "validation": ("Try the words listed in candidates.txt with ./check.sh; put the only one it accepts "
                       "into answer.txt."),
    }
    demo_templates = (
        "for w in $(grep -v '^#' candidates.txt); do if ./check.sh $w; then echo $w > answer.txt; fi; done",
        "submit",
    )
    vocabulary = ("candidates", "check", "key")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        candidates = rng.sample(WORDS, 4 + 4 * level)
        answer = rng.choice(candidates)
        salt = f"{rng.getrandbits(32):08x}"
        digest = hashlib.sha256(f"{salt}{answer}".encode()).hexdigest()
        listed = list(candidates)
        if level == 2:
            listed = ["# candidate keys, one per line", *listed[:6], "", *listed[6:]]
        files = {"candidates.txt": text(listed), "check.sh": _checker(salt, digest)}
        return new_instance(self, (tuple(candidates), answer), difficulty, self.instruction_template, files,
                            [self.demo_templates[0]], KEY_CHECKS, answer)


def _checker(salt: str, digest: str) -> str:
    return text([
        "#!/bin/bash",
        "# usage: ./check.sh WORD  (exit status 0 when WORD is the key)",
        'if [ $# -ne 1 ]; then echo "usage: ./check.sh WORD" >&2; exit 2; fi',
        f'[ "$(printf \'%s\' "{salt}$1" | sha256sum | cut -d" " -f1)" = "{digest}" ]',
    ])


KEY_CHECKS = '''
@check("answer_exists")
def _():
    return bool(read("answer.txt").strip())


@check("answer_correct")
def _():
    return read("answer.txt").strip() == EXPECTED
'''
