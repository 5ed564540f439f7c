"""How dsv4 is laid out over devices: a logical-axis table (`rules.py`) and meshes (`mesh.py`).

May import jax and flax; never the scheduler or engine. The model imports `constrain` from here.
"""

from dsv4.sharding.mesh import make_mesh, param_sharding, shard_model
from dsv4.sharding.rules import (
    REPLICATED,
    SEQUENCE_ONLY,
    SEQUENCE_PARALLEL,
    SEQUENCE_PARALLEL_ZIGZAG,
    ShardingRules,
    constrain,
    use_mesh,
)

__all__ = ["REPLICATED", "SEQUENCE_ONLY", "SEQUENCE_PARALLEL", "SEQUENCE_PARALLEL_ZIGZAG", "ShardingRules", "constrain",
           "make_mesh", "param_sharding", "shard_model", "use_mesh"]  # fmt: skip
