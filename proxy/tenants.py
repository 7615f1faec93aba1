"""Per-tenant cache salts: ``pdserve proxy --api-key K1 K2 ... --cache-salt-from-api-key``.

Called by ``app._serve`` for every generation request, after ``BearerAuth`` left the index of the key the
request presented in its scope (``auth.API_KEY_INDEX``):

    salts = TenantSalts(config.api_keys, load_secret(config.cache_salt_secret_file))   # once, at start-up
    salt = salts.salt(key_index, parsed.cache_salt)    # the cache_salt the nodes and the routing keys get

A tenant is an API key. Its salt is a keyed hash of the key, and a client's own ``cache_salt`` is mixed in
(a tenant may still split its own KV further, never join another's)::

    tenant(key)        = HMAC-SHA256(secret, "pdserve-tenant\\0" + sha256(key))
    salt(key, None)    = hex(tenant(key))
    salt(key, client)  = hex(HMAC-SHA256(secret, "pdserve-tenant-salt\\0" + tenant(key) + utf8(client)))

The key never leaves the proxy, and a salt seen downstream (a node's log, a store key) gives away neither
the key nor another tenant's salt: without ``secret`` none can be computed. ``secret`` is 32 random bytes
per proxy process unless ``--cache-salt-secret-file`` names a file to read it from (then salts, hence the
tenants' prefix-cache and store hits, survive a proxy restart and agree between proxies that share it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Sequence

MIN_SECRET_BYTES = 16
_TENANT = b"pdserve-tenant\x00"
_TENANT_SALT = b"pdserve-tenant-salt\x00"


class TenantSalts:
    def __init__(self, api_keys: Sequence[str], secret: bytes):
        if not api_keys:
            raise ValueError("--cache-salt-from-api-key needs --api-key (one key per tenant)")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cache salt secret has {len(secret)} bytes; need >= {MIN_SECRET_BYTES} "
                             "(--cache-salt-secret-file)")
        self._secret = secret
        self._tenants = [self._mac(_TENANT + hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest())
                         for key in api_keys]

    def salt(self, key_index: int | None, client_salt: str | None) -> str:
        """The salt of a request that presented key ``key_index`` (set by ``BearerAuth``) and sent ``client_salt``."""
        if key_index is None or not 0 <= key_index < len(self._tenants):
            raise RuntimeError(f"no API key index on an authenticated request (got {key_index!r}): "
                               "BearerAuth must run in front of the proxy's routes")
        tenant = self._tenants[key_index]
        if client_salt is None:
            return tenant.hex()
        return self._mac(_TENANT_SALT + tenant + client_salt.encode("utf-8", "surrogatepass")).hex()

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self._secret, message, hashlib.sha256).digest()


def load_secret(path: str | None) -> bytes:
    """The bytes of ``path`` (``--cache-salt-secret-file``), or 32 random bytes for this process."""
    if path is None:
        return os.urandom(32)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise ValueError(f"--cache-salt-secret-file {path} has mode {stat.filemode(mode)}: whoever reads it "
                                 f"can compute every tenant's salt; make it readable by its owner only (chmod 600)")
            secret = f.read(1 << 16)
    except OSError as exc:
        raise ValueError(f"--cache-salt-secret-file {path}: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"--cache-salt-secret-file {path} has {len(secret)} bytes; need >= {MIN_SECRET_BYTES}")
    return secret
