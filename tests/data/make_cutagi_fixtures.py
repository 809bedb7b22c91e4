#!/usr/bin/env python3
"""Build cuTAGI's main branch (commit ef69219, the first with multi-head attention and RMSNorm)
on the CPU from source, and record what it computes on small attention and RMSNorm networks
into tests/data/cutagi_fixtures.npz: the numbers tests/unit/tagi/test_attention.py checks
`dptrain.tagi.MultiheadAttention` and `dptrain.tagi.RMSNorm` against.

cuTAGI main has no release on the package index, so it is built here, from a git repository of
cuTAGI (a clone or a bare mirror; machines without network use a local one):

  CUTAGI_REPO=/path/to/cuTAGI.git PYBIND11_REPO=/path/to/pybind11.git \\
      .venv/bin/python tests/data/make_cutagi_fixtures.py tests/data/cutagi_fixtures.npz

  CUTAGI_REPO   cuTAGI's git repository (default https://github.com/lhnguyen102/cuTAGI.git)
  PYBIND11_REPO pybind11's git repository (default https://github.com/pybind/pybind11.git):
                cuTAGI vendors pybind11 as a git submodule, which a plain export lacks; the
                submodule's pinned commit is checked out from here
  CUTAGI_BUILD  a folder to build in and keep (default: a temporary folder, removed after)

The build: `git archive` of the commit into the build folder, pybind11's pinned commit into
extern/pybind11, an empty extern/googletest (cuTAGI's CMakeLists adds that folder; its C++
tests are not built: BUILD_TESTING=OFF), then CMake with CMAKE_CUDA_COMPILER=OFF, so the CPU
library is built even where nvcc is installed, and only the Python extension `cutagi`. It takes
several CPU minutes. The recording then runs in a child Python with the built `cutagi` and
cuTAGI's own `pytagi` (from the same commit) first on its path.

The keys of the .npz are documented at `record` below.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

COMMIT = "ef69219"
CUTAGI_URL = "https://github.com/lhnguyen102/cuTAGI.git"
PYBIND11_URL = "https://github.com/pybind/pybind11.git"


def _git_dir(source: str, into: Path) -> str:
    """A local git directory holding `source`'s history (cloned bare if `source` is a URL)."""
    if Path(source).exists():
        return source
    subprocess.run(["git", "clone", "--bare", "--quiet", source, str(into)], check=True)
    return str(into)


def _export(git_dir: str, commit: str, dest: Path) -> None:
    """The tree of `commit` written under `dest` (no .git, no submodules)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", git_dir, "archive", "--format=tar", commit],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _submodule_commit(git_dir: str, commit: str, path: str) -> str:
    line = subprocess.run(["git", "-C", git_dir, "ls-tree", commit, path], check=True,
                          capture_output=True, text=True).stdout.split()
    if len(line) < 3 or line[1] != "commit":
        raise SystemExit(f"{path} is not a submodule at {commit} of {git_dir}")
    return line[2]


def build(root: Path) -> Path:
    """Export and build cuTAGI's CPU Python extension under `root`; return the source folder
    (which holds pytagi/ and, after the build, the `cutagi` extension under build/)."""
    src = root / "cuTAGI"
    cutagi_git = _git_dir(os.environ.get("CUTAGI_REPO", CUTAGI_URL), root / "cutagi.git")
    _export(cutagi_git, COMMIT, src)
    pybind_git = _git_dir(os.environ.get("PYBIND11_REPO", PYBIND11_URL), root / "pybind11.git")
    _export(pybind_git, _submodule_commit(cutagi_git, COMMIT, "extern/pybind11"),
            src / "extern" / "pybind11")
    gtest = src / "extern" / "googletest"
    gtest.mkdir(parents=True, exist_ok=True)
    (gtest / "CMakeLists.txt").write_text("# not built: BUILD_TESTING=OFF\n")
    build_dir = src / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_TESTING=OFF",
                    "-DCMAKE_CUDA_COMPILER=OFF",
                    f"-DPYTHON_EXECUTABLE={sys.executable}",
                    f"-DPython_EXECUTABLE={sys.executable}",
                    f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build_dir}"], check=True)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "cutagi", "-j", jobs],
                   check=True)
    return src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="tests/data/cutagi_fixtures.npz")
    parser.add_argument("--build-only", action="store_true",
                        help="build cuTAGI and stop (with CUTAGI_BUILD, to keep the build)")
    args = parser.parse_args()
    keep = os.environ.get("CUTAGI_BUILD")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="cutagi-"))
    try:
        src = root / "cuTAGI"
        if not any((src / "build").glob("cutagi*.so")):
            src = build(root)
        if args.build_only:
            return
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(src / "build"), str(src)])
        subprocess.run([sys.executable, str(Path(__file__).with_name("_cutagi_record.py")),
                        str(Path(args.out).resolve())], check=True, env=env,
                       cwd=str(root))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
