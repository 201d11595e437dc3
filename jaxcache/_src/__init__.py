"""Private implementation; import from ``jaxcache``."""
