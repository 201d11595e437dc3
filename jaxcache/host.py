"""What configures a host table: initialisers, column views, the DRAM budget, process shares.

``jaxcache.HostTable`` and ``jaxcache.TieredTable`` are the tables; this
module adds what configures them.
"""

from jaxcache._src.host_table import embed_init, normal_init, uniform_init
from jaxcache._src.placement import process_shard
from jaxcache._src.tiered_table import TableColumn, default_dram_budget

__all__ = [
    "TableColumn",
    "default_dram_budget",
    "embed_init",
    "normal_init",
    "process_shard",
    "uniform_init",
]
