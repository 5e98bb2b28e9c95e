"""`python -m vitserve.bench.peers`: see bench/peers/cli.py."""
import sys

from vitserve.bench.peers.cli import main

sys.exit(main())
