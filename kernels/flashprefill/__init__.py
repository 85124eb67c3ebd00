"""FlashPrefill V2: training-free block-sparse prefill attention with mean correction."""
from .config import SparseConfig
from .index import BlockIndex, SparseStats
from .plan import BatchPlan, make_plan

__all__ = ["SparseConfig", "BlockIndex", "SparseStats", "BatchPlan", "make_plan"]
