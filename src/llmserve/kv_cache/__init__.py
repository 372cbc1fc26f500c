from llmserve.kv_cache.block_pool import BlockPool, KVBlock
from llmserve.kv_cache.manager import KVCacheManager
from llmserve.kv_cache.sizing import KVCacheSpec, num_blocks_for_memory

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVCacheSpec", "num_blocks_for_memory"]
