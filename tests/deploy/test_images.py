"""The Dockerfiles against the build context a clean clone gives them, without a Docker engine.

docker/test.sh builds the images for real, but only as root; this catches the commonest way a build breaks in
seconds and anywhere: a file a `COPY` names that .dockerignore (an allow-list) keeps out of the context, as
happened to setup.py when the wheel gained it. The Dockerfiles are read with dockerfile-parse (ARG defaults
substituted as Docker does) and the context is computed by docker-py's own .dockerignore matcher.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser
from dockerfile_parse.util import WordSplitter

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
# Docker's trick for an optional file: a one-character class makes the source a glob, which may match nothing
OPTIONAL_GLOBS = {"README.m[d]"}


def tracked_files() -> set[str]:
    """What a clean clone holds: the build context of CI and of a user who just cloned."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return {name for name in listed.decode().split("\0") if name}


def build_context() -> set[str]:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return set(exclude_paths(str(REPO), patterns)) & tracked_files()


def copy_sources(dockerfile: Path) -> list[str]:
    """Every path a COPY or ADD takes from the build context (not from another stage), ARGs substituted."""
    with dockerfile.open("rb") as handle:
        parser = DockerfileParser(fileobj=handle)
        instructions = list(zip(parser.structure, parser.context_structure))
    sources = []
    for instruction, context in instructions:
        if instruction["instruction"] not in ("COPY", "ADD"):
            continue
        words = list(WordSplitter(instruction["value"], args=context.args).split())
        if any(word.startswith("--from=") for word in words):
            continue
        sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


@pytest.fixture(scope="module")
def context() -> set[str]:
    return build_context()


def test_every_dockerfile_copies_something():
    assert {path.name for path in DOCKERFILES} >= {"Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.train"}
    for dockerfile in DOCKERFILES:
        assert copy_sources(dockerfile), dockerfile


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_copied_path_is_in_a_clean_clones_build_context(dockerfile, context):
    missing = []
    for source in copy_sources(dockerfile):
        if source in OPTIONAL_GLOBS:
            continue
        prefix = source.rstrip("/")
        if prefix not in context and not any(path.startswith(prefix + "/") for path in context):
            missing.append(source)
    assert not missing, f"{dockerfile.name} copies {missing}, which .dockerignore or git leaves out of the context"


def test_the_context_keeps_out_what_the_images_must_not_hold(context):
    # the tests, training runs and the benchmark are not the product; a checkpoint in the context slows every build
    assert not [path for path in context if path.split("/")[0] in ("tests", "training", "bench", ".git")]
    assert "setup.py" in context and "models/vit-fmnist/model.onnx" in context
