"""Keys, whatever the transport: `--api-key` opens the inference and model calls, `--admin-key` the repository
API, each sent as `Authorization: Bearer KEY` (an HTTP header, or gRPC request metadata) and compared in constant
time. This is a shared secret, not identity: put TLS and OIDC in front (docs/repository.md).
"""
from __future__ import annotations

import hmac

from pydantic import SecretStr

from vitserve.service.ground.errors import Forbidden, RepositoryControlDisabled, Unauthorized
from vitserve.service.ground.settings import Settings

MAX_KEY_CHARS = 512  # a longer Authorization value is wrong, and is not compared


def check_authorization(value: str | None, key: SecretStr | None, what: str) -> None:
    """Nothing when `key` is unset or the Authorization `value` carries it; Unauthorized (401) without
    credentials, Forbidden (403) with others."""
    if key is None:
        return
    if not value:
        raise Unauthorized(f"{what} needs a key: send Authorization: Bearer KEY")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_KEY_CHARS:
        raise Unauthorized(f"{what} needs a key: send Authorization: Bearer KEY")
    if not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise Forbidden(f"the key sent does not open {what}")


def check_repository_access(settings: Settings, authorization: str | None, *, changes: bool) -> None:
    """The repository API behind the admin key. The index (`changes` False) is served in every control mode, as
    Triton serves it (tools read it to find what a server holds); load and unload only in explicit mode. Without
    an admin key the index still needs the api key when one is set: it names what the model routes serve."""
    if not changes:
        key, what = (settings.admin_key, "the repository API") if settings.admin_key else (settings.api_key,
                                                                                           "the repository index")
        check_authorization(authorization, key, what)
        return
    if settings.model_control_mode == "none":
        raise RepositoryControlDisabled("load and unload are off: start the server with --model-repository DIR "
                                        "--model-control-mode explicit")
    check_authorization(authorization, settings.admin_key, "the repository API")
    if settings.model_control_mode != "explicit":
        raise RepositoryControlDisabled("load and unload need --model-control-mode explicit (in poll mode the "
                                        "repository's files decide what is served)")
