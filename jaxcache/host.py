"""What configures a host table: initialisers, column views, the DRAM budget,
process shares, and the vocabulary of raw ids.

``jaxcache.HostTable`` and ``jaxcache.TieredTable`` are the tables; this
module adds what configures them. ``Vocabulary`` and ``hashed_rows`` are what
``CacheConfig(vocabulary=jaxcache.DynamicVocabulary())`` runs on the host.
"""

from jaxcache._src.host_table import embed_init, normal_init, uniform_init
from jaxcache._src.placement import process_shard
from jaxcache._src.tiered_table import TableColumn, default_dram_budget
from jaxcache._src.vocabulary import Admission, Vocabulary, hashed_rows

__all__ = [
    "Admission",
    "TableColumn",
    "Vocabulary",
    "default_dram_budget",
    "embed_init",
    "hashed_rows",
    "normal_init",
    "process_shard",
    "uniform_init",
]
