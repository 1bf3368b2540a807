"""`albatross report`: one self-contained HTML page with every figure, read back and in a browser."""

import base64
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from albatross.eval.report import write_report
from albatross.records import Reward, Sample, Trajectory, append_jsonl

FIGURES = {"fig-pareto", "fig-categories", "fig-training-0"}
CATEGORIES = {"t0": "text-processing", "t1": "text-processing", "t2": "file-operations"}


def _traj(task: str, trial: int, ok: bool, turns: int, version: int = 0) -> dict:
    sample = Sample([], [], [], [])
    sample.extend([1] * 12, model=False)
    for _ in range(turns):
        sample.extend([2] * 5, model=True, logprobs=[-0.1] * 5, versions=[version] * 5)
        sample.extend([3] * 4, model=False)
    t = Trajectory(task, f"g-{task}", trial, samples=[sample], status="ok", completion_tokens=5 * turns,
                   reward=Reward(success=ok, score=1.0 if ok else 0.1), wall_seconds=0.5 * turns)
    return t.to_dict()


def _eval_dir(root: Path, label: str, p_solve: float, turns: int, seed: int) -> Path:
    """An eval directory as `albatross eval` writes it: eval.json and every try in attempts.jsonl."""
    out = root / label
    out.mkdir()
    rng = random.Random(seed)
    (out / "eval.json").write_text(json.dumps({"label": label, "tasks": list(CATEGORIES), "trials": 3,
                                               "harness": {"max_turns": turns}}))
    for task, cat in CATEGORIES.items():
        for trial in range(3):
            append_jsonl(out / "attempts.jsonl", {**_traj(task, trial, rng.random() < p_solve, turns),
                                                  "category": cat, "model": label})
    append_jsonl(out / "attempts.jsonl", {**_traj("t0", 0, False, 0), "status": "infra_error"})
    return out


def _run_dir(root: Path) -> Path:
    """A demo / training run directory: base and trained evals, metrics and trajectories of training."""
    out = root / "run"
    for name, p in (("base", 0.3), ("trained", 0.6)):
        rng = random.Random(name)
        for task, cat in CATEGORIES.items():
            for trial in range(3):
                append_jsonl(out / f"eval_{name}.jsonl",
                             {**_traj(task, trial, rng.random() < p, 2), "category": cat})
    for step in range(1, 7):
        append_jsonl(out / "run" / "metrics.jsonl", {
            "step": step, "version": step, "pass_rate": 0.3 + 0.05 * step, "groups": 4 * step,
            "zero_signal_groups": step, "infra_error_attempts": step // 3, "entropy": 0.3 - 0.02 * step,
            "mismatch_kl": 0.001 * step, "staleness_mean": 0.5 * step, "staleness_max": step})
        append_jsonl(out / "run" / "trajectories.jsonl", _traj("t0", 0, step % 2 == 0, 2, version=step))
    (out / "summary.json").write_text(json.dumps({"base_pass_at_1": 0.3, "seed": 0}))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("report-inputs")
    return [_eval_dir(root, "model-a", 0.8, 4, 1), _eval_dir(root, "model-b", 0.4, 1, 2), _run_dir(root)]


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.imgs.append(attrs)
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v and not v.startswith("data:")]


def _check_page(path: Path) -> str:
    from PIL import Image

    text = path.read_text()
    parser = _Images()
    parser.feed(text)
    assert {img.get("id") for img in parser.imgs} == FIGURES
    assert parser.links == [], "the page must be self-contained"
    for img in parser.imgs:
        assert img["src"].startswith("data:image/png;base64,"), img.get("id")
        png = base64.b64decode(img["src"].split(",", 1)[1], validate=True)
        with Image.open(io.BytesIO(png)) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 150, img["id"]
    return text


def test_report_has_every_figure_and_no_broken_image(tmp_path, inputs):
    out = write_report(inputs, tmp_path / "sub" / "report.html")
    text = _check_page(out)
    for label in ("model-a", "model-b", "run base", "run trained"):
        assert label in text
    assert "text-processing" in text and "file-operations" in text
    assert '"max_turns": 4' in text and "base_pass_at_1" in text  # the configuration of each result
    assert "Pareto frontier" in text


def test_report_cli_prices_and_errors(tmp_path, inputs):
    prices = tmp_path / "prices.toml"
    prices.write_text('["model-a"]\ninput = 3\ncached_input = 0.3\noutput = 15\n'
                      '["*"]\ninput = 0.1\noutput = 0.4\n')
    out = tmp_path / "report.html"
    cmd = [sys.executable, "-m", "albatross.cli", "report", *map(str, inputs), "--out", str(out),
           "--prices", str(prices)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = _check_page(out)
    # model-a, per attempt: 4 requests; fresh input 12 + 3 x 4 observation tokens, cached input
    # 17 + 26 + 35 (the previous request and its answer), output 4 x 5 tokens
    assert _cost_cell(text, "model-a") == f"${(24 * 3 + 78 * 0.3 + 20 * 15) / 1e6:.6f}"
    # run base is priced by the "*" entry (cached input at the input price): 2 requests
    assert _cost_cell(text, "run base") == f"${(16 * 0.1 + 17 * 0.1 + 10 * 0.4) / 1e6:.6f}"
    for args, message in (([str(tmp_path / "missing")], "no such directory"),
                          ([str(tmp_path)], "no attempts.jsonl, eval_*.jsonl or metrics.jsonl found")):
        r = subprocess.run([sys.executable, "-m", "albatross.cli", "report", *args, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _cost_cell(html_text: str, label: str) -> str:
    row = re.search(f"<tr><td>{label}</td>(.*?)</tr>", html_text).group(1)
    return re.findall("<td>(.*?)</td>", row)[4]


# Counts the images the browser could not decode; written into the DOM for --dump-dom to read.
_PROBE = ("<script>window.addEventListener('load',()=>{const b=[...document.images].filter("
          "i=>!i.complete||i.naturalWidth===0).length;document.title='broken='+b+' of '+"
          "document.images.length;});</script>")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium absent (apt-get install -y chromium) for the browser check")
def test_report_reads_well_in_chromium(tmp_path, inputs):
    from PIL import Image

    page = write_report(inputs, tmp_path / "report.html")
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    dom = _chromium(tmp_path, "--dump-dom", "--virtual-time-budget=5000", probe.as_uri())
    assert f"<title>broken=0 of {len(FIGURES)}</title>" in dom
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000", page.as_uri())
    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
        gray = im.convert("L").resize((120, 200))
        dark = sum(gray.histogram()[:200]) / (120 * 200)
    assert dark > 0.02, "the screenshot is (almost) blank"
    if os.environ.get("ALBATROSS_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["ALBATROSS_KEEP_SCREENSHOT"])


def _chromium(tmp_path: Path, *args: str) -> str:
    profile = tempfile.mkdtemp(dir=tmp_path)
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_training_run_panels_all_have_data(inputs):
    from albatross.eval.report import _training_panels, load_dir

    results, runs = load_dir(inputs[2])
    assert [r.label for r in results] == ["run base", "run trained"] and len(runs) == 1
    panels = _training_panels(runs[0])
    assert len(panels) == 8
    for title, _xlabel, lines in panels:
        assert any(len(xs) == len(ys) > 0 for _name, xs, ys in lines), title
    share = dict((t, lines) for t, _x, lines in panels)["zero-signal group share"][0]
    assert share[2] == [0.25] * 6  # one of the four groups finished in each step had no signal
