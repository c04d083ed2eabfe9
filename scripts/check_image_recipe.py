#!/usr/bin/env python3
"""Check a Dockerfile's pip install steps without Docker: resolve them as pip would in the image.

Reads the Dockerfile itself (its base image, ARG defaults and every `pip install` in its RUN steps), makes a venv
with the image's Python (found here through uv, python3.X on PATH or pyenv; otherwise this Python with pip's
--python-version), and replays the steps in order:
  - a step that installs from an index other than PyPI (Paddle's, PyTorch's) gets a STAND-IN wheel for each
    requirement it names: a locally built, empty wheel with the same name, the lowest version the step accepts and
    the top-level package that distribution ships (`paddle` for paddlepaddle-gpu). It stands in for the resolver
    only; nothing here runs Paddle or torch;
  - other steps before the project's run as written (e.g. pinning pip);
  - the project's own step (`pip install -e ".[...]"`) is resolved with `pip install --dry-run --report`,
    wheels only (--only-binary=:all:), from PyPI, ignoring the host's pip configuration.
It fails when the resolution would install another provider of a stood-in package (a `paddlepaddle` over
paddlepaddle-gpu: the CPU build's files over the GPU build's), a second tritonserver (nvidia-pytriton: the image
has its own), or cannot find a wheel for the image's Python (a pinned version without one).

    scripts/check_image_recipe.py                        # ./Dockerfile
    scripts/check_image_recipe.py --dockerfile Dockerfile.torch --json out.json

Exit status: 0 passes, 1 the recipe is wrong, 2 the check itself could not run (bad Dockerfile, no index).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
# The Python each base image ships (NVIDIA's Triton release compatibility matrix: the 24.x images up to 24.11 are
# Ubuntu 22.04 with Python 3.10; from 24.12 Ubuntu 24.04 with 3.12). A base not listed here fails the check: add
# its Python from NVIDIA's matrix when the Dockerfile moves.
IMAGE_PYTHON = {
    "nvcr.io/nvidia/tritonserver:24.10-py3": "3.10",
}
# Distributions that ship each top-level package: installing any of them over a stand-in replaces its files.
PROVIDERS = {
    "paddle": re.compile(r"^paddlepaddle([-_.].+)?$"),
    "torch": re.compile(r"^torch$"),
}
# Packages the image brings that no pip step may add a second copy of.
IMAGE_BRINGS = {"nvidia-pytriton": "a second tritonserver (the image has /opt/tritonserver)"}
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "ConnectionError", "Could not fetch URL",
                  "Temporary failure in name resolution", "Network is unreachable", "ReadTimeoutError")


class CheckCannotRun(Exception):
    """The check itself could not run (exit 2), as opposed to a recipe that is wrong (exit 1)."""


@dataclass
class PipStep:
    args: list[str]  # what follows `pip install`, ARGs expanded
    line: str  # as written, for messages

    @property
    def index(self) -> str | None:
        for i, a in enumerate(self.args):
            if a in ("-i", "--index-url", "--extra-index-url") and i + 1 < len(self.args):
                return self.args[i + 1]
            for flag in ("--index-url=", "--extra-index-url="):
                if a.startswith(flag):
                    return a[len(flag):]
        return None

    @property
    def installs_project(self) -> bool:
        return any(a == "-e" or a == "." or a.startswith((".[", "./")) for a in self.args)

    @property
    def requirements(self) -> list[str]:
        skip_next = {"-i", "--index-url", "--extra-index-url", "-c", "-r", "--constraint", "--requirement"}
        out, skip = [], False
        for a in self.args:
            if skip:
                skip = False
            elif a in skip_next:
                skip = True
            elif not a.startswith("-"):
                out.append(a)
        return out


@dataclass
class Recipe:
    base_image: str
    steps: list[PipStep] = field(default_factory=list)


def read_recipe(dockerfile: Path) -> Recipe:
    """The base image and the pip install commands of a Dockerfile's RUN steps, with ARG defaults expanded."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    base = ""
    steps: list[PipStep] = []

    def expand(s: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), s)

    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ARG":
            name, _, default = rest.strip().partition("=")
            if default:
                args[name] = default.strip().strip('"')
        elif word == "FROM" and not base:
            base = expand(rest.split()[0])
        elif word == "RUN":
            for words in shell_commands(expand(rest)):
                while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value prefixes
                    words.pop(0)
                if words[:4] in (["python3", "-m", "pip", "install"], ["python", "-m", "pip", "install"]):
                    steps.append(PipStep(words[4:], shlex.join(words)))
                elif words[:2] in (["pip", "install"], ["pip3", "install"]):
                    steps.append(PipStep(words[2:], shlex.join(words)))
    if not base:
        raise CheckCannotRun(f"{dockerfile}: no FROM line")
    if not any(s.installs_project for s in steps):
        raise CheckCannotRun(f"{dockerfile}: no pip install of the project (pip install -e \".[...]\")")
    return Recipe(base, steps)


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, split at && || ; | ( ) outside quotes, each as its words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def image_python(base_image: str) -> str:
    try:
        return IMAGE_PYTHON[base_image]
    except KeyError:
        raise CheckCannotRun(f"base image {base_image}: its Python is not recorded in IMAGE_PYTHON "
                             f"({', '.join(IMAGE_PYTHON)}); add it from NVIDIA's frameworks support matrix") from None


