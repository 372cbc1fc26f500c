from llmserve.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
