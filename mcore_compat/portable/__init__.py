"""Pieces of the portable ``dp_balanced`` backend (see :mod:`mcore_compat.adapters.portable`).

``schedule`` plans bins (pure), ``samples`` reads and checks one step's raw samples, ``exchange``
holds the collectives, ``microbatch`` builds packed THD microbatches and CP views, and ``errors``
encodes problems so every rank raises the same error.
"""

__all__: list[str] = []