def find_interpreter(version: str) -> str | None:
    """A Python `version` (X.Y) interpreter on the host: uv's, python3.X on PATH, or pyenv's; None: none here."""
    candidates = []
    uv = shutil.which("uv")
    if uv:
        found = subprocess.run([uv, "python", "find", version], capture_output=True, text=True)
        candidates += found.stdout.split()[:1] if found.returncode == 0 else []
    candidates += [p for p in [shutil.which(f"python{version}")] if p]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += [str(p) for p in sorted((pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
                                          reverse=True)]
    for candidate in candidates:  # a pyenv shim on PATH may name a version it cannot run: ask each one
        probe = subprocess.run([candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def stand_in_version(requirement: str) -> tuple[str, str]:
    """(name, the lowest version the requirement accepts that a release would carry)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    req = Requirement(requirement)
    candidates = []
    for spec in req.specifier:
        v = Version(spec.version.replace(".*", ""))
        candidates += [v, Version(f"{v.base_version}.0"), Version(f"{v.base_version}.1")]
    for v in sorted(set(candidates)) or [Version("1.0.0")]:
        if req.specifier.contains(v, prereleases=True):
            release = ".".join(str(n) for n in (*v.release, 0, 0)[:max(3, len(v.release))])
            return req.name, release if Version(release) == v else str(v)
    raise CheckCannotRun(f"no stand-in version satisfies {requirement}")


def top_level_package(dist_name: str) -> str:
    for module, pattern in PROVIDERS.items():
        if pattern.match(dist_name.lower()):
            return module
    return re.sub(r"[-.]", "_", dist_name.lower())


def build_stand_in(name: str, version: str, into: Path) -> Path:
    """An empty py3-none-any wheel named `name` shipping its top-level package, labelled as a stand-in."""
    module = top_level_package(name)
    dist = re.sub(r"[-.]", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": (f'"""STAND-IN for {name} {version}, built by scripts/check_image_recipe.py for '
                                  f'pip\'s resolver. Not {name}: it holds no code."""\n__version__ = "{version}"\n'),
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                             f"Summary: STAND-IN for the resolver (scripts/check_image_recipe.py), not {name}\n"),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: check_image_recipe\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(content.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    wheel = into / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, content in files.items():
            z.writestr(path, content)
    return wheel


def pip_flags() -> list[str]:
    """PyPI only, the host's pip configuration ignored (the image has none of it); its CA bundle kept."""
    flags = ["--isolated", "--disable-pip-version-check", "--timeout", "60", "--index-url", PYPI]
    if os.environ.get("PIP_CERT"):
        flags += ["--cert", os.environ["PIP_CERT"]]
    return flags


def run_pip(python: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([python, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode and any(e in proc.stdout + proc.stderr for e in NETWORK_ERRORS):
        raise CheckCannotRun(f"cannot reach {PYPI} (pip {' '.join(args[:2])}): the check resolves against it\n"
                             + (proc.stderr or proc.stdout)[-1500:])
    return proc


def make_venv(recipe: Recipe, want: str, interpreter: str | None, root: Path, env_dir: Path) -> tuple[str, str]:
    """A venv of `interpreter` (None: this Python) holding the pip the Dockerfile pins; (its python, its version)."""
    subprocess.run([interpreter or sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = str(env_dir / "bin" / "python")
    # Its pip is installed by this one (pip --python) rather than by ensurepip, which costs seconds: the pip the
    # Dockerfile pins, else the newest (the image has a pip of its own).
    proc = run_pip(sys.executable, ["--python", py, "install", *pip_flags(), "-q", pip_pin(recipe)], root)
    if proc.returncode:
        raise CheckCannotRun(f"installing pip into the {want} venv: {proc.stderr[-800:]}")
    got = subprocess.run([py, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if interpreter and not got.startswith(want + "."):
        raise CheckCannotRun(f"{interpreter} is Python {got}, not the image's {want}")
    return py, got


def pip_pin(recipe: Recipe) -> str:
    pins = [r for s in recipe.steps if not s.index and not s.installs_project
            for r in s.requirements if re.match(r"pip\b", r)]
    return (pins or ["pip"])[-1]


def replay_steps(recipe: Recipe, py: str, root: Path, tmp_path: Path, result: dict) -> dict[str, str] | None:
    """The steps before the project's: stand-ins for off-PyPI ones, the others run. Returns {top-level package:
    the stand-in providing it}; None when a step fails (the problem is in result)."""
    stood_in: dict[str, str] = {}
    for step in recipe.steps:
        if step.installs_project:
            break
        index = step.index
        if index and index.rstrip("/") != PYPI:
            for requirement in step.requirements:
                name, version = stand_in_version(requirement)
                wheel = build_stand_in(name, version, tmp_path)
                proc = run_pip(py, ["install", "--isolated", "--no-index", "--no-deps", "-q", str(wheel)], root)
                if proc.returncode:
                    raise CheckCannotRun(f"installing the stand-in {wheel.name}: {proc.stderr[-800:]}")
                stood_in[top_level_package(name)] = name
                result["stand_ins"].append({"name": name, "version": version, "for": step.line, "index": index})
            continue
        if step.args != [pip_pin(recipe)]:  # that one is done: the venv's pip is the pin
            proc = run_pip(py, ["install", *pip_flags(), "-q", *step.args], root)
            if proc.returncode:
                result["problems"].append(f"step `{step.line}` fails: {proc.stderr.strip()[-800:]}")
                return None
        result["steps_run"].append(step.line)
    return stood_in


def judge(items: list[dict], stood_in: dict[str, str], project: PipStep, want: str, result: dict) -> None:
    """What the project's step would install, and what is wrong with it, into result."""
    for item in items:
        meta = item["metadata"]
        name, version = meta["name"], meta["version"]
        result["would_install"].append(f"{name}=={version}")
        module = top_level_package(name)
        if module in stood_in:
            result["problems"].append(
                f"`{project.line}` would install {name} {version} over {stood_in[module]}, which the image brings: "
                f"both ship the `{module}` package, so the image would run {name}'s files")
        if name.lower() in IMAGE_BRINGS:
            result["problems"].append(f"`{project.line}` would install {name}: {IMAGE_BRINGS[name.lower()]}")
        url = item.get("download_info", {}).get("url", "")
        if not item.get("is_direct") and not url.endswith(".whl"):
            result["problems"].append(f"{name} {version} has no wheel for Python {want} ({url})")


def check(dockerfile: Path, root: Path, python: str | None = None, this_python: bool = False) -> dict:
    """Replay the recipe's pip steps; returns what it found, with "problems" empty when the recipe passes.
    this_python: resolve with this Python and pip's --python-version even where the image's Python is here."""
    recipe = read_recipe(dockerfile)
    want = image_python(recipe.base_image)
    interpreter = None if this_python else python or find_interpreter(want)
    result = {"dockerfile": str(dockerfile), "base_image": recipe.base_image, "image_python": want,
              "stand_ins": [], "steps_run": [], "would_install": [], "problems": []}
    # without the image's Python here: this Python resolving for it (pip's --python-version, wheels only)
    target_version = [] if interpreter else ["--python-version", want]
    with tempfile.TemporaryDirectory(prefix="image-recipe-") as tmp:
        tmp_path = Path(tmp)
        py, got = make_venv(recipe, want, interpreter, root, tmp_path / "venv")
        result["resolver_python"] = got if interpreter else f"{got}, resolving with --python-version {want}"
        stood_in = replay_steps(recipe, py, root, tmp_path, result)
        if stood_in is None:
            return result
        project = [s for s in recipe.steps if s.installs_project][0]
        report = tmp_path / "report.json"
        proc = run_pip(py, ["install", *pip_flags(), "--dry-run", "--quiet", "--report", str(report),
                            "--only-binary=:all:", *target_version, *project.args], root)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip()[-1500:]
            result["problems"].append(f"`{project.line}` does not resolve to wheels for Python {want} "
                                      f"(a pinned version without a wheel for it?):\n{tail}")
            return result
        judge(json.loads(report.read_text())["install"], stood_in, project, want, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dockerfile", default="Dockerfile", help="relative to --root (default: Dockerfile)")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose files the Dockerfile copies")
    p.add_argument("--python", help="the interpreter to resolve with (default: found for the image's Python)")
    p.add_argument("--this-python", action="store_true",
                   help="resolve with this Python and pip's --python-version (what runs where the image's Python "
                        "is not installed)")
    p.add_argument("--json", type=Path, help="write the findings here")
    a = p.parse_args(argv)
    root = a.root.resolve()
    try:
        result = check(root / a.dockerfile, root, a.python, a.this_python)
    except CheckCannotRun as e:
        print(f"check_image_recipe: cannot check: {e}", file=sys.stderr)
        return 2
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(f"{a.dockerfile}: base {result['base_image']}, Python {result['image_python']} "
          f"(resolved with {result['resolver_python']})")
    for s in result["stand_ins"]:
        print(f"  stand-in {s['name']} {s['version']} for `{s['for']}`")
    for line in result["steps_run"]:
        print(f"  ran `{line}`")
    print(f"  would install: {' '.join(result['would_install']) or 'nothing'}")
    for problem in result["problems"]:
        print(f"FAIL: {problem}", file=sys.stderr)
    if not result["problems"]:
        print("OK: no other provider of a stood-in package, every requirement has a wheel for the image's Python")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
