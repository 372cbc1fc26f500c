from llmserve.kv_cache.block_pool import BlockPool, KVBlock
from llmserve.kv_cache.groups import KVCacheGroup, blocks_per_sequence, group_layers
from llmserve.kv_cache.manager import KVCacheManager
from llmserve.kv_cache.sizing import KVCacheSpec, num_blocks_for_memory

__all__ = ["BlockPool", "KVBlock", "KVCacheGroup", "KVCacheManager", "KVCacheSpec",
           "blocks_per_sequence", "group_layers", "num_blocks_for_memory"]
