"""kopf's login, from the cluster config the operator's own client uses (``kube.load_config``).

kopf's built-in login reads a kubeconfig's static token or client certificate, or the in-cluster token,
but runs no exec credential plugin and reads no ``tokenFile``. With this one, kopf's watches and the
operator's writes reach the same server as the same user, however the config authenticates. kopf calls
it at start and again whenever the API server answers 401, so each call gets the credentials afresh
through lightkube: an exec plugin runs again, a token file is read again.
"""

from __future__ import annotations

import kopf
from lightkube.config.models import User

from omnimodel_operator.kube import ClusterConfig, CredentialsError, authorization_header


async def authorization(user: User, server: str) -> tuple[str | None, str | None]:
    """The ``Authorization`` header for ``user``, fetched afresh, as (scheme, credentials)."""
    try:
        header = await authorization_header(user, server)
    except Exception as err:  # an exec plugin that fails or prints no token, a token file gone
        raise CredentialsError(f"getting credentials: {type(err).__name__}: {err}") from err
    if not header:
        return None, None
    scheme, _, credentials = header.partition(" ")
    return scheme, credentials or None


async def connection_info(cluster: ClusterConfig, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """What kopf needs to connect as ``cluster``'s user: server, CA, client certificate, and the
    ``Authorization`` header lightkube computes (static token, token file, exec plugin, basic auth)."""
    config = cluster.config
    server = config.cluster
    user = config.user or User()
    scheme, credentials = await authorization(user, server.server)

    def path(name: str | None) -> str | None:
        return str(config.abs_file(name)) if name else None  # relative to the kubeconfig, as kubectl reads it

    return kopf.ConnectionInfo(
        server=server.server,
        ca_path=path(server.certificate_auth),
        ca_data=server.certificate_auth_data,
        insecure=server.insecure or None,
        certificate_path=path(user.client_cert),
        certificate_data=user.client_cert_data,
        private_key_path=path(user.client_key),
        private_key_data=user.client_key_data,
        scheme=scheme,
        token=credentials,
        default_namespace=config.context.namespace,
        trust_env=trust_env,
    )
