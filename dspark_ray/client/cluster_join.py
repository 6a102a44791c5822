"""Which Ray cluster a command joins, and with which of Ray's credentials (docs/operations.md, "Security").

Which: the address given (`--address`, RAY_ADDRESS), else the one cluster running on this host; where this host runs
several, they are named and none is picked. Credentials: Ray 2.60 starts a cluster with token authentication
(`ray.init()` always; `ray start --head` when it finds a token, e.g. ~/.ray/auth_token), and then refuses any process
that does not send the token. Ray itself sends it only where RAY_AUTH_MODE=token is set or where it found the cluster
on its own ("auto"), never to an address named. So a process of ours that holds Ray's token sends it, whatever the
address (a cluster without token authentication ignores it), and one refused for want of it says where it goes.
"""
from __future__ import annotations

import logging
import os
import stat

AUTH_MODE = "RAY_AUTH_MODE"
RAY_TOKEN_PLACES = "~/.ray/auth_token, a file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN"


class SeveralClusters(ConnectionError):
    """This host runs more than one Ray cluster and none was named."""


def cluster_address(address: str | None) -> str | None:
    """The GCS "host:port" to join: `address`, else RAY_ADDRESS, else the only Ray cluster running on this host (None
    when none runs). SeveralClusters, naming them, when this host runs more than one; ValueError for a Ray client
    address (ray://), which has no GCS to read."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address != "auto":
        if address.startswith("ray://"):
            raise ValueError(f"{address}: a Ray client address; name the cluster's GCS (HEAD:6379)")
        from ray._private.services import canonicalize_bootstrap_address_or_die
        return canonicalize_bootstrap_address_or_die(address)
    from ray._private.services import find_gcs_addresses
    found = sorted(find_gcs_addresses())           # every raylet on this host names its cluster's GCS
    if len(found) > 1:
        raise SeveralClusters(f"this host runs {len(found)} Ray clusters ({', '.join(found)}): name the one to use "
                              f"with --address (or RAY_ADDRESS)")
    return found[0] if found else None


def use_ray_token() -> bool:
    """Send Ray's token on this process's Ray connections (and its children's) when it holds one and RAY_AUTH_MODE
    is not set; returns whether it now does. Idempotent, and silent: Ray's own warning says the same at `ray start`."""
    mode = os.environ.get(AUTH_MODE)
    if mode is not None:
        return mode.lower() == "token"
    from ray._raylet import AuthenticationTokenLoader
    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        return False
    _token_mode()
    return True


def token_for_new_cluster() -> str | None:
    """Before `ray start --head`: token authentication on, as `ray.init()` has it, with a token made (0600) where
    none is at hand; returns where it was made, or None. Leaves an explicit RAY_AUTH_MODE as it is."""
    if os.environ.get(AUTH_MODE) is not None or use_ray_token():
        return None
    from ray._private.authentication.authentication_token_setup import (_get_default_token_path,
                                                                        generate_and_save_token)
    path = _get_default_token_path()
    quiet = logging.getLogger(generate_and_save_token.__module__)     # its INFO line: the caller says where
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        generate_and_save_token()
    finally:
        quiet.setLevel(level)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)     # Ray writes it with the umask's mode, often 0644
    _token_mode()
    return str(path)


def _token_mode() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config
    os.environ[AUTH_MODE] = "token"
    Config.initialize("")                            # Ray caches its config: re-read with the mode set
    AuthenticationTokenLoader.instance().reset_cache()


def refused_by_ray(e: BaseException) -> bool:
    """Whether `e` is a cluster refusing this process's Ray token (missing or wrong)."""
    text = f"{type(e).__name__}: {e}"
    return "AuthenticationError" in text or "InvalidAuthToken" in text or "Unauthenticated" in text


def refusal(address: str) -> str:
    """What to do when the cluster at `address` refuses this process's Ray token."""
    held = "holds none" if os.environ.get(AUTH_MODE, "").lower() != "token" else "holds another"
    return (f"the Ray cluster at {address} has token authentication and this process {held} of its token: "
            f"`ray get-auth-token` on its head prints it; put it in {RAY_TOKEN_PLACES} (docs/operations.md, "
            f"\"Security\")")
