"""Compiled host kernels, and an on-disk cache of them that several processes share safely.

Every loop the host runs per id is a numba function compiled on first use
and cached on disk, so that a process does not compile again what an
earlier one compiled. numba's own cache names each compiled version after a
counter it reads from the function's index file: two processes that compile
versions for different argument types at the same moment (the workers of
one host starting together, or a test run's parallel workers) may pick the
same number, and the index can end up pointing one version's types at the
other's machine code. A later process then runs code compiled for other
arrays (reproduced here with eight processes on a cold cache: wrong-version
entries in about one trial in eight). ``kernel`` keeps numba's cache but
names each version's file after its own key, writes the file before the
index entry, and loads only entries named so: a race can lose an index entry
(that version is compiled once more), never pair a key with another
version's code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numba
from numba.core import caching

__all__ = ["KeyedCacheFile", "kernel"]


class KeyedCacheFile(caching.IndexDataCacheFile):
    """numba's index and data files, each version's data file named after its key.

    Examples:
      >>> import tempfile
      >>> files = KeyedCacheFile(tempfile.mkdtemp(), "f-1.py311", source_stamp=0)
      >>> files.save(("int64",), b"code for int64")
      >>> files.load(("int64",)), files.load(("float32",))
      (b'code for int64', None)
    """

    def save(self, key: Any, data: Any) -> None:
        """Saves the version of ``key``: its data file, then the index entry."""
        name = self._keyed_name(key)
        self._save_data(name, data)  # atomic: a temporary file renamed
        overloads = self._load_index()
        if overloads.get(key) != name:
            overloads[key] = name
            self._save_index(overloads)

    def load(self, key: Any) -> Any:
        """The saved version of ``key``, or ``None`` (an entry not named after
        its key, such as one numba's own cache wrote, is not trusted)."""
        name = self._keyed_name(key)
        if self._load_index().get(key) != name:
            return None
        try:
            return self._load_data(name)
        except OSError:  # removed since the index was read
            return None

    def _keyed_name(self, key: Any) -> str:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
        return self._data_name_pattern.replace("{number:d}", digest)


def kernel(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled by numba without the GIL or bounds checks, cached on
    disk in ``KeyedCacheFile``s.

    Examples:
      >>> from jaxcache._src import kernels
      >>> type(kernels.place_rows._cache._cache_file).__name__
      'KeyedCacheFile'
    """
    dispatcher: Any = numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    cache = dispatcher._cache
    files = cache._cache_file
    base = files._index_name.removesuffix(".nbi")
    cache._cache_file = KeyedCacheFile(files._cache_path, base, files._source_stamp)
    return dispatcher
