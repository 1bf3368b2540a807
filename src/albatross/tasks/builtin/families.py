"""Generated task families for the CPU demo, sized for a tiny language model.

File names and contents are drawn from ``WORDS``, a small fixed vocabulary in which no word contains
another (so ``grep`` never matches by accident), and every instruction follows one fixed template.
Each family's ``generate(rng, difficulty)`` returns an ``Instance``: the files under /app, the
instruction, the oracle (solve.sh and one shell command per agent turn) and a pure-bash test.sh that
writes /logs/verifier/reward.json. Expected answers live only in tests/, never in environment/.

Difficulty adds distractor files: ``easy`` is the layout described on each family, ``medium`` adds
one more file and ``hard`` two more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORDS: tuple[str, ...] = (
    "apple", "mango", "kiwi", "lemon", "grape", "peach", "plum", "cherry",
    "melon", "lime", "fig", "pear", "olive", "onion", "bean", "corn",
    "rice", "wheat", "bread", "honey", "sugar", "salt", "pepper", "tea",
)  # fmt: skip
DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")
APP = "/app"

HELDOUT_WORDS = 5  # words per family that only held-out instructions name
VALIDATION_WORDS = 3  # words per family that only validation instructions name


def split_words(index: int, split: str) -> tuple[str, ...]:
    """The words an instruction of the ``index``-th family may name in ``split``. Each family sets aside
    its own block of ``HELDOUT_WORDS + VALIDATION_WORDS`` words (the blocks rotate through WORDS), so no
    held-out or validation instruction of a family, nor an oracle command built from its words, is ever
    a training one, while each word is still named by training instructions of other families."""
    size = HELDOUT_WORDS + VALIDATION_WORDS
    start = index * size % len(WORDS)
    block = [WORDS[(start + i) % len(WORDS)] for i in range(size)]
    if split == "heldout":
        return tuple(block[:HELDOUT_WORDS])
    if split == "validation":
        return tuple(block[HELDOUT_WORDS:])
    return tuple(w for w in WORDS if w not in block)


@dataclass
class Instance:
    """One generated task, before it is written to a task directory."""

    family: str
    key: tuple[object, ...]  # the parameters that make this instance distinct from any other
    difficulty: str
    instruction: str
    files: dict[str, str]  # name under /app -> content
    demo_steps: list[str]  # one shell command per agent turn, ending with "submit"
    solve_sh: str
    test_sh: str
    test_files: dict[str, str] = field(default_factory=dict)  # more files under tests/
    setup_sh: str = ""  # run once at build time (RUN), then removed; for state files cannot carry


class Family:
    """A task family: a fixed instruction template, fixed demo command patterns, a generator."""

    name: str = ""
    category: str = ""
    instruction_template: str = ""
    demo_templates: tuple[str, ...] = ()
    vocabulary: tuple[str, ...] = ()  # words beyond WORDS that its tasks use (for the tokenizer corpus)
    # instructions of the validation and held-out splits, for a family whose instruction names no word
    # (so that no split repeats another's instruction); its tasks and oracle stay those of the family
    split_templates: dict[str, str] = {}
    keep_agent_processes = False  # [verifier]: its tests check processes the agent left running

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        raise NotImplementedError

    def _instance(
        self,
        key: tuple[object, ...],
        difficulty: str,
        files: dict[str, str],
        test_sh: str,
        solve: str,
        **fields: str,
    ) -> Instance:
        """Fill the templates with ``fields``; ``solve`` is the oracle's shell line (templated too)."""
        return Instance(
            family=self.name,
            key=(self.name, *key),
            difficulty=difficulty,
            instruction=self.instruction_template.format(**fields),
            files=files,
            demo_steps=[t.format(**fields) for t in self.demo_templates],
            solve_sh=f"#!/bin/bash\nset -e\ncd {APP}\n{solve.format(**fields)}\n",
            test_sh=test_sh,
        )


def extra_files(difficulty: str) -> int:
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}, got {difficulty!r}")
    return DIFFICULTIES.index(difficulty)


def word_lines(
    rng: random.Random, n_lines: int, words_per_line: int = 1, exclude: tuple[str, ...] = ()
) -> list[str]:
    pool = [w for w in WORDS if w not in exclude]
    return [" ".join(rng.choice(pool) for _ in range(words_per_line)) for _ in range(n_lines)]


