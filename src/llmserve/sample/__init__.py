from llmserve.sample.sampler import Sampler

__all__ = ["Sampler"]
