"""The packages of the wheel: `vitserve` and its layers, each a link in vitserve/ to a top-level folder of the
repository (vitserve/service -> ../service: vitserve/__init__.py), which setuptools follows, so the wheel holds the
files themselves and installing vitserve puts a single name into site-packages; a user's own `model.py` or
`service/` neither shadows vitserve's nor is shadowed by it. Everything else is in pyproject.toml.

Folders without Python (the web page's) are packages too, so that their files go in as package data, as setuptools
asks. A layer whose folder is absent (a dangling link) is left out: the serving images copy only vitserve/ and
service/ before the build. bench/ is never packed: the benchmark runs from a checkout, and the product never
imports it (tests/test_layers.py), so a user's install carries none of its lines.
"""
from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["vitserve", "vitserve.*"],
                                     exclude=["vitserve.bench", "vitserve.bench.*", "*__pycache__*"]),
    package_data={
        # the web page at / (service/http/routes/web.py serves every file under service/web/) and gRPC's protocol
        "vitserve.service": ["web/*.html", "web/*.js", "web/*.css", "web/*.svg", "web/samples/*.png",
                             "web/samples/*.json", "web/samples/LICENSE", "grpc/generated/*.proto",
                             "grpc/generated/*.pyi", "grpc/generated/LICENSE"],
    },
)
