"""The packages of the wheel: the repository keeps its layers as top-level folders (model/, export/, service/,
evaluation/), and the wheel installs each under the one import name `vitserve` (vitserve.model, vitserve.service,
...), so that installing vitserve puts a single name into site-packages and a user's own `model.py` or `service/`
neither shadows vitserve's nor is shadowed by it. Everything else is in pyproject.toml.

Folders without Python (the web page's) are packages too, so that their files go in as package data, as setuptools
asks. A folder that is absent is left out: the serving images copy only vitserve/ and service/ before the build.
"""
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
# bench/ is not among them: the benchmark runs from a checkout (vitserve/__init__.py finds it there), and the
# product never imports it (tests/test_layers.py), so a user's install carries none of its 6,000 lines
LAYERS = ("model", "export", "evaluation", "service")

package_dir = {"vitserve": "vitserve"}
packages = ["vitserve"]
for layer in LAYERS:
    if (ROOT / layer / "__init__.py").is_file():
        package_dir[f"vitserve.{layer}"] = layer
        packages += [f"vitserve.{layer}"] + [f"vitserve.{layer}.{sub}" for sub in find_namespace_packages(str(ROOT / layer), exclude=["*__pycache__*"])]

setup(
    package_dir=package_dir,
    packages=packages,
    package_data={
        # the web page at / (service/http/routes/web.py serves every file under service/web/) and gRPC's protocol
        "vitserve.service": ["web/*.html", "web/*.js", "web/*.css", "web/*.svg", "web/samples/*.png",
                             "web/samples/*.json", "web/samples/LICENSE", "grpc/generated/*.proto",
                             "grpc/generated/*.pyi", "grpc/generated/LICENSE"],
    },
)
