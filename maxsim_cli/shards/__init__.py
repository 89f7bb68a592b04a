"""Shards of packed variable-length token embeddings: the module `maxsim_cli.shards`, as a package."""

from maxsim_cli.shards.readers import *  # noqa: F403
from maxsim_cli.shards.readers import _decode_ids as _decode_ids
