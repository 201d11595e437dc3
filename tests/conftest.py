"""Test-session set-up: eight simulated CPU devices, before JAX starts.

Single-device code uses the first device; sharded tests build meshes of 1, 2,
4 and 8 of them.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
