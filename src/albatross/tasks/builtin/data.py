"""Families: log analysis (log_errors) and data conversion (csv_to_json)."""

from __future__ import annotations

import csv
import io
import random

from albatross.tasks.builtin.checks import new_instance
from albatross.tasks.builtin.families import WORDS, Family, Instance, extra_files, text

SERVICES = ("auth", "billing", "cache", "search", "mailer", "gateway", "storage", "worker")
LEVELS = ("INFO", "WARN", "DEBUG")
COLUMNS = ("name", "color", "size", "price", "count", "city", "owner", "weight")
NUMERIC = {"size", "price", "count", "weight"}


class LogErrors(Family):
    """/app/app.log: "<date> <time> <LEVEL> <service>: <words>" lines; 2-4 services (by difficulty) have
    ERROR lines, with distinct counts. Medium adds a rotated app.log.1 (not to be counted); hard also has
    INFO lines that mention ERROR in their message. Tests: output exists, the right services, the right
    counts, most errors first."""

    name = "log_errors"
    category = "log-analysis"
    instruction_template = ("Count the ERROR lines of each service in app.log and write one line per "
                            "service, the service name and the count, most errors first, to errors.txt.")
    split_templates = {
        "heldout": ("For every service with ERROR entries in app.log, write its name and how many ERROR lines "
                    "it has to errors.txt, one service per line, the largest count on top."),
        "validation": ("errors.txt should list each service of app.log that logged ERROR lines, with the "
                       "number of them, sorted from most to fewest, one per line."),
    }
    demo_templates = (
        "awk '$3 == \"ERROR\" {{sub(\":\", \"\", $4); n[$4]++}} END {{for (s in n) print s, n[s]}}' app.log "
        "| sort -k2,2nr > errors.txt",
        "submit",
    )
    vocabulary = (*SERVICES, "ERROR", *LEVELS)

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        services = rng.sample(SERVICES, 4 + level)
        failing = services[: 2 + level]
        counts = dict(zip(failing, rng.sample(range(1, 10), len(failing)), strict=True))
        lines = [self._line(rng, "ERROR", s) for s, n in counts.items() for _ in range(n)]
        lines += [self._line(rng, rng.choice(LEVELS), rng.choice(services)) for _ in range(10 + 10 * level)]
        if level == 2:
            lines += [self._line(rng, "INFO", rng.choice(services), "recovered from ERROR") for _ in range(3)]
        lines = [f"2024-03-{rng.randint(1, 28):02d} {line}" for line in lines]
        files = {"app.log": text(sorted(lines))}
        if level >= 1:
            files["app.log.1"] = text(sorted(f"2024-02-{rng.randint(1, 28):02d} {self._line(rng, 'ERROR', s)}"
                                             for s in services))
        expected = sorted(counts.items(), key=lambda kv: -kv[1])
        return new_instance(self, (tuple(sorted(lines)),), difficulty, self.instruction_template, files,
                            [self.demo_templates[0].format()], LOG_CHECKS, expected)

    @staticmethod
    def _line(rng: random.Random, level: str, service: str, message: str = "") -> str:
        clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
        return f"{clock} {level} {service}: {message or ' '.join(rng.sample(WORDS, 3))}"


LOG_CHECKS = '''
def got():
    rows = [line.split() for line in lines("errors.txt")]
    return [(r[0].rstrip(":"), int(r[1])) for r in rows]


@check("errors_exists")
def _():
    return bool(lines("errors.txt"))


@check("errors_services")
def _():
    return sorted(s for s, _ in got()) == sorted(s for s, _ in EXPECTED)


@check("errors_counts")
def _():
    return sorted(got()) == sorted(tuple(e) for e in EXPECTED)


@check("errors_order")
def _():
    return got() == [tuple(e) for e in EXPECTED]
'''


class CsvToJson(Family):
    """/app/{a}.csv: a header of 3-5 columns (by difficulty) and 3-8 rows of words and integers; hard
    puts quoted values with commas in. Tests: the JSON exists, is a non-empty list of objects, has one
    object per row, the header's keys, and exactly the values (numbers as numbers)."""

    name = "csv_to_json"
    category = "data-conversion"
    instruction_template = ("Convert {a}.csv to {a}.json: a JSON list with one object per row, keyed by "
                            "the header, with numbers as numbers.")
    demo_templates = (
        "python3 -c \"import csv, json; rows = list(csv.DictReader(open('{a}.csv'))); "
        "json.dump([{{k: int(v) if v.isdigit() else v for k, v in r.items()}} for r in rows], "
        "open('{a}.json', 'w'))\"",
        "submit",
    )
    vocabulary = COLUMNS

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        a = rng.choice(WORDS)
        columns = rng.sample(COLUMNS, 3 + level)
        if not NUMERIC & set(columns):
            columns[-1] = rng.choice(sorted(NUMERIC))
        rows = [{c: self._value(rng, c, level) for c in columns} for _ in range(rng.randint(3, 5 + level))]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        files = {f"{a}.csv": buf.getvalue()}
        command = self.demo_templates[0].format(a=a)
        return new_instance(self, (a, buf.getvalue()), difficulty, self.instruction_template.format(a=a), files,
                            [command], CSV_CHECKS.replace("OUT", f"{a}.json"), {"columns": columns, "rows": rows})

    @staticmethod
    def _value(rng: random.Random, column: str, level: int) -> int | str:
        if column in NUMERIC:
            return rng.randint(0, 999)
        if level == 2 and rng.random() < 0.4:
            return ", ".join(rng.sample(WORDS, 2))
        return rng.choice(WORDS)


CSV_CHECKS = '''
def got():
    return json.loads(read("OUT"))


@check("json_exists")
def _():
    return os.path.isfile(os.path.join(APP, "OUT"))


@check("json_valid")
def _():
    data = got()
    return isinstance(data, list) and bool(data) and all(isinstance(r, dict) for r in data)


@check("json_rows")
def _():
    return len(got()) == len(EXPECTED["rows"])


@check("json_keys")
def _():
    return bool(got()) and all(sorted(r) == sorted(EXPECTED["columns"]) for r in got())


@check("json_values")
def _():
    return got() == EXPECTED["rows"]
'''
