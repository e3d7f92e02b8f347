"""A non-editable install carries everything an offline run needs, the toy preset's models included."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_then_offline_solve_outside_the_source_tree(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # The new environment sees this one's packages (the patched llama.cpp, numpy, the build backend of the
    # dev extra), whether this one is a venv or the base interpreter; its own site-packages come first.
    outer = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    Path(inner, "outer-environment.pth").write_text("".join(f"{path}\n" for path in sorted(outer)))
    source = tmp_path / "source"  # a copy: setuptools builds in the tree it installs from
    for name in ("kvrescue_local", "models"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # pip and the build backend (setuptools, from the dev extra) of this environment, no network
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-build-isolation", "--quiet", str(source)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": ""}
    problem = "a=7 b=4 c=5 d=9 e=6 f=2 g=8 h=3\nCompute 3 terms: a+d-c."
    solved = subprocess.run([str(python), "-m", "kvrescue_local", "solve", problem, "--mode", "full", "-n", "1",
                             "--temp", "0"], cwd=workdir, capture_output=True, text=True, env=env, timeout=600)
    assert solved.returncode == 0, solved.stderr[-3000:]
    assert "answer: 11 " in solved.stdout
    where = subprocess.run([str(python), "-c", "import kvrescue_local.paths as p; print(p.SHIPPED_MODELS)"],
                           cwd=workdir, capture_output=True, text=True, env=env)
    assert where.stdout.startswith(str(env_dir)), where.stdout
