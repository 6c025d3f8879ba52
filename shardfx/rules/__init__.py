"""Sharding rules shardfx adds to DTensor's registry, one file per op family (STYLE 6).

DTensor's own rules (``torch/distributed/tensor/_ops``) cover most ATen ops; a file here adds
the ops it lacks for the graphs we capture. Importing this package registers them.
"""

from shardfx.rules import attention, experts  # noqa: F401

# Ops answered unlike DTensor's own dispatch would (on shardfx's meshes): past its cache.
UNCACHED = attention.OPS + experts.OPS
