"""jaxhybrid: hybrid data x model parallel training for JAX/Flax (after Pal et al. 2019)."""

from __future__ import annotations

__version__ = "0.1.0"
