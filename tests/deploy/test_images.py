"""The Dockerfiles: multi-stage, unprivileged, health-checked, torch pinned as pyproject pins it,
and a build context that holds what they copy and nothing heavy (the venv, the models)."""

from __future__ import annotations

import os
import re
import tomllib

import pytest

from tests.deploy.files import ROOT

DOCKERFILES = ("deploy/Dockerfile.cpu", "deploy/Dockerfile.cuda")


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    with open(os.path.join(ROOT, dockerfile)) as f:
        lines = [line.rstrip() for line in f if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "") for line in joined.splitlines() if line.strip()]


def stages(dockerfile: str) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions(dockerfile):
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def build_args(dockerfile: str) -> dict[str, str]:
    return dict(arg.split("=", 1) for name, arg in instructions(dockerfile) if name == "ARG" and "=" in arg)


def pyproject_torch_pin() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    (pin,) = [dep for dep in dependencies if dep.replace(" ", "").startswith("torch==")]
    return pin.split("==", 1)[1].strip()


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_runtime_stage_is_unprivileged_and_health_checked(dockerfile: str) -> None:
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "the image is built in one stage"
    runtime = all_stages[-1]
    users = [args for name, args in runtime if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime stage runs as root"
    healthchecks = [args for name, args in runtime if name == "HEALTHCHECK"]
    assert healthchecks and "healthcheck.py" in healthchecks[-1]
    assert any(name == "COPY" and "--from=" in args for name, args in runtime), "the runtime stage does not copy the build stage's output"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_torch_is_pinned_as_pyproject_pins_it(dockerfile: str) -> None:
    args = build_args(dockerfile)
    assert args["TORCH_VERSION"] == pyproject_torch_pin()
    installs = [args for name, args in instructions(dockerfile) if name == "RUN" and "torch==${TORCH_VERSION}" in args]
    assert installs and "--index-url" in installs[0]
    if dockerfile.endswith("cpu"):
        assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    else:
        assert re.search(r"/whl/cu\d+$", args["TORCH_INDEX_URL"])
        assert all(args.split()[0].startswith("nvidia/cuda:") for args in (a for name, a in instructions(dockerfile) if name == "FROM"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_build_context_holds_what_the_dockerfile_copies(dockerfile: str) -> None:
    build = pytest.importorskip("docker.utils.build", reason="the docker SDK is not installed (test extras)")
    with open(os.path.join(ROOT, dockerfile + ".dockerignore")) as f:
        patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    context = build.exclude_paths(ROOT, patterns, dockerfile=dockerfile)
    copied = [args.split()[:-1] for name, args in instructions(dockerfile) if name == "COPY" and "--from=" not in args]
    for sources in copied:
        for source in sources:
            assert source in context or any(path.startswith(source + "/") for path in context), f"{source} is not in the build context"
    heavy = [path for path in context if path.split("/")[0] in (".venv", "models", ".git") or "__pycache__" in path]
    assert not heavy, f"the build context carries {heavy[:5]}"
