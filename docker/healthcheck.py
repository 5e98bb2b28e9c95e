"""The images' HEALTHCHECK: exit 0 when GET /v2/health/ready answers 200, 1 otherwise.

Slim images have no curl; this needs only the standard library. The port is the server's own
(VITSERVE_PORT, default 8000); the server may listen on 0.0.0.0, so probe loopback.
"""
import os
import sys
import urllib.request

URL = f"http://127.0.0.1:{os.environ.get('VITSERVE_PORT', '8000')}/v2/health/ready"

try:
    with urllib.request.urlopen(URL, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT_S", "3"))) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as e:  # refused, 503 (HTTPError), timeout: all mean "not ready"
    print(f"not ready: {URL}: {e}", file=sys.stderr)
    sys.exit(1)
