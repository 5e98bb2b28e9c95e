"""`vitserve bench --mode peers` (`python -m vitserve.bench.peers`, `make bench-peers`): vitserve side by side with the
servers a user would pick instead, Triton Inference Server (through nvidia-pytriton) and LitServe.

Each peer runs in its own virtual environment (build/peers/venv-*, made by `venvs` with pinned versions) and does
the same per-image work as vitserve (`image_classifier`); the load is Debian's `wrk` (`wrk`) with the same bodies
(`bodies`). Nothing here imports the peers' packages: `triton_server` and `litserve_server` run only in their
venvs. Modules: `config` (the defaults), `run` (the rounds), `servers` (starting and stopping each server),
`answers` (each path's answer checked against the raw session), `report` (Markdown and JSON).
"""
