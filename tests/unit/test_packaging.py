"""A pip-installed albatross carries the demo's config: `albatross demo` of an installed wheel finds it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_package_ships_the_demo_config_and_the_demo_finds_it(tmp_path):
    """setup.py's build_py (what a wheel and `pip install .` package) copies configs/demo.toml into the package."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(site)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (site / "albatross" / "configs" / "demo.toml").read_bytes() == (ROOT / "configs" / "demo.toml").read_bytes()
    # the installed package alone (no checkout beside it): the demo's config is the packaged one
    probe = ("from albatross.pipeline.demo import demo_config, demo_config_path; "
             "print(demo_config_path()); print(demo_config(None, False, None, []).name)")
    r = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
                        + probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    path, name = r.stdout.split()
    assert Path(path) == site / "albatross" / "configs" / "demo.toml" and name == "demo"


def test_what_the_demo_config_uses_is_installed_by_the_plain_install():
    """README's first command is `pip install -e . && albatross demo`: every optional part the demo's config turns
    on must be a core dependency, not an extra (a LoRA demo with PEFT only in `[lora]` stops at once)."""
    import tomllib

    from albatross.config import load_config

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    cfg = load_config(ROOT / "configs" / "demo.toml")
    needs = {"peft"} if cfg.trainer.lora.on else set()
    if cfg.engine.type == "vllm":
        needs.add("vllm")
    assert needs <= names, f"the demo needs {sorted(needs - names)}, which `pip install -e .` does not install"