def text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def make_test_sh(family: str, checks: list[tuple[str, str, str]], expected: str) -> str:
    """A pure-bash test.sh. ``checks``: (exists metric, correct metric, file under /app).

    The file is correct when its content equals ``expected`` after trimming surrounding whitespace.
    """
    lines = [
        "#!/bin/bash",
        f"# albatross builtin task: {family}",
        "mkdir -p /logs/verifier",
        f"cd {APP} || exit 1",
        'trim() { local s; s=$(cat -- "$1"); s="${s#"${s%%[![:space:]]*}"}"; '
        'printf \'%s\' "${s%"${s##*[![:space:]]}"}"; }',
        "expected=$(cat <<'ALBATROSS_EOF'",
        expected.strip(),
        "ALBATROSS_EOF",
        ")",
    ]
    fields = []
    for exists, correct, name in checks:
        lines += [
            f"{exists}=0; {correct}=0",
            f"if [ -f {name} ]; then {exists}=1; "
            f'if [ "$(trim {name})" = "$expected" ]; then {correct}=1; fi; fi',
        ]
        fields += [f'\\"{exists}\\": ${exists}', f'\\"{correct}\\": ${correct}']
    lines.append(f'echo "{{{", ".join(fields)}}}" > /logs/verifier/reward.json')
    return "\n".join(lines) + "\n"


class CountLines(Family):
    """Single step. /app holds {a}.txt {b}.txt {c}.txt with distinct line counts in 1..9."""

    name = "count_lines"
    category = "text-processing"
    instruction_template = "Count the lines in {a}.txt and write the number to answer.txt."
    demo_templates = ("wc -l < {a}.txt > answer.txt", "submit")
    ext = "txt"  # the input files' extension

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        n_files = 3 + extra_files(difficulty)
        names = rng.sample(WORDS, n_files)
        counts = rng.sample(range(1, 10), n_files)
        files = {f"{n}.{self.ext}": text(word_lines(rng, c)) for n, c in zip(names, counts, strict=True)}
        test = make_test_sh(self.name, [("answer_exists", "answer_correct", "answer.txt")], str(counts[0]))
        key = (tuple(names), tuple(counts))
        return self._instance(key, difficulty, files, test, self.demo_templates[0], a=names[0])


class GrepWord(Family):
    """Single step. /app holds {a}.log and {b}.log (4-8 lines of 3 words); {w} is in 1-3 lines of {a}.log."""

    name = "grep_word"
    category = "text-processing"
    instruction_template = "Write the lines of {a}.log that contain {w} to out.txt."
    demo_templates = ("grep {w} {a}.log > out.txt", "submit")
    ext = "log"  # the input files' extension

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        words = rng.sample(WORDS, 3 + extra_files(difficulty))
        w, names = words[0], words[1:]
        logs = [self._log(rng, w, hits=rng.randint(1, 3)) for _ in names]
        files = {f"{n}.{self.ext}": text(lines) for n, lines in zip(names, logs, strict=True)}
        expected = text([line for line in logs[0] if w in line.split()])
        test = make_test_sh(self.name, [("out_exists", "out_correct", "out.txt")], expected)
        key = (w, tuple(names), tuple(files[f"{n}.{self.ext}"] for n in names))
        return self._instance(key, difficulty, files, test, self.demo_templates[0], a=names[0], w=w)

    @staticmethod
    def _log(rng: random.Random, w: str, hits: int) -> list[str]:
        lines = word_lines(rng, rng.randint(4, 8), 3, exclude=(w,))
        for i in rng.sample(range(len(lines)), hits):
            words = lines[i].split()
            words[rng.randrange(3)] = w
            lines[i] = " ".join(words)
        return lines


class FollowPointer(Family):
    """Multi-step. /app holds {a}.txt whose content is "{b}.txt", {b}.txt and two other files."""

    name = "follow_pointer"
    category = "file-operations"
    instruction_template = "The file {a}.txt names another file. Copy that file to result.txt."
    demo_templates = ("cat {a}.txt", "cp {b}.txt result.txt", "submit")
    solve_template = 'cp "$(cat {a}.txt)" result.txt'  # the oracle reads the pointer itself

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        names = rng.sample(WORDS, 4 + extra_files(difficulty))
        a, b, others = names[0], names[1], names[2:]
        contents = self._distinct_contents(rng, 1 + len(others))
        files = {f"{a}.txt": f"{b}.txt\n", f"{b}.txt": contents[0]}
        files.update({f"{n}.txt": c for n, c in zip(others, contents[1:], strict=True)})
        test = make_test_sh(self.name, [("result_exists", "result_correct", "result.txt")], contents[0])
        key = (a, b, tuple(others), tuple(contents))
        return self._instance(key, difficulty, files, test, self.solve_template, a=a, b=b)

    @staticmethod
    def _distinct_contents(rng: random.Random, n: int) -> list[str]:
        contents: list[str] = []
        while len(contents) < n:
            candidate = text(word_lines(rng, rng.randint(1, 3), 3))
            if candidate not in contents:
                contents.append(candidate)
        return contents


FAMILIES: dict[str, Family] = {f.name: f for f in (CountLines(), GrepWord(), FollowPointer())}
